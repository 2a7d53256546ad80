"""How weights are taken out of a model and put back in: the one place that knows the
accepted input types (``nn.Module``, ``TensorDictBase``, ``Mapping[str, Tensor]``)."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from weightsync.core.errors import SchemaMismatchError

if TYPE_CHECKING:
    from tensordict import TensorDictBase

ACCEPTED_TYPES = "an nn.Module, a TensorDictBase or a Mapping[str, Tensor]"

ExtractAs = Literal["tensordict", "state_dict"]


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a ``TensorDictBase``, without importing tensordict (which pulls
    ``torch._dynamo``, about a second): a TensorDict exists only once its module is loaded."""
    tensordict = sys.modules.get("tensordict")
    return tensordict is not None and isinstance(value, tensordict.TensorDictBase)


def detach_parameters(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict(keep_vars=True)`` as :func:`flat_tensors` gives a module: each Parameter
    detached (sharing its storage and version counter), buffers as they are."""
    return OrderedDict(
        (name, t.detach() if isinstance(t, torch.nn.Parameter) else t)
        for name, t in tensors.items()
    )


def flat_tensors(source: Any, *, what: str = "weights") -> dict[str, torch.Tensor]:
    """``source`` as an ordered flat ``"a.b.c" -> tensor`` dict, sharing storage with it.

    Modules give their parameters and persistent buffers (BatchNorm running stats included),
    as ``state_dict`` names them. Raises ``TypeError`` for anything else."""
    if isinstance(source, torch.nn.Module):
        return detach_parameters(source.state_dict(keep_vars=True))
    if is_tensordict(source):
        out: dict[str, torch.Tensor] = OrderedDict()
        for key, value in source.items(include_nested=True, leaves_only=True):
            name = ".".join(key) if isinstance(key, tuple) else key
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{what}: entry {name!r} is a {type(value).__name__}, not a tensor")
            out[name] = value
        return out
    if isinstance(source, Mapping):
        out = OrderedDict()
        for name, value in source.items():
            if not isinstance(name, str):
                raise TypeError(f"{what}: keys must be str, got {type(name).__name__} {name!r}")
            if isinstance(value, torch.Tensor):
                out[name] = value.detach()
            elif isinstance(value, Mapping) or is_tensordict(value):
                for sub, tensor in flat_tensors(value, what=what).items():
                    out[f"{name}.{sub}"] = tensor
            else:
                raise TypeError(
                    f"{what}: entry {name!r} is a {type(value).__name__}; expected a tensor"
                )
        return out
    raise TypeError(f"{what}: got {type(source).__name__}; expected {ACCEPTED_TYPES}")


class WeightStrategy:
    """Extracts weights from a model and applies weights to a model.

    ``extract_as="tensordict"`` returns a (nested) ``TensorDict``; ``"state_dict"`` an
    ordered flat dict. Both share storage with the source: copies are the transport's job.
    """

    def __init__(self, extract_as: ExtractAs = "tensordict") -> None:
        if extract_as not in ("tensordict", "state_dict"):
            raise ValueError(
                f"extract_as must be 'tensordict' or 'state_dict', got {extract_as!r}"
            )
        self.extract_as: ExtractAs = extract_as

    def __repr__(self) -> str:
        return f"WeightStrategy(extract_as={self.extract_as!r})"

    def extract_weights(self, source: Any) -> TensorDictBase | dict[str, torch.Tensor]:
        """The weights of ``source`` (parameters and buffers), in the chosen format."""
        flat = flat_tensors(source, what="extract_weights")
        if self.extract_as == "state_dict":
            return flat
        if is_tensordict(source):
            return source
        from tensordict import TensorDict  # only here: importing it costs about a second

        return TensorDict(dict(flat), batch_size=[]).unflatten_keys(".")

    @torch.no_grad()
    def apply_weights(self, dest: Any, weights: Any) -> None:
        """Copy ``weights`` into ``dest`` in place; checks every key, shape and dtype first,
        so a mismatch raises :class:`SchemaMismatchError` with ``dest`` untouched."""
        targets = flat_tensors(dest, what="apply_weights destination")
        sources = flat_tensors(weights, what="apply_weights weights")
        for name, target in targets.items():
            source = sources.get(name)
            if source is None:
                raise SchemaMismatchError(
                    f"key {name!r} of the destination is missing from the weights",
                    key=name, expected=(tuple(target.shape), target.dtype), got=None,
                )
            if source.shape != target.shape or source.dtype != target.dtype:
                raise SchemaMismatchError(
                    f"key {name!r}: destination has shape {tuple(target.shape)} dtype "
                    f"{target.dtype}, weights have shape {tuple(source.shape)} dtype {source.dtype}",
                    key=name, expected=(tuple(target.shape), target.dtype),
                    got=(tuple(source.shape), source.dtype),
                )
        for name in sources:
            if name not in targets:
                raise SchemaMismatchError(
                    f"key {name!r} of the weights has no place in the destination",
                    key=name, expected=None, got=tuple(sources[name].shape),
                )
        for name, target in targets.items():
            target.copy_(sources[name])
