"""``RayTransport``: TorchRL's per-actor Ray transport, kept for code written against it.

TorchRL's ``RayWeightSyncScheme`` holds one per actor and drives them. weightsync's
``RayWeightSyncScheme`` drives every actor at once instead (its sender's ``RayWriter``, each
actor's ``RayReader``, one group for the bytes), so this class keeps the seed's constructor
and methods and sends or receives nothing itself: the methods that would say so and name
what to use instead. It stays here, not at the TorchRL edge, so that
``weightsync.RayTransport`` imports without TorchRL.
"""

from __future__ import annotations

from typing import Any

from weightsync.core.strategy import WeightStrategy

_SEND_INSTEAD = (
    "RayTransport does not send on its own: weightsync's RayWeightSyncScheme sends to every "
    "actor at once; use scheme.connect() and sender.send(weights) (or send_async + wait)"
)
_RECEIVE_INSTEAD = (
    "RayTransport does not receive on its own: inside the actor, use RayWeightReceiverMixin "
    "(or scheme.create_receiver(worker_idx) and receiver.poll()/receive())"
)


class RayTransport:
    """TorchRL's transport to ONE Ray actor, by its signature (seed 003). ``backend`` must
    be ``"gloo"`` or ``"nccl"``; the other arguments are kept as given."""

    def __init__(
        self,
        *,
        remote_actor: Any = None,
        worker_idx: int | None = None,
        backend: str = "gloo",
        connection_info_name: str = "connection_info",
        model_id: str | None = None,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.remote_actor = remote_actor
        self.worker_idx = 0 if worker_idx is None else worker_idx
        self.backend = backend
        self.connection_info_name = connection_info_name
        self.model_id = model_id or "policy"
        self.model: Any = None

    def set_model(self, model: Any) -> None:
        """The model received weights would be applied to."""
        self.model = model

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing per actor: the scheme's ``connect()`` sets up the rendezvous and group."""

    def send_weights(self, weights: Any) -> None:
        raise RuntimeError(f"worker {self.worker_idx}: {_SEND_INSTEAD}")

    def send_weights_async(self, weights: Any) -> None:
        raise RuntimeError(f"worker {self.worker_idx}: {_SEND_INSTEAD}")

    def wait_ack(self) -> None:
        """Nothing is ever pending here: raises, as TorchRL does without a send."""
        raise RuntimeError(f"worker {self.worker_idx}: no pending send to wait for. "
                           f"{_SEND_INSTEAD}")

    def receive_weights(
        self,
        timeout: float | None = None,
        *,
        weights: Any = None,
        model: Any = None,
        strategy: WeightStrategy | None = None,
    ) -> Any | None:
        raise RuntimeError(f"worker {self.worker_idx}: {_RECEIVE_INSTEAD}")

    def setup_connection_and_weights_on_receiver(
        self,
        *,
        worker_idx: int,
        strategy: WeightStrategy | None = None,
        model: Any | None = None,
        weights: Any | None = None,
    ) -> Any:
        raise RuntimeError(f"worker {worker_idx}: {_RECEIVE_INSTEAD}")
