"""Ray actors as weightsync workers: a mixin that gives any actor class the methods the
:class:`~weightsync.schemes.ray.RayWeightSender` calls.

    @ray.remote
    class Collector(RayWeightReceiverMixin):
        def __init__(self, scheme, worker_idx):
            self.policy = make_policy()
            self.weightsync_setup(scheme, worker_idx, self.policy)

        def collect(self):
            self.weightsync_receiver.poll()          # newest delivered version, if any
            ...

    sender = scheme.create_sender(collectors)      # in the driver or in a trainer actor
    sender.register_model(policy); sender.connect(); sender.send()

Deliveries run as actor method calls. In a plain actor they run between your methods; in a
threaded actor (``.options(max_concurrency=2)``) they run while ``collect`` runs, staged in
the background, and ``poll()`` applies them whole.
"""

from __future__ import annotations

import contextlib
from typing import Any

from weightsync.schemes.ray import RayWeightReceiver, RayWeightSyncScheme


class RayWeightReceiverMixin:
    """Holds ``self.weightsync_receiver`` and answers the sender's calls."""

    weightsync_receiver: RayWeightReceiver

    def weightsync_setup(
        self, scheme: RayWeightSyncScheme, worker_idx: int, model: Any, *, announce: bool = True
    ) -> RayWeightReceiver:
        """Create the receiver for ``model``; ``announce`` tells the sender about this actor
        (a replacement for a dead one joins at the sender's next send)."""
        receiver = scheme.create_receiver(worker_idx=worker_idx)
        receiver.register_model(model)
        self.weightsync_receiver = receiver
        if announce:
            with contextlib.suppress(ValueError):  # no sender yet: it is handed our handle
                receiver.announce()
        return receiver

    def weightsync_version(self) -> int:
        return self.weightsync_receiver.version

    def weightsync_path(self) -> str | None:
        """``"node-local"``, ``"relayed"`` or ``"broadcast"``: how versions reach this
        actor."""
        return self.weightsync_receiver.path

    # called by the sender ------------------------------------------------------
    def _weightsync_check(self, layout: dict[str, Any]) -> str:
        return self.weightsync_receiver.check_layout(layout)

    def _weightsync_attach(self, node_local: dict[str, Any]) -> bool:
        return self.weightsync_receiver.attach_local(node_local)

    def _weightsync_join(self, info: dict[str, Any], layout: dict[str, Any],
                         relay: dict[str, Any] | None = None) -> dict[str, Any] | None:
        return self.weightsync_receiver.join(info, layout, relay)

    def _weightsync_receive(
        self, version: int, keep: bool, messages: list[dict[str, Any]] | None = None,
        delivery: dict[str, Any] | None = None,
    ) -> int | dict[str, Any]:
        return self.weightsync_receiver.take(version, keep, messages, delivery)
