"""A host that forwards versions to other hosts, so that each version crosses the
trainer's link about once however many hosts there are.

Each worker runs a relay: a listener (:class:`~.publisher.VersionPublisher`, on the address
its host reaches the trainer from) that serves the versions this worker fetches for its
host, each chunk as soon as it arrived and was checked, as whole chunks or as a delta
against the version the asking host holds. The trainer tells each host whom to fetch from
(:func:`routes`: the hosts above it in a chain, or a tree for many hosts and a small
version, nearest first, then the trainer itself); the host asks
the trainer, over its own sealed connection, for a digest of every chunk (:meth:`~.packed.
PackedVersion.chunk_digests`), and refuses a chunk that a relay changed or damaged, then
fetches from the next source (:func:`relayed`). A relay that dies or stalls costs the hosts
after it one idle limit (:data:`IDLE_S`), not their deadline."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncError
from weightsync.transports.net.fetch import Forwarding, VersionFetcher
from weightsync.transports.net.packed import PackedVersion
from weightsync.transports.net.publisher import VersionPublisher
from weightsync.transports.net.wire import join_address, split_address

logger = logging.getLogger(__name__)

#: how many hosts before it a host may fetch from (nearest first) before the trainer
UPSTREAM = 3
#: the fan-outs :func:`fan_out` chooses from (1: a chain)
FAN_OUTS = (1, 2, 3, 4)
#: the longest a host waits for the next byte from a relay before it asks the next source
IDLE_S = 5.0
#: how long a host's other workers leave the fetch to its lead (the worker whose relay
#: hosts after it fetch from) before one of them fetches itself
LEAD_GRACE_S = 10.0


@dataclass(frozen=True)
class Route:
    """One host's part in delivering a version."""

    #: the relays it fetches from, nearest first (the trainer is its last source)
    sources: list[str]
    #: hosts fetch from this one
    feeds: bool


def fan_out(hosts: int, chunks: int) -> int:
    """How many hosts each relay feeds (1: a chain) for the last of ``hosts`` to hold a
    version of ``chunks`` chunks soonest, counted in chunk-times at one link's rate. A
    relay that feeds k hosts sends each chunk k times, and each level below the first adds
    k chunk-times before the first chunk gets there: a chain (``chunks + hosts - 1``) wins
    while the hosts are fewer than about the chunks, a tree for many hosts and a small
    version (e.g. 64 hosts, 7 chunks: a chain 70, fan-out 2 26)."""
    return min(FAN_OUTS, key=lambda k: (k * (chunks + _levels(hosts, k) - 1), k))


def _parent(position: int, k: int) -> int:
    return (position - 1) // k


def _levels(hosts: int, k: int) -> int:
    """The levels of a tree of ``hosts`` hosts where each feeds ``k`` (a chain: ``hosts``)."""
    levels, position = 1, hosts - 1
    while position > 0:
        position, levels = _parent(position, k), levels + 1
    return levels


def routes(hosts: Sequence[str], relays: Mapping[str, str], chunks: int) -> dict[str, Route]:
    """Each host's route for a version of ``chunks`` chunks: ``hosts`` in order (the first
    fetches from the trainer) as a chain or a tree (:func:`fan_out`), each host fetching
    from the relays (``relays``: host -> its lead's address) of up to ``UPSTREAM`` hosts
    above it, nearest first; the trainer is every host's last source."""
    k = fan_out(len(hosts), chunks)
    out = {}
    for position, host in enumerate(hosts):
        sources: list[str] = []
        at = position
        while at > 0 and len(sources) < UPSTREAM:
            at = _parent(at, k)
            if hosts[at] in relays:
                sources.append(relays[hosts[at]])
        out[host] = Route(sources, feeds=position * k + 1 < len(hosts))
    return out


def local_address_toward(address: str) -> str:
    """The address this host reaches ``address`` from (where its relay listens, so that
    the hosts that reach the trainer reach it too); no packet is sent."""
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port or 9))
        return str(probe.getsockname()[0])


def relayed(sources: Sequence[str], version: int, fetcher: VersionFetcher, trainer: str,
            credential: str, deadline: Deadline,
            offer: Callable[[PackedVersion, str], None] | None,
            *, relay_credential: str | None = None,
            commit: Callable[[PackedVersion], None] | None = None
            ) -> tuple[PackedVersion, str] | None:
    """Version ``version`` from the first of ``sources`` (relays) that delivers it whole,
    each chunk checked against the digests the ``trainer`` gives this host (``credential``:
    its own there; ``relay_credential``: the one it proves to relays, default the same),
    with the source it came from; None if none did (the caller asks the trainer).
    ``offer``: this host's relay, which serves the version on as it arrives."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-net-digests")
    try:
        digests = pool.submit(fetcher.fetch_digests, trainer, credential, version,
                              deadline.remaining())
        for source in sources:
            try:
                packed = fetcher.fetch(source, relay_credential or credential, version,
                                       deadline.remaining(), commit=commit,
                                       forwarding=Forwarding(digests, offer, IDLE_S))
            except (WeightSyncError, OSError) as exc:
                logger.warning("host %s: version %d from the relay at %s failed (%s); "
                               "asking the next source", fetcher.name, version, source, exc)
                continue
            return packed, source
        return None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


class HostRelay:
    """Worker-side: serves what this worker fetches for its host to the hosts after it."""

    def __init__(self, bind_host: str, token: str, *, timeout: float, delta: bool) -> None:
        self.publisher = VersionPublisher(join_address(bind_host, 0), token, timeout=timeout,
                                          delta=delta, awaits=timeout)

    @property
    def address(self) -> str:
        return self.publisher.address

    def offer(self, packed: PackedVersion, session: str) -> None:
        """``packed``, of the trainer session ``session``, is on its way here: each chunk is
        served once marked ready, under that session (a host's delta base from the
        trainer is one here too)."""
        self.publisher.session = session
        self.publisher.publish(packed)

    def forwarded_bytes(self, version: int) -> int:
        """Every byte this relay sent of ``version`` (its streams that ended)."""
        return sum(s.wire_bytes for s in self.publisher.figures(version))

    def close(self) -> None:
        self.publisher.close()
