"""A process on the path between a host and the trainer, holding no token: it forwards
the handshake untouched, then hands the trainer's chunks of the first version to a
``tamper`` function before forwarding them (or slows every byte to ``rate`` bytes/s).
The tests of the network transport use it as the attacker (or the slow link)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

from weightsync.transports.net.seal import TAG_BYTES
from weightsync.transports.net.wire import CHUNK_BYTES, CHUNK_HEADER

#: one chunk as it crosses the wire: its header (kind, size, checksum), its MAC, its payload
Chunk = tuple[bytes, bytes, bytes]
Tamper = Callable[[list[Chunk]], list[Chunk]]


def _read(sock: socket.socket, nbytes: int) -> bytes:
    out = bytearray()
    while len(out) < nbytes:
        data = sock.recv(nbytes - len(out))
        if not data:
            raise ConnectionError("closed")
        out += data
    return bytes(out)


def _frame(sock: socket.socket, sealed: bool) -> bytes:
    head = _read(sock, 4)
    (length,) = struct.unpack("!I", head)
    return head + _read(sock, length + (TAG_BYTES if sealed else 0))


class Relay:
    """Listens on loopback; each connection is relayed to ``target`` (``HOST:PORT``)."""

    def __init__(self, target: str, tamper: Tamper | None = None, rate: float | None = None) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.tamper, self.rate = tamper, rate
        self.tampered = 0  # versions the tamper function saw
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                host_side, _ = self._server.accept()
            except OSError:
                return
            trainer_side = socket.create_connection(self.target, timeout=30)
            host_side.settimeout(30)
            self._sockets += [host_side, trainer_side]
            threading.Thread(target=self._pipe, args=(host_side, trainer_side), daemon=True).start()
            threading.Thread(target=self._down, args=(trainer_side, host_side), daemon=True).start()

    def _send(self, sock: socket.socket, data: bytes) -> None:
        if self.rate is None:
            sock.sendall(data)
            return
        step = max(int(self.rate / 20), 1)
        for at in range(0, len(data), step):
            sock.sendall(data[at:at + step])
            time.sleep(step / self.rate)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                self._send(dst, data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _down(self, trainer: socket.socket, host: socket.socket) -> None:
        """Trainer to host: the handshake's two frames, the version header, its chunks
        (through ``tamper``), then whatever follows, as is."""
        if self.tamper is None:
            self._pipe(trainer, host)
            return
        with contextlib.suppress(OSError, ConnectionError):
            for _ in range(2):  # the trainer's nonce and proof, before the seal
                self._send(host, _frame(trainer, sealed=False))
            header = _frame(trainer, sealed=True)
            self._send(host, header)
            nbytes = json.loads(header[4:-TAG_BYTES])["nbytes"]
            chunks: list[Chunk] = []
            for _ in range((nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES):
                head = _read(trainer, CHUNK_HEADER.size)
                tag = _read(trainer, TAG_BYTES)
                _, size, _ = CHUNK_HEADER.unpack(head)
                chunks.append((head, tag, _read(trainer, size)))
            self.tampered += 1
            for head, tag, payload in self.tamper(chunks):
                self._send(host, head + tag + payload)
        self._pipe(trainer, host)
