"""RayWeightSyncScheme: weights to Ray actors on any host of a Ray cluster.

The trainer drives: it checks every actor's layout, builds the library's own
torch.distributed group (rendezvous published in a named Ray actor, at the node address
Ray reports), and for each send signals the actors through Ray and broadcasts the packed
buckets once for all of them; actors stage what arrives and apply it at ``poll()``. Actors
on the trainer's own node take each version out of shared memory instead (``node_local``).
When an actor dies, the send raises :class:`WorkerLostError`, and the next send rebuilds the
group from the survivors and from any replacement that announced itself.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    SchemaMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.layout import Layout
from weightsync.core.staging import StagingBuffers
from weightsync.core.stats import SendRecord
from weightsync.core.strategy import WeightStrategy
from weightsync.core.versions import NO_VERSION, VersionTable
from weightsync.schemes.base import WeightReceiver, WeightSender, WeightSyncScheme
from weightsync.transports.ray import (
    GroupInfo,
    NodeLocalInfo,
    NodeLocalSender,
    RayTransport,
    WeightGroup,
    bucket_buffers,
    node_address,
)

logger = logging.getLogger(__name__)


class Rendezvous:
    """The named Ray actor holding the group's connection info and replacement announcements."""

    def __init__(self) -> None:
        self.info: dict[str, Any] | None = None
        self.layout: dict[str, Any] | None = None
        self.announced: dict[int, Any] = {}

    def set_group(self, info: dict[str, Any], layout: dict[str, Any]) -> None:
        self.info, self.layout = info, layout

    def group_info(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return self.info, self.layout

    def announce(self, worker_idx: int, handle: Any) -> None:
        self.announced[worker_idx] = handle

    def take_announcements(self) -> dict[int, Any]:
        out, self.announced = self.announced, {}
        return out


class RayWeightSyncScheme(WeightSyncScheme):
    """Sync to ``num_workers`` Ray actors; ``backend`` is ``"gloo"`` (CPU) or ``"nccl"`` (GPU).

    ``connection_info_name`` names the rendezvous actor (unique per scheme by default).
    ``node_local`` (gloo, CPU weights): the trainer writes each version once into shared
    memory, and actors on its node copy it from there at ``poll()`` instead of taking it
    over loopback TCP; actors elsewhere (or that cannot open it) get the broadcast.
    ``False`` sends every byte through the group."""

    def __init__(
        self,
        num_workers: int = 1,
        *,
        backend: str = "gloo",
        timeout: float = 60.0,
        connection_info_name: str | None = None,
        strategy: WeightStrategy | None = None,
        node_local: bool = True,
    ) -> None:
        super().__init__(timeout=timeout, strategy=strategy)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.num_workers = num_workers
        self.backend = backend
        self.connection_info_name = connection_info_name or f"weightsync-{uuid.uuid4().hex[:12]}"
        self.node_local = bool(node_local)

    def create_sender(self, workers: Sequence[Any] | Mapping[int, Any] | None = None) -> RayWeightSender:
        """The trainer's end; ``workers`` are the actor handles, by worker index."""
        sender = RayWeightSender(self)
        if workers is not None:
            sender.register_workers(workers)
        return sender

    def create_receiver(self, worker_idx: int = 0) -> RayWeightReceiver:
        return RayWeightReceiver(self, worker_idx)


def _cause(exc: BaseException) -> BaseException:
    """The user-level exception inside a RayTaskError (or the error itself)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class RayWeightSender(WeightSender):
    """Trainer side of :class:`RayWeightSyncScheme`."""

    def __init__(self, scheme: RayWeightSyncScheme) -> None:
        import ray

        super().__init__(scheme)
        self.scheme: RayWeightSyncScheme = scheme
        self._ray = ray
        self._table = VersionTable(scheme.num_workers)
        self._handles: dict[int, Any] = {}
        self._reported: set[int] = set()  # lost and already reported: skipped until replaced
        self._members: dict[int, Any] = {}  # in the current group generation
        self._group: WeightGroup | None = None
        self._generation = 0
        self._store: Any = None
        self._address = node_address()
        self._buffers: dict[str, torch.Tensor] | None = None
        self._local: NodeLocalSender | None = None
        self._local_handles: dict[int, Any] = {}  # the actor each node-local worker is
        self._pending: tuple[int, list[int], dict[int, Any], float, dict[int, str]] | None = None
        self._lock = threading.RLock()
        self._rendezvous: Any = ray.remote(num_cpus=0)(Rendezvous).options(
            name=scheme.connection_info_name
        ).remote()

    # ------------------------------------------------------------------ workers
    def register_workers(self, workers: Sequence[Any] | Mapping[int, Any]) -> None:
        """The actor handles of the workers (a list in worker order, or {index: handle})."""
        items = workers.items() if isinstance(workers, Mapping) else enumerate(workers)
        for idx, handle in items:
            self._table.check_worker_ids([idx])
            self._handles[idx] = handle
            self._reported.discard(idx)

    def add_worker(self, worker_idx: int, handle: Any, timeout: float | None = None) -> int:
        """Bring in a (replacement) actor now and give it the current version (the last
        snapshot sent, under its own number); returns that version."""
        self.register_workers({worker_idx: handle})
        with self._lock:
            self._members.pop(worker_idx, None)
            self._group = None  # membership changed: rebuild
            if self.version == NO_VERSION:
                return NO_VERSION
            self._start(None, [worker_idx], Deadline(self.scheme.timeout if timeout is None
                                                      else timeout), resend=True)
            return self.wait_async(timeout)

    def _take_announcements(self) -> None:
        announced: dict[int, Any] = self._ray.get(
            self._rendezvous.take_announcements.remote(),  # type: ignore[attr-defined]
            timeout=self.scheme.timeout,
        )
        for idx, handle in announced.items():
            logger.info("worker %d announced a (new) actor; it joins at the next send", idx)
            self._handles[idx] = handle
            self._reported.discard(idx)
            self._members.pop(idx, None)
            self._group = None

    # ------------------------------------------------------------------ group
    def _check_layouts(self, handles: Mapping[int, Any], deadline: Deadline) -> None:
        assert self._layout is not None
        layout = self._layout.to_dict()
        refs = {w: h._weightsync_check.remote(layout) for w, h in handles.items()}
        for w, ref in refs.items():
            try:
                self._ray.get(ref, timeout=deadline.remaining())
            except self._ray.exceptions.RayActorError as exc:
                raise WorkerLostError(f"worker {w} is dead: {exc}", worker_ids=[w]) from exc
            except self._ray.exceptions.RayTaskError as exc:
                cause = _cause(exc)
                if isinstance(cause, SchemaMismatchError):
                    raise SchemaMismatchError(f"worker {w}: {cause}", key=cause.key,
                                              expected=cause.expected, got=cause.got) from exc
                raise

    def _build_group(self, deadline: Deadline) -> dict[int, str]:
        """A new group generation with every known live worker; returns {worker: why} of
        the workers that could not join."""
        assert self._layout is not None
        self._take_announcements()
        candidates = dict(sorted(self._handles.items()))
        lost: dict[int, str] = {}
        self._check_layouts_tolerant(candidates, lost, deadline)
        for w in lost:
            candidates.pop(w, None)
        local = self._attach_local(candidates, lost, deadline)
        for w in lost:
            candidates.pop(w, None)
        remote = [w for w in candidates if w not in local]
        if self._store is None:
            import datetime

            import torch.distributed as dist

            self._store = dist.TCPStore(
                self._address, 0, None, True,
                timeout=datetime.timedelta(seconds=self.scheme.timeout), wait_for_workers=False,
            )
        self._generation += 1
        info = GroupInfo(
            address=self._address, port=int(self._store.port), world_size=len(remote) + 1,
            generation=self._generation, backend=self.scheme.backend,
            ranks={w: r + 1 for r, w in enumerate(remote)},
            timeout_s=min(self.scheme.timeout, deadline.remaining() or self.scheme.timeout),
        )
        layout = self._layout.to_dict()
        self._ray.get(self._rendezvous.set_group.remote(asdict(info), layout),  # type: ignore[attr-defined]
                      timeout=deadline.remaining())
        refs = {w: h._weightsync_join.remote(asdict(info), layout) for w, h in candidates.items()}
        try:
            self._group = WeightGroup(info, 0, store=self._store)
        except RuntimeError as exc:  # someone never joined: find out who, rebuild next time
            self._group = None
            for w, ref in refs.items():
                try:
                    self._ray.get(ref, timeout=1.0)
                except Exception as err:
                    lost[w] = f"could not join the group: {_cause(err)}"
            raise WorkerLostError(
                f"the group could not be built: {exc}", worker_ids=list(lost) or list(refs)
            ) from exc
        for w, ref in refs.items():
            try:
                self._ray.get(ref, timeout=deadline.remaining())
            except Exception as err:
                lost[w] = f"failed to join: {_cause(err)}"
        self._members = {w: h for w, h in candidates.items() if w not in lost}
        for w in self._members:
            state = self._table.workers[w]
            state.connected, state.lost = True, False
        return lost

    def _attach_local(
        self, handles: Mapping[int, Any], lost: dict[int, str], deadline: Deadline
    ) -> set[int]:
        """Offer the node-local path to every actor; returns those on this node that can open
        the shared segments, which take versions from there instead of the broadcast."""
        if self._local is None:
            return set()
        info = asdict(self._local.info)
        refs = {w: h._weightsync_attach.remote(info) for w, h in handles.items()}
        local = set()
        for w, ref in refs.items():
            try:
                if self._ray.get(ref, timeout=deadline.remaining()):
                    local.add(w)
                    if self._local_handles.get(w) is not handles[w]:  # a new actor
                        self._local.detach(w)
                    self._local.attach(w)
                    self._local_handles[w] = handles[w]
                else:
                    self._local.detach(w)
            except self._ray.exceptions.RayActorError as exc:
                lost[w] = f"actor died: {type(exc).__name__}"
                self._local.detach(w)
        if local:
            logger.info("worker(s) %s share this node: they copy from shared memory", sorted(local))
        return local

    def _check_layouts_tolerant(
        self, handles: Mapping[int, Any], lost: dict[int, str], deadline: Deadline
    ) -> None:
        for w, h in handles.items():
            try:
                self._check_layouts({w: h}, deadline)
            except WorkerLostError as exc:
                lost[w] = str(exc)

    # ------------------------------------------------------------------ API
    @property
    def version(self) -> int:
        return self._table.published

    def worker_lag(self) -> dict[int, int]:
        return self._table.lag()

    def connect(self, timeout: float | None = None) -> int:
        """Wait until every worker's actor is known (handed over, or announced by actors set
        up after the sender), check their layouts, build the group, deliver version 0."""
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        while True:  # actors set up with the scheme after the sender announce themselves
            self._take_announcements()
            missing = [w for w in range(self.scheme.num_workers) if w not in self._handles]
            if not missing:
                break
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"no actor for worker(s) {missing} within {deadline.timeout}s: pass the "
                    "handles to create_sender(workers) or register_workers(), or create the "
                    "actors (weightsync_setup) after the sender", worker_ids=missing,
                )
            time.sleep(deadline.slice(0.05))
        if self._layout is None:
            self._weights_to_send(None)
        self._check_layouts(self._handles, deadline)
        if self.version == NO_VERSION:
            self.send(None, None, timeout=deadline.remaining())
        return self.version

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        self._start(weights, worker_ids, Deadline(self.scheme.timeout))

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None,
             timeout: float | None = None) -> int:
        self._start(weights, worker_ids, Deadline(self.scheme.timeout if timeout is None else timeout))
        return self.wait_async(timeout)

    def _start(
        self, weights: Any, worker_ids: int | list[int] | None, deadline: Deadline,
        resend: bool = False,
    ) -> None:
        if self._closed:
            raise RuntimeError("this sender is closed")
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        with self._lock:
            self._take_announcements()  # a replacement actor joins at the next send
        named = self._table.check_worker_ids(worker_ids)
        if worker_ids is None:
            named = [w for w in named if w not in self._reported]
        flat = None if resend else self._weights_to_send(weights)
        assert self._layout is not None
        t0 = time.perf_counter()
        with self._lock:
            if self._buffers is None and self._local is None:
                device = "cuda" if self.scheme.backend == "nccl" else "cpu"
                self._layout_on_wire = self._layout.on_device(
                    f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu")
                if self.scheme.node_local and set(self._layout.nbytes_by_device) == {"cpu"} \
                        and device == "cpu":
                    self._local = NodeLocalSender(max_slots=self.scheme.num_workers + 2)
                else:
                    self._buffers = self._layout_on_wire.allocate()
            lost: dict[int, str] = {}
            if self._group is None:
                lost.update(self._build_group(deadline))
            version = self.version if resend else self.version + 1
            t_pack = time.perf_counter()
            if self._local is not None:  # one write into shared memory: the snapshot
                local_named = [w for w in named if w in self._local.workers]
                if flat is not None:
                    self._local.publish(flat, local_named, version, deadline.remaining())
                else:
                    self._local.point_at_latest(local_named)
                buffers = self._local.latest_buffers()
            else:
                assert self._buffers is not None
                if flat is not None:
                    self._layout_on_wire.pack(flat, self._buffers)  # the snapshot
                buffers = self._buffers
            if self.scheme.backend == "nccl":
                torch.cuda.synchronize()
            pack_s = time.perf_counter() - t_pack
            local = self._local
            refs = {w: h._weightsync_receive.remote(
                        version, w in named, local.messages_for(w) if local is not None else None)
                    for w, h in self._members.items()}
            t1 = time.perf_counter()
            assert self._group is not None
            try:
                self._group.broadcast(bucket_buffers(self._layout_on_wire, buffers))
            except RuntimeError as exc:
                logger.warning("broadcast of version %d failed: %s", version, exc)
                self._group = None  # broken: rebuilt from the survivors at the next send
            self._table.published = version
            self._pending = (version, named, refs, t0, lost | {
                w: "not a member of the group" for w in named
                if w not in self._members and w not in lost
            })
            self._phases = {"pack": pack_s, "broadcast": time.perf_counter() - t1}

    def wait_async(self, timeout: float | None = None) -> int:
        if self._pending is None:
            raise RuntimeError("no send_async() is pending")
        version, named, refs, _t0, lost = self._pending
        self._pending = None
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        t0 = time.perf_counter()
        broken = self._group is None
        slow = []
        for w, ref in refs.items():
            try:
                acked = self._ray.get(ref, timeout=deadline.remaining())
                if w in named:
                    self._table.workers[w].version = int(acked)
            except self._ray.exceptions.GetTimeoutError:
                slow.append(w)
            except self._ray.exceptions.RayActorError as exc:
                lost[w] = f"actor died: {type(exc).__name__}"
                if self._local is not None:
                    self._local.detach(w)
                self._members.pop(w, None)
                self._handles.pop(w, None)
                self._table.workers[w].lost = True
            except self._ray.exceptions.RayTaskError as exc:
                if not broken:
                    raise WeightSyncError(f"worker {w} failed to take version {version}: "
                                          f"{_cause(exc)}") from exc
        self._phases["ack"] = time.perf_counter() - t0
        self._stats.add(SendRecord(version, tuple(named), self._layout.nbytes if self._layout else 0,
                                   dict(self._phases)))
        if lost:
            self._group = None
            self._reported.update(lost)
            raise WorkerLostError(
                f"lost worker(s) {sorted(lost)} while sending version {version}: "
                + "; ".join(f"worker {w}: {why}" for w, why in sorted(lost.items()))
                + ". The next send rebuilds the group from the others; a replacement actor "
                "joins then (or at once with add_worker).", worker_ids=list(lost), version=version,
            )
        if slow:
            self._group = None
            raise WeightSyncTimeoutError(
                f"worker(s) {slow} did not take version {version} within {deadline.timeout}s",
                worker_ids=slow,
            )
        if broken:
            raise WeightSyncError(f"the broadcast of version {version} failed; the group is "
                                  "rebuilt at the next send")
        return version

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._group is not None:
            self._group.close()
            self._group = None
        self._store = None
        if self._local is not None:
            self._local.close()  # actors that mapped its segments keep them until they close
            self._local = None
        with contextlib.suppress(Exception):
            self._ray.kill(self._rendezvous)  # type: ignore[arg-type]


class RayWeightReceiver(WeightReceiver):
    """The worker end, held by a Ray actor (see ``weightsync.integrations.ray``)."""

    def __init__(self, scheme: RayWeightSyncScheme, worker_idx: int) -> None:
        super().__init__(scheme, worker_idx)
        self.scheme: RayWeightSyncScheme = scheme
        self.transport = RayTransport(
            worker_idx=worker_idx, backend=scheme.backend,
            connection_info_name=scheme.connection_info_name,
        )
        self._staging: StagingBuffers | None = None
        self._arrived = threading.Condition()
        self._sender_checked = 0.0

    # -------------------------------------------------- driven by the sender (via the mixin)
    def check_layout(self, layout: dict[str, Any]) -> None:
        """Raise SchemaMismatchError naming the key if the sender's layout differs from ours."""
        Layout.from_dict(layout).check_compatible(
            Layout.from_weights(self._destination()), other_name=f"worker {self.worker_idx}"
        )

    def attach_local(self, info: dict[str, Any]) -> bool:
        """Take versions from the sender's shared memory if this actor is on the sender's
        node (see ``node_local``); True if so."""
        return self.transport.attach_local(NodeLocalInfo(**info))

    def join(self, info: dict[str, Any], layout: dict[str, Any]) -> None:
        group = GroupInfo(**info)
        if self.worker_idx in group.ranks:
            self.transport.detach_local()  # a member of the broadcast this generation
        self.transport.join(group, Layout.from_dict(layout))
        assert self.transport.layout is not None
        if self.transport.local is not None:
            self._staging = None  # poll() copies straight out of the sender's slots
        elif self._staging is None or self._staging.layout != self.transport.layout:
            self._staging = StagingBuffers(self.transport.layout)

    def take(self, version: int, keep: bool, messages: list[dict[str, Any]] | None = None) -> int:
        """Take part in the delivery of ``version``: on the sender's node, open any new
        segments it names (the version already waits in shared memory); else take the
        broadcast and stage it if the version is for us."""
        if not self.transport.joined:
            raise RuntimeError(f"worker {self.worker_idx} has not joined the group")
        local = self.transport.local
        if local is not None:
            local.take_messages(messages or [])
        else:
            group, layout = self.transport.group, self.transport.layout
            assert self._staging is not None and group is not None and layout is not None
            self._staging.fill(version, lambda b: group.broadcast(bucket_buffers(layout, b)),
                               keep)
        with self._arrived:
            self._arrived.notify_all()
        return version if keep else self._version

    # -------------------------------------------------- API
    def announce(self) -> None:
        """From inside an actor: tell the sender this actor is worker ``worker_idx`` (a
        replacement joins at the sender's next send)."""
        import ray

        handle = ray.get_runtime_context().current_actor
        rendezvous = ray.get_actor(self.scheme.connection_info_name)
        ray.get(rendezvous.announce.remote(self.worker_idx, handle), timeout=self.scheme.timeout)

    def connect(self, timeout: float | None = None) -> int:
        """Wait until the sender has delivered a version, and apply it. In a threaded actor
        (``max_concurrency`` > 1) call it any time; otherwise call it from a method that runs
        after the sender's ``connect()``."""
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        while True:
            applied = self.poll()
            if applied is not None or self._version > NO_VERSION:
                return self._version
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: nothing delivered within {deadline.timeout}s"
                )
            with self._arrived:
                self._arrived.wait(deadline.slice(0.05))

    def poll(self) -> int | None:
        """Apply the newest staged version; with nothing new, check (about once a second)
        that the sender still lives: its rendezvous actor dies with it."""
        applied = None
        if self.transport.local is not None:
            applied = self.transport.local.apply(self._destination(), self._version)
        elif self._staging is not None:
            applied = self._staging.apply(self._destination(), self._version)
        if applied is not None:
            self._version = applied
            return applied
        self._check_sender()
        return None

    def _check_sender(self) -> None:
        now = time.monotonic()
        if not self.transport.joined or now - self._sender_checked < 1.0:
            return  # not joined yet: there may be no sender so far
        self._sender_checked = now
        import ray

        try:
            ray.get_actor(self.scheme.connection_info_name)
        except ValueError:
            from weightsync.core.errors import SenderLostError

            raise SenderLostError(
                f"worker {self.worker_idx} (at version {self._version}): the sender is gone "
                f"(its rendezvous actor {self.scheme.connection_info_name!r} no longer exists)"
            ) from None

    def receive(self, timeout: float | None = 5.0) -> int | None:
        deadline = Deadline(timeout)
        while True:
            applied = self.poll()
            if applied is not None or deadline.expired():
                return applied
            with self._arrived:
                self._arrived.wait(deadline.slice(0.05))

    def close(self) -> None:
        self._closed = True
        self.transport.close()
