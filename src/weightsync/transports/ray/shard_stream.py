"""Point-to-point streams of a sharded trainer's pieces to the Ray scheme's relays.

Every trainer rank sends each relay actor (one group member per node) the pieces it writes
(``core/shards.local_pieces``: rows of a ``Shard(0)``, a column block of a ``Shard(1)``, a
replicated tensor from one rank only), in the layout's order, cut into chunks of whole rows
of the piece (at most :data:`CHUNK_BYTES`, or one row if a row is larger). Each chunk goes
as a header ``[payload bytes, checksum]`` then its payload, so a rank never holds more than
its shard plus a few chunks (a cast to the wire dtype copies one chunk at a time).

The relay knows from the plan which pieces each rank sends (their regions, announced by
every rank and checked by rank 0 before any byte is sent), posts the receives of every rank
at once, verifies each chunk against its header before writing it at its global position
in the staging buffer, and reports the ranks whose stream failed. Only a buffer every
rank's stream filled and verified may be taken by an actor.

Why not a broadcast per rank: every trainer rank is a member of the group, so a broadcast
from rank r would make every other trainer rank receive r's shard (a gather).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.core.errors import IntegrityError, WeightSyncError
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece, check_parts
from weightsync.transports.ray.group import WeightGroup, wire_checksum
from weightsync.transports.ray.p2p import live_pg, signed, wait_work

logger = logging.getLogger(__name__)

#: the most bytes of one chunk (a piece's rows are never split, so a single row larger than
#: this goes as one chunk)
CHUNK_BYTES = 4 << 20
#: chunks in flight per relay before the sender waits for the oldest
WINDOW = 4
#: test hook: called by a trainer rank with (version, chunk index) before each chunk is
#: sent (the fault tests kill the rank there)
SendHook = Callable[[int, int], None]
send_hook: SendHook | None = None
#: test hook: called by a relay with each received payload before it is verified
RecvHook = Callable[[torch.Tensor], None]


class StreamFailed(WeightSyncError):
    """A relay did not get a whole, verified stream from some trainer ranks (``ranks``)."""

    def __init__(self, message: str, *, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True)
class Chunk:
    """Rows ``lo:hi`` (along the piece's first dimension) of piece ``name``, whose region
    in the global tensor is ``region``; ``nbytes`` in the wire dtype."""

    name: str
    region: tuple[tuple[int, int], ...]
    lo: int
    hi: int
    nbytes: int


def regions_of(regions: Mapping[str, Sequence[int]]) -> dict[str, tuple[tuple[int, int], ...]]:
    """``describe_regions``' flat bounds back into ``name -> ((start, stop), ...)``."""
    return {name: tuple((int(b[2 * d]), int(b[2 * d + 1])) for d in range(len(b) // 2))
            for name, b in regions.items()}


def chunk_plan(layout: Layout, regions: Mapping[str, Sequence[int]],
               chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """The chunks one rank sends (and a relay expects from it), in the layout's order;
    ``layout`` is the wire layout (its dtypes size the chunks). Rank 0 picks
    ``chunk_bytes`` and sends it with each plan, so every side cuts the same chunks."""
    by_name = regions_of(regions)
    chunks: list[Chunk] = []
    for spec in layout.specs:
        region = by_name.get(spec.name)
        if region is None:
            continue
        shape = [hi - lo for lo, hi in region]
        itemsize = torch.empty(0, dtype=spec.dtype).element_size()
        if not shape:  # a 0-dim tensor: one chunk of one element
            chunks.append(Chunk(spec.name, region, 0, 1, itemsize))
            continue
        rows = shape[0]
        row_bytes = itemsize * (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1)
        if rows == 0 or row_bytes == 0:
            continue
        step = max(1, chunk_bytes // row_bytes)
        chunks += [Chunk(spec.name, region, lo, min(lo + step, rows),
                         (min(lo + step, rows) - lo) * row_bytes) for lo in range(0, rows, step)]
    return chunks


def send_pieces(group: WeightGroup, pieces: Sequence[ShardPiece], layout: Layout,
                regions: Mapping[str, Sequence[int]], relays: Sequence[int], version: int,
                timeout: float | None, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Send this rank's ``pieces`` (announced as ``regions``) to every group rank in
    ``relays``, chunk by chunk, each chunk to all relays at once; returns the payload bytes
    sent. Raises RuntimeError if the group fails or ``timeout`` runs out."""
    pg = live_pg(group)
    by_name = {p.name: p for p in pieces}
    plan = chunk_plan(layout, regions, chunk_bytes)
    in_flight: list[tuple[Any, list[torch.Tensor]]] = []
    sent = 0
    for index, chunk in enumerate(plan):
        if send_hook is not None:
            send_hook(version, index)
        local = by_name[chunk.name].local
        local = local.detach()
        rows = local.reshape(1) if local.dim() == 0 else local[chunk.lo:chunk.hi]
        rows = rows.to(device="cpu", dtype=layout[chunk.name].dtype).contiguous()
        payload = rows.reshape(-1).view(torch.uint8)
        if payload.storage_offset() % 8:  # an 8-byte-aligned copy: the fast path of both ends
            payload = payload.clone()
        if payload.numel() != chunk.nbytes:
            raise WeightSyncError(f"key {chunk.name!r}: chunk {index} of version {version} has "
                                  f"{payload.numel()} bytes, the plan says {chunk.nbytes}")
        header = torch.tensor([chunk.nbytes, signed(wire_checksum(payload))], dtype=torch.int64)
        works = []
        for relay in relays:
            works.append(pg.send([header], relay, 2 * index))
            works.append(pg.send([payload], relay, 2 * index + 1))
        in_flight.append((works, [header, payload]))
        sent += payload.numel() * len(relays)
        if len(in_flight) > WINDOW:
            for work in in_flight.pop(0)[0]:
                wait_work(work, timeout)
    for works, _alive in in_flight:
        for work in works:
            wait_work(work, timeout)
    return sent


@dataclass
class _Posted:
    index: int
    header: torch.Tensor
    payload: torch.Tensor
    works: list[Any]


def receive_pieces(group: WeightGroup, layout: Layout, views: Mapping[str, torch.Tensor],
                   regions_by_rank: Mapping[int, Mapping[str, Sequence[int]]], version: int,
                   timeout: float | None, hook: RecvHook | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> int:
    """A relay: take every trainer rank's stream of ``version`` and write each chunk, once
    verified against its header, at its global position in ``views`` (``name -> global
    tensor view`` of a staging buffer). Returns the bytes received. Raises
    :class:`StreamFailed` naming the ranks whose stream broke (after waiting for the
    others, so that the ranks named are the ones at fault), :class:`IntegrityError` if a
    chunk does not match its checksum, or if the plan's regions do not cover each tensor
    exactly once (``check_parts``: then every stream is still taken, so that the ranks
    are not left waiting, and nothing is written)."""
    pg = live_pg(group)
    refused: IntegrityError | None = None
    try:
        check_parts({spec.name: spec.shape for spec in layout.specs}, regions_by_rank,
                    f"version {version}")
    except IntegrityError as exc:
        refused = exc
    plans = {rank: chunk_plan(layout, regions, chunk_bytes)
             for rank, regions in regions_by_rank.items()}
    posted: dict[int, list[_Posted]] = {}
    failed: dict[int, str] = {}
    received = 0

    def post(rank: int, index: int, slot: int) -> _Posted:
        chunk = plans[rank][index]
        buffer = _buffers[(rank, slot)]
        header = torch.zeros(2, dtype=torch.int64)
        payload = buffer[:chunk.nbytes]
        works = [pg.recv([header], rank, 2 * index), pg.recv([payload], rank, 2 * index + 1)]
        return _Posted(index, header, payload, works)

    size = max((c.nbytes for plan in plans.values() for c in plan), default=0)
    _buffers = {(rank, slot): torch.empty(size, dtype=torch.uint8)
                for rank in plans for slot in (0, 1)}
    def fail(rank: int, exc: RuntimeError) -> None:
        failed[rank] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        posted[rank] = []

    for rank, plan in plans.items():
        posted[rank] = []
        try:
            posted[rank] = [post(rank, 0, 0)] if plan else []
        except RuntimeError as exc:  # the group broke before this rank's stream began
            fail(rank, exc)
    bad: list[str] = []
    while any(posted.values()):
        for rank in sorted(posted):
            if not posted[rank]:
                continue
            current = posted[rank].pop(0)
            plan = plans[rank]
            try:
                for work in current.works:
                    wait_work(work, timeout)
                nxt = current.index + 1
                if nxt < len(plan):  # the next chunk lands while this one is checked
                    posted[rank].append(post(rank, nxt, nxt % 2))
            except RuntimeError as exc:  # (a broken pair can close the others: all named)
                fail(rank, exc)
                continue
            chunk = plan[current.index]
            nbytes, want = (int(v) for v in current.header.tolist())
            if hook is not None:
                hook(current.payload)
            if nbytes != chunk.nbytes or wire_checksum(current.payload) != want & 0xFFFFFFFFFFFFFFFF:
                bad.append(f"trainer rank {rank} chunk {current.index} (key {chunk.name!r})")
                continue
            if refused is None:
                _place(layout, views, chunk, current.payload)
            received += chunk.nbytes
    if failed:
        raise StreamFailed(
            f"version {version}: the stream from trainer rank(s) {sorted(failed)} broke ("
            + "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items())) + ")",
            ranks=sorted(failed))
    if refused is not None:
        raise refused
    if bad:
        raise IntegrityError(f"version {version} arrived corrupted: {len(bad)} chunk(s) differ "
                             f"from their checksums, first: {bad[0]}; it is dropped")
    return received


def _place(layout: Layout, views: Mapping[str, torch.Tensor], chunk: Chunk,
           payload: torch.Tensor) -> None:
    """Write a verified chunk into its rows of its region of the global view."""
    spec = layout[chunk.name]
    target = views[chunk.name]
    if not chunk.region:
        target.copy_(payload.view(spec.dtype).reshape(()))
        return
    block = target[tuple(slice(lo, hi) for lo, hi in chunk.region)][chunk.lo:chunk.hi]
    block.copy_(payload.view(spec.dtype).reshape(block.shape))
