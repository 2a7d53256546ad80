"""NetWeightSyncScheme: workers on any host that reaches the trainer's address, over TCP;
no Ray, no shared file system.

The ends are the common :class:`~weightsync.schemes.sender.WeightSender` and
:class:`~weightsync.schemes.receiver.WeightReceiver`, handed the network transport's
writer and reader (``transports/net/writer.py``, ``transports/net/reader.py``): the trainer
listens on one port for the workers' control connections and their hosts' fetches; each
version is packed once, fetched once per host (whole, or as a delta against the version
that host holds), verified chunk by chunk under the connection's MACs, and staged in the
host's shared memory, from where each worker on that host copies it at its own call.
With ``trainer_ranks > 1`` (a sharded trainer), every rank serves its own shards from a
listener of its own and each host fetches every rank's part at once
(``transports/net/sharded_writer.py``; docs/sharded.md).
"""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.core.checks import checked_int
from weightsync.core.strategy import WeightStrategy
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
from weightsync.transports.net.reader import NetReader
from weightsync.transports.net.sharded_writer import NetRankZeroWriter, net_rank_writer
from weightsync.transports.net.wire import join_address, split_address
from weightsync.transports.net.writer import NetWriter
from weightsync.transports.ranks.member import MemberWriter

DEFAULT_ADDRESS = "127.0.0.1:0"


def bound_address(address: str) -> str:
    """``address`` with a port: a port of 0 is replaced by one free now on that host's
    interface (the workers must know the port before the trainer listens)."""
    host, port = split_address(address)
    if port:
        return address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return join_address(host, probe.getsockname()[1])


@dataclass(frozen=True)
class NetConfig:
    """Where the trainer listens and what travels; validated once, never changed (plain
    data: it travels, pickled, to every worker with the scheme)."""

    num_workers: int
    address: str = DEFAULT_ADDRESS
    #: what every connection proves (each host its own credential derived from it); the
    #: workers hold it, as the scheme is pickled to them
    token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    #: floating-point weights are cast to it as they are packed (None: sent as they are)
    dtype: torch.dtype | None = None
    #: each host gets the difference from the version it holds
    delta: bool = False
    #: how many processes of a sharded trainer serve each version, each its own shards
    trainer_ranks: int = 1
    #: what the ranks prove to rank 0 (never the workers' token; not pickled to workers:
    #: ``schemes/ranks.py``)
    rank_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        check_num_workers(self.num_workers)
        object.__setattr__(self, "address", bound_address(self.address))
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ValueError(
                f"dtype must be a floating-point torch.dtype or None, got {self.dtype!r}")
        object.__setattr__(self, "delta", bool(self.delta))
        checked_trainer_ranks(self.trainer_ranks)


class NetWeightSyncScheme(WeightSyncScheme):
    """Sync ``num_workers`` workers on any hosts that can reach ``address`` (``HOST:PORT``,
    where the trainer listens; port 0 picks a free one when the scheme is created).

    The scheme carries a random token (pickled to the workers with it): every connection
    proves it both ways without sending it, and every byte after is authenticated (a relay
    on the path cannot change what it forwards; nothing is encrypted). Workers on one host
    share one fetch per version, staged in that host's shared memory. ``dtype`` (e.g.
    ``torch.bfloat16``): floating-point weights are cast as they are packed, and copied
    into each worker's own model dtype exactly as cast. ``delta``: each host gets each
    chunk as the difference from the version it holds (a host that holds none, or one the
    trainer no longer keeps, gets it whole, and ``stats()`` says why). ``send()`` returns
    once every worker's host holds the version (staged); each worker applies it at its
    next ``poll()`` or ``receive()``.

    ``trainer_ranks``: how many processes of a sharded trainer (FSDP2, tensor parallel)
    serve each version, each its own shards (``create_sender(rank=r)`` in each, on the
    trainer's host; see docs/sharded.md); workers are unchanged, and each host fetches
    every rank's part at once."""

    def __init__(
        self, num_workers: int = 1, address: str = DEFAULT_ADDRESS, *,
        dtype: torch.dtype | None = None, delta: bool = False, timeout: float = 60.0,
        strategy: WeightStrategy | None = None, trainer_ranks: int = 1,
    ) -> None:
        super().__init__(timeout=timeout, strategy=strategy)
        self.config = NetConfig(
            num_workers, address, dtype=dtype, delta=delta, trainer_ranks=trainer_ranks,
            rank_key=new_rank_key() if checked_trainer_ranks(trainer_ranks) > 1 else "")

    num_workers = property(lambda self: self.config.num_workers)
    address = property(lambda self: self.config.address)
    dtype = property(lambda self: self.config.dtype)
    delta = property(lambda self: self.config.delta)
    trainer_ranks = property(lambda self: self.config.trainer_ranks)

    def create_sender(self, rank: int | None = None) -> WeightSender:
        """The trainer's end: listens at ``address`` from its first ``connect()``/``send()``.
        ``stats()["last"]`` adds what crossed the trainer's link for that version
        (``wire_bytes``, headers and MACs included; ``hosts``: one fetch per host;
        ``delta_chunks``; ``whole``: why a host got it whole). With ``trainer_ranks > 1``,
        rank ``rank``'s (default: this process's torch.distributed rank), which registers
        its own shards; rank 0 listens at ``address``, the others on its host at a free
        port. Needs the rank key: the scheme as created or pickled, not the copy
        :meth:`for_workers` makes."""
        c = self.config
        rank = trainer_rank(rank, c.trainer_ranks)
        options: dict[str, Any] = {"timeout": self.peer_timeout, "dtype": c.dtype,
                                   "delta": c.delta}
        writer: NetWriter | NetRankZeroWriter | MemberWriter
        if c.trainer_ranks == 1:
            writer = NetWriter(c.address, c.token, c.num_workers, **options)
        elif rank == 0:
            writer = NetRankZeroWriter(c.address, c.token, checked_rank_key(c.rank_key, self),
                                       c.num_workers, c.trainer_ranks, **options)
        else:
            writer = net_rank_writer(c.address, c.token, checked_rank_key(c.rank_key, self),
                                     rank, **options)
        return WeightSender(self, writer, c.num_workers)

    def create_receiver(self, worker_idx: int = 0) -> WeightReceiver:
        """The end for worker ``worker_idx``, on any host that reaches ``address``."""
        c = self.config
        worker_idx = checked_int(worker_idx, "worker_idx", 0, c.num_workers - 1)
        reader = NetReader(c.address, c.token, worker_idx, timeout=self.peer_timeout,
                           cast=c.dtype is not None, delta=c.delta)
        return WeightReceiver(self, worker_idx, reader)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_workers={self.num_workers}, "
                f"address={self.address!r}, dtype={self.dtype}, delta={self.delta}, "
                f"trainer_ranks={self.trainer_ranks}, timeout={self.timeout})")
