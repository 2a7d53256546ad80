"""SIGSTOP a process and return once every thread of it has stopped.

``kill(pid, SIGSTOP)`` returns before the process stops: the kernel stops each thread when
that thread next runs kernel code that looks at signals, and on a loaded machine a
thread that was running (or had just been woken) went on for 10 ms, long enough to take
a host's staging lock for the next version or to ack one. A test that then expects the
process silent must wait for the stop it asked for.
"""

from __future__ import annotations

import os
import signal
import time

from weightsync.core.liveness import process_stat

#: /proc's states of a thread that runs no more code: stopped, traced, dead
_HALTED = frozenset("TtZX")


def running_threads(pid: int) -> list[int]:
    """The threads of ``pid`` not (yet) stopped; none once the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    running = []
    for tid in map(int, tids):
        stat = process_stat(tid)  # /proc/<tid> is each thread's own, hidden from listings
        if stat is not None and stat[0] not in _HALTED:  # None: that thread ended meanwhile
            running.append(tid)
    return running


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """Send SIGSTOP to ``pid`` and wait (at most ``timeout``) until all its threads stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while running := running_threads(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid}: threads {running} still run {timeout} s "
                                 "after SIGSTOP")
        time.sleep(0.001)
