"""The rank board of a sharded trainer whose ranks run on several hosts: the rank hub and
links (:mod:`weightsync.transports.ranks.socket_board`, the rank protocol's board as socket
messages) over TCP instead of a Unix socket. The ranks prove the rank key both ways, as on
one host; without a shared kernel there are no peer credentials, so a rank is admitted by
that proof alone, and a lost rank is told by its connection (a stalled one by the
deadline)."""

from __future__ import annotations

import socket

from weightsync.core.deadline import Deadline
from weightsync.transports.local.accept import accept_ready
from weightsync.transports.local.channel import Channel, ChannelTimeout
from weightsync.transports.net.wire import connect_when_listening, split_address


def _tcp(sock: socket.socket) -> Channel:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Channel(sock)


class TcpRankListener:
    """Rank 0's listener for the other ranks at ``address`` (``HOST:PORT``)."""

    def __init__(self, address: str) -> None:
        host, port = split_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=64)
        self.address = address

    def accept(self, timeout: float | None = 0.0) -> Channel | None:
        """A new connection within ``timeout``, or None; ``ListenerClosed`` (an OSError)
        once closed, accept()'s OSError otherwise (the rank hub's accept loop retries it)."""
        taken = accept_ready(self._sock, timeout)
        if taken is None:
            return None
        conn = taken[0]
        try:
            return _tcp(conn)
        except OSError:
            conn.close()
            raise

    def close(self) -> None:
        self._sock.close()


def connect_tcp(address: str, timeout: float | None) -> Channel:
    """A channel to rank 0's listener at ``address``, retrying while it is not up yet;
    ``ChannelTimeout`` after ``timeout``."""
    try:
        return Channel(connect_when_listening(address, Deadline(timeout)))
    except TimeoutError as exc:
        raise ChannelTimeout(f"no rank 0 listening at {address}: {exc}") from exc
