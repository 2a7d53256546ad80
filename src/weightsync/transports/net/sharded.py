"""A sharded trainer on the network transport: every trainer rank serves its own shards to
the receiving hosts from a listener of its own, and each host fetches every rank's part
and puts the global tensors together. No rank gathers anything, and nothing runs on the
trainer's process group.

The coordination is the rank protocol (:mod:`weightsync.transports.ranks`) over its socket
board (:mod:`weightsync.transports.ranks.socket_board`: socket messages, both ways
authenticated with the *rank key*): on the trainer's host by default, or over TCP at a
``board`` address rank 0 listens at (:mod:`.board`) when the ranks run on several hosts.
What is the network's is the data plane. Version ``n``:

1. Each rank announces its hello (global layout, the regions it holds); rank 0 checks the
   layouts and that the regions tile every tensor exactly once, before any byte moves.
2. Rank 0 posts the plan; each rank packs its pieces (cast to the wire dtype, every chunk
   checksummed) as version ``n`` of its own :class:`~.publisher.VersionPublisher`, and
   answers done with the address it serves at.
3. Rank 0 has every host fetch version ``n`` from every rank's address at once (its
   ``deliver``), each chunk verified, as whole chunks or as deltas against the part of
   ``n - 1`` that host holds from that rank; then it posts the outcome.

A rank lost before its done fails the attempt on every rank (``TrainerRankLostError``
naming it) and the next attempt takes the same number: no host was asked for it. Hosts
prove the *host token*, an HMAC of the rank key: they never receive the rank key, so a
server host cannot pose as a trainer rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import IntegrityError, TrainerRankLostError, WeightSyncError
from weightsync.core.layout import Layout
from weightsync.core.shards import (
    ShardPiece,
    check_parts,
    describe_regions,
    global_layout,
    local_pieces,
)
from weightsync.transports.net.board import TcpRankListener, connect_tcp
from weightsync.transports.net.fetch import VersionFetcher
from weightsync.transports.net.packed import PackedVersion, plan
from weightsync.transports.net.publisher import VersionPublisher
from weightsync.transports.ranks.lead import RankLead
from weightsync.transports.ranks.member import RankMember
from weightsync.transports.ranks.records import Hello, Plan, new_id
from weightsync.transports.ranks.socket_board import RankHub, RankLink

logger = logging.getLogger(__name__)

#: the shortest rank key accepted (hex characters: 128 bits)
MIN_RANK_KEY = 32
#: seconds between rank 0's pings of the other ranks while the hosts fetch a version
PING_S = 0.5
#: a rank silent this long while the hosts fetched is named when their fetch fails
STALLED_S = 3.0


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
    ``address`` to hosts that prove the host token."""

    def __init__(self, rank: int, address: str, rank_key: str, dtype: torch.dtype | None,
                 timeout: float, delta: bool) -> None:
        self.rank, self.dtype = rank, dtype
        self.publisher = VersionPublisher(address, host_token(rank_key), timeout=timeout,
                                          delta=delta)
        self.pieces: list[ShardPiece] = []
        self.layout: Layout | None = None

    @property
    def address(self) -> str:
        return self.publisher.address

    def take(self, flat: Mapping[str, Any]) -> None:
        """This send's pieces of ``flat`` (``name -> DTensor | LocalShard | tensor``)."""
        self.layout = global_layout(flat)
        self.pieces = local_pieces(flat, self.rank)

    def hello(self, known: Hello | None) -> Hello:
        """The hello of this rank's current model: ``known`` while it still holds."""
        assert self.layout is not None
        regions = describe_regions(self.pieces)
        if known is not None and known.fingerprint == self.layout.fingerprint \
                and known.regions == regions:
            return known
        return Hello(self.rank, new_id(), self.layout.to_dict(), self.layout.fingerprint, regions)

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
    rank) returned; a lost rank fails the attempt on every rank."""

    def __init__(self, address: str, rank_key: str, ranks: int, *, dtype: torch.dtype | None,
                 timeout: float, delta: bool, board: str = "") -> None:
        self.ranks = ranks
        self.own = RankPublisher(0, address, rank_key, dtype, timeout, delta)
        if board:  # ranks on several hosts: the board over TCP at that HOST:PORT
            self.hub = RankHub(board, rank_key, None, ranks, listener=TcpRankListener(board))
        else:
            self.hub = RankHub(board_address(rank_key), rank_key, os.getuid(), ranks)
        self.lead = RankLead(self.hub, ranks)
        self.hub.start()

    def send(self, flat: Mapping[str, Any], version: int, deadline: Deadline,
             deliver: Deliver) -> list[str]:
        """Write version ``version`` with every rank and ``deliver`` it; returns the ranks'
        addresses. Raises (on every rank) what failed: ``TrainerRankLostError`` for a rank,
        ``SchemaMismatchError`` for layouts that disagree, the delivery's error otherwise."""
        own = self.own
        try:
            own.take(flat)
            assert own.layout is not None
            self.lead.meet(own.layout, describe_regions(own.pieces), version, deadline)
            attempt = self.lead.begin(version, {})
            own.publish(version)
            dones = self.lead.wait_done(attempt, deadline)
            addresses = [own.address] + [_address(dones[r].detail, r)
                                         for r in range(1, self.ranks)]
            try:
                with self._pinging():
                    deliver(version, addresses)
            except Exception as exc:
                self._blame_lost_rank(attempt, exc)
                raise
        except BaseException as exc:
            self.lead.fail(version, exc)
            raise
        self.lead.commit()
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
        not only the servers' error."""
        for rank in range(1, self.ranks):
            why = self.hub.lost(rank, attempt.incarnations[rank])
            silent = self.hub.silent_for(rank)
            if not why and silent > STALLED_S:
                why = f"stopped answering ({silent:.1f} s without a word: stalled?)"
            if why:
                raise TrainerRankLostError(
                    f"trainer rank {rank} {why} while the hosts fetched version "
                    f"{attempt.version} ({type(error).__name__}: {error})", rank=rank) from error

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
                 timeout: float, delta: bool, board: str = "") -> None:
        self.rank = rank
        self.own = RankPublisher(rank, address, rank_key, dtype, timeout, delta)
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
        self.own.take(flat)
        self.member.announce(self.own.hello(self.member.hello))
        return self.member.take_part(lambda attempt: self._write(attempt), version, deadline)

    def _write(self, attempt: Plan) -> dict[str, Any]:
        return self.own.publish(attempt.version)

    def close(self) -> None:
        self.link.close()
        self.own.close()


class ShardedFetcher:
    """A receiving host's end: one :class:`~.fetch.VersionFetcher` per trainer rank (each
    keeps its own delta base), fetched at once, put together into the global tensors."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._fetchers: dict[int, VersionFetcher] = {}

    def fetch(self, addresses: Sequence[str], token: str, want: int | None,
              timeout: float, commit: Callable[[int, dict[str, torch.Tensor]], None] | None = None
              ) -> tuple[int, dict[str, torch.Tensor]]:
        """Version ``want`` (None: the ranks' current one) from every rank, verified and put
        together: ``(version, name -> global tensor)``. ``commit(version, tensors)``: run
        once every part arrived, before rank 0 hears its part did (so rank 0's verdict means
        "staged"); if it raises, rank 0 is told why."""
        for rank in [r for r in self._fetchers if r >= len(addresses)]:
            del self._fetchers[rank]
        fetchers = [self._fetchers.setdefault(r, VersionFetcher(f"{self.name} <- trainer rank {r}"))
                    for r in range(len(addresses))]
        futures: list[Future[PackedVersion]] = []
        whole: list[tuple[int, dict[str, torch.Tensor]]] = []

        def put_together(first: PackedVersion) -> None:  # in rank 0's fetch, before its verdict
            parts = [first, *(f.result() for f in futures[1:])]
            versions = {p.version for p in parts}
            if len(versions) != 1:
                raise WeightSyncError(f"host {self.name}: the trainer ranks serve different "
                                      f"versions {sorted(versions)}; ask for one by number")
            whole.append((versions.pop(), assemble(parts, self.name)))
            if commit is not None:
                commit(*whole[0])

        with ThreadPoolExecutor(len(addresses), thread_name_prefix="weightsync-net-fetch") as pool:
            for rank, (fetcher, address) in enumerate(zip(fetchers, addresses, strict=True)):
                futures.append(pool.submit(fetcher.fetch, address, token, want, timeout,
                                           put_together if rank == 0 else None))
            for future in futures:
                future.result()
        return whole[0]

    @property
    def last_kinds(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for fetcher in self._fetchers.values():
            for kind, count in fetcher.last_kinds.items():
                kinds[kind] = kinds.get(kind, 0) + count
        return kinds


def assemble(parts: Sequence[PackedVersion], where: str) -> dict[str, torch.Tensor]:
    """The global tensors the ranks' parts tile: each part's region copied into a tensor of
    the global shape the ranks declare (the parts' bounding shape if they declare none),
    once the regions are checked to cover each tensor exactly once (``check_parts``; rank 0
    checked the ranks' hellos, this checks what arrived)."""
    found: dict[str, list[tuple[torch.Tensor, list[int]]]] = {}
    for rank, part in enumerate(parts):
        tensors = part.tensors()
        for name, tensor in tensors.items():
            bounds = part.regions.get(name)
            if bounds is None:
                raise IntegrityError(f"host {where}: trainer rank {rank} sent {name!r} without "
                                     "its region")
            found.setdefault(name, []).append((tensor, bounds))
    shapes: dict[str, list[int]] = {}
    for name, pieces in found.items():
        dtypes = {t.dtype for t, _ in pieces}
        if len(dtypes) != 1:
            raise IntegrityError(f"host {where}: the ranks sent {name!r} as {sorted(map(str, dtypes))}")
        dims = {len(b) for _, b in pieces}
        if len(dims) != 1:
            raise IntegrityError(f"host {where}: the ranks sent {name!r} with "
                                 f"{sorted(d // 2 for d in dims)} dimensions")
        shapes[name] = [max(b[2 * d + 1] for _, b in pieces) for d in range(dims.pop() // 2)]
        declared = {tuple(part.shapes[name]) for part in parts if name in part.shapes}
        if len(declared) > 1:
            raise IntegrityError(f"host {where}: the ranks give {name!r} different global "
                                 f"shapes {sorted(declared)}")
        if declared:  # the shape the parts must cover (a missing last block is a gap)
            shapes[name] = list(declared.pop())
    check_parts(shapes, {rank: part.regions for rank, part in enumerate(parts)}, f"host {where}")
    out: dict[str, torch.Tensor] = {}
    for name, pieces in found.items():
        whole = torch.empty(shapes[name], dtype=pieces[0][0].dtype)
        for tensor, bounds in pieces:
            whole[tuple(slice(bounds[2 * d], bounds[2 * d + 1]) for d in range(len(bounds) // 2))
                  ].copy_(tensor)
        out[name] = whole
    return out
