"""The worker side of the ``weightsync`` vLLM weight-transfer backend: the engine vLLM makes
in each of its workers (``WeightSyncWeightTransferEngine``), with the ``init_info`` and
``update_info`` of ``worker_config``. Each update loads one committed version, exactly, from the
trainer's directory (one host) or from this host's staging directory (the network path,
where the host's first rank fetches it), checked against the served model's layout,
through vLLM's layerwise reload (on a CPU, in flight: ahead of the take, into a shadow that
the take swaps in, ``load_ahead``); a LoRA adapter's versions are staged as files instead.
One trainer per server at a time (``weightsync.serving.sessions``)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from weightsync.core.checksum import warm_up_in_background
from weightsync.core.errors import WeightSyncError
from weightsync.integrations.vllm.extension import apply_exact
from weightsync.integrations.vllm.load_ahead import LoadAhead, wait_loaded
from weightsync.integrations.vllm.loading import EngineLoader, Pairs
from weightsync.integrations.vllm.spare_cores import run_on, spare_cores
from weightsync.integrations.vllm.take_lease import TakeLease
from weightsync.integrations.vllm.worker_config import WeightSyncInitInfo, WeightSyncUpdateInfo
from weightsync.schemes.double_buffer import (
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
)
from weightsync.serving.adapter_files import AdapterFiles
from weightsync.serving.host_receiver import (
    HostReceiver,
    host_name,
    request_key,
    staging_directory,
    wait_staged,
)
from weightsync.serving.sessions import ServerSessions

logger = logging.getLogger(__name__)


def _worker_index() -> int:
    """This process's rank among the engine's workers (0 outside a distributed group)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)
    except Exception:  # no group initialised: a single worker
        return 0


def _relaying(remote: WeightSyncInitInfo, relays: list[str] | None) -> dict[str, Any]:
    """What a stage on the network path with several servers takes: the session's pool
    key, whether this host's relay sends deltas, and the relays to try first."""
    return {"relays": relays or [], "pool": remote.pool, "delta": remote.delta}


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
        engine_id = f"{getattr(self.vllm_config, 'instance_id', '')}/{os.getppid()}"
        self.staging = staging_directory(engine_id)
        self.host_label = host_name(engine_id)
        #: the trainer session that initialised it last, and those that ended here
        self.sessions = ServerSessions(f"vLLM worker {self.worker_idx} on {self.host_label}")
        self.lease: TakeLease | None = None  # in-flight takes on this server (worker 0)
        #: a stage the trainer asked for inside an update session: begun at its finish
        self.stage_asked: tuple[WeightSyncInitInfo, int, list[str]] | None = None
        self.served = -1  # the version the served model holds (the receiver may be ahead)
        self.ahead: LoadAhead | None = None  # in flight on a CPU: loads ahead of the take
        self.ahead_key = ""  # the stage this host's ranks load ahead (rank 0 waits for them)
        #: a session's first version: the receiver its load ahead attached, until the take
        self.receiver_ahead: VLLMDoubleBufferWeightReceiver | None = None
        self._cores: frozenset[int] | None = None  # where the background threads run

    def _spare_cores(self) -> frozenset[int]:
        """The CPUs no worker of this engine is bound to, where its staging and loads ahead
        run (``spare_cores``: found once, on the worker's main thread, where the RPCs
        run); none on a GPU."""
        if self._cores is None:
            self._cores = spare_cores() if self.device.type == "cpu" else frozenset()
            if self._cores:
                logger.info("worker %d: staging and loading ahead on CPUs %s, which no "
                            "worker is bound to", self.worker_idx, sorted(self._cores))
        return self._cores

    def _host_receiver(self, ranks: int, timeout: float) -> HostReceiver:
        """This host's receiver, its background stages on the spare cores."""
        return HostReceiver(self.staging, ranks, self.host_label, timeout,
                            thread_setup=run_on(self._spare_cores()))

    def _loads_ahead(self) -> bool:
        """Whether staged versions are loaded into a shadow ahead of the take: on vLLM's
        CPU build, where a load re-packs every layer (on a GPU it is a device copy, and a
        shadow would double the weights' device memory), unless the server's environment
        says ``WEIGHTSYNC_VLLM_LOAD_AHEAD=0`` (the take then loads the staged version: the
        engine stops for the re-pack, and a shadow's memory is saved)."""
        return self.device.type == "cpu" and os.environ.get("WEIGHTSYNC_VLLM_LOAD_AHEAD") != "0"

    def _reload(self, pairs: Pairs) -> None:
        shadow = None if self.ahead is None else self.ahead.target()
        if shadow is not None:  # a load ahead of the take: the served model is only read
            shadow.load(pairs, self.model_config)
            return
        initialize_layerwise_reload(self.model)
        model: Any = self.model  # a vLLM model: load_weights takes (name, tensor) pairs
        model.load_weights(pairs)
        finalize_layerwise_reload(self.model, self.model_config)

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        """Attach to the directory and load its newest committed version (so a layout that
        does not fit the served model fails here, with ``SchemaMismatchError``); on the
        network path, first have this host's receiver fetch the trainer's current version
        into the host-local staging directory. An init of another trainer session takes the
        server over (``ServerSessions.take``)."""
        self.sessions.take(init_info.session)
        self.shutdown()
        if init_info.adapter:
            self._init_adapter(init_info)
            return
        idx = self.worker_idx
        if init_info.stage_version is not None:
            warm_up_in_background()  # the checksum kernels: here, not in a take
            self._start_staging(init_info, init_info.stage_version, new_session=True,
                                relays=init_info.relays)
            self.remote = init_info
            if init_info.url and idx == 0:
                self.lease = TakeLease(init_info.url, init_info.timeout,
                                       name=f"vLLM worker {idx} on {self.host_label}")
            logger.info("worker %d: staging version %d of %s in the background", idx,
                        init_info.stage_version, init_info.address)
            return
        directory, num_workers, local = init_info.directory, init_info.num_workers, None
        if init_info.address:
            where = f"vLLM worker {idx} on {self.host_label}"
            if _is_host_receiver():
                if self.host is None:
                    self.host = self._host_receiver(self._local_ranks(), init_info.timeout)
                key = request_key(init_info.token, f"init/{init_info.ticket}")
                local = self.host.stage(_trainer(init_info), init_info.token, None, key,
                                        init_info.timeout, new_session=True,
                                        pool=init_info.pool, delta=init_info.delta)
            else:
                key = request_key(init_info.token, f"init/{init_info.ticket}")
                local = wait_staged(self.staging, key, init_info.timeout, where)
            directory, num_workers = str(self.staging), self._local_ranks()
            self.remote = init_info
        receiver = self._attach(directory, num_workers, init_info.timeout, init_info.address)
        if local is not None:
            apply_exact(receiver, local, init_info.timeout)
        self.receiver, self.served = receiver, receiver.version
        logger.info("worker %d joined %s at version %d", idx, init_info.address or directory,
                    receiver.version)

    def _attach(self, directory: str, num_workers: int | None, timeout: float,
                address: str) -> VLLMDoubleBufferWeightReceiver:
        """This rank's receiver of ``directory`` (the trainer's, or this host's staging),
        loading through vLLM's layerwise reload, checked against the served layout."""
        idx = self.worker_idx
        scheme = VLLMDoubleBufferSyncScheme(
            directory, num_workers=max(num_workers or idx + 1, idx + 1), timeout=timeout)
        receiver = scheme.create_receiver(worker_idx=idx)
        loader = EngineLoader(self, f"vLLM worker {idx} ({address or directory})",
                              reload=self._reload,
                              hf_config=getattr(self.model_config, "hf_config", None))
        receiver.register_loader(loader)
        receiver.connect(timeout=timeout)
        return receiver

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
        self.host = self._host_receiver(1, init_info.timeout)
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
        self.stage_asked = None  # (one a session left unfinished: its trainer is gone)
        if self.adapter is None and self.remote is None:
            self._receiver()
        if self.lease is not None:
            self.lease.began()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load the named version (no device synchronisation is needed on CPU)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        """Load the version ``update_info`` names (None: the newest committed, on the
        directory path), once its trainer session is checked (``ServerSessions.check``)."""
        self.sessions.check(update_info.session, update_info.version)
        if self.adapter is not None:
            self._receive_adapter(update_info.version, update_info.timeout)
            return
        version = update_info.version
        if self.remote is not None:
            self._receive_remote(version, update_info.timeout, update_info.stage,
                                 update_info.label, update_info.relays)
            return
        receiver = self._receiver()
        if version is None:
            version = receiver.newest_committed()
            if version is None:
                return
        self.served = apply_exact(receiver, version, update_info.timeout)

    def _start_staging(self, remote: WeightSyncInitInfo, version: int, *,
                       new_session: bool = False, relays: list[str] | None = None) -> None:
        """In-flight: this host's receiver (local rank 0) starts fetching and staging
        ``version`` in the background (from ``relays`` first: other servers' hosts); the
        other ranks have nothing to do yet, or load it ahead of the take once it is staged
        (``LoadAhead``: every rank, a session's first version included)."""
        key = request_key(remote.token, f"version/{version}")
        self.ahead_key = ""
        if self._loads_ahead():
            if self.ahead is None:
                self.ahead = LoadAhead(self.model, self.staging, self.worker_idx,
                                       f"vLLM worker {self.worker_idx} on {self.host_label}",
                                       self._spare_cores())
            self.ahead.start(key, remote.timeout, lambda local: self._load_ahead(remote, local))
            self.ahead_key = key
        if not _is_host_receiver():
            return
        if self.host is None:
            self.host = self._host_receiver(self._local_ranks(), remote.timeout)
        self.host.after_commit = self._wait_loaded_ahead
        self.host.stage_in_background(_trainer(remote), remote.token, version, key,
                                      remote.timeout, new_session=new_session,
                                      **_relaying(remote, relays))

    def _load_ahead(self, remote: WeightSyncInitInfo, local: int) -> bool:
        """In the background: the receiver applies staged ``local``, its reload filling the
        shadow (``LoadAhead.target``). A session's first version has no receiver yet: one
        attaches here, its connect loading the staged version into the shadow, and the
        take adopts it (``receiver_ahead``)."""
        receiver = self.receiver
        if receiver is None:
            self._close_receiver_ahead()
            receiver = self.receiver_ahead = self._attach(
                str(self.staging), self._local_ranks(), remote.timeout, remote.address)
        if receiver.version != local:
            receiver.apply_version(local, timeout=remote.timeout)
        return True

    def _close_receiver_ahead(self) -> None:
        """Close a receiver attached ahead that no take adopted."""
        receiver, self.receiver_ahead = self.receiver_ahead, None
        if receiver is not None:
            receiver.close()

    def _wait_loaded_ahead(self, key: str) -> None:
        """On the host's receiver, before the trainer hears ``key`` staged: until every
        rank loaded it ahead (or gave up), so that the take only swaps it in."""
        if key and key == self.ahead_key and self.remote is not None:
            wait_loaded(self.staging, self._local_ranks(), key, self.remote.timeout,
                        f"vLLM worker {self.worker_idx} on {self.host_label}")

    def _receive_remote(self, version: int | None, timeout: float | None, stage: bool,
                        label: str, relays: list[str]) -> None:
        """The network path: this host's receiver fetches the trainer's ``version`` and
        stages it (in the background when it was asked to ``stage`` it before); every rank
        then loads exactly that staged version."""
        remote = self.remote
        assert remote is not None
        if version is None:
            raise ValueError("the weightsync network path needs update_info {'version': v} "
                             "(the weightsync trainer engine sends it)")
        if stage:  # begun once the trainer ends this update session (finish_weight_update):
            # a trainer that dies while the host fetches never leaves the session open
            self.stage_asked = (remote, version, relays)
            if self.lease is not None:
                self.lease.loaded(None)
            return
        if self.lease is None:
            self._take(remote, version, timeout, relays)
            return
        self.lease.loading()
        loaded = False
        try:
            self._take(remote, version, timeout, relays)
            loaded = True
        finally:
            self.lease.loaded(label if loaded and label else None)

    def _take(self, remote: WeightSyncInitInfo, version: int, timeout: float | None,
              relays: list[str]) -> None:
        """Every rank loads ``version``, staged on this host (fetched now if it was not:
        from ``relays`` first)."""
        timeout = remote.timeout if timeout is None else timeout
        where = f"vLLM worker {self.worker_idx} on {self.host_label}"
        key = request_key(remote.token, f"version/{version}")
        if self.host is not None:
            local = self.host.staged(key, timeout)
            if local is None:  # not staged in the background: fetch it now
                local = self.host.stage(_trainer(remote), remote.token, version, key, timeout,
                                        **_relaying(remote, relays))
        else:
            local = wait_staged(self.staging, key, timeout, where)
        if self.ahead is not None and self.ahead.take(key, local, timeout):
            if self.receiver is None:  # a session's first version: its receiver came ahead
                self.receiver, self.receiver_ahead = self.receiver_ahead, None
            self.served = local  # loaded ahead, swapped in
            return
        self._close_receiver_ahead()
        receiver = self.receiver
        if receiver is None:  # an in-flight init: the first version it staged
            receiver = self.receiver = self._attach(str(self.staging), self._local_ranks(),
                                                    remote.timeout, remote.address)
        elif receiver.version == local and self.served != local:  # loaded ahead, not taken
            receiver.apply_version(local, timeout=timeout)
        apply_exact(receiver, local, timeout)
        self.served = local

    def finish_weight_update(self) -> None:
        """Begin the stage this session asked for, if it did (a load has nothing to
        finalise: the version was loaded and post-processed whole)."""
        asked, self.stage_asked = self.stage_asked, None
        if asked is not None:
            remote, version, relays = asked
            self._start_staging(remote, version, relays=relays)
        if self.lease is not None:
            self.lease.finished()

    def shutdown(self) -> None:
        """Detach from the directory; the host's staging directory stays for the next init
        (``close`` removes it with the engine)."""
        if self.ahead is not None:
            self.ahead.drop()
        self._close_receiver_ahead()
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        self.remote, self.served = None, -1
        self.adapter = None  # its staged files stay: vLLM may read them again
        if self.lease is not None:
            self.lease.close()
            self.lease = None

    def __del__(self) -> None:
        # At interpreter exit this runs while modules are torn down, their globals already
        # None (``contextlib`` among them): builtins only, and nothing may escape.
        for owned in (getattr(self, "host", None), getattr(self, "adapter_files", None),
                      getattr(self, "ahead", None)):
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
        return -1 if self.receiver is None else self.served

    def _receiver(self) -> VLLMDoubleBufferWeightReceiver:
        if self.receiver is None:
            raise RuntimeError(
                f"vLLM worker {self.worker_idx}: call llm.init_weight_transfer_engine("
                "{'init_info': {'directory': ...}}) before updating weights"
            )
        return self.receiver

