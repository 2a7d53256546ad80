"""The one rank harness of the sharded-trainer tests: it starts trainer ranks as real
(spawned) processes on any medium, talks to them and collects what they report. Spawned
children and Ray workers import it (PYTHONPATH); the Ray actors live beside it, in
``rank_harness_ray.py``.

- **Processes** (:class:`RankProcesses`): ranks by key, each with its own report queue and
  command queue; :class:`RankGroup`/:func:`run_ranks` run ``fn(rank, world, *args)`` in
  each and collect every rank's :class:`RankOutcome`.
- **Commanded ranks** (:class:`Ranks`, the rank-protocol conformance suite): two ranks
  holding ``ws.LocalShard`` halves, driven by commands on every medium; a medium is a
  :class:`Transport` (the scheme the ranks get, the workers' copy, a worker, a forger)
  listed in :data:`TRANSPORTS` (Ray's in ``rank_harness_ray.py``).
- **Rank bodies** per model: FSDP2 / tensor-parallel ranks on SharedMem
  (:class:`TrainingRanks`), Megatron-style blocks (:class:`BlockRanks`), ``LocalShard``
  and DTensor ranks writing a directory, and the network path's ranks.

``init_gloo(rank, world, port)`` sets up a CPU process group (for FSDP2 / DTensor models).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import pickle
import queue
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from stopped import stop_process
from torch import nn

import weightsync as ws
from weightsync.core.deadline import Deadline
from weightsync.transports.directory import sharded as directory_sharded

#: how long a rank waits for the next word (a command, a step) and a test for a rank's
TIMEOUT = 60.0


# ================================================================ processes

@dataclass
class RankOutcome:
    """What one rank returned, or raised (type name, message, ``.rank`` if the error had
    one), or that it died (``exitcode``) or was killed at the timeout (``timed_out``)."""

    rank: int
    value: Any = None
    error_type: str | None = None
    error: str = ""
    error_rank: int | None = None
    traceback: str = ""
    exitcode: int | None = None
    timed_out: bool = False
    finished: bool = False

    @property
    def ok(self) -> bool:
        return self.finished and self.error_type is None


def _report(fn: Callable[..., Any], rank: int, world: int, args: tuple[Any, ...],
            out: Any, commands: Any) -> None:
    """The body of a :class:`RankGroup` rank: ``fn``'s value or error, on ``out``."""
    try:
        value = fn(rank, world, *args)
    except BaseException as exc:  # reported, never lost
        out.put(("error", type(exc).__name__, str(exc), getattr(exc, "rank", None),
                 traceback.format_exc()))
    else:
        out.put(("ok", value))


class RankProcesses:
    """Rank processes by key (a rank, or another name for a second claimant of one), each
    with its own report queue (``outs``) and command queue; spawned from ``ctx``."""

    def __init__(self, ctx: Any = None) -> None:
        self.ctx = ctx if ctx is not None else multiprocessing.get_context("spawn")
        self.processes: dict[Any, Any] = {}
        self.outs: dict[Any, Any] = {}
        self.commands: dict[Any, Any] = {}

    def start(self, key: Any, target: Callable[..., None], *args: Any) -> Any:
        """Start ``target(*args, out, commands)`` as ``key``'s process (replacing one that
        had that key)."""
        out, commands = self.ctx.Queue(), self.ctx.Queue()
        process = self.ctx.Process(target=target, args=(*args, out, commands), daemon=True,
                                   name=f"rank-{key}")
        process.start()
        self.processes[key], self.outs[key], self.commands[key] = process, out, commands
        return process

    def tell(self, key: Any, *command: Any) -> None:
        self.commands[key].put(command)

    def tell_all(self, *command: Any) -> None:
        for key in self.processes:
            self.tell(key, *command)

    def next(self, key: Any, timeout: float = TIMEOUT) -> tuple[Any, ...]:
        """The next word of ``key``'s process, or an AssertionError after ``timeout``."""
        try:
            return tuple(self.outs[key].get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"rank {key} said nothing within {timeout} s") from None

    def kill(self, key: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.processes[key].pid, signal.SIGKILL)
        self.processes[key].join(10)

    def signal(self, key: Any, sig: int) -> None:
        """Send ``sig`` to ``key``'s process; SIGSTOP returns once it has stopped."""
        if sig == signal.SIGSTOP:
            stop_process(self.processes[key].pid)
        else:
            os.kill(self.processes[key].pid, sig)

    def stop(self, key: Any) -> None:
        """Let ``key``'s process end (2 s), else kill it."""
        process = self.processes[key]
        process.join(timeout=2)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)

    def close(self, polite: bool = False) -> None:
        """Kill every process still running; ``polite``: first wake it (SIGCONT), tell it
        ``("close",)`` and give it 3 s."""
        if polite:
            for key, process in self.processes.items():
                if process.is_alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGCONT)
                    self.tell(key, "close")
            for process in self.processes.values():
                process.join(3)
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
            process.join(5)


class RankGroup:
    """Ranks running ``fn(rank, world, *args)``; :meth:`collect` waits for them (killing
    them at the deadline)."""

    def __init__(self) -> None:
        self.ranks = RankProcesses()
        self.processes = self.ranks.processes

    def start(self, fn: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
        return self.ranks.start(rank, _report, fn, rank, world, args)

    def collect(self, timeout: float, ranks: list[int] | None = None) -> list[RankOutcome]:
        deadline = time.monotonic() + timeout
        outcomes = []
        for rank in sorted(self.processes) if ranks is None else ranks:
            process, results = self.processes[rank], self.ranks.outs[rank]
            outcome = RankOutcome(rank)
            while True:
                try:
                    item = results.get(timeout=0.1)
                except queue.Empty:
                    if not process.is_alive():  # died without a word (a second look first)
                        try:
                            item = results.get(timeout=0.5)
                        except queue.Empty:
                            outcome.exitcode = process.exitcode
                            break
                    elif time.monotonic() > deadline:
                        outcome.timed_out = True
                        break
                    else:
                        continue
                outcome.finished = True
                if item[0] == "ok":
                    outcome.value = item[1]
                else:
                    _, outcome.error_type, outcome.error, outcome.error_rank, outcome.traceback = item
                break
            outcomes.append(outcome)
        for rank in sorted(self.processes) if ranks is None else ranks:
            self.stop(rank)
        return outcomes

    def stop(self, rank: int) -> None:
        self.ranks.stop(rank)

    def kill_all(self) -> None:
        self.ranks.close()


def run_ranks(fn: Callable[..., Any], world: int, timeout: float, *args: Any) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; every rank's outcome,
    in rank order, within ``timeout`` seconds (ranks still running then are killed)."""
    group = RankGroup()
    try:
        for rank in range(world):
            group.start(fn, rank, world, *args)
        return group.collect(timeout)
    finally:
        group.kill_all()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_gloo(rank: int, world: int, port: int) -> None:
    """A gloo process group over TCP on localhost (the user's group in these tests)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


# ================================================================ commanded ranks (the conformance suite)
ROWS, COLS = 4, 3
#: how long a commanded rank waits for its next command
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


@dataclass(frozen=True)
class NetConfig:
    """The network path's ranks: their key, and where rank 0's host stages each version."""

    rank_key: str
    staged: str
    timeout: float


class NetScheme:
    """The network path to ``vllm serve`` (``NetRankLead``/``NetRankMember``, what the vLLM
    trainer engine's sharded mode drives) as a scheme the harness can hand its ranks. Rank
    0's delivery is a server host's: it fetches every rank's part from that rank's listener
    and stages the whole version in a directory, which the test's worker reads."""

    def __init__(self, config: NetConfig) -> None:
        self.config = config

    def for_trainer_ranks(self) -> NetScheme:
        return self

    def for_workers(self) -> NetScheme:
        """What a server host holds: no rank key."""
        return NetScheme(replace(self.config, rank_key=""))

    def create_sender(self, rank: int) -> NetSender:
        from weightsync.schemes.ranks import checked_rank_key

        checked_rank_key(self.config.rank_key, self)
        return NetSender(self.config, rank)


class NetSender:
    """One rank of the network path with a sender's face (``connect``, ``send``,
    ``version``): the engine's numbering, a failed round's number taken again."""

    def __init__(self, config: NetConfig, rank: int) -> None:
        from weightsync.transports.net.sharded import NetRankLead, NetRankMember

        self.config, self.rank, self.version = config, rank, -1
        self.flat: dict[str, Any] = {}
        self.staging: Any = None  # rank 0: the host's staging sender, made at the first version
        self.lead = NetRankLead("127.0.0.1:0", config.rank_key, 2, dtype=None,
                                timeout=config.timeout, delta=False) if rank == 0 else None
        self.member = None if rank == 0 else NetRankMember(
            "127.0.0.1:0", config.rank_key, rank, dtype=None, timeout=config.timeout,
            delta=False)
        self.opened = False

    def register_model(self, flat: dict[str, Any]) -> None:
        self.flat = flat

    def connect(self, timeout: float) -> int:
        return self.send(timeout) if self.version < 0 else self.version

    def send(self, timeout: float) -> int:
        deadline = Deadline(timeout)
        if self.member is not None:
            if not self.opened:
                self.member.open(deadline)
                self.opened = True
            self.version = self.member.send(self.flat, self.version + 1, deadline)
            return self.version
        assert self.lead is not None
        try:
            self.lead.send(self.flat, self.version + 1, deadline, self._deliver)
        finally:
            self.version = max(self.version, self.lead.committed)
        return self.version

    def _deliver(self, version: int, addresses: list[str]) -> None:
        from weightsync.transports.net.handshake import host_credential
        from weightsync.transports.net.sharded import host_token
        from weightsync.transports.net.sharded_fetch import ShardedFetcher

        token = host_credential(host_token(self.config.rank_key), "host-a")
        got, tensors = ShardedFetcher("host-a").fetch(addresses, token, version,
                                                      self.config.timeout)
        assert got == version, (got, version)
        if self.staging is None:
            self.staging = ws.VLLMDoubleBufferSyncScheme(
                self.config.staged, num_workers=1, timeout=self.config.timeout).create_sender()
            self.staging.register_model(tensors)
        staged = self.staging.update_weights(tensors)
        assert staged == version, (staged, version)  # each version staged once, in order

    def close(self) -> None:
        for end in (self.lead, self.member, self.staging):
            if end is not None:
                end.close()


class Net(Transport):
    name = "net"

    def __init__(self, timeout: float) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="ws-conformance-net-", dir="/dev/shm"))
        self.scheme = NetScheme(NetConfig(secrets.token_hex(32), str(self.path / "staged"),
                                          timeout))

    def rank_scheme(self) -> Any:
        return self.scheme

    def worker_scheme(self) -> Any:
        return self.scheme.for_workers()

    def receiver(self) -> Any:
        """A worker reading what the host staged."""
        staged = self.scheme.config.staged
        return ws.VLLMDoubleBufferSyncScheme(staged, num_workers=1).create_receiver(0)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class NetSchemeTransport(Transport):
    """``NetWeightSyncScheme(trainer_ranks=2)`` itself: workers over TCP, each host fetching
    every rank's part (``transports/net/sharded_writer.py``)."""

    name = "net_scheme"

    def __init__(self, timeout: float) -> None:
        self.scheme = ws.NetWeightSyncScheme(num_workers=1, trainer_ranks=2, timeout=timeout)

    def rank_scheme(self) -> Any:
        return self.scheme.for_trainer_ranks()

    def worker_scheme(self) -> Any:
        return self.scheme.for_workers()

    def receiver(self) -> Any:
        return self.worker_scheme().create_receiver(0)


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


def command_rank(rank: int, world: int, scheme: Any, rows: int, first_value: float,
                 hold: str | None, out: Any, commands: Any) -> None:
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


def preloaded_context() -> Any:
    """Rank processes forked from a server that imported torch and weightsync once: a
    spawned rank spends a second or more importing them. The server keeps the environment
    and namespaces of its first use, so it serves only ranks that need none of the test's."""
    ctx = torch_mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "weightsync.schemes", "rank_harness"])
    return ctx


class Ranks:
    """Commanded rank processes of one transport: ``start(r)`` (re)starts rank ``r`` (a
    second ``start`` of a live rank is a second claimant: ``key`` tells them apart)."""

    def __init__(self, transport: Transport, world: int = 2) -> None:
        self.transport, self.world = transport, world
        self.procs = RankProcesses(preloaded_context())
        self.outs = self.procs.outs
        self.tell, self.next = self.procs.tell, self.procs.next
        self.kill, self.signal = self.procs.kill, self.procs.signal

    def start(self, rank: int, key: Any = None, scheme: Any = None, rows: int = ROWS,
              first_value: float = 0.0, hold: str | None = None) -> tuple[Any, ...]:
        """Start rank ``rank``'s process; returns its first word ("ready", or "crash" if it
        could not even create its sender)."""
        key = rank if key is None else key
        self.procs.start(key, command_rank, rank, self.world,
                         self.transport.rank_scheme() if scheme is None else scheme, rows,
                         first_value, hold)
        return self.next(key, 60)

    def close(self) -> None:
        self.procs.close(polite=True)


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
        """Stop the loop; a ``connect()`` still waiting (no rank 0 came) is cut by the
        close (at once, not at its 60 s deadline)."""
        self.stop.set()
        with contextlib.suppress(Exception):
            self.receiver.close()
        self.thread.join(10)


#: the media of the conformance suite by name (Ray's: ``rank_harness_ray.Ray``)
TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "shared_mem": SharedMem, "directory": Directory, "net": Net,
    "net_scheme": NetSchemeTransport}


# ================================================================ SharedMem: FSDP2 / tensor-parallel ranks
def _by_value(state: dict[str, torch.Tensor]) -> bytes:
    """A state as bytes: a tensor put in a queue travels as a handle to this process's
    shared memory, which is gone if the rank exits before the test reads it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def tiny_model(how: str = "fsdp") -> torch.nn.Module:
    """FSDP2: uneven under 2 and 4 ranks (7 and 3 rows), the LayerNorm sharded too. Tensor
    parallel splits the first Linear by rows (``Shard(0)``), the second by columns
    (``Shard(1)``), and keeps the LayerNorm whole on every rank (replicated)."""
    torch.manual_seed(0)
    if how == "tp":
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3),
                                   torch.nn.LayerNorm(3))
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))


def shard(model: torch.nn.Module, world: int, how: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    elif how == "tp":  # column-parallel first Linear (Shard(0)), row-parallel last (Shard(1))
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        # the LayerNorm stays plain tensors on every rank: rank 0 writes it
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gathered model (a collective: every rank calls it), for the test to compare."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def training_rank(rank: int, world: int, port: int, scheme: Any, how: str, steps: int,
                  hooks: dict[str, Any], paced: bool, out: Any, commands: Any) -> None:
    """An FSDP2 / tensor-parallel rank on SharedMem: connect, then ``steps`` SGD steps each
    sent (rank 0, ``paced``: each step once the test says go); rank 0 reports the gathered
    model with each version."""
    import torch.distributed as dist

    go = commands if paced else None
    try:
        init_gloo(rank, world, port)
        model = shard(tiny_model(how), world, how)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sender = scheme.create_sender(rank=rank)
        sender.register_model(model)
        version = sender.connect(timeout=TIMEOUT)
        state = full_state(model)
        out.put(("version", rank, version, _by_value(state) if rank == 0 else None))
        for step in range(steps):
            if rank == 0 and go is not None:
                go.get(timeout=TIMEOUT)
            loss = model(torch.randn(4, 5)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            state = full_state(model)
            if hooks.get("stop_at") == (rank, step):
                os.kill(os.getpid(), signal.SIGSTOP if hooks.get("how") == "stop" else signal.SIGKILL)
            try:
                version = sender.send(timeout=hooks.get("send_timeout", TIMEOUT))
            except Exception as exc:  # reported, then the rank carries on
                out.put(("error", rank, type(exc).__name__, str(exc), getattr(exc, "rank", None)))
                continue
            out.put(("version", rank, version, _by_value(state) if rank == 0 else None))
        out.put(("done", rank))
        if hooks.get("linger"):
            time.sleep(hooks["linger"])
        sender.close()
        dist.destroy_process_group()
    except BaseException as exc:
        out.put(("crash", rank, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


class TrainingRanks:
    """``world`` :func:`training_rank` processes, each with its own result queue; killed at
    the end. ``step()`` lets rank 0 take its next step (``paced``)."""

    def __init__(self, scheme: Any, world: int, how: str = "fsdp", steps: int = 3,
                 hooks: dict[str, Any] | None = None, paced: bool = True) -> None:
        self.world = world
        self.procs = RankProcesses(preloaded_context())
        port = 29000 + os.getpid() % 2000
        for r in range(world):
            self.procs.start(r, training_rank, r, world, port, scheme.for_trainer_ranks(),
                             how, steps, hooks or {}, paced)

    def next(self, rank: int, timeout: float = TIMEOUT) -> tuple[Any, ...]:
        message = self.procs.next(rank, timeout)
        if message[0] == "version" and isinstance(message[3], bytes):
            return (*message[:3], torch.load(io.BytesIO(message[3])))
        return message

    def step(self) -> None:
        self.procs.tell(0, "go")

    def close(self) -> None:
        self.procs.close()


# ================================================================ SharedMem: Megatron-style ranks
BLOCK_ROWS, BLOCK_COLS = 64, 32


def block_weights(rank: int, world: int, value: float) -> dict[str, Any]:
    """Rank ``rank``'s rows of ``w`` (uneven: the last rank takes the rest) and, on every
    rank, a plain ``b`` (rank 0 writes it), all filled with ``value``."""
    per = BLOCK_ROWS // world + 1
    lo, hi = min(rank * per, BLOCK_ROWS), min((rank + 1) * per, BLOCK_ROWS)
    rows = torch.full((hi - lo, BLOCK_COLS), value)
    return {"w": ws.LocalShard(rows, (BLOCK_ROWS, BLOCK_COLS), (lo, 0)),
            "b": torch.full((BLOCK_COLS,), value)}


class BlockModel(torch.nn.Module):
    """What a worker holds: the whole ``w`` and ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(BLOCK_ROWS, BLOCK_COLS))
        self.b = torch.nn.Parameter(torch.zeros(BLOCK_COLS))


def block_rank(rank: int, world: int, scheme: Any, rows: int | None, first_value: float,
               out: Any, commands: Any) -> None:
    """A rank that takes commands: ("send", timeout), ("hammer", n), ("kill_mid_write",),
    ("stop_mid_write",), ("close",). Each send fills its block with the version it is
    about to be (the n-th send is version n), so any mix of versions shows."""
    try:
        import weightsync.transports.shm.sharded as sharded

        sender = scheme.create_sender(rank=rank)
        weights = block_weights(rank, world, first_value)  # a restarted rank: its checkpoint
        if rows is not None:  # a rank that registers another model
            weights["w"] = type(weights["w"])(torch.zeros(rows, BLOCK_COLS), (BLOCK_ROWS + rows, BLOCK_COLS),
                                               (0, 0))
        sender.register_model(weights)
        out.put(("connected", rank, sender.connect(timeout=TIMEOUT)))
        while True:
            command = commands.get(timeout=TIMEOUT)
            if command[0] == "close":
                sender.close()
                out.put(("closed", rank))
                return
            if command[0] in ("kill_mid_write", "stop_mid_write"):
                real = sharded.write_pieces
                sig = signal.SIGKILL if command[0] == "kill_mid_write" else signal.SIGSTOP

                def half_then_die(pieces: Any, views: Any, real: Any = real, sig: Any = sig) -> int:
                    sharded.write_pieces = real  # once
                    for view in views.values():  # scribble half, as a dying copy would
                        view.view(-1)[: view.numel() // 2].fill_(-1.0)
                    os.kill(os.getpid(), sig)
                    return int(real(pieces, views))

                sharded.write_pieces = half_then_die  # type: ignore[assignment]
                command = ("send", TIMEOUT)
            count = command[1] if command[0] == "hammer" else 1
            timeout = command[1] if command[0] == "send" else TIMEOUT
            for _ in range(count):
                value = float(sender.version + 1)
                weights["w"].tensor.fill_(value)
                weights["b"].fill_(value)
                try:
                    version = sender.send(timeout=timeout)
                except Exception as exc:
                    out.put(("error", rank, type(exc).__name__, str(exc), getattr(exc, "rank", None)))
                    break
                out.put(("version", rank, version))
    except BaseException as exc:
        out.put(("crash", rank, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


class BlockRanks:
    """Megatron-style ranks (no process group): ``start(r)`` (re)starts rank ``r``."""

    def __init__(self, scheme: Any, world: int) -> None:
        self.scheme, self.world = scheme, world
        self.ranks = RankProcesses(preloaded_context())
        self.procs = self.ranks.processes
        self.tell, self.tell_all, self.next = self.ranks.tell, self.ranks.tell_all, self.ranks.next
        for r in range(world):
            self.start(r)

    def start(self, rank: int, rows: int | None = None, first_value: float = 0.0) -> None:
        self.ranks.start(rank, block_rank, rank, self.world, self.scheme.for_trainer_ranks(),
                         rows, first_value)

    def close(self) -> None:
        self.ranks.close()


# ================================================================ the directory: LocalShard ranks
#: name -> (global shape, dtype, split dimension); "norm" is a plain tensor (rank 0 writes it)
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]] = {
    "w": ((7, 10), torch.float32, 0),      # rows, uneven over 2-4 ranks
    "v": ((6, 9), torch.bfloat16, 1),      # columns: strided copies, odd byte ranges
    "b": ((13,), torch.float16, 0),
    "norm": ((5,), torch.float32, None),
}


def global_weights(step: int) -> dict[str, torch.Tensor]:
    """The whole model at ``step`` (every rank computes it and keeps its own blocks)."""
    out = {}
    for i, (name, (shape, dtype, _dim)) in enumerate(SHAPES.items()):
        numel = int(torch.tensor(shape).prod()) if shape else 1
        values = torch.arange(numel, dtype=torch.float64).reshape(shape) * 0.25 + 100 * step + i
        out[name] = values.to(dtype)
    return out


def _bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(size, world)  # the first ``extra`` ranks take one more
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def local_model(step: int, rank: int, world: int, *, wrong: str = "") -> dict[str, Any]:
    """Rank ``rank``'s blocks of :func:`global_weights` as ``LocalShard`` values. ``wrong``:
    "shape" registers another global shape for "w"; "overlap" claims rank 0's rows of "w"."""
    model: dict[str, Any] = {}
    for name, full in global_weights(step).items():
        dim = SHAPES[name][2]
        if dim is None:
            model[name] = full.clone()
            continue
        lo, hi = _bounds(full.shape[dim], 0 if wrong == "overlap" and name == "w" else rank, world)
        offsets = tuple(lo if d == dim else 0 for d in range(full.dim()))
        shape = tuple(full.shape)
        if wrong == "shape" and name == "w":
            shape = (shape[0] + 1, *shape[1:])
        model[name] = ws.LocalShard(full.narrow(dim, lo, hi - lo).clone(), shape, offsets)
    return model


def _fill(model: dict[str, Any], step: int, rank: int, world: int) -> None:
    fresh = local_model(step, rank, world)
    for name, value in model.items():
        target = value.tensor if isinstance(value, ws.LocalShard) else value
        source = fresh[name].tensor if isinstance(fresh[name], ws.LocalShard) else fresh[name]
        target.copy_(source)


def _reader(directory: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    receiver = scheme.create_receiver(0)
    local = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype, _) in SHAPES.items()}
    receiver.register_model(local)
    return receiver, local


def check_read(receiver: Any, local: dict[str, torch.Tensor], version: int, step: int) -> None:
    """The reader applies ``version`` and holds exactly the model of ``step``."""
    if receiver.version != version:
        got = receiver.receive(timeout=10)
        assert got == version, (got, version)
    for name, expected in global_weights(step).items():
        assert torch.equal(local[name], expected), (name, version)


def _install_fault(rank: int, fault: dict[str, Any]) -> None:
    """Stop or kill this rank between writing its pieces and its record of a version."""
    if fault.get("rank") != rank:
        return
    original = directory_sharded.after_part_written

    def hook(r: int, version: int) -> None:
        if version == fault["version"] and not fault.get("fired"):
            fault["fired"] = True
            os.kill(os.getpid(), signal.SIGKILL if fault["how"] == "kill" else signal.SIGSTOP)
        original(r, version)

    directory_sharded.after_part_written = hook


def sharded_scheme(directory: Path, world: int, timeout: float = 30.0,
                   **options: Any) -> Any:
    """The one scheme the test hands every rank (its pickle carries the ranks' key)."""
    return ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, trainer_ranks=world,
                                         timeout=timeout, **options)


def local_shard_rank(rank: int, world: int, scheme: Any, steps: int,
                     fault: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send ``steps`` versions of :func:`local_model` through ``scheme`` (the sharded scheme
    of :func:`sharded_scheme`); rank 0 checks a reader after each. With ``fault``, a failed
    send is recorded and retried (the same step) until it works."""
    _install_fault(rank, fault or {})
    fault = fault or {}
    directory, timeout = scheme.directory, scheme.timeout
    model = local_model(0, rank, world)
    report: dict[str, Any] = {"versions": [], "errors": []}
    reader = _reader(directory) if rank == 0 else None
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(model)
        step = sender.version + 1  # a restarted rank joins after the last committed version
        report["first"] = step
        while step < steps:
            _fill(model, step, rank, world)
            t0 = time.monotonic()
            try:
                # no wait for the reader (it is in rank 0); the faulty version: a short deadline
                version = sender.update_weights(timeout=fault.get("send_timeout", timeout)
                                                if step == fault.get("version")
                                                and not report["errors"] else timeout)
            except (ws.TrainerRankLostError, ws.WeightSyncTimeoutError) as exc:
                report["errors"].append((type(exc).__name__, getattr(exc, "rank", None), str(exc),
                                         round(time.monotonic() - t0, 2), step))
                if reader is not None:  # the reader keeps the last whole version
                    assert reader[0].poll() is None
                    check_read(*reader, step - 1, step - 1)
                if len(report["errors"]) > 3:
                    raise
                continue
            report["versions"].append(version)
            if reader is not None:
                check_read(*reader, version, step)
            step += 1
    if reader is not None:
        reader[0].close()
    return report


def own_scheme_rank(rank: int, world: int, directory: Path, steps: int) -> dict[str, Any]:
    """:func:`local_shard_rank` with a scheme this process makes itself, as every rank of a
    ``torchrun`` job does: the ranks agree on the directory's own rank key."""
    return local_shard_rank(rank, world, sharded_scheme(directory, world), steps)


def wrong_layout_rank(rank: int, world: int, scheme: Any, wrong: str) -> None:
    """Rank 1 registers a model that disagrees with rank 0's (``wrong``: "shape"/"overlap")."""
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(local_model(0, rank, world, wrong=wrong if rank == 1 else ""))
        sender.update_weights()


def racing_rank(rank: int, world: int, scheme: Any, steps: int) -> list[int]:
    """Send ``steps`` versions of :func:`local_model` as fast as the others let it (no wait
    for readers): version n is the model of step n."""
    model = local_model(0, rank, world)
    versions = []
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(model)
        for step in range(sender.version + 1, steps):
            _fill(model, step, rank, world)
            versions.append(sender.update_weights())
    return versions


def hammering_reader(rank: int, world: int, directory: Path, last: int) -> list[int]:
    """Apply every version it can until ``last``; each must be exactly its step's model."""
    receiver, local = _reader(directory)
    receiver.connect(timeout=60)
    seen = [receiver.version]
    while receiver.version < last:
        version = receiver.receive(timeout=60)
        assert version is not None, f"no version after {receiver.version} within 60 s"
        for name, expected in global_weights(version).items():
            assert torch.equal(local[name], expected), (name, version)
        seen.append(version)
    receiver.close()
    return seen


# ================================================================ DTensor ranks (FSDP2, tensor parallel)
def mlp(hidden: int = 13) -> nn.Sequential:
    """Odd sizes, so FSDP2 splits rows unevenly over 2 and 4 ranks."""
    return nn.Sequential(nn.Linear(10, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, 7))


def tp_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 37), nn.ReLU(), nn.Linear(37, 48), nn.LayerNorm(48))


def _compare(receiver: Any, local: nn.Module, full: dict[str, torch.Tensor], version: int) -> float:
    """Apply ``version`` in the reader; the largest difference from the gathered model."""
    if receiver.version != version:
        assert receiver.receive(timeout=20) == version
    state = local.state_dict()
    assert set(state) == set(full), (sorted(state), sorted(full))
    return max(float((state[n].float() - t.to(state[n].dtype).float()).abs().max())
               for n, t in full.items())


def _run(rank: int, world: int, scheme: Any, model: nn.Module, reader_model: nn.Module,
         steps: int, step_fn: Any) -> dict[str, Any]:
    """``steps`` versions through ``scheme`` (the one sharded scheme every rank is handed)."""
    receiver = None
    if rank == 0:
        receiver = scheme.create_receiver(0)
        receiver.register_model(reader_model)
    diffs, versions = [], []
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(model)
        for step in range(steps):
            if step:
                step_fn(step)
            version = sender.update_weights()
            versions.append(version)
            full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t
                    for n, t in model.state_dict().items()}  # the test gathers, not weightsync
            if receiver is not None:
                diffs.append(_compare(receiver, reader_model, full, version))
    if receiver is not None:
        receiver.close()
    return {"versions": versions, "diffs": diffs}


def fsdp_mlp(rank: int, world: int) -> tuple[nn.Module, Any]:
    """The :func:`mlp` under FSDP2 (``fully_shard`` per layer and at the root, in this
    rank's gloo group) and ``train(step)``: one SGD step on this rank's batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = mlp()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(step: int) -> None:
        x = torch.randn(8, 10, generator=torch.Generator().manual_seed(step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, train


def fsdp_rank(rank: int, world: int, scheme: Any, port: int, steps: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` per layer and at the root) trained with SGD on CPU/gloo."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        model, train = fsdp_mlp(rank, world)
        return _run(rank, world, scheme, model, mlp(), steps, train)
    finally:
        dist.destroy_process_group()


def tp_parallel(world: int) -> nn.Module:
    """The :func:`tp_model` under tensor parallelism in this rank's gloo group: a colwise
    (``Shard(0)``) and a rowwise (``Shard(1)``) Linear, their biases ``Shard(0)`` /
    ``Replicate()``, and a LayerNorm replicated by ``distribute_tensor``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = tp_model()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    norm = model[3]
    for name, param in list(norm.named_parameters()):
        norm.register_parameter(name, nn.Parameter(
            distribute_tensor(param.data, mesh, [Replicate()])))
    return model


def tp_rank(rank: int, world: int, scheme: Any, port: int, steps: int) -> dict[str, Any]:
    """Tensor parallel (:func:`tp_parallel`), sent cast to bfloat16 (``scheme``'s dtype)."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        model = tp_parallel(world)

        @torch.no_grad()
        def update(step: int) -> None:
            for param in model.parameters():
                param.mul_(0.9).add_(0.01 * step)

        return _run(rank, world, scheme, model, tp_model().to(torch.bfloat16), steps, update)
    finally:
        dist.destroy_process_group()


def fsdp_llama_rank(rank: int, world: int, scheme: Any, port: int,
                    steps: int) -> dict[str, Any] | None:
    """A tiny Llama (``vllm_model``) sharded with FSDP2 per decoder layer; version ``s`` holds
    ``vllm_model.perturb`` steps 1..s applied to the seed model. Rank 0 returns the gathered
    state of the last version (gathered by the test, for the comparison only)."""
    import torch.distributed as dist
    import vllm_model as vm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    init_gloo(rank, world, port)
    try:
        reference = vm.build_model()  # every rank computes the same plain model
        model = vm.build_model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with scheme.create_sender(rank=rank) as sender:
            sender.register_model(model)
            for step in range(steps):
                if step:
                    vm.perturb(reference, step)
                    with torch.no_grad():
                        full = dict(reference.named_parameters())
                        for name, param in model.named_parameters():
                            param.copy_(distribute_tensor(full[name].detach(), param.device_mesh,
                                                          param.placements))
                sender.update_weights()
            gathered = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy()
                        for n, t in model.state_dict().items()}  # numpy: pickled by value
        return gathered if rank == 0 else None
    finally:
        dist.destroy_process_group()


# ================================================================ the network path
NET_ROWS, NET_COLS = 8, 3000  # 2 ranks x 4 rows; big enough for a few chunks in float32


def full_weights(version: int) -> dict[str, torch.Tensor]:
    """What version ``version`` holds, whole (the test's reference)."""
    gen = torch.Generator().manual_seed(1234)
    matrix = torch.randn(NET_ROWS, NET_COLS, generator=gen)
    matrix[:, :10] += version  # a small change per version: deltas stay small
    return {"matrix": matrix, "bias": torch.arange(5, dtype=torch.float32) + version}


def rank_flat(rank: int, version: int) -> dict[str, Any]:
    """Rank ``rank``'s registration of version ``version``: its rows, and (rank 0) the
    plain bias whole."""
    full = full_weights(version)
    rows = NET_ROWS // 2
    flat: dict[str, Any] = {"matrix": ws.LocalShard(full["matrix"][rank * rows:(rank + 1) * rows],
                                                    (NET_ROWS, NET_COLS),
                                                    (rank * rows, 0))}
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
