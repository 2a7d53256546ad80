"""The trainer side's init info for the ``weightsync`` backend, validated once: the flat
``WeightSyncTrainerInitInfo`` users construct becomes the typed, frozen config of one mode
(``DirectoryConfig``: one host; ``NetworkConfig``: one trainer on the network path;
``ShardedConfig``: a sharded trainer's rank), each mode's object then trusting it.
Importing this module registers the backend with vLLM's factories (``plugin.register``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from weightsync.core.checks import checked_int
from weightsync.core.deadline import required_timeout
from weightsync.integrations.vllm.lora_routes import LOAD_MODES
from weightsync.integrations.vllm.plugin import BACKEND, register
from weightsync.integrations.vllm.server_take import PAUSE_MODES
from weightsync.schemes.local import check_num_workers
from weightsync.schemes.lora import check_adapter_name
from weightsync.schemes.ranks import checked_trainer_ranks, trainer_rank
from weightsync.transports.delta.codec import check_available as check_delta_available
from weightsync.transports.net.sharded import checked_rank_key
from weightsync.transports.net.wire import split_address


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
    #: how each ``vllm serve`` takes a version on the network path (HTTP, full weights):
    #: it keeps generating while the version travels and is staged on its host, then stops
    #: only to load it, inside vLLM's ``/pause`` of this mode: ``"keep"`` (running requests
    #: freeze and continue under the new weights, their KV recomputed; the fastest) or
    #: ``"wait"`` (new requests wait while the running ones finish on the old weights: no
    #: sample spans two versions)
    pause: str = "keep"


#: where a sharded trainer's ranks find their rank key when ``rank_key`` is not given
RANK_KEY_ENV = "WEIGHTSYNC_RANK_KEY"


@dataclass(frozen=True)
class SendConfig:
    """What every mode shares: the dtype versions travel in (None: the source's), the
    timeout of each call on the servers, and whether an HTTP server's prefix cache is
    emptied once it loaded a version."""

    dtype: torch.dtype | None
    timeout: float
    reset_prefix_cache: bool
    pause: str = "keep"


@dataclass(frozen=True)
class AdapterConfig:
    """The LoRA adapter mode: the adapter's name on the servers, the directory on their
    hosts under which each server's versions go (absolute, no trailing "/"), how many
    versions each keeps, and how the name moves to each version (``LOAD_MODES``)."""

    name: str
    root: str
    keep: int
    load: str


@dataclass(frozen=True)
class DirectoryConfig:
    """One host: versions go through ``directory``, read by ``num_workers`` workers."""

    directory: str
    num_workers: int
    send: SendConfig
    adapter: AdapterConfig | None


@dataclass(frozen=True)
class NetworkConfig:
    """The network path, one trainer: it listens at ``address`` for its servers' hosts."""

    address: str
    delta: bool
    send: SendConfig
    adapter: AdapterConfig | None


@dataclass(frozen=True)
class ShardedConfig:
    """The network path, one rank of a sharded trainer: it serves its own shards at
    ``address``; the ranks prove ``rank_key`` to each other and meet at ``ranks_address``
    (empty: on the trainer's host)."""

    address: str
    rank: int
    ranks: int
    rank_key: str = field(repr=False)
    ranks_address: str
    delta: bool
    send: SendConfig


TrainerConfig = DirectoryConfig | NetworkConfig | ShardedConfig


def trainer_config(info: WeightSyncTrainerInitInfo) -> TrainerConfig:
    """``info`` checked once, into its mode's config: a bad field is a ValueError naming it
    (a missing delta codec, ``check_delta_available``'s error)."""
    if bool(info.directory) == bool(info.address):
        raise ValueError("WeightSyncTrainerInitInfo needs exactly one of directory= (one "
                         "host) and address= (HOST:PORT the servers' hosts can reach)")
    ranks = checked_trainer_ranks(info.trainer_ranks)
    if ranks > 1:
        return _sharded_config(info, ranks)
    adapter = _adapter_config(info) if info.adapter else None
    send = _send_config(info)
    if info.address:
        if info.delta:
            check_delta_available()
        return NetworkConfig(info.address, bool(info.delta), send, adapter)
    return DirectoryConfig(info.directory, check_num_workers(info.num_workers), send, adapter)


def _sharded_config(info: WeightSyncTrainerInitInfo, ranks: int) -> ShardedConfig:
    if info.adapter:
        raise ValueError(f"adapter={info.adapter!r} needs one trainer rank (a LoRA "
                         f"adapter is small: gather it), got trainer_ranks={ranks}")
    if not info.address:
        raise ValueError(
            f"trainer_ranks={ranks} takes the network path: address='HOST:PORT' where this "
            "rank listens for the servers' hosts (one host with a shared directory: "
            "VLLMDoubleBufferSyncScheme(directory, trainer_ranks=N))")
    rank = trainer_rank(info.rank, ranks)
    if info.ranks_address:
        split_address(info.ranks_address)
    key = checked_rank_key(info.rank_key or os.environ.get(RANK_KEY_ENV, ""), ranks)
    if info.delta:
        check_delta_available()
    return ShardedConfig(info.address, rank, ranks, key, info.ranks_address, bool(info.delta),
                         _send_config(info))


def _adapter_config(info: WeightSyncTrainerInitInfo) -> AdapterConfig:
    if info.adapter_load not in LOAD_MODES:
        raise ValueError(f"adapter_load must be one of {LOAD_MODES}, got "
                         f"{info.adapter_load!r}")
    if not isinstance(info.adapter_root, str) or not os.path.isabs(info.adapter_root):
        raise ValueError(f"adapter_root must be an absolute path on the servers' hosts, "
                         f"got {info.adapter_root!r}")
    return AdapterConfig(check_adapter_name(info.adapter), info.adapter_root.rstrip("/") or "/",
                         checked_int(info.adapter_keep, "adapter_keep", 1), info.adapter_load)


def _send_config(info: WeightSyncTrainerInitInfo) -> SendConfig:
    if info.pause not in PAUSE_MODES:
        raise ValueError(f"pause must be one of {PAUSE_MODES} (vLLM's /pause modes an "
                         f"in-flight update runs in), got {info.pause!r}")
    return SendConfig(_dtype(info.dtype), required_timeout(info.timeout, "timeout"),
                      bool(info.reset_prefix_cache), info.pause)


def _dtype(name: object) -> torch.dtype | None:
    """``dtype``: None or "" (as the source holds them), else a torch dtype's name."""
    if name is None or name == "":
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (e.g. 'bfloat16'), got {name!r}")
    return dtype


register()  # vLLM runs its plugins only in its own processes: a trainer's needs this
