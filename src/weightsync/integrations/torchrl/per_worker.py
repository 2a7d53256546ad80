"""Per-worker weights for TorchRL's schemes (``per_worker_weights=True``, ``params_map``,
``device_map_fn``, distinct policy factories): one weightsync scheme for one worker per
collector worker, so each worker has its own stream of versions and its own layout, with
the promises of a single scheme (snapshot at the send, tear-free apply at a batch start, a
dead worker named)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import weightsync as ws
from weightsync.integrations.torchrl.collector_hooks import flat_weights

logger = logging.getLogger(__name__)

#: TorchRL's ``device_map_fn``: (worker index, the weights as a TensorDict) -> that worker's
DeviceMapFn = Callable[[int, Any], Any]


def is_per_worker_dict(weights: Any) -> bool:
    """Whether ``weights`` is TorchRL's per-worker form ``{worker_idx: weights}``."""
    return (isinstance(weights, dict) and bool(weights)
            and all(isinstance(k, int) and not isinstance(k, bool) for k in weights))


def distinct_factories(collector: Any) -> list[Callable[[], Any]] | None:
    """The collector's per-worker policy factories when they differ (TorchRL then gives each
    worker its own weights), else None."""
    factories = getattr(collector, "policy_factory", None)
    if not isinstance(factories, (list, tuple)) or not all(factories):
        return None
    return list(factories) if len({id(f) for f in factories}) > 1 else None


def _as_tensordict(source: Any) -> Any:
    """``source`` as the TensorDict TorchRL hands a ``device_map_fn``."""
    from tensordict import TensorDict, TensorDictBase

    if isinstance(source, torch.nn.Module):
        return TensorDict.from_module(source).data
    if isinstance(source, TensorDictBase):
        return source
    return TensorDict(dict(flat_weights(source, "weights"))).unflatten_keys(".")


def weights_device(source: Any) -> str:
    """The device of ``source``'s first tensor ("cpu" if none)."""
    for tensor in flat_weights(source, "weights").values():
        return str(tensor.device)
    return "cpu"


class PerWorkerSenders:
    """The trainer's ends of per-worker streams: worker ``i`` is worker 0 of ``schemes[i]``.

    ``sources[i]`` is what worker ``i`` gets on a send without weights (a module, a
    TensorDict or a mapping, read at every send); weights given for a worker replace it for
    that send. ``device_map_fn`` (if any) turns either into that worker's weights."""

    def __init__(self, schemes: Sequence[ws.WeightSyncScheme], sources: Sequence[Any],
                 new_sender: Callable[[ws.WeightSyncScheme], ws.WeightSender], *,
                 device_map_fn: DeviceMapFn | None = None) -> None:
        if len(schemes) != len(sources):
            raise ValueError(f"{len(schemes)} streams but {len(sources)} sources")
        self._sources = list(sources)
        self._map = device_map_fn
        self._senders: list[ws.WeightSender] = []
        self._pending: list[int] = []
        #: the device of each worker's version 0 (where its policy is materialised)
        self.devices: list[str] = []
        try:
            for idx, scheme in enumerate(schemes):
                sender = new_sender(scheme)
                self._senders.append(sender)
                registered = self._registered(idx)
                sender.register_model(registered)
                self.devices.append(weights_device(registered))
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return len(self._senders)

    @property
    def versions(self) -> dict[int, int]:
        """Each worker's newest version sent."""
        return {idx: sender.version for idx, sender in enumerate(self._senders)}

    def _registered(self, idx: int) -> Any:
        """What worker ``idx``'s sender registers: its version 0 and its layout."""
        source = self._sources[idx]
        if self._map is None and isinstance(source, torch.nn.Module):
            return source
        return self._weights_for(idx, None)

    def _weights_for(self, idx: int, weights: Any) -> dict[str, torch.Tensor] | None:
        """Worker ``idx``'s flat weights for one send (None: its registered module)."""
        source = self._sources[idx] if weights is None else weights
        if self._map is not None:
            return flat_weights(self._map(idx, _as_tensordict(source)),
                                f"device_map_fn({idx}, ...)")
        if weights is None and isinstance(source, torch.nn.Module):
            return None  # the sender snapshots the module it registered
        return flat_weights(source, f"the weights for worker {idx}")

    def connect(self, timeout: float) -> None:
        """Publish each worker's version 0 and wait until every worker holds it."""
        deadline = time.monotonic() + timeout
        for sender in self._senders:
            sender.connect(timeout=max(deadline - time.monotonic(), 1e-3))

    def send(self, weights: Mapping[int, Any], *, named: bool, sync: bool,
             timeout: float) -> None:
        """Snapshot each worker's weights now (``weights[i]``, None for its source) and
        deliver them; ``sync=False`` returns once every snapshot is taken (``finish`` waits).
        ``named``: the workers were named by the caller (a lost one is raised every time,
        not only once). A lost worker is raised as one ``WorkerLostError`` naming every
        lost worker, once the others got their version."""
        for idx in weights:
            if not 0 <= idx < self.num_workers:
                raise ValueError(f"no worker {idx}: workers are 0..{self.num_workers - 1}")
        flats = {idx: self._weights_for(idx, w) for idx, w in weights.items()}
        for idx, flat in flats.items():  # every layout checked before anything is sent
            layout = self._senders[idx].layout
            if flat is not None and layout is not None:
                layout.check_weights(flat)
        self.finish(timeout)
        deadline = time.monotonic() + timeout
        lost: dict[int, str] = {}
        for idx, flat in flats.items():
            try:
                self._senders[idx].send_async(flat, worker_ids=[0] if named else None,
                                              timeout=max(deadline - time.monotonic(), 1e-3))
                self._pending.append(idx)
            except ws.WorkerLostError as exc:
                lost[idx] = str(exc)
        if sync:
            self._finish(deadline, lost)
        elif lost:
            raise self._lost_error(lost)

    def finish(self, timeout: float) -> None:
        """Wait for the deliveries a ``sync=False`` send started."""
        self._finish(time.monotonic() + timeout, {})

    def _finish(self, deadline: float, lost: dict[int, str]) -> None:
        pending, self._pending = self._pending, []
        first_error: BaseException | None = None
        for idx in pending:
            try:
                self._senders[idx].wait_async(timeout=max(deadline - time.monotonic(), 1e-3))
            except ws.WorkerLostError as exc:
                lost[idx] = str(exc)
            except ws.WeightSyncError as exc:  # e.g. a timeout: the others still finish
                first_error = first_error or exc
        if lost:
            raise self._lost_error(lost) from first_error
        if first_error is not None:
            raise first_error

    @staticmethod
    def _lost_error(lost: dict[int, str]) -> ws.WorkerLostError:
        ids = sorted(lost)
        detail = "; ".join(f"worker {w}: {lost[w]}" for w in ids)
        return ws.WorkerLostError(
            f"lost worker(s) {ids} while sending them their weights ({detail}); the other "
            "workers got theirs", worker_ids=ids)

    def close(self, timeout: float = 10.0) -> None:
        """Wait for a pending delivery (logged if it fails), then close every sender."""
        try:
            self.finish(timeout)
        except ws.WeightSyncError as exc:
            logger.warning("the last per-worker update (sync=False) did not reach every "
                           "worker before shutdown: %s", exc)
        finally:
            senders, self._senders = self._senders, []
            for sender in senders:
                sender.close()
