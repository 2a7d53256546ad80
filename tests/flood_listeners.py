"""A listener in a process of its own whose open-file limit the test lowers (spawned
children import this module): the trainer's listener for hosts (``VersionPublisher``) or
rank 0's TCP rank board (``RankHub`` on a ``TcpRankListener``)."""

from __future__ import annotations

import logging
import os
import resource
import socket
from typing import Any

import torch

#: descriptors left free under the lowered limit: a few connections, then EMFILE
HEADROOM = 8


def weights() -> dict[str, torch.Tensor]:
    """What the publisher serves (the test's reference)."""
    return {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listener_main(kind: str, key: str, log_path: str, control: Any) -> None:
    """Serve as ``kind`` ("publisher" or "board") with ``key``; send the address over
    ``control``, lower the open-file limit when told (after the test's warm-up peer came
    through), say "low", and close when ``control`` says anything more (or ends)."""
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if kind == "publisher":
        from weightsync.transports.net.packed import pack
        from weightsync.transports.net.publisher import VersionPublisher

        publisher = VersionPublisher("127.0.0.1:0", key, timeout=5.0, delta=False)
        publisher.publish(pack(weights(), 0))
        address, close = publisher.address, publisher.close
    else:
        from weightsync.transports.net.board import TcpRankListener
        from weightsync.transports.ranks.socket_board import RankHub

        address = f"127.0.0.1:{_free_port()}"
        hub = RankHub(address, key, None, 2, listener=TcpRankListener(address))
        hub.start()
        close = hub.close
    try:
        control.send(address)
        if not control.poll(60):
            return
        control.recv()
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + HEADROOM, hard))
        control.send("low")
        control.poll(60)
    finally:
        close()
