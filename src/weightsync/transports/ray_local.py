"""The node-local path of the Ray scheme: actors on the sender's node copy each version out
of the sender's shared memory instead of taking it over the network.

The sender writes each version once into a :class:`SharedMemTransport` slot; each
co-located actor opens those segments through ``/proc/<pid>/fd`` and copies its version out
at ``poll()``, the way NCCL and Ray's object store use shared memory within a node. Hosts
that share ``/proc`` (containers, network namespaces) are told apart by Ray's node id.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.transports.local_channel import Message
from weightsync.transports.memfd import Segment
from weightsync.transports.ray_group import current_node_id
from weightsync.transports.shared_mem import DEFAULT_MODEL_ID, SharedMemTransport

logger = logging.getLogger(__name__)

_TOKEN_BYTES = 16


@dataclass
class NodeLocalInfo:
    """How an actor finds out whether it shares the sender's node and may open the sender's
    segments (plain data: crosses Ray): a probe segment holding a token, at ``fd`` in the
    sender process ``pid``."""

    node_id: str
    pid: int
    fd: int
    token: str


def _open_foreign_fd(pid: int, fd: int) -> int:
    """Open the file behind another process's descriptor (same host and user) via /proc."""
    return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def probe_node_local(info: NodeLocalInfo) -> bool:
    """True if this process runs on the sender's node and can open its segments."""
    if info.node_id != current_node_id():
        return False
    try:
        fd = _open_foreign_fd(info.pid, info.fd)
    except OSError as exc:
        logger.info("cannot open the sender's segments (%s); using the broadcast", exc)
        return False
    try:
        return os.pread(fd, _TOKEN_BYTES, 0).hex() == info.token
    finally:
        os.close(fd)


class _Outbox:
    """Stands in for a worker's channel in a :class:`SharedMemTransport`: keeps the segment
    messages (fds by number) for the next Ray call to carry to that actor."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.closed = False

    def send(self, header: dict[str, Any], payload: Any = None, fds: Sequence[int] = (),
             timeout: float | None = None) -> None:
        self.messages.append({"header": header, "fds": list(fds)})

    def take(self) -> list[dict[str, Any]]:
        out, self.messages = self.messages, []
        return out

    def close(self) -> None:
        self.closed = True


class NodeLocalSender:
    """The sender's path to actors on its own node: a :class:`SharedMemTransport` (slot pool,
    per-worker targets, tear-free reads under slot locks) whose segments the actors open
    through ``/proc/<pid>/fd``. A send writes one slot whatever the number of actors."""

    def __init__(self, max_slots: int) -> None:
        self.transport = SharedMemTransport(auto_register=True, max_slots=max_slots)
        self._probe = Segment.create(_TOKEN_BYTES)
        token = secrets.token_bytes(_TOKEN_BYTES)
        os.pwrite(self._probe.fd, token, 0)
        self.info = NodeLocalInfo(current_node_id(), os.getpid(), self._probe.fd, token.hex())
        self._outboxes: dict[int, _Outbox] = {}

    @property
    def workers(self) -> set[int]:
        return set(self._outboxes)

    def attach(self, worker_idx: int) -> None:
        if worker_idx not in self._outboxes:
            self._outboxes[worker_idx] = outbox = _Outbox()
            self.transport.attach_worker(worker_idx, outbox, at_latest=False)  # type: ignore[arg-type]

    def detach(self, worker_idx: int) -> None:
        if self._outboxes.pop(worker_idx, None) is not None:
            self.transport.detach_worker(worker_idx)

    def publish(self, flat: Mapping[str, torch.Tensor], worker_ids: Sequence[int], version: int,
                timeout: float | None) -> None:
        self.transport.publish(DEFAULT_MODEL_ID, flat, list(worker_ids), version, timeout)

    def point_at_latest(self, worker_ids: Sequence[int]) -> None:
        self.transport.point_at_latest(worker_ids)

    def latest_buffers(self) -> dict[str, torch.Tensor]:
        """The packed buffers of the newest version (stable until two sends later)."""
        return self.transport.latest_buffers()

    def messages_for(self, worker_idx: int) -> list[dict[str, Any]]:
        outbox = self._outboxes.get(worker_idx)
        return [] if outbox is None else outbox.take()

    def close(self) -> None:
        self.transport.close()
        self._outboxes.clear()
        self._probe.close()


class NodeLocalReceiver:
    """An actor's end of :class:`NodeLocalSender`: maps the segments the sender names and
    applies the newest version it is pointed at, straight from shared memory."""

    def __init__(self, worker_idx: int, sender_pid: int) -> None:
        self.worker_idx = worker_idx
        self.sender_pid = sender_pid
        self.transport = SharedMemTransport()

    def take_messages(self, messages: Sequence[dict[str, Any]]) -> None:
        for message in messages:
            fds = [_open_foreign_fd(self.sender_pid, n) for n in message["fds"]]
            self.transport.handle_message(Message(header=message["header"], fds=fds))

    @property
    def layout(self) -> Layout | None:
        return self.transport.receiver_layout(DEFAULT_MODEL_ID)

    def published_version(self) -> int:
        return self.transport.published_version(self.worker_idx)

    def apply(self, dest: Mapping[str, torch.Tensor], held_version: int,
              deadline: Deadline) -> int | None:
        """Copy the newest version for this worker into ``dest`` if newer than ours; a slot
        whose handle has not come is waited for only until ``deadline`` (``poll()``: not at
        all, since the sender's next call on this actor brings it)."""
        if self.layout is None:
            return None
        try:
            return self.transport.apply_latest(self.worker_idx, dest, held_version, deadline)
        except WeightSyncTimeoutError:  # its slot's handle has not come yet: next time
            return None

    def close(self) -> None:
        self.transport.close()
