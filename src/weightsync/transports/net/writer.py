"""The network transport's trainer end as the send lifecycle drives it (``core/endpoints``).

One listener (:class:`~.publisher.VersionPublisher`) at the scheme's address takes both the
workers' control connections (:class:`~.members.NetMembers`) and their hosts' fetches. A
version is packed once (cast to the wire dtype, checksummed per chunk) and each worker is
told of it; each host fetches it once, as whole chunks or as a delta against the version
it holds, and a send is delivered once every worker's host staged it. With several hosts,
the version leaves the trainer about once: hosts forward it along a chain, or a tree
(:mod:`.relay`), each chunk checked against the digests the trainer tells each host over
its own connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.layout import Layout
from weightsync.transports.net.members import NetMembers
from weightsync.transports.net.packed import plan
from weightsync.transports.net.publisher import JoinHandler, VersionPublisher

#: how long the figures of a version wait for streams whose verdict was just sent
_FIGURES_SETTLE_S = 1.0


def link_figures(publisher: VersionPublisher | None, version: int) -> dict[str, Any]:
    """What crossed a listener's link for ``version``: ``wire_bytes`` (every byte of its
    streams, headers and MACs included), ``hosts`` (fetches: one per host), ``chunks``,
    ``delta_chunks``, and ``whole`` (why a host got it whole, by host)."""
    streams = [] if publisher is None else publisher.figures(version, settle=_FIGURES_SETTLE_S)
    return {
        "wire_bytes": sum(s.wire_bytes for s in streams),
        "hosts": len(streams),
        "chunks": sum(s.chunks for s in streams),
        "delta_chunks": sum(s.delta_chunks for s in streams),
        "whole": {s.host: s.whole_reason for s in streams if s.whole_reason is not None},
    }


class Members(Protocol):
    """Whom a :class:`NetWriter` serves and how they hear of a version: the scheme's
    workers over their control connections (:class:`~.members.NetMembers`), or servers
    driven over their own API (the vLLM trainer engine's ``ServerMembers``). Each method
    is called from the :class:`NetWriter` method of the same lifecycle step."""

    #: held while a version is published (a worker that joins meanwhile is told of it)
    joining: threading.RLock

    @property
    def join_handler(self) -> JoinHandler | None:
        """Where the listener hands control connections (None: it refuses them)."""

    def started(self, publisher: VersionPublisher) -> None:
        """The listener is up (``start``): the session to tell, the streams to watch."""

    def published(self, version: int, layout: dict[str, Any],
                  extra: dict[str, Any] | None = None, nbytes: int = 0) -> None:
        """``version`` (``nbytes`` on the wire) is the one hosts fetch from now on."""

    def reachable(self, targets: list[int]) -> tuple[list[int], Losses]:
        """Those of ``targets`` that can be told of a version now, and why the others
        cannot."""

    def notify(self, targets: list[int], version: int) -> Losses:
        """Tell ``targets`` of ``version`` (their hosts start fetching); returns those lost."""

    def wait_staged(self, targets: list[int], version: int, deadline: Deadline,
                    lost: Losses, round_: str = "") -> None:
        """Until every target not in ``lost`` holds ``version`` (staged on its host; for
        the delivery ``round_`` of a sharded trainer's), adding those lost to ``lost``."""

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Until every member holds ``version`` or newer."""

    def held_versions(self) -> dict[int, int]:
        """Every member there now, with the version it holds (-1: none yet)."""

    def came_from(self, version: int) -> dict[str, dict[str, Any]]:
        """Per host that fetched ``version``: whom it fetched it from."""

    def close(self) -> None:
        """The sender leaves."""


class NetWriter:
    """The trainer's end: serves each version at ``address`` to the hosts of the workers
    (``members``: the scheme's workers, by default). ``metadata``: what every version's
    header carries besides the layout (a LoRA adapter's name and config)."""

    needs_acks = True  # a send returns once every worker's host staged the version

    def __init__(self, address: str, token: str, num_workers: int, *, timeout: float,
                 dtype: torch.dtype | None, delta: bool, members: Members | None = None,
                 metadata: Mapping[str, str] | None = None) -> None:
        self.address, self._token = address, token
        self.timeout, self.dtype, self.delta = timeout, dtype, delta
        self.members: Members = NetMembers(num_workers) if members is None else members
        self.metadata = dict(metadata or {})
        self.publisher: VersionPublisher | None = None
        self.pack_seconds = 0.0  # how long the newest version took to pack

    def start(self, deadline: Deadline) -> None:
        """Listen (the workers waiting to connect are let in from here)."""
        self.publisher = VersionPublisher(self.address, self._token, timeout=self.timeout,
                                          delta=self.delta, on_join=self.members.join_handler)
        self.members.started(self.publisher)

    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        """Pack the version once (tied names once), then make it the one hosts fetch."""
        assert self.publisher is not None
        started = time.perf_counter()
        weights = {spec.name: flat[spec.name] for spec in layout}
        packed = plan(weights, version, self.dtype, metadata=self.metadata)
        spare = self.publisher.spare_buffer(packed.nbytes)
        if spare is not None:  # a retired version's buffer: no page faults
            packed.buffer = spare
        packed.fill(weights)
        self.pack_seconds = time.perf_counter() - started
        with self.members.joining:
            self.publisher.publish(packed)
            self.members.published(version, layout.with_dtype(self.dtype).to_dict(),
                                   nbytes=packed.nbytes)
            return self.members.reachable(requested)[1]

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        return self.members.notify(targets, version)

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        self.members.wait_staged(targets, version, deadline, lost)

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        self.members.wait_joined(version, deadline)

    def held_versions(self) -> dict[int, int]:
        return self.members.held_versions()

    def version_figures(self, version: int) -> dict[str, Any]:
        """:func:`link_figures` (what left the trainer), and ``fetched_from``: per host
        (its id), its ``workers`` and whom it fetched the version ``from`` (``"trainer"``,
        or the id of the host that relayed it)."""
        return {**link_figures(self.publisher, version),
                "fetched_from": self.members.came_from(version)}

    def close(self) -> None:
        self.members.close()
        if self.publisher is not None:
            self.publisher.close()
