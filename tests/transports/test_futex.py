"""The futex ring word: processes sleeping on shared memory, woken all at once."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from weightsync.transports.memory.futex import FutexWord, supported
from weightsync.transports.shm.transport import DEFAULT_MODEL_ID, SharedMemTransport

pytestmark = pytest.mark.skipif(not supported(), reason="no futex on this platform")

_LONG_WAIT = 60.0  # a sleeper not woken by the ring would sleep this long


def _word(page: mmap.mmap) -> FutexWord:
    anchor = ctypes.c_char.from_buffer(page)
    base = ctypes.addressof(anchor)
    del anchor
    word = FutexWord.at(memoryview(page).cast("q"), 1, base)
    assert word is not None
    return word


def _sleeper(page: mmap.mmap, index: int, ready: Any, seen_at_start: int) -> None:
    word = _word(page)
    ready.put(index)
    word.wait(seen_at_start, _LONG_WAIT)
    memoryview(page).cast("q")[2 + index] = word.value


def test_one_raise_wakes_every_sleeping_process() -> None:
    page = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    word = _word(page)
    ctx = mp.get_context("fork")
    ready = ctx.Queue()
    sleepers = [ctx.Process(target=_sleeper, args=(page, i, ready, word.value), daemon=True)
                for i in range(3)]
    for p in sleepers:
        p.start()
    for _ in sleepers:
        ready.get(timeout=30)
    time.sleep(0.2)  # they are asleep in the kernel by now (a late one returns at once)
    word.raise_and_wake()
    for p in sleepers:
        p.join(_LONG_WAIT / 2)  # far less than their own wait: only the wake ends it
        assert p.exitcode == 0, "a sleeper was not woken by the ring"
    assert list(memoryview(page).cast("q")[2:5]) == [1, 1, 1]


def test_a_raise_before_the_sleep_is_never_missed() -> None:
    page = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    word = _word(page)
    seen = word.value
    word.raise_and_wake()  # lands between the look and the sleep
    started = time.monotonic()
    word.wait(seen, _LONG_WAIT)
    assert time.monotonic() - started < _LONG_WAIT / 2
    word.wait(word.value, 0.01)  # nothing raised: the timeout ends it


def test_each_publish_raises_the_ring_workers_sleep_on() -> None:
    transport = SharedMemTransport(auto_register=True)
    weights = {"w": torch.zeros(4)}
    try:
        transport.send_weights(DEFAULT_MODEL_ID, weights)
        ring = transport.publisher._models[DEFAULT_MODEL_ID].ring
        assert ring is not None
        before = ring.value
        transport.send_weights(DEFAULT_MODEL_ID, weights)
        transport.send_weights(DEFAULT_MODEL_ID, weights)
        assert ring.value == before + 2
    finally:
        transport.close()
