"""A version loaded off the engine's path: vLLM's own layerwise reload run on a shadow of
the served model, swapped in later in O(layers).

On vLLM's CPU build, taking a version is dominated by re-packing every linear layer for
oneDNN (``process_weights_after_loading``), ~0.4 s for a 400 MB model, during which the
engine cannot generate. A shadow shares nothing mutable with the served model: each module
is a shallow copy with its own parameter, buffer and child tables, and holds copies of the
served tensors, so the reload can run on it in a background thread while the engine keeps
generating on the served model. The take then points each served tensor at the shadow's
data and carries over what post-processing rebound (``cpu_linear``: the packed kernels).

Reload bookkeeping is vLLM's (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``
on the shadow); what is ours is only the shadow and the swap."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from types import MethodType
from typing import Any

import torch

logger = logging.getLogger(__name__)

Pairs = Iterable[tuple[str, torch.Tensor]]
#: a module's own tables, which the shadow copies rather than shares
#: the name of the function vLLM wraps a loader in for a layerwise reload
_RELOAD_WRAPPER = "online_process_loader"
_TABLES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


_Shape = tuple[torch.dtype, torch.device, tuple[int, ...], tuple[int, ...]]


def _shape_of(tensor: torch.Tensor) -> _Shape:
    return tensor.dtype, tensor.device, tuple(tensor.shape), tuple(tensor.stride())


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    """``tensor`` is the whole of its storage, densely: writing it touches nothing else."""
    return (tensor.numel() > 0 and tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


class SparePool:
    """Tensors a swap retired (the previous version's weights), written again by the next
    shadow instead of new memory: fresh pages cost a page fault each, zeroed by the kernel,
    about a second of a core per version of 400 MB on a virtual machine. Only tensors that
    own their whole storage are kept."""

    def __init__(self, tensors: list[Any] | tuple[Any, ...] = (),
                 served: torch.nn.Module | None = None) -> None:
        """Keeps those of ``tensors`` that own their storage, each storage once, and none
        that ``served`` (the model the engine runs) still holds."""
        self._free: dict[_Shape, list[torch.Tensor]] = {}
        taken = set() if served is None else {
            t.untyped_storage().data_ptr()
            for t in (*served.parameters(), *served.buffers())}
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or not _owns_its_storage(tensor):
                continue
            where = tensor.untyped_storage().data_ptr()
            if where not in taken:
                taken.add(where)
                self._free.setdefault(_shape_of(tensor), []).append(tensor.detach())

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in a retired tensor of its shape, or in new memory."""
        spares = self._free.get(_shape_of(tensor))
        if not spares:
            return tensor.detach().clone()
        return spares.pop().copy_(tensor.detach())

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The tensors kept, not yet taken."""
        for spares in self._free.values():
            yield from spares

    def __len__(self) -> int:
        return sum(len(spares) for spares in self._free.values())


def _copy_tensor(tensor: torch.Tensor, made: dict[int, Any], spares: SparePool) -> torch.Tensor:
    """A copy of ``tensor`` holding its own data (a Parameter stays one), one per tensor:
    a tensor that several modules share (tied embeddings) stays shared in the shadow."""
    if id(tensor) not in made:
        data = spares.copy_of(tensor)
        made[id(tensor)] = (torch.nn.Parameter(data, requires_grad=False)
                            if isinstance(tensor, torch.nn.Parameter) else data)
    return made[id(tensor)]


def _private_meta(meta: torch.Tensor, served: torch.nn.Module) -> torch.Tensor:
    """A copy of the meta tensor vLLM recorded for a served layer, for its shadow: vLLM
    binds and wraps the recorded tensor's loaders in place at each reload, so sharing it
    would send one model's loads to the other. Its loaders are unwrapped and unbound (the
    reload binds them to the shadow)."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    copy = torch.empty_like(meta, device="meta")
    copy.__class__ = meta.__class__
    attributes = dict(meta.__dict__)
    for key, value in attributes.items():
        while callable(value) and getattr(value, "__name__", "") == _RELOAD_WRAPPER:
            value = value.__wrapped__  # type: ignore[attr-defined]
        if isinstance(value, MethodType) and value.__self__ is served:
            value = value.__func__.__get__(layer_ref_sentinel)
        attributes[key] = value
    copy.__dict__ = attributes
    return copy


class PreparedLoad:
    """One version loaded into a shadow of ``model`` (:meth:`load`, in any thread), then
    taken by the served model (:meth:`swap_in`, while the engine is paused)."""

    def __init__(self, model: torch.nn.Module, label: int,
                 spares: SparePool | None = None) -> None:
        """``spares``: what an earlier swap retired, for the shadow's copies to reuse."""
        self.label = label  # the version it holds, as its caller numbers them
        self.model = model
        self.spares = spares if spares is not None else SparePool()
        #: (served module, its shadow, the shadow's attributes before the load)
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module, dict[str, Any]]] = []
        self.root: torch.nn.Module | None = None

    def _shadow(self, module: torch.nn.Module, made: dict[int, Any],
                layerwise: Callable[[torch.nn.Module], Any]) -> torch.nn.Module:
        """The shadow of ``module`` (``made``: the shadows and copies made so far, by the
        id of what they copy: one per module or tensor, shared where the model shares it)."""
        if id(module) in made:
            return made[id(module)]
        shadow = module.__class__.__new__(module.__class__)
        shadow.__dict__.update(module.__dict__)
        shadow.__dict__["_parameters"] = {
            name: None if t is None else _copy_tensor(t, made, self.spares)
            for name, t in module._parameters.items()}
        shadow.__dict__["_buffers"] = {
            name: None if t is None else _copy_tensor(t, made, self.spares)
            for name, t in module._buffers.items()}
        shadow.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        made[id(module)] = shadow
        shadow.__dict__["_modules"] = {
            name: None if child is None else self._shadow(child, made, layerwise)
            for name, child in module._modules.items()}
        served, copied = layerwise(module), layerwise(shadow)  # what vLLM recorded at load
        params, buffers = served.restore_metadata
        copied.restore_metadata = (
            {name: _private_meta(t, module) for name, t in params.items()},
            {name: _private_meta(t, module) for name, t in buffers.items()})
        copied.restore_device = served.restore_device
        self.pairs.append((module, shadow, dict(shadow.__dict__)))
        return shadow

    @torch.no_grad()
    def load(self, pairs: Pairs, model_config: Any) -> None:
        """Load ``pairs`` (checkpoint names) into a fresh shadow through vLLM's layerwise
        reload: the served model is only read."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            get_layerwise_info,
        )

        self.pairs = []
        root = self._shadow(self.model, {}, get_layerwise_info)
        self.spares = SparePool()  # what the shadow did not take is freed now
        loaded_all = False
        try:
            initialize_layerwise_reload(root)
            loaded: Any = root  # a vLLM model: load_weights takes (name, tensor) pairs
            loaded.load_weights(pairs)
            finalize_layerwise_reload(root, model_config)
            loaded_all = True
        finally:
            # vLLM keeps each layer's reload state in a weak-keyed table, but the loaders the
            # reload bound to a shadow layer reference it from there: drop the shadow's
            # entries, or every shadow (its packed kernels) would live on, a version's worth
            # of memory per update
            for _served, shadow, _before in self.pairs:
                state = LAYERWISE_INFO.pop(shadow, None)
                if state is not None:  # its meta tensors' wrapped loaders point back at it
                    state.restore_metadata = ({}, {})
                    state.reset()
            if not loaded_all:
                self.release()
        self.root = root

    def release(self) -> None:
        """Free the shadow now, whether it was swapped in or not. A shadow is full of
        reference cycles (its parameters' loaders are bound to its modules), so without this
        it would wait for Python's cyclic collector, holding a version's weights and packed
        kernels: on a server taking a version every few seconds, several versions' worth of
        memory at a time. Emptying each shadow module breaks every cycle through it."""
        for _served, shadow, before in self.pairs:
            shadow.__dict__.clear()
            before.clear()
        self.pairs, self.root = [], None

    @torch.no_grad()
    def swap_in(self) -> list[Any]:
        """Make the served model hold the shadow's version: each served tensor now points
        at the shadow's data, and what post-processing rebound on a shadow module (a packed
        kernel) is rebound on its served module. Call it while the engine is paused.
        Returns what the served model held (its old data and kernels): dropping it frees
        them, which the caller can do off the engine's path."""
        if self.root is None:
            raise RuntimeError("PreparedLoad.swap_in before load")
        retired: list[Any] = []
        swapped: set[int] = set()  # a tensor that several modules share is swapped once
        for served, shadow, before in self.pairs:
            for table in ("_parameters", "_buffers"):
                mine, theirs = served.__dict__[table], shadow.__dict__[table]
                for name, tensor in theirs.items():
                    target = mine.get(name)
                    if tensor is None or target is None or id(target) in swapped:
                        continue
                    swapped.add(id(target))
                    retired.append(target.data)
                    target.data = tensor.data
            for name, value in shadow.__dict__.items():  # what the load rebound, only
                if name in _TABLES or before.get(name, _MISSING) is value:
                    continue
                retired.append(served.__dict__.get(name))
                served.__dict__[name] = value
        self.release()  # the served model holds what it needs of the shadow: its data, kernels
        return retired


_MISSING = object()
