"""Same-host listeners that a connection flood cannot kill: a SharedMem or MultiProcess
trainer's hub for workers, and Ray's node-local fd server, go on accepting after
``accept()`` fails (EMFILE under a low open-file limit), so that a real worker (or actor)
still gets in within its deadline once the flood ends; and the fd server answers while
silent connections hold it (each request has one deadline, several are served at once)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import flood_listeners
import pytest
import torch

from weightsync.transports.ray import node_local

#: connections the test tries to open: more than the descriptors left to the listener's
#: process and its listen backlog (64) together; a full backlog ends the flood early
FLOOD = 6 * flood_listeners.HEADROOM + 64


@contextlib.contextmanager
def _listener_process(target: Callable[..., None], *args: Any) -> Iterator[Any]:
    """``target(*args, control)`` in a spawned process of its own; yields the test's end
    of ``control`` (closing it tells the process to close its listener)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    child.start()
    try:
        assert ours.poll(60), "the listener's process did not start"
        yield ours
    finally:
        ours.close()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)


def _flood(address: str) -> list[socket.socket]:
    """Up to :data:`FLOOD` connections to the Unix listener at ``address`` that say
    nothing, made without blocking (a full backlog, EAGAIN, ends the flood)."""
    flood: list[socket.socket] = []
    for _ in range(FLOOD):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(address)
        except BlockingIOError:
            sock.close()
            break
        flood.append(sock)
    return flood


def _lower_and_flood(control: Any, address: str, log: Path) -> None:
    """Have the listener's process lower its open-file limit, flood its listener until
    accept() fails with EMFILE (or 5 s passed: on to the checks either way), then end
    the flood."""
    control.send("lower the limit")
    assert control.poll(10) and control.recv() == "low"
    flood = _flood(address)
    try:
        end = time.monotonic() + 5.0
        while "EMFILE" not in log.read_text() and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        for sock in flood:
            sock.close()


def _assert_logged_emfile(log: Path) -> None:
    text = log.read_text()
    assert "accept() failed (EMFILE" in text and "open-file limit" in text, text


# ---------------------------------------------------------------------- the trainer's hub
def _worker_takes_version_0(scheme: Any, timeout: float) -> None:
    """Worker 0 (this process) connects within ``timeout`` and holds version 0, the
    trainer's weights; raises otherwise."""
    weights = {name: torch.zeros_like(t) for name, t in flood_listeners.weights().items()}
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(weights)
    try:
        assert receiver.connect(timeout=timeout) == 0
    finally:
        receiver.close()
    for name, tensor in flood_listeners.weights().items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("scheme_name", flood_listeners.LOCAL_SCHEMES)
def test_the_hub_survives_an_accept_flood_under_a_low_open_file_limit(scheme_name: str,
                                                                      tmp_path: Path):
    """The trainer's process may open only a few more files: a flood of connections to its
    hub makes accept() fail with EMFILE. The hub says so in its log and goes on; once the
    flood ends, a real worker connects and takes the trainer's version within its
    deadline. (Before, the hub's thread stopped at the first accept error: the error was
    kept for the trainer's next call, and no worker could join again.)"""
    log = tmp_path / "hub.log"
    with _listener_process(flood_listeners.hub_main, scheme_name, str(log)) as control:
        scheme = control.recv()
        _worker_takes_version_0(scheme, 30.0)  # warm: what joining imports is loaded
        assert control.poll(30) and control.recv() == "connected"
        _lower_and_flood(control, scheme.address, log)
        started = time.monotonic()
        _worker_takes_version_0(scheme, 5.0)
        assert time.monotonic() - started < 5.0
        _assert_logged_emfile(log)


# ---------------------------------------------------------------------- Ray's fd server
def _probe_within(address: str, pid: int, token: str, timeout: float) -> bool:
    """Whether the fd server at ``address`` (process ``pid``) answers a probe with
    ``token`` within ``timeout`` (a connection refused or not answered is tried again)."""
    end = time.monotonic() + timeout
    while True:
        try:
            answer, _fds = node_local._request(address, pid, {"probe": token})
            return answer.get("ok") is True
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.05)


def test_the_fd_server_survives_accept_errors_at_the_open_file_limit(tmp_path: Path):
    """Ray's node-local fd server (the trainer's, handing segment fds to co-located
    actors) in a process that has used up its open-file limit: a connection makes its
    accept() fail with EMFILE. It says so and goes on; once descriptors are free again,
    it answers an actor within its deadline. (Before, its thread returned without a word
    at the first accept error, and no actor could take a segment any more.)"""
    log = tmp_path / "fd-server.log"
    with _listener_process(flood_listeners.fd_server_main, str(log)) as control:
        address, pid, token = control.recv()
        assert _probe_within(address, pid, token, 10.0)  # warm
        control.send("use up the descriptors")
        assert control.poll(10) and control.recv() == "full"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(address)  # waits in the backlog: accept() fails with EMFILE
            end = time.monotonic() + 5.0
            while "EMFILE" not in log.read_text() and time.monotonic() < end:
                time.sleep(0.05)
        control.send("give them back")
        assert control.poll(10) and control.recv() == "released"
        started = time.monotonic()
        assert _probe_within(address, pid, token, 5.0), "the fd server no longer answers"
        assert time.monotonic() - started < 5.0
        _assert_logged_emfile(log)


def test_silent_connections_do_not_stall_the_fd_server():
    """Connections that never send their request hold the fd server only until their
    deadline, and meanwhile others are answered at once. (Before, it served one
    connection at a time, each for up to 5 s: a few silent ones held every actor off.)"""
    server = node_local._FdServer(secrets.token_hex(16))
    silent: list[socket.socket] = []
    try:
        for _ in range(4):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect(server.address)
            silent.append(sock)
        time.sleep(0.2)  # the server has taken them
        started = time.monotonic()
        answer, fds = node_local._request(server.address, os.getpid(), {"probe": server.token})
        assert answer == {"ok": True} and fds == []
        assert time.monotonic() - started < 2.0
    finally:
        for sock in silent:
            sock.close()
        server.close()
