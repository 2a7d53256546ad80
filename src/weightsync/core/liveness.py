"""Is a process of this host still alive? Read from /proc, cheap enough for every send."""

from __future__ import annotations

import os

_PF_EXITING = 0x4  # task flag set as soon as a process starts to exit
_SIGKILL_BIT = 1 << 8


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
    finally:
        os.close(fd)
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:  # fields[0] is field 3 (state): flags is field 9, pending signals field 31
        return (
            fields[0] in (b"Z", b"X")
            or int(fields[6]) & _PF_EXITING != 0
            or int(fields[28]) & _SIGKILL_BIT != 0
        )
    except (IndexError, ValueError):
        return False
