"""The rank-protocol conformance harness: two trainer ranks holding ``ws.LocalShard`` halves
of one model, each a real spawned process driven by commands, on any transport that takes
``trainer_ranks``; the test process holds one worker.

A transport is a :class:`Transport` (picklable): the scheme the ranks get, the scheme a
worker gets (what a worker could use to pose as a rank), a worker's receiver, and (where
the ranks' records lie on a board anyone inside the medium can write) a :class:`Forger`. Every
rank reports each command's outcome on its own queue: ``("ok", rank, version, seconds)``
or ``("error", rank, type, message, error_rank, seconds)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

import weightsync as ws

ROWS, COLS = 4, 3
#: how long a rank waits for its next command
IDLE_S = 120.0


def weights(rank: int, world: int, value: float, rows: int = ROWS) -> dict[str, Any]:
    """Rank ``rank``'s half of ``w`` (``rows`` x COLS globally) and, on every rank, a plain
    ``b`` (rank 0 writes it), all filled with ``value``."""
    per = rows // world
    lo, hi = rank * per, rows if rank == world - 1 else (rank + 1) * per
    return {"w": ws.LocalShard(torch.full((hi - lo, COLS), value), (rows, COLS), (lo, 0)),
            "b": torch.full((COLS,), value)}


class Model(torch.nn.Module):
    """What a worker holds: the whole ``w`` and ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(ROWS, COLS))
        self.b = torch.nn.Parameter(torch.zeros(COLS))


def uniform(model: Model) -> float:
    """The one value every element holds (a version), or fail on a mix."""
    values = torch.cat([model.w.detach().flatten(), model.b.detach().flatten()]).unique()
    assert values.numel() == 1, f"a torn or forged version: values {values.tolist()[:8]}"
    return float(values.item())


class Transport:
    """One transport's schemes and worker; subclasses say how each is made."""

    name = ""

    def rank_scheme(self) -> Any:
        """What the launcher hands a trainer rank."""
        raise NotImplementedError

    def worker_scheme(self) -> Any:
        """What a worker holds."""
        raise NotImplementedError

    def posing_scheme(self) -> Any:
        """The best a worker can make of what it holds to pose as trainer rank 1: the
        workers' copy (its token, address, directory, rendezvous name) with a rank key
        made up by itself."""
        return made_up_key(self.worker_scheme())

    def forger(self) -> Forger | None:
        """Who posts records on the ranks' board without the key (None: the medium takes
        no record from a process that has not proved the key, as SharedMem's handshake)."""
        return None

    def receiver(self) -> Any:
        raise NotImplementedError

    def worker(self) -> Any:
        """The worker the test holds (``holds(version)``, ``close()``)."""
        return Worker(self)

    def close(self) -> None:
        """Remove what the transport left behind."""


def made_up_key(scheme: Any) -> Any:
    """``scheme`` as a worker receives it (pickled), with a rank key of its own making."""
    from dataclasses import replace

    from weightsync.schemes.ranks import new_rank_key  # imported here: the harness also
    # runs against older code, to show which faults its tests catch there

    out = pickle.loads(pickle.dumps(scheme))
    out.config = replace(out.config, rank_key=new_rank_key())
    return out


#: the proof a forger puts on its records (it has no key)
FORGED_MAC = "00" * 32


def forged_hello(rank: int) -> dict[str, Any]:
    """A hello for ``rank`` from this (live) process, without the rank key's proof."""
    from weightsync.transports.ranks.liveness import process_detail
    from weightsync.transports.ranks.records import Hello, new_id

    return Hello(rank, new_id(), {}, "forged", {}, process_detail()).to_json() \
        | {"mac": FORGED_MAC}


def forged_done(rank: int, plan: dict[str, Any]) -> dict[str, Any]:
    """A done answering ``plan`` for ``rank`` (its incarnation, its attempt), without the
    rank key's proof."""
    return {"rank": rank, "incarnation": plan["incarnations"][str(rank)],
            "attempt": plan["attempt"], "detail": {"checksums": [], "error": None},
            "mac": FORGED_MAC}


class Forger:
    """Posts records on the ranks' board as a process without the rank key can."""

    def hello(self, rank: int) -> None:
        """Claim ``rank`` with a hello of this process's."""
        raise NotImplementedError

    def done(self, rank: int, timeout: float) -> str:
        """Wait for rank 0's next plan naming ``rank`` and answer it for ``rank``; returns
        its attempt."""
        raise NotImplementedError


class DirectoryForger(Forger):
    def __init__(self, path: Path) -> None:
        self.path = path

    def _open_plan(self, rank: int) -> dict[str, Any] | None:
        """Rank 0's plan naming ``rank`` that has no outcome yet."""
        with contextlib.suppress(OSError, ValueError):
            pending = json.loads((self.path / "pending.json").read_text())
            plan, decided = pending.get("plan"), {o.get("attempt") for o in pending["outcomes"]}
            if isinstance(plan, dict) and plan["attempt"] not in decided \
                    and str(rank) in plan["incarnations"]:
                return plan
        return None

    def _write(self, name: str, record: dict[str, Any]) -> None:
        tmp = self.path / f".forged-{name}"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path / name)

    def hello(self, rank: int) -> None:
        self._write(f"hello-{rank}.json", forged_hello(rank))

    def done(self, rank: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (plan := self._open_plan(rank)) is None:
            assert time.monotonic() < deadline, "rank 0 posted no plan to forge a done for"
            time.sleep(0.01)
        self._write(f"rank-{rank}.json", forged_done(rank, plan))
        return str(plan["attempt"])


class SharedMem(Transport):
    name = "shared_mem"

    def __init__(self, timeout: float) -> None:
        self.scheme = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=2,
                                                   timeout=timeout)

    def rank_scheme(self) -> Any:
        for_ranks = getattr(self.scheme, "for_trainer_ranks", None)
        return self.scheme if for_ranks is None else for_ranks()

    def worker_scheme(self) -> Any:
        return self.scheme.for_workers()  # what workers of a sharded trainer are handed

    def receiver(self) -> Any:
        return self.scheme.create_receiver(0)


class Directory(Transport):
    name = "directory"

    def __init__(self, timeout: float) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="ws-conformance-", dir="/dev/shm"))
        self.scheme = ws.VLLMDoubleBufferSyncScheme(self.path, num_workers=1, trainer_ranks=2,
                                                    timeout=timeout)

    def rank_scheme(self) -> Any:
        for_ranks = getattr(self.scheme, "for_trainer_ranks", None)
        return self.scheme if for_ranks is None else for_ranks()

    def worker_scheme(self) -> Any:
        for_workers = getattr(self.scheme, "for_workers", None)  # absent before the rank key
        return self.scheme if for_workers is None else for_workers()

    def forger(self) -> Forger:
        """A reader of the directory: it may write the directory's files (its boundary is
        the directory's permissions), but not prove the rank key."""
        return DirectoryForger(self.path)

    def receiver(self) -> Any:
        return self.worker_scheme().create_receiver(0)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def hold_rank_0(path: str) -> None:
    """Hold rank 0 inside its send of each version >= 1 (once its plan is posted, before it
    waits for the other ranks) until ``<path>.go`` exists; ``<path>.held`` says it is held."""
    from weightsync.transports.ranks import lead

    def hold(plan: Any) -> None:
        if plan.version < 1:
            return
        Path(path + ".held").write_text(str(plan.version))
        deadline = time.monotonic() + IDLE_S
        while not os.path.exists(path + ".go") and time.monotonic() < deadline:
            time.sleep(0.01)

    lead.while_ranks_write = hold


def rank_main(rank: int, world: int, scheme: Any, out: Any, commands: Any,
              rows: int = ROWS, first_value: float = 0.0, hold: str | None = None) -> None:
    """A rank that takes commands: ("connect", timeout[, value]), ("send", timeout[, value]),
    ("close",). Each version is filled with its number (the n-th send is version n; a
    restarted rank is told the value of the version it joins): a mix shows. ``hold``: see
    :func:`hold_rank_0`."""
    try:
        if hold is not None:
            hold_rank_0(hold)
        sender = scheme.create_sender(rank=rank)
        model = weights(rank, world, first_value, rows)
        sender.register_model(model)
        out.put(("ready", rank, os.getpid()))
        while True:
            command = commands.get(timeout=IDLE_S)
            if command[0] == "close":
                sender.close()
                out.put(("closed", rank))
                return
            value = float(command[2]) if len(command) > 2 else float(sender.version + 1)
            model["w"].tensor.fill_(value)
            model["b"].fill_(value)
            started = time.monotonic()
            try:
                if command[0] == "connect":
                    version = sender.connect(timeout=command[1])
                else:
                    version = sender.send(timeout=command[1])
            except Exception as exc:
                out.put(("error", rank, type(exc).__name__, str(exc), getattr(exc, "rank", None),
                         time.monotonic() - started))
                continue
            out.put(("ok", rank, version, time.monotonic() - started))
    except BaseException as exc:
        out.put(("crash", rank, type(exc).__name__, f"{exc}\n{traceback.format_exc()}", None, 0.0))


class Ranks:
    """Rank processes of one transport: ``start(r)`` (re)starts rank ``r`` (a second
    ``start`` of a live rank is a second claimant: ``key`` tells them apart)."""

    def __init__(self, transport: Transport, world: int = 2) -> None:
        self.ctx = mp.get_context("spawn")
        self.transport, self.world = transport, world
        self.procs: dict[Any, Any] = {}
        self.outs: dict[Any, Any] = {}
        self.commands: dict[Any, Any] = {}

    def start(self, rank: int, key: Any = None, scheme: Any = None, rows: int = ROWS,
              first_value: float = 0.0, hold: str | None = None) -> tuple[Any, ...]:
        """Start rank ``rank``'s process; returns its first word ("ready", or "crash" if it
        could not even create its sender)."""
        key = rank if key is None else key
        self.outs[key], self.commands[key] = self.ctx.Queue(), self.ctx.Queue()
        self.procs[key] = self.ctx.Process(target=rank_main, daemon=True, args=(
            rank, self.world, self.transport.rank_scheme() if scheme is None else scheme,
            self.outs[key], self.commands[key], rows, first_value, hold))
        self.procs[key].start()
        return self.next(key, 60)

    def tell(self, key: Any, *command: Any) -> None:
        self.commands[key].put(command)

    def next(self, key: Any, timeout: float = 60.0) -> tuple[Any, ...]:
        try:
            return tuple(self.outs[key].get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"rank {key} said nothing within {timeout} s") from None

    def kill(self, key: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[key].pid, signal.SIGKILL)
        self.procs[key].join(10)

    def signal(self, key: Any, sig: int) -> None:
        os.kill(self.procs[key].pid, sig)

    def close(self) -> None:
        for key, p in self.procs.items():
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                self.tell(key, "close")
        for p in self.procs.values():
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(5)


class Worker:
    """One worker in the test process: connects (rank 0's ``connect()`` waits for it), then
    keeps applying what comes (a transport that waits for acks needs it to)."""

    def __init__(self, transport: Transport) -> None:
        self.receiver = transport.receiver()
        self.model = Model()
        self.receiver.register_model(self.model)
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.receiver.connect(timeout=60)
            while not self.stop.is_set():
                with self.lock:
                    self.receiver.poll()
                time.sleep(0.02)
        except BaseException as exc:
            self.errors.append(exc)

    def holds(self, version: int) -> None:
        """The worker applies ``version``, whole, filled with its number."""
        deadline = time.monotonic() + 30
        while self.receiver.version < version and time.monotonic() < deadline \
                and not self.errors:
            time.sleep(0.05)
        assert not self.errors, self.errors
        with self.lock:
            assert self.receiver.version == version, (self.receiver.version, version)
            assert uniform(self.model) == float(version)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        with contextlib.suppress(Exception):  # a worker whose connect() never ended
            self.receiver.close()
