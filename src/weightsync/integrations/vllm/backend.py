"""weightsync as a vLLM weight-transfer backend (``WeightTransferConfig(backend="weightsync")``).

Registered by the ``vllm.general_plugins`` entry point (``plugin.register``), which vLLM runs
in every one of its processes. The worker side (``WeightSyncWeightTransferEngine``) reads
versions from a ``VLLMDoubleBufferSyncScheme`` directory; the trainer side
(``WeightSyncTrainerEngine``) writes them and drives vLLM's calls::

    llm = LLM(model=..., weight_transfer_config=WeightTransferConfig(backend="weightsync"))
    llm.init_weight_transfer_engine({"init_info": {"directory": "/dev/shm/policy"}})
    # per update, after sender.update_weights() returned version v in the trainer:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": v}})
    llm.finish_weight_update(weight_version=str(v))

This module imports vLLM; the rest of the package does not. Importing it registers the
backend with vLLM's factories (``plugin.register``, idempotent), so a trainer process that
is not a vLLM process finds ``WeightTransferTrainerFactory.trainer_init``'s ``weightsync``
engine as soon as it imports ``WeightSyncTrainerInitInfo``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from weightsync.core.deadline import Deadline, required_timeout
from weightsync.core.errors import (
    TrainerSessionEndedError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.core.shards import sharded_flat
from weightsync.integrations.vllm.lora_routes import LOAD_MODES, load_on_server
from weightsync.integrations.vllm.plugin import register
from weightsync.integrations.vllm.worker_engine import (  # noqa: F401 (re-exported)
    WeightSyncInitInfo,
    WeightSyncUpdateInfo,
    WeightSyncWeightTransferEngine,
)
from weightsync.schemes.double_buffer import (
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightSender,
)
from weightsync.schemes.lora import LoraAdapter
from weightsync.schemes.ranks import checked_trainer_ranks, trainer_rank
from weightsync.serving.adapter_files import version_path
from weightsync.serving.sessions import ENDED_SESSIONS, ONE_TRAINER, checked_session  # noqa: F401
from weightsync.transports.delta.codec import check_available as check_delta_available
from weightsync.transports.net.handshake import host_credential
from weightsync.transports.net.packed import PackedVersion, plan
from weightsync.transports.net.publisher import StreamFigures, VersionPublisher, figures_dict
from weightsync.transports.net.sharded import (
    NetRankLead,
    NetRankMember,
    checked_rank_key,
    host_token,
)
from weightsync.transports.net.wire import split_address

logger = logging.getLogger(__name__)

BACKEND = "weightsync"


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer side: where versions go (``directory``, on one host; or ``address``,
    ``HOST:PORT`` where the trainer listens for its servers' hosts), in which dtype (e.g.
    "bfloat16"), for how many workers; ``delta``: each host gets the difference from the
    version it holds (network path).

    ``adapter``: send only the active LoRA adapter of the source's peft model, served by
    each ``vllm serve --enable-lora`` under this one name, a new version at each
    ``send_weights()``; each server's host keeps the newest ``adapter_keep`` versions' files
    in a private directory under ``adapter_root`` (a directory on the servers' hosts);
    ``adapter_load``: how the name moves to each version, ``"inplace"`` or ``"swap"``
    (``lora_routes.load_on_server``)."""

    backend: ClassVar[str] = BACKEND
    directory: str = ""
    dtype: str | None = None
    timeout: float = 60.0
    num_workers: int = 1
    address: str = ""
    delta: bool = False
    #: a sharded trainer (network path): every rank ``rank=r`` in ``0..trainer_ranks-1``
    #: calls ``trainer_init`` with its own ``address`` and the same ``rank_key``
    trainer_ranks: int = 1
    #: the ranks' shared secret (e.g. ``secrets.token_hex(32)``, made by the launcher);
    #: empty: the ``WEIGHTSYNC_RANK_KEY`` environment variable. Servers never receive it.
    rank_key: str = ""
    #: ``HOST:PORT`` where rank 0 meets the other ranks when they run on several hosts
    #: (every rank passes the same); empty: the ranks meet on the trainer's host
    ranks_address: str = ""

    adapter: str = ""
    adapter_root: str = "/dev/shm"
    adapter_keep: int = 4
    adapter_load: str = "inplace"
    #: empty each ``vllm serve``'s prefix cache (``/reset_prefix_cache``) once it loaded a
    #: version, before its label names it: cached blocks were computed with the old weights
    #: (an adapter needs none: each version is served under a path of its own)
    reset_prefix_cache: bool = True


#: where a sharded trainer's ranks find their rank key when ``rank_key`` is not given
RANK_KEY_ENV = "WEIGHTSYNC_RANK_KEY"


def _server_name(client: Any) -> str:
    """How an error names a server: its URL when the client has one."""
    return str(getattr(client, "base_url", None) or client)


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """The trainer side. With ``directory``: commits each round's weights to the directory
    (rank 0 writes; the other ranks only iterate the source for its collectives), then tells
    vLLM which version to load. With ``address``: publishes each round's version on its own
    authenticated listener and has every server (``client``: one, or a list of them) fetch
    and load it; ``send_weights`` returns once every server serves it, or raises naming the
    servers that do not."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender: VLLMDoubleBufferWeightSender | None = None
        self.publisher: VersionPublisher | None = None
        self.clients: list[Any] = list(client) if isinstance(client, (list, tuple)) else [client]
        self.dtype: torch.dtype | None = None
        self.timeout = 60.0
        self.version = -1
        self._stats: list[dict[str, Any]] = []
        self._pack_seconds = 0.0
        self._whole_streams = 0
        self._token = ""
        self._needs_init: set[int] = set()  # servers to initialise again (they failed)
        self._round_inits: list[int] = []  # servers initialised during the round under way
        self.lead: NetRankLead | None = None  # rank 0 of a sharded trainer
        self.member: NetRankMember | None = None  # rank 1..N-1 of a sharded trainer
        self.addresses: list[str] = []  # every rank's, as the servers were last told
        self._next = 0  # the number of a sharded trainer's next version
        self.adapter: LoraAdapter | None = None  # adapter mode: only this adapter travels
        self._adapter_init: dict[str, Any] = {}
        self._adapter_dirs: dict[int, str] = {}  # per server: where its host keeps versions
        self._adapter_load = "inplace"
        self._reset_cache = True  # empty each HTTP server's prefix cache after a load
        #: this engine's session id, in every init and update it sends: a server serves one
        #: trainer session at a time (another's init ends this one: TrainerSessionEndedError)
        self.session = secrets.token_hex(8)

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightSyncTrainerEngine:
        if source is None:
            raise ValueError("the weightsync trainer engine needs a WeightSource (e.g. ModuleSource)")
        if bool(init_info.directory) == bool(init_info.address):
            raise ValueError("WeightSyncTrainerInitInfo needs exactly one of directory= (one "
                             "host) and address= (HOST:PORT the servers' hosts can reach)")
        ranks = checked_trainer_ranks(init_info.trainer_ranks)
        if ranks > 1:
            if init_info.adapter:
                raise ValueError(f"adapter={init_info.adapter!r} needs one trainer rank (a LoRA "
                                 f"adapter is small: gather it), got trainer_ranks={ranks}")
            return cls._sharded_init(init_info, ranks, client, source)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine._reset_cache = bool(init_info.reset_prefix_cache)
        if init_info.adapter:
            engine._start_adapter(init_info, source)
        weights = engine._materialise()
        if not engine.is_sender:
            return engine
        engine.dtype = getattr(torch, init_info.dtype) if init_info.dtype else None
        engine.timeout = required_timeout(init_info.timeout, "timeout")
        if init_info.address:
            engine._start_network(init_info, weights)
            return engine
        scheme = VLLMDoubleBufferSyncScheme(
            init_info.directory, num_workers=1 if init_info.adapter else init_info.num_workers,
            timeout=init_info.timeout, dtype=engine.dtype, adapter=init_info.adapter or None)
        engine.sender = scheme.create_sender()
        if engine.adapter is not None:
            engine.sender.register_model(engine.adapter.model)
            engine.version = engine.sender.update_weights()
        else:
            engine.sender.register_model(weights)
            engine.version = engine.sender.update_weights(weights)
        client.init_weight_transfer_engine({
            "directory": init_info.directory, "timeout": init_info.timeout,
            "num_workers": init_info.num_workers, "session": engine.session,
            **engine._adapter_info(0),
        })
        engine._reset_prefix_cache(client)
        engine._load_adapter(0, client)
        return engine

    @classmethod
    def _sharded_init(cls, init_info: WeightSyncTrainerInitInfo, ranks: int,
                      client: VLLMWeightSyncClient, source: WeightSource) -> WeightSyncTrainerEngine:
        """A sharded trainer's rank: rank 0 meets the other ranks and drives the servers;
        every rank serves its own shards of each version from its own ``address``. The
        first version (0) is sent here, by every rank."""
        if not init_info.address:
            raise ValueError(
                f"trainer_ranks={ranks} takes the network path: address='HOST:PORT' where this "
                "rank listens for the servers' hosts (one host with a shared directory: "
                "VLLMDoubleBufferSyncScheme(directory, trainer_ranks=N))")
        rank = trainer_rank(init_info.rank, ranks)
        if init_info.ranks_address:
            split_address(init_info.ranks_address)
        key = checked_rank_key(init_info.rank_key or os.environ.get(RANK_KEY_ENV, ""), ranks)
        if init_info.delta:
            check_delta_available()
        engine = cls(client=client, source=source, is_sender=rank == 0)
        engine._reset_cache = bool(init_info.reset_prefix_cache)
        engine.dtype = getattr(torch, init_info.dtype) if init_info.dtype else None
        engine.timeout = required_timeout(init_info.timeout, "timeout")
        options: dict[str, Any] = {"dtype": engine.dtype, "timeout": engine.timeout,
                                   "delta": init_info.delta, "board": init_info.ranks_address}
        try:
            if rank == 0:
                engine._token = host_token(key)
                engine.lead = NetRankLead(init_info.address, key, ranks, **options)
            else:
                engine.member = NetRankMember(init_info.address, key, rank, **options)
                engine.member.open(Deadline(engine.timeout))
            engine._send_sharded("init")
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _send_sharded(self, what: str) -> None:
        """One version of a sharded trainer: this rank's shards, never gathered (rank 0
        also has every server fetch the version from every rank and load it)."""
        flat = _shard_flat(self.source)
        deadline = Deadline(self.timeout)
        version = self._next
        if self.member is not None:
            own, started = self.member.own.publisher, time.perf_counter()
            self.version = self.member.send(flat, version, deadline)
            self._next = self.version + 1
            self._record(what, time.perf_counter() - started, own.figures(self.version, settle=5.0), {})
            return
        assert self.lead is not None
        asked: list[bool] = []

        def deliver(version: int, addresses: list[str]) -> None:
            asked.append(True)  # from here on, a server may hold this version
            self.version = version
            if addresses != self.addresses:  # a rank (re)started elsewhere: servers start over
                self._needs_init = set(range(len(self.clients)))
                self.addresses = addresses
            if what == "init":
                self._needs_init = set()  # each server is initialised now (failures: again)
                self._each_server("init", self._init_server, lambda: None)
            else:
                self._each_server("update", self._update_server, lambda: None)

        try:
            self.lead.send(flat, version, deadline, deliver)
        finally:  # a version some server may hold keeps its number; one no host saw does not
            if asked:
                self._next = version + 1

    def _start_adapter(self, init_info: WeightSyncTrainerInitInfo, source: WeightSource) -> None:
        """Adapter mode: the source must be a peft model's (``ModuleSource(peft_model)``);
        each server's host gets a private directory of its own for the versions."""
        if init_info.adapter_load not in LOAD_MODES:
            raise ValueError(f"adapter_load must be one of {LOAD_MODES}, got "
                             f"{init_info.adapter_load!r}")
        self._adapter_load = init_info.adapter_load
        model = getattr(source, "_module", source)  # ModuleSource keeps its module there
        self.adapter = LoraAdapter(model, init_info.adapter)
        for client in self.clients:
            if not hasattr(client, "load_lora_adapter") and getattr(client, "base_url", None) is None:
                raise TypeError(f"adapter={init_info.adapter!r} needs clients that can load an "
                                f"adapter on their server: {type(client).__name__} has neither "
                                "load_lora_adapter(name, path) nor an HTTP base_url (use "
                                "HTTPVLLMWeightSyncClient)")
        if not os.path.isabs(init_info.adapter_root):
            raise ValueError(f"adapter_root must be an absolute path on the servers' hosts, "
                             f"got {init_info.adapter_root!r}")
        root = init_info.adapter_root.rstrip("/") or "/"
        self._adapter_dirs = {
            index: f"{root}/weightsync-{self.adapter.name}-{secrets.token_hex(8)}"
            for index in range(len(self.clients))}
        self._adapter_init = {"adapter": self.adapter.name, "adapter_keep": init_info.adapter_keep}

    def _adapter_info(self, index: int) -> dict[str, Any]:
        """What server ``index``'s init_info carries in adapter mode (nothing otherwise)."""
        if self.adapter is None:
            return {}
        return {**self._adapter_init, "adapter_dir": self._adapter_dirs[index]}

    def _load_adapter(self, index: int, client: Any) -> None:
        """Adapter mode: point the adapter's name on server ``index`` at the version its
        host just staged (``/v1/load_lora_adapter``, a new path per version)."""
        if self.adapter is None:
            return
        path = version_path(self._adapter_dirs[index], self.adapter.name, self.version)
        load_on_server(client, self.adapter.name, path, self.timeout, self._adapter_load)

    def _start_network(self, init_info: WeightSyncTrainerInitInfo,
                       weights: dict[str, torch.Tensor]) -> None:
        if init_info.delta:
            check_delta_available()
        self._token = secrets.token_hex(32)
        self.publisher = VersionPublisher(init_info.address, self._token, timeout=self.timeout,
                                          delta=init_info.delta)
        self.version = 0
        packed = self._publish(weights)

        def init(index: int, client: Any) -> None:
            self._init_server(index, client)
            self._load_adapter(index, client)

        try:
            self._each_server("init", init, lambda: self._fill(packed, weights))
        except BaseException:
            self.shutdown()
            raise

    def _init_server(self, index: int, client: Any) -> None:
        """Have a server's host fetch the current version and every rank load it (a new or
        restarted server gets it whole)."""
        # each server's host gets a credential of its own: one server cannot pose as the
        # trainer to another (handshake.host_credential)
        token = host_credential(self._token, f"server{index}")
        info: dict[str, Any] = {"address": self._publisher().address, "token": token,
                                "ticket": secrets.token_hex(8), "timeout": self.timeout,
                                "session": self.session, **self._adapter_info(index)}
        if self.lead is not None:
            info["addresses"] = list(self.addresses)
        client.init_weight_transfer_engine(info)
        self._round_inits.append(index)  # its host streamed the version once more
        self._reset_prefix_cache(client)

    def _publisher(self) -> VersionPublisher:
        """This rank's listener (rank 0's own part, for a sharded trainer)."""
        if self.lead is not None:
            return self.lead.own.publisher
        assert self.publisher is not None
        return self.publisher


    def _materialise(self) -> dict[str, torch.Tensor]:
        """This round's tensors: the whole model's, or in adapter mode the adapter's alone
        (``BaseWeightChangedError`` if a base weight changed since the first round)."""
        if self.adapter is not None:
            return self.adapter.tensors()
        assert self.source is not None
        return {name: tensor.detach() for name, tensor in self.source}

    def _publish(self, weights: dict[str, torch.Tensor]) -> PackedVersion:
        """Lay out this round's version and publish it before it is packed: hosts stream
        each chunk as soon as ``_fill`` has packed it."""
        assert self.publisher is not None
        nbytes = plan(weights, self.version, self.dtype).nbytes  # layout only (no copy)
        metadata = {} if self.adapter is None else self.adapter.metadata()
        packed = plan(weights, self.version, self.dtype, self.publisher.spare_buffer(nbytes),
                      metadata)
        self.publisher.publish(packed)
        return packed

    def _fill(self, packed: PackedVersion, weights: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()
        packed.fill(weights)
        self._pack_seconds = time.perf_counter() - started

    def _each_server(self, what: str, call: Callable[[int, Any], None],
                     meanwhile: Callable[[], None]) -> None:
        """Run ``call`` for every server at once, each within the engine's timeout; then
        raise one error naming each server that failed or did not answer in time (the
        others got the version). A server that failed is initialised again before its next
        update (a restarted one has nothing: it takes the version whole)."""
        started = time.perf_counter()
        errors: dict[str, BaseException] = {}
        self._round_inits = []
        pool = ThreadPoolExecutor(max(len(self.clients), 1), thread_name_prefix="weightsync-server")
        try:
            futures = {i: pool.submit(call, i, c) for i, c in enumerate(self.clients)}
            meanwhile()  # pack the version while the servers' hosts stream it
            wait_futures(futures.values(), timeout=self.timeout)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a stalled call is left behind
        for index, future in futures.items():
            name = _server_name(self.clients[index])
            if not future.done():
                errors[name] = WeightSyncTimeoutError(
                    f"no answer within {self.timeout:g}s (the engine's timeout)")
            elif future.exception() is not None:
                errors[name] = future.exception()  # type: ignore[assignment]
            if name in errors:
                self._needs_init.add(index)
        # one stream per server that answered, and in an update one more per server
        # initialised again on the way (its init fetched the version whole first)
        again = len(self._round_inits) if what != "init" else 0
        expected = len(self.clients) - len(errors) + again
        streams = self._publisher().wait_streams(self.version, expected, 5.0)
        self._record(what, time.perf_counter() - started, streams, errors)
        if errors:
            detail = "; ".join(f"{name}: {type(exc).__name__}: {_server_said(exc)}"
                               for name, exc in errors.items())
            message = (f"version {self.version} ({what}) is not served by {len(errors)} of "
                       f"{len(self.clients)} servers: {detail}")
            taken = [name for name, exc in errors.items() if _session_ended(exc)]
            if taken:  # re-initialising them would only be refused: this session ended there
                raise TrainerSessionEndedError(
                    f"trainer session {self.session}: another trainer took over server(s) "
                    f"{taken} ({ONE_TRAINER}); {message}",
                    session=self.session) from next(iter(errors.values()))
            raise WeightSyncError(message) from next(iter(errors.values()))

    def _record(self, what: str, seconds: float, streams: list[StreamFigures],
                errors: dict[str, BaseException]) -> None:
        self._stats.append({
            "version": self.version, "call": what, "seconds": seconds,
            "pack_seconds": self._pack_seconds,
            "wire_bytes": sum(f.wire_bytes for f in streams),
            "chunks": sum(f.chunks for f in streams),
            "delta_chunks": sum(f.delta_chunks for f in streams),
            "hosts": [figures_dict(f) for f in streams],
            # hosts that got this version whole though delta is on, and why
            "whole": {f.host: f.whole_reason for f in streams if f.whole_reason},
            "failed": {name: str(exc) for name, exc in errors.items()},
        })
        self._whole_streams += sum(1 for f in streams if f.whole_reason)
        del self._stats[:-64]

    def stats(self) -> dict[str, Any]:
        """Per version sent on the network path: wire bytes, chunks and chunks sent as
        deltas (all hosts together, and per host), the hosts that got it whole and why,
        seconds; ``"last"`` is the newest; ``"whole_streams"`` counts, over the session,
        the streams that went whole with delta on (a host's first version included)."""
        return {"last": self._stats[-1] if self._stats else None, "versions": list(self._stats),
                "whole_streams": self._whole_streams}

    def send_weights(self) -> None:
        """Send this round's weights, then have every vLLM worker load that version (a
        sharded trainer: every rank calls it; each sends only its own shards; in adapter
        mode: have every server answer the adapter's name with it)."""
        if self.lead is not None or self.member is not None:
            self._send_sharded("update")
            return
        weights = self._materialise()
        if not self.is_sender:
            return
        if self.publisher is not None:
            self.version += 1
            packed = self._publish(weights)
            self._each_server("update", self._update_server, lambda: self._fill(packed, weights))
            return
        assert self.sender is not None
        self.version = self.sender.update_weights(None if self.adapter is not None else weights)
        try:
            self._update_server(0, self.client, self.version)
        except Exception as exc:  # the server's refusal, as its client raised it: named
            if isinstance(exc, TrainerSessionEndedError) or not _session_ended(exc):
                raise
            raise TrainerSessionEndedError(
                f"trainer session {self.session}: another trainer took over server "
                f"{_server_name(self.client)} ({ONE_TRAINER}): {_server_said(exc)}",
                session=self.session) from exc

    def _update_server(self, index: int, client: Any, version: int | None = None) -> None:
        """vLLM's update calls for server ``index`` (initialised again first if it failed),
        loading ``version`` (default: this engine's); an adapter is pointed at before the
        version label is set, so the label never names a version the adapter's name does
        not serve."""
        version = self.version if version is None else version
        if index in self._needs_init:
            self._init_server(index, client)
            self._needs_init.discard(index)
        client.start_weight_update()
        client.update_weights({"version": version, "session": self.session})
        try:
            self._load_adapter(index, client)
            self._reset_prefix_cache(client)
        except BaseException:
            with contextlib.suppress(Exception):
                client.finish_weight_update()  # end the server's update session, unlabelled
            raise
        client.finish_weight_update(weight_version=str(version))

    def _reset_prefix_cache(self, client: Any) -> None:
        """Empty an HTTP server's prefix cache once it loaded a version (its cached blocks,
        and those of requests running now, were computed with the old weights); an
        in-process client empties its engine's itself. Not in adapter mode."""
        url = getattr(client, "base_url", None)
        if not self._reset_cache or self.adapter is not None or url is None:
            return
        import requests

        reply = requests.post(f"{url}/reset_prefix_cache", timeout=self.timeout,
                              params={"reset_running_requests": "true"})
        reply.raise_for_status()
        if not reply.json().get("success", False):
            raise WeightSyncError(
                f"server {url} loaded version {self.version} but could not empty its prefix "
                "cache (blocks still held); its cached prompts would mix two versions")

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        for ranks in (self.lead, self.member):
            if ranks is not None:
                ranks.close()
        self.lead = self.member = None


def _server_said(exc: BaseException) -> str:
    """A server's error as its client raised it, with what the server said: over HTTP
    (requests' ``HTTPError``) the message is in the reply's body, not in the error."""
    body = getattr(getattr(exc, "response", None), "text", None)
    if not isinstance(body, str) or not body:
        return str(exc)
    with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):  # not vLLM's JSON
        body = str(json.loads(body)["error"]["message"])
    return f"{exc} (the server said: {body[:4000]})"


def _session_ended(exc: BaseException) -> bool:
    """Whether a server's error (as its client raised it) is its
    ``TrainerSessionEndedError``."""
    return isinstance(exc, TrainerSessionEndedError) or ONE_TRAINER in _server_said(exc)


def _shard_flat(source: Any) -> dict[str, Any]:
    """A sharded rank's weights as ``name -> DTensor | LocalShard | tensor``, never
    gathered: vLLM's ``ModuleSource`` iterates ``full_tensor()`` (a collective), so its
    module's parameters are read instead; a mapping or a module is taken as is."""
    module = getattr(source, "_module", None)  # vLLM's ModuleSource keeps its module there
    if isinstance(module, torch.nn.Module):
        return sharded_flat(dict(module.named_parameters()))
    if isinstance(source, (Mapping, torch.nn.Module)):
        return sharded_flat(source)
    return sharded_flat(dict(iter(source)))  # a WeightSource of (name, tensor) pairs


class OfflineLLMClient:
    """vLLM's four-call weight-sync client protocol over an in-process ``LLM``, with the
    steps an update needs around it: pause generation ("wait": requests in flight finish
    on the old weights), and after loading, reset the prefix cache, set the version label
    and resume."""

    def __init__(self, llm: Any, mode: str = "wait") -> None:
        self.llm = llm
        self.mode = mode

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.llm.reset_prefix_cache()

    def start_weight_update(self) -> None:
        self.llm.sleep(level=0, mode=self.mode)
        try:
            self.llm.start_weight_update()
        except BaseException:
            self.llm.wake_up(tags=["scheduling"])
            raise

    def update_weights(self, update_info: Any) -> None:
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException:
            self.llm.wake_up(tags=["scheduling"])
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        try:
            self.llm.finish_weight_update(weight_version=weight_version)
            self.llm.reset_prefix_cache()
        finally:
            self.llm.wake_up(tags=["scheduling"])


register()  # vLLM runs its plugins only in its own processes: a trainer's needs this
