"""Rank processes of a sharded trainer on the network transport (spawned children import
this module): rank ``r`` of 2 holds rows ``[r * 4, r * 4 + 4)`` of every version's matrix
as a ``ws.LocalShard`` and serves them from its own listener."""

from __future__ import annotations

from typing import Any

import torch

import weightsync as ws
from weightsync.core.deadline import Deadline

ROWS, COLS = 8, 3000  # 2 ranks x 4 rows; big enough for a few chunks in float32


def full_weights(version: int) -> dict[str, torch.Tensor]:
    """What version ``version`` holds, whole (the test's reference)."""
    gen = torch.Generator().manual_seed(1234)
    matrix = torch.randn(ROWS, COLS, generator=gen)
    matrix[:, :10] += version  # a small change per version: deltas stay small
    return {"matrix": matrix, "bias": torch.arange(5, dtype=torch.float32) + version}


def rank_flat(rank: int, version: int) -> dict[str, Any]:
    """Rank ``rank``'s registration of version ``version``: its rows, and (rank 0) the
    plain bias whole."""
    full = full_weights(version)
    rows = ROWS // 2
    flat: dict[str, Any] = {"matrix": ws.LocalShard(full["matrix"][rank * rows:(rank + 1) * rows],
                                                    (ROWS, COLS), (rank * rows, 0))}
    flat["bias"] = full["bias"]  # plain: rank 0 writes it
    return flat


def member_main(rank_key: str, versions: int, timeout: float, results: Any,
                first: int = 0) -> None:
    """Rank 1: send versions ``first .. first + versions - 1``, reporting what each send
    returned (or its error)."""
    from weightsync.transports.net.sharded import NetRankMember

    member = NetRankMember("127.0.0.1:0", rank_key, 1, dtype=torch.bfloat16, timeout=timeout,
                           delta=True)
    try:
        member.open(Deadline(timeout))
        for version in range(first, first + versions):
            try:
                results.put(("sent", member.send(rank_flat(1, version), version,
                                                 Deadline(timeout))))
            except ws.WeightSyncError as exc:
                results.put(("error", type(exc).__name__, getattr(exc, "rank", None), str(exc)))
    except BaseException as exc:
        results.put(("error", type(exc).__name__, getattr(exc, "rank", None), str(exc)))
    finally:
        member.close()
