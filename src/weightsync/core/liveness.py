"""Is a process of this host still alive? Read from /proc, cheap enough for every send.

A pid names a process only inside one pid namespace of one running kernel: two containers
on one host each have their pid 1, and hostnames say nothing about either. :func:`pid_scope`
names that space, so a pid written by one process is judged by another only when both see
the same pid numbers (otherwise the caller must use something namespace-proof, such as a
held ``fcntl`` lock, or wait for its deadline).
"""

from __future__ import annotations

import contextlib
import os

_PF_EXITING = 0x4  # task flag set as soon as a process starts to exit
_SIGKILL_BIT = 1 << 8


def _stat_says_dying(stat: bytes) -> bool:
    """Parse a /proc/<pid>/stat line: zombie, exiting, or SIGKILL pending."""
    fields = stat[stat.rfind(b")") + 2 :].split(b" ", 29)  # up to field 31, no further
    try:  # fields[0] is field 3 (state): flags is field 9, pending signals field 31
        return (
            fields[0] in (b"Z", b"X")
            or int(fields[6]) & _PF_EXITING != 0
            or int(fields[28]) & _SIGKILL_BIT != 0
        )
    except (IndexError, ValueError):
        return False


def process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the third on (state, parent, process group,
    ...), past the name, which may hold spaces and parentheses; None if it is gone or
    unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].decode(errors="replace").split()


def process_dying(pid: int) -> bool:
    """True if ``pid`` is gone, a zombie, exiting, or has SIGKILL pending (Linux /proc).

    A killed process closes its sockets only after tearing down its memory, which takes
    milliseconds for a process holding a model; this sees the kill before that."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        stat = os.read(fd, 4096)
    except ProcessLookupError:
        return True
    finally:
        os.close(fd)
    return _stat_says_dying(stat)


class ProcessWatch:
    """:func:`process_dying` for one process through a descriptor held open: each check is
    one ``pread`` (no path lookup), and the descriptor stays bound to that very process,
    so a reused pid can never pass for it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._gone = False
        try:
            self._fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        except FileNotFoundError:
            self._gone = True
        except OSError:  # no /proc here: fall back to the socket's hang-up alone
            pass

    def dying(self) -> bool:
        if self._gone:
            return True
        if self._fd is None:
            return False
        try:
            stat = os.pread(self._fd, 4096, 0)
        except ProcessLookupError:  # reaped
            self._gone = True
            return True
        except OSError:
            return False
        return _stat_says_dying(stat)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_scope: list[str | None] = []  # this process's pid_scope(), once read


def _forget_scope() -> None:
    _scope.clear()


os.register_at_fork(after_in_child=_forget_scope)  # a child may be in a new pid namespace


def _read_pid_scope() -> str | None:
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None  # this /proc belongs to another pid namespace than ours
        with open(_BOOT_ID, "rb") as handle:
            boot = handle.read(64).strip().decode("ascii")
        ns = os.stat("/proc/self/ns/pid")
    except (OSError, UnicodeDecodeError):
        return None
    return f"{boot}/{ns.st_dev}:{ns.st_ino}" if boot else None


def pid_scope() -> str | None:
    """The space this process's pids are numbered in: the kernel's boot (``boot_id``, shared
    by every container of a host, different on every host and after a reboot) and the pid
    namespace (device and inode of ``/proc/self/ns/pid``). A pid another process recorded
    can be checked in this process's /proc only if both recorded equal scopes. None when
    this process cannot tell (no /proc, or a /proc of another pid namespace)."""
    if not _scope:
        _scope.append(_read_pid_scope())
    return _scope[0]


def judged_by_pid(scope: str | None) -> bool:
    """Whether a pid recorded under ``scope`` names a process of this process's /proc."""
    return scope is not None and scope == pid_scope()


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is field 3, the
    state), or None if the process is gone or /proc cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` as /proc reports it, or None if it cannot be read."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None else int(fields[1])
    except (IndexError, ValueError):
        return None


def is_same_or_descendant(pid: int, ancestor: int, max_depth: int = 64) -> bool:
    """True if ``pid`` is ``ancestor`` or one of its descendants (walking /proc parents)."""
    for _ in range(max_depth):
        if pid == ancestor:
            return True
        parent = parent_pid(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, as /proc says), None if it is
    gone or a zombie: a pid alone may be reused, a pid and its start time may not."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode("ascii", "replace")
