"""A trainer rank's share of a sharded model: which rows and columns of each global tensor
it writes, found from its own parameters without talking to any other rank.

An FSDP2 or tensor-parallel parameter is a ``DTensor``: its shape is the global one and its
placements say which block this rank holds (``Shard(d)``: a slice of dimension ``d``,
uneven where the size does not divide; ``Replicate()``: the whole dimension, written only
by the ranks at coordinate 0 of that mesh dimension, so each byte has one writer).
Frameworks without DTensor (Megatron-style plain tensors) register a :class:`LocalShard`;
a plain tensor on a sharded rank is a full copy, written by rank 0 only.

Each rank builds the same *global* :class:`~weightsync.core.layout.Layout` from shapes and
dtypes alone, so every rank packs into the same slot at the same offsets; rank 0 checks
that the regions all ranks announce tile every tensor exactly once (:func:`check_cover`), and
a receiver that puts the ranks' parts together itself checks them again (:func:`check_parts`).
"""

from __future__ import annotations

import itertools
import math
import numbers
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.core.errors import IntegrityError, SchemaMismatchError
from weightsync.core.layout import Layout, TensorSpec
from weightsync.core.strategy import flat_tensors

#: ``(start, stop)`` per dimension of a global tensor
Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LocalShard:
    """A rank's block of a global tensor, for frameworks without DTensor.

    ``tensor`` holds rows/columns ``offsets[d] : offsets[d] + tensor.shape[d]`` of a tensor
    of ``global_shape``; exactly one rank must register each block (a replicated tensor:
    register it as a plain tensor, which rank 0 writes)."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.global_shape)
        offsets = tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "offsets", offsets)
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"LocalShard.tensor must be a tensor, got {type(self.tensor).__name__}")
        if not len(shape) == len(offsets) == self.tensor.dim():
            raise ValueError(f"LocalShard: global_shape {shape} and offsets {offsets} need one "
                             f"entry per dimension of the local tensor {tuple(self.tensor.shape)}")
        for dim, (size, start, local) in enumerate(zip(shape, offsets, self.tensor.shape, strict=True)):
            if start < 0 or start + local > size:
                raise ValueError(f"LocalShard: dimension {dim}: rows {start}..{start + local} "
                                 f"do not fit in the global size {size}")


@dataclass(frozen=True)
class ShardPiece:
    """One tensor's part that this rank writes: ``local`` goes to ``region`` of the global
    tensor ``name``."""

    name: str
    local: torch.Tensor
    region: Region


def _is_dtensor(value: object) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


def is_sharded_value(value: object) -> bool:
    """A DTensor or a :class:`LocalShard` (what only a sharded sender accepts)."""
    return isinstance(value, LocalShard) or _is_dtensor(value)


def global_shape_and_dtype(name: str, value: Any) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(value, LocalShard):
        return value.global_shape, value.tensor.dtype
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise ValueError(f"entry {name!r} is on the meta device and holds no data")
        return tuple(value.shape), value.dtype
    raise TypeError(f"entry {name!r} is a {type(value).__name__}; a sharded sender takes "
                    "tensors, DTensors and weightsync.LocalShard")


def sharded_flat(source: Any, *, what: str = "weights") -> dict[str, Any]:
    """A sharded rank's model as ``name -> DTensor | LocalShard | tensor``: a module's
    parameters and buffers (DTensors stay DTensors), or a flat mapping that may hold
    :class:`LocalShard` values."""
    if isinstance(source, Mapping) and any(isinstance(v, LocalShard) for v in source.values()):
        out: dict[str, Any] = {}
        for name, value in source.items():
            if not isinstance(name, str):
                raise TypeError(f"{what}: keys must be str, got {type(name).__name__} {name!r}")
            if not isinstance(value, (LocalShard, torch.Tensor)):
                raise TypeError(f"{what}: entry {name!r} is a {type(value).__name__}; expected "
                                "a tensor, a DTensor or a weightsync.LocalShard")
            out[name] = value
        return out
    return flat_tensors(source, what=what)


def global_layout(flat: Mapping[str, Any]) -> Layout:
    """The layout every rank agrees on: global shapes and dtypes, in the given order, all in
    host memory (the slot; a rank's shards may live on its GPU). Ties are not kept: each
    name is its own tensor."""
    return Layout(TensorSpec(name, *global_shape_and_dtype(name, value), "cpu")
                  for name, value in flat.items())


def _dtensor_piece(name: str, value: Any) -> ShardPiece | None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank holds no part of the tensor
        return None
    for dim, placement in enumerate(value.placements):
        if isinstance(placement, Replicate):
            if coordinate[dim] != 0:
                return None  # another rank holds the same bytes and writes them
        elif type(placement) is not Shard:
            raise ValueError(
                f"entry {name!r}: placement {placement} on mesh dimension {dim} is not "
                "supported (Shard(d) and Replicate() are; a Partial tensor must be reduced "
                "and a strided shard registered as a LocalShard)")
    local_shape, offset = compute_local_shape_and_global_offset(
        value.shape, mesh, value.placements)
    local = value.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(f"entry {name!r}: the local shard has shape {tuple(local.shape)}, its "
                         f"placements say {tuple(local_shape)}")
    return ShardPiece(name, local, tuple((o, o + s) for o, s in zip(offset, local_shape, strict=True)))


def local_pieces(flat: Mapping[str, Any], rank: int) -> list[ShardPiece]:
    """What rank ``rank`` writes of each entry of ``flat``: its shards, its
    :class:`LocalShard` blocks, and (rank 0 only) its plain tensors whole. Empty shards
    (an uneven split can leave a rank none) are left out."""
    pieces: list[ShardPiece] = []
    for name, value in flat.items():
        piece: ShardPiece | None
        if isinstance(value, LocalShard):
            region = tuple((o, o + s) for o, s in zip(value.offsets, value.tensor.shape, strict=True))
            piece = ShardPiece(name, value.tensor, region)
        elif _is_dtensor(value):
            piece = _dtensor_piece(name, value)
        elif rank == 0:
            piece = ShardPiece(name, value, tuple((0, s) for s in value.shape))
        else:
            piece = None
        if piece is not None and piece.local.numel() > 0:
            pieces.append(piece)
    return pieces


def write_pieces(pieces: Sequence[ShardPiece], views: Mapping[str, torch.Tensor]) -> int:
    """Copy each piece into its region of ``views`` (``name -> global-shaped view`` of the
    slot): one copy per piece, strided where the region is a column block. Returns the
    bytes written."""
    written = 0
    for piece in pieces:
        target = views[piece.name][tuple(slice(lo, hi) for lo, hi in piece.region)]
        source = piece.local.data if piece.local.requires_grad else piece.local
        target.copy_(source)
        written += target.numel() * target.element_size()
    return written


def describe_regions(pieces: Sequence[ShardPiece]) -> dict[str, list[int]]:
    """JSON-safe ``name -> [start, stop, start, stop, ...]`` per piece (one region each)."""
    return {p.name: [bound for pair in p.region for bound in pair] for p in pieces}


def _volume(region: Region) -> int:
    return math.prod(hi - lo for lo, hi in region)


def _overlap(a: Region, b: Region) -> bool:
    return all(max(alo, blo) < min(ahi, bhi) for (alo, ahi), (blo, bhi) in zip(a, b, strict=True))


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _claimed(parts: Sequence[tuple[int, Sequence[int]]]) -> int | None:
    """The elements ``parts`` claim together (overlaps counted twice); None if a region
    is malformed."""
    try:
        return sum(math.prod(int(b[2 * d + 1]) - int(b[2 * d]) for d in range(len(b) // 2))
                   for _, b in parts)
    except (TypeError, ValueError):
        return None


def _elements(region: Region) -> str:
    """``[lo:hi, lo:hi]``: a block of a tensor, as a user indexes it."""
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in region) + "]"


def _first_overlap(claims: Sequence[tuple[int, Region]]) -> tuple[int, int, Region] | None:
    """Two claims that share an element, and the block they share (lower rank first).
    A sweep along the dimension the regions split most: each region is compared only
    with those that reach past its start there (one or a few for a row or column split)."""
    solid = [(rank, region) for rank, region in claims if _volume(region) > 0]
    if len(solid) < 2:
        return None
    dims = len(solid[0][1])
    if dims == 0:  # a 0-dim tensor: any two writers share its one element
        first, second = sorted(rank for rank, _ in solid[:2])
        return first, second, ()
    axis = max(range(dims), key=lambda d: len({region[d][0] for _, region in solid}))
    active: list[tuple[int, Region]] = []
    for rank, region in sorted(solid, key=lambda claim: claim[1][axis]):
        active = [(r, theirs) for r, theirs in active if theirs[axis][1] > region[axis][0]]
        for other, theirs in active:
            if _overlap(region, theirs):
                shared = tuple((max(alo, blo), min(ahi, bhi))
                               for (alo, ahi), (blo, bhi) in zip(region, theirs, strict=True))
                return min(rank, other), max(rank, other), shared
        active.append((rank, region))
    return None


def _first_gap(shape: Sequence[int], regions: Sequence[Region]) -> Region:
    """A block of ``shape`` no region covers, given disjoint ``regions`` whose volumes add
    up to less than the shape's: along the first dimension, the first slab between two
    region bounds that the regions crossing it do not fill, then the same inside it."""
    if not shape:
        return ()
    need = math.prod(shape[1:])
    cuts = sorted({0, shape[0], *(r[0][0] for r in regions), *(r[0][1] for r in regions)})
    for lo, hi in itertools.pairwise(cuts):
        crossing = [r[1:] for r in regions if r[0][0] <= lo and hi <= r[0][1]]
        if sum(_volume(r) for r in crossing) < need:
            return ((lo, hi), *_first_gap(shape[1:], crossing))
    raise AssertionError(f"no gap in {tuple(shape)} although the regions are short of it")


def cover_problem(name: str, shape: Sequence[int],
                  parts: Sequence[tuple[int, Sequence[int]]]) -> str | None:
    """Why the ``parts`` of tensor ``name`` (``(trainer rank, flat bounds)``, as
    :func:`describe_regions` writes them) do not cover each element of ``shape`` exactly
    once: a region that does not fit, two ranks writing the same block, or a block nobody
    writes, each named; None when they tile it. Counting elements is not enough: [0,2),
    [1,2) and [3,4) add up to 4 and leave element 2 unwritten.

    The one check every place that puts parts together uses (rank 0 before any byte moves,
    and every receiver that assembles the ranks' parts itself)."""
    shape = tuple(int(d) for d in shape)
    claims: list[tuple[int, Region]] = []
    for rank, bounds in parts:
        flat = list(bounds)
        if len(flat) != 2 * len(shape) or not all(_is_int(b) for b in flat):
            return (f"trainer rank {rank}: key {name!r}: region {flat} does not fit shape "
                    f"{shape} (two int bounds per dimension)")
        flat = [int(b) for b in flat]
        region = tuple((flat[2 * d], flat[2 * d + 1]) for d in range(len(shape)))
        if any(not 0 <= lo <= hi <= size for (lo, hi), size in zip(region, shape, strict=True)):
            return f"trainer rank {rank}: key {name!r}: region {flat} does not fit shape {shape}"
        claims.append((rank, region))
    overlap = _first_overlap(claims)
    if overlap is not None:
        first, second, shared = overlap
        return (f"key {name!r}: trainer ranks {first} and {second} both write elements "
                f"{_elements(shared)} of shape {shape}: each element needs exactly one writer")
    numel = math.prod(shape)
    covered = sum(_volume(region) for _, region in claims)
    if covered == numel:
        return None
    gap = _first_gap(shape, [region for _, region in claims])
    return (f"key {name!r}: no trainer rank writes elements {_elements(gap)} of shape {shape} "
            f"(the ranks write {covered} of its {numel} elements)")


def check_cover(layout: Layout, regions_by_rank: Mapping[int, Mapping[str, Sequence[int]]]) -> None:
    """Every tensor of ``layout`` is written exactly once by the ranks together
    (:func:`cover_problem`): before any byte moves, so a disagreement is the ranks' setup
    (a rank registered another model, or a shard is missing). Raises
    :class:`SchemaMismatchError` naming the key and the ranks."""
    parts: dict[str, list[tuple[int, Sequence[int]]]] = {name: [] for name in layout.names}
    for rank, regions in regions_by_rank.items():
        for name, bounds in regions.items():
            if name not in parts:
                raise SchemaMismatchError(f"trainer rank {rank} writes key {name!r}, which is "
                                          "not in the layout", key=name)
            parts[name].append((rank, bounds))
    for spec in layout.specs:
        problem = cover_problem(spec.name, spec.shape, parts[spec.name])
        if problem is not None:
            raise SchemaMismatchError(
                f"{problem} ({spec.describe()}: a rank registered another model, or a shard "
                "is missing)", key=spec.name, expected=spec.numel, got=_claimed(parts[spec.name]))


#: the inputs :func:`check_parts` passed last (copies), newest last: a receiver is sent the
#: same regions version after version, and comparing them again costs far less than the check
_PASSED: list[tuple[dict[str, list[int]], dict[int, dict[str, list[int]]]]] = []
_PASSED_LOCK = threading.Lock()
_PASSED_KEPT = 8


def _plain(shapes: Mapping[str, Sequence[int]],
           regions_by_rank: Mapping[int, Mapping[str, Sequence[int]]],
           ) -> tuple[dict[str, list[int]], dict[int, dict[str, list[int]]]]:
    return ({name: list(shape) for name, shape in shapes.items()},
            {rank: {name: list(bounds) for name, bounds in regions.items()}
             for rank, regions in regions_by_rank.items()})


def check_parts(shapes: Mapping[str, Sequence[int]],
                regions_by_rank: Mapping[int, Mapping[str, Sequence[int]]], where: str) -> None:
    """A receiver's check of the parts it is about to put together (``shapes``: each
    tensor's global shape): every tensor covered exactly once, by regions of tensors it
    knows (:func:`cover_problem`). Raises :class:`IntegrityError` naming ``where``, the
    key and the block, before any byte of the parts is used. Regions that passed lately
    are only compared again."""
    plain = _plain(shapes, regions_by_rank)
    with _PASSED_LOCK:
        if plain in _PASSED:
            return
    _check_parts(shapes, regions_by_rank, where)
    with _PASSED_LOCK:
        _PASSED.append(plain)
        del _PASSED[:-_PASSED_KEPT]


def _check_parts(shapes: Mapping[str, Sequence[int]],
                 regions_by_rank: Mapping[int, Mapping[str, Sequence[int]]], where: str) -> None:
    parts: dict[str, list[tuple[int, Sequence[int]]]] = {name: [] for name in shapes}
    for rank, regions in regions_by_rank.items():
        for name, bounds in regions.items():
            if name not in parts:
                raise IntegrityError(f"{where}: trainer rank {rank} sends key {name!r}, which "
                                     "is not in the version's layout; the version is refused")
            parts[name].append((rank, bounds))
    for name, shape in shapes.items():
        problem = cover_problem(name, shape, parts[name])
        if problem is not None:
            raise IntegrityError(f"{where}: {problem}; the version is refused")
