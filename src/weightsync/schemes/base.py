"""The sender/receiver API every scheme offers (docs/contract.md), independent of how bytes move."""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import Self

from weightsync.core.errors import WorkerLostError
from weightsync.core.layout import Layout
from weightsync.core.stats import SendStats
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0


class WeightSyncScheme(abc.ABC):
    """A picklable description of one sync: hand it to every worker with its index."""

    def __init__(
        self, *, timeout: float = DEFAULT_TIMEOUT, strategy: WeightStrategy | None = None
    ) -> None:
        if timeout is None or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.strategy = strategy or WeightStrategy(extract_as="state_dict")

    @abc.abstractmethod
    def create_sender(self) -> WeightSender:
        """The trainer-side end of this scheme."""

    @abc.abstractmethod
    def create_receiver(self, worker_idx: int = 0) -> WeightReceiver:
        """The end for worker ``worker_idx``."""


class _Closable:
    """``close()``, ``with`` and close-on-garbage-collection, for senders and receivers."""

    _closed = False

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close()


class WeightSender(_Closable, abc.ABC):
    """Trainer side: publishes versions of one model's weights to the workers."""

    def __init__(self, scheme: WeightSyncScheme) -> None:
        self.scheme = scheme
        self._model: Any = None
        self._layout: Layout | None = None
        self._stats = SendStats()
        self._closed = False

    # ------------------------------------------------------------------ model
    def register_model(self, model: Any) -> None:
        """The source of the weights: an ``nn.Module``, ``TensorDictBase`` or mapping."""
        flat = flat_tensors(model, what="register_model")
        if not flat:
            raise ValueError("register_model: the model has no parameters or buffers to sync")
        layout = Layout.from_weights(flat)
        if self._layout is not None and layout.fingerprint != self._layout.fingerprint:
            self._layout.check_compatible(layout, self_name="the model registered first",
                                          other_name="the new model")
        self._model = model
        self._layout = layout

    @property
    def layout(self) -> Layout | None:
        return self._layout

    def _weights_to_send(self, weights: Any) -> Mapping[str, torch.Tensor]:
        """Flat weights for one send, checked against the layout (nothing written yet)."""
        if weights is None:
            if self._model is None:
                raise RuntimeError("nothing to send: call register_model(model) or pass weights=")
            flat = flat_tensors(self._model, what="the registered model")
        else:
            flat = flat_tensors(weights, what="send(weights=...)")
            if self._layout is None:
                self._layout = Layout.from_weights(flat)
        assert self._layout is not None
        self._layout.check_weights(flat)
        return flat

    # ------------------------------------------------------------------ API
    @abc.abstractmethod
    def connect(self, timeout: float | None = None) -> int:
        """Block until every worker holds version 0 (publishing it if needed); returns 0."""

    @abc.abstractmethod
    def send_async(
        self, weights: Any = None, worker_ids: int | list[int] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Snapshot the weights now and start delivering them; finish with ``wait_async``.
        ``timeout`` bounds this call (a slot may be held by a slow reader)."""

    @abc.abstractmethod
    def wait_async(self, timeout: float | None = None) -> int:
        """Block until the pending ``send_async`` is delivered; returns its version."""

    def send(
        self,
        weights: Any = None,
        worker_ids: int | list[int] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Snapshot the weights now, deliver them, and return the new version."""
        self.send_async(weights, worker_ids)
        return self.wait_async(timeout)

    def update_weights(self, weights: Any = None) -> int:
        """Alias of :meth:`send` (the vLLM-style senders' name)."""
        return self.send(weights)

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The newest version published (-1 before the first)."""

    def worker_lag(self) -> dict[int, int]:
        return {}

    def stats(self) -> dict[str, Any]:
        """Per-send figures: bytes, seconds per phase, per-worker lag."""
        summary = self._stats.summary(self.worker_lag())
        summary["version"] = self.version
        summary["layout_nbytes"] = self._layout.nbytes if self._layout else 0
        return summary



class WeightReceiver(_Closable, abc.ABC):
    """Worker side: holds one model and applies whole versions to it, only when asked."""

    def __init__(self, scheme: WeightSyncScheme, worker_idx: int) -> None:
        if not isinstance(worker_idx, int) or worker_idx < 0:
            raise ValueError(f"worker_idx must be an int >= 0, got {worker_idx!r}")
        self.scheme = scheme
        self.worker_idx = worker_idx
        self._model: Any = None
        self._dest: dict[str, torch.Tensor] | None = None
        self._version = NO_VERSION
        self._closed = False

    def register_model(self, model: Any) -> None:
        """The local model that received weights are copied into, in place."""
        dest = flat_tensors(model, what="register_model")
        Layout.from_weights(dest)  # refuses meta-device and sparse tensors now, by name
        self._dest = dest
        self._model = model

    def _destination(self) -> dict[str, torch.Tensor]:
        """The model's tensors as they are now. Resolved again at each apply, so a model
        changed after ``register_model`` (``load_state_dict(assign=True)``, a replaced
        submodule) receives the weights instead of tensors it no longer uses."""
        if self._dest is None:
            raise RuntimeError(
                f"worker {self.worker_idx}: call register_model(model) before connect()"
            )
        if self._model is not None:
            fresh = flat_tensors(self._model, what=f"worker {self.worker_idx}'s model")
            if fresh.keys() != self._dest.keys() or any(
                fresh[k] is not t and (fresh[k].shape != t.shape or fresh[k].dtype != t.dtype
                                       or fresh[k].device != t.device)
                for k, t in self._dest.items()
            ):
                Layout.from_weights(self._dest).check_compatible(
                    Layout.from_weights(fresh), self_name="the model as registered",
                    other_name=f"worker {self.worker_idx}'s model now",
                )
            self._dest = fresh
        return self._dest

    @property
    def model(self) -> Any:
        return self._model

    @property
    def version(self) -> int:
        """The version the local model holds now (-1 before connect)."""
        return self._version

    @abc.abstractmethod
    def connect(self, timeout: float | None = None) -> int:
        """Join the sender, receive and apply the current version; returns it."""

    @abc.abstractmethod
    def poll(self) -> int | None:
        """Apply the newest delivered version if newer than ours; never blocks."""

    @abc.abstractmethod
    def receive(self, timeout: float | None = None) -> int | None:
        """Block for a newer version (up to ``timeout``, default the scheme's) and apply
        it; None on timeout."""



def lost_error(worker_ids: list[int], version: int, why: dict[int, str]) -> WorkerLostError:
    detail = "; ".join(f"worker {w}: {why.get(w, 'connection lost')}" for w in worker_ids)
    return WorkerLostError(
        f"lost worker(s) {worker_ids} while sending version {version} ({detail}); the other "
        "workers got it, and a restarted worker with the same index gets the current version "
        "when it connects",
        worker_ids=worker_ids, version=version,
    )
