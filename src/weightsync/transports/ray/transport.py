"""RayTransport (TorchRL's RayTransport API): Ray carries the signals, a torch.distributed group the bytes.

The group (``ray.group``) is weightsync's own, never the user's default process group.
Rank 0 is the sender; worker ``i`` is rank ``i + 1`` unless the group was rebuilt
without some workers, in which case the rendezvous info maps worker indices to ranks.
Weights cross as packed buckets, one ``broadcast`` per bucket for all workers, each with a
checksum verified on arrival. Actors on the sender's own node take the node-local path
(``ray.node_local``) instead.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar

import torch

from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.transports.ray.group import (
    GroupInfo,
    WeightGroup,
    WireHook,
    bucket_buffers,
    free_port,
    node_address,
    wire_checksum,
    wire_checksums,
    wire_device,
)
from weightsync.transports.ray.node_local import (
    NodeLocalInfo,
    NodeLocalReceiver,
    NodeLocalSender,
    probe_node_local,
)

__all__ = [
    "GroupInfo", "NodeLocalInfo", "NodeLocalReceiver", "NodeLocalSender", "RayTransport",
    "WeightGroup", "bucket_buffers", "free_port", "node_address", "probe_node_local",
    "wire_checksum", "wire_checksums",
]

logger = logging.getLogger(__name__)


class RayTransport:
    """Weight transport to ONE Ray actor; the scheme holds one per worker and
    drives the collective for all of them at once.

    Sender side: ``send_weights``/``send_weights_async`` + ``wait_ack`` signal the actor
    through Ray and broadcast the packed bytes over the group. Receiver side (inside the
    actor): ``setup_connection_and_weights_on_receiver`` joins the group as rank
    ``worker_idx + 1``; ``receive_weights`` takes the next broadcast into a staging buffer and
    applies it to the model.
    """

    wire_hook: ClassVar[WireHook | None] = None  # tests: corrupt received bytes "on the wire"

    def __init__(
        self,
        *,
        remote_actor: Any = None,
        worker_idx: int | None = None,
        backend: str = "gloo",
        connection_info_name: str = "connection_info",
        model_id: str | None = None,
        secret: str = "",
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.remote_actor = remote_actor
        self.worker_idx = 0 if worker_idx is None else worker_idx
        self.backend = backend
        self.connection_info_name = connection_info_name
        self.model_id = model_id or "policy"
        self.secret = secret  # the scheme's token (the rendezvous actor never holds it)
        self.group: WeightGroup | None = None
        self.layout: Layout | None = None
        self._model: Any = None
        self._pending: Any = None
        self._staging: dict[str, torch.Tensor] | None = None
        self.local: NodeLocalReceiver | None = None  # on the sender's node: shared memory
        self.version = NO_VERSION

    # ------------------------------------------------------------------ sender side
    def attach_group(self, group: WeightGroup, layout: Layout) -> None:
        """Used by the scheme: the group (rank 0) and layout this transport sends with."""
        self.group = group
        self.layout = layout

    def send_weights(self, weights: Any) -> None:
        """Signal the actor, broadcast ``weights``, and wait until the actor took them."""
        self.send_weights_async(weights)
        self.wait_ack()

    def send_weights_async(self, weights: Any) -> None:
        """Signal the actor and broadcast ``weights``; finish with :meth:`wait_ack`."""
        if self.group is None or self.layout is None or self.remote_actor is None:
            raise RuntimeError("RayTransport has no group: the scheme's connect() sets it up")
        flat = flat_tensors(weights, what="RayTransport.send_weights")
        self.layout.check_weights(flat)
        buffers = self.layout.allocate()
        self.layout.pack(flat, buffers)
        version = self.version + 1
        delivery = {"checked": True, "generation": self.group.info.generation}
        self._pending = self.remote_actor._weightsync_receive.remote(version, True, None, delivery)
        self.group.send_checked(bucket_buffers(self.layout, buffers))
        self.version = version

    def wait_ack(self, timeout: float | None = None) -> None:
        """Wait until the actor acknowledged the pending send."""
        import ray

        if self._pending is None:
            raise RuntimeError("no pending send: call send_weights_async() first")
        pending, self._pending = self._pending, None
        ray.get(pending, timeout=timeout)

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing per worker: the scheme creates the rendezvous and rank 0."""

    # ------------------------------------------------------------------ receiver side
    def set_model(self, model: Any) -> None:
        """The model received weights are applied to."""
        self._model = model

    def join(self, info: GroupInfo, layout: Layout) -> None:
        """Join ``info``'s group generation (blocks until every member has joined); an actor
        that maps the sender's snapshot is not a member and takes its bytes from there."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.layout = layout.on_device(self._staging_device())
        if self.worker_idx in info.ranks or self.local is None:
            self.group = WeightGroup(info, info.rank_of(self.worker_idx))
        self._staging = None

    @property
    def joined(self) -> bool:
        return self.layout is not None and (self.group is not None or self.local is not None)

    def _staging_device(self) -> torch.device:
        return wire_device(self.backend)

    def take_broadcast(self, timeout: float | None = None,
                       checked: bool = True) -> dict[str, torch.Tensor]:
        """Receive one broadcast into a staging buffer (reused) and return it."""
        if self.layout is None:
            raise RuntimeError(f"worker {self.worker_idx} has not joined a group")
        if self._staging is None:
            self._staging = self.layout.allocate()
        self.receive_into(self._staging, timeout, checked)
        return self._staging

    def receive_into(self, buffers: dict[str, torch.Tensor], timeout: float | None = None,
                     checked: bool = True, version: int | None = None) -> None:
        """Take one broadcast into ``buffers`` within ``timeout`` seconds; if ``checked``,
        verify every chunk against the sender's checksum: a mismatch raises IntegrityError."""
        if self.group is None or self.layout is None:
            raise RuntimeError(f"worker {self.worker_idx} has not joined a group")
        wire = bucket_buffers(self.layout, buffers)
        if not checked:
            self.group.broadcast(wire, timeout)
            return
        bad = self.group.receive_checked(wire, timeout, RayTransport.wire_hook)
        if bad:
            raise IntegrityError(
                f"worker {self.worker_idx}: {len(bad)} chunk(s) of version "
                f"{'?' if version is None else version} arrived corrupted (first: chunk "
                f"{bad[0]}, its checksum differs from the sender's); the version is dropped "
                "and the worker keeps the one it holds"
            )

    def receive_unverified(self, buffers: dict[str, torch.Tensor], timeout: float | None,
                           checked: bool) -> list[int] | None:
        """Take one broadcast into ``buffers``; returns the sender's checksums (if
        ``checked``) for the caller to verify before use."""
        if self.group is None or self.layout is None:
            raise RuntimeError(f"worker {self.worker_idx} has not joined a group")
        wire = bucket_buffers(self.layout, buffers)
        if not checked:
            self.group.broadcast(wire, timeout)
            return None
        return self.group.receive_sums(wire, timeout, RayTransport.wire_hook)

    def receive_verified(self, buffers: dict[str, torch.Tensor], timeout: float | None,
                         checked: bool) -> tuple[list[int] | None, bool]:
        """Take one broadcast into ``buffers``, verifying each chunk (if ``checked``) while
        the next one arrives; returns the sender's checksums and whether every chunk
        matched them."""
        if self.group is None or self.layout is None:
            raise RuntimeError(f"worker {self.worker_idx} has not joined a group")
        wire = bucket_buffers(self.layout, buffers)
        if not checked:
            self.group.broadcast(wire, timeout)
            return None, True
        sums, bad = self.group.receive_verified(wire, timeout, RayTransport.wire_hook)
        return sums, not bad

    def receive_weights(
        self,
        timeout: float | None = None,
        *,
        weights: Any = None,
        model: Any = None,
        strategy: WeightStrategy | None = None,
    ) -> Any | None:
        """Take the next broadcast and apply it to ``model`` (or the one from
        :meth:`set_model`, or ``weights``); returns the applied weights."""
        target = model if model is not None else (self._model if self._model is not None else weights)
        staging = self.take_broadcast()
        if target is None:
            return None
        assert self.layout is not None
        self.layout.unpack(staging, flat_tensors(target, what="receive_weights destination"))
        return (strategy or WeightStrategy()).extract_weights(target)

    def setup_connection_and_weights_on_receiver(
        self,
        *,
        worker_idx: int,
        strategy: WeightStrategy | None = None,
        model: Any | None = None,
        weights: Any | None = None,
    ) -> Any:
        """Fetch the rendezvous from the named Ray actor, join as rank ``worker_idx + 1``
        and receive the initial weights."""
        import ray

        self.worker_idx = worker_idx
        rendezvous = ray.get_actor(self.connection_info_name)
        info: dict[str, Any]
        layout_dict: dict[str, Any]
        info, layout_dict = ray.get(rendezvous.group_info.remote())
        self.join(GroupInfo(**(info | {"secret": self.secret})), Layout.from_dict(layout_dict))
        return self.receive_weights(model=model, weights=weights, strategy=strategy)

    def attach_local(self, info: NodeLocalInfo) -> bool:
        """Take versions from the sender's shared memory if this actor is on its node."""
        if (self.local is not None and self.local.sender_pid == info.pid
                and self.local.address == info.address):
            return True
        self.detach_local()
        if self.backend == "gloo" and probe_node_local(info):
            self.local = NodeLocalReceiver(self.worker_idx, info)
        return self.local is not None

    def detach_local(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None

    def close(self) -> None:
        self.detach_local()
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.close()
            self.group = None
