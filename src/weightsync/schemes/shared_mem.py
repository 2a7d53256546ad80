"""SharedMemWeightSyncScheme: workers on this host read versions out of shared memory."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy
from weightsync.schemes.local import LocalScheme
from weightsync.schemes.local_receiver import LocalReceiver
from weightsync.schemes.local_sender import LocalSender
from weightsync.transports.local_channel import Channel, ChannelClosed, ChannelTimeout, Message
from weightsync.transports.shared_mem import DEFAULT_MODEL_ID, SharedMemTransport

logger = logging.getLogger(__name__)


class SharedMemWeightSyncScheme(LocalScheme):
    """Sync through shared memory: one packed write per send, whatever the worker count.

    ``max_slots`` caps the copies kept in shared memory (default ``num_workers + 2``, enough
    that a send never waits for a worker that is behind; two are used in steady state).
    """

    def __init__(
        self, num_workers: int = 1, *, timeout: float = 60.0,
        strategy: WeightStrategy | None = None, max_slots: int | None = None,
        zero_copy: bool = False,
    ) -> None:
        super().__init__(num_workers, timeout=timeout, strategy=strategy)
        self.max_slots = max_slots
        self.zero_copy = bool(zero_copy)  # the default of create_receiver(zero_copy=None)

    def create_sender(self) -> SharedMemWeightSender:
        return SharedMemWeightSender(self)

    def create_receiver(
        self, worker_idx: int = 0, zero_copy: bool | None = None
    ) -> SharedMemWeightReceiver:
        """The end for worker ``worker_idx``. ``zero_copy=True``: the model's weights become
        read-only views into the shared slot of the version it holds, switched to the
        newest at ``poll()``/``receive()`` (microseconds, whatever the size; still
        tear-free); ``close()`` gives the model its own copy of the version it holds."""
        return SharedMemWeightReceiver(
            self, worker_idx, zero_copy=self.zero_copy if zero_copy is None else zero_copy
        )


class SharedMemWeightSender(LocalSender):
    _delivery_needs_ack = False  # a published slot is delivered: the next poll() takes it

    def __init__(self, scheme: SharedMemWeightSyncScheme) -> None:
        self.transport = SharedMemTransport(
            auto_register=True, max_slots=scheme.max_slots or scheme.num_workers + 2
        )
        super().__init__(scheme)

    def _publish(
        self, flat: Mapping[str, torch.Tensor], targets: list[int], version: int,
        deadline: Deadline,
    ) -> None:
        self.transport.publish(DEFAULT_MODEL_ID, flat, targets, version, deadline.remaining())

    def _deliver(self, targets: list[int], version: int, deadline: Deadline) -> dict[int, str]:
        """Publishing delivered the version; wake only the workers blocked in receive()."""
        reachable, lost = self._reachable(targets)
        for w, channel in reachable:
            if not self.transport.worker_waiting(w):
                continue
            try:
                if not channel.send_nowait({"t": "version", "v": version}):
                    # a worker that does not read its notices is lagging, not waited on:
                    # the version is published, and any notice it reads later wakes it
                    logger.debug("worker %d is not reading its notices (lagging)", w)
            except (ChannelClosed, ChannelTimeout) as exc:
                lost[w] = f"could not be notified: {exc}"
        return lost

    def worker_lag(self) -> dict[int, int]:
        """Lag from the versions the workers wrote into shared memory as they applied."""
        with self._cond:
            for idx, state in self._table.workers.items():
                if state.connected:
                    state.version = max(state.version, self.transport.applied_version(idx))
            return self._table.lag()

    def _on_join(self, worker_idx: int, channel: Channel) -> None:
        self.transport.attach_worker(worker_idx, channel)

    def _on_lost(self, worker_idx: int) -> None:
        self.transport.detach_worker(worker_idx)

    def _close_transport(self) -> None:
        self.transport.close()


class SharedMemWeightReceiver(LocalReceiver):
    _ack_on_delivery = False

    def __init__(
        self, scheme: SharedMemWeightSyncScheme, worker_idx: int, *, zero_copy: bool = False
    ) -> None:
        super().__init__(scheme, worker_idx)
        self.transport = SharedMemTransport()
        self.zero_copy = zero_copy

    def _destination(self) -> dict[str, torch.Tensor]:
        """In zero-copy mode, the model's own Parameter and buffer objects (their ``.data``
        is re-pointed, so optimizers, hooks and ``state_dict()`` keep working)."""
        dest = super()._destination()
        if not self.zero_copy:
            return dest
        if isinstance(self._model, torch.nn.Module):
            return dict(self._model.state_dict(keep_vars=True))
        if isinstance(self._model, Mapping) and all(
            isinstance(t, torch.Tensor) for t in self._model.values()
        ):
            return dict(self._model)
        raise TypeError(
            f"worker {self.worker_idx}: zero_copy=True needs an nn.Module or a flat dict of "
            f"tensors (their .data is re-pointed), got {type(self._model).__name__}"
        )

    def _handle(self, message: Message, channel: Channel) -> bool:
        return self.transport.handle_message(message)

    def _sender_layout(self, deadline: Deadline) -> Layout:
        while True:
            try:
                return self.transport.wait_for_model(DEFAULT_MODEL_ID, Deadline(deadline.slice(0.1)))
            except WeightSyncTimeoutError:
                self._wait_for_delivery(Deadline(0), "connect")
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"worker {self.worker_idx}: the sender sent no weights within "
                        f"{deadline.timeout}s"
                    ) from None

    def _newer_available(self) -> bool:
        return self.transport.published_version(self.worker_idx) != self._version

    def _apply_newest(self, dest: dict[str, torch.Tensor], deadline: Deadline) -> int | None:
        if self.zero_copy:
            with torch.no_grad():
                return self.transport.adopt_latest(self.worker_idx, dest, self._version, deadline)
        return self.transport.apply_latest(self.worker_idx, dest, self._version, deadline)

    def _confirm_applied(self, version: int) -> None:
        """Nothing to send: ``apply_latest`` wrote the version into the control block."""

    def _wait_for_delivery(self, deadline: Deadline, what: str) -> None:
        # raise the flag first, then look: a version published after the look is noticed
        # (worst case, should the two race, the next 50 ms slice of the wait finds it)
        self.transport.set_waiting(self.worker_idx, True)
        try:
            if self.transport.published_version(self.worker_idx) > self._version:
                return
            super()._wait_for_delivery(deadline, what)
        finally:
            self.transport.set_waiting(self.worker_idx, False)

    def _close_transport(self) -> None:
        if self.zero_copy and self._dest is not None and self._version >= 0:
            # the model keeps the version it holds, as its own copy: once the slot's lock
            # is gone the sender may rewrite that memory
            with torch.no_grad():
                for tensor in self._destination().values():
                    tensor.data = tensor.data.clone()
        self.transport.close()
