"""The local channel (``transports.local.channel``): descriptors passed with a frame that
is never returned to the caller (the peer gone mid-frame, a malformed frame) are closed,
not left open in the receiving process."""

from __future__ import annotations

import os
import socket

import pytest

from weightsync.transports.local.channel import _PREFIX, Channel, ChannelClosed


def _copies_of(name: str) -> int:
    """How many descriptors of this process name the memfd ``name``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{name} (deleted)"
        except OSError:
            continue
    return count


@pytest.mark.parametrize("frame", ["cut after its prefix", "a header that is no object",
                                   "cut in its payload"])
def test_descriptors_of_a_frame_not_returned_are_closed(frame: str):
    raw, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = Channel(theirs)
    passed = os.memfd_create("weightsync-test")
    try:
        body = b"[1]" if frame == "a header that is no object" else b'{"x": 1}'
        payload = 16 if frame == "cut in its payload" else 0
        prefix = _PREFIX.pack(len(body), payload)
        if frame == "cut after its prefix":
            socket.send_fds(raw, [prefix], [passed])
        else:
            socket.send_fds(raw, [prefix + body + b"\0" * (payload // 2)], [passed])
        raw.close()  # the peer goes, mid-frame
        with pytest.raises(ChannelClosed):
            channel.recv(timeout=5)
        assert _copies_of("weightsync-test") == 1, "the copy that came with the frame is open"
    finally:
        channel.close()
        os.close(passed)
