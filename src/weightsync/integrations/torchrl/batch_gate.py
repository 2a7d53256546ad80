"""When a collector worker may apply a new version: at a batch start (the collector's
``pre_collect_hook``, in the thread that then runs the policy), and, in a worker that
sits idle between two batches (a ``MultiSyncCollector`` worker waits for the trainer's next
request), as soon as the version arrives.

``BatchGate`` runs that second path: a background thread in the worker applies a new version
only while no batch is in progress. The batch hooks mark the batches: ``batch_start()``
(in ``pre_collect_hook``) waits for an apply in progress to finish and closes the gate;
``batch_end()`` (in ``post_collect_hook``) opens it. An apply therefore never overlaps a
rollout, so nothing tears, and a user who updates the weights and then inspects or
evaluates an idle worker finds the new version there, as with TorchRL's own schemes. A
collector whose batch ends without calling ``post_collect_hook`` (one that writes into a
replay buffer) keeps its gate closed after its first batch: it takes versions at batch
starts only, as before."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.integrations.torchrl.collector_hooks import chain_pre_collect_hook

logger = logging.getLogger(__name__)

#: how often an idle worker looks for a new version (a cheap look at shared state)
IDLE_POLL_S = 0.005
#: how long ``stop()`` waits for an apply in progress
STOP_TIMEOUT_S = 10.0


class BatchGate:
    """Applies new versions in a worker between batches, from a background thread.

    ``apply`` is called (with the gate closed to batches) while the worker is idle; it must
    never block for long (the scheme's ``poll``); returning ``False`` ends the thread (the
    scheme is gone)."""

    def __init__(self, apply: Callable[[], Any], name: str, *, apply_timeout: float,
                 interval: float = IDLE_POLL_S) -> None:
        self._apply = apply
        self._apply_timeout = apply_timeout
        self._interval = interval
        self._cond = threading.Condition()
        self._in_batch = False
        self._applying = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"weightsync-idle-{name}",
                                        daemon=True)
        self._thread.start()

    @property
    def in_batch(self) -> bool:
        return self._in_batch

    def batch_start(self) -> None:
        """A batch starts in the calling thread: wait for an apply in progress, then keep the
        background applier out until ``batch_end()``."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._applying, self._apply_timeout):
                raise WeightSyncTimeoutError(
                    f"{self._thread.name}: applying a version between batches took over "
                    f"{self._apply_timeout:.0f} s; the batch cannot start meanwhile")
            self._in_batch = True

    def batch_end(self) -> None:
        """The batch is over: the worker is idle, the applier may apply again."""
        with self._cond:
            self._in_batch = False
            self._cond.notify_all()

    def stop(self) -> None:
        """End the background applier (waits for an apply in progress); safe to call twice."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("%s did not stop within %.0f s", self._thread.name,
                               STOP_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._in_batch and not self._stopped:
                    self._cond.wait(1.0)  # woken by batch_end() or stop()
                if self._stopped:
                    return
                self._applying = True
            try:
                if self._apply() is False:
                    self._stopped = True
            except Exception:  # stop here; the next batch start applies (or raises) instead
                logger.exception("%s: applying a version between batches failed; versions "
                                 "are applied at batch starts only from now on",
                                 self._thread.name)
                self._stopped = True
            finally:
                with self._cond:
                    self._applying = False
                    self._cond.notify_all()
                    if not self._stopped:
                        self._cond.wait(self._interval)


def chain_post_collect_hook(collector: Any, callback: Callable[[], None]) -> bool:
    """Run ``callback`` at the end of each of ``collector``'s batches, after any hook the
    user set. Returns False if the collector has no such hook."""
    if not hasattr(collector, "post_collect_hook"):
        return False
    user_hook = collector.post_collect_hook

    def post_collect_hook(batch: Any) -> None:
        if user_hook is not None:
            user_hook(batch)
        callback()

    collector.post_collect_hook = post_collect_hook
    return True


def open_idle_gate(collector: Any, poll: Callable[[], Any], name: str,
                   apply_timeout: float) -> BatchGate | None:
    """A ``BatchGate`` applying versions (``poll``) while ``collector`` is between batches,
    its ``batch_end`` chained to the collector's ``post_collect_hook``; None if the
    collector cannot say when a batch ends. The caller calls ``batch_start()`` in its
    ``pre_collect_hook`` before applying there."""
    gate_ref: list[weakref.ReferenceType[BatchGate]] = []

    def on_batch_end() -> None:
        gate = gate_ref[0]() if gate_ref else None
        if gate is not None:
            gate.batch_end()

    if not chain_post_collect_hook(collector, on_batch_end):
        return None
    gate = BatchGate(poll, name, apply_timeout=apply_timeout)
    gate_ref.append(weakref.ref(gate))
    return gate


class ApplyPoints:
    """Where a worker's scheme applies new versions. With a collector: at each batch start
    (``on_batch_start``, in its ``pre_collect_hook``) and, if ``idle``, between batches (a
    ``BatchGate`` calling ``poll``). Without one: before each call of the policy (a forward
    pre-hook calling ``poll``). Either way never while a step reads the weights. The
    callables should hold the scheme weakly (the hooks live as long as the collector)."""

    def __init__(self, on_batch_start: Callable[[], None], poll: Callable[[], Any], *,
                 idle: bool, name: str, apply_timeout: float) -> None:
        self._on_batch_start = on_batch_start
        self._poll = poll
        self._idle = idle
        self._apply_timeout = apply_timeout
        self._name = name
        self._hooked: weakref.ReferenceType[Any] | None = None
        self._handle: Any = None
        self.gate: BatchGate | None = None

    def install(self, collector: Any, model: Any) -> None:
        """Hook ``collector`` (once; again if it is a new one), else ``model``."""
        if collector is not None and not (self._hooked is not None
                                          and self._hooked() is collector):
            points_ref = weakref.ref(self)

            def on_batch_start() -> None:
                points = points_ref()
                if points is not None:
                    points._batch_start()

            if chain_pre_collect_hook(collector, on_batch_start):
                self._hooked = weakref.ref(collector)
                self._remove_handle()
                if self._idle:
                    if self.gate is not None:
                        self.gate.stop()
                    self.gate = open_idle_gate(collector, self._poll, self._name,
                                               self._apply_timeout)
                return
        if self._hooked is None and self._handle is None and isinstance(model,
                                                                         torch.nn.Module):
            poll = self._poll

            def forward_pre_hook(module: torch.nn.Module, args: Any) -> None:
                poll()

            self._handle = model.register_forward_pre_hook(forward_pre_hook)

    def _batch_start(self) -> None:
        gate = self.gate
        if gate is not None:
            gate.batch_start()
        self._on_batch_start()

    def _remove_handle(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def close(self) -> None:
        """Stop the idle applier and remove the forward pre-hook (the collector's hooks stay,
        doing nothing once the scheme is closed)."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.stop()
        self._remove_handle()
