"""The worker side's ``init_info`` and ``update_info`` of the ``weightsync`` vLLM
weight-transfer backend, typed and checked once as vLLM parses them (a bad field is a
``ValueError`` naming it); the trainer engine fills them (``trainer_config`` is its side)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync.core.checks import checked_int
from weightsync.core.deadline import checked_timeout, required_timeout
from weightsync.integrations.vllm.extension import engine_directory
from weightsync.schemes.lora import check_adapter_name
from weightsync.schemes.ranks import MAX_TRAINER_RANKS
from weightsync.serving.sessions import checked_session
from weightsync.transports.net.wire import split_address

#: the most relays a server is told to try before the trainer
MAX_RELAYS = 8


def checked_relays(relays: object, where: str) -> list[str]:
    """A list of at most ``MAX_RELAYS`` HOST:PORT (other servers' hosts that relay the
    version, nearest first): a ValueError naming ``where`` otherwise."""
    if not isinstance(relays, list) or len(relays) > MAX_RELAYS:
        raise ValueError(f"{where} 'relays' must be a list of at most {MAX_RELAYS} HOST:PORT")
    for address in relays:
        split_address(address)
    return list(relays)


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
    #: in-flight (the network path): the init only starts staging this version of the
    #: trainer's in the background and returns; every rank loads it at the update that
    #: names it (None: the init fetches and loads the trainer's current version itself)
    stage_version: int | None = None
    #: in-flight: this server's URL as the trainer reaches it; a take the trainer leaves
    #: unfinished for ``timeout`` s is finished by the server there (``take_lease``)
    url: str = ""
    #: the network path with several servers: the session's key among its servers (each
    #: server's host relays versions to the others and proves its own credential of this
    #: key to them; it cannot pose as the trainer), the relays to try for ``stage_version``
    #: before the trainer, nearest first, and whether a relay sends deltas
    pool: str = ""
    relays: list[str] = field(default_factory=list)
    delta: bool = False

    def __post_init__(self) -> None:
        """Checked once, as vLLM parses the dict: a bad field is a ValueError naming it."""
        self.session = checked_session(self.session, "init_info session")
        if self.url and (self.stage_version is None
                         or not self.url.startswith(("http://", "https://"))):
            raise ValueError(f"init_info 'url' ({self.url!r}) is the server's http(s) URL, "
                             "sent with 'stage_version' (an in-flight init)")
        if self.stage_version is not None:
            self.stage_version = checked_int(self.stage_version, "init_info stage_version")
            if not self.address or self.adapter:
                raise ValueError("init_info 'stage_version' is for full weights on the "
                                 "network path ('address', no 'adapter')")
        self.relays = checked_relays(self.relays, "init_info")
        if not isinstance(self.delta, bool):
            raise ValueError(f"init_info delta must be true or false, got {self.delta!r}")
        if self.relays and not self.pool:
            raise ValueError("init_info 'relays' needs the session's 'pool' key (the weightsync "
                             "trainer engine sends both)")
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
    #: in-flight (the network path): only start staging ``version`` on this host in the
    #: background and return at once; the update that names it without ``stage`` loads it
    stage: bool = False
    #: in-flight: the label the trainer gives the version at ``finish_weight_update`` (the
    #: server sets it itself if the trainer does not come back, ``take_lease``)
    label: str = ""
    #: the relays (other servers' hosts) to fetch ``version`` from before the trainer
    relays: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Versions are ints (3.9 or True is refused, never truncated); timeouts finite."""
        self.session = checked_session(self.session, "update_info session")
        if self.version is not None:
            self.version = checked_int(self.version, "update_info version")
        if not isinstance(self.stage, bool):
            raise ValueError(f"update_info stage must be true or false, got {self.stage!r}")
        if self.stage and self.version is None:
            raise ValueError("update_info with 'stage' needs the 'version' to stage")
        if not isinstance(self.label, str):
            raise ValueError(f"update_info label must be a string (vLLM's weight_version), "
                             f"got {self.label!r}")
        self.timeout = checked_timeout(self.timeout, "update_info timeout")
        self.relays = checked_relays(self.relays, "update_info")
