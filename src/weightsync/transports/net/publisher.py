"""The trainer's end of the network transport: a listener that admits only hosts proving
their credential of the session's token, and streams each the version it asks for, chunk
by chunk (a delta against the version the host says it holds, when the trainer still has
that version and ``delta`` is on; the chunk itself otherwise, saying why), every frame and
chunk under the connection's MAC (:mod:`.seal`), then waits for the host's verdict."""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from weightsync.transports.delta.codec import KIND_NAMES, WHOLE, DeltaEncoder
from weightsync.transports.local.accept import (
    HANDSHAKE_TIMEOUT,
    AcceptLoop,
    Admission,
    accept_ready,
)
from weightsync.transports.net.handshake import HandshakeError, accept_peer
from weightsync.transports.net.packed import DIGEST, PackedVersion, chunk_count
from weightsync.transports.net.seal import Seal
from weightsync.transports.net.wire import (
    CHUNK_HEADER,
    CHUNK_POSITION,
    ProtocolError,
    join_address,
    recv_frame,
    send_frame,
    split_address,
    tensor_view,
)

logger = logging.getLogger(__name__)


@dataclass
class StreamFigures:
    """What one host received of one version."""

    host: str
    version: int
    wire_bytes: int = 0
    chunks: int = 0
    delta_chunks: int = 0  # sent as a delta (an unchanged chunk counts, at 0 bytes)
    seconds: float = 0.0
    error: str | None = None
    #: why the version went whole to this host (None: as deltas, or delta is off)
    whole_reason: str | None = None
    #: the id whose credential the host proved (e.g. ``server0``)
    peer_id: str = ""
    #: where the host got the version: ``"trainer"`` (this stream), or the address of the
    #: relay it fetched it from (a host's report: nothing of it crossed this link)
    source: str = "trainer"


#: what the listener hands a connection whose request is ``{"join": ...}`` (a worker's
#: control connection, ``net.members``): the socket, its seal, the peer's name and the
#: request; it runs on the connection's thread until the worker leaves
JoinHandler = Callable[[socket.socket, Seal, str, dict[str, Any]], None]


class VersionPublisher:
    """Listens at ``address`` (``HOST:PORT``; port 0 picks one) and serves the current
    version to every host that proves its credential of ``token``
    (:func:`~.handshake.host_credential`: the token itself never leaves the trainer).
    ``on_join``: where workers' control connections go (None: they are refused). A host
    that relays versions (:mod:`.relay`) serves them under the trainer's ``session`` (its
    deltas are against the same bases) and ``awaits`` a version it has not begun to
    receive for up to that many seconds, rather than refusing it; it keeps no retired
    buffer for reuse."""

    def __init__(self, address: str, token: str, *, timeout: float, delta: bool,
                 on_join: JoinHandler | None = None, session: str | None = None,
                 awaits: float = 0.0) -> None:
        host, port = split_address(address)
        self.token = token
        self.timeout = timeout
        self.delta = delta
        self._on_join = on_join
        self.session = session or secrets.token_hex(8)
        self._awaits = awaits
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        bound = self._listener.getsockname()[1]
        self.address = join_address(host, bound)
        self._cond = threading.Condition()
        self._current: PackedVersion | None = None
        self._previous: PackedVersion | None = None
        self._retired: PackedVersion | None = None
        self._reading: dict[int, int] = {}  # id(version) -> streams reading it
        self._figures: dict[int, list[StreamFigures]] = {}
        self._streaming: dict[int, int] = {}  # version -> streams begun and not yet recorded
        self._connections: set[socket.socket] = set()
        #: where each host's relay listens, by the id it proved (it says so when it asks)
        self._relays: dict[str, str] = {}
        self._closed = False
        self._acceptor = AcceptLoop(
            lambda timeout: accept_ready(self._listener, timeout), self._accept,
            socket_of=lambda taken: taken[0], what=f"the trainer's listener at {self.address}",
            handshake_timeout=min(timeout, HANDSHAKE_TIMEOUT), name="weightsync-net-listener",
            connection_name="weightsync-net-stream")
        self._acceptor.start()
        logger.info("listening for weightsync hosts at %s", self.address)

    # ------------------------------------------------------------------ the trainer's calls
    def publish(self, packed: PackedVersion) -> None:
        """Make ``packed`` the version hosts get (it may still be filling: streams wait for
        each chunk); the one before stays as a delta base."""
        with self._cond:
            if self._current is not None and self._current.version == packed.version:
                # the same number again (a sharded attempt that failed before any host took
                # it): the base before it stays the delta base
                replaced, self._current = self._current, packed
                if replaced.buffer is not packed.buffer and not self._awaits:
                    self._retired = replaced
                self._figures[packed.version] = []
                self._cond.notify_all()
                return
            retired = self._previous
            self._previous, self._current = self._current, packed
            if retired is not None and retired.buffer is not packed.buffer and not self._awaits:
                self._retired = retired  # a relay keeps none: its buffers are its host's staging
            self._figures[packed.version] = []
            for old in [v for v in self._figures if v < packed.version - 8]:
                del self._figures[old]
            self._cond.notify_all()

    def spare_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A retired version's buffer of ``nbytes`` that no stream reads any more (reusing
        it spares the page faults of fresh memory), or None."""
        with self._cond:
            retired = self._retired
            if retired is None or retired.nbytes != nbytes or self._reading.get(id(retired), 0):
                return None
            self._retired = None
            return retired.buffer

    def figures(self, version: int, settle: float = 0.0) -> list[StreamFigures]:
        """The figures of the streams of ``version`` that ended; with ``settle``, first wait
        up to that long for the streams of it still under way to end (a host sends its
        verdict before it loads: the trainer can hear of the load before this thread has
        read the verdict)."""
        end = time.monotonic() + settle
        with self._cond:
            while self._streaming.get(version, 0):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self._figures.get(version, []))

    def wait_streams(self, version: int, count: int, timeout: float) -> list[StreamFigures]:
        """The figures of ``version`` once ``count`` streams of it ended (or ``timeout``)."""
        end = time.monotonic() + timeout
        with self._cond:
            while len(self._figures.get(version, [])) < count:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self._figures.get(version, []))

    def streams_ended(self, version: int, peer_id: str) -> int:
        """How many streams of ``version`` to ``peer_id``'s host have ended so far."""
        with self._cond:
            return sum(1 for f in self._figures.get(version, []) if f.peer_id == peer_id)

    def wait_stream(self, version: int, peer_id: str, timeout: float, after: int = 0
                    ) -> StreamFigures | None:
        """The figures of the next stream of ``version`` to the host that proved
        ``peer_id``'s credential to end after the first ``after`` (its verdict in: staged,
        or why not); None if none ended within ``timeout``."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                ended = [f for f in self._figures.get(version, []) if f.peer_id == peer_id]
                if len(ended) > after:
                    return ended[after]
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            connections = list(self._connections)
            self._cond.notify_all()  # a relay's stream awaiting a version ends now
        self._acceptor.stop(timeout=5, wake=lambda: self._listener.shutdown(socket.SHUT_RDWR))
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # ------------------------------------------------------------------ serving hosts
    def _accept(self, taken: tuple[socket.socket, str], admission: Admission) -> None:
        """A connection the accept loop (``local.accept``) took, on a thread of its own."""
        conn, peer = taken
        with self._cond:
            if self._closed:
                conn.close()
                return
            self._connections.add(conn)
        self._serve(conn, peer, admission)

    def _serve(self, conn: socket.socket, peer: str, admission: Admission) -> None:
        figures: StreamFigures | None = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                name, seal = accept_peer(conn, self.token, admission.deadline)
                host = f"{name} at {peer}"
            except (HandshakeError, ProtocolError, OSError) as exc:
                admission.refused("refused a connection from %s: %s", peer, exc)
                return
            admission.done()  # authenticated: no longer among the pending handshakes
            conn.settimeout(self.timeout)
            request = recv_frame(conn, seal=seal, what=f"the request of host {host}")
            if "join" in request:
                if self._on_join is None:
                    send_frame(conn, {"error": "this trainer takes no workers' connections"}, seal)
                    return
                conn.settimeout(None)  # a control connection lives as long as its worker
                self._on_join(conn, seal, host, request)
                return
            peer_id = name.split(" ", 1)[0]
            self._learn_relay(peer_id, request.get("relay"))
            if "digests" in request:
                self._send_digests(conn, seal, request.get("digests"))
                return
            if "report" in request:
                figures = self._report(host, peer_id, request)
                send_frame(conn, {"ok": True}, seal)
                return
            packed, base, whole = self._choose(request)
            if packed is None:
                with self._cond:
                    current = None if self._current is None else self._current.version
                send_frame(conn, {"error": f"the trainer has no version {request.get('want')} "
                                           f"(its current version is {current})"}, seal)
                return
            figures = StreamFigures(host, packed.version, whole_reason=whole, peer_id=peer_id)
            if whole is not None:
                logger.info("host %s gets version %d whole: %s", host, packed.version, whole)
            with self._cond:
                self._streaming[packed.version] = self._streaming.get(packed.version, 0) + 1
            started = time.perf_counter()
            held = [v for v in (packed, base) if v is not None]  # counted by _choose
            try:
                self._stream(conn, seal, packed, base, figures)
            finally:
                with self._cond:
                    for v in held:
                        self._reading[id(v)] -= 1
                        if not self._reading[id(v)]:
                            del self._reading[id(v)]
            verdict = recv_frame(conn, seal=seal, what=f"the verdict of host {host}")
            figures.seconds = time.perf_counter() - started
            if verdict.get("ok") != packed.version:
                figures.error = str(verdict.get("error", verdict))[:2000]
                logger.warning("host %s refused version %d: %s", host, packed.version, figures.error)
        except Exception as exc:  # a host that died or stalled: named in its figures
            logger.warning("stream to %s failed: %s", peer, exc)
            if figures is not None:
                figures.error = f"{type(exc).__name__}: {exc}"
        finally:
            with self._cond:
                self._connections.discard(conn)
                if figures is not None:
                    self._figures.setdefault(figures.version, []).append(figures)
                    left = self._streaming.pop(figures.version, 1) - 1
                    if left:
                        self._streaming[figures.version] = left
                self._cond.notify_all()
            conn.close()

    def relay_of(self, peer_id: str) -> str | None:
        """Where the host that proved ``peer_id``'s credential relays versions, if it said."""
        with self._cond:
            return self._relays.get(peer_id)

    def relay_names(self) -> dict[str, str]:
        """Each known relay's address -> the id its host proved (to name where a host
        fetched a version)."""
        with self._cond:
            return {address: peer_id for peer_id, address in self._relays.items()}

    def _learn_relay(self, peer_id: str, address: object) -> None:
        if isinstance(address, str) and len(address) <= 300:
            with contextlib.suppress(ValueError):
                split_address(address)
                with self._cond:
                    self._relays[peer_id] = address

    def _report(self, host: str, peer_id: str, request: dict[str, Any]) -> StreamFigures | None:
        """A host staged a version it fetched from a relay: its figures, as a stream's
        (none of its bytes crossed this link; recorded when the handler ends)."""
        version, source = request.get("report"), request.get("source")
        if type(version) is not int or not isinstance(source, str):
            return None
        with self._cond:
            self._streaming[version] = self._streaming.get(version, 0) + 1
        return StreamFigures(host, version, peer_id=peer_id, source=source[:300])

    def _send_digests(self, conn: socket.socket, seal: Seal, version: object) -> None:
        """A host's request for the digests of ``version``'s chunks (it fetches the version
        from another host, and checks each chunk against them): once it is packed."""
        with self._cond:
            found = [v for v in (self._current, self._previous)
                     if v is not None and v.version == version]
        if not found:
            send_frame(conn, {"error": f"the trainer has no version {version!r:.20} (its "
                                       "current and previous ones only)"}, seal)
            return
        send_frame(conn, {"digests": found[0].chunk_digests(self.timeout), "hash": DIGEST}, seal)

    def _choose(self, request: dict[str, Any]
                ) -> tuple[PackedVersion | None, PackedVersion | None, str | None]:
        """The version a host asked for (None: the current one), the base to encode it
        against (None: whole chunks) and, when ``delta`` is on and it goes whole, why."""
        want, base = request.get("want"), request.get("base")
        with self._cond:  # the versions chosen count as read until the stream ends
            if type(want) is int and self._awaits:  # a relay: the version may be on its way
                self._cond.wait_for(lambda: self._closed or (
                    self._current is not None and self._current.version >= want), self._awaits)
            current, previous = self._current, self._previous
            if current is None or (want is not None and want != current.version):
                return None, None, None
            chosen, why = None, None
            if self.delta:
                chosen, why = self._delta_base(current, previous, base)
                if chosen is None and isinstance(request.get("whole"), str):
                    why = f"the host asked for it whole: {request['whole'][:200]}"
            for v in (current, chosen):
                if v is not None:
                    self._reading[id(v)] = self._reading.get(id(v), 0) + 1
            return current, chosen, why

    def _delta_base(self, current: PackedVersion, previous: PackedVersion | None,
                    held: object) -> tuple[PackedVersion | None, str | None]:
        """The version a host's ``held`` base names, when this trainer still has it with
        the current layout; otherwise None and the reason it goes whole."""
        if not isinstance(held, dict):
            return None, "the host holds no version of this trainer's (a new or restarted host)"
        if held.get("session") != self.session:
            return None, f"the host holds a version of another trainer session ({held.get('session')!r:.40})"
        for candidate in (current, previous):
            if candidate is not None and candidate.version == held.get("version"):
                if candidate.fingerprint == current.fingerprint == held.get("fingerprint"):
                    return candidate, None
                return None, f"the layout changed since version {candidate.version}"
        return None, (f"the host holds version {held.get('version')!r:.20}, which the trainer no "
                      f"longer keeps (it keeps {current.version}"
                      f"{'' if previous is None else f' and {previous.version}'})")

    def _stream(self, conn: socket.socket, seal: Seal, packed: PackedVersion,
                base: PackedVersion | None, figures: StreamFigures) -> None:
        header = packed.header(self.session)
        header["base"] = None if base is None else base.version
        if figures.whole_reason is not None:
            header["whole"] = figures.whole_reason
        figures.wire_bytes += send_frame(conn, header, seal)
        count = chunk_count(packed.nbytes)
        if base is None:
            for index in range(count):
                packed.wait_chunk(index, self.timeout)  # the trainer packs as hosts stream
                self._send_chunk(conn, seal, packed, index, WHOLE, packed.chunk(index), figures)
            return
        encoder = DeltaEncoder()
        with ThreadPoolExecutor(1, thread_name_prefix="weightsync-net-encode") as pool:
            def encoded(i: int) -> tuple[int, torch.Tensor]:
                packed.wait_chunk(i, self.timeout)
                return encoder.encode(packed.chunk(i), base.chunk(i))

            def encode(i: int) -> Future[tuple[int, torch.Tensor]]:
                return pool.submit(encoded, i)
            ahead = encode(0) if count else None
            for index in range(count):
                assert ahead is not None
                kind, payload = ahead.result()
                ahead = encode(index + 1) if index + 1 < count else None
                self._send_chunk(conn, seal, packed, index, kind, payload, figures)

    @staticmethod
    def _send_chunk(conn: socket.socket, seal: Seal, packed: PackedVersion, index: int,
                    kind: int, payload: torch.Tensor, figures: StreamFigures) -> None:
        """Chunk ``index`` of ``packed`` as ``payload`` (the chunk, or its delta), under a
        MAC over its header, its position and the chunk's bytes as the host rebuilds them."""
        head = CHUNK_HEADER.pack(kind, payload.numel(), packed.checksums[index])
        tag = seal.sign(head, CHUNK_POSITION.pack(packed.version, index),
                        tensor_view(packed.chunk(index)))
        conn.sendall(head + tag)
        if payload.numel():
            conn.sendall(tensor_view(payload))
        figures.chunks += 1
        figures.wire_bytes += CHUNK_HEADER.size + len(tag) + payload.numel()
        if kind != WHOLE:
            figures.delta_chunks += 1
        logger.debug("chunk %d sent as %s (%d bytes)", figures.chunks - 1, KIND_NAMES[kind],
                     payload.numel())


def figures_dict(figures: StreamFigures) -> dict[str, Any]:
    return asdict(figures)
