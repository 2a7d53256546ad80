"""The MultiProcess data path's two buffers: the sender's :class:`Snapshot` and a worker's
:class:`Staging`, with the stream of messages between them (:class:`StagedStream`).

The sender packs each version into a snapshot buffer (one copy, so later optimizer steps
cannot leak into a send in flight) and streams each piece as soon as it is packed
(``mp.streams``); the worker reads straight into one of two staging buffers and applies it
to its model only when asked, so a transfer cut off half-way never reaches the model.

On the wire, a stream is one ``mp.layout`` message (the layout the versions share), then
one ``mp.weights`` message per version: a header naming the version and the layout's
fingerprint, and the raw bytes (after it on the socket, or through a pipe beside it).
:class:`~weightsync.transports.mp.endpoints.StreamWriter` / ``StreamReader`` use these
directly; TorchRL's ``MPTransport`` (``mp.transport``) is an adapter over the same classes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.core.staging import StagingBuffers
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import ChannelTimeout, Message
from weightsync.transports.memory.pieces import PiecePlan

__all__ = ["LAYOUT", "WEIGHTS", "PackAbandoned", "Snapshot", "StagedStream", "Staging", "as_bytes",
           "layout_header"]

#: the MultiProcess stream's messages: the layout (once per stream), then each version
LAYOUT, WEIGHTS = "mp.layout", "mp.weights"


def layout_header(layout: Layout) -> dict[str, Any]:
    """The header of the message that opens a stream: the layout every version has."""
    return {"t": LAYOUT, "layout": layout.to_dict()}


def as_bytes(buffer: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU uint8 tensor."""
    return memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


class PackAbandoned(OSError):
    """The pack of a snapshot failed after its first bytes were streamed: the frame cannot
    be completed, so the stream that carried it breaks (the receiver stages nothing)."""


class Snapshot:
    """A sender-side packed copy of one version, streamable while it is being packed.

    ``fill`` packs piece by piece and raises a watermark as it goes; ``pieces`` yields the
    payload a piece at a time as the watermark passes it, so a streamer writes each piece
    to its socket while the next one is packed (the pack and the transfer overlap)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout.on_device("cpu")
        self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        self.version = NO_VERSION
        self.lock = threading.Lock()
        self._plan = PiecePlan(self.layout)
        self._views = self._plan.buffer_views({"cpu": self.buffer})
        self._progress = threading.Condition()
        self.packed = 0  # bytes of ``version`` packed so far
        self.failed = False

    def fill(self, flat: Mapping[str, torch.Tensor], version: int,
             on_started: Callable[[], None] | None = None) -> None:
        """Pack ``flat`` as ``version``; ``on_started`` runs once the snapshot names the new
        version (its readers follow the pack from there)."""
        with self.lock:
            with self._progress:
                self.version, self.packed, self.failed = version, 0, False
            try:
                if on_started is not None:
                    on_started()
                self._plan.pack(flat, {"cpu": self.buffer}, self._advance, self._views)
            except BaseException:
                with self._progress:
                    self.failed = True
                    self._progress.notify_all()
                raise

    def _advance(self, watermark: int) -> None:
        with self._progress:
            self.packed = watermark
            self._progress.notify_all()

    @property
    def complete(self) -> bool:
        return self.packed == self.layout.nbytes and not self.failed

    def spans(self, deadline: Deadline) -> Iterator[tuple[int, int]]:
        """Byte ranges ``[lo, hi)`` of the payload, each as soon as it is packed (every
        byte in a yielded range is final)."""
        sent, total = 0, self.layout.nbytes
        while sent < total:
            with self._progress:
                while self.packed <= sent and not self.failed:
                    if deadline.expired():
                        raise ChannelTimeout(f"version {self.version} was not packed within {deadline}")
                    self._progress.wait(deadline.slice(0.5))
                if self.failed:
                    raise PackAbandoned(f"the pack of version {self.version} failed mid-way")
                mark = self.packed
            yield sent, mark
            sent = mark

    def pieces(self, deadline: Deadline) -> Iterator[memoryview]:
        """The payload, each piece as soon as it is packed (every yielded byte is final)."""
        data = as_bytes(self.buffer)
        for lo, hi in self.spans(deadline):
            yield data[lo:hi]

    def header(self) -> dict[str, Any]:
        return {"t": WEIGHTS, "v": self.version, "fingerprint": self.layout.fingerprint}


class Staging(StagingBuffers):
    """Receiver side: the staging buffers, filled from the wire after checking the header."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout.on_device("cpu"))

    def receive(self, message: Message, read_into: Callable[[memoryview], None]) -> int:
        """Read the payload of ``message`` into a free buffer via ``read_into(view)``."""
        header = message.header
        if header.get("fingerprint") != self.layout.fingerprint:
            raise IntegrityError(
                f"weights for layout {header.get('fingerprint')} arrived, expected "
                f"{self.layout.fingerprint}"
            )
        # bytes that come through a pipe beside the socket are announced in the header
        announced = header.get("pipe_nbytes", message.payload_nbytes)
        if announced != self.layout.nbytes:
            raise IntegrityError(
                f"version {header.get('v')}: {announced} bytes announced, the layout "
                f"needs {self.layout.nbytes}"
            )
        return self.fill(int(header["v"]), lambda buffers: read_into(as_bytes(buffers["cpu"])))


class StagedStream:
    """A worker's side of one stream: the layout message makes the :class:`Staging`, each
    weights message stages a version there, and ``apply_staged`` copies the newest into the
    model at the worker's call."""

    def __init__(self) -> None:
        self._staging: Staging | None = None

    def handle_message(self, message: Message, read_into: Callable[[memoryview], None]) -> int | None:
        """Take one message from the sender; returns the version staged, if it carried one
        (its bytes read by ``read_into``)."""
        kind = message.header.get("t")
        if kind == LAYOUT:
            self._staging = Staging(Layout.from_dict(message.header["layout"]))
            return None
        if kind == WEIGHTS:
            if self._staging is None:
                raise IntegrityError("weights arrived before their layout")
            return self._staging.receive(message, read_into)
        return None

    @property
    def sender_layout(self) -> Layout | None:
        """The layout the stream opened with (None: not yet)."""
        return None if self._staging is None else self._staging.layout

    def apply_staged(self, dest: Mapping[str, torch.Tensor], held_version: int) -> int | None:
        """Copy the newest staged version into ``dest`` if newer than ``held_version``."""
        return None if self._staging is None else self._staging.apply(dest, held_version)
