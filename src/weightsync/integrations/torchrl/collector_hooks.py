"""Where weightsync meets a TorchRL collector's own machinery: its ``pre_collect_hook`` (the
batch boundary where a worker takes a new version), its ``policy_version`` tags, its
``shutdown()``, and the meta-device policies it ships to workers."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from weightsync.core.strategy import flat_tensors, is_tensordict

logger = logging.getLogger(__name__)

# keys TorchRL's tensordict strategy adds that are not tensors of the module
_NOT_WEIGHTS = ("__extra_state__",)


def flat_weights(weights: Any, what: str) -> dict[str, torch.Tensor]:
    """TorchRL's weights (a module, a TensorDict from ``from_module``, a state dict) as
    weightsync's flat ``name -> tensor`` mapping."""
    flat = flat_tensors(weights, what=what)
    return {k: v for k, v in flat.items() if k.split(".", 1)[0] not in _NOT_WEIGHTS}


def is_weights_container(source: Any) -> bool:
    """Whether ``source`` is something weights live in: a module, TensorDict or mapping."""
    return isinstance(source, (torch.nn.Module, Mapping)) or is_tensordict(source)


def holds_weights(source: Any) -> bool:
    """Whether ``source`` has tensors to sync. A policy that is no module, TensorDict or
    mapping (TorchRL's ``RandomPolicy``), or one without tensors, has none: as with
    TorchRL's own schemes, there is nothing to sync for it."""
    return is_weights_container(source) and bool(flat_weights(source, "weights"))


class ClosableEnd(Protocol):
    """A scheme's end in this process: the trainer's sender or a worker's receiver."""

    @property
    def is_receiver(self) -> bool: ...

    def shutdown(self) -> None: ...


def model_in_collector(collector: Any, model_id: str) -> Any:
    """The trainer's model in ``collector``, found as TorchRL's own schemes find it: the
    attribute path first, then (the policy of a collector given only a ``policy_factory``)
    a policy the factory makes, whose weights are version 0; then ``get_model``, which
    raises for a policy the trainer does not hold."""
    from torchrl.weight_update.utils import _resolve_model

    try:
        model = _resolve_model(collector, model_id)
    except AttributeError:
        model = None
    if model is None and model_id == "policy":
        factories = getattr(collector, "policy_factory", None) or []
        if callable(factories):
            factories = [factories]
        factories = [f for f in factories if f]
        if factories:
            model = factories[0]()
    if model is None and hasattr(collector, "get_model"):
        model = collector.get_model(model_id)
    if model is None:
        raise ValueError(f"no model {model_id!r} found in {type(collector).__name__}")
    return model


def worker_indices(worker_ids: Any, worker_devices: list[str]) -> list[int] | None:
    """TorchRL's ``worker_ids`` (an int, a device, or a list of either) as worker indices;
    a device names every worker whose policy runs there."""
    if worker_ids is None:
        return None
    items = worker_ids if isinstance(worker_ids, (list, tuple)) else [worker_ids]
    out: list[int] = []
    for item in items:
        if isinstance(item, torch.device) or (isinstance(item, str) and not item.isdigit()):
            device = str(torch.device(item))
            matches = [i for i, d in enumerate(worker_devices) if d == device]
            if not matches:
                raise ValueError(f"no worker runs its policy on {device} "
                                 f"(workers' devices: {worker_devices})")
            out.extend(matches)
        else:
            out.append(int(item))
    return sorted(set(out))


def chain_pre_collect_hook(collector: Any, callback: Callable[[], None]) -> bool:
    """Run ``callback`` at the start of each of ``collector``'s batches, before any hook the
    user set (which keeps running). Returns False if the collector has no such hook."""
    if not hasattr(collector, "pre_collect_hook"):
        return False
    user_hook = collector.pre_collect_hook

    def pre_collect_hook() -> None:
        callback()
        if user_hook is not None:
            user_hook()

    collector.pre_collect_hook = pre_collect_hook
    return True


def tag_policy_version(collector: Any, version: int) -> None:
    """Make ``collector`` tag its frames with ``version`` (when ``track_policy_version`` is on),
    the next frame included: it would otherwise carry the tag of the previous env step."""
    tracker = getattr(collector, "policy_version_tracker", None)
    if tracker is None or not hasattr(tracker, "version"):
        return
    tracker.version = int(version)
    carrier = getattr(collector, "_carrier", None)
    value = carrier.get("policy_version", None) if carrier is not None else None
    if isinstance(value, torch.Tensor):
        value.fill_(int(version))


def tracked_version(collector: Any) -> int | None:
    """The version ``collector``'s own tracker holds, if it tracks an integer version."""
    version = getattr(getattr(collector, "policy_version_tracker", None), "version", None)
    return version if isinstance(version, int) else None


def close_with(collector: Any, end: ClosableEnd) -> None:
    """Close ``end`` when ``collector.shutdown()`` runs: TorchRL's collectors never shut their
    schemes down, and an end left open keeps a thread and a socket alive (on a worker,
    closing it at interpreter exit would stall the exit). Workers' receivers close first and
    say goodbye; the trainer's sender closes once its workers are gone, so a normal shutdown
    reports no lost worker and no lost sender."""
    ends: list[weakref.ReferenceType[Any]] | None = getattr(collector, "_weightsync_ends", None)
    if ends is None:
        ends = []
        original = collector.shutdown

        def shutdown(*args: Any, **kwargs: Any) -> Any:
            live = [e for e in (ref() for ref in ends) if e is not None]
            for e in live:
                if e.is_receiver:
                    e.shutdown()
            try:
                return original(*args, **kwargs)
            finally:
                for e in live:
                    e.shutdown()

        collector.shutdown = shutdown
        collector._weightsync_ends = ends
    if not any(ref() is end for ref in ends):
        ends.append(weakref.ref(end))


def materialize_meta_module(module: torch.nn.Module, device: str | torch.device, *,
                            synced_names: set[str] | None = None, where: str = "worker") -> bool:
    """Give a module whose tensors are on the meta device (how TorchRL ships a policy to its
    workers) real, uninitialised storage on ``device``; the first version received fills it.
    Returns whether it did anything. Refuses (``ValueError``) a meta tensor that no version
    would fill (e.g. a non-persistent buffer, absent from ``synced_names``)."""
    meta = [name for name, t in [*module.named_parameters(), *module.named_buffers()]
            if t.is_meta]
    if not meta:
        return False
    if synced_names is not None:
        unsynced = [name for name in meta if name not in synced_names]
        if unsynced:
            raise ValueError(
                f"{where}: tensor(s) {unsynced} of the policy are on the meta device and are not "
                "part of the synced weights (non-persistent buffers?), so no version would ever "
                "fill them; build the policy on a real device or make them persistent"
            )
    module.to_empty(device=device)
    logger.info("%s: materialised %d meta tensor(s) on %s", where, len(meta), device)
    return True
