"""Listeners that a connection flood cannot kill: the trainer's listener for hosts and rank
0's TCP rank board go on accepting after ``accept()`` fails (EMFILE under a low open-file
limit, or any other error), cap the connections in their handshake, and give each
handshake one deadline, so peers that drip a byte at a time lose their threads when it
passes, and a real host or rank still gets in."""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing as mp
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flood_listeners
import pytest
import torch

from weightsync.core.deadline import Deadline
from weightsync.transports.local import accept as accept_module
from weightsync.transports.local.accept import MAX_PENDING_HANDSHAKES, AcceptLoop, ListenerClosed
from weightsync.transports.net.board import TcpRankListener, connect_tcp
from weightsync.transports.net.fetch import VersionFetcher
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.packed import pack
from weightsync.transports.net.publisher import VersionPublisher
from weightsync.transports.ranks import socket_board
from weightsync.transports.ranks.socket_board import RankHub, RankLink

pytest.importorskip("zstandard")

KINDS = ["publisher", "board"]
#: the threads that run one connection's handshake, by listener
HANDSHAKE_THREADS = {"publisher": "weightsync-net-stream", "board": "weightsync-rank-handshake"}


def _real_peer(kind: str, address: str, key: str, timeout: float) -> None:
    """A real host fetches the current version (``kind="publisher"``), or rank 1 joins the
    rank board (``"board"``), within ``timeout``; raises otherwise."""
    if kind == "publisher":
        credential = host_credential(key, "host-b")
        got = VersionFetcher("host-b").fetch(address, credential, None, timeout).tensors()
        for name, tensor in flood_listeners.weights().items():
            assert torch.equal(got[name], tensor), name
        return
    link = RankLink(address, key, None, 1, connect=lambda left: connect_tcp(address, left))
    try:
        link.open(Deadline(timeout))
        assert link.channel is not None
    finally:
        link.close()


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------- accept floods
@pytest.mark.parametrize("kind", KINDS)
def test_a_listener_survives_an_accept_flood_under_a_low_open_file_limit(kind: str,
                                                                         tmp_path: Path):
    """The listener's process may open only a few more files: a flood of connections makes
    accept() fail with EMFILE. It says so in its log and goes on; once the flood ends, a
    real host (or rank) gets in within its deadline. (Before, the accept loop returned on
    the first error without a word, and every later peer waited in the backlog.)"""
    key, log = secrets.token_hex(16), tmp_path / "listener.log"
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=flood_listeners.listener_main, args=(kind, key, str(log), theirs),
                        daemon=True)
    child.start()
    flood: list[socket.socket] = []
    try:
        assert ours.poll(60), "the listener's process did not start"
        address = ours.recv()
        _real_peer(kind, address, key, 10.0)  # warm: what the handshake imports is loaded
        ours.send("lower the limit")
        assert ours.poll(10) and ours.recv() == "low"
        host, _, port = address.rpartition(":")
        for _ in range(6 * flood_listeners.HEADROOM):
            flood.append(socket.create_connection((host, int(port)), timeout=5))
        _wait_for(lambda: "EMFILE" in log.read_text(), 5.0)  # on to the checks either way
        for sock in flood:
            sock.close()
        started = time.monotonic()
        _real_peer(kind, address, key, 5.0)
        assert time.monotonic() - started < 5.0
        text = log.read_text()
        assert "accept() failed (EMFILE" in text and "open-file limit" in text, text
    finally:
        for sock in flood:
            sock.close()
        ours.close()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)


# ---------------------------------------------------------------------- dripping peers
@contextlib.contextmanager
def _listener(kind: str, key: str, handshake_timeout: float,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, bytes]]:
    """A listener of ``kind`` whose handshakes get ``handshake_timeout``; yields its address
    and the first bytes of a handshake frame it reads (a frame of 200 header bytes)."""
    if kind == "publisher":
        publisher = VersionPublisher("127.0.0.1:0", key, timeout=handshake_timeout, delta=False)
        publisher.publish(pack(flood_listeners.weights(), 0))
        try:
            yield publisher.address, struct.pack("!I", 200)
        finally:
            publisher.close()
        return
    monkeypatch.setattr(socket_board, "HANDSHAKE_TIMEOUT", handshake_timeout)
    address = f"127.0.0.1:{flood_listeners._free_port()}"
    hub = RankHub(address, key, None, 2, listener=TcpRankListener(address))
    hub.start()
    try:
        yield address, struct.pack("!IQ", 200, 0)
    finally:
        hub.close()


def _handshake_threads(kind: str) -> int:
    return sum(t.name == HANDSHAKE_THREADS[kind] for t in threading.enumerate())


@pytest.mark.parametrize("kind", KINDS)
def test_dripping_peers_lose_their_threads_at_the_handshake_deadline(
        kind: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """More peers than the cap each drip a byte of their first frame every 0.2 s, which
    no per-read timeout ends: at most the cap of them get a thread (the rest are closed at
    once), every one is dropped when the handshake's one deadline (2 s) passes although it
    goes on dripping, and a real host (or rank) then gets in."""
    caplog.set_level(logging.WARNING)
    key, deadline = secrets.token_hex(16), 2.0
    most, sampling = [0], threading.Event()

    def sample() -> None:  # the most handshake threads alive at once
        end = time.monotonic() + 20
        while not sampling.wait(0.02) and time.monotonic() < end:
            most[0] = max(most[0], _handshake_threads(kind))

    with _listener(kind, key, deadline, monkeypatch) as (address, prefix):
        host, _, port = address.rpartition(":")
        drippers: list[socket.socket] = []
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            for _ in range(MAX_PENDING_HANDSHAKES + 6):
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(prefix)
                drippers.append(sock)
                time.sleep(0.005)  # the listener keeps up: no connection waits in its backlog
            started, live = time.monotonic(), set(drippers)
            while time.monotonic() - started < deadline + 1.5:  # the deadline, and a margin
                for sock in list(live):
                    try:
                        sock.send(b" ")
                    except OSError:
                        live.discard(sock)  # dropped by the listener
                time.sleep(0.2)
            sampling.set()
            sampler.join(5)
            assert 0 < most[0] <= MAX_PENDING_HANDSHAKES, most[0]
            assert _handshake_threads(kind) == 0, "dripping peers kept their threads"
            _real_peer(kind, address, key, 5.0)
        finally:
            sampling.set()
            for sock in drippers:
                sock.close()
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert f"{MAX_PENDING_HANDSHAKES} connections are already in their handshake" in said, said


# ---------------------------------------------------------------------- the loop itself
def test_accept_errors_are_retried_with_a_backoff_and_logged_once(
        caplog: pytest.LogCaptureFixture):
    """Failing accept() calls (EMFILE four times, then an error of another kind) are
    retried after a growing pause, never in a busy loop, and said once in the log (the
    rest counted); the connection after them is served; only a closed listener ends the
    loop."""
    caplog.set_level(logging.WARNING, logger=accept_module.__name__)
    mine, peer = socket.socketpair()
    calls: list[float] = []
    served = threading.Event()

    def accept(timeout: float) -> socket.socket | None:
        calls.append(time.monotonic())
        if len(calls) <= 4:
            raise OSError(errno.EMFILE, "Too many open files")
        if len(calls) == 5:
            raise OSError(errno.ECONNABORTED, "Software caused connection abort")
        if len(calls) == 6:
            return mine
        if len(calls) == 7:
            raise ListenerClosed("closed")
        raise AssertionError("accept() called after the listener closed")

    def serve(sock: socket.socket, admission: Any) -> None:
        admission.done()
        served.set()

    loop: AcceptLoop[socket.socket] = AcceptLoop(accept, serve, socket_of=lambda s: s,
                                                 what="the test's listener")
    loop.start()
    try:
        assert served.wait(5)
        assert _wait_for(lambda: not loop.running, 5), "a closed listener ends it"
        # pauses of 0.01, 0.02, 0.04, 0.08 and 0.16 s between the failed calls
        assert calls[5] - calls[0] >= 0.25, [round(c - calls[0], 3) for c in calls]
        failed = [r.getMessage() for r in caplog.records if "accept() failed" in r.getMessage()]
        assert len(failed) == 1 and "EMFILE" in failed[0], failed
        assert loop.pending == 0
    finally:
        loop.stop(2)
        mine.close()
        peer.close()
