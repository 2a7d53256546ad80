"""The layout of a set of weights, and how it packs into flat per-device, per-dtype buckets.

A layout is the ordered names, shapes, dtypes and devices of the tensors, the names that
are tied to another (packed once, see ``core/ties.py``), plus a fingerprint of (names,
shapes, dtypes, ties). Both sides of a sync agree on it before any byte
moves; a send is then one large copy per bucket instead of one call per tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.core.errors import SchemaMismatchError
from weightsync.core.ties import checked_ties, describe_tie, find_ties, same_tensor

#: Byte alignment of every bucket inside a device buffer (a cache line; also any dtype's size).
BUCKET_ALIGNMENT = 64


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the spelling used in headers and manifests."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; refuses anything that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def _align(offset: int, alignment: int = BUCKET_ALIGNMENT) -> int:
    return (offset + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape, dtype and device of one tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        return f"shape {tuple(self.shape)} dtype {dtype_name(self.dtype)}"


@dataclass(frozen=True)
class BucketSpec:
    """One flat bucket: the tensors of one (device, dtype), back to back, at ``byte_offset``."""

    device: str
    dtype: torch.dtype
    byte_offset: int
    numel: int
    names: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Layout:
    """Ordered tensor specs with their packing into buckets; immutable once built.

    ``ties``: ``alias -> name`` for names that are the same tensor as an entry of ``specs``
    (not entries themselves): nothing is packed for them."""

    def __init__(self, specs: Iterable[TensorSpec], *, alignment: int = BUCKET_ALIGNMENT,
                 ties: Mapping[str, str] | None = None) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.names: tuple[str, ...] = tuple(s.name for s in self.specs)
        self.alignment = alignment
        self._by_name: dict[str, TensorSpec] = {}
        for spec in self.specs:
            if spec.name in self._by_name:
                raise ValueError(f"duplicate weight name {spec.name!r}")
            self._by_name[spec.name] = spec
        self.ties: dict[str, str] = checked_ties(ties or {}, self._by_name)
        self.buckets, self._slots, self.nbytes_by_device = self._plan_buckets(self.specs, alignment)
        self.fingerprint = self._compute_fingerprint(self.specs, self.ties)

    @staticmethod
    def _plan_buckets(
        specs: tuple[TensorSpec, ...], alignment: int,
    ) -> tuple[tuple[BucketSpec, ...], dict[str, tuple[int, int]], dict[str, int]]:
        groups: dict[tuple[str, torch.dtype], list[TensorSpec]] = {}
        for spec in specs:
            groups.setdefault((spec.device, spec.dtype), []).append(spec)
        buckets: list[BucketSpec] = []
        slots: dict[str, tuple[int, int]] = {}
        device_end: dict[str, int] = {}
        for (device, dtype), members in groups.items():
            start = _align(device_end.get(device, 0), alignment)
            numel = 0
            for spec in members:
                slots[spec.name] = (len(buckets), numel)
                numel += spec.numel
            buckets.append(BucketSpec(device, dtype, start, numel, tuple(s.name for s in members)))
            device_end[device] = start + numel * dtype.itemsize
        return tuple(buckets), slots, {d: _align(end, alignment) for d, end in device_end.items()}

    @staticmethod
    def _compute_fingerprint(specs: tuple[TensorSpec, ...], ties: Mapping[str, str]) -> str:
        canon: list[Any] = [[s.name, list(s.shape), dtype_name(s.dtype)] for s in specs]
        if ties:  # an untied layout keeps the fingerprint it always had
            canon.append(sorted(ties.items()))
        return hashlib.sha256(json.dumps(canon).encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_weights(cls, weights: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of a flat ``name -> tensor`` mapping, in its iteration order.

        Only dense tensors that hold data can be synced: a sparse tensor raises TypeError
        and a tensor on the meta device ValueError, each naming the entry, before any byte
        moves."""
        for name, t in weights.items():
            if t.layout != torch.strided:
                raise TypeError(
                    f"entry {name!r} is a {t.layout} tensor; weightsync syncs dense tensors "
                    "(convert it with .to_dense())"
                )
            if t.device.type == "meta":
                raise ValueError(
                    f"entry {name!r} is on the meta device and holds no data; materialise the "
                    "model first, e.g. model.to_empty(device='cpu')"
                )
        ties = find_ties(weights)
        return cls(
            (TensorSpec(name, tuple(t.shape), t.dtype, str(t.device))
             for name, t in weights.items() if name not in ties),
            ties=ties,
        )

    def on_device(self, device: str | torch.device) -> Layout:
        """The same layout with every tensor placed on ``device``."""
        return Layout((TensorSpec(s.name, s.shape, s.dtype, str(device)) for s in self.specs),
                      ties=self.ties)

    def with_dtype(self, dtype: torch.dtype | None) -> Layout:
        """The same layout with floating-point tensors cast to ``dtype`` (None: unchanged)."""
        if dtype is None:
            return self
        return Layout(
            (TensorSpec(s.name, s.shape, dtype if s.dtype.is_floating_point else s.dtype, s.device)
             for s in self.specs),
            ties=self.ties,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description; :meth:`from_dict` reads it back (no pickle involved)."""
        described: dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "tensors": [
                {"name": s.name, "shape": list(s.shape), "dtype": dtype_name(s.dtype), "device": s.device}
                for s in self.specs
            ],
        }
        if self.ties:
            described["ties"] = dict(self.ties)
        return described

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        try:
            layout = cls((
                TensorSpec(
                    str(t["name"]),
                    tuple(int(d) for d in t["shape"]),
                    dtype_from_name(str(t["dtype"])),
                    str(t.get("device", "cpu")),
                )
                for t in data["tensors"]
            ), ties=data.get("ties") or {})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed layout description: {exc}") from exc
        if "fingerprint" in data and data["fingerprint"] != layout.fingerprint:
            raise ValueError("layout description does not match its own fingerprint")
        return layout

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.specs)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.specs == other.specs and self.ties == other.ties

    def __hash__(self) -> int:
        return hash(self.specs)

    def __repr__(self) -> str:
        return (
            f"Layout({len(self.specs)} tensors, {self.nbytes} bytes, "
            f"{len(self.buckets)} buckets, fingerprint={self.fingerprint})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers together, alignment padding included."""
        return sum(self.nbytes_by_device.values())

    # ------------------------------------------------------------------ validation
    def check_weights(
        self, weights: Mapping[str, torch.Tensor], *, expected_by: str = "the registered layout",
        given_by: str = "the given weights",
    ) -> None:
        """Raise :class:`SchemaMismatchError` unless ``weights`` has exactly this layout's
        names, shapes, dtypes and ties (devices may differ: copies move bytes across devices)."""
        for alias, canonical in self.ties.items():
            tensor, tied_to = weights.get(alias), weights.get(canonical)
            if not (isinstance(tensor, torch.Tensor) and isinstance(tied_to, torch.Tensor)
                    and same_tensor(tensor, tied_to)):
                got = "missing" if tensor is None else describe_tie(None)
                raise SchemaMismatchError(
                    f"key {alias!r} is {describe_tie(canonical)} in {expected_by}, but "
                    f"{got} in {given_by}", key=alias,
                    expected=describe_tie(canonical), got=got,
                )
        for spec in self.specs:
            tensor = weights.get(spec.name)
            if tensor is None:
                raise SchemaMismatchError(
                    f"key {spec.name!r} is in {expected_by} ({spec.describe()}) but missing from "
                    f"{given_by}",
                    key=spec.name, expected=spec.describe(), got=None,
                )
            if not isinstance(tensor, torch.Tensor):
                raise SchemaMismatchError(
                    f"key {spec.name!r}: {given_by} holds a {type(tensor).__name__}, not a tensor",
                    key=spec.name, expected=spec.describe(), got=type(tensor).__name__,
                )
            if tensor.shape != spec.shape or tensor.dtype != spec.dtype:
                got = TensorSpec(spec.name, tuple(tensor.shape), tensor.dtype).describe()
                raise SchemaMismatchError(
                    f"key {spec.name!r}: {expected_by} has {spec.describe()}, {given_by} has {got}",
                    key=spec.name, expected=spec.describe(), got=got,
                )
            if tensor.is_meta:
                raise ValueError(
                    f"key {spec.name!r} of {given_by} is on the meta device and holds no data "
                    "(was the model moved to meta after register_model?)"
                )
        if len(weights) != len(self.specs) + len(self.ties):
            extra = next(k for k in weights if k not in self._by_name and k not in self.ties)
            raise SchemaMismatchError(
                f"key {extra!r} is in {given_by} but not in {expected_by}",
                key=extra, expected=None, got=TensorSpec(
                    extra, tuple(weights[extra].shape), weights[extra].dtype).describe(),
            )

    def check_compatible(
        self, other: Layout, *, self_name: str = "the sender", other_name: str = "the receiver",
        ignore_dtype: bool = False,
    ) -> None:
        """Raise :class:`SchemaMismatchError` naming the first key on which the layouts
        differ in a tie, presence, shape or (unless ``ignore_dtype``) dtype."""
        for alias in sorted(set(self.ties) | set(other.ties)):
            mine, theirs_tie = self.ties.get(alias), other.ties.get(alias)
            if mine != theirs_tie:
                other_key = mine or theirs_tie
                raise SchemaMismatchError(
                    f"keys {alias!r} and {other_key!r}: {alias!r} is {describe_tie(mine)} "
                    f"on {self_name} but {describe_tie(theirs_tie)} on {other_name}; tie "
                    "or untie them alike on both sides",
                    key=alias, expected=describe_tie(mine), got=describe_tie(theirs_tie),
                )
        for spec in self.specs:
            theirs = other._by_name.get(spec.name)
            if theirs is None:
                raise SchemaMismatchError(
                    f"key {spec.name!r} ({spec.describe()}) is on {self_name} but not on "
                    f"{other_name}", key=spec.name, expected=spec.describe(), got=None,
                )
            if spec.shape != theirs.shape or (not ignore_dtype and spec.dtype != theirs.dtype):
                raise SchemaMismatchError(
                    f"key {spec.name!r}: {self_name} has {spec.describe()}, {other_name} has "
                    f"{theirs.describe()}",
                    key=spec.name, expected=spec.describe(), got=theirs.describe(),
                )
        for theirs in other.specs:
            if theirs.name not in self._by_name:
                raise SchemaMismatchError(
                    f"key {theirs.name!r} ({theirs.describe()}) is on {other_name} but not on "
                    f"{self_name}", key=theirs.name, expected=None, got=theirs.describe(),
                )

    # ------------------------------------------------------------------ buffers
    def allocate(self, *, pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """Fresh zeroed uint8 buffers, one per device, sized for this layout."""
        return {
            device: torch.zeros(
                nbytes, dtype=torch.uint8, device=device,
                pin_memory=pin_memory and device == "cpu" and torch.cuda.is_available(),
            )
            for device, nbytes in self.nbytes_by_device.items()
        }

    def bucket_views(self, buffers: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Typed flat views of each bucket inside ``buffers`` (uint8, one per device)."""
        views = []
        for bucket in self.buckets:
            raw = buffers[bucket.device][bucket.byte_offset : bucket.byte_offset + bucket.nbytes]
            views.append(raw.view(bucket.dtype))
        return views

    def offsets(self) -> dict[str, tuple[int, int]]:
        """``name -> (start, end)`` byte offsets of each tensor inside its device buffer."""
        out = {}
        for spec in self.specs:
            index, start = self._slots[spec.name]
            begin = self.buckets[index].byte_offset + start * spec.dtype.itemsize
            out[spec.name] = (begin, begin + spec.nbytes)
        return out

    def tensor_views(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``name -> tensor`` views into ``buffers``, shaped as the layout says."""
        bucket_views = self.bucket_views(buffers)
        views = {}
        for spec in self.specs:
            index, start = self._slots[spec.name]
            views[spec.name] = bucket_views[index][start : start + spec.numel].view(spec.shape)
        return views

    def named_views(self, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """:meth:`tensor_views` plus each tied name, as the same view as the name it is
        tied to: a flat dict whose own layout (``from_weights``) is this one, ties included."""
        views = self.tensor_views(buffers)
        return views | {alias: views[name] for alias, name in self.ties.items()}

    def pack(self, weights: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
             views: Sequence[torch.Tensor] | None = None) -> None:
        """Copy ``weights`` (already checked against this layout) into ``buffers``, through
        ``views`` (their :meth:`tensor_views` in layout order) if the caller keeps them.

        One fused ``_foreach_copy_`` for every tensor (device moves and casts included,
        else one copy each): about 25% less than a ``torch.cat`` per bucket for a small
        model, where the views cost more to make than the bytes to copy."""
        if views is None:
            views = list(self.tensor_views(buffers).values())
        copy_all(list(views), [weights[spec.name] for spec in self.specs])

    def unpack(self, buffers: Mapping[str, torch.Tensor], dest: Mapping[str, torch.Tensor],
               views: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy every tensor out of ``buffers`` (or its ``views``, made by
        :meth:`tensor_views` and kept by the caller) into the matching tensor of ``dest``."""
        if views is None:
            views = self.tensor_views(buffers)
        copy_all([dest[name] for name in self.names], [views[name] for name in self.names])


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``t.copy_(s)`` for each pair, fused into one ``_foreach_copy_`` call where possible.
    Autograd never sees it: a tensor that requires grad takes part through ``.data`` (its
    own bytes), which costs less than entering ``torch.no_grad()`` at every call."""
    if not targets:
        return
    targets = [t.data if t.requires_grad else t for t in targets]
    sources = [s.data if s.requires_grad else s for s in sources]
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        try:
            foreach_copy(targets, sources)
            return
        except (RuntimeError, TypeError):
            pass  # mixed devices or dtypes that the fused kernel refuses: go one by one
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)
