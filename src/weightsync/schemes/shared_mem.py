"""SharedMemWeightSyncScheme: workers on this host read versions out of shared memory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from weightsync.core.checks import checked_int
from weightsync.core.strategy import WeightStrategy
from weightsync.schemes.local import LocalScheme, SameHostConfig
from weightsync.schemes.ranks import (
    checked_rank_key,
    checked_trainer_ranks,
    new_rank_key,
    trainer_rank,
)
from weightsync.schemes.receiver import WeightReceiver
from weightsync.schemes.sender import WeightSender
from weightsync.transports.ranks.member import MemberWriter
from weightsync.transports.shm.endpoints import SharedMemReader, SharedMemWriter
from weightsync.transports.shm.sharded import RankZeroWriter, rank_writer
from weightsync.transports.shm.slots import MAX_SLOTS, MAX_WORKERS


@dataclass(frozen=True)
class SharedMemConfig(SameHostConfig):
    """The same-host settings, plus the slot pool's cap and the receivers' default mode."""

    max_slots: int | None = None
    zero_copy: bool = False
    #: how many processes of a sharded trainer write each version (``shm/sharded.py``)
    trainer_ranks: int = 1
    #: what the ranks prove to rank 0 (never the workers' token; not pickled to workers:
    #: ``schemes/ranks.py``)
    rank_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_workers > MAX_WORKERS:
            raise ValueError(f"num_workers must be at most {MAX_WORKERS} for SharedMem (the size of "
                             f"its control block), got {self.num_workers}")
        if self.max_slots is not None:
            checked_int(self.max_slots, "max_slots", 2, MAX_SLOTS)
        elif self.num_workers + 2 > MAX_SLOTS:
            raise ValueError(f"num_workers={self.num_workers} needs max_slots <= {MAX_SLOTS}; "
                             f"pass max_slots= explicitly")
        object.__setattr__(self, "zero_copy", bool(self.zero_copy))
        checked_trainer_ranks(self.trainer_ranks)


class SharedMemWeightSyncScheme(LocalScheme):
    """Sync through shared memory: one packed write per send, whatever the worker count.

    ``max_slots`` caps the copies kept in shared memory (default ``num_workers + 2``, plus
    one per zero-copy receiver, which pins the slot it views: enough that a send never
    waits for a worker that is behind; two are used in steady state).
    ``zero_copy`` is the default of ``create_receiver(i, zero_copy=None)``.
    ``trainer_ranks``: how many processes of a sharded trainer (FSDP2, tensor parallel)
    write each version, each its own shards (``create_sender(rank=r)`` in each; see
    docs/sharded.md); workers are unchanged.
    """

    def __init__(
        self, num_workers: int = 1, *, timeout: float = 60.0,
        strategy: WeightStrategy | None = None, max_slots: int | None = None,
        zero_copy: bool = False, trainer_ranks: int = 1,
    ) -> None:
        super().__init__(num_workers, timeout=timeout, strategy=strategy)
        self.config: SharedMemConfig = SharedMemConfig(
            **asdict(self.config), max_slots=max_slots, zero_copy=zero_copy,
            trainer_ranks=trainer_ranks,
            rank_key=new_rank_key() if checked_trainer_ranks(trainer_ranks) > 1 else "")

    max_slots = property(lambda self: self.config.max_slots)
    zero_copy = property(lambda self: self.config.zero_copy)
    trainer_ranks = property(lambda self: self.config.trainer_ranks)


    def create_sender(self, rank: int | None = None) -> WeightSender:
        """The trainer's end; with ``trainer_ranks > 1``, rank ``rank``'s (default: this
        process's torch.distributed rank), which registers its own shards. Needs the rank
        key: the scheme as created or pickled, not the copy :meth:`for_workers` makes."""
        c = self.config
        rank = trainer_rank(rank, c.trainer_ranks)
        writer: RankZeroWriter | MemberWriter | SharedMemWriter
        if c.trainer_ranks == 1:
            writer = SharedMemWriter(c.address, c.token, c.uid, c.num_workers,
                                     max_slots=self.max_slots)
        elif rank == 0:
            writer = RankZeroWriter(c.address, c.token, checked_rank_key(c.rank_key, self), c.uid,
                                    c.num_workers, self.max_slots, c.trainer_ranks)
        else:
            writer = rank_writer(c.address, checked_rank_key(c.rank_key, self), c.uid, rank)
        return WeightSender(self, writer, c.num_workers)

    def create_receiver(self, worker_idx: int = 0, zero_copy: bool | None = None) -> WeightReceiver:
        """The end for worker ``worker_idx``. ``zero_copy=True``: the model's weights become
        read-only views into the shared slot of the version it holds, switched to the
        newest at ``poll()``/``receive()`` (microseconds, whatever the size; still
        tear-free); ``close()`` gives the model its own copy of the version it holds."""
        reader = SharedMemReader(self._link(worker_idx),
                                 zero_copy=self.zero_copy if zero_copy is None else zero_copy)
        return WeightReceiver(self, worker_idx, reader)
