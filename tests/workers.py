"""Worker-process bodies for the multi-process tests (importable by spawn/forkserver)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

import torch

import weightsync as ws


class StopFlag:
    """The workers' stop signal, lock-free: a worker SIGKILLed inside ``Event.is_set()``
    keeps the Event's lock forever, and the next ``set()`` would hang the test. It lives
    here, not in conftest, so that spawn and forkserver can pickle it."""

    def __init__(self) -> None:
        self._flag = mp.get_context("spawn").RawValue("b", 0)

    def set(self) -> None:
        self._flag.value = 1

    def clear(self) -> None:
        self._flag.value = 0

    def is_set(self) -> bool:
        return bool(self._flag.value)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.is_set()


def make_model(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
        torch.nn.Linear(width, 4),
    )


def checksum(model: torch.nn.Module) -> float:
    return float(sum(t.detach().double().sum() for t in model.state_dict().values()))


def fill_all(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(value)


def echo_worker(scheme: Any, idx: int, out: Any, stop: Any, width: int = 16) -> None:
    """Connect, report (event, idx, version, checksum), then report every new version."""
    model = make_model(width)
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    try:
        version = receiver.connect(timeout=30)
        out.put(("connected", idx, version, checksum(model)))
        while not stop.is_set():
            version = receiver.receive(timeout=0.1)
            if version is not None:
                out.put(("version", idx, version, checksum(model)))
    except ws.WeightSyncError as exc:
        out.put(("error", idx, type(exc).__name__, str(exc)))
    finally:
        receiver.close()


def scribble_worker(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    """Connect, then overwrite the local weights; report what it holds after each step."""
    model = make_model()
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    receiver.connect(timeout=30)
    fill_all(model, 1234.0)
    out.put(("scribbled", idx, receiver.version, checksum(model)))
    stop.wait(30)
    receiver.close()


def hammer_worker(scheme: Any, idx: int, out: Any, stop: Any, width: int = 64) -> None:
    """Poll in a tight loop; after every read check each tensor equals receiver.version."""
    model = make_model(width)
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    receiver.connect(timeout=30)
    reads = violations = applied = 0
    first_bad = None
    while not stop.is_set():
        if receiver.poll() is not None:
            applied += 1
        expected = float(max(receiver.version, 0))
        for t in model.state_dict().values():  # zero-copy re-points the tensors' data
            if not bool((t == expected).all()):
                violations += 1
                if first_bad is None:
                    first_bad = (receiver.version, float(t.flatten()[0]))
                break
        reads += 1
    out.put(("hammer", idx, reads, violations, applied, first_bad, receiver.version))
    receiver.close()


def mismatched_worker(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    """A worker whose model has another shape: connect must raise SchemaMismatchError."""
    model = make_model(width=17)
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    try:
        receiver.connect(timeout=30)
        out.put(("connected", idx, receiver.version, 0.0))
    except ws.SchemaMismatchError as exc:
        out.put(("mismatch", idx, exc.key, str(exc)))
    finally:
        receiver.close()


def trainer_process(scheme: Any, out: Any, sends: int) -> None:
    """A trainer in its own process (to be killed by the test)."""
    model = make_model()
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    for _ in range(sends):
        fill_all(model, float(sender.version + 1))
        sender.send(timeout=30)
    out.put(("trainer-ready", sender.version))
    time.sleep(300)


def drain(out: Any, count: int, timeout: float = 30.0) -> list[tuple]:
    """Take ``count`` items from a queue, failing the test (not hanging) past ``timeout``."""
    items, deadline = [], time.monotonic() + timeout
    while len(items) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {count} messages, got {items}")
        try:
            items.append(out.get(timeout=left))
        except queue.Empty:
            continue
    return items


def lag_when(sender: Any, expected: dict[int, int], timeout: float = 10.0) -> dict[int, int]:
    """``sender.worker_lag()`` once it equals ``expected``, or as it stands at ``timeout``: a
    worker acks after it applied, and the network scheme's ack crosses a socket after the
    worker's own report to the test, so the trainer may hear it a moment later."""
    deadline = time.monotonic() + timeout
    lag = sender.worker_lag()
    while lag != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        lag = sender.worker_lag()
    return lag


def close_during_connect(receiver: Any, after: float = 0.3, within: float = 3.0) -> BaseException:
    """Call ``receiver.close()`` from another thread ``after`` seconds into a
    ``connect(timeout=30)``: the connect must raise the closed error ``within`` seconds, and
    the receiver stay closed. Returns that error (its ``__cause__`` says what it waited on)."""
    import threading

    closer = threading.Timer(after, receiver.close)
    t0 = time.monotonic()
    closer.start()
    try:
        try:
            receiver.connect(timeout=30)
        except RuntimeError as exc:
            error: BaseException = exc
        else:
            raise AssertionError("connect() returned although close() was called during it")
        took = time.monotonic() - t0
    finally:
        closer.join(15)
    assert "this receiver is closed" in str(error), repr(error)
    assert took < within, f"connect() took {took:.1f} s to notice close()"
    assert not closer.is_alive(), "close() did not return"
    try:
        receiver.poll()
    except RuntimeError as exc:
        assert "this receiver is closed" in str(exc)
    else:
        raise AssertionError("poll() worked on a closed receiver")
    return error
