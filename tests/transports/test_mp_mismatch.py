"""A worker's last words reach the trainer whichever trainer thread notices it left first.

A worker whose model does not match reports the mismatch and hangs up at once. The hub
thread normally reads the report before the hang-up; but the streamer writing the next
version to that worker (MultiProcess) or the look for dead workers after a publish
(SharedMem) may find the broken connection first. These tests force that order without
any sleep: the hub is stopped after the worker joined, so it never reads the report, and
the other thread must read it when it takes the loss. Real sockets, real handshakes, the
real receiver in a thread of this process. Every wait has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from workers import make_model

import weightsync as ws
from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.layout import Layout
from weightsync.core.strategy import flat_tensors

SCHEMES = {"mp": ws.MultiProcessWeightSyncScheme, "shm": ws.SharedMemWeightSyncScheme}


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Trainer:
    """A sender's writer driven step by step (its hub can be stopped between steps)."""

    def __init__(self, scheme: Any) -> None:
        self.sender = scheme.create_sender()
        self.writer = self.sender.writer
        self.flat = flat_tensors(make_model(), what="the trainer's model")
        self.layout = Layout.from_weights(self.flat)
        self.writer.start(Deadline(10))

    def send(self, version: int) -> Losses:
        lost = self.writer.publish(self.flat, self.layout, [0], version, Deadline(10))
        lost.update(self.writer.deliver([0], version, Deadline(10)))
        return lost

    def stop_reading(self) -> None:
        """From here on the hub thread reads no worker message (as if it never ran again)."""
        self.writer.members.hub.stop()

    def worker_lost(self) -> bool:
        return bool(self.writer.members.table.workers[0].lost)


class Worker:
    """Worker 0's real receiver, connecting in a thread; keeps what connect raised."""

    def __init__(self, scheme: Any, width: int) -> None:
        self.receiver = scheme.create_receiver(worker_idx=0)
        self.receiver.register_model(make_model(width))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._connect, daemon=True)
        self.thread.start()

    def _connect(self) -> None:
        try:
            self.receiver.connect(timeout=10)
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive(), "the worker's connect() did not return"


@pytest.fixture(params=sorted(SCHEMES))
def scheme(request: pytest.FixtureRequest) -> Any:
    return SCHEMES[request.param](num_workers=1, timeout=10)


@pytest.fixture
def trainer(scheme: Any) -> Iterator[Trainer]:
    trainer = Trainer(scheme)
    yield trainer
    trainer.sender.close()


def test_a_mismatch_reported_before_the_hang_up_is_not_lost_with_the_connection(scheme, trainer):
    worker = Worker(scheme, width=17)
    wait_for("worker 0 to join", lambda: 0 in trainer.writer.members.hub_channels())
    trainer.stop_reading()
    trainer.send(0)
    worker.join()  # it got the layout, reported the mismatch, said goodbye and hung up
    assert isinstance(worker.error, ws.SchemaMismatchError), worker.error
    key = worker.error.key
    assert key is not None

    trainer.send(1)  # the streamer's write breaks (MultiProcess), or the look finds it (SharedMem)
    wait_for("worker 0 to be taken as gone", trainer.worker_lost)
    with pytest.raises(ws.SchemaMismatchError, match="worker 0") as info:
        trainer.writer.wait_joined(1, Deadline(5))
    message = str(info.value)
    assert key in message and "refused" in message
    refused = info.value  # the details come as fields too
    assert (refused.key, refused.expected, refused.got) == (
        key, worker.error.expected, worker.error.got)
    assert trainer.writer.members.reachable([0])[1] == {0: "closed its receiver"}


def test_a_worker_that_vanishes_without_a_word_is_still_reported_lost_at_once(scheme, trainer):
    worker = Worker(scheme, width=16)
    wait_for("worker 0 to join", lambda: 0 in trainer.writer.members.hub_channels())
    trainer.send(0)
    worker.join()
    assert worker.error is None and worker.receiver.version == 0
    trainer.stop_reading()
    worker.receiver.reader.link.channel.close()  # the socket ends as at a crash: no goodbye

    t0 = time.monotonic()
    lost = trainer.send(1)
    wait_for("worker 0 to be taken as gone", trainer.worker_lost, timeout=5)
    lost.update(trainer.writer.members.reachable([0])[1])
    assert time.monotonic() - t0 < 5
    assert list(lost) == [0] and "closed its receiver" not in lost[0]
    assert trainer.writer.members.table.workers[0].error is None
    worker.receiver.close()
