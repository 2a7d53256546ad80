"""TorchRL's transport protocol, for the TorchRL-named adapters at weightsync's edge.

:class:`TransportBackend` is the API TorchRL's weight-sync schemes call on a transport
(``send_weights``, ``receive_weights``, ``setup_connection_and_weights_on_sender`` /
``setup_connection_and_weights_on_receiver``). weightsync satisfies it with classes named
as TorchRL names them, so code written against TorchRL's transports runs unchanged:
``SharedMemTransport`` (``shm.transport``) and ``MPTransport`` (``mp.transport``) are
adapters over the shared-memory and MultiProcess data paths, and ``RayTransport``
(``ray.transport``) keeps TorchRL's per-actor signature and points to weightsync's Ray
scheme instead of sending on its own.

It is not the interface weightsync's transports implement: that is
:class:`~weightsync.core.endpoints.WeightWriter` (the trainer's end) and
:class:`~weightsync.core.endpoints.WeightReader` (a worker's end), which the public
``WeightSender`` / ``WeightReceiver`` drive; the adapters sit beside those ends, over the
same data-path classes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from weightsync.core.strategy import WeightStrategy


@runtime_checkable
class TransportBackend(Protocol):
    """TorchRL's transport API: how bytes move between one sender and its receivers, as
    TorchRL's schemes drive them (they add the rest: rendezvous, acks, liveness)."""

    def send_weights(self, weights: Any) -> None:
        """Send weights to the receiver(s)."""
        ...

    def receive_weights(
        self,
        timeout: float | None = None,
        *,
        weights: Any = None,
        model: Any = None,
        strategy: WeightStrategy | None = None,
    ) -> Any | None:
        """Receive weights and apply them to ``model``; None if nothing new came in time."""
        ...

    def setup_connection_and_weights_on_sender(self) -> None:
        """Sender-side set-up once the workers exist (may be a no-op)."""
        ...

    def setup_connection_and_weights_on_receiver(
        self,
        *,
        worker_idx: int,
        weights: Any = None,
        model: Any = None,
        strategy: WeightStrategy | None = None,
    ) -> Any:
        """Receiver-side set-up: join the sender and take the initial weights."""
        ...
