"""A cheap guard that tensors meant to stay fixed (an adapter's base model) did not change.

Hashing a whole base model at every send would cost as much as sending it. Instead each
tensor is recorded once by identity (the object, its storage pointer, shape, dtype), its
in-place version counter (bumped by every in-place op through the tensor: an optimizer
step, ``copy_``, ``load_state_dict``) and a few sampled elements (which also catch writes
through ``.data``, e.g. peft's ``merge_adapter``, that bypass the counter). A check costs a
few microseconds per tensor, whatever its size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightsync.core.errors import BaseWeightChangedError

#: elements sampled per tensor (evenly spaced over the whole tensor, first and last included)
SAMPLES = 16


@dataclass(frozen=True)
class _Seen:
    tensor_id: int
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    version: int
    index: torch.Tensor  # the sampled positions of the flattened tensor
    sample: torch.Tensor


@torch.no_grad()
def _sample(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).index_select(0, index)


def _seen(tensor: torch.Tensor) -> _Seen:
    numel = tensor.numel()
    index = torch.linspace(0, max(numel - 1, 0), min(SAMPLES, numel),
                           device=tensor.device).round().long()
    return _Seen(id(tensor), tensor.data_ptr(), tuple(tensor.shape), tensor.dtype,
                 tensor._version, index, _sample(tensor, index).clone())


class FrozenWeights:
    """Records named tensors once; :meth:`check` raises :class:`BaseWeightChangedError`
    naming the first one that changed since."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], what: str = "base weight") -> None:
        self.what = what
        self._seen = {name: _seen(t) for name, t in tensors.items()}

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise if any recorded tensor was replaced, resized, written in place or removed."""
        if tensors.keys() != self._seen.keys():
            gone = sorted(self._seen.keys() - tensors.keys())
            new = sorted(tensors.keys() - self._seen.keys())
            key = (gone or new)[0]
            raise BaseWeightChangedError(
                f"{self.what} {key!r} was {'removed' if gone else 'added'} since the sender "
                "connected: the workers' base no longer matches the trainer's", key=key)
        for name, tensor in tensors.items():
            seen = self._seen[name]
            why = self._difference(seen, tensor)
            if why:
                raise BaseWeightChangedError(
                    f"{self.what} {name!r} changed since the sender connected ({why}): only "
                    "the adapter is sent, so the workers would keep the old base; nothing was "
                    "sent (freeze the base, or sync the full model instead)", key=name)

    @staticmethod
    def _difference(seen: _Seen, tensor: torch.Tensor) -> str:
        if id(tensor) != seen.tensor_id or tensor.data_ptr() != seen.data_ptr:
            return "the tensor was replaced"
        if tuple(tensor.shape) != seen.shape or tensor.dtype != seen.dtype:
            return f"now {tuple(tensor.shape)} {tensor.dtype}, was {seen.shape} {seen.dtype}"
        if tensor._version != seen.version:
            return "it was written in place"
        if not torch.equal(_sample(tensor, seen.index), seen.sample):
            return "its values differ"
        return ""
