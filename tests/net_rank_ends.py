"""The processes of ``NetWeightSyncScheme(trainer_ranks=2)`` tests: a trainer rank that
sends its ``LocalShard`` rows of each version it is told to, and a worker that checks each
version it applies against the whole version (tear-free). Each reports on its ``out`` queue
and takes commands from its ``commands`` queue (``rank_harness.RankProcesses``)."""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from typing import Any

import torch
from rank_harness import NET_COLS, NET_ROWS, full_weights, rank_flat

import weightsync as ws

#: how long a process waits for its next command before it gives up
IDLE_S = 60.0


def _error(exc: BaseException) -> tuple[Any, ...]:
    return ("error", type(exc).__name__, getattr(exc, "rank", None),
            list(getattr(exc, "worker_ids", ()) or ()), str(exc))


def trainer_rank(scheme: Any, rank: int, timeout: float, first: int, out: Any,
                 commands: Any) -> None:
    """Rank ``rank``, registering its rows of version ``first``: ``("connect",)`` or
    ``("send", v[, timeout])`` (its rows of version ``v``) answer ``("ok", version)`` or the
    error; ``("stats",)`` answers what crossed its link for the last version;
    ``("close",)`` ends it."""
    try:
        _serve_rank(scheme, rank, timeout, first, out, commands)
    except BaseException as exc:  # reported, never lost
        out.put(("crashed", type(exc).__name__, str(exc), traceback.format_exc()))
        raise


def _serve_rank(scheme: Any, rank: int, timeout: float, first: int, out: Any,
                commands: Any) -> None:
    sender = scheme.create_sender(rank=rank)
    sender.register_model(rank_flat(rank, first))
    try:
        while True:
            command = commands.get(timeout=IDLE_S)
            if command[0] == "close":
                return
            try:
                if command[0] == "connect":
                    out.put(("ok", sender.connect(timeout=timeout)))
                elif command[0] == "stats":
                    last = sender.stats()["last"] or {}
                    out.put(("stats", {k: last.get(k) for k in ("version", "wire_bytes", "hosts")}))
                else:
                    out.put(("ok", sender.send(rank_flat(rank, command[1]),
                                               timeout=(*command, timeout)[2])))
            except ws.WeightSyncError as exc:
                out.put(_error(exc))
    finally:
        sender.close()


def matches(model: dict[str, torch.Tensor], version: int, dtype: torch.dtype | None) -> bool:
    """``model`` holds exactly version ``version`` (as cast to ``dtype`` on the wire)."""
    for name, want in full_weights(version).items():
        if dtype is not None:
            want = want.to(dtype).to(want.dtype)
        if not torch.equal(model[name], want):
            return False
    return True


def worker(scheme: Any, idx: int, timeout: float, kill: tuple[int, int] | None, out: Any,
           commands: Any) -> None:
    """Worker ``idx``: connects, then reports ``("version", v, matches)`` for each version
    it applies until told ``("close",)``; a weightsync error is reported and ends it.
    ``kill=(pid, v)``: this host's first fetch of version ``v`` starts by killing ``pid``
    (a trainer rank dies while the hosts fetch)."""
    if kill is not None:
        _kill_when_fetching(*kill)
    try:
        _work(scheme, idx, timeout, out, commands)
    except BaseException as exc:  # reported, never lost
        out.put(("crashed", type(exc).__name__, str(exc), traceback.format_exc()))
        raise


def _kill_when_fetching(pid: int, version: int) -> None:
    from weightsync.transports.net import reader

    fetch, killed = reader.fetch_packed, []

    def killing(fetcher: Any, addresses: Any, credential: str, want: int, *args: Any) -> Any:
        if want == version and not killed:
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)  # gone: its listener refuses the fetch
        return fetch(fetcher, addresses, credential, want, *args)

    reader.fetch_packed = killing  # type: ignore[assignment]


def _work(scheme: Any, idx: int, timeout: float, out: Any, commands: Any) -> None:
    model = {"bias": torch.zeros(5), "matrix": torch.zeros(NET_ROWS, NET_COLS)}
    receiver = scheme.create_receiver(idx)
    receiver.register_model(model)
    try:
        version = receiver.connect(timeout=timeout)
        out.put(("version", version, matches(model, version, scheme.dtype)))
        while True:
            try:
                if commands.get_nowait()[0] == "close":
                    return
            except queue.Empty:
                pass
            got = receiver.receive(timeout=0.2)
            if got is not None:
                out.put(("version", got, matches(model, got, scheme.dtype)))
    except ws.WeightSyncError as exc:
        out.put(_error(exc))
    finally:
        receiver.close()
