"""The network transport's worker end as the receive lifecycle drives it (``core/endpoints``).

A background stager hears of each version over the control connection (:class:`~.link.
NetLink`) and makes it staged on this host (:class:`~.host_stage.HostStage`: one fetch per
host, into shared memory), then tells the trainer. A version is applied only at the
worker's call (``connect``, ``poll``, ``receive``), copied from the staged bytes, so the
fetch never runs on the worker's own thread and a version is never half applied. A
sharded trainer's version is fetched from every rank at once (:func:`~.sharded_fetch.
fetch_packed`, still one fetch per host) and applied once the ranks committed it. With
several hosts, a host fetches from the hosts before it and serves the hosts after it
(:mod:`.relay`), each chunk checked against the trainer's digest.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import SchemaMismatchError, WeightSyncError
from weightsync.core.layout import Layout
from weightsync.core.versions import NO_VERSION
from weightsync.transports.net.fetch import Forwarding, VersionFetcher
from weightsync.transports.net.host_stage import HostStage, host_id
from weightsync.transports.net.link import NetLink
from weightsync.transports.net.packed import PackedVersion
from weightsync.transports.net.relay import LEAD_GRACE_S, HostRelay, relayed
from weightsync.transports.net.sharded_fetch import ShardedFetcher, fetch_packed

logger = logging.getLogger(__name__)

_WAIT_SLICE = 0.05


class NetReader:
    """Worker ``worker_idx``'s end: versions staged on its host, applied at its call."""

    views_model = False
    expecting = "version from the trainer"

    def __init__(self, address: str, token: str, worker_idx: int, *, timeout: float,
                 cast: bool, delta: bool = False) -> None:
        self.worker_idx = worker_idx
        self._token = token
        self.name = f"worker {worker_idx} on {socket.gethostname()}"
        self.link = NetLink(address, token, worker_idx, self.name)
        self.timeout = timeout
        self.cast = cast  # the trainer casts floating tensors: dtypes may differ here
        self.delta = delta  # this worker's relay forwards deltas to hosts that hold the base
        self.stage: HostStage | None = None
        self.relay: HostRelay | None = None
        self._cond = threading.Condition()
        self._staged = NO_VERSION
        self._staged_round = ""  # a sharded trainer's round that staged ``_staged``
        self._failed: tuple[int, str, str] | None = None  # (version, why, round)
        self._sharded: ShardedFetcher | None = None  # a sharded trainer's: one base per rank
        self._stop = False
        self._came_from: str | None = None  # where this worker fetched the version it staged
        self._stager: threading.Thread | None = None
        self.link.on_event = self._wake
        self.link.join_extra = self._open_relay

    def _open_relay(self, local_host: str) -> dict[str, str]:
        """Listen for the hosts after this one (on the address this worker reaches the
        trainer from); the join says where, and which host this is."""
        if self.relay is None:
            self.relay = HostRelay(local_host, self._token, timeout=self.timeout,
                                   delta=self.delta)
        return {"relay": self.relay.address, "host": host_id()}

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ the lifecycle's calls
    def open(self, local: Layout | None, deadline: Deadline) -> None:
        self.link.open(deadline)
        sent = Layout.from_dict(self.link.wait_layout(deadline))
        if local is not None:
            try:
                sent.check_compatible(local, self_name="the trainer",
                                      other_name=f"worker {self.worker_idx}", ignore_dtype=self.cast)
            except SchemaMismatchError as exc:
                self.link.send({"mismatch": str(exc), "key": exc.key, "expected": exc.expected,
                                "got": exc.got})
                raise
        # one directory per trainer session, shared by its workers on this host
        key = f"{self.link.address}/{self._token}/{self.link.session}"
        self.stage = HostStage(key, self.name)
        self._stager = threading.Thread(target=self._run_stager, daemon=True,
                                        name=f"weightsync-net-stager-{self.worker_idx}")
        self._stager.start()

    def newer_available(self, version: int) -> bool:
        return self._usable() > version

    def _usable(self) -> int:
        """The newest version this worker may apply: staged on its host and, from a
        sharded trainer, committed by the ranks (a failed round's is never applied)."""
        return min(self._staged, self.link.committed) if self.link.ranks else self._staged

    def apply_newest(self, dest: dict[str, torch.Tensor], version: int,
                     deadline: Deadline) -> int | None:
        with self._cond:
            while self._usable() <= version < self.link.delivered and not deadline.expired() \
                    and self.link.sender_lost is None and not self._failed_at(self.link.delivered):
                self._cond.wait(deadline.slice(_WAIT_SLICE))
        usable = self._usable()
        if usable <= version or self.stage is None:
            return None
        return self.stage.apply(dest, version, at_most=usable if self.link.ranks else None)

    def _failed_at(self, version: int) -> bool:
        """Staging ``version`` (in the link's current round) failed on this host."""
        failed = self._failed
        return failed is not None and (failed[0] > version or (
            failed[0] == version and failed[2] == self.link.round))

    def _to_stage(self) -> bool:
        """The version announced last (in its round) is not staged here, nor failed."""
        link = self.link
        return (link.delivered > self._staged or (
            link.delivered == self._staged and link.round != self._staged_round)) \
            and not self._failed_at(link.delivered)

    def wait(self, version: int, deadline: Deadline) -> None:
        with self._cond:
            if self._usable() <= version and self.link.sender_lost is None:
                self._cond.wait(deadline.slice(_WAIT_SLICE))
        self.check_sender(version)

    def check_sender(self, version: int) -> None:
        if self._usable() <= version:  # what was staged before the trainer left is applied first
            self.link.check_sender(version)

    def ack(self, version: int) -> None:
        self.link.send({"ack": version})

    def close(self, dest: dict[str, torch.Tensor] | None) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.link.close()
        if self._stager is not None and self._stager is not threading.current_thread():
            self._stager.join(10.0)
        if self.relay is not None:
            self.relay.close()
        if self.stage is not None:
            self.stage.close()

    # ------------------------------------------------------------------ staging
    def _run_stager(self) -> None:
        """Stage each version the trainer announces, one at a time, and say so."""
        while True:
            with self._cond:
                while not self._stop and self.link.sender_lost is None and not self._to_stage():
                    self._cond.wait(0.5)
                if self._stop or self.link.sender_lost is not None:
                    return
                link = self.link
                wanted, round_, ranks = link.delivered, link.round, list(link.ranks)
                sources = list(link.sources)
                leaves_it = link.feeds and not link.lead  # to the worker whose relay serves
            assert self.stage is not None
            said = {"round": round_} if round_ else {}
            fetch = partial(self._fetch_ranks, ranks, wanted, round_) if ranks \
                else partial(self._fetch, wanted, sources)
            if leaves_it:
                self._await_lead(wanted)
            self._came_from = None
            try:
                staged = self.stage.stage(wanted, fetch, Deadline(self.timeout), round_)
            except (WeightSyncError, OSError) as exc:
                if self._stop:
                    return
                logger.warning("%s: could not stage version %d: %s", self.name, wanted, exc)
                with self._cond:
                    self._failed = (wanted, f"{type(exc).__name__}: {exc}", round_)
                    self._cond.notify_all()
                self.link.send({"failed": wanted, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                **said})
                continue
            with self._cond:
                if staged >= self._staged:
                    self._staged_round = round_ if staged == wanted else ""
                self._staged = max(self._staged, staged)
                self._failed = None
                self._cond.notify_all()
            came: dict[str, str] = {} if self._came_from is None else {"from": self._came_from}
            self.link.send({"staged": staged, **(said if staged == wanted else {}), **came})

    def _await_lead(self, wanted: int) -> None:
        """Leave the fetch of ``wanted`` to this host's lead (hosts after this one fetch it
        from the lead's relay) for up to ``LEAD_GRACE_S``: a lead that is gone or stalled
        costs that long, then this worker fetches itself."""
        assert self.stage is not None
        end = time.monotonic() + min(LEAD_GRACE_S, self.timeout / 3)
        while time.monotonic() < end and self.stage.newest() < wanted:
            with self._cond:
                if self._stop or self.link.sender_lost is not None \
                        or self.link.delivered > wanted:
                    return
                self._cond.wait(0.02)

    def _fetch(self, wanted: int, sources: list[str], base: tuple[PackedVersion, str] | None,
               allocate: Callable[[int], torch.Tensor]) -> tuple[PackedVersion, str]:
        """Version ``wanted`` from the relays before this host, nearest first, each chunk
        checked against the digests the trainer tells this host (a relay that fails,
        stalls or sends a changed chunk is passed over), else the trainer's current one;
        this worker's relay serves it on as it arrives."""
        deadline = Deadline(self.timeout)
        offer = None if self.relay is None else self.relay.offer
        if sources:
            fetcher = self._fetcher(base, allocate)
            fetched = relayed(sources, wanted, fetcher, self.link.address,
                              self.link.credential, deadline, offer)
            if fetched is not None:
                packed, self._came_from = fetched
                return packed, str(fetcher.base_session)
        fetcher = self._fetcher(base, allocate)
        packed = fetcher.fetch(self.link.address, self.link.credential, None,
                               deadline.remaining(), forwarding=Forwarding(started=offer))
        self._came_from = "trainer"
        return packed, str(fetcher.base_session)

    def _fetcher(self, base: tuple[PackedVersion, str] | None,
                 allocate: Callable[[int], torch.Tensor]) -> VersionFetcher:
        fetcher = VersionFetcher(self.name, allocate=allocate)
        if base is not None:
            fetcher.base, fetcher.base_session = base
        return fetcher

    def _fetch_ranks(self, ranks: list[str], want: int, round_: str,
                     base: tuple[PackedVersion, str] | None,
                     allocate: Callable[[int], torch.Tensor]) -> tuple[PackedVersion, str]:
        """A sharded trainer's version ``want``, from every rank at once, staged under its
        round (each rank's delta base is kept by this worker's fetcher, not ``base``)."""
        if self._sharded is None:
            self._sharded = ShardedFetcher(self.name)
        packed = fetch_packed(self._sharded, ranks, self.link.credential, want, self.timeout,
                              allocate)
        return packed, round_
