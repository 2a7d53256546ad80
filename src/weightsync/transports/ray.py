"""RayTransport (seed 003): Ray carries the signals, a torch.distributed group the bytes.

The group is weightsync's own: a ``ProcessGroupGloo`` (or NCCL) built directly on a
``TCPStore``, so the user's default process group is never initialised or touched. Rank 0
is the sender; worker ``i`` is rank ``i + 1`` (seed 003) unless the group was rebuilt
without some workers, in which case the rendezvous info maps worker indices to ranks.
Weights cross as packed buckets, one ``broadcast`` per bucket for all workers.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION

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
        """Join ``info``'s group generation (blocks until every member has joined)."""
        if self.group is not None:
            self.group.close()
        self.layout = layout.on_device(self._staging_device())
        self.group = WeightGroup(info, info.rank_of(self.worker_idx))
        self._staging = None

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

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.close()
            self.group = None
