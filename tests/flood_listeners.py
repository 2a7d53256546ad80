"""A listener in a process of its own whose open-file limit the test lowers (spawned
children import this module): the trainer's listener for hosts (``VersionPublisher``),
rank 0's TCP rank board (``RankHub`` on a ``TcpRankListener``), a same-host trainer's hub
for workers (a SharedMem or MultiProcess sender) or Ray's node-local fd server."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import secrets
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
        _lower_the_limit_when_told(control)
    finally:
        close()


def _limit_open_files() -> None:
    """This process's open-file limit: exactly ``HEADROOM`` more descriptors may be opened.
    The kernel hands out the lowest free number, so the limit counts the free numbers from
    0, gaps included: a pipe inherited at a high number (a child spawned by a test process
    that holds hundreds of descriptors) would otherwise leave hundreds free below it. A
    descriptor above the limit stays usable."""
    taken = {int(fd) for fd in os.listdir("/proc/self/fd")}
    limit = free = 0
    while free < HEADROOM:
        free += limit not in taken
        limit += 1
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def _lower_the_limit_when_told(control: Any) -> None:
    """Wait for the test's word (after its warm-up peer came through: what a handshake
    imports is loaded), lower the open-file limit to a few descriptors above those open,
    say "low", and return when ``control`` says anything more (or ends)."""
    if not control.poll(60):
        return
    control.recv()
    _limit_open_files()
    control.send("low")
    control.poll(60)


#: the same-host schemes whose trainer's hub the test floods
LOCAL_SCHEMES = ("shm", "mp")


def hub_main(scheme_name: str, log_path: str, control: Any) -> None:
    """A trainer of a one-worker ``scheme_name`` scheme ("shm": SharedMem, "mp":
    MultiProcess): send the scheme over ``control``, wait (``connect()``) for the test's
    warm-up worker to take version 0 and say "connected" (or the error), then lower the
    open-file limit when told, as :func:`listener_main` does."""
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    import weightsync as ws

    cls = {"shm": ws.SharedMemWeightSyncScheme, "mp": ws.MultiProcessWeightSyncScheme}
    scheme = cls[scheme_name](num_workers=1, timeout=30)
    sender = scheme.create_sender()
    try:
        sender.register_model(weights())
        control.send(scheme)
        try:
            sender.connect(timeout=30)
        except ws.WeightSyncError as exc:
            control.send(f"{type(exc).__name__}: {exc}")
            return
        control.send("connected")
        _lower_the_limit_when_told(control)
    finally:
        sender.close()


def fd_server_main(log_path: str, control: Any) -> None:
    """Ray's node-local fd server (no Ray needed: the server alone): send its address,
    process and token over ``control``; when told, use up every descriptor the process
    may open (the trainer is at its open-file limit: the server's accept() fails with
    EMFILE) and say "full"; when told again, give them back and say "released"; close
    when ``control`` says anything more (or ends)."""
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    from weightsync.transports.ray.node_local import _FdServer

    server = _FdServer(secrets.token_hex(16))
    held: list[int] = []
    try:
        control.send((server.address, os.getpid(), server.token))
        if not control.poll(60):
            return
        control.recv()
        _limit_open_files()
        with contextlib.suppress(OSError):  # EMFILE: none left
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        control.send("full")
        if not control.poll(60):
            return
        control.recv()
        while held:
            os.close(held.pop())
        control.send("released")
        control.poll(60)
    finally:
        for fd in held:
            os.close(fd)
        server.close()
