"""Keep other processes of the same user out of a trainer's shared memory (Linux).

Any process of the same user may open another's file descriptors through
``/proc/<pid>/fd`` (or take them with ``pidfd_getfd``, or read its memory through
``/proc/<pid>/mem`` or ``ptrace``) unless that process is *not dumpable*: the kernel then
asks for ``CAP_SYS_PTRACE`` (root) instead. A SharedMem sender marks its process so
(``prctl(PR_SET_DUMPABLE, 0)``) before it creates its first segment, so only the workers
it hands the fds to (over its authenticated socket) hold them. The flag also means no
core dump and no ``gdb``/``py-spy`` attach by the same user; set
``WEIGHTSYNC_DUMPABLE=1`` in the trainer's environment to keep the process dumpable (for
debugging), which gives up this protection. It is inherited by forked children and reset
by ``exec``. See docs/security.md.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

#: the environment variable that keeps a sender's process dumpable (opt-out, for debugging)
ENV_KEEP_DUMPABLE = "WEIGHTSYNC_DUMPABLE"
_PR_SET_DUMPABLE, _PR_GET_DUMPABLE = 4, 3


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.restype = ctypes.c_int
    result = int(libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0),
                            ctypes.c_ulong(0), ctypes.c_ulong(0)))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def is_dumpable() -> bool | None:
    """Whether this process is dumpable (None where the platform cannot tell)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _prctl(_PR_GET_DUMPABLE) == 1
    except (OSError, AttributeError):
        return None


def protect_sender_process() -> bool:
    """Make this process non-dumpable, unless ``WEIGHTSYNC_DUMPABLE=1`` opts out; True if
    it is protected now. Called by a SharedMem sender before its first segment exists."""
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get(ENV_KEEP_DUMPABLE, "") not in ("", "0"):
        logger.info("%s is set: this trainer stays dumpable, so any process of its user "
                    "can open its shared memory through /proc", ENV_KEEP_DUMPABLE)
        return False
    try:
        if _prctl(_PR_GET_DUMPABLE) != 0:
            _prctl(_PR_SET_DUMPABLE, 0)
            logger.debug("process %d is no longer dumpable: its shared memory is kept from "
                         "other processes of its user", os.getpid())
        return True
    except (OSError, AttributeError) as exc:
        logger.warning("could not make this trainer non-dumpable (%s): other processes of "
                       "its user may open its shared memory through /proc", exc)
        return False
