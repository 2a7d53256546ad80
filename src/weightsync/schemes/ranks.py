"""The trainer ranks of a sharded scheme: how many (``trainer_ranks``, validated here
once for every scheme), which one a sender is for (``create_sender(rank=...)``), and the
ranks' own secret.

The rank key: ranks prove to rank 0 a secret beside the workers' token. A scheme with
``trainer_ranks > 1`` draws it when created, and its pickle carries it, so that a scheme
handed to every trainer process works as the contract shows (``create_sender(rank=r)``).
:func:`for_workers` returns the copy to hand workers: it holds no key (in this process, and
so in its pickle too), so a worker handed that copy, pickled or not (a thread, a fork),
cannot create a rank's sender, nor pass rank 0's handshake.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any, TypeVar

from weightsync.core.checks import checked_int

#: the most trainer ranks one scheme takes (each holds a connection or a file, and a slot
#: mapping)
MAX_TRAINER_RANKS = 1024

S = TypeVar("S")


def checked_trainer_ranks(value: object) -> int:
    """``trainer_ranks``: an int in ``1..MAX_TRAINER_RANKS``, or a ValueError saying so."""
    return checked_int(value, "trainer_ranks", 1, MAX_TRAINER_RANKS)


def new_rank_key() -> str:
    return secrets.token_hex(16)


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


def checked_rank_key(rank_key: str, scheme: object) -> str:
    """The rank key a rank's sender needs, or a ValueError saying how to hand it over."""
    if not rank_key:
        raise ValueError(
            f"this copy of {type(scheme).__name__} holds no rank key: it is the workers' "
            "copy (scheme.for_workers()), which cannot act as a trainer rank. Hand the "
            "trainer ranks the scheme itself, or scheme.for_trainer_ranks()")
    return rank_key


def _copy(scheme: S) -> S:
    out = object.__new__(type(scheme))  # not copy.copy: that pickles
    out.__dict__.update(vars(scheme))
    return out


def for_trainer_ranks(scheme: S) -> S:
    """A copy of ``scheme`` for the trainer ranks (its pickle carries the rank key); a
    ValueError on the workers' copy, which has none."""
    config: Any = getattr(scheme, "config", None)
    if getattr(config, "trainer_ranks", 1) > 1:
        checked_rank_key(getattr(config, "rank_key", ""), scheme)
    return _copy(scheme)


def for_workers(scheme: S) -> S:
    """A copy of ``scheme`` to hand workers: without the rank key, here as in its pickle,
    so that whoever holds it (another process, or a thread or a fork of this one) cannot
    act as a trainer rank: ``create_sender(rank=...)`` on it is a ValueError, whatever the
    rank and however it is passed. The scheme itself keeps the key."""
    out = _copy(scheme)
    config: Any = getattr(out, "config", None)
    if getattr(config, "rank_key", ""):
        out.__dict__["config"] = replace(config, rank_key="")
    return out


def pickled_state(scheme: Any) -> dict[str, Any]:
    """``scheme``'s pickled state: what it holds (the workers' copy holds no rank key)."""
    return dict(scheme.__dict__)
