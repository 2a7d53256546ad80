"""A receiving host's end of the network transport: connect to the trainer, prove this
host's credential, ask for a version (saying which one this host holds, so it may come as
deltas), and rebuild it chunk by chunk, each authenticated (:mod:`.seal`) and verified
against the trainer's checksum before the version is returned. The last verified version
stays in memory as the next delta's base. One deadline bounds the whole fetch."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import (
    IntegrityError,
    SenderLostError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.transports.delta.codec import KIND_NAMES, WHOLE, DeltaDecoder, header_problem
from weightsync.transports.net.handshake import prove_to_trainer
from weightsync.transports.net.packed import (
    DIGEST,
    PackedVersion,
    chunk_count,
    chunk_digest,
    layout_fingerprint,
    parse_header,
    parse_metadata,
    parse_regions,
    parse_shapes,
)
from weightsync.transports.net.seal import TAG_BYTES, Seal
from weightsync.transports.net.wire import (
    CHUNK_BYTES,
    CHUNK_HEADER,
    CHUNK_POSITION,
    DeadlinePassed,
    ProtocolError,
    chunk_checksum,
    recv_exact,
    recv_frame,
    recv_into_exact,
    send_frame,
    split_address,
    tensor_view,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: the largest version a host accepts (after the trainer proved the credential), and never
#: more than this host's memory
MAX_VERSION_BYTES = 1 << 42


def host_memory() -> int:
    """This host's physical memory in bytes (the bound of any version it can hold)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return MAX_VERSION_BYTES


class _BadDelta(IntegrityError):
    """A chunk sent as a delta did not rebuild the trainer's chunk: this host's base is
    suspect, so the version is asked for again, whole."""


@dataclass(frozen=True)
class Forwarding:
    """What a fetch from a peer host, or for one, needs: the trainer's digest of each
    chunk, told over this host's own sealed link (a chunk counts only once it matches,
    whoever sent it: a relay cannot change what it forwards), and who to hand the version
    under way as it arrives (this host's relay serves each chunk once it is checked)."""

    #: the trainer's digests, as they come (:meth:`VersionFetcher.fetch_digests`)
    digests: Future[list[str]] | None = None
    #: given the version under way and its trainer session, as its header arrives
    started: Callable[[PackedVersion, str], None] | None = None
    #: from a relay: give up on it once it sends nothing for this long (None: the deadline)
    idle_s: float | None = None


class VersionFetcher:
    """Fetches versions from one trainer session for this host (``name``: how the trainer
    logs it). ``allocate(nbytes)``: where a version is rebuilt (default: fresh memory, or
    the buffer of the base before last), e.g. a file in shared memory."""

    def __init__(self, name: str, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.name = name
        self._allocate = allocate
        self.base: PackedVersion | None = None
        self.base_session: str | None = None
        self.last_kinds: dict[str, int] = {}
        #: why the last version came whole (None: it came as deltas, or this host asked
        #: for nothing better), as the trainer said it
        self.last_whole_reason: str | None = None
        self.whole_refetches = 0  # versions fetched again whole after a delta failed here
        self._decoder: DeltaDecoder | None = None
        self._spare: torch.Tensor | None = None  # the buffer of the base before last
        #: where this host's relay listens (told with each request: the trainer routes
        #: other hosts to it), or None
        self.relay_address: str | None = None

    def fetch(self, address: str, credential: str, want: int | None, timeout: float | None,
              commit: Callable[[PackedVersion], None] | None = None,
              forwarding: Forwarding | None = None) -> PackedVersion:
        """Version ``want`` (None: the trainer's current one), verified, within one deadline
        of ``timeout`` seconds from this call's start. ``credential``: this host's, as the
        trainer made it (:func:`~.handshake.host_credential`). Raises ``SenderLostError``
        if the trainer is unreachable or goes away mid-version, ``IntegrityError`` if a
        chunk fails its MAC or checksum, ``WeightSyncTimeoutError`` once the deadline
        passes, ``WeightSyncError`` if the trainer has no such version; the base is then
        unchanged. A delta that does not rebuild the trainer's chunk (a damaged base) is
        fetched again whole at once, within the same deadline. ``forwarding``: digests to
        check each chunk against, and who gets the version as it arrives (a relaying
        host). ``commit(version)``: run
        once the version is verified and before the trainer is told it arrived (e.g. stage
        it), so the trainer's verdict means "staged"; if it raises, the trainer is told
        why and the base is unchanged."""
        deadline = Deadline(timeout)
        try:
            return self._fetch_once(address, credential, want, deadline, offer_base=True,
                                    commit=commit, forwarding=forwarding)
        except _BadDelta as exc:
            self.whole_refetches += 1
            logger.info("host %s: %s; fetching version %s again, whole, at once", self.name,
                        exc, want if want is not None else "(current)")
            return self._fetch_once(address, credential, want, deadline, offer_base=False,
                                    whole=f"a delta against its base did not rebuild the "
                                          f"trainer's chunk ({exc})", commit=commit,
                                    forwarding=forwarding)

    def _fetch_once(self, address: str, credential: str, want: int | None, deadline: Deadline,
                    offer_base: bool, whole: str | None = None,
                    commit: Callable[[PackedVersion], None] | None = None,
                    forwarding: Forwarding | None = None) -> PackedVersion:
        asked = want if want is not None else "(current)"
        forwarding = forwarding or Forwarding()
        reads = deadline if forwarding.idle_s is None else deadline.idle_limited(forwarding.idle_s)
        return self._exchange(address, credential, asked, deadline, reads, lambda sock, seal:
                              self._receive(sock, seal, address, want, reads, offer_base, whole,
                                            commit, forwarding))

    def fetch_digests(self, address: str, credential: str, version: int,
                      timeout: float | None) -> list[str]:
        """The trainer's digest of each chunk of ``version``, over this host's own sealed
        connection to it (to check the version as it comes from another host)."""
        deadline = Deadline(timeout)

        def ask(sock: socket.socket, seal: Seal) -> list[str]:
            send_frame(sock, {"digests": version}, seal)
            reply = recv_frame(sock, seal=seal, deadline=deadline,
                               what=f"host {self.name}: the digests from {address}")
            digests = reply.get("digests")
            if "digests" in reply and reply.get("hash") != DIGEST:
                raise WeightSyncError(
                    f"host {self.name}: the trainer at {address} hashes chunks with "
                    f"{reply.get('hash', 'sha256-128')!r:.40}, this host checks {DIGEST!r}: run "
                    "the same weightsync release on the trainer and every host")
            if not isinstance(digests, list) or not all(
                    isinstance(d, str) and len(d) == 32 for d in digests):
                raise WeightSyncError(f"host {self.name}: the trainer at {address} gave no "
                                      f"digests of version {version}: {reply.get('error')}")
            return digests
        return self._exchange(address, credential, f"{version} (its digests)", deadline,
                              deadline, ask)

    def report(self, address: str, credential: str, version: int, source: str,
               timeout: float | None) -> None:
        """Tell the trainer this host staged ``version``, fetched from the relay at
        ``source`` (its verdict, as a stream from the trainer ends with one)."""
        deadline = Deadline(timeout)

        def tell(sock: socket.socket, seal: Seal) -> None:
            send_frame(sock, {"report": version, "source": source, "relay": self.relay_address},
                       seal)
            recv_frame(sock, seal=seal, deadline=deadline,
                       what=f"host {self.name}: the trainer's answer to its report")
        self._exchange(address, credential, f"{version} (its report)", deadline, deadline, tell)

    def _exchange(self, address: str, credential: str, asked: object, deadline: Deadline,
                  reads: Deadline, body: Callable[[socket.socket, Seal], T]) -> T:
        """Connect to ``address``, prove this host's ``credential``, run ``body`` on the
        sealed connection; its failures as this host's named errors."""
        host, port = split_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=deadline.remaining())
        except TimeoutError:
            raise self._late(address, asked, deadline, "connecting") from None
        except OSError as exc:
            raise SenderLostError(f"host {self.name}: cannot reach the trainer at {address} "
                                  f"({exc}); is it running, and is that address reachable "
                                  f"from here?") from None
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                return body(sock, prove_to_trainer(sock, credential, self.name, reads))
            except DeadlinePassed as exc:
                raise self._late(address, asked, deadline, str(exc)) from None
            except (ProtocolError, OSError) as exc:
                raise SenderLostError(
                    f"host {self.name}: the connection to the trainer at {address} broke "
                    f"during version {asked}: {type(exc).__name__}: {exc}; this host keeps "
                    "serving the version it held") from None

    def _late(self, address: str, asked: object, deadline: Deadline, detail: str
              ) -> WeightSyncTimeoutError:
        return WeightSyncTimeoutError(
            f"host {self.name}: version {asked} from the trainer at {address} did not arrive "
            f"within the fetch's deadline of {deadline} ({detail}); this host keeps serving "
            "the version it held")

    def _receive(self, sock: socket.socket, seal: Seal, address: str, want: int | None,
                 deadline: Deadline, offer_base: bool, whole: str | None,
                 commit: Callable[[PackedVersion], None] | None,
                 forwarding: Forwarding) -> PackedVersion:
        base = self.base if offer_base else None
        held = None if base is None else {"session": self.base_session, "version": base.version,
                                          "fingerprint": base.fingerprint}
        request: dict[str, object] = {"want": want, "base": held}
        if self.relay_address is not None:
            request["relay"] = self.relay_address
        if whole is not None:
            request["whole"] = whole[:300]
        send_frame(sock, request, seal)
        header = recv_frame(sock, seal=seal, deadline=deadline,
                            what=f"host {self.name}: the version header from {address}")
        if "error" in header:
            raise WeightSyncError(f"host {self.name}: the trainer at {address} refused: "
                                  f"{header['error']}")
        version, session, entries, nbytes = parse_header(header, MAX_VERSION_BYTES)
        regions = parse_regions(header, entries)
        shapes = parse_shapes(header, regions)
        metadata = parse_metadata(header)
        memory = host_memory()
        if nbytes > memory:
            raise IntegrityError(
                f"host {self.name}: the trainer's header announces version {version} of "
                f"{nbytes} bytes, more than this host's {memory} bytes of memory; refused "
                "before anything is allocated")
        based = header.get("base")
        if based is not None and (base is None or based != base.version
                                  or session != self.base_session
                                  or layout_fingerprint(entries, nbytes) != base.fingerprint):
            raise ProtocolError(f"the trainer encodes against version {based}, which this "
                                f"host does not hold")
        self.last_whole_reason = None if based is not None else str(header.get("whole", ""))[:200]
        if based is None and self.last_whole_reason:
            logger.info("host %s receives version %d whole: %s", self.name, version,
                        self.last_whole_reason)
        # a relaying host's versions are served on: no buffer of theirs is written again
        out = self._buffer(nbytes, version, reuse=forwarding.started is None)
        count = chunk_count(nbytes)
        # the version under way, each chunk marked ready once checked (a relay serves it)
        packed = PackedVersion(version, entries, out, [0] * count, regions=regions,
                               shapes=shapes, metadata=metadata, _ready=0)
        if forwarding.started is not None:
            forwarding.started(packed, session)
        try:
            kinds = self._chunks(sock, seal, address, packed, base if based is not None else None,
                                 forwarding.digests, deadline)
        except BaseException as exc:
            packed.mark_failed(f"{type(exc).__name__}: {exc}")
            raise
        packed.mark_ready(count)
        if commit is not None:
            try:
                commit(packed)
            except Exception as exc:  # the trainer hears why; the caller gets the error
                message = (f"host {self.name} could not stage version {version}: "
                           f"{type(exc).__name__}: {exc}")
                self._refuse(sock, seal, IntegrityError, message)
                if isinstance(exc, (ProtocolError, OSError)):  # not the connection's fault
                    raise WeightSyncError(message) from exc
                raise
        if self.base is not None:
            self._spare = self.base.buffer  # callers are done with a version once they fetch again
        self.base, self.base_session, self.last_kinds = packed, session, kinds
        send_frame(sock, {"ok": version}, seal)
        logger.info("host %s received version %d (%d bytes, chunks %s)", self.name, version,
                    nbytes, kinds)
        return packed

    def _chunks(self, sock: socket.socket, seal: Seal, address: str, packed: PackedVersion,
                base: PackedVersion | None, trainers: Future[list[str]] | None,
                deadline: Deadline) -> dict[str, int]:
        """Rebuild every chunk of ``packed`` from the stream (whole, or a delta against
        ``base``), each checked (MAC, checksum, the trainer's digest when given) before it
        is marked ready; returns how many chunks came as each kind."""
        version, out, nbytes = packed.version, packed.buffer, packed.nbytes
        digests: list[str] | None = None
        kinds: dict[str, int] = {}
        position = bytearray(CHUNK_POSITION.size)
        for index in range(chunk_count(nbytes)):
            head = recv_exact(sock, CHUNK_HEADER.size + TAG_BYTES, deadline)
            kind, size, checksum = CHUNK_HEADER.unpack_from(head)
            target = out[index * CHUNK_BYTES:(index + 1) * CHUNK_BYTES]
            problem = header_problem(kind, size, target.numel(), base is not None)
            if problem is not None:
                raise IntegrityError(f"host {self.name}: chunk {index} of version {version}: "
                                     f"{problem}; the version is refused before anything is "
                                     f"allocated for it, and this host keeps the one it held")
            name = KIND_NAMES[kind]
            kinds[name] = kinds.get(name, 0) + 1
            where = f"host {self.name}: chunk {index} of version {version} (sent {name})"
            if kind == WHOLE:
                recv_into_exact(sock, tensor_view(target), deadline)
            else:
                assert base is not None  # header_problem refuses a delta without a base
                payload = torch.empty(size, dtype=torch.uint8)
                recv_into_exact(sock, tensor_view(payload), deadline)
                if self._decoder is None:
                    self._decoder = DeltaDecoder()
                try:
                    self._decoder.decode(kind, payload, base.chunk(index), target)
                except (ValueError, IntegrityError) as exc:
                    raise self._refuse(sock, seal, _BadDelta,
                                       f"{where} does not decode: {exc}") from None
            CHUNK_POSITION.pack_into(position, 0, version, index)
            try:
                seal.check(memoryview(head)[CHUNK_HEADER.size:], memoryview(head)[:CHUNK_HEADER.size],
                           position, tensor_view(target), what=where)
            except IntegrityError as exc:
                raise self._refuse(sock, seal, IntegrityError if kind == WHOLE else _BadDelta,
                                   str(exc)) from None
            if trainers is not None:  # from a relay: the digest, which the checksum adds nothing to
                if digests is None:
                    digests = self._digests(trainers, version, chunk_count(nbytes), deadline)
                if chunk_digest(target) != digests[index]:
                    raise self._refuse(sock, seal, IntegrityError,
                                       f"{where} from {address} differs from the trainer's "
                                       "digest (the peer that forwarded it changed or damaged "
                                       "it); the version is refused and this host keeps the "
                                       "one it held")
            elif chunk_checksum(target) != checksum:
                raise self._refuse(sock, seal, IntegrityError if kind == WHOLE else _BadDelta,
                                   f"{where} differs from the trainer's checksum; the version "
                                   "is refused and this host keeps the one it held")
            packed.checksums[index] = checksum
            packed.mark_ready(index + 1)
        return kinds

    def _digests(self, trainers: Future[list[str]], version: int, count: int,
                 deadline: Deadline) -> list[str]:
        """The trainer's digests of ``version``, once they came (within ``deadline``)."""
        try:
            digests = trainers.result(timeout=deadline.remaining())
        except TimeoutError:
            raise DeadlinePassed(f"the trainer's digests of version {version} did not come "
                                 f"within {deadline}") from None
        if len(digests) != count:
            raise IntegrityError(f"host {self.name}: version {version} has {count} chunks, but "
                                 f"the trainer's digests name {len(digests)}")
        return digests

    def _buffer(self, nbytes: int, version: int, reuse: bool = True) -> torch.Tensor:
        """Where version ``version`` is rebuilt: the buffer of the base before last when it
        fits and ``reuse`` (no page faults of fresh memory), a new one otherwise."""
        spare, self._spare = self._spare, None
        if reuse and spare is not None and spare.numel() == nbytes and self._allocate is None:
            return spare
        try:
            if self._allocate is not None:
                return self._allocate(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8)
        except (RuntimeError, OSError) as exc:
            raise WeightSyncError(f"host {self.name}: cannot allocate {nbytes} bytes for "
                                  f"version {version}: {exc}") from None

    @staticmethod
    def _refuse(sock: socket.socket, seal: Seal, error: type[IntegrityError],
                message: str) -> IntegrityError:
        """Tell the trainer why the version is refused (best effort), and the error to raise."""
        with contextlib.suppress(OSError):
            send_frame(sock, {"error": message[:1000]}, seal)
        return error(message)
