"""The trainer's end of the Ray scheme.

For each send the trainer packs one snapshot, signals every actor through Ray and
broadcasts the packed buckets (with their checksums) once for all actors on other nodes;
actors on its own node take the version from shared memory. One deadline covers the whole
call: group building, the broadcast (its timeout follows the deadline) and the answers. An
actor that dies becomes :class:`WorkerLostError`, one that does not answer in time
:class:`WeightSyncTimeoutError`, both naming it; the next send rebuilds the group without it
(and tries a silent one again), so the others keep receiving.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.stats import SendRecord
from weightsync.core.versions import NO_VERSION, VersionTable
from weightsync.schemes.base import WeightSender
from weightsync.schemes.ray_answers import Answers, collect_answers
from weightsync.transports.ray_group import (
    GroupInfo,
    WeightGroup,
    bucket_buffers,
    current_node_id,
    node_address,
    wire_device,
)
from weightsync.transports.ray_local import NodeLocalSender

if TYPE_CHECKING:
    from weightsync.schemes.ray import RayWeightSyncScheme

logger = logging.getLogger(__name__)

# Shares of the time left that a step may take, so that a silent actor in one step still
# leaves time to collect the others' answers (and blame only the silent one).
_CHECK_SHARE = 0.5
_BROADCAST_SHARE = 0.8
_ANNOUNCE_SHARE = 0.25


def _share(deadline: Deadline, share: float) -> float | None:
    left = deadline.remaining()
    return None if left is None else left * share


@dataclass
class Pending:
    """A send started (snapshot taken, broadcast done) whose answers are not collected yet."""

    version: int
    named: list[int]
    refs: dict[int, Any]
    dead: dict[int, str]
    silent: dict[int, str]
    broadcast_error: str | None


class RayWeightSender(WeightSender):
    """Trainer side of :class:`RayWeightSyncScheme`."""

    def __init__(self, scheme: RayWeightSyncScheme) -> None:
        import ray

        from weightsync.schemes.ray import Rendezvous

        super().__init__(scheme)
        self.scheme: RayWeightSyncScheme = scheme
        self._ray = ray
        self._table = VersionTable(scheme.num_workers)
        self._handles: dict[int, Any] = {}
        self._reported: set[int] = set()  # dead or silent, already reported
        self._members: dict[int, Any] = {}  # in the current group generation
        self._group: WeightGroup | None = None
        self._generation = 0
        self._store: Any = None
        self._address = node_address()
        self._buffers: dict[str, torch.Tensor] | None = None
        self._local: NodeLocalSender | None = None
        self._local_handles: dict[int, Any] = {}  # the actor each node-local worker is
        self._pending: Pending | None = None
        self._phases: dict[str, float] = {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(current_node_id(), soft=False)
        self._rendezvous: Any = ray.remote(num_cpus=0)(Rendezvous).options(
            name=scheme.connection_info_name, scheduling_strategy=here,
        ).remote()  # on the trainer's node: it answers while that node lives, and dies with it

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
        self._members.pop(worker_idx, None)
        self._group = None  # membership changed: rebuild
        if self.version == NO_VERSION:
            return NO_VERSION
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        self._start(None, [worker_idx], deadline, resend=True)
        return self._finish(deadline)

    def _take_announcements(self, deadline: Deadline) -> None:
        try:
            announced: dict[int, Any] = self._ray.get(
                self._rendezvous.take_announcements.remote(),  # type: ignore[attr-defined]
                timeout=_share(deadline, _ANNOUNCE_SHARE),
            )
        except self._ray.exceptions.GetTimeoutError:
            return  # the next call looks again
        for idx, handle in announced.items():
            logger.info("worker %d announced a (new) actor; it joins at the next send", idx)
            self._handles[idx] = handle
            self._reported.discard(idx)
            self._members.pop(idx, None)
            self._group = None

    def _answers(self, refs: Mapping[int, Any], timeout: float | None) -> Answers:
        return collect_answers(self._ray, refs, timeout)

    # ------------------------------------------------------------------ group
    def _build_group(self, deadline: Deadline) -> tuple[dict[int, str], dict[int, str]]:
        """A new group generation with every live worker that answers in time (a worker
        silent before is tried again); returns the (dead, silent) workers left out."""
        assert self._layout is not None
        self._take_announcements(deadline)
        candidates = dict(sorted(self._handles.items()))
        layout = self._layout.to_dict()
        checked = self._answers({w: h._weightsync_check.remote(layout)
                                 for w, h in candidates.items()}, _share(deadline, _CHECK_SHARE))
        for w, err in checked.errors.items():
            if isinstance(err, SchemaMismatchError):
                raise SchemaMismatchError(f"worker {w}: {err}", key=err.key,
                                          expected=err.expected, got=err.got) from err
            raise WeightSyncError(f"worker {w} failed its layout check: {err}") from err
        dead, silent = dict(checked.dead), dict(checked.silent)
        candidates = {w: h for w, h in candidates.items() if w in checked.values}
        local = self._attach_local(candidates, dead, silent, deadline)
        candidates = {w: h for w, h in candidates.items() if w not in dead and w not in silent}
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
            timeout_s=_share(deadline, _BROADCAST_SHARE) or self.scheme.timeout,
            secret=self.scheme.secret, nonce=secrets.token_hex(16),
        )
        public = asdict(info) | {"secret": ""}  # the rendezvous actor never holds the token
        self._ray.get(self._rendezvous.set_group.remote(public, layout),  # type: ignore[attr-defined]
                      timeout=deadline.remaining())
        refs = {w: h._weightsync_join.remote(asdict(info), layout) for w, h in candidates.items()}
        try:
            self._group = WeightGroup(info, 0, store=self._store, host=self._address)
        except (RuntimeError, IntegrityError) as exc:  # someone never joined: who?
            self._group = None
            joined = self._answers(refs, deadline.remaining())
            failed = {w: f"could not join the group: {e}" for w, e in joined.errors.items()}
            failed |= joined.dead | joined.silent
            raise WorkerLostError(
                f"group generation {info.generation} could not be built ({exc}); "
                + "; ".join(f"worker {w}: {why}" for w, why in sorted(failed.items())),
                worker_ids=list(failed) or remote,
            ) from exc
        joined = self._answers(refs, deadline.remaining())
        dead |= joined.dead
        silent |= joined.silent
        silent |= {w: f"failed to join: {e}" for w, e in joined.errors.items()}
        self._members = {w: h for w, h in candidates.items() if w in joined.values}
        for w in self._members:
            state = self._table.workers[w]
            state.connected, state.lost = True, False
            self._reported.discard(w)
        return dead, silent

    def _attach_local(self, handles: Mapping[int, Any], dead: dict[int, str],
                      silent: dict[int, str], deadline: Deadline) -> set[int]:
        """Offer the node-local path to every actor; returns those on this node that can open
        the shared segments, which take versions from there instead of the broadcast."""
        if self._local is None:
            return set()
        info = asdict(self._local.info)
        answers = self._answers({w: h._weightsync_attach.remote(info) for w, h in handles.items()},
                                _share(deadline, _CHECK_SHARE))
        dead |= answers.dead
        silent |= answers.silent | {w: f"attach failed: {e}" for w, e in answers.errors.items()}
        local = set()
        for w, handle in handles.items():
            if answers.values.get(w):
                local.add(w)
                if self._local_handles.get(w) is not handle:  # a new actor
                    self._local.detach(w)
                self._local.attach(w)
                self._local_handles[w] = handle
            else:
                self._local.detach(w)
        if local:
            logger.info("worker(s) %s share this node: they copy from shared memory", sorted(local))
        return local

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
            self._take_announcements(deadline)
            missing = [w for w in range(self.scheme.num_workers) if w not in self._handles]
            if not missing:
                break
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"no actor for worker(s) {missing} within {deadline}: pass the "
                    "handles to create_sender(workers) or register_workers(), or create the "
                    "actors (weightsync_setup) after the sender", worker_ids=missing,
                )
            time.sleep(deadline.slice(0.05))
        if self._layout is None:
            self._weights_to_send(None)
        if self.version == NO_VERSION:
            self._start(None, None, deadline)
            return self._finish(deadline)
        return self.version

    def send_async(self, weights: Any = None, worker_ids: int | list[int] | None = None,
                   timeout: float | None = None) -> None:
        """Snapshot now, signal the actors and broadcast (within ``timeout``, default the
        scheme's); finish with :meth:`wait_async`, which collects the answers."""
        self._start(weights, worker_ids,
                    Deadline(self.scheme.timeout if timeout is None else timeout))

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None,
             timeout: float | None = None) -> int:
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        self._start(weights, worker_ids, deadline)
        return self._finish(deadline)

    def wait_async(self, timeout: float | None = None) -> int:
        return self._finish(Deadline(self.scheme.timeout if timeout is None else timeout))

    def _prepare_buffers(self) -> None:
        assert self._layout is not None
        if self._buffers is not None or self._local is not None:
            return
        cuda = self.scheme.backend == "nccl"
        self._layout_on_wire = self._layout.on_device(wire_device(self.scheme.backend))
        if self.scheme.node_local and not cuda and set(self._layout.nbytes_by_device) == {"cpu"}:
            self._local = NodeLocalSender(max_slots=self.scheme.num_workers + 2)
        else:
            self._buffers = self._layout_on_wire.allocate()

    def _start(self, weights: Any, worker_ids: int | list[int] | None, deadline: Deadline,
               resend: bool = False) -> None:
        if self._closed:
            raise RuntimeError("this sender is closed")
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        self._take_announcements(deadline)  # a replacement actor joins at the next send
        named = self._table.check_worker_ids(worker_ids)
        flat = None if resend else self._weights_to_send(weights)
        assert self._layout is not None
        self._prepare_buffers()
        dead: dict[int, str] = {}
        silent: dict[int, str] = {}
        if self._group is None:
            dead, silent = self._build_group(deadline)
            silent = {w: why for w, why in silent.items() if w not in self._reported}
        if worker_ids is None:  # after the build: a worker that answers again is back
            named = [w for w in named if w not in self._reported]
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
        group = self._group
        assert group is not None
        wire = bucket_buffers(self._layout_on_wire, buffers)
        remote = group.info.world_size > 1
        checked = remote and self.scheme.checksums
        pack_s = time.perf_counter() - t_pack
        budget = _share(deadline, _BROADCAST_SHARE)
        local = self._local
        delivery = {"generation": group.info.generation, "checked": checked,
                    "timeout_s": None if budget is None else budget * 0.95}
        refs = {w: h._weightsync_receive.remote(
                    version, w in named, local.messages_for(w) if local is not None else None,
                    delivery)
                for w, h in self._members.items()}
        t1 = time.perf_counter()
        broadcast_error = None
        if remote:
            try:
                if checked:  # chunks, each summed as it goes out, then the sums
                    group.send_checked(wire, budget)
                else:
                    group.broadcast(wire, budget)
            except RuntimeError as exc:
                logger.warning("broadcast of version %d failed: %s", version, exc)
                broadcast_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self._group = None  # broken: rebuilt from the survivors at the next send
        self._table.published = version
        dead |= {w: "not a member of the group" for w in named
                 if w not in self._members and w not in dead and w not in silent}
        self._pending = Pending(version, named, refs, dead, silent, broadcast_error)
        self._phases = {"pack": pack_s, "broadcast": time.perf_counter() - t1}

    def _finish(self, deadline: Deadline) -> int:
        if self._pending is None:
            raise RuntimeError("no send_async() is pending")
        pending, self._pending = self._pending, None
        version, named = pending.version, pending.named
        t0 = time.perf_counter()
        answers = self._answers(pending.refs, deadline.remaining())
        for w, acked in answers.values.items():
            if w in named:
                self._table.workers[w].version = int(acked)
        dead = pending.dead | answers.dead
        silent = pending.silent | answers.silent
        for w in answers.dead:
            if self._local is not None:
                self._local.detach(w)
            self._members.pop(w, None)
            self._handles.pop(w, None)
            self._table.workers[w].lost = True
        missed = answers.errors  # answered with an error: alive, but without this version
        self._phases["ack"] = time.perf_counter() - t0
        self._stats.add(SendRecord(version, tuple(named), self._layout.nbytes if self._layout else 0,
                                   dict(self._phases)))
        if dead or silent or missed or pending.broadcast_error:
            self._group = None  # rebuilt at the next send, without the dead, retrying the silent
        self._reported.update(dead, silent)
        for w in silent:
            self._members.pop(w, None)
        what = "; ".join([f"worker {w}: {why}" for w, why in sorted((dead | silent).items())]
                         + [f"worker {w}: {e}" for w, e in sorted(missed.items())])
        if dead:
            raise WorkerLostError(
                f"lost worker(s) {sorted(dead)} while sending version {version}: {what}. The "
                "next send rebuilds the group from the others; a replacement actor joins then "
                "(or at once with add_worker).", worker_ids=list(dead), version=version)
        if silent:
            raise WeightSyncTimeoutError(
                f"worker(s) {sorted(silent)} did not take version {version} within "
                f"{deadline}: {what}. The next send rebuilds the group without them "
                "(a worker that answers again rejoins then).", worker_ids=list(silent))
        if missed or pending.broadcast_error:
            raise WeightSyncError(
                f"the broadcast of version {version} failed"
                f"{': ' + pending.broadcast_error if pending.broadcast_error else ''}"
                f"{'; ' + what if what else ''}; the group is rebuilt at the next send")
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
        try:
            self._ray.kill(self._rendezvous)  # type: ignore[arg-type]
        except Exception as exc:  # Ray already shut down: nothing left to kill
            logger.debug("rendezvous actor not killed: %s", exc)
