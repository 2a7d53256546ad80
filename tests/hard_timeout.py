"""A per-test deadline that nothing can escape, for tests that block inside Ray.

pytest-timeout's signal lands in the main thread only when it runs Python code: a test
blocked in ``ray.get()``, or one whose ``finally:`` blocks again after the signal (e.g. a
``collector.shutdown()`` waiting on a dead actor), runs on past it. ``HardDeadline`` is a
watchdog thread armed for one test's whole protocol (setup, call, teardown): when the
deadline passes it prints every thread's stack, kills the processes this pytest started
(raylets, Ray workers, collector workers: nothing else), and ends pytest with exit status
``EXIT_CODE``. The run fails loudly and names the test instead of hanging CI."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

#: pytest's exit status when a hard deadline ended the run
EXIT_CODE = 86


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_descendants() -> list[int]:
    """SIGKILL every process this one started (directly or not); returns their ids."""
    pids = _descendants(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


class HardDeadline:
    """Arm with ``start()`` before a test, ``cancel()`` after it; ``seconds`` after
    ``start()`` an uncancelled deadline ends this process (see the module docstring)."""

    def __init__(self, nodeid: str, seconds: float,
                 release_output: Callable[[], None] | None = None) -> None:
        self.nodeid = nodeid
        self.seconds = seconds
        self._release_output = release_output  # e.g. stop pytest's capture of fd 2
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hard-deadline", daemon=True)

    def start(self) -> HardDeadline:
        self._thread.start()
        return self

    def cancel(self) -> None:
        self._cancelled.set()

    def _watch(self) -> None:
        start = time.monotonic()
        if self._cancelled.wait(self.seconds):
            return
        if self._release_output is not None:
            with contextlib.suppress(Exception):  # the report below matters more
                self._release_output()
        err = sys.__stderr__ or sys.stderr
        err.write(f"\n\nHARD DEADLINE: {self.nodeid} still running after "
                  f"{time.monotonic() - start:.0f} s (limit {self.seconds:.0f} s); "
                  "stacks follow, then every process this pytest started is killed and "
                  f"pytest exits with status {EXIT_CODE}\n")
        faulthandler.dump_traceback(file=err, all_threads=True)
        killed = kill_descendants()
        err.write(f"HARD DEADLINE: killed {len(killed)} process(es): {killed}\n")
        err.flush()
        os._exit(EXIT_CODE)
