"""The network path's reads (``transports/net/wire``): a long read wakes its thread once per
``WAKE_BYTES``, not at every segment (each wake-up takes the GIL that a vLLM worker's
engine thread needs), and still ends exactly, at a deadline, or at a closed peer."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from weightsync.core.deadline import Deadline
from weightsync.transports.net.wire import (
    WAKE_BYTES,
    DeadlinePassed,
    ProtocolError,
    recv_into_exact,
)

PIECE = 64 << 10


class CountingSocket(socket.socket):
    """A TCP socket that counts its reader's wake-ups (its ``recv_into`` calls)."""

    wakeups = 0

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self.wakeups += 1
        return super().recv_into(*args, **kwargs)


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, CountingSocket]]:
    """A loopback TCP connection: the writing end and the counting reading end."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        writer = socket.create_connection(listener.getsockname(), timeout=10)
        accepted, _ = listener.accept()
    reader = CountingSocket(fileno=accepted.detach())
    yield writer, reader
    writer.close()
    reader.close()


def _trickle(sock: socket.socket, data: bytes, pause: float, then_close: bool = False) -> None:
    """Send ``data`` a piece at a time, each one a separate arrival at the reader."""
    for start in range(0, len(data), PIECE):
        sock.sendall(data[start:start + PIECE])
        time.sleep(pause)
    if then_close:
        sock.close()


def _low_water(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def test_a_long_read_wakes_once_per_wake_bytes_and_arrives_whole(connection):
    writer, reader = connection
    data = bytes(range(256)) * (4 * WAKE_BYTES // 256 + 100)  # 4 MiB and 25,600 bytes
    sender = threading.Thread(target=_trickle, args=(writer, data, 0.002), daemon=True)
    sender.start()
    out = bytearray(len(data))
    recv_into_exact(reader, memoryview(out), Deadline(30))
    sender.join(10)
    assert out == data
    # 65 pieces arrived one by one; the read woke for each MiB and for the last bytes
    assert reader.wakeups <= 8, f"{reader.wakeups} wake-ups for {len(data) // PIECE + 1} pieces"
    assert _low_water(reader) == 1  # frames and headers after it wake as they come


def test_a_short_read_wakes_as_its_bytes_come(connection):
    writer, reader = connection
    writer.sendall(b"x" * 100)
    out = bytearray(100)
    recv_into_exact(reader, memoryview(out), Deadline(10))
    assert out == b"x" * 100 and reader.wakeups == 1 and _low_water(reader) == 1


def test_a_stalled_peer_still_meets_the_deadline(connection):
    writer, reader = connection
    writer.sendall(b"y" * PIECE)  # then nothing: fewer bytes than a wake-up asks for
    started = time.monotonic()
    with pytest.raises(DeadlinePassed, match=f"{PIECE} of {4 * WAKE_BYTES} bytes"):
        recv_into_exact(reader, memoryview(bytearray(4 * WAKE_BYTES)), Deadline(0.5))
    assert time.monotonic() - started < 5
    assert _low_water(reader) == 1


def test_a_peer_that_closes_mid_read_is_a_protocol_error(connection):
    writer, reader = connection
    sender = threading.Thread(target=_trickle, args=(writer, b"z" * (2 * PIECE), 0.01, True),
                              daemon=True)
    sender.start()
    with pytest.raises(ProtocolError, match=f"after {2 * PIECE} of {4 * WAKE_BYTES} bytes"):
        recv_into_exact(reader, memoryview(bytearray(4 * WAKE_BYTES)), Deadline(10))
    sender.join(10)
    assert _low_water(reader) == 1


def test_a_unix_socket_reads_as_before():
    writer, reader = socket.socketpair()
    with writer, reader:
        data = b"u" * (2 * WAKE_BYTES)
        sender = threading.Thread(target=writer.sendall, args=(data,), daemon=True)
        sender.start()
        out = bytearray(len(data))
        recv_into_exact(reader, memoryview(out), Deadline(10))
        sender.join(10)
        assert out == data
