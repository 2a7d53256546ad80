"""A worker's end of every scheme: applying whole versions, written once.

A :class:`WeightReceiver` is handed its transport's :class:`~weightsync.core.endpoints.WeightReader`
and owns what every transport shares: the registered model (resolved again at each apply),
the version it holds, one deadline per call, and the apply lock that keeps ``close()``
(from any thread) from releasing memory an apply is reading; a ``close()`` from a signal
handler that interrupted the applying thread itself leaves the release to the moment the
apply ends. ``close()`` cancels the deadline of a ``connect()`` in progress, so a worker
shut down while it waits for its trainer stops waiting at once. A version is applied only
inside ``connect()``, ``poll()`` and ``receive()``: never behind the worker's back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch

from weightsync.core.checks import checked_int
from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import WeightReader
from weightsync.core.errors import SchemaMismatchError, WeightSyncTimeoutError
from weightsync.core.fork_safety import track_for_fork
from weightsync.core.layout import Layout
from weightsync.core.own_tensors import OwnTensors
from weightsync.core.strategy import detach_parameters, flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.schemes.closing import Closable, SyncSettings

logger = logging.getLogger(__name__)

#: how long ``receive()`` waits on the transport between two looks
_WAIT_SLICE = 0.05
#: how long ``close()`` waits for a ``connect()`` in another thread to end once its deadline
#: is cancelled (it ends within one wait slice; past this, that connect() releases the
#: receiver itself as it returns, so close() never hangs)
_CLOSE_WAIT = 10.0


class _ApplyLock:
    """The apply lock, knowing which threads hold it or wait for it: a ``close()`` that a
    signal handler runs in such a thread cannot wait for the lock (its own thread holds it,
    mid-apply), so it leaves the release to ``on_free``, called as that thread lets go."""

    def __init__(self, on_free: Callable[[], None]) -> None:
        self.lock = threading.Lock()
        self._threads: set[int] = set()
        self._on_free = on_free

    def held_here(self) -> bool:
        """Does this thread hold the lock, or wait for it?"""
        return threading.get_ident() in self._threads

    def __enter__(self) -> None:
        self._threads.add(threading.get_ident())  # before the acquire: no gap for a handler
        try:
            self.lock.acquire()
        except BaseException:  # a signal handler raised while this thread waited
            self._leave()
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.lock.release()
        self._leave()

    def _leave(self) -> None:
        self._threads.discard(threading.get_ident())
        self._on_free()


class WeightReceiver(Closable):
    """Worker side: holds one model and applies whole versions to it, only when asked.
    Created by ``scheme.create_receiver(worker_idx)``."""

    def __init__(self, scheme: SyncSettings, worker_idx: int, reader: WeightReader) -> None:
        worker_idx = checked_int(worker_idx, "worker_idx")
        self.scheme = scheme
        self.worker_idx = worker_idx
        self.reader = reader
        self._model: Any = None
        self._own: OwnTensors | None = None  # the module's own tensors, walked once
        self._dest: dict[str, torch.Tensor] | None = None
        self._version = NO_VERSION
        # held while a version is applied: close() waits for it
        self._apply_lock = _ApplyLock(on_free=self._release_if_left)
        self._connect_ended = threading.Condition(self._apply_lock.lock)
        # the deadline of each connect() in progress, by thread: close() cancels them
        self._connecting: dict[int, Deadline] = {}
        self._closed = False
        self._released = False  # the reader is closed (by close(), or by a connect() it cut short)
        self._release_left = False  # a close() in a signal handler left the release to its thread
        self._forked_copy = False
        track_for_fork(self)

    # ------------------------------------------------------------------ model
    def register_model(self, model: Any) -> None:
        """The local model that received weights are written into."""
        dest = flat_tensors(model, what="register_model")
        Layout.from_weights(dest)  # refuses meta-device and sparse tensors now, by name
        self._dest = dest
        self._model = model
        self._own = None

    @property
    def model(self) -> Any:
        return self._model

    @property
    def version(self) -> int:
        """The version the local model holds now (-1 before connect)."""
        return self._version

    def _destination(self) -> dict[str, torch.Tensor]:
        """The model's tensors as they are now. Resolved again (cheaply, for a module) at
        each ``poll()`` that applies and at the start of each ``receive()``, so a model
        changed after ``register_model`` (``load_state_dict(assign=True)``, a replaced
        submodule) receives the weights instead of tensors it no longer uses."""
        if self._dest is None:
            raise RuntimeError(
                f"worker {self.worker_idx}: call register_model(model) before connect()"
            )
        if self.reader.views_model:
            fresh = self._own_tensors()
            if fresh is self._dest:  # a module unchanged since the last call
                return fresh
        elif isinstance(self._model, torch.nn.Module):  # what flat_tensors gives, walk kept
            fresh = detach_parameters(self._module_tensors())
        else:
            fresh = flat_tensors(self._model, what=f"worker {self.worker_idx}'s model")
        if fresh.keys() != self._dest.keys() or any(
            fresh[k] is not t and (fresh[k].shape != t.shape or fresh[k].dtype != t.dtype
                                   or fresh[k].device != t.device)
            for k, t in self._dest.items()
        ):
            Layout.from_weights(self._dest).check_compatible(
                Layout.from_weights(fresh), self_name="the model as registered",
                other_name=f"worker {self.worker_idx}'s model now",
            )
        self._dest = fresh
        return fresh

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """For a reader that re-points ``.data`` (zero-copy): the model's own Parameter and
        buffer objects, so optimizers, hooks and ``state_dict()`` keep working."""
        if isinstance(self._model, torch.nn.Module):
            return self._module_tensors()
        if isinstance(self._model, Mapping) and all(
            isinstance(t, torch.Tensor) for t in self._model.values()
        ):
            return dict(self._model)
        raise TypeError(
            f"worker {self.worker_idx}: zero_copy=True needs an nn.Module or a flat dict of "
            f"tensors (their .data is re-pointed), got {type(self._model).__name__}"
        )

    def _module_tensors(self) -> dict[str, torch.Tensor]:
        """The registered module's own tensors, walked once and checked cheaply at each
        call (``core.own_tensors``): ``state_dict()`` costs about 1 ms for a 32-layer
        transformer, at every ``poll()`` that applies."""
        if self._own is None:
            self._own = OwnTensors(self._model)
        return self._own.get()

    # ------------------------------------------------------------------ API
    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(self.scheme.timeout if timeout is None else timeout)

    def connect(self, timeout: float | None = None) -> int:
        """Join the sender, receive and apply the current version; returns it. A
        ``close()`` from another thread (or a signal handler) meanwhile ends the wait
        within a fraction of a second: this then raises RuntimeError ("this receiver is
        closed"), chained from what the transport was doing."""
        deadline = self._deadline(timeout)
        me = threading.get_ident()
        with self._apply_lock:
            self._check_open()
            self._connecting[me] = deadline
        try:
            version = self._connect(deadline)
        except Exception as exc:
            if deadline.cancelled:
                raise self._closed_error("close() was called while connect() waited") from exc
            raise
        finally:
            self._connect_done(me)
        if deadline.cancelled:  # closed as it finished: the caller must not go on with it
            raise self._closed_error("close() was called while connect() waited")
        return version

    def _connect_done(self, me: int) -> None:
        """A connect() ended: wake a close() waiting for it, or do the release that a
        close() left to it (one that gave up waiting, or ran in this very thread)."""
        with self._apply_lock:
            del self._connecting[me]
            self._connect_ended.notify_all()
            if self._closed and not self._connecting:
                try:
                    self._release()
                except Exception as exc:  # the connect's own error is the one to raise
                    logger.warning("worker %d: releasing after connect() failed: %s",
                                   self.worker_idx, exc)

    def _connect(self, deadline: Deadline) -> int:
        dest = self._destination()
        try:
            self.reader.open(Layout.from_weights(dest) if dest else None, deadline)
        except SchemaMismatchError:
            self._closed = True  # refused for good: released as connect() returns
            raise
        while True:
            with self._apply_lock:
                self._check_open()
                applied = self.reader.apply_newest(self._destination(), self._version, deadline)
            if applied is not None:
                self._version = applied
                break
            if self._version > NO_VERSION:
                break  # a version was applied before (a Ray actor the sender drove)
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"worker {self.worker_idx}: no {self.reader.expecting} within {deadline}"
                )
            self.reader.wait(self._version, deadline)
        self.reader.ack(self._version)
        logger.info("worker %d connected, holds version %d", self.worker_idx, self._version)
        return self._version

    def poll(self) -> int | None:
        """Apply the newest delivered version if newer than ours; never blocks. A version
        delivered before the sender died is still applied; after that the loss is raised."""
        with self._apply_lock:
            self._check_open()
            if self.reader.newer_available(self._version):
                applied = self.reader.apply_newest(self._destination(), self._version,
                                                   Deadline(0))
                if applied is not None:
                    return self._applied(applied)
        self.reader.check_sender(self._version)
        return None

    def receive(self, timeout: float | None = None) -> int | None:
        """Block for a newer version (up to ``timeout``, default the scheme's) and apply it;
        None if none came in time."""
        deadline = self._deadline(timeout)
        with self._apply_lock:
            self._check_open()
            dest = self._destination()  # once per call: not between a wake-up and its apply
        while True:
            with self._apply_lock:
                self._check_open()
                applied = self.reader.apply_newest(dest, self._version,
                                                   Deadline(deadline.slice(_WAIT_SLICE)))
                if applied is not None:
                    return self._applied(applied)
            self.reader.check_sender(self._version)
            if deadline.expired():
                return None
            self.reader.wait(self._version, deadline)

    def newer_published(self) -> bool:
        """Has the sender published a version newer than the one this worker holds? A cheap
        look that applies nothing (``poll()`` may still return None for a moment while the
        version is on its way; ``receive(timeout)`` waits for it)."""
        return self.reader.newer_available(self._version)

    def _applied(self, version: int) -> int:
        logger.debug("worker %d applied version %d", self.worker_idx, version)
        self._version = version
        self.reader.ack(version)
        return version

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _closed_error(self, why: str = "") -> RuntimeError:
        return RuntimeError(f"worker {self.worker_idx}: this receiver is closed"
                            + (f" ({why})" if why else ""))

    def close(self) -> None:
        """Leave the sender (a clean goodbye, not a loss) and release everything; waits for
        an apply in progress in another thread. Callable from any thread or a signal
        handler: a ``connect()`` still waiting (for a trainer not started yet, or its first
        version) is cut short and raises RuntimeError ("this receiver is closed"); a handler
        that interrupted this thread's own ``poll()`` or ``receive()`` returns at once, and
        the apply under way finishes, then releases."""
        if self._closed:
            return
        self._closed = True
        for deadline in tuple(self._connecting.values()):  # no lock: it may be held by a
            deadline.cancel()                               # connect() in this very thread
        if threading.get_ident() in self._connecting:
            return  # a signal handler in the connecting thread: connect() releases as it ends
        if self._apply_lock.held_here():  # a signal handler in a poll(), receive() or apply:
            self._release_left = True     # released as this thread lets the lock go
            return
        self._release_when_free()

    def _release_if_left(self) -> None:
        """Do the release a ``close()`` left to the moment the apply lock was let go."""
        if self._release_left:
            self._release_left = False
            self._release_when_free()

    def _release_when_free(self) -> None:
        """Wait for the ``connect()`` calls in progress to end (their deadlines cancelled)
        and release; past :data:`_CLOSE_WAIT`, the last of them releases as it returns."""
        waited = Deadline(_CLOSE_WAIT)
        with self._connect_ended:
            while self._connecting and not waited.expired():
                for deadline in self._connecting.values():  # one that registered meanwhile
                    deadline.cancel()
                self._connect_ended.wait(waited.slice(_CLOSE_WAIT))
            if self._connecting:
                logger.warning("worker %d: a connect() in another thread did not end within "
                               "%s of close(); it releases the receiver as it returns",
                               self.worker_idx, waited)
                return
            self._release()

    def _release(self) -> None:
        """Close the reader, once (apply lock held); a zero-copy model keeps its version."""
        if self._released:
            return
        self._released = True
        dest = None
        if self._dest is not None and self._version > NO_VERSION:
            try:
                dest = self._destination()
            except Exception as exc:  # the model is gone or changed: nothing to keep
                logger.debug("worker %d: model not resolved at close: %s",
                             self.worker_idx, exc)
        self.reader.close(dest)
