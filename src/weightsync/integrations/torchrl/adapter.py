"""TorchRL's ``WeightSyncScheme`` interface driven by a weightsync scheme: the trainer's end
(``init_on_sender``, ``connect``, ``send``: ``adapter_trainer.py``) and each collector worker's
end (``init_on_receiver``, ``connect``, a new version taken at each batch start:
``adapter_worker.py``), joined here with the state both share. The concrete schemes
(``schemes.py`` for one host, ``ray_scheme.py`` for a Ray cluster) say which weightsync
scheme moves the bytes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import weightsync as ws
from weightsync.core.deadline import required_timeout
from weightsync.integrations.torchrl.adapter_trainer import _TrainerEnd
from weightsync.integrations.torchrl.adapter_worker import _WorkerEnd
from weightsync.integrations.torchrl.batch_gate import ApplyPoints
from weightsync.integrations.torchrl.per_worker import PerWorkerSenders

__all__ = ["WeightsyncTorchRLScheme"]

logger = logging.getLogger(__name__)


class WeightsyncTorchRLScheme(_TrainerEnd, _WorkerEnd):
    """A TorchRL ``WeightSyncScheme`` whose bytes move through a weightsync scheme.

    The trainer's end is a weightsync sender (created by ``init_on_sender``); each collector
    worker's end a weightsync receiver (created by ``connect`` there). The picklable
    weightsync scheme travels to the workers inside this object."""

    _weightsync_class: Callable[..., ws.WeightSyncScheme]
    #: attributes that stay in the process that made them (never pickled to a worker)
    _process_local: tuple[str, ...] = ("_sender", "_receiver", "_apply_points", "_per_worker")
    #: whether a batch start waits (up to ``timeout``) for a version already published whose
    #: bytes are still on their way: only where they come while this thread waits
    _wait_for_published: bool = True
    #: whether a worker idle between batches applies a version as it arrives (a background
    #: applier gated by the batch hooks), not only at its next batch start
    _apply_when_idle: bool = True
    #: whether a policy that is no module (TorchRL's ``RandomPolicy``) is taken, with nothing
    #: to sync (TorchRL's Ray scheme), or refused (TorchRL's process schemes refuse it)
    _accepts_stateless_policy: bool = False
    #: whether each worker may have its own weights (``params_map``, ``device_map_fn``,
    #: distinct policy factories, per-worker weight dicts): one weightsync scheme per worker
    _per_worker_capable: bool = True
    #: TorchRL's flag: each worker its own weights (set by the schemes that take it)
    per_worker_weights: bool = False

    def __init__(self, strategy: str = "tensordict", sync: bool = True, *,
                 timeout: float = 60.0, connect_timeout: float = 300.0) -> None:
        super().__init__(strategy)
        self.sync = sync
        self.timeout = required_timeout(timeout, "timeout")
        self.connect_timeout = required_timeout(connect_timeout, "connect_timeout")
        self._ws: ws.WeightSyncScheme | None = None   # picklable: travels to the workers
        self._streams: list[ws.WeightSyncScheme] | None = None  # per-worker: one per worker
        self._per_worker: PerWorkerSenders | None = None  # the trainer's ends of _streams
        self._worker_devices: list[str] = []
        self._local = False                            # a single-process Collector
        self._no_weights = False                       # a policy without tensors: no-op sync
        self._sender: ws.WeightSender | None = None
        self._pending_async = False
        self._receiver: ws.WeightReceiver | None = None
        self._apply_points: ApplyPoints | None = None  # where this worker applies versions

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sync={self.sync}, weightsync={self._ws!r})"

    @property
    def weightsync_scheme(self) -> ws.WeightSyncScheme | None:
        """The weightsync scheme underneath (``None`` before ``init_on_sender``, and with
        per-worker weights: see ``weightsync_schemes``)."""
        return self._ws

    @property
    def weightsync_schemes(self) -> list[ws.WeightSyncScheme]:
        """With per-worker weights, worker ``i``'s own weightsync scheme (one worker each);
        otherwise the one scheme all workers share (empty before ``init_on_sender``)."""
        if self._streams is not None:
            return list(self._streams)
        return [self._ws] if self._ws is not None else []

    @property
    def worker_versions(self) -> dict[int, int]:
        """On the trainer, the newest version sent to each worker (with per-worker weights
        each worker counts its own; otherwise every worker shares the scheme's count)."""
        if self._per_worker is not None:
            return self._per_worker.versions
        return {idx: self.version for idx in range(len(self._worker_devices))}

    @property
    def is_receiver(self) -> bool:
        """Whether this end is a worker's (a receiver) rather than the trainer's."""
        return self._receiver is not None

    @property
    def version(self) -> int:
        """The version this end holds: the newest sent (trainer) or applied (worker)."""
        if self._per_worker is not None:  # the newest any worker was sent
            return max(self._per_worker.versions.values(), default=-1)
        end = self._sender if self._sender is not None else self._receiver
        return end.version if end is not None else -1

    # ============================================================== both
    def create_transport(self, **kwargs: Any) -> Any:
        """The weightsync end this scheme drives (TorchRL's abstract hook; not used by the
        collectors with this scheme)."""
        return self._sender if self._sender is not None else self._receiver

    def __getstate__(self) -> dict[str, Any]:
        # the ends stay where they were made (a forked child's copy of the sender is inert:
        # weightsync marks it closed there); workers create their own receiver
        state = super().__getstate__()
        for key in self._process_local:
            state[key] = None
        # workers get the workers' copy of each weightsync scheme (a sharded one's pickle
        # then leaves its trainer ranks' key out)
        if state.get("_ws") is not None:
            state["_ws"] = state["_ws"].for_workers()
        if state.get("_streams") is not None:
            state["_streams"] = [scheme.for_workers() for scheme in state["_streams"]]
        state["_pending_async"] = False
        return state

    def shutdown(self) -> None:
        """Close this end: the sender (trainer) or receiver (worker); safe to call twice."""
        sender, self._sender = getattr(self, "_sender", None), None
        streams, self._per_worker = getattr(self, "_per_worker", None), None
        if streams is not None:
            streams.close(self.timeout)
        points, self._apply_points = getattr(self, "_apply_points", None), None
        if points is not None:  # first: its idle applier polls the receiver
            points.close()
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if sender is not None:
            try:
                self._finish_async_of(sender)
            except ws.WeightSyncError as exc:  # e.g. RayCollector kills its actors first
                logger.warning("%s: the last update (sync=False) did not reach every worker "
                               "before shutdown: %s", type(self).__name__, exc)
            finally:
                sender.close()
        if receiver is not None:
            receiver.close()
        super().shutdown()
