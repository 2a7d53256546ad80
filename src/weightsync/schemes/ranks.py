"""Which rank of a sharded trainer a sender is created for (``create_sender(rank=...)``)."""

from __future__ import annotations


def trainer_rank(rank: int | None, trainer_ranks: int) -> int:
    """``rank``, checked to be an int in ``0..trainer_ranks-1``; None: 0 for an unsharded
    trainer, else this process's torch.distributed rank (an error if it has none)."""
    if rank is None:
        if trainer_ranks == 1:
            return 0
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"trainer_ranks={trainer_ranks}: pass create_sender(rank=r), the "
                             "rank of this trainer process in 0..trainer_ranks-1 (or call "
                             "torch.distributed.init_process_group first)")
        rank = dist.get_rank()
    if type(rank) is not int or not 0 <= rank < trainer_ranks:
        raise ValueError(f"rank must be an int in 0..{trainer_ranks - 1} "
                         f"(trainer_ranks={trainer_ranks}), got {rank!r}")
    return rank
