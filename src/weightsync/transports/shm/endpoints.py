"""The SharedMem transport's two ends as the send lifecycle drives them (``WeightWriter``
and ``WeightReader`` of ``core.endpoints``), over the slot pool's data path.

:class:`SharedMemWriter`: workers admitted by the hub (``local.members``) are attached to
the shared slots; a version is published by one packed write into a free slot, and that
is delivery: a worker's next ``poll()`` takes it. Workers blocked in ``receive()`` are
woken all at once through the control block's ring word (``futex``).
:class:`SharedMemReader`: copies the newest slot into the model, or (zero-copy) points the
model's tensors at read-only views of it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import SchemaMismatchError, WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, Message
from weightsync.transports.local.link import LocalLink
from weightsync.transports.local.members import Members
from weightsync.transports.shm.publisher import SlotPublisher
from weightsync.transports.shm.reader import SlotReader
from weightsync.transports.shm.slots import DEFAULT_MODEL_ID

#: the longest a blocked worker sleeps between two looks at the control block
_WAIT_SLICE = 0.05


class SharedMemWriter:
    """The trainer's end: one write per send into a slot no worker reads, through its
    :class:`SlotPublisher` (``slots``)."""

    needs_acks = False  # a published slot is delivered: the next poll() takes it

    def __init__(self, address: str, token: str, uid: int, num_workers: int,
                 max_slots: int | None) -> None:
        """``max_slots`` None: ``num_workers + 2``, plus one per zero-copy worker (each
        pins the slot it views besides its target)."""
        self.slots = SlotPublisher(max_slots=max_slots or num_workers + 2,
                                   grow_for_views=max_slots is None)
        self.members = Members(address, token, uid, num_workers,
                               on_join=self.slots.attach_worker, on_lost=self._detach)

    def _detach(self, worker_idx: int) -> None:
        """A worker left or died: keep the version it applied (the publisher forgets it)."""
        applied = self.slots.applied_version(worker_idx)
        with self.members.cond:
            state = self.members.table.workers[worker_idx]
            state.version = max(state.version, applied)
        self.slots.detach_worker(worker_idx)

    def start(self, deadline: Deadline) -> None:
        self.members.start()

    def publish(self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        self.members.check_hub()
        with self.members.joining:
            reachable, lost = self.members.reachable(requested)
            targets = [w for w, _ in reachable]
            self.slots.publish(DEFAULT_MODEL_ID, flat, targets, version, deadline.remaining())
        return lost

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        """Publishing delivered the version, and the publisher woke the workers blocked
        in ``receive()`` (for a large model as the pack began); report who left. With no
        acks, a dead worker is found here or never: looked for after the wake-ups, so the
        live workers are not kept waiting by the look. A worker that already holds the
        version got it, even if it has left since."""
        pending = self._without_version(targets, version)
        self.members.drop_dead(pending)
        # a worker may have applied the version and left since the look above (or be
        # leaving: the hub drops its channel before ``_detach`` records its version): it
        # is gone for good now, so one more look finds what it applied
        lost = self.members.reachable(pending)[1]
        still = set(self._without_version(list(lost), version))
        return {w: why for w, why in lost.items() if w in still}

    def _without_version(self, workers: list[int], version: int) -> list[int]:
        """The workers that hold no ``version`` (or newer). Shared memory first, then the
        table: ``_detach`` copies one into the other before the publisher forgets it, so
        either read sees a version applied by a worker that left before the first."""
        applied = {w: self.slots.applied_version(w) for w in workers}
        with self.members.cond:
            return [w for w in workers
                    if max(applied[w], self.members.table.workers[w].version) < version]

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Nothing to wait for: publishing is delivery."""

    def _refresh_versions(self) -> None:
        """The versions the workers wrote into shared memory as they applied (under cond)."""
        for idx, state in self.members.table.workers.items():
            if state.connected:
                state.version = max(state.version, self.slots.applied_version(idx))

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        self.members.wait_joined(version, deadline, refresh=self._refresh_versions)

    def held_versions(self) -> dict[int, int]:
        with self.members.cond:
            self._refresh_versions()
        return self.members.held_versions()

    def close(self) -> None:
        self.members.close()
        self.slots.close()


class SharedMemReader:
    """A worker's end: applies the newest slot its target names, at the worker's call,
    through its :class:`SlotReader` (``slots``)."""

    def __init__(self, link: LocalLink, *, zero_copy: bool) -> None:
        self.link = link
        self.worker_idx = link.worker_idx
        self.expecting = "weights from the sender"
        self.views_model = zero_copy
        self.slots = SlotReader()
        link.on_sender_lost = self._end_wait

    def _on_message(self, message: Message, channel: Channel) -> bool:
        return self.slots.handle_message(message)

    def _end_wait(self) -> None:
        """The trainer is gone: cut a wait short (every sleeper looks again)."""
        ring = self.slots.ring()
        if ring is not None:
            ring.wake()

    def open(self, local: Layout | None, deadline: Deadline) -> None:
        self.link.open(deadline, self._on_message)
        while True:
            try:
                sent = self.slots.wait_for_model(DEFAULT_MODEL_ID, Deadline(deadline.slice(0.1)))
                break
            except WeightSyncTimeoutError:
                self.link.check_sender(NO_VERSION)
                if deadline.expired():
                    raise WeightSyncTimeoutError(
                        f"worker {self.worker_idx}: the sender sent no weights within "
                        f"{deadline}") from None
        if local is not None:
            try:
                sent.check_compatible(local, other_name=f"worker {self.worker_idx}")
            except SchemaMismatchError as exc:
                self.link.report_mismatch(exc)
                raise

    def newer_available(self, version: int) -> bool:
        self.link.check_connected()
        return self.slots.published_version(self.worker_idx) != version

    def apply_newest(self, dest: dict[str, torch.Tensor], version: int,
                     deadline: Deadline) -> int | None:
        self.link.check_connected()
        if self.views_model:  # re-points ``.data``: autograd records nothing, no no_grad()
            return self.slots.adopt_latest(self.worker_idx, dest, version, deadline)
        return self.slots.apply_latest(self.worker_idx, dest, version, deadline)

    def wait(self, version: int, deadline: Deadline) -> None:
        ring = self.slots.ring()
        if ring is None:  # no model yet, or no futex here: the trainer sends a notice
            self._wait_for_notice(version, deadline)
            return
        try:
            seen = ring.value  # read before the look: a raise after it ends the sleep at once
            self.link.check_sender(version)
            if self.slots.published_version(self.worker_idx) <= version:
                ring.wait(seen, deadline.slice(_WAIT_SLICE))
        except ValueError:  # closed meanwhile by another thread: the caller finds it closed
            return

    def _wait_for_notice(self, version: int, deadline: Deadline) -> None:
        # raise the flag first, then look: a version published after the look is noticed
        # (should the two race, the next 50 ms slice of the wait finds it)
        self.slots.set_waiting(self.worker_idx, True)
        try:
            self.link.wait(version, deadline,
                           lambda: self.slots.published_version(self.worker_idx) > version)
        finally:
            self.slots.set_waiting(self.worker_idx, False)

    def check_sender(self, version: int) -> None:
        self.link.check_sender(version)

    def ack(self, version: int) -> None:
        """After connect, over the socket (the trainer's connect() waits for it); later
        versions are recorded in shared memory by ``apply_latest``."""
        if self.link.acked == NO_VERSION:
            self.link.ack(version, timeout=10.0)

    def close(self, dest: dict[str, torch.Tensor] | None) -> None:
        if self.views_model and dest is not None:
            # the model keeps the version it holds, as its own copy: once the slot's lock
            # is gone the sender may rewrite that memory
            with torch.no_grad():
                for tensor in dest.values():
                    tensor.data = tensor.data.clone()
        self.slots.forget_opened()  # before the goodbye: see SlotReader.forget_opened
        self.link.close()
        self.slots.close()
