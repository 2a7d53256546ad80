"""Per-node streams of the Ray scheme with ``delta=True``: the trainer sends each node the
chunks of a version as differences from the version that node holds, point to point over
the group (one node's base may differ from another's, so no broadcast).

Each chunk goes as a small header (kind, payload size, the checksum of the new chunk) then
its payload (see ``delta``), always as two messages (an empty payload too), so a receiver
that refuses a header still takes exactly the messages that were sent. The receiver checks
every header against its chunk before it allocates anything (``header_problem``: a known
kind, a size that kind can have for that chunk, a base to apply a delta to) and receives
every payload into room for one chunk, the most any valid payload takes; a refused header
is an :class:`IntegrityError` for that version like a checksum that differs.

The trainer keeps the previous packed version beside the newest (two buffers, swapped: one
extra copy of the version); each receiving node keeps the last version it verified (one
extra copy). A node gets deltas only against the exact snapshot the trainer knows it holds
(``SnapshotId``); anything else goes whole. The node rebuilds every chunk, verifies it
against the sender's checksum before any worker may take it, and only then makes it its new
base: a mismatch refuses the version (:class:`IntegrityError`) and leaves the base as it
was.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weightsync.core.errors import IntegrityError
from weightsync.core.layout import Layout
from weightsync.transports.delta.codec import (
    WHOLE,
    DeltaDecoder,
    DeltaEncoder,
    header_problem,
)
from weightsync.transports.delta.errors import MalformedDeltaError
from weightsync.transports.ray.delivery import DeltaStream
from weightsync.transports.ray.group import (
    FillChunk,
    WeightGroup,
    _chunks,
    bucket_buffers,
    wire_checksum,
)
from weightsync.transports.ray.p2p import live_pg, signed, wait_work

logger = logging.getLogger(__name__)

Buffers = dict[str, torch.Tensor]
#: test hook: called with each rebuilt chunk ([chunk]) before it is verified
ChunkHook = Callable[[list[torch.Tensor]], None]
#: test hook: called with each chunk's index and header tensor (kind, payload bytes,
#: checksum) as it arrives, before it is checked (to corrupt it "on the wire")
HeaderHook = Callable[[int, torch.Tensor], None]
#: threads that encode chunks ahead of the one on the wire (zstd and torch release the GIL)
ENCODE_THREADS = 2
_Encoded = tuple[int, int, dict[str | None, tuple[int, torch.Tensor]]]


@dataclass
class WireFigures:
    """What crossed the network for one version, all nodes together."""

    wire_bytes: int = 0
    chunks: int = 0
    delta_chunks: int = 0  # sent as a delta (an unchanged chunk counts, at 0 bytes)
    delta_refused: int = 0  # nodes whose rebuilt version failed its checksums (sent whole)

    def add(self, other: WireFigures) -> None:
        self.wire_bytes += other.wire_bytes
        self.chunks += other.chunks
        self.delta_chunks += other.delta_chunks
        self.delta_refused += other.delta_refused

    def as_dict(self) -> dict[str, int]:
        return {"wire_bytes": self.wire_bytes, "chunks": self.chunks,
                "delta_chunks": self.delta_chunks, "delta_refused": self.delta_refused}


@dataclass
class _Snapshot:
    id: str
    buffers: Buffers
    version: int | None = None  # the version it was packed for


#: why a node gets a version whole instead of deltas: the keys of
#: ``stats()["whole_versions"]``
WHOLE_FIRST = "first_version"  # nothing was sent before: no base anywhere
WHOLE_NO_BASE = "no_base"  # the node verified nothing the trainer knows of (see the log)
WHOLE_NEW_ACTOR = "new_actor"  # the actor that verified the base was replaced
WHOLE_BEHIND = "behind"  # the node holds an older version (it skipped one)
WHOLE_REFUSED = "refused"  # the node refused the delta (checksums): resent whole
WHOLE_REASONS = (WHOLE_FIRST, WHOLE_NO_BASE, WHOLE_NEW_ACTOR, WHOLE_BEHIND, WHOLE_REFUSED)


@dataclass(frozen=True)
class _Held:
    """The snapshot a worker's node verified last, and the actor that said so."""

    handle: Any
    snapshot_id: str
    version: int | None


@dataclass
class DeltaSender:
    """The trainer's side: two packed buffers (the newest snapshot and the one before, the
    base of the deltas) and the snapshot each worker's node verified last."""

    layout: Layout  # the wire layout (CPU)
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    latest: _Snapshot | None = None
    previous: _Snapshot | None = None
    bases: dict[int, _Held] = field(default_factory=dict)  # worker -> what its node holds
    #: worker -> why the trainer does not know its node's base (its last answer lacked one)
    unknown: dict[int, str] = field(default_factory=dict)
    #: versions sent whole to a node, by reason (``WHOLE_REASONS``), since the start
    whole_versions: dict[str, int] = field(default_factory=dict)
    _spare: Buffers | None = None
    _count: int = 0
    _local: threading.local = field(default_factory=threading.local)  # one encoder a thread
    _pool: ThreadPoolExecutor | None = None

    def next_buffers(self) -> Buffers:
        """Buffers to pack the next version into (never the newest snapshot's)."""
        if self.previous is not None:
            return self.previous.buffers
        if self._spare is None:
            self._spare = self.layout.allocate()
        return self._spare

    def packed(self, buffers: Buffers, version: int | None = None) -> str:
        """``buffers`` (from :meth:`next_buffers`) now hold the newest snapshot (of
        ``version``); its id."""
        self._count += 1
        snapshot = _Snapshot(f"{self.nonce}:{self._count}", buffers, version)
        self.previous, self.latest = self.latest, snapshot
        self._spare = None
        return snapshot.id

    def base_for(self, worker_idx: int, handle: Any) -> str | None:
        """The snapshot a delta for this worker's node is taken against (None: whole, see
        :meth:`why_whole`)."""
        if self.why_whole(worker_idx, handle) is not None or self.previous is None:
            return None
        return self.previous.id

    def why_whole(self, worker_idx: int, handle: Any) -> tuple[str, str] | None:
        """Why this worker's node (its actor ``handle``) gets the newest snapshot whole:
        ``(reason, what happened)``, the reason one of ``WHOLE_REASONS``; None: it gets
        deltas against the previous snapshot."""
        previous = self.previous
        if previous is None:
            return WHOLE_FIRST, "nothing was sent before, so no node holds a base"
        held = self.bases.get(worker_idx)
        if held is None:
            return WHOLE_NO_BASE, self.unknown.get(worker_idx,
                                                   "its node has verified no version yet")
        if held.handle is not handle:
            return WHOLE_NEW_ACTOR, (f"a new actor: the one that verified "
                                     f"{_version_name(held.version)} was replaced")
        if held.snapshot_id != previous.id:
            return WHOLE_BEHIND, (f"its node holds {_version_name(held.version)}, the deltas "
                                  f"are against {_version_name(previous.version)} (it missed "
                                  "a version)")
        return None

    def remember(self, worker_idx: int, handle: Any, snapshot_id: str | None,
                 why: str = "its node named no verified version") -> None:
        """The snapshot this worker's node verified last (None: unknown, ``why``)."""
        if snapshot_id is None:
            self.bases.pop(worker_idx, None)
            self.unknown[worker_idx] = why
            return
        version = next((s.version for s in (self.latest, self.previous)
                        if s is not None and s.id == snapshot_id), None)
        self.bases[worker_idx] = _Held(handle, snapshot_id, version)
        self.unknown.pop(worker_idx, None)

    def count_whole(self, reason: str) -> None:
        """One node got a version whole for ``reason`` (``stats()["whole_versions"]``)."""
        self.whole_versions[reason] = self.whole_versions.get(reason, 0) + 1

    def _encode(self, index: int, piece: torch.Tensor, base: torch.Tensor | None,
                base_id: str | None, fill: FillChunk | None) -> _Encoded:
        """Chunk ``index`` (packed first by ``fill``, if given): its checksum and its
        encodings (whole, and against ``base``)."""
        if fill is not None:
            fill(index, piece)
        encoded: dict[str | None, tuple[int, torch.Tensor]] = {None: (WHOLE, piece)}
        if base is not None:
            encoder = getattr(self._local, "encoder", None)
            if encoder is None:
                encoder = self._local.encoder = DeltaEncoder()
            encoded[base_id] = encoder.encode(piece, base)
        return index, signed(wire_checksum(piece)), encoded

    def send(self, group: WeightGroup, targets: Mapping[int, str | None],
             timeout: float | None, fill: FillChunk | None = None) -> WireFigures:
        """Send the newest snapshot to each rank of ``targets`` (rank -> base id, None for
        whole chunks); each chunk is encoded once (for all ranks with the same base), on
        ``ENCODE_THREADS`` threads ahead of the chunk on the wire. ``fill(index, chunk)``
        packs each chunk of the snapshot just before it is encoded (every chunk, even with
        no target), so the pack overlaps the encoding and the wire."""
        assert self.latest is not None
        pg, figures = live_pg(group), WireFigures()
        pieces = _chunks(bucket_buffers(self.layout, self.latest.buffers))
        if not targets:
            if fill is not None:
                for index, piece in enumerate(pieces):
                    fill(index, piece)
            return figures
        base_id = self.previous.id if self.previous is not None else None
        bases = (_chunks(bucket_buffers(self.layout, self.previous.buffers))
                 if self.previous is not None and base_id in targets.values() else None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="weightsync-delta")
        futures: list[Future[_Encoded]] = [
            self._pool.submit(self._encode, i, piece, None if bases is None else bases[i], base_id,
                              fill)
            for i, piece in enumerate(pieces)]
        works: list[Any] = []
        alive: list[torch.Tensor] = []  # payloads and headers, until their sends complete
        try:
            for future in futures:
                index, checksum, encoded = future.result()
                for rank, base in targets.items():
                    kind, payload = encoded[base if base in encoded else None]
                    header = torch.tensor([kind, payload.numel(), checksum], dtype=torch.int64)
                    alive += [header, payload]
                    works.append(pg.send([header], rank, 2 * index))
                    works.append(pg.send([payload], rank, 2 * index + 1))  # even empty
                    figures.wire_bytes += payload.numel() + header.numel() * 8
                    figures.chunks += 1
                    figures.delta_chunks += kind != WHOLE
            for work in works:
                wait_work(work, timeout)
        except BaseException:
            # a failed stream: no encode thread may still write (``fill``) into the
            # snapshot once this returns (the caller then packs it whole)
            for future in futures:
                future.cancel()
            wait_futures(futures)
            raise
        return figures

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _version_name(version: int | None) -> str:
    return "an earlier version" if version is None else f"version {version}"


class DeltaReceiver:
    """A node's side (the actor that takes the node's stream): its base, the last version
    it verified, and the scratch a delta's payload lands in."""

    #: test hook, see :data:`HeaderHook` (None in normal use)
    header_hook: ClassVar[HeaderHook | None] = None

    def __init__(self, layout: Layout, worker_idx: int) -> None:
        self.layout = layout
        self.worker_idx = worker_idx
        self.base: Buffers | None = None
        self.base_id: str | None = None
        self._copying: threading.Thread | None = None  # the base being updated
        self._scratch = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self._decoder = DeltaDecoder()

    def receive(self, group: WeightGroup, buffers: Buffers, plan: DeltaStream,
                version: int, timeout: float | None, hook: ChunkHook | None = None) -> None:
        """Take the stream of ``version`` (``plan``: its snapshot ``id`` and the ``base`` id
        it is encoded against) into ``buffers``, verify every chunk, and make it the base;
        IntegrityError naming the chunks that do not match (the base is kept)."""
        pg = live_pg(group)
        self._settle()
        pieces = _chunks(bucket_buffers(self.layout, buffers))
        usable = plan.base is not None and plan.base == self.base_id
        bases = (_chunks(bucket_buffers(self.layout, self.base))
                 if usable and self.base is not None else None)
        headers = torch.zeros(len(pieces), 3, dtype=torch.int64)
        heads = [pg.recv([headers[i]], 0, 2 * i) for i in range(len(pieces))]  # all posted
        bad: list[tuple[int, str]] = []
        pending: tuple[int, int, Any, torch.Tensor, int] | None = None
        for index in range(len(pieces) + 1):
            arriving = None
            if index < len(pieces):  # post chunk index's payload, then rebuild the one before
                wait_work(heads[index], timeout)
                arriving = self._post_payload(pg, index, headers[index], pieces[index],
                                              bases is not None, bad)
            if pending is not None:
                done, kind, work, payload, want = pending
                wait_work(work, timeout)
                why = None if kind < 0 else self._rebuild(done, kind, payload, pieces[done], bases)
                if why is None and kind >= 0:
                    if hook is not None:
                        hook([pieces[done]])
                    if signed(wire_checksum(pieces[done])) != want:
                        why = "its checksum differs from the sender's"
                if why is not None:
                    bad.append((done, why))
            pending = arriving
        if bad:
            bad.sort()
            first, why = bad[0]
            raise IntegrityError(
                f"worker {self.worker_idx} (host {socket.gethostname()}): version {version} "
                f"rebuilt from {'deltas' if usable else 'whole chunks'} does not match the "
                f"sender: {len(bad)} chunk(s) of {len(pieces)} refused (first: chunk {first}, "
                f"{why}); no worker takes it, and this node gets it whole")
        self._remember(buffers, str(plan.id))

    def _post_payload(self, pg: Any, index: int, header: torch.Tensor, piece: torch.Tensor,
                      has_base: bool, bad: list[tuple[int, str]]
                      ) -> tuple[int, int, Any, torch.Tensor, int]:
        """Check chunk ``index``'s ``header`` and post the receive of its payload: into the
        chunk itself when whole, else into scratch room for one chunk (a payload never
        takes more). ``(index, kind, work, payload, checksum)``; kind -1 if the header was
        refused (appended to ``bad``): its payload is still taken, then dropped."""
        if DeltaReceiver.header_hook is not None:
            DeltaReceiver.header_hook(index, header)
        kind, size, want = (int(v) for v in header.tolist())
        problem = header_problem(kind, size, piece.numel(), has_base)
        if problem is not None:
            bad.append((index, f"its header is refused: {problem}"))
            kind, size = -1, 0
        room = piece if kind == WHOLE else self._payload(index % 2, piece.numel())
        work = pg.recv([room], 0, 2 * index + 1)
        return index, kind, work, room[:size], want

    def _rebuild(self, index: int, kind: int, payload: torch.Tensor, piece: torch.Tensor,
                 bases: Sequence[torch.Tensor] | None) -> str | None:
        """Rebuild chunk ``index`` into ``piece`` from what arrived (``payload``: the chunk
        itself when whole; the header was checked); why not, if it cannot be."""
        if kind == WHOLE:
            return None
        assert bases is not None  # header_problem refuses a delta without a base
        try:
            self._decoder.decode(kind, payload, bases[index], piece)
        except MalformedDeltaError as exc:
            return str(exc)
        return None

    def _payload(self, slot: int, size: int) -> torch.Tensor:
        """Scratch ``slot`` (two: one is rebuilt from while the other arrives), ``size``
        bytes (at most a chunk's)."""
        scratch = self._scratch[slot]
        if scratch.numel() < size:
            scratch = self._scratch[slot] = torch.empty(size, dtype=torch.uint8)
        return scratch[:size]

    def _remember(self, buffers: Buffers, snapshot_id: str) -> None:
        """Make the verified ``buffers`` the base: copied on a thread, off the answer to
        the sender and the actor's apply (the next stream waits for it; ``buffers``, a
        staging buffer, is not refilled before then)."""
        if self.base is None:
            self.base = self.layout.allocate()
        base = self.base

        def copy() -> None:
            for device, buffer in buffers.items():
                base[device].copy_(buffer)

        self._copying = threading.Thread(target=copy, name="weightsync-delta-base", daemon=True)
        self._copying.start()
        self.base_id = snapshot_id

    def _settle(self) -> None:
        """Wait until the base is updated."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None

    def forget(self) -> None:
        """Drop the base (its memory too): the next version comes whole."""
        self._settle()
        self.base = self.base_id = None
