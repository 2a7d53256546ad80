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
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from weightsync.core.checks import checked_int
from weightsync.core.deadline import Deadline, checked_timeout, required_timeout
from weightsync.core.errors import (
    TrainerSessionEndedError,
    WeightSyncError,
    WeightSyncTimeoutError,
)
from weightsync.core.shards import sharded_flat
from weightsync.integrations.vllm.extension import apply_exact, engine_directory
from weightsync.integrations.vllm.loading import EngineLoader, Pairs
from weightsync.integrations.vllm.lora_routes import LOAD_MODES, load_on_server
from weightsync.integrations.vllm.plugin import register
from weightsync.schemes.double_buffer import (
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
    VLLMDoubleBufferWeightSender,
)
from weightsync.schemes.lora import LoraAdapter, check_adapter_name
from weightsync.schemes.ranks import MAX_TRAINER_RANKS, checked_trainer_ranks, trainer_rank
from weightsync.serving.adapter_files import AdapterFiles, version_path
from weightsync.serving.host_receiver import (
    HostReceiver,
    host_name,
    request_key,
    staging_directory,
    wait_staged,
)
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
#: how many ended trainer sessions a server remembers (their updates and inits are refused)
ENDED_SESSIONS = 64
#: in every refusal of a session (the trainer finds it in the server's error text)
ONE_TRAINER = "one trainer per server at a time"
#: a trainer session id: what ``secrets.token_hex`` makes, bounded
_SESSION_CHARS = frozenset("0123456789abcdefABCDEF")


def checked_session(session: Any, what: str) -> str:
    """A trainer session id as it came in ``init_info``/``update_info``: "" (none, e.g. a
    direct call) or 8 to 64 hex digits; ValueError naming ``what`` otherwise."""
    if session is None or session == "":
        return ""
    if (not isinstance(session, str) or not 8 <= len(session) <= 64
            or not set(session) <= _SESSION_CHARS):
        raise ValueError(f"{what} must be a trainer session id (8 to 64 hex digits, as the "
                         f"weightsync trainer engine sends), got {session!r}")
    return session


def _session_name(session: str | None) -> str:
    return f"trainer session {session}" if session else "an init without a trainer session"


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """``init_info`` of ``llm.init_weight_transfer_engine``: the trainer's ``directory`` (one
    host), or the ``address`` it listens at with the session's ``token`` (the network path:
    the trainer engine fills both, and a ``ticket`` naming this init)."""

    directory: str = ""
    timeout: float = 60.0
    num_workers: int | None = None
    address: str = ""
    token: str = ""
    ticket: str = ""
    #: a sharded trainer: every rank's HOST:PORT, rank by rank (``address`` is rank 0's)
    addresses: list[str] = field(default_factory=list)
    adapter: str = ""  # a LoRA adapter's versions, not full weights (vllm serve --enable-lora)
    adapter_dir: str = ""  # where this server's host keeps them (the trainer names it)
    adapter_keep: int = 4
    #: the trainer engine's session id (one per trainer engine): a server serves one
    #: session at a time, and an init of another session ends the one before (its updates
    #: are refused from then on); "" (a direct call) ends it too, and is never refused
    session: str = ""

    def __post_init__(self) -> None:
        """Checked once, as vLLM parses the dict: a bad field is a ValueError naming it."""
        self.session = checked_session(self.session, "init_info session")
        if self.adapter:
            check_adapter_name(self.adapter)
            if not os.path.isabs(self.adapter_dir):
                raise ValueError("init_info with 'adapter' needs 'adapter_dir', an absolute "
                                 "path on the server's host (the trainer engine sends it)")
            self.adapter_keep = checked_int(self.adapter_keep, "init_info adapter_keep", 1)
        if bool(self.directory) == bool(self.address):
            raise ValueError("init_info needs exactly one of 'directory' (a directory both "
                             "sides see) and 'address' (the trainer's HOST:PORT)")
        if self.directory:
            self.directory = engine_directory(self.directory)
        else:
            split_address(self.address)
            if not isinstance(self.addresses, list) or len(self.addresses) > MAX_TRAINER_RANKS:
                raise ValueError("init_info 'addresses' must be a list of HOST:PORT, one per "
                                 "trainer rank")
            for address in self.addresses:
                split_address(address)
            if not self.token or not self.ticket:
                raise ValueError("init_info with 'address' needs the trainer's 'token' and "
                                 "'ticket' (the weightsync trainer engine sends them)")
        self.timeout = required_timeout(self.timeout, "init_info timeout")
        if self.num_workers is not None:
            self.num_workers = checked_int(self.num_workers, "init_info num_workers", 1)


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``llm.update_weights``: the committed version every rank loads
    (None: the newest committed one, as each rank reads it)."""

    version: int | None = None
    timeout: float | None = None
    #: the trainer session it comes from (the weightsync trainer engine sends its own): the
    #: update is refused unless that session initialised the server last; "" (a direct
    #: call, the directory path's manual updates) is not checked
    session: str = ""

    def __post_init__(self) -> None:
        """Versions are ints (3.9 or True is refused, never truncated); timeouts finite."""
        self.session = checked_session(self.session, "update_info session")
        if self.version is not None:
            self.version = checked_int(self.version, "update_info version")
        self.timeout = checked_timeout(self.timeout, "update_info timeout")


def _worker_index() -> int:
    """This process's rank among the engine's workers (0 outside a distributed group)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)
    except Exception:  # no group initialised: a single worker
        return 0


def _is_host_receiver() -> bool:
    """Whether this worker receives the network path's versions for its host (local rank 0:
    one receive per host, however many ranks it has)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank) == 0
    except Exception:  # no group initialised: a single worker
        return True


def _trainer(info: WeightSyncInitInfo) -> str | list[str]:
    """Where the host fetches from: the trainer's address, or every rank's (sharded)."""
    return list(info.addresses) if info.addresses else info.address


class WeightSyncWeightTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """The worker side: each update loads one committed version from the directory,
    checked against the served model's layout, through vLLM's layerwise reload."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_idx = _worker_index()
        self.receiver: VLLMDoubleBufferWeightReceiver | None = None
        self.remote: WeightSyncInitInfo | None = None  # the network path's session
        self.host: HostReceiver | None = None  # this host's one receiver (local rank 0)
        self.adapter: WeightSyncInitInfo | None = None  # the session, when it serves an adapter
        self.adapter_files: AdapterFiles | None = None  # its files (local rank 0 writes them)
        self.retired_files: list[AdapterFiles] = []  # an earlier session's, still named
        self.session: str | None = None  # the trainer session that initialised it last
        self.ended: dict[str, str] = {}  # ended session -> the one that took over
        engine_id = f"{getattr(self.vllm_config, 'instance_id', '')}/{os.getppid()}"
        self.staging = staging_directory(engine_id)
        self.host_label = host_name(engine_id)

    def _reload(self, pairs: Pairs) -> None:
        initialize_layerwise_reload(self.model)
        model: Any = self.model  # a vLLM model: load_weights takes (name, tensor) pairs
        model.load_weights(pairs)
        finalize_layerwise_reload(self.model, self.model_config)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        """Attach to the directory and load its newest committed version (so a layout that
        does not fit the served model fails here, with ``SchemaMismatchError``); on the
        network path, first have this host's receiver fetch the trainer's current version
        into the host-local staging directory. An init of another trainer session takes the
        server over (see ``_take_session``)."""
        self._take_session(init_info.session)
        self.shutdown()
        if init_info.adapter:
            self._init_adapter(init_info)
            return
        idx = self.worker_idx
        directory, num_workers, local = init_info.directory, init_info.num_workers, None
        if init_info.address:
            where = f"vLLM worker {idx} on {self.host_label}"
            if _is_host_receiver():
                if self.host is None:
                    self.host = HostReceiver(self.staging, self._local_ranks(), self.host_label,
                                             init_info.timeout)
                key = request_key(init_info.token, f"init/{init_info.ticket}")
                local = self.host.stage(_trainer(init_info), init_info.token, None, key,
                                        init_info.timeout, new_session=True)
            else:
                key = request_key(init_info.token, f"init/{init_info.ticket}")
                local = wait_staged(self.staging, key, init_info.timeout, where)
            directory, num_workers = str(self.staging), self._local_ranks()
            self.remote = init_info
        scheme = VLLMDoubleBufferSyncScheme(
            directory, num_workers=max(num_workers or idx + 1, idx + 1),
            timeout=init_info.timeout,
        )
        receiver = scheme.create_receiver(worker_idx=idx)
        loader = EngineLoader(self, f"vLLM worker {idx} ({init_info.address or directory})",
                              reload=self._reload,
                              hf_config=getattr(self.model_config, "hf_config", None))
        receiver.register_loader(loader)
        receiver.connect(timeout=init_info.timeout)
        if local is not None:
            apply_exact(receiver, local, init_info.timeout)
        self.receiver = receiver
        logger.info("worker %d joined %s at version %d", idx, init_info.address or directory,
                    receiver.version)

    def _take_session(self, session: str) -> None:
        """One trainer per server at a time: an init of another trainer session ends the
        current one (its next update is refused, naming both, so it never loads another
        trainer's weights under its own label); a session once ended cannot come back (a
        new trainer engine takes the server back). An init without a session (a direct
        call) is never refused."""
        where = f"vLLM worker {self.worker_idx} on {self.host_label}"
        if session and session in self.ended:
            taken_by = self.ended[session]
            raise TrainerSessionEndedError(
                f"{where}: refused an init of trainer session {session}: it ended when "
                f"{_session_name(taken_by)} took this server over ({ONE_TRAINER}); a new "
                "trainer engine (a new session) takes it back",
                session=session, taken_by=taken_by)
        current = self.session
        if current is not None and current != session:
            if current:
                self.ended[current] = session
                while len(self.ended) > ENDED_SESSIONS:
                    del self.ended[next(iter(self.ended))]
            logger.warning("%s: %s takes this server over from %s; updates of the latter are "
                           "refused from now on", where, _session_name(session),
                           _session_name(current))
        self.session = session

    def _check_session(self, update_info: WeightSyncUpdateInfo) -> None:
        """Refuse an update of a trainer session other than the one that initialised this
        server last (an update without a session is not checked)."""
        session = update_info.session
        if not session or session == self.session or self.session is None:
            return  # None: never initialised (the update says to init first)
        where = f"vLLM worker {self.worker_idx} on {self.host_label}"
        what = "an update" if update_info.version is None else f"version {update_info.version}"
        if session in self.ended:
            taken_by = self.ended[session]
            raise TrainerSessionEndedError(
                f"{where}: refused {what} of trainer session {session}: "
                f"{_session_name(taken_by)} initialised this server since and took it over "
                f"({ONE_TRAINER}), so session {session} ended; the server keeps serving "
                f"what {_session_name(taken_by)} loaded. Stop one of the trainers; a new "
                "trainer engine takes the server back at its init",
                session=session, taken_by=taken_by)
        raise TrainerSessionEndedError(
            f"{where}: refused {what} of trainer session {session}: {ONE_TRAINER}, and "
            f"this server was initialised last by {_session_name(self.session)}, not by "
            f"session {session}", session=session, taken_by=self.session)

    def _init_adapter(self, init_info: WeightSyncInitInfo) -> None:
        """A LoRA adapter's versions: the base weights stay as served; this host's first
        rank stages the trainer's current adapter version for vLLM's LoRA loader (every
        rank loads it from there when the trainer points the adapter's name at it)."""
        lora_config = getattr(self.vllm_config, "lora_config", None)
        if lora_config is None:
            raise WeightSyncError(
                f"vLLM worker {self.worker_idx} on {self.host_label}: the trainer sends LoRA "
                f"adapter {init_info.adapter!r}, but this server has LoRA off: start it with "
                "--enable-lora --max-lora-rank R (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
        self.adapter = init_info
        self.remote = init_info if init_info.address else None
        if not _is_host_receiver():
            return  # one copy of the files per host
        files = self.adapter_files
        if files is None or str(files.root) != init_info.adapter_dir:
            if files is not None:  # vLLM serves from them until the new session's first load
                self.retired_files.append(files)
            files = self.adapter_files = AdapterFiles(
                init_info.adapter_dir, init_info.adapter, int(lora_config.max_lora_rank),
                init_info.adapter_keep)
        if not init_info.address:
            files.stage(init_info.directory, init_info.timeout)
            return
        # a fresh staging directory per init: another trainer session may send another
        # layout (dtype, rank), and the staged slots only carry versions to the files
        if self.host is not None:
            self.host.close()
        files.forget(self.staging)
        self.host = HostReceiver(self.staging, 1, self.host_label, init_info.timeout)
        key = request_key(init_info.token, f"init/{init_info.ticket}")
        local = self.host.stage(init_info.address, init_info.token, None, key, init_info.timeout)
        files.stage(self.staging, init_info.timeout, expect=local, label=self.host.version)

    def _receive_adapter(self, version: int | None, timeout: float | None) -> None:
        """Stage adapter version ``version`` on this host (its first rank; the others have
        nothing to do: vLLM's LoRA loader reads the staged files on every rank)."""
        session = self.adapter
        assert session is not None
        if version is None:
            raise ValueError("a LoRA adapter update needs update_info {'version': v} (the "
                             "weightsync trainer engine sends it)")
        files = self.adapter_files
        if files is None:
            return
        while self.retired_files:  # the name left them at this session's init
            self.retired_files.pop().close()
        timeout = session.timeout if timeout is None else timeout
        if not session.address:
            files.stage(session.directory, timeout, expect=version)
            return
        assert self.host is not None
        key = request_key(session.token, f"version/{version}")
        local = self.host.stage(session.address, session.token, version, key, timeout)
        files.stage(self.staging, timeout, expect=local, label=version)

    def _local_ranks(self) -> int:
        """The ranks that load from this host's staging directory (an engine on one host)."""
        return max(int(getattr(self.parallel_config, "world_size", 1) or 1), 1)

    def start_weight_update(self) -> None:
        """Nothing to prepare: each version is loaded whole inside ``update_weights``."""
        if self.adapter is None:
            self._receiver()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load the named version (no device synchronisation is needed on CPU)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        self._check_session(update_info)
        if self.adapter is not None:
            self._receive_adapter(update_info.version, update_info.timeout)
            return
        receiver = self._receiver()
        version = update_info.version
        if self.remote is not None:
            self._receive_remote(receiver, version, update_info.timeout)
            return
        if version is None:
            version = receiver.newest_committed()
            if version is None:
                return
        apply_exact(receiver, version, update_info.timeout)

    def _receive_remote(self, receiver: VLLMDoubleBufferWeightReceiver, version: int | None,
                        timeout: float | None) -> None:
        """The network path: this host's receiver fetches the trainer's ``version`` and
        stages it; every rank then loads exactly that staged version."""
        remote = self.remote
        assert remote is not None
        if version is None:
            raise ValueError("the weightsync network path needs update_info {'version': v} "
                             "(the weightsync trainer engine sends it)")
        timeout = remote.timeout if timeout is None else timeout
        key = request_key(remote.token, f"version/{version}")
        if self.host is not None:
            local = self.host.stage(_trainer(remote), remote.token, version, key, timeout)
        else:
            local = wait_staged(self.staging, key, timeout,
                                f"vLLM worker {self.worker_idx} on {self.host_label}")
        apply_exact(receiver, local, timeout)

    def finish_weight_update(self) -> None:
        """Nothing to finalise: the version was loaded and post-processed whole."""

    def shutdown(self) -> None:
        """Detach from the directory; the host's staging directory stays for the next init
        (``close`` removes it with the engine)."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        self.remote = None
        self.adapter = None  # its staged files stay: vLLM may read them again

    def __del__(self) -> None:
        # At interpreter exit this runs while modules are torn down, their globals already
        # None (``contextlib`` among them): builtins only, and nothing may escape.
        for owned in (getattr(self, "host", None), getattr(self, "adapter_files", None)):
            if owned is not None:
                try:  # noqa: SIM105 (not contextlib.suppress: the module may be gone by now)
                    owned.close()
                except Exception:
                    pass

    @property
    def version(self) -> int:
        """The version this worker holds (-1 before ``init_weight_transfer_engine``; with an
        adapter, the one this host staged last)."""
        if self.adapter_files is not None:
            return self.adapter_files.version
        return -1 if self.receiver is None else self.receiver.version

    def _receiver(self) -> VLLMDoubleBufferWeightReceiver:
        if self.receiver is None:
            raise RuntimeError(
                f"vLLM worker {self.worker_idx}: call llm.init_weight_transfer_engine("
                "{'init_info': {'directory': ...}}) before updating weights"
            )
        return self.receiver


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
