"""The vLLM servers one trainer engine drives, written once for every mode: vLLM's client
calls on a server (init; start, update, finish), on the one server of the directory path
or on all of them at once (each within the engine's timeout, then one error naming each
server that failed), and the figures of each version sent (``stats``)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import TrainerSessionEndedError, WeightSyncError, WeightSyncTimeoutError
from weightsync.integrations.vllm.server_take import (
    served_label,
    server_url,
    take,
    wait_host_staged,
)
from weightsync.serving.sessions import ONE_TRAINER
from weightsync.transports.net.publisher import StreamFigures, VersionPublisher, figures_dict

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from weightsync.integrations.vllm.trainer_adapter import ServedAdapter

#: a call on one server: ``call(index, client)``
ServerCall = Callable[[int, Any], None]


@dataclass
class ServerRound:
    """The calls of one version on every server, started at once (``Servers.start_round``)."""

    what: str  # "init" or "update"
    version: int
    futures: dict[int, Future[None]]  # server index -> its call
    deadline: Deadline  # the engine's timeout, from the round's start
    started: float = field(default_factory=time.perf_counter)
    served: list[int] = field(default_factory=list)  # once ended: the servers that got it


def as_clients(client: Any) -> list[Any]:
    """The servers' clients as vLLM hands them to a trainer engine: one, or a list."""
    return list(client) if isinstance(client, (list, tuple)) else [client]


class Servers:
    """The servers of one trainer engine (``clients``; ``client``: as vLLM handed them) and
    what every call on them carries: the engine's ``session``, its ``timeout``; in adapter
    mode the ``adapter`` whose name each server points at each version."""

    def __init__(self, client: Any, clients: list[Any], *, session: str, timeout: float,
                 reset_prefix_cache: bool, adapter: ServedAdapter | None,
                 pause: str = "keep") -> None:
        self.client = client
        self.clients = clients
        self.session = session
        self.timeout = timeout
        self.reset_cache = reset_prefix_cache  # empty each HTTP server's prefix cache after a load
        self.adapter = adapter
        self.pause = pause  # vLLM's pause mode around an in-flight take ("keep", "wait")
        #: version v is labelled ``label_base + v`` on the servers (``learn_labels``)
        self.label_base = 0
        self.needs_init: set[int] = set()  # servers to initialise again (they failed)
        self.round_inits: list[int] = []  # servers initialised during the round under way
        #: per server URL, the seconds of each step of its in-flight take of the version
        #: under way (pause, load, label, reset, resume: how long it stopped generating)
        self.round_takes: dict[str, dict[str, float]] = {}
        self._stats: list[dict[str, Any]] = []
        self._whole_streams = 0

    def init_server(self, index: int, client: Any, info: dict[str, Any], version: int) -> None:
        """vLLM's init call on server ``index``: ``info``, this engine's session and, in
        adapter mode, where the server's host keeps the adapter's versions."""
        adapter = {} if self.adapter is None else self.adapter.init_fields(index)
        client.init_weight_transfer_engine({**info, "session": self.session, **adapter})
        self.round_inits.append(index)  # its host streamed the version once more
        self.reset_prefix_cache(client, version)

    def learn_labels(self) -> None:
        """Number this session's labels above every numeric label the servers serve now
        (a server that cannot say counts as none): labels on a server never repeat or go
        backwards, across trainer sessions and restarts too."""
        held = []
        for client in self.clients:
            try:
                held.append(served_label(client, min(self.timeout, 10.0)))
            except Exception as exc:  # an unreachable server: its init names it
                logger.info("server %s did not say its label: %s", server_name(client), exc)
        numbers = [label for label in held if label is not None]
        self.label_base = max(numbers) + 1 if numbers else 0

    def label(self, version: int) -> str:
        """The label version ``version`` of this session carries on the servers."""
        return str(self.label_base + version)

    def label_server(self, client: Any, version: int) -> None:
        """Set the label of the version a server loaded at its init (an update session that
        loads nothing)."""
        client.start_weight_update()
        client.finish_weight_update(weight_version=self.label(version))

    def in_flight(self, client: Any) -> bool:
        """Whether a server takes versions in flight (``server_take``): an HTTP server
        loading full weights."""
        return self.adapter is None and server_url(client) is not None

    def bring_in_flight(self, index: int, client: Any, version: int,
                        publisher: VersionPublisher,
                        init_info: Callable[[int], dict[str, Any]],
                        relays: list[str] | None = None) -> None:
        """Server ``index`` stages ``version`` in the background (with its init, from
        ``init_info(index)``, if it is new or failed: ``needs_init``; from ``relays``, other
        servers' hosts, before the trainer), keeps generating until its host staged it,
        then takes it inside vLLM's pause, labelled; all within the engine's timeout."""
        deadline = Deadline(self.timeout)
        url = server_url(client)
        assert url is not None
        after = publisher.streams_ended(version, f"server{index}")
        if index in self.needs_init:
            self.needs_init.discard(index)  # a failure puts it back (finish_round)
            # its one stream of the version (no other follows at the take)
            client.init_weight_transfer_engine(
                {**init_info(index), "session": self.session, "stage_version": version,
                 "url": url, **relaying(relays)})
        else:
            client.start_weight_update()
            client.update_weights({"version": version, "session": self.session, "stage": True,
                                   **relaying(relays)})
            client.finish_weight_update()
        wait_host_staged(publisher, index, url, version, after, deadline)
        self.round_takes[url] = take(client, url, version, self.label(version), self.session,
                                     self.pause, deadline,
                                     lambda: self.reset_prefix_cache(client, version))

    def point_adapter(self, index: int, client: Any, version: int) -> None:
        """Adapter mode: point the adapter's name on server ``index`` at ``version``."""
        if self.adapter is not None:
            self.adapter.point(index, client, version, self.timeout)

    def update_server(self, index: int, client: Any, version: int,
                      init: ServerCall | None = None, relays: list[str] | None = None) -> None:
        """vLLM's update calls for server ``index`` (first initialised again by ``init`` if
        it failed), loading ``version`` (from ``relays`` before the trainer); an adapter is
        pointed at before the version label is set, so the label never names a version the
        adapter's name does not serve."""
        if index in self.needs_init and init is not None:
            init(index, client)
            self.needs_init.discard(index)
        client.start_weight_update()
        client.update_weights({"version": version, "session": self.session, **relaying(relays)})
        try:
            self.point_adapter(index, client, version)
            self.reset_prefix_cache(client, version)
        except BaseException:
            with contextlib.suppress(Exception):
                client.finish_weight_update()  # end the server's update session, unlabelled
            raise
        client.finish_weight_update(weight_version=self.label(version))

    def update_sole_server(self, version: int) -> None:
        """The directory path's one server loads ``version``; its refusal of this session
        (another trainer took it over) is a ``TrainerSessionEndedError`` saying so."""
        try:
            self.update_server(0, self.client, version)
        except Exception as exc:  # the server's refusal, as its client raised it: named
            if isinstance(exc, TrainerSessionEndedError) or not session_ended(exc):
                raise
            raise TrainerSessionEndedError(
                f"trainer session {self.session}: another trainer took over server "
                f"{server_name(self.client)} ({ONE_TRAINER}): {server_said(exc)}",
                session=self.session) from exc

    def reset_prefix_cache(self, client: Any, version: int) -> None:
        """Empty an HTTP server's prefix cache once it loaded a version (its cached blocks,
        and those of requests running now, were computed with the old weights); an
        in-process client empties its engine's itself. Not in adapter mode."""
        url = getattr(client, "base_url", None)
        if not self.reset_cache or self.adapter is not None or url is None:
            return
        import requests

        reply = requests.post(f"{url}/reset_prefix_cache", timeout=self.timeout,
                              params={"reset_running_requests": "true"})
        reply.raise_for_status()
        if not reply.json().get("success", False):
            raise WeightSyncError(
                f"server {url} loaded version {version} but could not empty its prefix "
                "cache (blocks still held); its cached prompts would mix two versions")

    def start_round(self, what: str, version: int, call: ServerCall) -> ServerRound:
        """Start ``call`` on every server at once (``what``: "init" or "update"); the round
        is ended by :meth:`finish_round`."""
        self.round_inits = []
        self.round_takes = {}
        pool = ThreadPoolExecutor(max(len(self.clients), 1), thread_name_prefix="weightsync-server")
        try:
            futures = {i: pool.submit(call, i, c) for i, c in enumerate(self.clients)}
        finally:
            pool.shutdown(wait=False)  # its threads end with their calls
        return ServerRound(what, version, futures, Deadline(self.timeout))

    def finish_round(self, calls: ServerRound, publisher: VersionPublisher) -> None:
        """Wait for a round's calls (until the engine's timeout from its start), record its
        figures and the servers that got the version (``calls.served``); then raise one
        error naming each server that failed or did not answer in time. A stalled call is
        left behind (a blocked HTTP call cannot be cancelled); its server is initialised
        again."""
        wait_futures(calls.futures.values(), timeout=calls.deadline.remaining())
        errors: dict[str, BaseException] = {}
        for index, future in calls.futures.items():
            name = server_name(self.clients[index])
            if not future.done():
                errors[name] = WeightSyncTimeoutError(
                    f"no answer within {self.timeout:g}s (the engine's timeout)")
            elif future.exception() is not None:
                errors[name] = future.exception()  # type: ignore[assignment]
            if name in errors:
                self.needs_init.add(index)
            else:
                calls.served.append(index)
        # one stream per server that answered, and in an update one more per server
        # initialised again on the way (its init fetched the version whole first)
        again = len(self.round_inits) if calls.what != "init" else 0
        expected = len(self.clients) - len(errors) + again
        streams = publisher.wait_streams(calls.version, expected, 5.0)
        self.record(calls.version, calls.what, time.perf_counter() - calls.started, streams, errors,
                    relays=publisher.relay_names())
        if errors:
            self._raise_for(calls.version, calls.what, errors)

    def _raise_for(self, version: int, what: str, errors: dict[str, BaseException]) -> None:
        detail = "; ".join(f"{name}: {type(exc).__name__}: {server_said(exc)}"
                           for name, exc in errors.items())
        message = (f"version {version} ({what}) is not served by {len(errors)} of "
                   f"{len(self.clients)} servers: {detail}")
        taken = [name for name, exc in errors.items() if session_ended(exc)]
        if taken:  # re-initialising them would only be refused: this session ended there
            raise TrainerSessionEndedError(
                f"trainer session {self.session}: another trainer took over server(s) "
                f"{taken} ({ONE_TRAINER}); {message}",
                session=self.session) from next(iter(errors.values()))
        raise WeightSyncError(message) from next(iter(errors.values()))

    def record(self, version: int, what: str, seconds: float, streams: list[StreamFigures],
               errors: dict[str, BaseException], relays: Mapping[str, str] | None = None
               ) -> None:
        """The figures of one version sent (the newest 64 are kept); ``relays``: each
        relay's address -> its server's name (where a host fetched from, by name)."""
        relays = relays or {}
        self._stats.append({
            "version": version, "call": what, "seconds": seconds,
            "pack_seconds": 0.0,  # the network mode's: amended once its sender says
            "wire_bytes": sum(f.wire_bytes for f in streams),
            "chunks": sum(f.chunks for f in streams),
            "delta_chunks": sum(f.delta_chunks for f in streams),
            "hosts": [figures_dict(f) for f in streams],
            # per host (the id it proved, e.g. server1): "trainer", or the server whose
            # host relayed it (its address when unknown)
            "fetched_from": {f.peer_id or f.host: relays.get(f.source, f.source)
                             for f in streams if not f.error},
            # hosts that got this version whole though delta is on, and why
            "whole": {f.host: f.whole_reason for f in streams if f.whole_reason},
            "failed": {name: str(exc) for name, exc in errors.items()},
            # in flight: how long each server stopped generating for its take, and its steps
            "take_seconds": {url: sum(p.values()) for url, p in self.round_takes.items()},
            "take_phases": {url: dict(p) for url, p in self.round_takes.items()},
        })
        self._whole_streams += sum(1 for f in streams if f.whole_reason)
        del self._stats[:-64]

    def amend(self, version: int, **figures: Any) -> None:
        """Add ``figures`` to those recorded for ``version`` (if they were)."""
        for record in reversed(self._stats):
            if record["version"] == version:
                record.update(figures)
                return

    def stats(self) -> dict[str, Any]:
        """Per version sent on the network path: wire bytes, chunks and chunks sent as
        deltas (all hosts together, and per host), the hosts that got it whole and why,
        seconds; ``"last"`` is the newest; ``"whole_streams"`` counts, over the session,
        the streams that went whole with delta on (a host's first version included)."""
        return {"last": self._stats[-1] if self._stats else None, "versions": list(self._stats),
                "whole_streams": self._whole_streams}


def relaying(relays: list[str] | None) -> dict[str, Any]:
    """The ``relays`` field of a call, when there are any (a server of an older weightsync
    would refuse a field it does not know)."""
    return {"relays": relays} if relays else {}


def server_name(client: Any) -> str:
    """How an error names a server: its URL when the client has one."""
    return str(getattr(client, "base_url", None) or client)


def server_said(exc: BaseException) -> str:
    """A server's error as its client raised it, with what the server said: over HTTP
    (requests' ``HTTPError``) the message is in the reply's body, not in the error."""
    body = getattr(getattr(exc, "response", None), "text", None)
    if not isinstance(body, str) or not body:
        return str(exc)
    with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):  # not vLLM's JSON
        body = str(json.loads(body)["error"]["message"])
    return f"{exc} (the server said: {body[:4000]})"


def session_ended(exc: BaseException) -> bool:
    """Whether a server's error (as its client raised it) is its
    ``TrainerSessionEndedError``."""
    return isinstance(exc, TrainerSessionEndedError) or ONE_TRAINER in server_said(exc)
