"""In-flight updates of a ``vllm serve`` on the network path: the server keeps generating
while a version travels, is verified and is staged on its host (a background stage its
engine starts and returns from at once); once the trainer hears the host staged it, the
server stops only for the take, inside vLLM's ``/pause`` (``mode="keep"``: running
requests freeze and continue after; ``"wait"``: they finish on the old weights first):
load the staged version, label it, empty the prefix cache (running requests recompute
their KV under the new weights), resume. No step runs between the load and the label, so
every token's ``weight_versions`` span names the weights that sampled it."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncError, WeightSyncTimeoutError
from weightsync.transports.net.publisher import VersionPublisher

logger = logging.getLogger(__name__)

#: vLLM's pause modes an in-flight take may run in
PAUSE_MODES = ("keep", "wait")


def server_url(client: Any) -> str | None:
    """An HTTP server's URL (vLLM's ``HTTPVLLMWeightSyncClient``), else None."""
    url = getattr(client, "base_url", None)
    return url if isinstance(url, str) and url else None


def served_label(client: Any, timeout: float) -> int | None:
    """The version label a server serves now, when it is a number (None: "default", a
    label of another kind, or a client that cannot say): a new trainer session numbers its
    labels above it, so labels on a server never repeat or go backwards."""
    label: object = None
    url = server_url(client)
    if url is not None:
        import requests

        reply = requests.get(f"{url}/weight_info", timeout=timeout)
        if reply.ok:
            label = reply.json().get("weight_version")
    else:
        engine = getattr(getattr(client, "llm", None), "llm_engine", None)
        if engine is not None and hasattr(engine, "get_weight_version"):
            label = engine.get_weight_version()
    if isinstance(label, str) and label.isdigit():
        return int(label)
    return None


def left(deadline: Deadline) -> float:
    """Seconds left of a finite deadline (every call on the servers has one)."""
    remaining = deadline.remaining()
    assert remaining is not None
    return max(remaining, 0.001)


def post(url: str, route: str, timeout: float, body: dict[str, Any] | None = None,
         **params: str) -> None:
    """One call of vLLM's HTTP API on ``url`` (``body``: its JSON), raising with what the
    server said."""
    import requests

    _check(requests.post(f"{url}/{route}", params=params or None, json=body, timeout=timeout),
           url, route)


def is_paused(url: str, timeout: float) -> bool:
    """Whether the server at ``url`` is paused now (vLLM's ``GET /is_paused``)."""
    import requests

    answer = _check(requests.get(f"{url}/is_paused", timeout=timeout), url, "is_paused").json()
    return isinstance(answer, dict) and answer.get("is_paused") is True


def _check(reply: Any, url: str, route: str) -> Any:
    """``reply``, or WeightSyncError with what the server said."""
    if not reply.ok:
        raise WeightSyncError(f"server {url}: /{route} answered {reply.status_code}: "
                              f"{reply.text[:1000]}")
    return reply


def wait_host_staged(publisher: VersionPublisher, index: int, url: str, version: int, after: int,
                deadline: Deadline) -> None:
    """Wait until server ``index``'s host staged ``version`` (its verdict on the stream
    that ended after the first ``after``), or raise naming the server; it keeps serving
    the version it held either way."""
    figures = publisher.wait_stream(version, f"server{index}", left(deadline), after)
    if figures is None:
        raise WeightSyncTimeoutError(
            f"server {url}: its host did not stage version {version} within {deadline}; "
            "it keeps serving the version it held")
    if figures.error is not None:
        raise WeightSyncError(
            f"server {url}: its host could not stage version {version} ({figures.error}); "
            "it keeps serving the version it held")


def take(client: Any, url: str, version: int, label: str, session: str, pause: str,
         deadline: Deadline, after_load: Callable[[], None]) -> dict[str, float]:
    """Server ``url`` loads the staged ``version`` inside vLLM's pause, runs ``after_load``
    (empty the prefix cache) and labels it ``label`` before it resumes (the label last, so
    that once it is set only ``/resume`` is left); a load that fails leaves the label as it
    was, and the server resumes in every case (should this process die inside, the server
    finishes the take itself: ``take_lease``). Returns the seconds of each step
    (``pause``, ``load``, ``reset``, ``label``, ``resume``)."""
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name], mark = now - mark, now

    client.start_weight_update()  # first: from here the server finishes what we leave
    post(url, "pause", left(deadline), mode=pause)
    lap("pause")
    try:
        try:
            client.update_weights({"version": version, "session": session, "label": label,
                                   "timeout": left(deadline)})
        except BaseException:
            with contextlib.suppress(Exception):
                client.finish_weight_update()  # end the server's update session, unlabelled
            raise
        lap("load")
        try:
            after_load()
        finally:  # loaded: labelled, even when the cache could not be emptied
            lap("reset")
            client.finish_weight_update(weight_version=label)
            lap("label")
    finally:
        post(url, "resume", max(left(deadline), 5.0))
        lap("resume")
    return phases
