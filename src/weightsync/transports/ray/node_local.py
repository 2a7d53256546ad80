"""The node-local path of the Ray scheme: actors on the sender's node copy each version out
of the sender's shared memory instead of taking it over the network.

The sender writes each version once into a slot of a
:class:`~weightsync.transports.shm.publisher.SlotPublisher`; each
co-located actor maps those segments and copies its version out at ``poll()``, the way
NCCL and Ray's object store use shared memory within a node. The segments' fds reach an
actor over the sender's *fd server*, a ``local`` channel listener at an abstract Unix
address (framed messages, fds passed with ``SCM_RIGHTS``): each Ray
call that names new segments carries, for one actor only, a one-time random ticket that
the server redeems for exactly those fds, to a process of the sender's user
(``SO_PEERCRED``). The sender's process is not dumpable (``dumpable``), so no other
process of its user can take the fds through ``/proc/<pid>/fd``. Hosts that share
``/proc`` or the abstract socket namespace (containers) are told apart by Ray's node id,
and the probe checks that the server answering is the sender's process and knows its token.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.transports.local.accept import AcceptLoop, Admission
from weightsync.transports.local.address import ChannelListener, connect_channel, new_address
from weightsync.transports.local.auth import peer_credentials, proofs_match
from weightsync.transports.local.channel import Channel, Message
from weightsync.transports.local.hub import close_passed_fds, display_address
from weightsync.transports.memory.dumpable import protect_sender_process
from weightsync.transports.ray.group import current_node_id
from weightsync.transports.shm.publisher import SlotPublisher
from weightsync.transports.shm.reader import SlotReader
from weightsync.transports.shm.slots import DEFAULT_MODEL_ID

logger = logging.getLogger(__name__)

_TOKEN_BYTES = 16
_MAX_FDS = 16  # a segment message carries a few fds (control block and ack: 2)
_IO_TIMEOUT_S = 5.0
#: requests the fd server answers at once (each a few small frames within one deadline of
#: ``_IO_TIMEOUT_S``); more are closed at once, so silent connections cannot stall it
_MAX_PENDING_REQUESTS = 16


@dataclass
class NodeLocalInfo:
    """How an actor finds out whether it shares the sender's node and reaches its fd
    server (plain data: crosses Ray): the server's abstract socket ``address`` in the
    sender process ``pid``, which answers a probe only with ``token``."""

    node_id: str
    pid: int
    address: str
    token: str


def _request(address: str, pid: int, request: dict[str, Any],
             max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One request to a sender's fd server; its answer and the fds it passed (at most
    ``max_fds``). Refuses a server that is not process ``pid`` of this user."""
    channel = connect_channel(address, 0.0)  # no retry: a server that is not up is not there
    message: Message | None = None
    try:
        peer = peer_credentials(channel.socket)
        if peer.pid != pid or peer.uid != os.getuid():
            raise PermissionError(f"the fd server at the sender's address is process {peer.pid} "
                                  f"of uid {peer.uid}, not the sender {pid}")
        channel.send(request, timeout=_IO_TIMEOUT_S)
        message = channel.recv(_IO_TIMEOUT_S, max_payload=0)
        if len(message.fds) > max_fds:
            raise ValueError(f"the sender's fd server passed {len(message.fds)} fds, "
                             f"{max_fds} were asked for")
        return message.header, message.fds
    except BaseException:
        if message is not None:
            close_passed_fds(message)
        raise
    finally:
        channel.close()


def probe_node_local(info: NodeLocalInfo) -> bool:
    """True if this process runs on the sender's node and its fd server answers."""
    if info.node_id != current_node_id():
        return False
    try:
        answer, _ = _request(info.address, info.pid, {"probe": info.token})
    except (OSError, ValueError) as exc:
        logger.info("cannot reach the sender's shared memory (%s); using the broadcast", exc)
        return False
    return answer.get("ok") is True


class _FdServer:
    """Hands the sender's segment fds to actors that hold a ticket (one-time, random, one
    actor's); a probe with the token gets a yes. A ``ChannelListener`` at a fresh abstract
    address whose accept loop a connection flood cannot kill (:mod:`~weightsync.transports.
    local.accept`): each request is answered on a thread of its own within one deadline,
    at most ``_MAX_PENDING_REQUESTS`` at once; only processes of this user get an answer."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._listener = ChannelListener(new_address())
        self.address = self._listener.address
        self._lock = threading.Lock()
        self._tickets: dict[str, tuple[int, list[int]]] = {}  # ticket -> (worker, dup fds)
        self._acceptor: AcceptLoop[Channel] = AcceptLoop(
            self._listener.accept, self._serve, socket_of=lambda channel: channel.socket,
            what=f"the trainer's node-local fd server at {display_address(self.address)}",
            handshake_timeout=_IO_TIMEOUT_S, max_pending=_MAX_PENDING_REQUESTS,
            name="weightsync-fd-server", connection_name="weightsync-fd-request")
        self._acceptor.start()

    def issue(self, worker_idx: int, fds: Sequence[int]) -> str:
        """A ticket for copies of ``fds`` (taken now: the numbers may be reused later)."""
        copies: list[int] = []
        try:
            for fd in fds:
                copies.append(os.dup(fd))
        except OSError:
            _close_all(copies)
            raise
        ticket = secrets.token_hex(16)
        with self._lock:
            self._tickets[ticket] = (worker_idx, copies)
        return ticket

    def revoke(self, worker_idx: int) -> None:
        """Drop the tickets a worker did not redeem (it left)."""
        with self._lock:
            gone = [t for t, (w, _) in self._tickets.items() if w == worker_idx]
            for ticket in gone:
                _close_all(self._tickets.pop(ticket)[1])

    def _serve(self, channel: Channel, admission: Admission) -> None:
        """One request, on a thread of the accept loop, within the admission's deadline."""
        try:
            self._answer(channel, admission.deadline)
        except (OSError, ValueError) as exc:  # the client is told by its own call
            logger.debug("fd server: a request failed (%s)", exc)
        finally:
            channel.close()

    def _answer(self, channel: Channel, deadline: Deadline) -> None:
        if peer_credentials(channel.socket).uid != os.getuid():
            return  # another user: closed before a byte is read
        request = channel.recv(deadline.remaining(), max_payload=0)
        close_passed_fds(request)  # a client passes none: never keep one
        probe, ticket = request.header.get("probe"), request.header.get("ticket")
        if probe is not None:
            channel.send({"ok": proofs_match(self.token, probe)}, timeout=deadline.remaining())
            return
        if not isinstance(ticket, str):
            return
        with self._lock:
            entry = self._tickets.pop(ticket, None)
        if entry is None:
            channel.send({"ok": False}, timeout=deadline.remaining())
            return
        try:
            channel.send({"ok": True}, fds=entry[1], timeout=deadline.remaining())
        finally:
            _close_all(entry[1])

    def close(self) -> None:
        self._acceptor.stop(2.0, wake=self._listener.shutdown)
        self._listener.close()
        with self._lock:
            for _, copies in self._tickets.values():
                _close_all(copies)
            self._tickets.clear()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Outbox:
    """Stands in for a worker's channel in a :class:`SlotPublisher`: keeps the segment
    messages (their fds as a ticket of the fd server) for the next Ray call to carry to
    that actor."""

    def __init__(self, worker_idx: int, server: _FdServer) -> None:
        self.worker_idx = worker_idx
        self.server = server
        self.messages: list[dict[str, Any]] = []
        self.closed = False

    def send(self, header: dict[str, Any], payload: Any = None, fds: Sequence[int] = (),
             timeout: float | None = None) -> None:
        message: dict[str, Any] = {"header": header, "nfds": len(fds)}
        if fds:
            message["ticket"] = self.server.issue(self.worker_idx, fds)
        self.messages.append(message)

    def take(self) -> list[dict[str, Any]]:
        out, self.messages = self.messages, []
        return out

    def close(self) -> None:
        self.closed = True


class NodeLocalSender:
    """The sender's path to actors on its own node: a :class:`SlotPublisher` (slot pool,
    per-worker targets, tear-free reads under slot locks) whose segments the actors take
    from its fd server. A send writes one slot whatever the number of actors."""

    def __init__(self, max_slots: int) -> None:
        protect_sender_process()  # no other process of this user opens our fds via /proc
        self.slots = SlotPublisher(max_slots=max_slots)
        self._server = _FdServer(secrets.token_hex(_TOKEN_BYTES))
        self.info = NodeLocalInfo(current_node_id(), os.getpid(), self._server.address,
                                  self._server.token)
        self._outboxes: dict[int, _Outbox] = {}

    @property
    def workers(self) -> set[int]:
        return set(self._outboxes)

    def attach(self, worker_idx: int) -> None:
        if worker_idx not in self._outboxes:
            self._outboxes[worker_idx] = outbox = _Outbox(worker_idx, self._server)
            self.slots.attach_worker(worker_idx, outbox, at_latest=False)  # type: ignore[arg-type]

    def detach(self, worker_idx: int) -> None:
        if self._outboxes.pop(worker_idx, None) is not None:
            self.slots.detach_worker(worker_idx)
            self._server.revoke(worker_idx)

    def publish(self, flat: Mapping[str, torch.Tensor], worker_ids: Sequence[int], version: int,
                timeout: float | None) -> None:
        self.slots.publish(DEFAULT_MODEL_ID, flat, list(worker_ids), version, timeout)

    def point_at_latest(self, worker_ids: Sequence[int]) -> None:
        self.slots.point_at_latest(worker_ids)

    def latest_buffers(self) -> dict[str, torch.Tensor]:
        """The packed buffers of the newest version (stable until two sends later)."""
        return self.slots.latest_buffers()

    def messages_for(self, worker_idx: int) -> list[dict[str, Any]]:
        outbox = self._outboxes.get(worker_idx)
        return [] if outbox is None else outbox.take()

    def close(self) -> None:
        self.slots.close()
        self._outboxes.clear()
        self._server.close()


class NodeLocalReceiver:
    """An actor's end of :class:`NodeLocalSender`: maps the segments the sender names and
    applies the newest version it is pointed at, straight from shared memory."""

    def __init__(self, worker_idx: int, info: NodeLocalInfo) -> None:
        self.worker_idx = worker_idx
        self.sender_pid = info.pid
        self.address = info.address
        self.slots = SlotReader()

    def take_messages(self, messages: Sequence[dict[str, Any]]) -> None:
        """Map the segments the sender names, redeeming each message's ticket at its fd
        server."""
        for message in messages:
            nfds, ticket = int(message.get("nfds", 0)), message.get("ticket")
            fds: list[int] = []
            if nfds:
                if not 0 < nfds <= _MAX_FDS or not isinstance(ticket, str):
                    raise ValueError(f"malformed segment message from the sender: {message!r}")
                answer, fds = _request(self.address, self.sender_pid, {"ticket": ticket}, nfds)
                if answer.get("ok") is not True or len(fds) != nfds:
                    _close_all(fds)
                    raise PermissionError(f"worker {self.worker_idx}: the sender's fd server "
                                          "refused a segment ticket")
            self.slots.handle_message(Message(header=message["header"], fds=fds))

    @property
    def layout(self) -> Layout | None:
        return self.slots.layout(DEFAULT_MODEL_ID)

    def published_version(self) -> int:
        return self.slots.published_version(self.worker_idx)

    def apply(self, dest: Mapping[str, torch.Tensor], held_version: int,
              deadline: Deadline) -> int | None:
        """Copy the newest version for this worker into ``dest`` if newer than ours; a slot
        whose handle has not come is waited for only until ``deadline`` (``poll()``: not at
        all, since the sender's next call on this actor brings it)."""
        if self.layout is None:
            return None
        try:
            return self.slots.apply_latest(self.worker_idx, dest, held_version, deadline)
        except WeightSyncTimeoutError:  # its slot's handle has not come yet: next time
            return None

    def close(self) -> None:
        self.slots.close()
