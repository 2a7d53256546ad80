"""The ends of every transport family, made directly from a scheme's config (no
``WeightSender`` / ``WeightReceiver`` around them), and the reader scripts of
``tests/transports/test_endpoints.py``. A script drives one ``WeightReader`` the way the
receive lifecycle does and reports what it saw; it runs in a worker process
(:func:`reader_process`) or in a thread of a Ray actor (``endpoint_actors.py``), so this
module imports no Ray."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import weightsync as ws
from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import WeightReader, WeightWriter
from weightsync.core.errors import (
    SchemaMismatchError,
    SenderLostError,
    WeightSyncTimeoutError,
    WorkerDroppedError,
)
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION

#: every family of writer/reader pairs, as the suite's ids name them
FAMILIES = ("shm", "shm-zero-copy", "mp", "directory", "net", "ray")
#: how long one idle ``wait`` is given in the wait script (seconds)
IDLE_WAIT = 0.3

Report = Callable[..., None]


# ---------------------------------------------------------------------- weights
def weights_of(version: int, width: int = 16, *, wide_bias: bool = False) -> dict[str, torch.Tensor]:
    """Distinct values for each version (seeded by it), of float and integer dtypes;
    ``wide_bias``: a layout whose key ``1.bias`` has another shape."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "0.weight": torch.randn(width, 8, generator=g),
        "0.bias": torch.randn(width, generator=g),
        "1.weight": torch.randn(4, width, generator=g, dtype=torch.float64),
        "1.bias": torch.randn(5 if wide_bias else 4, generator=g),
        "steps": torch.randint(0, 1 << 40, (3,), generator=g),
    }


def uniform(version: int, width: int = 16) -> dict[str, torch.Tensor]:
    """Every element of every tensor equal to ``version``, plus a 1 MB tensor: a version
    that mixes two versions' bytes shows at once."""
    flat = weights_of(0, width)
    flat["big"] = torch.empty(256, 1024)
    for t in flat.values():
        t.fill_(version)
    return flat


def digest(flat: Mapping[str, torch.Tensor]) -> str:
    """The exact bytes of every tensor, key by key."""
    h = hashlib.sha256()
    for name in sorted(flat):
        t = flat[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def all_equal(flat: Mapping[str, torch.Tensor], value: float) -> bool:
    return all(bool((t == value).all()) for t in flat.values())


# ---------------------------------------------------------------------- what a process holds
def memfd_count() -> int:
    """Anonymous shared-memory segments this process has open (``memory.memfd``)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    return count


def held() -> tuple[int, int]:
    """(weightsync's threads, memfd segments) of this process: every thread the library
    starts is named ``weightsync-*`` (other threads come and go: a queue's feeder, Ray's)."""
    ours = sum(1 for t in threading.enumerate() if t.name.startswith("weightsync"))
    return ours, memfd_count()


def settled(before: tuple[int, int], within: float = 5.0) -> tuple[int, int]:
    """What this process holds once its threads ended (at most ``within`` seconds)."""
    give_up = time.monotonic() + within
    now = held()
    while (now[0] > before[0] or now[1] > before[1]) and time.monotonic() < give_up:
        time.sleep(0.05)
        now = held()
    return now


# ---------------------------------------------------------------------- the ends
@dataclass(frozen=True)
class Ends:
    """How one family's writer (in the test process) and readers (anywhere) are made:
    ``scheme`` only carries the family's picklable config."""

    family: str
    scheme: Any

    @classmethod
    def new(cls, family: str, num_workers: int, directory: str | None = None) -> Ends:
        scheme: Any
        if family in ("shm", "shm-zero-copy"):
            scheme = ws.SharedMemWeightSyncScheme(num_workers, timeout=30)
        elif family == "mp":
            scheme = ws.MultiProcessWeightSyncScheme(num_workers, timeout=30)
        elif family == "directory":
            assert directory is not None
            scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers, timeout=30)
        elif family == "net":
            scheme = ws.NetWeightSyncScheme(num_workers, address="127.0.0.1:0", timeout=30)
        elif family == "ray":
            # the group's broadcast, Ray's own path (on one node, node_local would hand the
            # actors SharedMem's slot pool instead, which the shm families cover)
            scheme = ws.RayWeightSyncScheme(num_workers, timeout=30, node_local=False)
        else:
            raise ValueError(family)
        return cls(family, scheme)

    def writer(self) -> WeightWriter:
        c, timeout = self.scheme.config, self.scheme.peer_timeout
        if self.family in ("shm", "shm-zero-copy"):
            from weightsync.transports.shm.endpoints import SharedMemWriter

            return SharedMemWriter(c.address, c.token, c.uid, c.num_workers, max_slots=None)
        if self.family == "mp":
            from weightsync.transports.mp.endpoints import StreamWriter

            return StreamWriter(c.address, c.token, c.uid, c.num_workers, timeout=timeout)
        if self.family == "directory":
            from weightsync.transports.directory.writer import DirectoryWriter

            return DirectoryWriter(c.directory, c.num_workers, dtype=None, durable=False,
                                   mode=c.mode, poll_interval=c.poll_interval)
        if self.family == "net":
            from weightsync.transports.net.writer import NetWriter

            return NetWriter(c.address, c.token, c.num_workers, timeout=timeout, dtype=None,
                             delta=False)
        from weightsync.transports.ray.writer import RayWriter

        return RayWriter(num_workers=c.num_workers, backend=c.backend, node_local=c.node_local,
                         checksums=c.checksums, rendezvous_name=c.connection_info_name,
                         secret=c.secret, timeout=timeout)

    def named_files(self, writer: WeightWriter) -> list[str]:
        """The names in shared memory that this family's ends make while they run (the
        network readers' host stage; the others use memfd segments, which have none),
        for a started ``writer``: none may be left once both ends closed."""
        if self.family != "net":
            return []
        from weightsync.transports.net import host_stage

        c = self.scheme.config
        key = f"{c.address}/{c.token}/{writer.publisher.session}"  # type: ignore[attr-defined]
        digest = hashlib.sha256(key.encode()).hexdigest()[:24]
        return [str(host_stage._parent() / f"{host_stage.PREFIX}{os.getuid()}-{digest}")]

    def reader(self, idx: int) -> WeightReader:
        """Worker ``idx``'s reader, made in the calling process (Ray's is made by the
        actor's receiver, see ``endpoint_actors.py``)."""
        c, timeout = self.scheme.config, self.scheme.peer_timeout
        if self.family in ("shm", "shm-zero-copy", "mp"):
            from weightsync.transports.local.link import LocalLink

            link = LocalLink(c.address, c.token, c.uid, c.creator_pid, idx, timeout)
            if self.family == "mp":
                from weightsync.transports.mp.endpoints import StreamReader

                return StreamReader(link)
            from weightsync.transports.shm.endpoints import SharedMemReader

            return SharedMemReader(link, zero_copy=self.family == "shm-zero-copy")
        if self.family == "directory":
            from weightsync.transports.directory.reader import DirectoryReader

            return DirectoryReader(c.directory, idx, mode=c.mode, poll_interval=c.poll_interval)
        if self.family == "net":
            from weightsync.transports.net.reader import NetReader

            return NetReader(c.address, c.token, idx, timeout=timeout, cast=False)
        raise ValueError(f"{self.family}: its readers live in Ray actors")


# ---------------------------------------------------------------------- reader scripts
def connect(reader: WeightReader, dest: dict[str, torch.Tensor], deadline: Deadline) -> int:
    """What ``WeightReceiver.connect`` does with its reader: open, apply the first version
    delivered (waiting between looks), ack it."""
    reader.open(Layout.from_weights(dest), deadline)
    while True:
        applied = reader.apply_newest(dest, NO_VERSION, deadline)
        if applied is not None:
            reader.ack(applied)
            return applied
        if deadline.expired():
            raise WeightSyncTimeoutError(f"no {reader.expecting} within {deadline}")
        reader.wait(NO_VERSION, deadline)


def _look(reader: WeightReader, dest: dict[str, torch.Tensor], version: int) -> int | None:
    """What ``poll()`` does: a cheap look, then apply without waiting."""
    if reader.newer_available(version):
        return reader.apply_newest(dest, version, Deadline(0))
    return None


def follow(reader: WeightReader, dest: dict[str, torch.Tensor], report: Report,
           stop: Any) -> None:
    """Connect, then report every version applied (with its digest) until stopped, or until
    ``check_sender``/``wait`` says the sender is gone (reported with how long that call
    took, and when)."""
    version = connect(reader, dest, Deadline(30))
    report("applied", version, digest(dest))
    while not stop.is_set():
        try:
            applied = _look(reader, dest, version)
            if applied is not None:
                version = applied
                reader.ack(version)
                report("applied", version, digest(dest))
                continue
            t0 = time.monotonic()
            try:
                reader.check_sender(version)
            except SenderLostError as exc:
                report("sender-lost", version, str(exc), time.time(), time.monotonic() - t0)
                return
            reader.wait(version, Deadline(0.1))
        except WorkerDroppedError as exc:  # a live trainer gave up on this worker: it
            report("dropped", version, str(exc))  # joins again at its next look
        except SenderLostError as exc:  # from wait(): the same promise
            report("sender-lost", version, str(exc), time.time(), 0.0)
            return


def poller(reader: WeightReader, dest: dict[str, torch.Tensor], report: Report,
           stop: Any) -> None:
    """Connect, then loop as ``poll()`` does (look, apply, else ``check_sender``; never
    ``wait``), reporting as :func:`follow` does: the sender's loss must come from
    ``check_sender`` alone."""
    version = connect(reader, dest, Deadline(30))
    report("applied", version, digest(dest))
    while not stop.is_set():
        applied = _look(reader, dest, version)
        if applied is not None:
            version = applied
            reader.ack(version)
            report("applied", version, digest(dest))
            continue
        t0 = time.monotonic()
        try:
            reader.check_sender(version)
        except SenderLostError as exc:
            report("sender-lost", version, str(exc), time.time(), time.monotonic() - t0)
            return
        time.sleep(0.01)


def hammer(reader: WeightReader, dest: dict[str, torch.Tensor], report: Report,
           stop: Any) -> None:
    """Apply in a tight loop while versions of uniform values are published; after every
    look, every tensor must hold the one value of the version held."""
    version = connect(reader, dest, Deadline(30))
    reads = torn = applies = 0
    first_torn: tuple[int, list[float]] | None = None
    # once stopped, one more look: a version the writer counts as held may only have been
    # delivered (MultiProcess acks a version as its bytes arrive), and the next poll applies it
    last_look = False
    while not last_look:
        last_look = stop.is_set()
        applied = _look(reader, dest, version)
        if applied is not None:
            version, applies = applied, applies + 1
            reader.ack(version)
        reads += 1
        if not all_equal(dest, float(version)):
            torn += 1
            if first_torn is None:
                first_torn = (version, [float(t.flatten()[-1]) for t in dest.values()])
    report("hammer", reads, torn, applies, first_torn, version)


def waiter(reader: WeightReader, dest: dict[str, torch.Tensor], report: Report,
           stop: Any) -> None:
    """Connect; time one ``wait`` with nothing new coming; then wait (look, wait, look...)
    for the next version, report when it was seen, and apply it."""
    version = connect(reader, dest, Deadline(30))
    report("applied", version, digest(dest))
    t0 = time.monotonic()
    reader.wait(version, Deadline(IDLE_WAIT))
    report("idle", time.monotonic() - t0)
    report("waiting")
    deadline = Deadline(20)
    while not reader.newer_available(version) and not deadline.expired():
        reader.wait(version, deadline)
    report("seen", time.time(), reader.newer_available(version))
    applied = reader.apply_newest(dest, version, Deadline(10))  # the directory's writer
    if applied is not None:                                     # waits for this ack
        reader.ack(applied)
    stop.wait(30)


def mismatched(reader: WeightReader, dest: dict[str, torch.Tensor], report: Report,
               stop: Any) -> None:
    """``dest`` has another shape of ``1.bias``: connect must refuse it, naming the key;
    reported with the method that raised."""
    where = "open"
    try:
        reader.open(Layout.from_weights(dest), Deadline(30))
        where = "apply_newest"
        deadline = Deadline(30)
        while reader.apply_newest(dest, NO_VERSION, Deadline(deadline.slice(0.1))) is None \
                and not deadline.expired() and not stop.is_set():
            reader.wait(NO_VERSION, deadline)
    except SchemaMismatchError as exc:
        report("mismatch", where, exc.key, str(exc))
        stop.wait(30)
        return
    report("accepted", where)


SCRIPTS: dict[str, Callable[[WeightReader, dict[str, torch.Tensor], Report, Any], None]] = {
    "follow": follow, "poller": poller, "hammer": hammer, "waiter": waiter,
    "mismatched": mismatched,
}


def destination(script: str) -> dict[str, torch.Tensor]:
    """The worker's own tensors for ``script`` (zeros: nothing applied yet)."""
    if script == "hammer":
        return {k: torch.zeros_like(v) for k, v in uniform(0).items()}
    return {k: torch.zeros_like(v)
            for k, v in weights_of(0, wide_bias=script == "mismatched").items()}


def run_script(reader: WeightReader, dest: dict[str, torch.Tensor], script: str,
               report: Report, stop: Any, before: tuple[int, int]) -> None:
    """Run ``script``, then close the reader and report ("closed", what this process held
    before the reader was made, what it holds once the reader is closed)."""
    try:
        SCRIPTS[script](reader, dest, report, stop)
    except Exception as exc:
        report("error", type(exc).__name__, str(exc))
    finally:
        reader.close(dest)
        report("closed", before, settled(before))


def reader_process(ends: Ends, idx: int, out: Any, stop: Any, script: str) -> None:
    """A worker process (the ``Workers`` harness): worker ``idx``'s reader runs ``script``,
    each report put on this process's own queue as (event, idx, ...)."""
    torch.set_num_threads(1)
    dest = destination(script)
    before = held()
    reader = ends.reader(idx)
    run_script(reader, dest, script, lambda event, *rest: out.put((event, idx, *rest)), stop,
               before)


def writer_process(ends: Ends, idx: int, out: Any, stop: Any) -> None:
    """A writer in its own process, to be SIGKILLed: connects, sends version 1, says so,
    then waits to die."""
    writer = ends.writer()
    workers = list(range(ends.scheme.num_workers))
    deadline = Deadline(30)
    writer.start(deadline)
    send(writer, weights_of(0), 0, workers, deadline, joined=True)
    send(writer, weights_of(1), 1, workers, deadline)
    out.put(("writer-ready", idx, os.getpid()))
    stop.wait(60)


def send(writer: WeightWriter, flat: dict[str, torch.Tensor], version: int,
         workers: list[int], deadline: Deadline, *, joined: bool = False) -> dict[int, str]:
    """What ``WeightSender`` does with its writer for one version (``joined``: its
    ``connect()``, which then waits for every worker): publish, let the caller change
    ``flat`` (here: scribble on it), deliver, wait for the acks. Returns every worker
    lost on the way (a ``WorkerLostError`` raised by ``wait_acked`` counts as its list)."""
    lost = dict(writer.publish(flat, Layout.from_weights(flat), workers, version, deadline))
    with torch.no_grad():  # the snapshot was taken: the trainer's next step changes nothing
        for t in flat.values():
            t.fill_(-7)
    targets = [w for w in workers if w not in lost]
    lost |= writer.deliver(targets, version, deadline)
    if writer.needs_acks:
        try:
            writer.wait_acked([w for w in targets if w not in lost], version, deadline, lost)
        except ws.WorkerLostError as exc:
            lost |= {w: str(exc) for w in exc.worker_ids}
    if joined:
        writer.wait_joined(version, deadline)
    return lost
