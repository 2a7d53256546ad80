"""The Ray actor of ``tests/transports/test_endpoints.py`` (importable by Ray workers through
PYTHONPATH): a worker whose ``RayReader`` is driven by a reader script in a thread, while
the writer drives the actor's receiver methods (layout check, join, take) as it does any
actor's. Made threaded (``max_concurrency``), so that deliveries land while the script
runs; set up again for each test (a new scheme, receiver and script), so that the tests
share a few actors instead of starting their own."""

from __future__ import annotations

import os
import threading
from typing import Any

import ray
import torch
from endpoint_ends import Ends, destination, held, run_script

from weightsync.integrations.ray import RayWeightReceiverMixin


@ray.remote(num_cpus=0)
class EndpointActor(RayWeightReceiverMixin):
    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._events: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set_up = False

    def setup(self, ends: Ends, idx: int, script: str) -> int:
        """Be worker ``idx`` of ``ends`` for ``script`` (the previous test's reader closed
        first); returns this actor's pid."""
        if not self.stop(10.0):
            raise RuntimeError("the previous script did not end")
        if self._set_up and self._thread is None:  # set up, never run: close its reader
            self.weightsync_receiver.reader.close(None)
        self.idx, self.script = idx, script
        self.dest = destination(script)
        self.before = held()
        # the sender's calls (``_weightsync_*``) reach the reader through this receiver;
        # the script drives the same reader directly
        self.weightsync_setup(ends.scheme, idx, self.dest, announce=False)
        self._set_up = True
        self._events, self._stop, self._thread = [], threading.Event(), None
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> None:
        """Start the script; its reports are collected by :meth:`events`."""
        def report(event: str, *rest: Any) -> None:
            with self._lock:
                self._events.append((event, self.idx, *rest))

        self._thread = threading.Thread(
            target=run_script, daemon=True,
            args=(self.weightsync_receiver.reader, self.dest, self.script, report, self._stop,
                  self.before))
        self._thread.start()

    def events(self) -> list[tuple[Any, ...]]:
        with self._lock:
            taken, self._events = self._events, []
        return taken

    def stop(self, timeout: float) -> bool:
        """Stop the script; True once it ended (it closes the reader and reports)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
