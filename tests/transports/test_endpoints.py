"""One conformance suite of the writer/reader interface (``core/endpoints.py``): every
family's ``WeightWriter`` and ``WeightReader`` driven directly, the way ``WeightSender`` and
``WeightReceiver`` drive them (``endpoint_ends.send`` / ``connect``), with each reader in a
real process of its own (Ray: an actor), and the docstrings' promises checked:

- versions: each reader applies exactly the values published (a digest of every byte),
  ``held_versions()`` says what each holds, ``publish`` took a snapshot (the caller
  scribbles on its tensors once it returned);
- tear-free: a reader applying in a tight loop while versions are published never holds
  a mix of two;
- waits: a reader's ``wait`` returns by its deadline (it blocks "a short while" and raises
  no timeout of its own: ``receive()`` returns None at its deadline), and soon after a
  version arrives; ``open`` with no writer, ``wait_acked`` with a silent reader and
  ``wait_joined`` with an absent one raise ``WeightSyncTimeoutError`` (naming who) within
  the deadline;
- losses: ``check_sender`` raises ``SenderLostError`` (naming the version kept, without
  blocking) once the writer closed or was killed; a reader SIGKILLed is reported lost by the
  next version's ``publish``/``deliver``/``wait_acked``, within its deadline;
- a reader whose layout differs gets ``SchemaMismatchError`` naming the key, and so does
  the writer;
- ``close()`` on both ends leaves no thread, process, memfd segment or name in /dev/shm
  (the network readers' host stage: the other families' shared memory is memfd segments).

The seven transports of the tree, and how each is covered:

- ``shm``: ``SharedMemWriter`` with copying readers (``shm``) and zero-copy readers
  (``shm-zero-copy``, the model's tensors become views of a slot);
- ``mp``: ``StreamWriter`` / ``StreamReader``;
- ``directory``: ``DirectoryWriter`` / ``DirectoryReader``;
- ``net``: ``NetWriter`` / ``NetReader`` on loopback;
- ``ray``: ``RayWriter`` in the test process, each ``RayReader`` in an actor of one local Ray
  instance, taking each version from the group's broadcast into its staging buffers
  (``node_local=False``: on one node, the node-local path would copy out of SharedMem's
  slot pool, which the ``shm`` cases cover; ``tests/schemes/test_ray_scheme.py`` runs both);
- ``local`` (the Unix-socket hub, handshake, members and worker link) has no writer or
  reader of its own: it is the join, the acks and the loss detection of ``shm``,
  ``shm-zero-copy`` and ``mp`` (the handshake at ``open``, ``members`` in ``wait_acked`` /
  ``wait_joined`` / ``held_versions`` / ``deliver``'s losses, the link's goodbye and death
  watch in ``check_sender``): every case of those families is one of its cases;
- ``memory`` (memfd segments, the futex ring, CUDA IPC) has none either: its memfd
  segments are the slots of ``shm`` (copied out, or mapped read-only by ``shm-zero-copy``);
  the futex ring is what a SharedMem reader's ``wait`` sleeps on (the wait cases);
  ``close()`` must leave no memfd open in any process (the versions case, for every
  family). CUDA IPC needs a GPU: ``tests/schemes/test_cuda_shared_mem.py``.

Every wait has a timeout. The Ray cases share one module-scoped Ray instance.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from endpoint_ends import (
    FAMILIES,
    IDLE_WAIT,
    Ends,
    digest,
    held,
    reader_process,
    send,
    settled,
    uniform,
    weights_of,
    writer_process,
)
from stopped import stop_process
from workers import drain

import weightsync as ws
from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import WeightWriter
from weightsync.core.layout import Layout

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the families whose reader checks the layout at ``open`` (the directory's checks it
#: against the slot at the first ``apply_newest``, as its docstring says; Ray's sender
#: asks each actor's receiver before it builds the group)
OPEN_CHECKS_LAYOUT = ("shm", "shm-zero-copy", "mp", "net")


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    pytest.importorskip("ray")
    from ray_processes import local_ray_instance

    yield from local_ray_instance(TESTS_DIR)


@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.ray) if f == "ray"
                                        else f for f in FAMILIES])
def family(request: pytest.FixtureRequest) -> str:
    """Module-scoped, so that pytest runs the cases family by family (Ray's last: its
    instance, once started, would slow down the others on a small machine)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


@pytest.fixture
def make_ends(family: str) -> Iterator[Callable[[int], Ends]]:
    """``make_ends(num_workers)``: the family's ends; the directory's lives in a fresh
    directory of /dev/shm, removed after the test."""
    made: list[str] = []

    def make(num_workers: int) -> Ends:
        directory = None
        if family == "directory":
            directory = tempfile.mkdtemp(prefix="ws-endpoints-",
                                         dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            made.append(directory)
        return Ends.new(family, num_workers, directory)

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


class Readers:
    """The readers of one test, each running a script of ``endpoint_ends``: worker
    processes of the ``Workers`` harness, or Ray actors."""

    def __init__(self, ends: Ends, workers: Any, pool: list[Any] | None) -> None:
        self.ends = ends
        self.workers = workers
        self.pool = pool  # Ray: the module's actors, set up again for each test
        self.actors: dict[int, Any] = {}
        self._backlog: list[tuple[Any, ...]] = []
        self._writers: list[WeightWriter] = []

    def writer(self) -> WeightWriter:
        """The family's writer, closed at the end of the test if the test did not."""
        writer = self.ends.writer()
        self._writers.append(writer)
        return writer

    def close_writer(self, writer: WeightWriter) -> None:
        self._writers.remove(writer)
        writer.close()

    @property
    def on_ray(self) -> bool:
        return self.ends.family == "ray"

    def start(self, script: str, n: int) -> None:
        if not self.on_ray:
            for i in range(n):
                self.workers.start(reader_process, self.ends, i, script)
            return
        import ray
        from endpoint_actors import EndpointActor

        assert self.pool is not None
        while len(self.pool) < n:
            self.pool.append(EndpointActor.options(max_concurrency=4).remote())
        made = dict(enumerate(self.pool[:n]))
        ray.get([a.setup.remote(self.ends, i, script) for i, a in made.items()], timeout=60)
        self.actors.update(made)

    def attach(self, writer: WeightWriter) -> None:
        """Hand the writer its readers where it needs them (Ray: the actor handles), and
        start the scripts."""
        if self.on_ray:
            import ray

            for i, actor in self.actors.items():
                writer.members.register(i, actor)  # type: ignore[attr-defined]
            ray.get([a.run.remote() for a in self.actors.values()], timeout=30)

    def events(self, count: int, timeout: float = 30.0) -> list[tuple[Any, ...]]:
        if not self.on_ray:
            return drain(self.workers.out, count, timeout)
        import ray

        give_up = time.monotonic() + timeout
        while len(self._backlog) < count:
            if time.monotonic() > give_up:
                raise AssertionError(f"timed out waiting for {count} reports, got {self._backlog}")
            for actor in self.actors.values():
                self._backlog.extend(ray.get(actor.events.remote(), timeout=30))
            time.sleep(0.02)
        taken, self._backlog = self._backlog[:count], self._backlog[count:]
        return taken

    def events_until(self, last: tuple[Any, ...], timeout: float = 30.0) -> list[tuple[Any, ...]]:
        """Every report up to and including the first that starts with ``last``: a reader
        whose connect() found a newer version already there reports only that one."""
        give_up = time.monotonic() + timeout
        taken: list[tuple[Any, ...]] = []
        while not taken or taken[-1][:len(last)] != last:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting for a report {last}, got {taken}")
            taken += self.events(1, remaining)
        return taken

    def pid(self, idx: int) -> int:
        if not self.on_ray:
            return int(self.workers.procs[idx].pid)
        import ray

        return int(ray.get(self.actors[idx].pid.remote(), timeout=30))

    def kill(self, idx: int) -> None:
        if not self.on_ray:
            self.workers.kill(idx)
            return
        import ray

        actor = self.actors.pop(idx)
        assert self.pool is not None
        self.pool.remove(actor)  # the next test that needs it starts another
        ray.kill(actor, no_restart=True)

    def stop(self) -> None:
        """Stop every script: each closes its reader and reports ("closed", ...)."""
        if not self.on_ray:
            self.workers.stop.set()
            return
        import ray

        assert all(ray.get([a.stop.remote(10.0) for a in self.actors.values()], timeout=30))

    def finish(self, n: int, timeout: float = 30.0) -> list[tuple[Any, ...]]:
        """Stop the scripts and take every report until ``n`` readers said "closed" (each
        with nothing left in its process: no weightsync thread, no memfd segment)."""
        self.stop()
        taken: list[tuple[Any, ...]] = []
        give_up = time.monotonic() + timeout
        while sum(e[0] == "closed" for e in taken) < n:
            taken += self.events(1, max(0.1, give_up - time.monotonic()))
        for event in taken:
            if event[0] == "closed":
                _, idx, before, after = event
                assert after[0] <= before[0] and after[1] <= before[1], \
                    f"worker {idx}'s reader left threads or memfd segments: {before} -> {after}"
            assert event[0] != "error", event
        return taken

    def close(self) -> None:
        """After the test: close the writers it left open (it failed), end the actors."""
        while self._writers:
            with contextlib.suppress(Exception):
                self._writers.pop().close()
        if self.on_ray and self.actors:  # the scripts end; the actors stay for the next test
            import ray

            ray.get([a.stop.remote(10.0) for a in self.actors.values()], timeout=30)
            self.actors.clear()


@pytest.fixture(scope="module")
def ray_actors() -> list[Any]:
    """The Ray cases' actors, shared by them (an actor takes seconds to start: a worker
    process importing torch); a test that kills one has it replaced."""
    return []


@pytest.fixture
def readers(make_ends: Callable[[int], Ends], workers: Any, family: str,
            request: pytest.FixtureRequest) -> Iterator[Callable[[int], Readers]]:
    made: list[Readers] = []
    pool = request.getfixturevalue("ray_actors") if family == "ray" else None

    def make(num_workers: int) -> Readers:
        made.append(Readers(make_ends(num_workers), workers, pool))
        return made[-1]

    yield make
    for group in made:
        group.close()


def eventually(check: Callable[[], bool], within: float = 5.0) -> bool:
    give_up = time.monotonic() + within
    while not check():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.02)
    return True


def connect_writer(writer: WeightWriter, n: int, flat: dict[str, Any] | None = None,
                   timeout: float = 30.0) -> None:
    """What ``WeightSender.connect`` does: start, publish version 0, wait for every worker."""
    deadline = Deadline(timeout)
    writer.start(deadline)
    send(writer, weights_of(0) if flat is None else flat, 0, list(range(n)), deadline,
         joined=True)


# ---------------------------------------------------------------------- 1. versions, 6. close
def test_versions_arrive_whole_and_close_leaves_nothing(readers: Callable[[int], Readers]) -> None:
    group = readers(2)
    group.start("follow", 2)
    before, threads = held(), threading.active_count()
    writer = group.writer()
    group.attach(writer)
    connect_writer(writer, 2)
    named = group.ends.named_files(writer)
    assert all(os.path.exists(path) for path in named), named  # the check below can fail
    got = group.events(2)
    assert sorted(e[:4] for e in got) == [("applied", w, 0, digest(weights_of(0))) for w in (0, 1)]
    for version in (1, 2, 3):
        lost = send(writer, weights_of(version), version, [0, 1], Deadline(20))
        assert lost == {}
        got = group.events(2)
        # the values published, not the scribbles made on them once publish returned
        assert sorted(e[:4] for e in got) == [("applied", w, version, digest(weights_of(version)))
                                              for w in (0, 1)]
        assert eventually(lambda v=version: writer.held_versions() == {0: v, 1: v}), \
            writer.held_versions()
    group.finish(2)
    if not group.on_ray:
        for proc in group.workers.procs.values():
            proc.join(10)
            assert proc.exitcode == 0, proc
    group.close_writer(writer)
    after = settled(before)
    assert after[0] <= before[0], threading.enumerate()
    assert after[1] <= before[1], "the writer kept memfd segments open"
    if not group.on_ray:  # Ray's driver runs threads of its own
        assert eventually(lambda: threading.active_count() <= threads), threading.enumerate()
    assert not [path for path in named if os.path.exists(path)]
    if group.on_ray:  # close() ended the rendezvous actor
        assert eventually(lambda: not _named_actor(group.ends.scheme.connection_info_name))


def _named_actor(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------- 2. tear-free
def test_no_reader_applies_half_a_version(readers: Callable[[int], Readers]) -> None:
    group = readers(1)
    group.start("hammer", 1)
    writer = group.writer()
    group.attach(writer)
    connect_writer(writer, 1, uniform(0))
    version, t0 = 0, time.monotonic()
    while version < 100 and time.monotonic() - t0 < 3.0:
        version += 1
        assert send(writer, uniform(version), version, [0], Deadline(20)) == {}
    last = version
    assert eventually(lambda: writer.held_versions().get(0) == last, 10), writer.held_versions()
    (event, _, reads, torn, applies, first_torn, final), _closed = group.finish(1)
    assert event == "hammer", (event, reads)
    assert torn == 0, f"{torn} of {reads} looks held a torn version, first {first_torn}"
    assert applies >= 2 and final == last, (applies, final, last)
    group.close_writer(writer)


# ---------------------------------------------------------------------- 3. waits
def test_wait_returns_by_its_deadline_and_when_a_version_arrives(
        readers: Callable[[int], Readers]) -> None:
    group = readers(1)
    group.start("waiter", 1)
    writer = group.writer()
    group.attach(writer)
    connect_writer(writer, 1)
    (applied, idle, waiting) = group.events(3)
    assert applied[:3] == ("applied", 0, 0) and waiting[0] == "waiting"
    assert idle[0] == "idle" and idle[2] <= IDLE_WAIT + 0.25, f"wait took {idle[2]:.2f} s"
    time.sleep(0.3)  # the reader is waiting now
    published = time.time()
    assert send(writer, weights_of(1), 1, [0], Deadline(20)) == {}
    done = time.time()
    (event, _, seen_at, newer), = group.events(1)
    assert event == "seen" and newer, "the reader's wait loop did not see version 1"
    assert published <= seen_at <= done + 2.0, f"seen {seen_at - done:.2f} s after the send"
    group.finish(1)
    group.close_writer(writer)


def test_open_without_a_writer_times_out(make_ends: Callable[[int], Ends]) -> None:
    ends = make_ends(1)
    if ends.family == "directory":
        pytest.skip("the directory reader's open joins nothing: versions are read from the "
                    "directory whenever they are there (no writer is needed to open)")
    if ends.family == "ray":
        pytest.skip("a Ray reader's open does nothing: the sender drives each actor (layout "
                    "check, join) itself")
    reader = ends.reader(0)
    t0 = time.monotonic()
    with pytest.raises(ws.WeightSyncTimeoutError):
        reader.open(Layout.from_weights(weights_of(0)), Deadline(0.5))
    assert time.monotonic() - t0 < 2.5
    reader.close(None)


def test_wait_joined_names_an_absent_reader(make_ends: Callable[[int], Ends]) -> None:
    ends = make_ends(2)
    writer = ends.writer()
    t0 = time.monotonic()
    try:
        with pytest.raises(ws.WeightSyncTimeoutError) as info:
            # Ray's start waits for every actor's handle (its wait_joined has nothing left
            # to wait for: wait_acked collected the actors' answers)
            connect_writer(writer, 2, timeout=0.5)
        assert time.monotonic() - t0 < 2.5
        assert info.value.worker_ids == (0, 1), info.value
    finally:
        writer.close()


#: long enough for a busy reader to ack on a loaded 2-core runner (1.5 s was not, in CI)
ACK_DEADLINE_S = 4.0


def test_wait_acked_names_a_silent_reader(readers: Callable[[int], Readers]) -> None:
    group = readers(2)
    if not _needs_acks(group.ends):
        pytest.skip("SharedMem needs no acks: publishing is delivery, wait_acked has nothing "
                    "to wait for (a stalled reader cannot hold a send back)")
    group.start("follow", 2)
    writer = group.writer()
    group.attach(writer)
    connect_writer(writer, 2)
    group.events(2)
    pid = group.pid(1)
    stop_process(pid)  # stopped before version 1 is announced: it cannot stage or ack it
    try:
        deadline = Deadline(ACK_DEADLINE_S)
        t0 = time.monotonic()
        lost = writer.publish(weights_of(1), Layout.from_weights(weights_of(1)), [0, 1], 1,
                              deadline)
        assert lost == {}
        lost = writer.deliver([0, 1], 1, deadline)
        with pytest.raises(ws.WeightSyncTimeoutError) as info:
            writer.wait_acked([0, 1], 1, deadline, lost)
        assert time.monotonic() - t0 < ACK_DEADLINE_S + 1.5
        assert info.value.worker_ids == (1,), info.value
        assert lost == {}
    finally:
        os.kill(pid, signal.SIGCONT)
    assert group.events(1)[0][:3] == ("applied", 0, 1)
    late = group.events(1)[0]
    if group.on_ray and late[0] == "error":
        # Ray's collective waits no longer than the writer's deadline, on the reader's side
        # too: a reader stopped past it may find the version gone. It must say so and keep
        # what it held, never apply part of it.
        assert late[1:3] == (1, "WeightSyncError"), late
        assert "version 1 did not arrive" in late[3] and "Keeping version -1" in late[3], late
    else:
        assert late[:3] == ("applied", 1, 1), late
    group.finish(2)
    group.close_writer(writer)


def _needs_acks(ends: Ends) -> bool:
    return ends.family not in ("shm", "shm-zero-copy")


# ---------------------------------------------------------------------- 4. losses
@pytest.mark.parametrize("how", ["closed", "killed"])
@pytest.mark.parametrize("loop", ["poller", "follow"])
def test_reader_learns_that_its_writer_left(readers: Callable[[int], Readers], how: str,
                                            loop: str) -> None:
    """``loop``: as ``poll()`` does (``check_sender`` alone must say it), or as
    ``receive()`` does (``check_sender`` or ``wait``)."""
    group = readers(1)
    if how == "killed" and group.on_ray:
        pytest.skip("the Ray writer lives in the driver, which holds the test's Ray instance; "
                    "a Ray reader sees its sender gone through the rendezvous actor, which "
                    "the closed case ends")
    group.start(loop, 1)
    writer = None
    if how == "closed":
        writer = group.writer()
        group.attach(writer)
        connect_writer(writer, 1)
        assert send(writer, weights_of(1), 1, [0], Deadline(20)) == {}
    else:
        group.workers.start(writer_process, group.ends, 99)
    # version 0, then 1; or 1 alone, when the reader's connect() found it already there
    got = group.events_until(("applied", 0, 1))
    if how == "killed" and not any(e[0] == "writer-ready" for e in got):
        got += group.events_until(("writer-ready",))
    assert all(e[0] in ("applied", "writer-ready") for e in got), got
    left = time.time()
    if writer is not None:
        group.close_writer(writer)
    else:
        group.workers.kill(99)
    (event, _, version, message, at, took), = group.events(1, timeout=20)
    assert event == "sender-lost", (event, version, message)
    assert version == 1 and "version 1" in message, message  # the version the worker keeps
    assert at - left < 8.0, f"found {at - left:.1f} s after the writer left"
    assert took < 0.5, f"check_sender blocked for {took:.2f} s"
    group.finish(1)


def test_writer_reports_a_killed_reader(readers: Callable[[int], Readers]) -> None:
    group = readers(2)
    group.start("follow", 2)
    writer = group.writer()
    group.attach(writer)
    connect_writer(writer, 2)
    group.events(2)
    group.kill(1)
    deadline = Deadline(10)
    t0 = time.monotonic()
    lost = send(writer, weights_of(1), 1, [0, 1], deadline)
    assert time.monotonic() - t0 < 10
    assert set(lost) == {1} and lost[1], lost
    first = group.events(1)[0]
    if group.on_ray and first[0] == "error":
        # One collective carries the version to every actor: when it reached the dead actor
        # first, the survivor waits it out, says so and keeps what it held (docs/ray.md).
        assert first[1:3] == (0, "WeightSyncError"), first
        assert "version 1 did not arrive" in first[3] and "Keeping version -1" in first[3], first
    else:
        assert first[:4] == ("applied", 0, 1, digest(weights_of(1))), first
    assert 1 not in writer.held_versions(), writer.held_versions()
    assert send(writer, weights_of(2), 2, [0], Deadline(20)) == {}  # the survivor goes on
    assert group.events(1)[0][:4] == ("applied", 0, 2, digest(weights_of(2)))
    group.finish(1)
    group.close_writer(writer)


# ---------------------------------------------------------------------- 5. layouts
def test_a_reader_with_another_layout_is_refused_naming_the_key(
        readers: Callable[[int], Readers]) -> None:
    group = readers(1)
    group.start("mismatched", 1)
    writer = group.writer()
    group.attach(writer)
    with pytest.raises(ws.SchemaMismatchError) as info:
        connect_writer(writer, 1, timeout=20)
    assert info.value.key == "1.bias" and "1.bias" in str(info.value), info.value
    if not group.on_ray:  # a Ray actor's layout is checked by the sender, through its receiver
        (event, _, where, key, message), = group.events(1)
        assert (event, key) == ("mismatch", "1.bias") and "1.bias" in message, message
        assert where == ("open" if group.ends.family in OPEN_CHECKS_LAYOUT else "apply_newest")
    group.finish(1)
    group.close_writer(writer)

