"""RayWeightSyncScheme: weights to Ray actors on any host of a Ray cluster.

The ends are the common :class:`~weightsync.schemes.sender.WeightSender` and
:class:`~weightsync.schemes.receiver.WeightReceiver`, handed the Ray transport's writer and
reader (``transports/ray/writer.py``, ``transports/ray/reader.py``): the trainer checks every
actor's layout, builds the library's own torch.distributed group (rendezvous in a named Ray
actor, at the node address Ray reports, authenticated by the scheme's secret token), and for
each send signals the actors through Ray and broadcasts the packed, checksummed buckets once
for all of them; actors stage what arrives and apply it at ``poll()``. Actors on the
trainer's own node take each version out of shared memory instead (``node_local``).
``dtype`` casts the version as it is packed; ``delta`` sends each node on another host the
difference from the version it holds (``transports/delta/``). ``trainer_ranks > 1``:
a sharded trainer, each rank sending its own shards point to point to every relay actor
(``transports/ray/sharded_lead.py``, ``sharded_rank.py``, ``shard_stream.py``).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.core.errors import WorkerLostError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy
from weightsync.core.versions import NO_VERSION
from weightsync.schemes.base import WeightSyncScheme
from weightsync.schemes.local import check_num_workers
from weightsync.schemes.ranks import (
    checked_rank_key,
    checked_trainer_ranks,
    new_rank_key,
    trainer_rank,
)
from weightsync.schemes.receiver import WeightReceiver
from weightsync.schemes.sender import WeightSender
from weightsync.transports.ray.group import current_node_id
from weightsync.transports.ray.reader import SENDER_CHECK_S, RayReader
from weightsync.transports.ray.rendezvous import Rendezvous
from weightsync.transports.ray.sharded_lead import RayLeadWriter
from weightsync.transports.ray.sharded_rank import rank_ray_writer
from weightsync.transports.ray.writer import RayWriter

__all__ = ["SENDER_CHECK_S", "RayConfig", "RayWeightReceiver", "RayWeightSender",
           "RayWeightSyncScheme", "Rendezvous"]

BACKENDS = ("gloo", "nccl")
#: the Ray namespace of a sharded trainer's rendezvous actor: its ranks are separate Ray
#: jobs (each its own namespace by default), and they and the actors must all find it
SHARDED_NAMESPACE = "weightsync"


@dataclass(frozen=True)
class RayConfig:
    """How the trainer reaches its actors; validated once, never changed (plain data: it
    travels, pickled, to every actor with the scheme)."""

    num_workers: int
    backend: str = "gloo"
    node_local: bool = True
    checksums: bool = True
    #: the name of the rendezvous actor (unique per scheme by default)
    connection_info_name: str = field(
        default_factory=lambda: f"weightsync-{uuid.uuid4().hex[:12]}")
    #: only holders of it can join the group or write rendezvous values a member accepts
    secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    #: floating-point weights are cast to it as they are packed (None: sent as they are)
    dtype: torch.dtype | None = None
    #: each node on another host gets the difference from the version it holds
    delta: bool = False
    #: how many processes of a sharded trainer send each version (``sharded_lead.py``)
    trainer_ranks: int = 1
    #: what the ranks' records on the rendezvous actor prove (never the secret, which the
    #: actors hold; not pickled to workers: ``schemes/ranks.py``)
    rank_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        check_num_workers(self.num_workers)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if not isinstance(self.connection_info_name, str) or not self.connection_info_name:
            raise ValueError("connection_info_name must be a non-empty string, got "
                             f"{self.connection_info_name!r}")
        try:
            bytes.fromhex(self.secret)
        except (TypeError, ValueError):
            raise ValueError("secret must be a hex string") from None
        object.__setattr__(self, "node_local", bool(self.node_local))
        object.__setattr__(self, "checksums", bool(self.checksums))
        object.__setattr__(self, "delta", bool(self.delta))
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ValueError(
                f"dtype must be a floating-point torch.dtype or None, got {self.dtype!r}")
        if self.delta and self.backend != "gloo":
            raise ValueError("delta=True needs backend='gloo' (the deltas are encoded and "
                             "decoded on the CPU)")
        checked_trainer_ranks(self.trainer_ranks)
        if self.trainer_ranks > 1 and self.delta:
            raise ValueError("delta=True is not supported with trainer_ranks > 1 (no rank "
                             "holds the whole previous version to diff against)")
        if self.trainer_ranks > 1 and self.backend != "gloo":
            raise ValueError("trainer_ranks > 1 needs backend='gloo' (the ranks' streams "
                             "are point to point on the CPU)")

    @property
    def namespace(self) -> str | None:
        """The rendezvous actor's Ray namespace: a sharded trainer's is fixed, else None
        (the namespace of the job that creates the sender, as the actors')."""
        return SHARDED_NAMESPACE if self.trainer_ranks > 1 else None


class RayWeightSyncScheme(WeightSyncScheme):
    """Sync to ``num_workers`` Ray actors; ``backend`` is ``"gloo"`` (CPU) or ``"nccl"`` (GPU).

    ``connection_info_name`` names the rendezvous actor (unique per scheme by default).
    ``node_local`` (gloo, CPU weights): the trainer writes each version once into shared
    memory, and actors on its node copy it from there at ``poll()`` instead of taking it
    over loopback TCP; actors elsewhere (or that cannot open it) get the broadcast.
    ``False`` sends every byte through the group. The scheme carries a random ``secret``
    (it travels, pickled, to the actors through Ray): only holders of it can join the group
    or write rendezvous values a member accepts. ``checksums`` (default on): every bucket
    broadcast carries a checksum the receiving actor verifies before it applies anything.

    ``dtype`` (e.g. ``torch.bfloat16``): floating-point weights are cast as they are packed,
    so the actors' models hold that dtype (the trainer keeps its own, e.g. fp32 masters).
    ``delta`` (opt-in, gloo): each chunk of a version goes to each other host as the
    difference from the same chunk of the version that host's actors hold (the changed
    16-bit words as varints where numba is installed, else XOR then zstd; a chunk whose
    delta would not be smaller goes whole), rebuilt and verified against the
    version's checksums before any actor may take it; a host that does not hold the base
    gets whole chunks. Worth it when most words do not change between versions (bf16 after
    a small optimizer step) and the network is slower than the CPU's encoding (~4 GB/s per
    core with numba, ~0.5 GB/s with zstd); costs one extra copy of the (cast) version on
    the trainer and on one actor per other host. Needs ``zstandard`` (``pip install
    'weightsync[delta]'``).

    ``trainer_ranks`` (default 1): a sharded trainer (FSDP2 / DTensor, or ``LocalShard``)
    of that many processes, each connected to the Ray cluster, each calling
    ``create_sender(rank=r)``; rank 0 also passes the actor handles. Every rank sends its
    own shards point to point to one relay actor per node, which assembles, verifies and
    hands the version to its node's actors; no rank gathers the model. Versions reach the
    actors whole, in the global layout. With it: gloo only, no ``delta``, and actors on the
    trainer's node take the group path too (no ``node_local``); the rendezvous actor lives
    in the Ray namespace ``"weightsync"``."""

    def __init__(
        self,
        num_workers: int = 1,
        *,
        backend: str = "gloo",
        timeout: float = 60.0,
        connection_info_name: str | None = None,
        strategy: WeightStrategy | None = None,
        node_local: bool = True,
        checksums: bool = True,
        dtype: torch.dtype | None = None,
        delta: bool = False,
        trainer_ranks: int = 1,
    ) -> None:
        super().__init__(timeout=timeout, strategy=strategy)
        named = {} if connection_info_name is None else {
            "connection_info_name": connection_info_name}
        self.config = RayConfig(num_workers, backend, node_local, checksums, **named,
                                dtype=dtype, delta=delta, trainer_ranks=trainer_ranks,
                                rank_key=new_rank_key()
                                if checked_trainer_ranks(trainer_ranks) > 1 else "")

    num_workers = property(lambda self: self.config.num_workers)
    backend = property(lambda self: self.config.backend)
    node_local = property(lambda self: self.config.node_local)
    checksums = property(lambda self: self.config.checksums)
    connection_info_name = property(lambda self: self.config.connection_info_name)
    secret = property(lambda self: self.config.secret)
    dtype = property(lambda self: self.config.dtype)
    delta = property(lambda self: self.config.delta)
    trainer_ranks = property(lambda self: self.config.trainer_ranks)

    def create_sender(
        self, workers: Sequence[Any] | Mapping[int, Any] | None = None, *,
        rank: int | None = None,
    ) -> WeightSender:
        """The trainer's end; ``workers`` are the actor handles, by worker index. With
        ``trainer_ranks > 1``: rank ``rank``'s end (default: this process's
        torch.distributed rank); only rank 0 takes ``workers`` (ranks 1..N-1 send to the
        actors rank 0 names)."""
        rank = trainer_rank(rank, self.config.trainer_ranks)
        if rank > 0:
            if workers is not None:
                raise ValueError(f"trainer rank {rank}: only rank 0 takes the actor handles")
            c = self.config
            assert c.namespace is not None
            writer = rank_ray_writer(rank=rank, secret=c.secret,
                                     rank_key=checked_rank_key(c.rank_key, self),
                                     rendezvous_name=c.connection_info_name,
                                     namespace=c.namespace, dtype=c.dtype)
            return WeightSender(self, writer, c.num_workers)
        sender = RayWeightSender(self)
        if workers is not None:
            sender.register_workers(workers)
        return sender

    def create_receiver(self, worker_idx: int = 0) -> RayWeightReceiver:
        return RayWeightReceiver(self, worker_idx)

    def __repr__(self) -> str:
        c = self.config
        return (f"{type(self).__name__}(num_workers={c.num_workers}, backend={c.backend!r}, "
                f"node_local={c.node_local}, checksums={c.checksums}, dtype={c.dtype}, "
                f"delta={c.delta}, timeout={self.timeout}"
                + (f", trainer_ranks={c.trainer_ranks})" if c.trainer_ranks > 1 else ")"))


class RayWeightSender(WeightSender):
    """Trainer side of :class:`RayWeightSyncScheme`: the common sender, plus the actor
    handles of its workers."""

    writer: RayWriter

    def __init__(self, scheme: RayWeightSyncScheme) -> None:
        c = scheme.config
        writer: RayWriter
        if c.trainer_ranks > 1:  # rank 0 of a sharded trainer: no node-local path
            writer = RayLeadWriter(
                trainer_ranks=c.trainer_ranks, rank_key=checked_rank_key(c.rank_key, scheme),
                num_workers=c.num_workers, backend=c.backend,
                node_local=False, checksums=c.checksums, rendezvous_name=c.connection_info_name,
                secret=c.secret, timeout=scheme.peer_timeout, dtype=c.dtype, namespace=c.namespace)
        else:
            writer = RayWriter(num_workers=c.num_workers, backend=c.backend,
                               node_local=c.node_local, checksums=c.checksums,
                               rendezvous_name=c.connection_info_name, secret=c.secret,
                               timeout=scheme.peer_timeout, dtype=c.dtype, delta=c.delta)
        super().__init__(scheme, writer, c.num_workers)
        self.scheme: RayWeightSyncScheme = scheme

    def stats(self) -> dict[str, Any]:
        """The common figures; ``last`` also says what crossed the network for that version,
        all other hosts together: ``wire_bytes``, ``chunks``, ``delta_chunks`` (sent as
        differences, unchanged ones included) and ``delta_refused`` (hosts whose rebuilt
        version failed its checksums and got it whole). With ``delta=True``,
        ``whole_versions`` counts the versions a host got whole since the start, by reason
        (``first_version``, ``no_base``, ``new_actor``, ``behind``, ``refused``; each is
        also logged at INFO naming the worker, its node and what happened)."""
        summary = super().stats()
        if self.writer.delta:
            summary["whole_versions"] = self.writer.whole_versions()
        last = summary.get("last")
        if last is not None:
            empty = {"wire_bytes": 0, "chunks": 0, "delta_chunks": 0, "delta_refused": 0}
            last |= self.writer.figures.get(last["version"], empty)
        return summary

    def register_workers(self, workers: Sequence[Any] | Mapping[int, Any]) -> None:
        """The actor handles of the workers (a list in worker order, or {index: handle})."""
        items = workers.items() if isinstance(workers, Mapping) else enumerate(workers)
        for idx, handle in items:
            self._table.check_worker_ids([idx])
            self.writer.members.register(idx, handle)

    def add_worker(self, worker_idx: int, handle: Any, timeout: float | None = None) -> int:
        """Bring in a (replacement) actor now and give it the current version (the last
        snapshot sent, under its own number); returns that version."""
        self._check_open()
        self._table.check_worker_ids([worker_idx])
        self.writer.members.replace(worker_idx, handle)
        if self.version == NO_VERSION:
            return NO_VERSION
        if self._pending is not None:
            raise RuntimeError("a send_async() is still pending: call wait_async() first")
        deadline = self._deadline(timeout)
        version = self.version
        lost = self.writer.republish([worker_idx], version, deadline)
        targets = [w for w in (worker_idx,) if w not in lost]
        lost.update(self.writer.deliver(targets, version, deadline))
        self.writer.wait_acked(targets, version, deadline, lost)
        if lost:
            raise WorkerLostError.naming(lost, version)
        return version


class RayWeightReceiver(WeightReceiver):
    """The worker end, held by a Ray actor (see ``weightsync.integrations.ray``): the common
    receiver, plus the calls the sender drives through the actor."""

    reader: RayReader

    def __init__(self, scheme: RayWeightSyncScheme, worker_idx: int) -> None:
        c = scheme.config
        reader = RayReader(worker_idx, num_workers=c.num_workers, backend=c.backend,
                           rendezvous_name=c.connection_info_name,
                           timeout=scheme.peer_timeout, rendezvous_namespace=c.namespace)
        super().__init__(scheme, worker_idx, reader)
        self.scheme: RayWeightSyncScheme = scheme

    @property
    def path(self) -> str | None:
        """How versions reach this actor: ``"node-local"`` (the sender's shared memory),
        ``"broadcast"`` (the group), or None before the sender's first send."""
        return self.reader.path

    def check_layout(self, layout: dict[str, Any]) -> str:
        """Raise SchemaMismatchError naming the key if the sender's layout differs from ours;
        returns this actor's Ray node id (the sender groups actors by node)."""
        Layout.from_dict(layout).check_compatible(
            Layout.from_weights(self._destination()), other_name=f"worker {self.worker_idx}"
        )
        return current_node_id()

    def attach_local(self, info: dict[str, Any]) -> bool:
        """Take versions from the sender's shared memory if this actor is on the sender's
        node (see ``node_local``); True if so."""
        return self.reader.attach_local(info)

    def join(self, info: dict[str, Any], layout: dict[str, Any],
             relay: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Join a group generation; as its node's relay (``relay``), returns how the other
        actors of this node find its shared memory."""
        return self.reader.join(info, layout, relay)

    def take(self, version: int, keep: bool, messages: list[dict[str, Any]] | None = None,
             delivery: dict[str, Any] | None = None) -> int | dict[str, Any]:
        """Take part in the delivery of ``version`` (kept if ``keep``); the checksums are
        verified before anything is applied. Returns the version this actor will hold once
        it polls; a relay returns ``{"held": that version, "relayed": whether its followers
        got it, "messages": {follower: segment messages}}``."""
        relayed = self.reader.take(version, keep, messages, delivery, held=self._version)
        held = version if keep and not relayed.get("refused") else self._version
        return {"held": held} | relayed if relayed else held

    def announce(self) -> None:
        """From inside an actor: tell the sender this actor is worker ``worker_idx`` (a
        replacement joins at the sender's next send)."""
        self.reader.announce(self.scheme.peer_timeout)
