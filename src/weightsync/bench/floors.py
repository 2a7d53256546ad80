"""What the machine itself costs, measured in the same run as the transports: one memcpy
(one device-to-device copy on a GPU; also split over several processes at once), one bare
Unix-socket transfer, one bare transfer through a page-mapping pipe, and one copy into
shared memory followed by one wake of the processes blocked on it until the last runs (the
least any tear-free publish to workers blocked in ``receive()`` can cost: the bytes are
written, then the workers woken)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch


def join_or_kill(procs: Sequence[Any], timeout: float) -> None:
    """Wait up to ``timeout`` for each process to end; kill those that do not."""
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)


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


def _split_copier(nbytes: int, repeats: int, barrier: Any, out: Any) -> None:
    """One process of :func:`split_copy_times`: copy its part at each barrier."""
    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # fault the pages in
    for _ in range(repeats):
        barrier.wait(60)
        t0 = time.monotonic()
        dst.copy_(src)
        out.put((t0, time.monotonic()))


def split_copy_times(nbytes: int, parts: int, repeats: int = 5) -> list[float]:
    """Seconds from the first start to the last end of ``parts`` processes each copying
    ``nbytes / parts`` at once (one thread each): the floor of ``parts`` trainer ranks that
    write one model together, which more processes only lower where the memory bus has
    room for them."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(parts)
    outs = [ctx.Queue() for _ in range(parts)]  # one each: a killed writer holds no one's lock
    procs = [ctx.Process(target=_split_copier, args=(nbytes // parts, repeats, barrier, q),
                         daemon=True) for q in outs]
    for p in procs:
        p.start()
    try:
        spans = [[q.get(timeout=120) for _ in range(repeats)] for q in outs]
    finally:
        join_or_kill(procs, 30)
    return [max(s[i][1] for s in spans) - min(s[i][0] for s in spans) for i in range(repeats)]


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


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname()[:2])
        theirs = listener.accept()[0]
    for end in (ours, theirs):
        end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ours, theirs


def socket_times(nbytes: int, repeats: int = 5, tcp: bool = False) -> list[float]:
    """Seconds of each move of ``nbytes`` from this process into another one's buffer over a
    bare Unix socket (no framing, no snapshot, no apply): MultiProcess's own floor here;
    ``tcp``: over TCP on loopback, the network scheme's floor on one host."""
    from weightsync.transports.local.channel import _SOCKET_BUFFER

    ours, theirs = _tcp_pair() if tcp else socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
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
        join_or_kill([reader], 30)
    return times[1:]  # the first transfer grows the socket buffers


def _pipe_reader(read_fd: int, ack_fd: int, nbytes: int, rounds: int) -> None:
    from weightsync.core.deadline import Deadline
    from weightsync.transports.mp.pipe import PipeReader

    pipe, buffer = PipeReader(read_fd), memoryview(bytearray(nbytes))
    for version in range(rounds):
        pipe.read_into(buffer, Deadline(60.0))
        pipe.read_commit(version, Deadline(60.0))
        os.write(ack_fd, b"k")


def pipe_times(nbytes: int, repeats: int = 5) -> list[float] | None:
    """Seconds of each move of ``nbytes`` into another process's buffer through a pipe that
    maps the sender's pages (``vmsplice``, then a trailer once drained): MultiProcess's
    data path for large versions, with no framing, snapshot or apply. None where such a
    pipe cannot be made here."""
    from weightsync.core.deadline import Deadline
    from weightsync.transports.mp.pipe import PipeWriter

    opened = PipeWriter.open()
    if opened is None:
        return None
    pipe, read_fd = opened
    ack_read, ack_write = os.pipe()
    reader = mp.get_context("fork").Process(
        target=_pipe_reader, args=(read_fd, ack_write, nbytes, repeats + 1), daemon=True)
    reader.start()
    os.close(read_fd)
    os.close(ack_write)
    payload = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    try:
        for version in range(repeats + 1):
            t0 = time.perf_counter()
            pipe.write(payload.data_ptr(), nbytes, Deadline(60.0))
            pipe.commit(version, Deadline(60.0))
            if os.read(ack_read, 1) != b"k":
                break
            times.append(time.perf_counter() - t0)
    finally:
        pipe.close()
        os.close(ack_read)
        join_or_kill([reader], 30)
    return times[1:] if len(times) == repeats + 1 else None


_STOP = 0  # word 0 of the wake floor's shared page: 1 tells the sleepers to leave
_RING = 1  # word 1: the futex the sleepers wait on; word 2 + i: when sleeper i woke


def _ring_in(page: mmap.mmap) -> Any:
    """The futex word ``_RING`` of ``page`` (None without futex support)."""
    from weightsync.transports.memory.futex import FutexWord

    anchor = ctypes.c_char.from_buffer(page)
    base = ctypes.addressof(anchor)
    del anchor  # only the address is kept: the page may be closed later
    return FutexWord.at(memoryview(page).cast("q"), _RING, base)


def _sleeper(page: mmap.mmap, index: int) -> None:
    words = memoryview(page).cast("d")
    ring = _ring_in(page)
    assert ring is not None
    while not words[_STOP]:
        seen = ring.value
        ring.wait(seen, 1.0)
        words[2 + index] = time.clock_gettime(time.CLOCK_MONOTONIC)


def wake_times(workers: int, repeats: int = 20, busy_s: float = 0.005,
               nbytes: int = 0) -> list[float] | None:
    """Seconds from the start of one copy of ``nbytes`` into shared memory, through one
    futex wake of ``workers`` processes blocked on it, until the last of them runs; the
    waker busy for ``busy_s`` before each (as the bench's trainer is). With ``nbytes`` 0
    only the wake is timed. None without futex."""
    page = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    words = memoryview(page).cast("d")
    ring = _ring_in(page)
    if ring is None:
        return None
    ctx = mp.get_context("fork")  # the sleepers need nothing but this page
    sleepers = [ctx.Process(target=_sleeper, args=(page, i), daemon=True) for i in range(workers)]
    for p in sleepers:
        p.start()
    shared = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    dst = torch.frombuffer(shared, dtype=torch.uint8, count=nbytes) if nbytes else None
    src = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    try:
        time.sleep(0.2)  # every sleeper is asleep
        for _ in range(repeats + 1):
            end = time.perf_counter() + busy_s
            while time.perf_counter() < end:
                pass
            t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
            if dst is not None:
                dst.copy_(src)
            ring.raise_and_wake()
            deadline = time.monotonic() + 5.0
            while (min(words[2 + i] for i in range(workers)) < t0
                   and time.monotonic() < deadline):
                time.sleep(0.0001)
            times.append(max(words[2 + i] for i in range(workers)) - t0)
    finally:
        words[_STOP] = 1
        ring.raise_and_wake()
        join_or_kill(sleepers, 5)
        del ring, dst  # their views of the pages, then ours: the pages can then be unmapped
        words.release()
        for mapping in (page, shared):
            with contextlib.suppress(BufferError):
                mapping.close()
    return times[1:]  # the first round faults the pages in
