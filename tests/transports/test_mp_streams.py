"""The MultiProcess sender's snapshot pool and streamers (``transports/mp/streams.py``):
the sender may close while a streamer is still in a transfer (its ``stop`` waits 1 s for
the thread, then the pool is cleared); the streamer ends later and releases its snapshot,
which must not kill its thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import torch

from weightsync.core.deadline import Deadline
from weightsync.core.layout import Layout
from weightsync.transports.local.channel import Channel
from weightsync.transports.mp.streams import SnapshotPool, Streamer


def test_a_streamer_that_outlives_the_senders_close_releases_its_snapshot(monkeypatch):
    """Worker 0 stops reading mid-transfer; the sender closes (the streamer's ``stop`` gives
    up waiting, the pool is cleared), then the worker's socket goes: the transfer fails and
    the streamer releases its snapshot into the cleared pool. Its thread ends quietly."""
    died: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    flat = {"w": torch.ones(12 << 20, dtype=torch.uint8)}  # more than the socket buffers
    # hold, less than takes a page-mapping pipe
    layout = Layout.from_weights(flat)
    pool = SnapshotPool(layout, 2)
    snapshot = pool.fill(flat, 0, Deadline(10))
    ours, theirs = socket.socketpair()
    failures: list[str] = []
    streamer = Streamer(0, Channel(ours), pool, 30.0, lambda w, c, why: failures.append(why))
    try:
        streamer.offer(0, Deadline(30))
        deadline = time.monotonic() + 10  # the layout goes, then the version's bytes fill
        while not pool._readers and time.monotonic() < deadline:  # the buffers and block
            time.sleep(0.01)
        time.sleep(0.2)
        assert pool._readers == {id(snapshot): 1}
        streamer.stop()  # as the sender's close: waits 1 s for the thread, still writing,
        assert streamer._thread.is_alive() and pool._readers == {id(snapshot): 1}
        pool.clear()  # then the pool goes
        theirs.close()  # the worker goes: the transfer fails, the streamer lets go
        streamer._thread.join(10)
        assert not streamer._thread.is_alive()
    finally:
        theirs.close()
        ours.close()
    assert died == [], [f"{d.exc_type.__name__}: {d.exc_value}" for d in died]
    assert failures == []  # a stopped streamer reports nothing
    assert pool._readers == {}


def test_a_snapshot_is_reused_once_its_last_reader_lets_go():
    flat = {"w": torch.arange(16, dtype=torch.float32)}
    pool = SnapshotPool(Layout.from_weights(flat), 2)
    first = pool.fill(flat, 0, Deadline(10))
    assert pool.acquire_latest() is first and pool.acquire_latest() is first
    second = pool.fill(flat, 1, Deadline(10))
    assert second is not first
    pool.release(first)
    with pytest.raises(Exception, match="no free snapshot"):  # one reader left on the first
        pool.fill(flat, 2, Deadline(0.1))
    pool.release(first)
    assert pool.fill(flat, 2, Deadline(10)) is first
