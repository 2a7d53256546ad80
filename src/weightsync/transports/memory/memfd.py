"""Anonymous shared-memory segments (``memfd``) mapped as uint8 tensors.

A segment has no name in /dev/shm: it is passed between processes as a file descriptor
and freed by the kernel when the last process holding it exits, SIGKILL included.

The creator seals a segment once it has mapped it (Linux ``memfd`` seals, kept by the
file itself, whoever holds or reopens its fd): its size is fixed (a shrink would crash
every process that maps it with SIGBUS), and unless it is made for the receiver to write
(``create(..., receivers_write=True)``), ``F_SEAL_FUTURE_WRITE`` forbids every new
writable mapping, ``write()``, hole punching and ``mprotect`` to writable, while the
creator keeps the writable mapping it made first. So a process handed the fd (a worker)
can read the segment, never change it. See docs/security.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import tempfile
import warnings

import torch

logger = logging.getLogger(__name__)

#: Linux's ``F_SEAL_FUTURE_WRITE`` (5.1+; Python's ``fcntl`` does not name it)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_SIZE_SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0x0002) | getattr(fcntl, "F_SEAL_GROW", 0x0004)
               | getattr(fcntl, "F_SEAL_SEAL", 0x0001))
_warned_no_seal = False


def _anonymous_fd(nbytes: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("weightsync", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    else:  # pragma: no cover - non-Linux fallback: an unlinked file in a tmpfs if we have one
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryFile(dir=shm_dir) as handle:
            fd = os.dup(handle.fileno())
    os.ftruncate(fd, max(nbytes, 1))
    return fd


class Segment:
    """One shared segment: its fd, its mapping and a flat uint8 tensor over the mapping."""

    def __init__(self, fd: int, nbytes: int, *, writable: bool) -> None:
        self.fd = fd
        self.nbytes = nbytes
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map: mmap.mmap | None = mmap.mmap(fd, max(nbytes, 1), flags=flags, prot=prot)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only maps are fine: receivers only read
            self.tensor: torch.Tensor | None = torch.frombuffer(
                self._map, dtype=torch.uint8, count=nbytes
            ) if nbytes else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, *, receivers_write: bool = False, sealed: bool = True) -> Segment:
        """A new segment, mapped writable here, then sealed: fixed size, and (unless
        ``receivers_write``) no writable mapping or write by anyone else, ever.
        ``sealed=False``: the caller seals it later, once the processes that must write it
        too (a sharded trainer's other ranks) have mapped it writable."""
        seg = cls(_anonymous_fd(nbytes), nbytes, writable=True)
        if sealed:
            seg.seal(writes=not receivers_write)
        return seg

    def seal(self, *, writes: bool) -> None:
        """Fix the segment's size and (``writes``) forbid any new way to write it; a kernel
        without ``F_SEAL_FUTURE_WRITE`` (before 5.1) or memfd seals is logged, once."""
        global _warned_no_seal
        seals = _SIZE_SEALS | (F_SEAL_FUTURE_WRITE if writes else 0)
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            return
        except (OSError, AttributeError) as exc:
            if not _warned_no_seal:
                _warned_no_seal = True
                logger.warning("shared segments cannot be sealed here (%s): a process "
                               "holding their fds may write them", exc)
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)

    def seals(self) -> int:
        """The segment's seals (``F_GET_SEALS``), 0 where it has none."""
        try:
            return int(fcntl.fcntl(self.fd, fcntl.F_GET_SEALS))
        except (OSError, AttributeError):
            return 0

    @classmethod
    def attach(cls, fd: int, nbytes: int, *, writable: bool = False) -> Segment:
        """Map a segment received from another process; takes ownership of ``fd``."""
        return cls(fd, nbytes, writable=writable)

    def view_int64(self) -> memoryview:
        """The segment as an array of int64 (for small control blocks); read-only where
        the mapping is."""
        assert self._map is not None
        return memoryview(self._map).cast("q")

    def close(self) -> None:
        self.tensor = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # views still alive: GC unmaps later
                self._map.close()
            self._map = None
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
