"""The server's side of an in-flight take (``server_take``): a take that its trainer began
and did not finish within the trainer's own deadline (the trainer died or hung between
``/pause`` and its label) is finished by the server, as the trainer would have finished
it: its prefix cache emptied, the label of the version it loaded, then ``/resume``. Before,
such a server stayed paused, its requests kept, until the next trainer session's take.
Once the label is set only the trainer's ``/resume`` is left (one call): the lease lets
go there, so that it never resumes a server that someone else paused or put to sleep
since.

The lease lives in the server's first worker (vLLM calls ``start_weight_update``,
``update_weights`` and ``finish_weight_update`` on it, in that order, once per update
session); it reaches its own server over vLLM's HTTP routes, at the URL the trainer
reached it at."""

from __future__ import annotations

import enum
import logging
import threading
import time

from weightsync.integrations.vllm.server_take import is_paused, post

logger = logging.getLogger(__name__)


#: how long each of the lease's calls on its own server may take
CALL_S = 30.0


class Step(enum.Enum):
    """Where the update session under way stands, as the worker saw it."""

    IDLE = "idle"  # no session, or the last one was looked after
    BEGUN = "begun"  # start_weight_update; the trainer pauses the server next
    LOADING = "loading"  # update_weights runs (its own deadline bounds it)
    LOADED = "loaded"  # update_weights returned; the trainer empties the cache, labels it


class TakeLease:
    """Watches one server's update sessions; a session whose next step does not come within
    ``timeout`` seconds (the trainer's own deadline for the whole take) is finished here,
    on the server's HTTP API at ``url``; ``name`` says which worker in the log."""

    def __init__(self, url: str, timeout: float, *, name: str) -> None:
        self.url, self.timeout, self.name = url.rstrip("/"), timeout, name
        self._cond = threading.Condition()
        self._step = Step.IDLE
        self._since = 0.0
        self._label: str | None = None  # the label of the version this session loaded
        self._closed = False
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="weightsync-take-lease")
        self._thread.start()

    # ------------------------------------------------------------------ the worker's calls
    def began(self) -> None:
        self._enter(Step.BEGUN)

    def loading(self) -> None:
        self._enter(Step.LOADING)

    def loaded(self, label: str | None) -> None:
        """``label``: what the trainer labels the version this take loaded (None: it loaded
        nothing, a failed load or a stage only)."""
        self._enter(Step.LOADED, label)

    def finished(self) -> None:
        """The label is set (or the session ended unlabelled): nothing left to watch."""
        self._enter(Step.IDLE)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _enter(self, step: Step, label: str | None = None) -> None:
        with self._cond:
            self._step, self._since, self._label = step, time.monotonic(), label
            self._cond.notify_all()

    # ------------------------------------------------------------------ the watch
    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if self._step in (Step.IDLE, Step.LOADING):
                        self._cond.wait()
                        continue
                    left = self._since + self.timeout - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                step, label, self._step = self._step, self._label, Step.IDLE
            try:
                self._finish(step, label)
            except Exception as exc:  # the server may be gone too: nothing left to keep
                logger.warning("%s: could not finish the take its trainer left (%s): %s",
                               self.name, step.value, exc)

    def _finish(self, step: Step, label: str | None) -> None:
        """What the trainer did not do after ``step`` (``BEGUN`` or ``LOADED``), in its
        order. The update session is always ended (vLLM refuses the next one's start until
        it is); the rest only when the server is paused or a label is owed (a trainer that
        died in a stage, which never pauses, leaves nothing else)."""
        paused = is_paused(self.url, CALL_S)
        if paused or label is not None:
            logger.warning(
                "%s: its trainer began a take and did not finish it within %.0f s (it died "
                "or hung after %s): finishing it here (label %s, prefix cache emptied, "
                "resumed)", self.name, self.timeout, step.value,
                label if label is not None else "unchanged")
        if label is not None:  # new weights: no request goes on with KV of the old ones
            post(self.url, "reset_prefix_cache", CALL_S, reset_running_requests="true")
        post(self.url, "finish_weight_update", CALL_S, {"weight_version": label})
        if paused:
            post(self.url, "resume", CALL_S)
