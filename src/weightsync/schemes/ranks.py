"""The trainer ranks of a sharded scheme: how many (``trainer_ranks``, validated here
once for every scheme), which one a sender is for (``create_sender(rank=...)``), and the
ranks' own secret.

The rank key: ranks prove to rank 0 a secret that workers never receive. A scheme with
``trainer_ranks > 1`` draws a rank key beside the workers' token and leaves it out of its
pickle; only :func:`for_trainer_ranks`'s copy carries it, once (a copy unpickled from it
drops it again when pickled). So a worker handed the scheme cannot create a rank's sender,
nor pass rank 0's handshake.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any, TypeVar

from weightsync.core.checks import checked_int

#: the most trainer ranks one scheme takes (each holds a connection or a file, and a slot
#: mapping)
MAX_TRAINER_RANKS = 1024

#: the attribute a copy for the ranks carries (never pickled: set on the copy only)
_TRAVELS = "_rank_key_travels"

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
            f"this copy of {type(scheme).__name__} holds no rank key: it was pickled as "
            "workers get it. Hand the trainer ranks scheme.for_trainer_ranks() instead "
            "(workers never receive the key, so they cannot act as a rank)")
    return rank_key


def for_trainer_ranks(scheme: S) -> S:
    """A copy of ``scheme`` whose pickle carries the rank key (to the ranks only)."""
    config: Any = getattr(scheme, "config")  # noqa: B009
    if config.trainer_ranks > 1:
        checked_rank_key(getattr(config, "rank_key", ""), scheme)
    out = object.__new__(type(scheme))  # not copy.copy: that pickles, which drops the key
    out.__dict__.update(vars(scheme))
    setattr(out, _TRAVELS, True)
    return out


def pickled_state(scheme: Any) -> dict[str, Any]:
    """``scheme``'s pickled state: without the rank key unless it is the ranks' copy."""
    state = dict(scheme.__dict__)
    travels = bool(state.pop(_TRAVELS, False))
    if not travels and str(getattr(scheme.config, "rank_key", "")):
        state["config"] = replace(scheme.config, rank_key="")
    return state
