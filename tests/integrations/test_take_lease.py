"""``take_lease`` against an HTTP server that records what it is asked (the calls vLLM's
routes answer; a real ``vllm serve`` with a trainer killed inside its take is
``test_vllm_serve_remote.py``'s): the lease stays silent while the trainer keeps to its
deadline, and finishes each kind of take it was left inside, in the trainer's order."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("requests")

from weightsync.integrations.vllm.take_lease import TakeLease

TIMEOUT = 0.3


class Server:
    """Answers ``GET /is_paused`` with ``paused`` and records every call, in order."""

    def __init__(self) -> None:
        self.paused = False
        self.calls: list[tuple[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                server.calls.append(("GET", self.path))
                self._answer({"is_paused": server.paused})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.calls.append(("POST", self.path, body) if body else ("POST", self.path))
                if self.path == "/resume":
                    server.paused = False
                self._answer({"success": True})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def posts(self) -> list[tuple[str, Any]]:
        return [c[1:] for c in self.calls if c[0] == "POST"]


@pytest.fixture
def served() -> Iterator[tuple[Server, TakeLease]]:
    server = Server()
    lease = TakeLease(server.url, TIMEOUT, name="worker 0")
    yield server, lease
    lease.close()
    server.httpd.shutdown()


def settle(server: Server, calls: int = 0) -> None:
    """Wait for ``calls`` calls, then past the deadline of whatever could come after."""
    give_up = time.monotonic() + 10
    while len(server.calls) < calls and time.monotonic() < give_up:
        time.sleep(0.02)
    time.sleep(TIMEOUT * 2)


def test_a_trainer_that_keeps_its_deadline_is_left_alone(served: tuple[Server, TakeLease]):
    server, lease = served
    for label in ("3", "4"):  # two takes, each step well within the deadline
        lease.began()
        server.paused = True
        lease.loading()
        lease.loaded(label)
        lease.finished()
        server.paused = False  # the trainer resumed
        time.sleep(TIMEOUT / 3)
    settle(server)
    assert server.calls == []


def test_a_new_take_before_the_deadline_puts_the_last_one_off(served: tuple[Server, TakeLease]):
    server, lease = served
    server.paused = True
    for _ in range(6):
        lease.began()  # each within the deadline of the one before
        time.sleep(TIMEOUT / 2)
    lease.loading()  # a load runs under its own deadline, however long
    time.sleep(TIMEOUT * 2)
    assert server.calls == []


def paused_and_loaded(server: Server, lease: TakeLease, label: str | None) -> None:
    """The trainer's take up to the end of its load (``label``: None, the load failed)."""
    lease.began()
    server.paused = True
    lease.loading()
    lease.loaded(label)


def test_left_after_the_pause_the_server_resumes_on_its_version(
        served: tuple[Server, TakeLease]):
    server, lease = served
    lease.began()
    server.paused = True
    settle(server, 3)
    # no reset and no label: nothing was loaded; the update session is ended
    assert server.posts() == [("/finish_weight_update", {"weight_version": None}),
                              ("/resume",)]
    assert not server.paused


def test_left_after_the_load_the_server_sets_the_label_owed_then_resumes(
        served: tuple[Server, TakeLease]):
    server, lease = served
    paused_and_loaded(server, lease, "7")
    settle(server, 4)
    assert server.posts() == [("/reset_prefix_cache?reset_running_requests=true",),
                              ("/finish_weight_update", {"weight_version": "7"}),
                              ("/resume",)]


def test_left_after_a_failed_load_the_label_stays(served: tuple[Server, TakeLease]):
    server, lease = served
    paused_and_loaded(server, lease, None)
    settle(server, 3)
    assert server.posts() == [("/finish_weight_update", {"weight_version": None}),
                              ("/resume",)]


def test_once_the_label_is_set_the_lease_lets_go(served: tuple[Server, TakeLease]):
    """Only the trainer's /resume is left: a server paused since (by hand, or put to sleep)
    is not the lease's to resume."""
    server, lease = served
    paused_and_loaded(server, lease, "8")
    lease.finished()
    settle(server)
    assert server.calls == []


def test_a_trainer_gone_outside_a_take_changes_nothing(served: tuple[Server, TakeLease]):
    server, lease = served
    lease.began()  # a stage: start, update(stage), finish; the server never paused
    lease.loaded(None)
    lease.finished()
    settle(server)
    assert server.calls == []
    lease.began()  # died inside a stage: the session is ended, nothing else
    lease.loaded(None)
    settle(server, 2)
    assert server.posts() == [("/finish_weight_update", {"weight_version": None})]
