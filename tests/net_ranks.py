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
                first: int = 0, board: str = "") -> None:
    """Rank 1: send versions ``first .. first + versions - 1``, reporting what each send
    returned (or its error)."""
    from weightsync.transports.net.sharded import NetRankMember

    member = NetRankMember("127.0.0.1:0", rank_key, 1, dtype=torch.bfloat16, timeout=timeout,
                           delta=True, board=board)
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


class StagingClient:
    """vLLM's four-call client protocol, answered by a host receiver in this process (no
    vLLM): each init and update fetches the version from every rank and stages it in
    ``directory``, as a server host's receiver does."""

    def __init__(self, directory: Any, timeout: float) -> None:
        from weightsync.serving.host_receiver import HostReceiver

        self.host = HostReceiver(directory, 1, "fake-server", timeout)
        self.timeout = timeout
        self.info: dict[str, Any] = {}
        self.staged: dict[int, int] = {}  # trainer version -> local version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.info = dict(init_info)
        self._stage(None)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._stage(int(update_info["version"]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def _stage(self, want: int | None) -> None:
        from weightsync.serving.host_receiver import request_key

        addresses = self.info.get("addresses") or self.info["address"]
        local = self.host.stage(addresses, self.info["token"], want, request_key("k", str(want)),
                                self.timeout)
        status = (self.host.directory / "staged.json").read_text()
        import json

        self.staged[int(json.loads(status)["version"])] = local


def engine_rank(rank: int, world: int, rank_key: str, versions: int, timeout: float) -> list[int]:
    """A trainer rank > 0 of the vLLM trainer engine (``trainer_ranks=world``) whose source
    is its ``LocalShard`` rows; returns the version of each send."""
    from weightsync.integrations.vllm.backend import WeightSyncTrainerEngine, WeightSyncTrainerInitInfo

    source: dict[str, Any] = rank_flat(rank, 0)
    engine = WeightSyncTrainerEngine.trainer_init(
        WeightSyncTrainerInitInfo(rank=rank, trainer_ranks=world, rank_key=rank_key,
                                  address="127.0.0.1:0", dtype="bfloat16", delta=True,
                                  timeout=timeout),
        client=None, source=source)  # type: ignore[arg-type]  # only rank 0 calls the client
    sent = [engine.version]
    try:
        for version in range(1, versions):
            source.update(rank_flat(rank, version))
            engine.send_weights()
            sent.append(engine.version)
    finally:
        engine.shutdown()
    return sent
