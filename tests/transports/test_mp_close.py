"""Closing the MultiProcess worker's end (``transports/mp/endpoints.py``,
``transports/mp/pipe.py``): every pipe end it was handed is closed once, and no other
file's descriptor with it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from weightsync.transports.local.channel import Message
from weightsync.transports.mp.endpoints import StreamReader
from weightsync.transports.mp.pipe import PipeReader, PipeWriter
from weightsync.transports.mp.snapshots import LAYOUT


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.parametrize("end", ["read", "write"])
def test_a_pipe_end_closed_twice_spares_the_next_owner_of_its_number(end: str) -> None:
    read_fd, write_fd = os.pipe()
    pipe_end = PipeReader(read_fd) if end == "read" else PipeWriter(write_fd, 1 << 16)
    number = read_fd if end == "read" else write_fd
    other = write_fd if end == "read" else read_fd
    pipe_end.close()
    assert not _is_open(number)
    unrelated = os.open(os.devnull, os.O_RDONLY)  # the number's next owner, as the kernel
    if unrelated != number:  # would make it (it gives the lowest free number)
        os.dup2(unrelated, number)
        os.close(unrelated)
    try:
        pipe_end.close()  # e.g. close() after the reader thread closed it
        assert _is_open(number), "a second close() closed another file's descriptor"
    finally:
        if _is_open(number):
            os.close(number)
        os.close(other)


def test_close_closes_a_pipe_that_a_layout_brought_while_it_waited() -> None:
    """A layout read by the reader thread while ``close()`` waits for that thread swaps the
    pipe: both the pipe it replaced and the new one are closed, each once."""
    first_read, first_write = os.pipe()
    second_read, second_write = os.pipe()
    reader: StreamReader

    def close_link() -> None:  # the reader thread's last message, before the join returns
        reader._take_pipe(Message({"t": LAYOUT, "pipe": True}, fds=[second_read]))

    link = SimpleNamespace(worker_idx=0, rejoinable=False, sender_alive=lambda: True,
                           close=close_link)
    reader = StreamReader(link)  # type: ignore[arg-type]
    reader._take_pipe(Message({"t": LAYOUT, "pipe": True}, fds=[first_read]))
    try:
        reader.close(None)
        assert not _is_open(first_read)
        assert not _is_open(second_read), "the pipe the last layout brought was left open"
    finally:
        for fd in (first_read, second_read):
            if _is_open(fd):
                os.close(fd)
        os.close(first_write)
        os.close(second_write)
