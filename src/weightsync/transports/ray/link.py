"""An actor's link to the trainer's bytes: the group generation it is a member of, or the
shared memory on its node it copies versions out of, and the wire layout it takes them in.

The actor's reader (``reader``) drives it: ``join`` for each group generation,
``attach_local`` when the actor shares a node with the sender or a relay, and the
``receive_*`` calls for one broadcast each.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch

from weightsync.core.layout import Layout
from weightsync.transports.ray.group import (
    GroupInfo,
    WeightGroup,
    WireHook,
    bucket_buffers,
    wire_device,
)
from weightsync.transports.ray.node_local import NodeLocalInfo, NodeLocalReceiver, probe_node_local


class ActorLink:
    """Worker ``worker_idx``'s place in the transfer: a rank of the group (``group``), or
    a reader of its node's shared memory (``local``), with the ``layout`` on the wire."""

    #: tests: corrupt received bytes "on the wire", before any checksum sees them
    wire_hook: ClassVar[WireHook | None] = None

    def __init__(self, worker_idx: int, backend: str) -> None:
        self.worker_idx = worker_idx
        self.backend = backend
        self.group: WeightGroup | None = None
        self.layout: Layout | None = None
        self.local: NodeLocalReceiver | None = None

    @property
    def joined(self) -> bool:
        return self.layout is not None and (self.group is not None or self.local is not None)

    def join(self, info: GroupInfo, layout: Layout) -> None:
        """Join ``info``'s group generation (blocks until every member has joined); an actor
        that maps the sender's snapshot is not a member and takes its bytes from there."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.layout = layout.on_device(wire_device(self.backend))
        if self.worker_idx in info.ranks or self.local is None:
            self.group = WeightGroup(info, info.rank_of(self.worker_idx))

    def _wire(self, buffers: dict[str, torch.Tensor]) -> tuple[WeightGroup, list[torch.Tensor]]:
        if self.group is None or self.layout is None:
            raise RuntimeError(f"worker {self.worker_idx} has not joined a group")
        return self.group, bucket_buffers(self.layout, buffers)

    def receive_unverified(self, buffers: dict[str, torch.Tensor], timeout: float | None,
                           checked: bool) -> list[int] | None:
        """Take one broadcast into ``buffers``; returns the sender's checksums (if
        ``checked``) for the caller to verify before use."""
        group, wire = self._wire(buffers)
        if not checked:
            group.broadcast(wire, timeout)
            return None
        return group.receive_sums(wire, timeout, ActorLink.wire_hook)

    def receive_verified(self, buffers: dict[str, torch.Tensor], timeout: float | None,
                         checked: bool) -> tuple[list[int] | None, bool]:
        """Take one broadcast into ``buffers``, verifying each chunk (if ``checked``) while
        the next one arrives; returns the sender's checksums and whether every chunk
        matched them."""
        group, wire = self._wire(buffers)
        if not checked:
            group.broadcast(wire, timeout)
            return None, True
        sums, bad = group.receive_verified(wire, timeout, ActorLink.wire_hook)
        return sums, not bad

    def attach_local(self, info: NodeLocalInfo) -> bool:
        """Take versions from the sender's (or a relay's) shared memory if this actor is on
        its node; True if so."""
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
