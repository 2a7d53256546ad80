"""A word of shared memory that processes sleep on: the Linux ``futex`` wait and wake.

A worker blocked in ``receive()`` sleeps on the control block's "ring" word; the trainer
raises the word after it publishes and wakes every sleeper with one system call. One call
for all workers matters on a small machine: a sleeper woken by its own call preempts the
trainer before it can wake the next one. The kernel compares the word before sleeping, so
a raise that lands between a worker's look and its sleep is never missed. Where the
platform has no futex (not Linux, or an architecture not listed), ``FutexWord.at`` gives
None and the caller keeps its socket notice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: the futex system call's number, per architecture (Linux)
_SYSCALL_FUTEX = {"x86_64": 202, "aarch64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not private): the word is in shared memory
_WAKE_ALL = 0x7FFFFFFF
_VALUE_MASK = 0x7FFFFFFF  # the word's value stays a positive 32-bit int


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_call() -> tuple[Callable[..., int], int] | None:
    number = _SYSCALL_FUTEX.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    call = libc.syscall
    call.restype = ctypes.c_long
    return call, number  # type: ignore[no-any-return]


_FUTEX = _futex_call()


def supported() -> bool:
    """Whether this platform has the futex calls (Linux on x86_64 or aarch64)."""
    return _FUTEX is not None


def _long(value: int) -> ctypes.c_long:
    """``syscall`` reads every argument as a long: pass them as such."""
    return ctypes.c_long(value)


class FutexWord:
    """Word ``index`` of ``words`` (int64, a shared mapping whose first byte is at
    ``base_address``): read and written through ``words`` only, so a word whose mapping
    was released raises instead of touching freed memory; the kernel gets its address
    (the low 32 bits on a little-endian machine) and fails cleanly if it is gone."""

    def __init__(self, words: memoryview, index: int, base_address: int) -> None:
        assert _FUTEX is not None
        self._call, number = _FUTEX
        self._number = _long(number)
        self._words = words
        self._index = index
        self._address = ctypes.c_void_p(base_address + 8 * index)

    @classmethod
    def at(cls, words: memoryview, index: int, base_address: int) -> FutexWord | None:
        """Word ``index`` of ``words``, or None without futex support."""
        if _FUTEX is None or base_address % 8 or sys.byteorder != "little":
            return None
        return cls(words, index, base_address)

    @property
    def value(self) -> int:
        return int(self._words[self._index])

    def raise_and_wake(self) -> None:
        """Change the word and wake every process sleeping on it (trainer side)."""
        self._words[self._index] = (self._words[self._index] + 1) & _VALUE_MASK
        self.wake()

    def wake(self) -> None:
        """Wake every sleeper without changing the word (each looks again, then sleeps)."""
        self._call(self._number, self._address, _long(_FUTEX_WAKE), _long(_WAKE_ALL),
                   None, None, _long(0))

    def wait(self, seen: int, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds unless the word no longer holds ``seen``; returns
        on a wake, a change, a timeout or a signal alike (the caller looks again)."""
        if timeout <= 0:
            return
        whole = int(timeout)
        span = _Timespec(whole, int((timeout - whole) * 1e9))
        result = self._call(self._number, self._address, _long(_FUTEX_WAIT), _long(seen),
                            ctypes.byref(span), None, _long(0))
        if result == -1:
            errno = ctypes.get_errno()
            if errno not in (11, 110, 4):  # EAGAIN (changed), ETIMEDOUT, EINTR: look again
                logger.debug("futex wait failed: %s", os.strerror(errno))
