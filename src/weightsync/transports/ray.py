"""RayTransport (seed 003): Ray carries the signals, a torch.distributed group the bytes.

The group is weightsync's own: a ``ProcessGroupGloo`` (or NCCL) built directly on a
``TCPStore``, so the user's default process group is never initialised or touched. Rank 0
is the sender; worker ``i`` is rank ``i + 1`` (seed 003) unless the group was rebuilt
without some workers, in which case the rendezvous info maps worker indices to ranks.
Weights cross as packed buckets, one ``broadcast`` per bucket for all workers.

Actors on the sender's own node skip the network: the sender writes each version once into
shared memory (a :class:`SharedMemTransport` slot) and each co-located actor opens those
segments through ``/proc/<pid>/fd`` and copies its version out at ``poll()``, the way NCCL
and Ray's object store use shared memory within a node. Only actors that cannot open them
(another node, another user) join the group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local_channel import Message
from weightsync.transports.shared_mem import DEFAULT_MODEL_ID, SharedMemTransport
from weightsync.transports.shared_memory import Segment

logger = logging.getLogger(__name__)


@dataclass
class GroupInfo:
    """Where and how to join one generation of the group (plain data: crosses Ray)."""

    address: str
    port: int
    world_size: int
    generation: int
    backend: str
    ranks: dict[int, int] = field(default_factory=dict)  # worker_idx -> rank
    timeout_s: float = 60.0

    def rank_of(self, worker_idx: int) -> int:
        if worker_idx not in self.ranks:
            raise KeyError(f"worker {worker_idx} is not a member of group generation "
                           f"{self.generation} (members: {sorted(self.ranks)})")
        return self.ranks[worker_idx]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_address() -> str:
    """This node's address as the Ray cluster knows it (the address its raylet was started
    with; never a hard-coded loopback), so the same code runs on a multi-node cluster."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


_TOKEN_BYTES = 16


def current_node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


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

    def apply(self, dest: Mapping[str, torch.Tensor], held_version: int) -> int | None:
        """Copy the newest version for this worker into ``dest`` if newer than ours."""
        if self.layout is None:
            return None
        try:
            return self.transport.apply_latest(self.worker_idx, dest, held_version, Deadline(1.0))
        except WeightSyncTimeoutError:  # its slot's handle has not come yet: next time
            return None

    def close(self) -> None:
        self.transport.close()


class WeightGroup:
    """One generation of the library's own process group, for one rank."""

    def __init__(self, info: GroupInfo, rank: int, store: Any = None) -> None:
        timeout = datetime.timedelta(seconds=info.timeout_s)
        self.info = info
        self.rank = rank
        if store is None:
            store = dist.TCPStore(info.address, info.port, info.world_size, rank == 0,
                                  timeout=timeout, wait_for_workers=False)
        self.store = store
        prefixed = dist.PrefixStore(f"weightsync/gen{info.generation}", store)
        if info.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, info.world_size, options)
        elif info.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, info.world_size, timeout)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {info.backend!r}")

    def broadcast(self, buffers: list[torch.Tensor]) -> None:
        """Broadcast each buffer from rank 0, all in flight at once, then wait."""
        works = []
        for buffer in buffers:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            works.append(self.pg.broadcast([buffer], opts))
        for work in works:
            work.wait()

    def close(self) -> None:
        self.pg = None


def bucket_buffers(layout: Layout, buffers: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The flat per-device byte buffers of a packed layout, in a fixed order."""
    return [buffers[device] for device in sorted(layout.nbytes_by_device)]


class RayTransport:
    """Weight transport to ONE Ray actor (seed 003); the scheme holds one per worker and
    drives the collective for all of them at once.

    Sender side: ``send_weights``/``send_weights_async`` + ``wait_ack`` signal the actor
    through Ray and broadcast the packed bytes over the group. Receiver side (inside the
    actor): ``setup_connection_and_weights_on_receiver`` joins the group as rank
    ``worker_idx + 1``; ``receive_weights`` takes the next broadcast into a staging buffer and
    applies it to the model.
    """

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
        self.group: WeightGroup | None = None
        self.layout: Layout | None = None
        self._model: Any = None
        self._pending: Any = None
        self._staging: dict[str, torch.Tensor] | None = None
        self.local: NodeLocalReceiver | None = None  # on the sender's node: shared memory
        self.version = NO_VERSION

    # ------------------------------------------------------------------ sender side
    def attach_group(self, group: WeightGroup, layout: Layout) -> None:
        """Used by the scheme: the group (rank 0) and layout this transport sends with."""
        self.group = group
        self.layout = layout

    def send_weights(self, weights: Any) -> None:
        """Signal the actor, broadcast ``weights``, and wait until the actor took them."""
        self.send_weights_async(weights)
        self.wait_ack()

    def send_weights_async(self, weights: Any) -> None:
        """Signal the actor and broadcast ``weights``; finish with :meth:`wait_ack`."""
        if self.group is None or self.layout is None or self.remote_actor is None:
            raise RuntimeError("RayTransport has no group: the scheme's connect() sets it up")
        flat = flat_tensors(weights, what="RayTransport.send_weights")
        self.layout.check_weights(flat)
        buffers = self.layout.allocate()
        self.layout.pack(flat, buffers)
        version = self.version + 1
        self._pending = self.remote_actor._weightsync_receive.remote(version, True)
        self.group.broadcast(bucket_buffers(self.layout, buffers))
        self.version = version

    def wait_ack(self, timeout: float | None = None) -> None:
        """Wait until the actor acknowledged the pending send."""
        import ray

        if self._pending is None:
            raise RuntimeError("no pending send: call send_weights_async() first")
        pending, self._pending = self._pending, None
        ray.get(pending, timeout=timeout)

    def setup_connection_and_weights_on_sender(self) -> None:
        """Nothing per worker: the scheme creates the rendezvous and rank 0 (seed 003)."""

    # ------------------------------------------------------------------ receiver side
    def set_model(self, model: Any) -> None:
        """The model received weights are applied to."""
        self._model = model

    def join(self, info: GroupInfo, layout: Layout) -> None:
        """Join ``info``'s group generation (blocks until every member has joined); an actor
        that maps the sender's snapshot is not a member and takes its bytes from there."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.layout = layout.on_device(self._staging_device())
        if self.worker_idx in info.ranks or self.local is None:
            self.group = WeightGroup(info, info.rank_of(self.worker_idx))
        self._staging = None

    @property
    def joined(self) -> bool:
        return self.layout is not None and (self.group is not None or self.local is not None)

    def _staging_device(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"

    def take_broadcast(self) -> dict[str, torch.Tensor]:
        """Receive one broadcast into a staging buffer (reused) and return it."""
        if self.group is None or self.layout is None:
            raise RuntimeError(f"worker {self.worker_idx} has not joined a group")
        if self._staging is None:
            self._staging = self.layout.allocate()
        self.group.broadcast(bucket_buffers(self.layout, self._staging))
        return self._staging

    def receive_weights(
        self,
        timeout: float | None = None,
        *,
        weights: Any = None,
        model: Any = None,
        strategy: WeightStrategy | None = None,
    ) -> Any | None:
        """Take the next broadcast and apply it to ``model`` (or the one from
        :meth:`set_model`, or ``weights``); returns the applied weights."""
        target = model if model is not None else (self._model if self._model is not None else weights)
        staging = self.take_broadcast()
        if target is None:
            return None
        assert self.layout is not None
        self.layout.unpack(staging, flat_tensors(target, what="receive_weights destination"))
        return (strategy or WeightStrategy()).extract_weights(target)

    def setup_connection_and_weights_on_receiver(
        self,
        *,
        worker_idx: int,
        strategy: WeightStrategy | None = None,
        model: Any | None = None,
        weights: Any | None = None,
    ) -> Any:
        """Fetch the rendezvous from the named Ray actor, join as rank ``worker_idx + 1``
        and receive the initial weights (seed 003)."""
        import ray

        self.worker_idx = worker_idx
        rendezvous = ray.get_actor(self.connection_info_name)
        info: dict[str, Any]
        layout_dict: dict[str, Any]
        info, layout_dict = ray.get(rendezvous.group_info.remote())
        self.join(GroupInfo(**info), Layout.from_dict(layout_dict))
        return self.receive_weights(model=model, weights=weights, strategy=strategy)

    def attach_local(self, info: NodeLocalInfo) -> bool:
        """Take versions from the sender's shared memory if this actor is on its node."""
        if self.local is not None and self.local.sender_pid == info.pid:
            return True
        self.detach_local()
        if self.backend == "gloo" and probe_node_local(info):
            self.local = NodeLocalReceiver(self.worker_idx, info.pid)
        return self.local is not None

    def detach_local(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None

    def close(self) -> None:
        self.detach_local()
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.close()
            self.group = None
