"""Objects that must be inert in a process forked from their owner.

A sender or receiver copied into a forked child (a data-loader worker, a helper started
with ``os.fork``) shares its sockets and shared memory with the parent. The child's copy
must never close, signal or watch any of them: after a fork, every tracked object is
marked closed in the child, and its ``close()`` does nothing there.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

_tracked: weakref.WeakSet[Any] = weakref.WeakSet()


def track_for_fork(obj: Any) -> None:
    """Mark ``obj`` (with ``_forked_copy`` and ``_closed`` attributes) inert in children."""
    _tracked.add(obj)


def _inert_after_fork() -> None:
    for obj in list(_tracked):
        obj._forked_copy = True
        obj._closed = True
    _tracked.clear()


os.register_at_fork(after_in_child=_inert_after_fork)
