"""Anonymous shared-memory segments (``memfd``) mapped as uint8 tensors.

A segment has no name in /dev/shm: it is passed between processes as a file descriptor
and freed by the kernel when the last process holding it exits, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import warnings

import torch


def _anonymous_fd(nbytes: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("weightsync", os.MFD_CLOEXEC)
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
    def create(cls, nbytes: int) -> Segment:
        return cls(_anonymous_fd(nbytes), nbytes, writable=True)

    @classmethod
    def attach(cls, fd: int, nbytes: int, *, writable: bool = False) -> Segment:
        """Map a segment received from another process; takes ownership of ``fd``."""
        return cls(fd, nbytes, writable=writable)

    def view_int64(self) -> memoryview:
        """The segment as a writable array of int64 (for small control blocks)."""
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
