"""What the machine itself costs, measured in the same run as the transports: one memcpy
(one device-to-device copy on a GPU) and one bare Unix-socket transfer."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any

import torch


def copy_times(nbytes: int, repeats: int = 5, device: str = "cpu") -> list[float]:
    """Seconds of each copy of ``nbytes`` between two warm buffers on ``device``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    cuda = dst.is_cuda
    times = []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(dst.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(dst.device)
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first copy faults the pages in


def memcpy_floor(nbytes: int, repeats: int = 5, device: str = "cpu") -> float:
    """Median seconds of one copy of ``nbytes`` (memcpy, or a device-to-device copy)."""
    return statistics.median(copy_times(nbytes, repeats, device))


def _socket_reader(sock: Any, nbytes: int, rounds: int) -> None:
    buffer = memoryview(bytearray(nbytes))
    for _ in range(rounds):
        view = buffer
        while len(view):
            n = sock.recv_into(view)
            if n == 0:
                return
            view = view[n:]
        sock.sendall(b"k")


def socket_times(nbytes: int, repeats: int = 5) -> list[float]:
    """Seconds of each move of ``nbytes`` from this process into another one's buffer over a
    bare Unix socket (no framing, no snapshot, no apply): MultiProcess's own floor here."""
    from weightsync.transports.local_channel import _SOCKET_BUFFER

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (ours, theirs):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                end.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
    reader = mp.get_context("fork").Process(
        target=_socket_reader, args=(theirs, nbytes, repeats + 1), daemon=True)
    reader.start()
    payload = memoryview(bytearray(b"\1" * nbytes))
    times = []
    try:
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            ours.sendall(payload)
            ours.recv(1)
            times.append(time.perf_counter() - t0)
    finally:
        ours.close()
        theirs.close()
        reader.join(30)
        if reader.is_alive():
            reader.kill()
            reader.join(5)
    return times[1:]  # the first transfer grows the socket buffers
