"""Whether the process that posted a hello still lives, for media that cannot tell from a
connection (files, a Ray actor): each hello carries its pid, host and pid namespace, judged
only where the reader shares that pid namespace."""

from __future__ import annotations

import os
import socket
from typing import Any

from weightsync.core.liveness import judged_by_pid, pid_scope, process_dying
from weightsync.transports.ranks.records import Hello


def process_detail() -> dict[str, Any]:
    """What a hello says of its process, for the others to judge its liveness by."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "pidns": pid_scope()}


def judged_here(hello: Hello) -> bool:
    """This process can judge the liveness of ``hello``'s by its pid."""
    scope = hello.detail.get("pidns")
    return isinstance(scope, str) and judged_by_pid(scope) \
        and isinstance(hello.detail.get("pid"), int)


def hello_dead(hello: Hello) -> bool:
    """The process that posted ``hello`` is gone (judged only in our pid namespace)."""
    return judged_here(hello) and process_dying(int(hello.detail["pid"]))


def who(hello: Hello) -> str:
    return f"pid {hello.detail.get('pid')} on {hello.detail.get('host')}"


def claim_refused(held: Hello | None, claimant: Hello) -> str:
    """Why ``claimant`` may not take rank ``claimant.rank`` from ``held`` (another live
    process holds it), or '' if it may (none holds it, it died, it is the same process)."""
    if held is None or held.incarnation == claimant.incarnation \
            or held.detail.get("pid") == claimant.detail.get("pid") \
            or not judged_here(held) or hello_dead(held):
        return ""
    return (f"trainer rank {claimant.rank} is already held by a live process ({who(held)}); "
            "a rank index is claimed by one process at a time")


def lost_verdict(hello: Hello | None, incarnation: str, gone: str) -> str:
    """Why the rank that said ``incarnation`` is lost, judged by its current hello (``gone``
    when it has none); "" while that same process lives. The lead boards of media without
    a connection to watch (files, a Ray actor) ask this."""
    if hello is None:
        return gone
    if hello.incarnation != incarnation:
        return f"restarted ({who(hello)})"
    if hello_dead(hello):
        return f"died ({who(hello)})"
    return ""

