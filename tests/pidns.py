"""Run a process body inside a pid namespace of its own, as in a container: it sees its own
pid numbers (1, or a small one under a reaper like tini) and its own /proc. Linux, root only.

``in_pid_namespace`` is a ``multiprocessing`` process body (fork start method): it unshares a
pid and a mount namespace, forks the namespace's first process (pid 1 there), which mounts a
fresh /proc and runs the target; it reports, on a pipe (this process cannot start threads
once it unshared its pid namespace, so no ``multiprocessing.Queue``), that process's pid as seen
from the test (``("init", pid)``: SIGKILL it to kill the whole namespace), then waits for it.
``Namespaces`` starts such bodies for a test and kills them all at its end.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import traceback
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount_own_proc() -> None:
    """Make this mount namespace's mounts private, then mount /proc for this pid namespace."""
    _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    _check(_libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount -t proc /proc")


def pid_namespaces_usable() -> bool:
    """Whether this process may create pid and mount namespaces (root on Linux): tried in
    a throwaway child, which exits at once."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare")
            inner = os.fork()
            if inner == 0:
                try:
                    _mount_own_proc()
                    os._exit(0 if os.getpid() == 1 else 1)
                except BaseException:
                    os._exit(1)
            code = os.waitstatus_to_exitcode(os.waitpid(inner, 0)[1])
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def in_pid_namespace(ctl: Any, as_pid: int, target: Any, *args: Any) -> None:
    """Run ``target(*args)`` in a new pid namespace as its pid 1 (``as_pid=1``) or as pid
    ``as_pid`` under a pid 1 that only reaps (as under tini); send ``("init", pid)`` on ``ctl`` (the
    sending end of a ``multiprocessing.Pipe``)."""
    _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare")
    init = os.fork()
    if init == 0:
        code = 1
        try:
            _mount_own_proc()
            if as_pid == 1:
                target(*args)
                code = 0
            else:
                for _ in range(as_pid - 2):  # pids are handed out in order: use up 2..as_pid-1
                    spent = os.fork()
                    if spent == 0:
                        os._exit(0)
                    os.waitpid(spent, 0)
                child = os.fork()
                if child == 0:
                    _run_and_exit(target, args)
                code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        except BaseException:
            traceback.print_exc()
        finally:
            _flush_queues(args)
            os._exit(code)
    ctl.send(("init", init))
    ctl.close()
    os.waitpid(init, 0)


def _run_and_exit(target: Any, args: tuple[Any, ...]) -> None:
    code = 1
    try:
        target(*args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        _flush_queues(args)
        os._exit(code)


def _flush_queues(args: tuple[Any, ...]) -> None:
    """os._exit skips multiprocessing's exit hooks: push out what the target queued."""
    for arg in args:
        if hasattr(arg, "join_thread") and hasattr(arg, "close"):
            try:
                arg.close()
                arg.join_thread()
            except Exception:
                pass


class Namespaces:
    """Starts process bodies in pid namespaces of their own; kills them all at the end."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("fork")
        self.queues = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.inits: list[int] = []

    def start(self, as_pid: int, target: Any, *args: Any) -> tuple[Any, int]:
        """Run ``target(out, *args)``; returns its own result queue and the pid (seen from
        here) of its namespace's pid 1."""
        ctl, ctl_end = self.ctx.Pipe(duplex=False)
        out = self.queues.Queue()
        proc = self.ctx.Process(target=in_pid_namespace, args=(ctl_end, as_pid, target, out, *args),
                                daemon=True)
        proc.start()
        self.procs.append(proc)
        ctl_end.close()
        assert ctl.poll(10), "the namespace's pid 1 was not reported"
        event, init = ctl.recv()
        ctl.close()
        assert event == "init"
        self.inits.append(init)
        return out, init

    def close(self) -> None:
        for init in self.inits:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
