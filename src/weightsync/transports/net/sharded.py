"""A sharded trainer on the network transport: every trainer rank serves its own shards to
the receiving hosts from a listener of its own, and each host fetches every rank's part
and puts the global tensors together; no rank gathers anything. The round is the rank
protocol's over its socket board (on the trainer's host, or over TCP at a ``board`` address
rank 0 listens at, :mod:`.board`). The network's data plane: each rank packs its pieces
(cast to the wire dtype, every chunk checksummed) as version ``n`` of its own
:class:`~.publisher.VersionPublisher` and its done names the address it serves at; rank 0
then has every host fetch ``n`` from every rank at once (``deliver``), whole or as deltas
against the part of ``n - 1`` the host holds. A rank lost while the hosts fetch fails the
round; a server that did not take it is rank 0's error once it is committed. Hosts prove
the *host token*, an HMAC of the rank key, which they never receive (or, for
``NetWeightSyncScheme``, the workers' token their scheme carries: ``hosts_token``)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError, TrainerRankLostError
from weightsync.core.layout import Layout
from weightsync.core.shards import (
    ShardPiece,
    describe_regions,
    global_layout,
    local_pieces,
)
from weightsync.transports.net.board import TcpRankListener, connect_tcp
from weightsync.transports.net.packed import PackedVersion, plan
from weightsync.transports.net.publisher import JoinHandler, VersionPublisher
from weightsync.transports.ranks.lead import LeadRound, Model, RankLead
from weightsync.transports.ranks.member import RankMember
from weightsync.transports.ranks.records import Plan
from weightsync.transports.ranks.socket_board import RankHub, RankLink

logger = logging.getLogger(__name__)

#: the shortest rank key accepted (hex characters: 128 bits)
MIN_RANK_KEY = 32
#: seconds between rank 0's pings of the other ranks while the hosts fetch a version
PING_S = 0.5
#: a rank silent this long while the hosts fetched is named when their fetch fails
STALLED_S = 3.0
#: how long a failed delivery waits for the board to notice a rank that died meanwhile
LOSS_NOTICE_S = 0.5


def checked_rank_key(rank_key: str, ranks: int) -> str:
    """``rank_key`` if it is a secret worth the name; a ValueError saying how to make one."""
    if not isinstance(rank_key, str) or len(rank_key) < MIN_RANK_KEY:
        raise ValueError(
            f"trainer_ranks={ranks} needs a rank key of at least {MIN_RANK_KEY} characters, "
            "the same on every rank and never given to the servers: e.g. "
            "secrets.token_hex(32) made by the launcher and handed to each rank")
    return rank_key


def board_address(rank_key: str) -> str:
    """Where rank 0's rank board listens on the trainer's host (every rank computes the
    same name from the key; the board appends its own suffix)."""
    digest = hashlib.sha256(f"weightsync-net-ranks/{rank_key}".encode()).hexdigest()[:24]
    return f"\0weightsync-net-{os.getuid()}-{digest}"


def host_token(rank_key: str) -> str:
    """The token the receiving hosts prove to every rank's listener: derived from the rank
    key, which the hosts never see."""
    return hmac.new(rank_key.encode(), b"weightsync-net hosts", hashlib.sha256).hexdigest()


def pack_pieces(pieces: Sequence[ShardPiece], version: int, dtype: torch.dtype | None,
                publisher: VersionPublisher, layout: Layout) -> PackedVersion:
    """This rank's pieces as version ``version`` of ``publisher``, packed and checksummed
    (each piece detached: its bytes, not its autograd history), with each tensor's global
    shape from ``layout`` (what the hosts check the parts cover)."""
    local = {p.name: p.local.detach() for p in pieces}
    nbytes = plan(local, version, dtype).nbytes
    packed = plan(local, version, dtype, publisher.spare_buffer(nbytes))
    packed.regions = describe_regions(pieces)
    shapes = {spec.name: list(spec.shape) for spec in layout}
    packed.shapes = {p.name: shapes[p.name] for p in pieces}
    packed.fill(local)
    publisher.publish(packed)
    return packed


class RankPublisher:
    """What every rank of a sharded trainer has: its pieces of each version, served at
    ``address`` to hosts that prove ``hosts_token`` (default: the host token of the rank
    key). ``on_join``: where workers' control connections go (rank 0 of a scheme)."""

    def __init__(self, rank: int, address: str, rank_key: str, dtype: torch.dtype | None,
                 timeout: float, delta: bool, hosts_token: str | None = None,
                 on_join: JoinHandler | None = None) -> None:
        self.rank, self.dtype = rank, dtype
        self.publisher = VersionPublisher(
            address, host_token(rank_key) if hosts_token is None else hosts_token,
            timeout=timeout, delta=delta, on_join=on_join)
        self.pieces: list[ShardPiece] = []
        self.layout: Layout | None = None

    @property
    def address(self) -> str:
        return self.publisher.address

    def take(self, flat: Mapping[str, Any]) -> None:
        """This send's pieces of ``flat`` (``name -> DTensor | LocalShard | tensor``)."""
        self.layout = global_layout(flat)
        self.pieces = local_pieces(flat, self.rank)

    def publish(self, version: int) -> dict[str, Any]:
        assert self.layout is not None
        packed = pack_pieces(self.pieces, version, self.dtype, self.publisher, self.layout)
        return {"address": self.address, "nbytes": packed.nbytes}

    def close(self) -> None:
        self.publisher.close()


#: rank 0's delivery of a version: (version, every rank's address) -> None or an error
Deliver = Callable[[int, list[str]], None]


class NetRankLead:
    """Rank 0 of ``ranks``: the rank board's hub and the protocol's lead, beside its own
    publisher. ``send`` returns once ``deliver`` (the hosts fetched the version from every
    rank) returned; a lost rank fails the attempt on every rank. ``hosts_token``,
    ``on_join``: as :class:`RankPublisher`'s."""

    def __init__(self, address: str, rank_key: str, ranks: int, *, dtype: torch.dtype | None,
                 timeout: float, delta: bool, board: str = "", hosts_token: str | None = None,
                 on_join: JoinHandler | None = None) -> None:
        self.ranks = ranks
        self.own = RankPublisher(0, address, rank_key, dtype, timeout, delta, hosts_token,
                                 on_join)
        if board:  # ranks on several hosts: the board over TCP at that HOST:PORT
            self.hub = RankHub(board, rank_key, None, ranks, listener=TcpRankListener(board))
        else:
            self.hub = RankHub(board_address(rank_key), rank_key, os.getuid(), ranks)
        self.lead = RankLead(self.hub, ranks)
        self.committed = -1  # the version the last committed round wrote
        self.hub.start()

    def send(self, flat: Mapping[str, Any], version: int, deadline: Deadline,
             deliver: Deliver) -> list[str]:
        """Write version ``version`` with every rank and ``deliver`` it; returns the ranks'
        addresses. Raises (on every rank) what failed the round: ``TrainerRankLostError``
        for a rank (one lost while the hosts fetched included), ``SchemaMismatchError`` for
        layouts that disagree. A delivery that failed at the hosts alone is the servers'
        error, raised here once the round is committed (``committed``): the ranks' version
        stands, as a worker's failure leaves it on every medium."""
        own = self.own

        def model() -> Model:
            own.take(flat)
            assert own.layout is not None
            return own.layout, describe_regions(own.pieces)

        def body(round_: LeadRound) -> tuple[list[str], Exception | None]:
            _, dones = round_.write({}, lambda plan: own.publish(plan.version))
            addresses = [own.address] + [_address(dones[r].detail, r)
                                         for r in range(1, self.ranks)]
            try:
                with self._pinging():
                    deliver(version, addresses)
            except Exception as exc:
                assert round_.plan is not None
                self._blame_lost_rank(round_.plan, exc)
                return addresses, exc
            return addresses, None

        addresses, servers_failed = self.lead.run(version, deadline, model, body)
        self.committed = version
        if servers_failed is not None:
            raise servers_failed
        return addresses

    @contextlib.contextmanager
    def _pinging(self) -> Iterator[None]:
        """While the hosts fetch, ask every rank for a word each :data:`PING_S`: a rank
        that stopped (stalled, suspended) stops answering, and is named if they fail."""
        stop = threading.Event()

        def ping() -> None:
            while not stop.wait(PING_S):
                self.hub.ping()

        self.hub.ping()
        thread = threading.Thread(target=ping, name="weightsync-net-ping", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)

    def _blame_lost_rank(self, attempt: Plan, error: Exception) -> None:
        """A delivery that failed while a rank was lost (it died while the hosts fetched its
        part) or had stopped answering (stalled) is that rank's ``TrainerRankLostError``,
        not only the servers' error. A host may hear of a dead rank before this board does:
        it is given :data:`LOSS_NOTICE_S` to notice."""
        notice = Deadline(LOSS_NOTICE_S)
        while True:
            for rank in range(1, self.ranks):
                why = self.hub.lost(rank, attempt.incarnations[rank])
                silent = self.hub.silent_for(rank)
                if not why and silent > STALLED_S:
                    why = f"stopped answering ({silent:.1f} s without a word: stalled?)"
                if why:
                    raise TrainerRankLostError(
                        f"trainer rank {rank} {why} while the hosts fetched version "
                        f"{attempt.version} ({type(error).__name__}: {error})",
                        rank=rank) from error
            if notice.expired():
                return
            self.hub.wait(notice.slice(0.05))

    def close(self) -> None:
        self.hub.close()
        self.own.close()


def _address(detail: dict[str, Any], rank: int) -> str:
    address = detail.get("address")
    if not isinstance(address, str) or not address:
        raise IntegrityError(f"trainer rank {rank}'s done record names no address")
    return address


class NetRankMember:
    """Rank ``rank`` (1..N-1): joins rank 0's board and serves its own pieces of each
    version rank 0 plans."""

    def __init__(self, address: str, rank_key: str, rank: int, *, dtype: torch.dtype | None,
                 timeout: float, delta: bool, board: str = "",
                 hosts_token: str | None = None) -> None:
        self.rank = rank
        self.own = RankPublisher(rank, address, rank_key, dtype, timeout, delta, hosts_token)
        if board:  # rank 0's board over TCP (ranks on several hosts)
            self.link = RankLink(board, rank_key, None, rank,
                                 connect=lambda timeout: connect_tcp(board, timeout))
        else:
            self.link = RankLink(board_address(rank_key), rank_key, os.getuid(), rank)
        self.member = RankMember(self.link, rank)

    def open(self, deadline: Deadline) -> None:
        """Join rank 0's board (``TrainerRankLostError`` naming rank 0 if it is not there
        within ``deadline``)."""
        self.link.open(deadline)

    def send(self, flat: Mapping[str, Any], version: int, deadline: Deadline) -> int:
        """Serve this rank's part of the next version rank 0 plans; returns that version
        once rank 0 committed it, or raises what failed it, as every rank does."""
        own = self.own
        own.take(flat)
        assert own.layout is not None
        return self.member.run(own.layout, describe_regions(own.pieces),
                               lambda plan: own.publish(plan.version), version, deadline)

    def close(self) -> None:
        self.link.close()
        self.own.close()
