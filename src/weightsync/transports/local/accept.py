"""An accept loop that a connection flood cannot kill, shared by every socket listener:
the trainer's hub for same-host workers (:mod:`weightsync.transports.local.hub`), Ray's
node-local fd server (:mod:`weightsync.transports.ray.node_local`), the trainer's listener
for hosts (:mod:`weightsync.transports.net.publisher`) and a sharded trainer's rank
board (:mod:`weightsync.transports.ranks.socket_board`, over its Unix socket or TCP). It lives in the
local family, the base of the socket transports, so that no family imports another for it.

* A failed ``accept()`` (``EMFILE``/``ENFILE`` when the open-file limit is reached,
  ``ENOBUFS``, ``ENOMEM``, ``ECONNABORTED``, anything else) is logged, rate-limited, and
  retried after a short backoff: only stopping the loop (its owner closing) ends it.
* At most ``max_pending`` connections are in their handshake at once; a connection beyond
  that is closed at once (logged), so a flood cannot take a thread and a file per socket.
* Each handshake has one deadline for the whole exchange (an :class:`Admission`): a peer
  that drips a byte at a time is shut out when it passes, whatever its reads do.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from weightsync.core.deadline import Deadline

logger = logging.getLogger(__name__)

#: connections that may be in their handshake at once; more are closed at once
MAX_PENDING_HANDSHAKES = 64
#: the longest a network peer gets for its whole handshake (a few round trips of small frames)
HANDSHAKE_TIMEOUT = 10.0
#: how often the loop looks at its stop flag and at the handshakes' deadlines (seconds)
_POLL = 0.2
#: the first and the longest pause after a failed accept() (doubling in between)
_BACKOFF_FIRST, _BACKOFF_MOST = 0.01, 0.5
#: a recurring warning is logged at most once per this many seconds
LOG_INTERVAL = 10.0

C = TypeVar("C")


class ListenerClosed(OSError):
    """The listening socket was closed: the accept loop ends."""


class RateLimitedLog:
    """A recurring warning, logged at most once per ``interval`` seconds, saying how many
    like it were left out meanwhile (a flood must not flood the log too)."""

    def __init__(self, interval: float = LOG_INTERVAL) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._skipped = 0

    def warning(self, message: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._skipped += 1
                return
            skipped, self._skipped, self._last = self._skipped, 0, now
        if skipped:
            message += f" ({skipped} more like it in the last {self.interval:g} s)"
        logger.warning(message, *args)


def describe(exc: BaseException) -> str:
    """An accept error in words a user can act on (the errno's name and what to do)."""
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
    text = f"{name}: {exc}" if name else f"{type(exc).__name__}: {exc}"
    if code in (errno.EMFILE, errno.ENFILE):
        text += " (the open-file limit is reached: raise `ulimit -n`, or a flood of connections " \
                "holds the files)"
    elif code in (errno.ENOBUFS, errno.ENOMEM):
        text += " (the kernel is short of memory for sockets)"
    return text


def peer_name(sock: socket.socket) -> str:
    """``HOST:PORT`` of a connected socket's peer (``?`` once it is gone)."""
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "a local socket"


def accept_ready(sock: socket.socket, timeout: float | None) -> tuple[socket.socket, str] | None:
    """A connection waiting at the listening socket ``sock`` within ``timeout`` seconds
    (None: however long it takes),
    with its peer's ``HOST:PORT``, or None. Raises :class:`ListenerClosed` once ``sock``
    is closed, and ``accept()``'s own ``OSError`` otherwise (``poll``, not ``select``: a
    trainer's listener may have a descriptor above 1023)."""
    fd = sock.fileno()
    if fd < 0:
        raise ListenerClosed("the listener is closed")
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
        return None
    conn, peer = sock.accept()
    return conn, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a local socket"


class Admission:
    """One accepted connection until it has proved itself: the one ``deadline`` of its
    whole handshake, after which the accept loop shuts it down. Its handler calls
    :meth:`done` once the peer is authenticated (or refused), freeing its place among the
    pending handshakes; the loop calls it too when the handler returns."""

    __slots__ = ("_loop", "cut", "deadline", "sock")

    def __init__(self, loop: AcceptLoop[Any], sock: socket.socket, deadline: Deadline) -> None:
        self._loop, self.sock, self.deadline = loop, sock, deadline
        self.cut = False  # shut down at its deadline

    def done(self) -> None:
        self._loop._finish(self)

    def refused(self, message: str, *args: object) -> None:
        """Log why the peer was refused (rate-limited with every other refusal)."""
        self._loop.refusals.warning(message, *args)


class AcceptLoop(Generic[C]):
    """Accepts connections with ``accept(timeout) -> C | None`` on a thread of its own and
    runs ``serve(connection, admission)`` for each on a thread of its own, until
    :meth:`stop`. ``socket_of`` gives a connection's socket (closed when over the cap, shut
    down at its handshake's deadline); ``what`` names the listener in log lines."""

    def __init__(self, accept: Callable[[float], C | None],
                 serve: Callable[[C, Admission], None], *,
                 socket_of: Callable[[C], socket.socket], what: str,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 max_pending: int = MAX_PENDING_HANDSHAKES,
                 name: str = "weightsync-listener",
                 connection_name: str = "weightsync-handshake") -> None:
        self._accept, self._serve, self._socket_of = accept, serve, socket_of
        self.what, self.handshake_timeout, self.max_pending = what, handshake_timeout, max_pending
        self._connection_name = connection_name
        self._lock = threading.Lock()
        self._pending: set[Admission] = set()
        self._stopped = threading.Event()
        self._accept_errors = RateLimitedLog()
        self._over_cap = RateLimitedLog()
        self._expired = RateLimitedLog()
        self.refusals = RateLimitedLog()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the loop still accepts (until :meth:`stop`, or its listener closed)."""
        return self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Connections in their handshake now."""
        with self._lock:
            return len(self._pending)

    def stop(self, timeout: float = 5.0, wake: Callable[[], None] | None = None) -> None:
        """End the loop (within ``timeout``; ``wake``, e.g. shutting the listening socket
        down, ends its wait at once) and shut down the connections still in their handshake.
        The owner closes its listening socket after this (the loop may poll it until then)."""
        self._stopped.set()
        if wake is not None:
            with contextlib.suppress(OSError):
                wake()
        with self._lock:
            for admission in self._pending:
                _shutdown(admission.sock)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        delay = _BACKOFF_FIRST
        while not self._stopped.is_set():
            self._expire()
            try:
                connection = self._accept(_POLL)
            except ListenerClosed:
                return
            except Exception as exc:  # EMFILE, ENOBUFS, ECONNABORTED, ...: never the end
                if self._stopped.is_set() or getattr(exc, "errno", None) == errno.EBADF:
                    return  # closed under the loop
                self._accept_errors.warning(
                    "%s: accept() failed (%s); retrying with a backoff of up to %g s",
                    self.what, describe(exc), _BACKOFF_MOST)
                self._stopped.wait(delay)
                delay = min(2 * delay, _BACKOFF_MOST)
                continue
            delay = _BACKOFF_FIRST
            if connection is not None:
                self._take(connection)

    def _take(self, connection: C) -> None:
        sock = self._socket_of(connection)
        with self._lock:
            full = len(self._pending) >= self.max_pending
            if not full:
                admission = Admission(self, sock, Deadline(self.handshake_timeout))
                self._pending.add(admission)
        if full:
            self._over_cap.warning(
                "%s: closed a connection from %s at once: %d connections are already in "
                "their handshake (the most at once; a flood, or peers that do not finish "
                "their handshake within %g s?)", self.what, peer_name(sock), self.max_pending,
                self.handshake_timeout)
            _close(sock)
            return
        try:
            threading.Thread(target=self._serve_one, args=(connection, admission),
                             name=self._connection_name, daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: like a failed accept()
            self._finish(admission)
            _close(sock)
            self._accept_errors.warning("%s: dropped a connection: no thread for it (%s)",
                                        self.what, exc)
            self._stopped.wait(_BACKOFF_MOST)

    def _serve_one(self, connection: C, admission: Admission) -> None:
        try:
            self._serve(connection, admission)
        except Exception as exc:  # the handler's own errors are its to name; never a dead thread
            logger.warning("%s: a connection from %s failed: %s: %s", self.what,
                           peer_name(admission.sock), type(exc).__name__, exc)
            _close(admission.sock)
        finally:
            self._finish(admission)

    def _finish(self, admission: Admission) -> None:
        with self._lock:  # after this, the deadline no longer applies to it
            self._pending.discard(admission)

    def _expire(self) -> None:
        """Shut down the connections whose whole handshake outlived its deadline (their
        threads then fail their read or write and end)."""
        late = []
        with self._lock:
            for admission in self._pending:
                if not admission.cut and admission.deadline.expired():
                    admission.cut = True
                    late.append(peer_name(admission.sock))
                    _shutdown(admission.sock)
        for peer in late:
            self._expired.warning("%s: dropped the connection from %s: it did not finish its "
                                  "handshake within %g s", self.what, peer, self.handshake_timeout)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()

