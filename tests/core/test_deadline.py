"""Deadline: the time left for each wait of one blocking call, and cancel() cutting it short."""

from __future__ import annotations

import threading
import time

import pytest

from weightsync.core.deadline import Deadline


def test_a_deadline_counts_down_to_zero():
    deadline = Deadline(0.2)
    assert 0.0 < deadline.remaining() <= 0.2
    assert not deadline.expired()
    assert deadline.slice(0.05) == 0.05
    time.sleep(0.25)
    assert deadline.expired()
    assert deadline.remaining() == 0.0
    assert deadline.slice(0.05) == 0.0


def test_no_deadline_never_expires_until_cancelled():
    deadline = Deadline(None)
    assert deadline.remaining() is None and not deadline.expired()
    assert deadline.slice(0.1) == 0.1
    deadline.cancel()
    assert deadline.expired() and deadline.cancelled
    assert deadline.remaining() == 0.0
    assert deadline.slice(0.1) == 0.0


@pytest.mark.parametrize("timeout", [0.0, 30.0])
def test_cancel_ends_it_at_once(timeout):
    deadline = Deadline(timeout)
    said = str(deadline)
    assert not deadline.cancelled
    deadline.cancel()
    assert deadline.cancelled and deadline.expired()
    assert deadline.remaining() == 0.0 and deadline.slice(1.0) == 0.0
    assert str(deadline) == said  # an error message still names the timeout given


def test_deadlines_derived_from_one_are_cancelled_with_it():
    deadline = Deadline(30)
    earlier, longer = deadline.ahead(), deadline.at_least(60)
    unrelated = Deadline(30)
    assert 25 < earlier.remaining() < 30 and longer.remaining() > 59
    deadline.cancel()
    assert earlier.expired() and longer.expired() and earlier.slice(1.0) == 0.0
    assert not unrelated.expired()


def test_at_least_keeps_the_longer_of_the_two():
    assert 9 < Deadline(10).at_least(1).remaining() <= 10
    assert 4 < Deadline(0.1).at_least(5).remaining() <= 5
    assert Deadline(None).at_least(5).remaining() is None


def test_a_polling_loop_on_it_ends_within_one_slice_of_a_cancel_from_another_thread():
    deadline = Deadline(30)
    threading.Timer(0.2, deadline.cancel).start()
    t0 = time.monotonic()
    while not deadline.expired():
        time.sleep(deadline.slice(0.1))
    assert time.monotonic() - t0 < 1.5


def test_idle_limited_caps_each_wait_not_the_deadline():
    deadline = Deadline(30)
    idle = deadline.idle_limited(2.0)
    assert idle.remaining() == 2.0 and not idle.expired()  # each wait: at most 2 s
    assert 1.0 < Deadline(1.5).idle_limited(2.0).remaining() <= 1.5  # never past the deadline
    assert Deadline(None).idle_limited(2.0).remaining() == 2.0
    deadline.cancel()
    assert idle.expired() and idle.remaining() == 0.0  # cancelled with it
