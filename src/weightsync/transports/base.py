"""The transport interface every weightsync transport implements."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from weightsync.core.strategy import WeightStrategy


@runtime_checkable
class TransportBackend(Protocol):
    """How bytes move between one sender and its receivers; schemes add the rest
    (rendezvous, acks, liveness, versions)."""

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
