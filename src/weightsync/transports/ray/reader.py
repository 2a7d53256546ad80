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
stream (``delivery["stream"]``, see ``delta_stream``), verified chunk by chunk in ``take``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError, SenderLostError, WeightSyncError
from weightsync.core.layout import Layout
from weightsync.core.staging import Buffers, StagingBuffers
from weightsync.transports.ray.delta_stream import DeltaReceiver
from weightsync.transports.ray.group import GroupInfo
from weightsync.transports.ray.node_local import NodeLocalInfo, NodeLocalSender
from weightsync.transports.ray.shard_stream import StreamFailed, receive_pieces
from weightsync.transports.ray.staging import checked_staging
from weightsync.transports.ray.transport import RayTransport

logger = logging.getLogger(__name__)

# How long a receiver waits for its sender's rendezvous actor to answer a liveness check
# before poll()/receive() report the sender (or the network to it) lost.
SENDER_CHECK_S = 5.0


class RayReader:
    """An actor's end: stages what the trainer delivers, applies it when the worker asks."""

    views_model: bool = False

    def __init__(self, worker_idx: int, *, num_workers: int, backend: str,
                 rendezvous_name: str, secret: str, timeout: float,
                 rendezvous_namespace: str | None = None) -> None:
        self.worker_idx = worker_idx
        self.num_workers = num_workers
        self.expecting = "weights delivered by the sender"
        self.rendezvous_name = rendezvous_name
        #: a sharded trainer's rendezvous lives in a namespace of its own (its ranks are
        #: separate Ray jobs); None: this actor's job namespace, as the trainer's
        self.rendezvous_namespace = rendezvous_namespace
        self._timeout = timeout
        self.transport = RayTransport(worker_idx=worker_idx, backend=backend,
                                      connection_info_name=rendezvous_name, secret=secret)
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
        if self.transport.local is not None:
            return "relayed" if self._relayed else "node-local"
        return "broadcast" if self.transport.group is not None else None

    # -------------------------------------------------- driven by the sender
    def attach_local(self, info: dict[str, Any]) -> bool:
        """Take versions from the sender's shared memory if this actor is on its node, or
        (``info["relay"]``) from the shared memory of its node's relay actor."""
        info = dict(info)
        relay = bool(info.pop("relay", False))
        if relay:
            self.transport.detach_local()  # the relay gives every segment anew each build
        attached = self.transport.attach_local(NodeLocalInfo(**info))
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
            self.transport.detach_local()  # a member of the broadcast this generation
        self.transport.join(group, Layout.from_dict(layout))
        assert self.transport.layout is not None
        if self.transport.local is not None:
            self._staging = None  # poll() copies straight out of the sender's slots
        elif self._staging is None or self._staging.layout != self.transport.layout:
            self._staging = checked_staging(self.transport.layout, self.worker_idx)
            self._delta = None  # a new layout: no base

    def take(self, version: int, keep: bool, messages: list[dict[str, Any]] | None,
             delivery: dict[str, Any] | None, held: int) -> dict[str, Any]:
        """Take part in the delivery of ``version``: on the sender's (or relay's) node, open
        any new segments it names (the version already waits in shared memory); else take
        the broadcast within ``delivery["timeout_s"]`` and stage it, with the sender's
        checksums, if ``keep``. A relay also writes it for ``delivery["relay"]`` and returns
        ``{"relayed": whether it did, "messages": {follower: segment messages}}`` (else
        ``{}``). A failure is raised here (to the sender) and by the next poll()."""
        if not self.transport.joined:
            raise RuntimeError(f"worker {self.worker_idx} has not joined the group")
        delivery = delivery or {}
        local = self.transport.local
        stream = delivery.get("stream")
        if local is not None:
            local.take_messages(messages or [])
        elif delivery.get("sharded") is not None:
            lost = self._take_sharded(version, keep, delivery, held)
            if lost is not None:
                return self._answer() | lost
        elif stream is not None:
            refused = self._take_stream(version, keep, stream, delivery, held)
            if refused is not None:
                return self._answer() | {"refused": refused}
        else:
            transport, staging = self.transport, self._staging
            assert staging is not None and transport.group is not None
            generation = delivery.get("generation")
            if generation is not None and generation != transport.group.info.generation:
                raise WeightSyncError(  # queued while this actor was stopped: long gone
                    f"worker {self.worker_idx}: version {version} was sent to group generation "
                    f"{generation}, this actor is in {transport.group.info.generation}")
            timeout, checked = delivery.get("timeout_s"), bool(delivery.get("checked"))
            relay, followers = self._relay, delivery.get("relay")
            self._relayed_now = False

            def write(buffers: Buffers) -> list[int] | None:
                if relay is None or not followers:  # verified at poll(), if ever
                    return transport.receive_unverified(buffers, timeout, checked)
                return self._relay_version(relay, buffers, followers, version, timeout, checked)

            try:
                staging.fill(version, write, keep)
            except RuntimeError as exc:
                raise self._did_not_arrive(version, held, exc, keep) from exc
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

    def _take_stream(self, version: int, keep: bool, stream: dict[str, Any],
                     delivery: dict[str, Any], held: int) -> str | None:
        """Delta: take this node's stream of ``version``, verified, into staging (and relay
        it); returns why it was refused (the sender then streams it whole) or None."""
        transport, staging, group = self.transport, self._staging, self.transport.group
        assert staging is not None and group is not None and transport.layout is not None
        if self._delta is None:
            self._delta = DeltaReceiver(transport.layout, self.worker_idx)
        self._relayed_now = False
        if stream.get("skip"):
            return None
        generation = delivery.get("generation")
        if generation is not None and generation != group.info.generation:
            raise WeightSyncError(
                f"worker {self.worker_idx}: version {version} was sent to group generation "
                f"{generation}, this actor is in {group.info.generation}")
        timeout, followers, decoder = delivery.get("timeout_s"), delivery.get("relay"), self._delta

        def write(buffers: Buffers) -> None:
            decoder.receive(group, buffers, stream, version, timeout,
                            RayTransport.wire_hook)
            if self._relay is not None and followers:
                layout = transport.layout
                assert layout is not None
                self._relay.publish(layout.named_views(buffers), followers, version, timeout)
                self._relayed_now = True

        try:
            staging.fill(version, write, keep)
        except IntegrityError as exc:
            logger.warning("%s", exc)
            if stream.get("base") is None:  # whole chunks failed too: nothing is applied,
                if keep:  # the sender raises it, and so does the next poll()
                    self._failure = exc
                raise
            return str(exc)
        except RuntimeError as exc:
            raise self._did_not_arrive(version, held, exc, keep) from exc
        return None

    def _take_sharded(self, version: int, keep: bool, delivery: dict[str, Any],
                      held: int) -> dict[str, Any] | None:
        """A sharded trainer: take every trainer rank's stream of ``version``, each chunk
        verified before it is written into staging (and relay it once whole); returns
        ``{"refused": why, "lost_ranks": [...]}`` if some rank's stream broke (nothing
        staged: the version is not taken), else None."""
        transport, staging, group = self.transport, self._staging, self.transport.group
        assert staging is not None and group is not None and transport.layout is not None
        layout = transport.layout
        generation = delivery.get("generation")
        if generation is not None and generation != group.info.generation:
            raise WeightSyncError(
                f"worker {self.worker_idx}: version {version} was sent to group generation "
                f"{generation}, this actor is in {group.info.generation}")
        timeout, followers = delivery.get("timeout_s"), delivery.get("relay")
        sharded = delivery["sharded"]
        regions = {int(r): regs for r, regs in sharded["regions"].items()}
        wire_hook = RayTransport.wire_hook
        hook = None if wire_hook is None else (lambda payload: wire_hook([payload]))
        self._relayed_now = False

        def write(buffers: Buffers) -> None:
            views = layout.named_views(buffers)
            receive_pieces(group, layout, views, regions, version, timeout, hook,
                           int(sharded["chunk_bytes"]))
            if self._relay is not None and followers:
                self._relay.publish(views, followers, version, timeout)
                self._relayed_now = True

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

    def _relay_version(self, relay: NodeLocalSender, buffers: Buffers, followers: list[int],
                       version: int, timeout: float | None, checked: bool) -> list[int] | None:
        """Take the broadcast, verified chunk by chunk as it arrives, then write it once
        into the relay's shared memory for ``followers``; returns what is left to verify at
        poll() (None: verified; the sums if they did not match: poll() raises
        IntegrityError, and the followers keep what they hold)."""
        sums, intact = self.transport.receive_verified(buffers, timeout, checked)
        if not intact:
            logger.warning("worker %d: version %d arrived corrupted; not relayed to %s",
                           self.worker_idx, version, followers)
            return sums
        layout = self.transport.layout
        assert layout is not None
        relay.publish(layout.named_views(buffers), followers, version, timeout)
        self._relayed_now = True
        return None

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
        local = self.transport.local
        if local is not None:  # the version the sender's shared memory points this actor at
            return local.published_version() > version
        staging = self._staging
        staged = None if staging is None else staging.staged_version
        return staged is not None and staged > version

    def apply_newest(self, dest: dict[str, torch.Tensor], version: int,
                     deadline: Deadline) -> int | None:
        """Verify and apply the newest version delivered, if newer than ``version``;
        IntegrityError (``dest`` untouched) if its bytes do not match the sender's sums."""
        local = self.transport.local
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
        self.transport.close()
        with self._arrived:
            self._arrived.notify_all()
