"""RayWeightSyncScheme: weights to Ray actors on any host of a Ray cluster.

The trainer (``ray_sender``) drives: it checks every actor's layout, builds the library's
own torch.distributed group (rendezvous in a named Ray actor, at the node address Ray
reports, authenticated by the scheme's secret token), and for each send signals the actors
through Ray and broadcasts the packed, checksummed buckets once for all of them; actors stage
what arrives and apply it at ``poll()``. Actors on the trainer's own node take each version
out of shared memory instead (``node_local``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    SenderLostError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.core.layout import Layout
from weightsync.core.staging import StagingBuffers
from weightsync.core.strategy import WeightStrategy
from weightsync.core.versions import NO_VERSION
from weightsync.schemes.base import WeightReceiver, WeightSyncScheme
from weightsync.schemes.ray_sender import RayWeightSender
from weightsync.transports.ray import RayTransport
from weightsync.transports.ray_group import GroupInfo
from weightsync.transports.ray_local import NodeLocalInfo
from weightsync.transports.ray_staging import checked_staging

__all__ = ["RayWeightReceiver", "RayWeightSender", "RayWeightSyncScheme", "Rendezvous"]

logger = logging.getLogger(__name__)

# How long a receiver waits for its sender's rendezvous actor to answer a liveness check
# before poll()/receive() report the sender (or the network to it) lost.
SENDER_CHECK_S = 5.0


class Rendezvous:
    """The named Ray actor holding the group's connection info (never the token) and
    replacement announcements; it dies with the sender, which tells receivers so."""

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

    def ping(self) -> bool:
        return True


class RayWeightSyncScheme(WeightSyncScheme):
    """Sync to ``num_workers`` Ray actors; ``backend`` is ``"gloo"`` (CPU) or ``"nccl"`` (GPU).

    ``connection_info_name`` names the rendezvous actor (unique per scheme by default).
    ``node_local`` (gloo, CPU weights): the trainer writes each version once into shared
    memory, and actors on its node copy it from there at ``poll()`` instead of taking it
    over loopback TCP; actors elsewhere (or that cannot open it) get the broadcast.
    ``False`` sends every byte through the group. The scheme carries a random ``secret``
    (it travels, pickled, to the actors through Ray): only holders of it can join the group
    or write rendezvous values a member accepts. ``checksums`` (default on): every bucket
    broadcast carries a checksum the receiving actor verifies before it applies anything."""

    def __init__(
        self,
        num_workers: int = 1,
        *,
        backend: str = "gloo",
        timeout: float = 60.0,
        connection_info_name: str | None = None,
        strategy: WeightStrategy | None = None,
        node_local: bool = True,
        checksums: bool = True,
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
        self.checksums = bool(checksums)
        self.secret = secrets.token_hex(32)

    def create_sender(self, workers: Sequence[Any] | Mapping[int, Any] | None = None) -> RayWeightSender:
        """The trainer's end; ``workers`` are the actor handles, by worker index."""
        sender = RayWeightSender(self)
        if workers is not None:
            sender.register_workers(workers)
        return sender

    def create_receiver(self, worker_idx: int = 0) -> RayWeightReceiver:
        return RayWeightReceiver(self, worker_idx)


class RayWeightReceiver(WeightReceiver):
    """The worker end, held by a Ray actor (see ``weightsync.integrations.ray``)."""

    def __init__(self, scheme: RayWeightSyncScheme, worker_idx: int) -> None:
        super().__init__(scheme, worker_idx)
        self.scheme: RayWeightSyncScheme = scheme
        self.transport = RayTransport(
            worker_idx=worker_idx, backend=scheme.backend,
            connection_info_name=scheme.connection_info_name, secret=scheme.secret,
        )
        self._staging: StagingBuffers | None = None
        self._arrived = threading.Condition()
        self._failure: WeightSyncError | None = None  # a delivery that failed, for poll()
        self._rendezvous: Any = None
        self._ping: tuple[Any, float] | None = None  # (pending liveness check, sent at)
        self._sender_checked = 0.0

    @property
    def path(self) -> str | None:
        """How versions reach this actor: ``"node-local"`` (the sender's shared memory),
        ``"broadcast"`` (the group), or None before the sender's first send."""
        if self.transport.local is not None:
            return "node-local"
        return "broadcast" if self.transport.group is not None else None

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
        if self._rendezvous is None:
            import ray

            self._rendezvous = ray.get_actor(self.scheme.connection_info_name)
        if self.worker_idx in group.ranks:
            self.transport.detach_local()  # a member of the broadcast this generation
        self.transport.join(group, Layout.from_dict(layout))
        assert self.transport.layout is not None
        if self.transport.local is not None:
            self._staging = None  # poll() copies straight out of the sender's slots
        elif self._staging is None or self._staging.layout != self.transport.layout:
            self._staging = checked_staging(self.transport.layout, self.worker_idx)

    def take(self, version: int, keep: bool, messages: list[dict[str, Any]] | None = None,
             delivery: dict[str, Any] | None = None) -> int:
        """Take part in the delivery of ``version``: on the sender's node, open any new
        segments it names (the version already waits in shared memory); else take the
        broadcast within ``delivery["timeout_s"]`` and stage it, with the sender's checksums,
        if the version is for us. A failure is raised here (to the sender) and by the next
        poll(); the checksums are verified at poll(), before anything is applied."""
        if not self.transport.joined:
            raise RuntimeError(f"worker {self.worker_idx} has not joined the group")
        delivery = delivery or {}
        local = self.transport.local
        if local is not None:
            local.take_messages(messages or [])
        else:
            transport, staging = self.transport, self._staging
            assert staging is not None and transport.group is not None
            generation = delivery.get("generation")
            if generation is not None and generation != transport.group.info.generation:
                raise WeightSyncError(  # queued while this actor was stopped: long gone
                    f"worker {self.worker_idx}: version {version} was sent to group generation "
                    f"{generation}, this actor is in {transport.group.info.generation}")
            try:
                staging.fill(version, lambda b: transport.receive_unverified(
                    b, delivery.get("timeout_s"), bool(delivery.get("checked"))), keep)
            except RuntimeError as exc:
                failure = WeightSyncError(
                    f"worker {self.worker_idx}: version {version} did not arrive ({exc}); the "
                    f"sender or the network to it failed. Keeping version {self._version}.")
                if keep:
                    self._failure = failure
                raise failure from exc
        if keep:
            self._failure = None
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
                    f"worker {self.worker_idx}: nothing delivered within {deadline}"
                )
            with self._arrived:
                self._arrived.wait(deadline.slice(0.05))

    def poll(self) -> int | None:
        """Apply the newest delivered version, never blocking; IntegrityError (keeping the
        version held) if its bytes do not match the sender's checksums. With nothing new:
        raise a delivery that failed, or SenderLostError if the sender's rendezvous actor
        is gone or has not answered for ``SENDER_CHECK_S``."""
        applied = None
        if self.transport.local is not None:
            applied = self.transport.local.apply(self._destination(), self._version)
        elif self._staging is not None:
            applied = self._staging.apply(self._destination(), self._version)
        if applied is not None:
            self._version = applied
            return applied
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        self._check_sender()
        return None

    def _check_sender(self) -> None:
        """A liveness check that never blocks: one ping in flight, looked at on each call."""
        if self._rendezvous is None:
            return  # not joined yet: there may be no sender so far
        import ray

        now = time.monotonic()
        if self._ping is None:
            if now - self._sender_checked >= 1.0:
                self._ping = (self._rendezvous.ping.remote(), now)
            return
        ref, sent = self._ping
        ready, _ = ray.wait([ref], timeout=0)
        if ready:
            self._ping, self._sender_checked = None, now
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.ActorUnavailableError:
                raise self._lost(f"cannot reach its rendezvous actor "
                                 f"{self.scheme.connection_info_name!r} (network?)") from None
            except ray.exceptions.RayActorError:
                raise self._lost(f"its rendezvous actor {self.scheme.connection_info_name!r} "
                                 "no longer exists") from None
        elif now - sent > min(SENDER_CHECK_S, self.scheme.timeout):
            self._ping, self._sender_checked = None, now
            raise self._lost(f"its rendezvous actor {self.scheme.connection_info_name!r} did "
                             f"not answer for {now - sent:.1f}s (the sender's node, or the "
                             "network to it, is down)")

    def _lost(self, why: str) -> SenderLostError:
        return SenderLostError(
            f"worker {self.worker_idx} (at version {self._version}): the sender is gone: {why}")

    def receive(self, timeout: float | None = None) -> int | None:
        """Block for a newer version (up to ``timeout``, default the scheme's) and apply it;
        None on timeout."""
        deadline = Deadline(self.scheme.timeout if timeout is None else timeout)
        while True:
            applied = self.poll()
            if applied is not None or deadline.expired():
                return applied
            with self._arrived:
                self._arrived.wait(deadline.slice(0.05))

    def close(self) -> None:
        self._closed = True
        self.transport.close()
