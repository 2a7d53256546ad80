"""Run a function as another local user (``nobody`` by default), for the attack tests.

``run_as_user(fn, *args)`` forks, drops to ``uid``/``gid`` in the child (supplementary groups
cleared, so the child holds none of root's rights), runs ``fn(*args)`` and hands back its
picklable result, or re-raises the error it raised. The child is SIGKILLed at the timeout.
Switching user needs root: mark such tests ``@needs_root`` and ``@pytest.mark.multiuser``.
With ``uid``/``gid`` set to the caller's own, it is simply a child with a hard timeout (for
calls that might hang), and needs no root.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

NOBODY = 65534

#: Skip marker for tests that switch to another user.
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to switch to another user"
)


class OtherUserTimeout(TimeoutError):
    """The child running as the other user did not finish within its timeout (it was killed)."""


class OtherUserError(RuntimeError):
    """The child failed with an error that could not be sent back as itself."""


def _child(fn: Callable[..., Any], args: tuple[Any, ...], uid: int, gid: int, fd: int) -> None:
    """Body of the forked child: switch user, run, write one pickled outcome, exit."""
    try:
        if (uid, gid) != (os.geteuid(), os.getegid()):
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
        outcome: tuple[str, Any, str] = ("ok", fn(*args), "")
    except BaseException as exc:  # everything goes back to the parent
        outcome = ("error", exc, traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception:
        text = outcome[2] or repr(outcome[1])
        data = pickle.dumps(("error", OtherUserError(f"unpicklable outcome: {text}"), text))
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def run_as_user(
    fn: Callable[..., T], *args: Any, uid: int = NOBODY, gid: int = NOBODY, timeout: float = 30.0
) -> T:
    """``fn(*args)`` in a forked child running as ``uid``/``gid``; its result or its error.

    The result (or exception) must be picklable. Raises :class:`OtherUserTimeout` after
    killing the child if it runs past ``timeout`` seconds."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller's frames (pytest's, the test's)
        code = 0
        try:
            os.close(read_fd)
            _child(fn, args, uid, gid, write_fd)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise OtherUserTimeout(
                    f"{getattr(fn, '__name__', fn)} as uid {uid} did not finish within {timeout}s"
                )
            ready, _, _ = select.select([read_fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(read_fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    if not chunks:
        raise OtherUserError(f"{getattr(fn, '__name__', fn)} as uid {uid}: the child died silently")
    status, value, text = pickle.loads(b"".join(chunks))  # our own child's bytes
    if status == "ok":
        return value  # type: ignore[no-any-return]
    if isinstance(value, BaseException) and hasattr(value, "add_note"):
        value.add_note(f"raised as uid {uid} in a child process:\n{text}")
    raise value


def run_in_child(fn: Callable[..., T], *args: Any, timeout: float = 30.0) -> T:
    """``fn(*args)`` in a forked child of the same user, killed at ``timeout`` (for calls
    that must not hang: a test fails with :class:`OtherUserTimeout` instead of hanging)."""
    return run_as_user(fn, *args, uid=os.geteuid(), gid=os.getegid(), timeout=timeout)
