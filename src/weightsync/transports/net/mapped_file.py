"""Staged files mapped as tensors, each mapping holding a shared ``flock`` on its file for
as long as it lives (in any process: a worker applying it, a relay serving it, a fetch
using it as a delta base). A retired file is reused for the next version only when
:func:`retire` takes it exclusively, so no mapping ever sees its bytes change; reusing one
spares a version the cost of fresh shared-memory pages (allocated, zeroed and faulted in
one by one: ~4x a memcpy of them here)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
import weakref
from pathlib import Path

import torch

#: the longest a mapping waits for a file's exclusive holder (which holds it only to
#: rename or remove the file)
_LOCK_WAIT_S = 5.0


def map_locked(path: Path, nbytes: int, *, write: bool) -> torch.Tensor:
    """The first ``nbytes`` bytes of ``path`` as a uint8 tensor over a mapping of the file:
    shared and populated at once to ``write`` into, private (copy-on-write) to read. The
    file stays locked shared until the tensor and every view of it are gone.
    ``FileNotFoundError`` if ``path`` is gone or was retired meanwhile."""
    fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        _lock_shared(fd, path)
        if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
            raise FileNotFoundError(f"{path} was retired while it was being opened")
        if not nbytes:
            os.close(fd)
            return torch.empty(0, dtype=torch.uint8)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        populate = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the pages mapped in one call
        flags = mmap.MAP_SHARED | populate if write else mmap.MAP_PRIVATE
        mapping = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    weakref.finalize(mapping, os.close, fd)  # the lock goes with the last view of the bytes
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _lock_shared(fd: int, path: Path) -> None:
    end = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > end:
                raise TimeoutError(f"{path} stayed locked exclusively for {_LOCK_WAIT_S:g} s "
                                   "(a worker of this host stalled while retiring it?)") from None
            time.sleep(0.001)


def retire(path: Path, spare: Path) -> bool:
    """Retire the staged file ``path``: kept as ``spare`` (to be written again) when no
    process maps it and there is no spare yet, removed otherwise (mappings of it stay
    valid). Returns whether it became the spare."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # mapped somewhere: it goes
            os.unlink(path)
            return False
        if os.path.lexists(spare):
            os.unlink(path)
            return False
        os.replace(path, spare)  # still held: a mapping that opened it now finds it gone
        return True
    finally:
        os.close(fd)


def fresh_or_spare(path: Path, spare: Path, nbytes: int) -> torch.Tensor:
    """``path`` made ``nbytes`` long and mapped to be written: the spare when it has that
    size (its pages are already there), a new file otherwise. A file left at ``path``
    (a fetch that failed) is replaced, never truncated: a relay may still map it."""
    with contextlib.suppress(FileNotFoundError):
        if os.stat(spare, follow_symlinks=False).st_size == nbytes:
            os.replace(spare, path)
            return map_locked(path, nbytes, write=True)
        os.unlink(spare)  # of another layout
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return map_locked(path, nbytes, write=True)
