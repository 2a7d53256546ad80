"""A ``RayCollector`` actor whose collector is a multi-process one
(``collector_class=MultiSyncCollector`` or ``MultiAsyncCollector``): the actor's own
policy never runs (its worker processes run theirs), so each version the actor receives is
applied to the actor's policy as soon as it is delivered and then forwarded, through the
actor's collector's own ``update_policy_weights_()``, to its worker processes.

The second hop is the actor collector's own weight-sync scheme: weightsync's
``SharedMemWeightSyncScheme`` when it has one (``collector_kwargs={"weight_sync_schemes":
{"policy": SharedMemWeightSyncScheme()}}``, or the one ``RayCollector`` adds for a
``policy_factory``), so each worker process takes the version whole at a batch start;
otherwise whatever scheme that collector built (TorchRL's default), with its semantics."""

from __future__ import annotations

import logging
import weakref
from typing import Any

from weightsync.integrations.torchrl.collector_hooks import model_in_collector

logger = logging.getLogger(__name__)


def is_multi_process_collector(collector: Any) -> bool:
    """Whether ``collector`` is one of TorchRL's multi-process collectors."""
    from torchrl.collectors import MultiCollector

    return isinstance(collector, MultiCollector)


def actor_policy(collector: Any, model_id: str) -> Any:
    """The policy a multi-process collector actor receives versions into: its own, else
    (built from a ``policy_factory`` only) one its factory makes, held by the scheme."""
    try:
        return collector.get_model(model_id)
    except (ValueError, AttributeError, KeyError):
        return model_in_collector(collector, model_id)


def _inner_scheme(collector: Any, model_id: str) -> Any:
    schemes = getattr(collector, "_weight_sync_schemes", None) or {}
    return schemes.get(model_id)


class InnerForwarder:
    """Forwards the versions a ``RayCollector`` actor receives to the worker processes of the
    multi-process collector that actor is (``collector``), for model ``model_id``."""

    def __init__(self, collector: Any, model_id: str) -> None:
        self._collector = weakref.ref(collector)
        self.model_id = model_id
        scheme = _inner_scheme(collector, model_id)
        if scheme is None:
            raise ValueError(
                f"RayCollector's actor collector ({type(collector).__name__}) has no weight "
                f"sync scheme for {model_id!r}, so versions could not reach its worker "
                "processes; give it one: collector_kwargs={'weight_sync_schemes': {'policy': "
                "weightsync.integrations.torchrl.SharedMemWeightSyncScheme()}}")
        if not type(scheme).__module__.startswith("weightsync."):
            logger.info(
                "%s in a RayCollector actor forwards versions to its worker processes "
                "through %s (not weightsync's: its workers may take a version mid-batch); "
                "pass collector_kwargs={'weight_sync_schemes': {'policy': weightsync's "
                "SharedMemWeightSyncScheme()}} for whole versions at batch starts",
                type(collector).__name__, type(scheme).__name__)

    def forward(self, model: Any, version: int) -> None:
        """Send ``model``'s weights (version ``version`` of the trainer's, just applied in
        this actor) to every worker process of the actor's collector."""
        collector = self._collector()
        if collector is None:
            return
        collector.update_policy_weights_(model, model_id=self.model_id)
        logger.debug("version %d forwarded to the worker processes of %s", version,
                     type(collector).__name__)
