"""``LLMCollector(weight_updater=...)`` on the LLM scheme: the updater, and the collector's
``policy_version`` made to follow the version the engine holds."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torchrl.collectors.weight_update import WeightUpdaterBase

from weightsync.core.deadline import checked_timeout

logger = logging.getLogger(__name__)


class EngineScheme(Protocol):
    """What the updater needs of ``llm.VLLMDoubleBufferSyncScheme`` (named here as a
    protocol, so that this module does not import the one that re-exports it)."""

    timeout: float

    def create_receiver(self, vllm_engine: Any) -> Any: ...


class Committer(Protocol):
    """What the updater needs of ``llm.VLLMDoubleBufferWeightSender``."""

    def update_weights(self, weights: Any = None) -> Any: ...


with warnings.catch_warnings():  # TorchRL deprecates subclassing; LLMCollector still needs it
    warnings.simplefilter("ignore", DeprecationWarning)

    class VLLMDoubleBufferWeightUpdater(WeightUpdaterBase):
        """``LLMCollector(weight_updater=...)`` on the scheme: ``update_policy_weights_()``
        brings the engine to the trainer's newest committed version, and the collector's
        ``policy_version`` (``track_policy_version=True``) is the version the engine holds,
        stamped before each batch so every frame names the version that generated it.

        ``update_policy_weights_(weights)`` first commits ``weights`` (needs ``sender=``)."""

        def __init__(self, scheme: EngineScheme, vllm_engine: Any, *,
                     sender: Committer | None = None,
                     timeout: float | None = None) -> None:
            self.scheme = scheme
            self.receiver = scheme.create_receiver(vllm_engine)
            self.sender = sender
            chosen = checked_timeout(timeout, "timeout")
            self.timeout = scheme.timeout if chosen is None else chosen

        @property
        def version(self) -> int:
            """The version the engine holds (-1 before the first update)."""
            return self.receiver.version

        def _push_weights(self, *, policy_or_weights: Any = None,
                          worker_ids: Any = None) -> None:
            if policy_or_weights is not None:
                if self.sender is None:
                    raise ValueError(
                        "update_policy_weights_(weights) commits them first: build the "
                        "updater with sender=scheme.create_sender() (or commit with the "
                        "sender and call update_policy_weights_() with no argument)")
                self.sender.update_weights(policy_or_weights)
            self._sync_weights_with_worker(server_weights=None)

        def _sync_weights_with_worker(self, *, worker_id: Any = None,
                                      server_weights: Any = None) -> None:
            version = self.receiver.apply_weights(timeout=self.timeout)
            if version is not None:
                logger.info("LLMCollector engine now holds version %d", version)
            for collector in self.collectors or []:
                if collector is not None:
                    stamp_version(collector, self.receiver.version)

        def register_collector(self, collector: Any) -> None:
            """Register ``collector``; its version tracker follows the engine's version
            (not a count of updates), stamped before each of its batches."""
            super().register_collector(collector)
            follow_engine_version(collector, self)


def stamp_version(collector: Any, version: int) -> None:
    """Make ``collector``'s ``PolicyVersion`` read ``version``, the frame it will collect
    next included: that one was stamped by the env step that ended the previous batch."""
    tracker = getattr(collector, "policy_version_tracker", None)
    if tracker is None or version < 0 or not hasattr(tracker, "version"):
        return
    as_int = getattr(tracker, "version_type", int) in (int, "int")
    tracker.version = int(version) if as_int else str(version)
    shuttle = getattr(collector, "_shuttle", None)
    if as_int and shuttle is not None and "policy_version" in shuttle:
        held = shuttle.get("policy_version")
        shuttle.set("policy_version", torch.full_like(held, int(version)))


def follow_engine_version(collector: Any, updater: VLLMDoubleBufferWeightUpdater) -> None:
    """Replace ``collector``'s per-update counter with the engine's version: its
    ``increment_version`` (run after every ``update_policy_weights_``, even one that
    loaded nothing) and each batch start now stamp the version the engine holds."""
    ref = weakref.ref(updater)

    def increment_version() -> None:
        owner = ref()
        if owner is not None:
            stamp_version(collector, owner.version)

    collector.increment_version = increment_version
    original = collector.iterator

    def iterator() -> Iterator[Any]:
        batches = original()
        while True:
            owner = ref()
            if owner is not None:
                stamp_version(collector, owner.version)
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    collector.iterator = iterator
