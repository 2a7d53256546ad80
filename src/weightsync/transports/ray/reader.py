"""The Ray scheme's worker end, inside an actor, as the receive lifecycle drives it.

The trainer drives the protocol through the actor's methods: it offers the node-local path
(``attach_local``), joins the actor to each group generation (``join``) and has it take each
version (``take``): out of the trainer's shared memory on its node, else from the broadcast
into a staging buffer with the sender's checksums. On a node with several actors, one of
them (the relay) takes the broadcast and writes each version, verified, once into shared
memory of its own, and the others copy it from there (``"relayed"``), as actors on the
trainer's node do from the trainer's. ``apply_newest`` (the worker's
``poll()``) verifies and applies the newest one whole. With nothing new, ``check_sender``
raises a delivery that failed, or :class:`SenderLostError` once the sender's rendezvous
actor is gone or silent. With ``delta=True`` the node's actor in the group takes its own
stream (a ``DeltaStream`` delivery, see ``delta_stream``), verified chunk by chunk in
``take``. ``link`` holds the actor's group membership and node-local mapping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from weightsync.core.checksum import warm_up_in_background
from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError, SenderLostError, WeightSyncError
from weightsync.core.layout import Layout
from weightsync.core.staging import Buffers, StagingBuffers
from weightsync.transports.ray.delivery import Broadcast, Delivery, DeltaStream, ShardedPieces
from weightsync.transports.ray.delta_stream import DeltaReceiver
from weightsync.transports.ray.group import GroupInfo
from weightsync.transports.ray.link import ActorLink
from weightsync.transports.ray.node_local import NodeLocalInfo, NodeLocalSender
from weightsync.transports.ray.shard_stream import StreamFailed, receive_pieces
from weightsync.transports.ray.staging import checked_staging

logger = logging.getLogger(__name__)

# How long a receiver waits for its sender's rendezvous actor to answer a liveness check
# before poll()/receive() report the sender (or the network to it) lost.
SENDER_CHECK_S = 5.0


class RayReader:
    """An actor's end: stages what the trainer delivers, applies it when the worker asks."""

    views_model: bool = False

    def __init__(self, worker_idx: int, *, num_workers: int, backend: str,
                 rendezvous_name: str, timeout: float,
                 rendezvous_namespace: str | None = None) -> None:
        self.worker_idx = worker_idx
        self.num_workers = num_workers
        self.expecting = "weights delivered by the sender"
        self.rendezvous_name = rendezvous_name
        #: a sharded trainer's rendezvous lives in a namespace of its own (its ranks are
        #: separate Ray jobs); None: this actor's job namespace, as the trainer's
        self.rendezvous_namespace = rendezvous_namespace
        self._timeout = timeout
        self.link = ActorLink(worker_idx, backend)  # each join's group info holds the token
        self._staging: StagingBuffers | None = None
        self._arrived = threading.Condition()
        self._failure: WeightSyncError | None = None  # a delivery that failed, for poll()
        self._rendezvous: Any = None
        self._ping: tuple[Any, float] | None = None  # (pending liveness check, sent at)
        self._sender_checked = 0.0
        self._relay: NodeLocalSender | None = None  # this actor relays to its node's others
        self._relayed = False  # this actor copies from its node's relay
        self._relayed_now = False  # the version being taken was relayed
        self._delta: DeltaReceiver | None = None  # delta streams: this node's base

    @property
    def path(self) -> str | None:
        """``"node-local"`` (the sender's shared memory), ``"relayed"`` (the shared memory
        of the actor on this node that took the broadcast), ``"broadcast"`` (the group), or
        None before the sender's first send."""
        if self.link.local is not None:
            return "relayed" if self._relayed else "node-local"
        return "broadcast" if self.link.group is not None else None

    # -------------------------------------------------- driven by the sender
    def attach_local(self, info: dict[str, Any]) -> bool:
        """Take versions from the sender's shared memory if this actor is on its node, or
        (``info["relay"]``) from the shared memory of its node's relay actor."""
        info = dict(info)
        relay = bool(info.pop("relay", False))
        if relay:
            self.link.detach_local()  # the relay gives every segment anew each build
        attached = self.link.attach_local(NodeLocalInfo(**info))
        self._relayed = relay and attached
        return attached

    def join(self, info: dict[str, Any], layout: dict[str, Any],
             relay: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Join a group generation (or only learn the layout, on the sender's node or as a
        relayed actor). ``relay``: ``{"followers": [...]}``, the other actors of this node,
        which copy each version from this actor's shared memory; returns how they find it."""
        self._join(GroupInfo(**info), layout)
        if not relay:
            self._close_relay()
            return None
        if self._relay is None:
            self._relay = NodeLocalSender(max_slots=self.num_workers + 2)
        for w in self._relay.workers:
            self._relay.detach(w)
        for w in relay["followers"]:
            self._relay.attach(w)
        return asdict(self._relay.info)

    def _close_relay(self) -> None:
        if self._relay is not None:
            self._relay.close()  # its followers keep what they mapped until they close
            self._relay = None

    def _join(self, group: GroupInfo, layout: dict[str, Any]) -> None:
        if self._rendezvous is None:
            import ray

            self._rendezvous = ray.get_actor(self.rendezvous_name,
                                             namespace=self.rendezvous_namespace)
        if self.worker_idx in group.ranks:
            self.link.detach_local()  # a member of the broadcast this generation
        self.link.join(group, Layout.from_dict(layout))
        assert self.link.layout is not None
        if self.link.local is not None:
            self._staging = None  # poll() copies straight out of the sender's slots
        elif self._staging is None or self._staging.layout != self.link.layout:
            self._staging = checked_staging(self.link.layout, self.worker_idx)
            self._delta = None  # a new layout: no base
            warm_up_in_background()  # the checksum kernels: not in the first poll()

    def take(self, version: int, keep: bool, messages: list[dict[str, Any]] | None,
             delivery: Mapping[str, Any] | None, held: int) -> dict[str, Any]:
        """Take part in the delivery of ``version``: on the sender's (or relay's) node, open
        any new segments it names (the version already waits in shared memory); else take
        it by the path ``delivery`` names (see ``delivery``) within its ``timeout_s`` and
        stage it, with the sender's checksums, if ``keep``. A relay also writes it for its
        followers and returns ``{"relayed": whether it did, "messages": {follower: segment
        messages}}`` (else ``{}``). A failure is raised here (to the sender) and by the
        next poll()."""
        link = self.link
        if not link.joined:
            raise RuntimeError(f"worker {self.worker_idx} has not joined the group")
        refused: dict[str, Any] | None = None
        if link.local is not None:
            link.local.take_messages(messages or [])
        else:
            if delivery is None:
                raise WeightSyncError(
                    f"worker {self.worker_idx}: version {version} came with no delivery, and "
                    "this actor maps no shared memory of its node to copy it from")
            typed = Delivery.from_wire(delivery, worker_idx=self.worker_idx, version=version)
            group, staging = link.group, self._staging
            assert group is not None and staging is not None
            if typed.generation != group.info.generation:
                raise WeightSyncError(  # queued while this actor was stopped: long gone
                    f"worker {self.worker_idx}: version {version} was sent to group generation "
                    f"{typed.generation}, this actor is in {group.info.generation}")
            self._relayed_now = False
            plan = typed.plan
            if isinstance(plan, Broadcast):
                self._take_broadcast(version, keep, plan, typed, staging, held)
            elif isinstance(plan, DeltaStream):
                refused = self._take_stream(version, keep, plan, typed, staging, held)
            else:
                refused = self._take_sharded(version, keep, plan, typed, staging, held)
        if refused is not None:
            return self._answer() | refused
        if keep:
            self._failure = None
        with self._arrived:
            self._arrived.notify_all()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        """What ``take`` tells the sender beyond the version held: a relay's followers'
        segments, and the snapshot this node's delta base is (``delta``)."""
        answer: dict[str, Any] = {} if self._delta is None else {"base": self._delta.base_id}
        relay = self._relay
        if relay is None:
            return answer
        return answer | {"relayed": self._relayed_now,
                         "messages": {w: relay.messages_for(w) for w in relay.workers}}

    def _publish_to_followers(self, buffers: Buffers, delivery: Delivery, version: int) -> None:
        """A relay: write the version, verified, once into its shared memory for the
        followers that keep it."""
        layout = self.link.layout
        assert self._relay is not None and layout is not None
        self._relay.publish(layout.named_views(buffers), delivery.relay, version,
                            delivery.timeout_s)
        self._relayed_now = True

    def _take_broadcast(self, version: int, keep: bool, plan: Broadcast, delivery: Delivery,
                        staging: StagingBuffers, held: int) -> None:
        """The whole version from the group's broadcast, with its checksums to verify at
        poll(); a relay verifies it first, then writes it for its followers."""
        link, timeout, checked = self.link, delivery.timeout_s, plan.checked
        relaying = self._relay is not None and bool(delivery.relay)

        def write(buffers: Buffers) -> list[int] | None:
            if not relaying:  # verified at poll(), if ever
                return link.receive_unverified(buffers, timeout, checked)
            sums, intact = link.receive_verified(buffers, timeout, checked)
            if not intact:
                logger.warning("worker %d: version %d arrived corrupted; not relayed to %s",
                               self.worker_idx, version, list(delivery.relay))
                return sums  # poll() raises IntegrityError; the followers keep theirs
            self._publish_to_followers(buffers, delivery, version)
            return None

        try:
            staging.fill(version, write, keep)
        except RuntimeError as exc:
            raise self._did_not_arrive(version, held, exc, keep) from exc

    def _take_stream(self, version: int, keep: bool, plan: DeltaStream, delivery: Delivery,
                     staging: StagingBuffers, held: int) -> dict[str, Any] | None:
        """Delta: take this node's stream of ``version``, verified, into staging (and relay
        it); returns ``{"refused": why}`` (the sender then streams it whole) or None."""
        link, group = self.link, self.link.group
        assert group is not None and link.layout is not None
        if self._delta is None:
            self._delta = DeltaReceiver(link.layout, self.worker_idx)
        if plan.skip:
            return None
        decoder = self._delta

        def write(buffers: Buffers) -> None:
            decoder.receive(group, buffers, plan, version, delivery.timeout_s,
                            ActorLink.wire_hook)
            if self._relay is not None and delivery.relay:
                self._publish_to_followers(buffers, delivery, version)

        try:
            staging.fill(version, write, keep)
        except IntegrityError as exc:
            logger.warning("%s", exc)
            if plan.base is None:  # whole chunks failed too: nothing is applied,
                if keep:  # the sender raises it, and so does the next poll()
                    self._failure = exc
                raise
            return {"refused": str(exc)}
        except RuntimeError as exc:
            raise self._did_not_arrive(version, held, exc, keep) from exc
        return None

    def _take_sharded(self, version: int, keep: bool, plan: ShardedPieces, delivery: Delivery,
                      staging: StagingBuffers, held: int) -> dict[str, Any] | None:
        """A sharded trainer: take every trainer rank's stream of ``version``, each chunk
        verified before it is written into staging (and relay it once whole); returns
        ``{"refused": why, "lost_ranks": [...]}`` if some rank's stream broke (nothing
        staged: the version is not taken), else None."""
        link, group = self.link, self.link.group
        assert group is not None and link.layout is not None
        layout = link.layout
        wire_hook = ActorLink.wire_hook
        hook = None if wire_hook is None else (lambda payload: wire_hook([payload]))

        def write(buffers: Buffers) -> None:
            views = layout.named_views(buffers)
            receive_pieces(group, layout, views, plan.regions, version, delivery.timeout_s,
                           hook, plan.chunk_bytes)
            if self._relay is not None and delivery.relay:
                self._publish_to_followers(buffers, delivery, version)

        try:
            staging.fill(version, write, keep)
        except StreamFailed as exc:
            logger.warning("worker %d: %s; keeping version %d", self.worker_idx, exc, held)
            return {"refused": str(exc), "lost_ranks": exc.ranks}
        except IntegrityError as exc:
            logger.warning("%s", exc)
            if keep:
                self._failure = exc
            raise
        except RuntimeError as exc:
            raise self._did_not_arrive(version, held, exc, keep) from exc
        return None

    def _did_not_arrive(self, version: int, held: int, exc: BaseException,
                        keep: bool) -> WeightSyncError:
        """The error of a version the group failed to bring (kept for the next poll()
        when ``keep``)."""
        failure = WeightSyncError(
            f"worker {self.worker_idx}: version {version} did not arrive ({exc}); the "
            f"sender or the network to it failed. Keeping version {held}.")
        if keep:
            self._failure = failure
        return failure

    def announce(self, timeout: float | None) -> None:
        """From inside an actor: tell the sender this actor is worker ``worker_idx``."""
        import ray

        handle = ray.get_runtime_context().current_actor
        rendezvous = ray.get_actor(self.rendezvous_name, namespace=self.rendezvous_namespace)
        ray.get(rendezvous.announce.remote(self.worker_idx, handle), timeout=timeout)

    # -------------------------------------------------- driven by the receiver
    def open(self, local: Layout | None, deadline: Deadline) -> None:
        """Nothing to do: the sender checks the layout and joins this actor itself."""

    def newer_available(self, version: int) -> bool:
        """Whether a version newer than ``version`` waits for this actor (applies nothing)."""
        local = self.link.local
        if local is not None:  # the version the sender's shared memory points this actor at
            return local.published_version() > version
        staging = self._staging
        staged = None if staging is None else staging.staged_version
        return staged is not None and staged > version

    def apply_newest(self, dest: dict[str, torch.Tensor], version: int,
                     deadline: Deadline) -> int | None:
        """Verify and apply the newest version delivered, if newer than ``version``;
        IntegrityError (``dest`` untouched) if its bytes do not match the sender's sums."""
        local = self.link.local
        if local is not None:
            return local.apply(dest, version, deadline)
        if self._staging is not None:
            return self._staging.apply(dest, version)
        return None

    def wait(self, version: int, deadline: Deadline) -> None:
        with self._arrived:
            self._arrived.wait(deadline.slice(0.05))

    def check_sender(self, version: int) -> None:
        """Raise a delivery that failed, or SenderLostError if the sender's rendezvous actor
        is gone or has not answered for ``SENDER_CHECK_S``; never blocks (one liveness
        check in flight, looked at on each call)."""
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
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
        name = self.rendezvous_name
        if ready:
            self._ping, self._sender_checked = None, now
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.ActorUnavailableError:
                raise self._lost(version, f"cannot reach its rendezvous actor {name!r} "
                                          "(network?)") from None
            except ray.exceptions.RayActorError:
                raise self._lost(version, f"its rendezvous actor {name!r} no longer "
                                          "exists") from None
        elif now - sent > min(SENDER_CHECK_S, self._timeout):
            self._ping, self._sender_checked = None, now
            raise self._lost(version, f"its rendezvous actor {name!r} did not answer for "
                                      f"{now - sent:.1f}s (the sender's node, or the network "
                                      "to it, is down)")

    def _lost(self, version: int, why: str) -> SenderLostError:
        return SenderLostError(
            f"worker {self.worker_idx} (at version {version}): the sender is gone: {why}")

    def ack(self, version: int) -> None:
        """Nothing to send: the sender collects each take's answer."""

    def close(self, dest: dict[str, torch.Tensor] | None) -> None:
        self._close_relay()
        self.link.close()
        with self._arrived:
            self._arrived.notify_all()
