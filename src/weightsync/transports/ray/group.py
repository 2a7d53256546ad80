"""weightsync's own torch.distributed group for Ray actors on other nodes.

A ``ProcessGroupGloo`` (or NCCL) built directly on a ``TCPStore``, so the user's default
process group is never initialised or touched. Rank 0 is the sender. Every broadcast takes
its own timeout (the caller's deadline, not a group-wide one), and every buffer that
crosses the network travels with a checksum the receiver verifies before anything is
applied.

The TCPStore accepts any peer that can reach the trainer's port, and can list and
overwrite its keys. So every key the group uses is named by an HMAC of the scheme's
secret, every value carries an HMAC of the secret, and once built, each rank proves to the
others that it holds the secret. A peer without it can neither join the group nor plant
rendezvous values that a member accepts.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from weightsync.core.checksum import CHECKSUM_ID, check_function, checksum
from weightsync.core.errors import IntegrityError, WeightSyncError
from weightsync.core.layout import Layout

logger = logging.getLogger(__name__)

_MAC_BYTES = 32


@dataclass
class GroupInfo:
    """Where and how to join one generation of the group (plain data: crosses Ray).

    ``secret`` is the scheme's token (hex); with it empty the group is unauthenticated
    (only for hand-built groups, e.g. the benchmark's point-to-point floor)."""

    address: str
    port: int
    world_size: int
    generation: int
    backend: str
    ranks: dict[int, int] = field(default_factory=dict)  # worker_idx -> rank
    timeout_s: float = 60.0
    secret: str = ""
    nonce: str = ""
    checksum: str = CHECKSUM_ID  # the function of the chunk checksums (``core.checksum``)

    def rank_of(self, worker_idx: int) -> int:
        if worker_idx not in self.ranks:
            raise KeyError(f"worker {worker_idx} is not a member of group generation "
                           f"{self.generation} (members: {sorted(self.ranks)})")
        return self.ranks[worker_idx]


def node_address() -> str:
    """This node's address as the Ray cluster knows it (the address its raylet was started
    with; never a hard-coded loopback), so the same code runs on a multi-node cluster."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def local_address(default: str) -> str:
    """The address this process's Ray node was started with (``default`` outside Ray): the
    interface gloo binds, which must be reachable from the other nodes."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    return default


def current_node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def wire_device(backend: str) -> torch.device:
    """Where the group's buffers live: this process's current CUDA device for NCCL (which
    must exist), the CPU for gloo."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend != "nccl":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not torch.cuda.is_available():
        raise WeightSyncError(
            "backend='nccl' needs a CUDA device in the trainer and in every actor on another "
            "node, and this process has none: use backend='gloo' for CPU weights")
    return torch.device(f"cuda:{torch.cuda.current_device()}")


# ------------------------------------------------------------------ authentication
class AuthenticatedStore(dist.Store):
    """A view of a (Prefix/TCP)Store in which every key name is an HMAC of the secret and
    every value carries one: a value a peer without the secret wrote is refused with
    :class:`IntegrityError`. ``add`` counters stay plain (a forger can only delay)."""

    def __init__(self, inner: dist.Store, secret: bytes, scope: str) -> None:
        super().__init__()
        self._inner = inner
        self._secret = secret
        self._scope = scope

    def _name(self, key: str) -> str:
        digest = hmac.new(self._secret, f"{self._scope}/{key}".encode(), hashlib.sha256)
        return "weightsync/" + digest.hexdigest()[:40]

    def _mac(self, name: str, value: bytes) -> bytes:
        return hmac.new(self._secret, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def _seal(self, key: str, value: Any) -> tuple[str, bytes]:
        name = self._name(key)
        raw = value.encode() if isinstance(value, str) else bytes(value)
        return name, self._mac(name, raw) + raw

    def _open(self, key: str, name: str, sealed: bytes) -> bytes:
        mac, raw = sealed[:_MAC_BYTES], sealed[_MAC_BYTES:]
        if len(sealed) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(name, raw)):
            raise IntegrityError(
                f"rendezvous key {key!r} ({self._scope}) was not written by a holder of the "
                "scheme's token: another peer on the network wrote to the trainer's store"
            )
        return raw

    def set(self, key: str, value: Any) -> None:
        name, sealed = self._seal(key, value)
        self._inner.set(name, sealed)  # type: ignore[arg-type]  # bytes are accepted

    def get(self, key: str) -> bytes:
        name = self._name(key)
        return self._open(key, name, bytes(self._inner.get(name)))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(self._name(key), amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check([self._name(k) for k in keys]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(self._name(key)))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        raise NotImplementedError("compare_set is not used by weightsync's groups")

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)


def member_proof(secret: bytes, info: GroupInfo, rank: int) -> bytes:
    """What rank ``rank`` shows the others to prove it holds the scheme's token."""
    message = f"member|{info.generation}|{info.nonce}|{rank}".encode()
    return hmac.new(secret, message, hashlib.sha256).digest()


# ------------------------------------------------------------------ checksums
def wire_checksum(buffer: torch.Tensor) -> int:
    """The checksum of a byte buffer (:mod:`weightsync.core.checksum`, on any device): one
    read, catches flipped, lost and misplaced bytes (not an attacker: see the MACs)."""
    return checksum(buffer)


def wire_checksums(buffers: Sequence[torch.Tensor]) -> list[int]:
    return [wire_checksum(b) for b in buffers]


CHUNK_BYTES = 8 << 20  # checksummed while the next chunk is on the wire


def _chunks(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    pieces = []
    for buffer in buffers:
        flat = buffer.reshape(-1)
        pieces += [flat[start:start + CHUNK_BYTES] for start in range(0, flat.numel(), CHUNK_BYTES)]
    return pieces


def chunk_checksums(buffers: Sequence[torch.Tensor]) -> list[int]:
    """The checksum of every chunk :meth:`WeightGroup.send_checked` sends."""
    return wire_checksums(_chunks(buffers))


def _sums_tensor(sums: Sequence[int], device: torch.device) -> torch.Tensor:
    signed = [s - (1 << 64) if s >= 1 << 63 else s for s in sums]  # uint64 as int64
    return torch.tensor(signed, dtype=torch.int64, device=device)


def _sums_list(tensor: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFFFFFFFFFFFFFF for v in tensor.cpu().tolist()]


def bucket_buffers(layout: Layout, buffers: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The flat per-device byte buffers of a packed layout, in a fixed order."""
    return [buffers[device] for device in sorted(layout.nbytes_by_device)]


# Test hook: called with each received list of buffers before they are verified, to
# corrupt them "on the wire". None in normal use.
WireHook = Callable[[list[torch.Tensor]], None]
#: ``fill(index, chunk)``: write chunk ``index`` of the buffers just before it is sent
FillChunk = Callable[[int, torch.Tensor], None]


class WeightGroup:
    """One generation of the library's own process group, for one rank."""

    def __init__(self, info: GroupInfo, rank: int, store: Any = None,
                 host: str | None = None) -> None:
        check_function(info.checksum, f"group generation {info.generation}")
        timeout = datetime.timedelta(seconds=max(info.timeout_s, 0.001))
        self.info = info
        self.rank = rank
        if store is None:
            store = dist.TCPStore(info.address, info.port, info.world_size, False,
                                  timeout=timeout, wait_for_workers=False)
        else:
            store.set_timeout(timeout)
        self.store = store
        secret = bytes.fromhex(info.secret)
        scoped: dist.Store = (
            AuthenticatedStore(store, secret, f"gen{info.generation}") if secret
            else dist.PrefixStore(f"weightsync/gen{info.generation}", store)
        )
        self.device = wire_device(info.backend)
        if info.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(scoped, rank, info.world_size, options)
        elif info.backend == "gloo":
            gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gloo_options._timeout = timeout
            gloo_options._devices = [dist.ProcessGroupGloo.create_device(
                hostname=host or local_address(info.address))]
            self.pg = dist.ProcessGroupGloo(scoped, rank, info.world_size, gloo_options)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {info.backend!r}")
        if secret:
            self._check_members(secret, timeout)

    def _check_members(self, secret: bytes, timeout: datetime.timedelta) -> None:
        """Every rank shows the others its proof of the token; any rank whose proof is wrong
        (a peer that slipped into the group) makes the whole generation unusable."""
        size = self.info.world_size
        mine = torch.frombuffer(bytearray(member_proof(secret, self.info, self.rank)),
                                dtype=torch.uint8).to(self.device)
        gathered = [torch.empty(_MAC_BYTES, dtype=torch.uint8, device=self.device)
                    for _ in range(size)]
        opts = c10d.AllgatherOptions()
        opts.timeout = timeout
        self.pg.allgather([gathered], [mine], opts).wait()
        for rank, proof in enumerate(gathered):
            expected = member_proof(secret, self.info, rank)
            if not hmac.compare_digest(bytes(proof.cpu().numpy().tobytes()), expected):
                self.pg = None
                raise IntegrityError(
                    f"rank {rank} of group generation {self.info.generation} did not prove it "
                    "holds the scheme's token: a peer without it reached the group"
                )

    def _broadcast(self, tensor: torch.Tensor, timeout: float | None) -> Any:
        if self.pg is None:
            raise RuntimeError(f"group generation {self.info.generation} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = datetime.timedelta(seconds=max(timeout, 0.001))
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, buffers: list[torch.Tensor], timeout: float | None = None,
                  fill: FillChunk | None = None) -> None:
        """Broadcast ``buffers`` from rank 0 in chunks, all in flight at once, then wait;
        each operation gives up after ``timeout`` seconds (default: the group's). Rank 0's
        ``fill(index, chunk)`` writes each chunk just before it goes out (a pack streamed
        into the broadcast)."""
        works = []
        for index, piece in enumerate(_chunks(buffers)):
            if fill is not None:
                fill(index, piece)
            works.append(self._broadcast(piece, timeout))
        for work in works:
            work.wait()

    def send_checked(self, buffers: list[torch.Tensor], timeout: float | None = None,
                     fill: FillChunk | None = None) -> list[int]:
        """Rank 0: broadcast ``buffers`` in chunks and, last, the checksum of every chunk,
        summed while the chunks are on the wire (as each is written, with ``fill``: see
        :meth:`broadcast`); returns the checksums."""
        pieces = _chunks(buffers)
        if fill is None:
            works = [self._broadcast(piece, timeout) for piece in pieces]
            sums = wire_checksums(pieces)  # overlaps the transfer
        else:
            works, sums = [], []
            for index, piece in enumerate(pieces):
                fill(index, piece)
                works.append(self._broadcast(piece, timeout))
                sums.append(wire_checksum(piece))  # while the chunk is still in cache
        works.append(self._broadcast(_sums_tensor(sums, self.device), timeout))
        for work in works:
            work.wait()
        return sums

    def receive_sums(self, buffers: list[torch.Tensor], timeout: float | None = None,
                     hook: WireHook | None = None) -> list[int]:
        """Other ranks: take :meth:`send_checked`'s chunks and return the sender's checksums,
        to verify later (before the bytes are used: see ``ray_staging``)."""
        pieces = _chunks(buffers)
        expected = torch.zeros(len(pieces), dtype=torch.int64, device=self.device)
        works = [self._broadcast(piece, timeout) for piece in pieces]
        works.append(self._broadcast(expected, timeout))
        for work in works:
            work.wait()
        if hook is not None:
            hook(pieces)
        return _sums_list(expected)

    def receive_checked(self, buffers: list[torch.Tensor], timeout: float | None = None,
                        hook: WireHook | None = None) -> list[int]:
        """Other ranks: take :meth:`send_checked`'s chunks, summing each as the next one
        arrives, then its checksums; returns the indices of the chunks that differ."""
        return self.receive_verified(buffers, timeout, hook)[1]

    def receive_verified(self, buffers: list[torch.Tensor], timeout: float | None = None,
                         hook: WireHook | None = None) -> tuple[list[int], list[int]]:
        """:meth:`receive_checked`, also returning the sender's checksums:
        ``(sums, indices of the chunks that differ)``."""
        pieces = _chunks(buffers)
        expected = torch.zeros(len(pieces), dtype=torch.int64, device=self.device)
        works = [self._broadcast(piece, timeout) for piece in pieces]
        works.append(self._broadcast(expected, timeout))
        sums = []
        for piece, work in zip(pieces, works, strict=False):
            work.wait()
            if hook is not None:
                hook([piece])
            sums.append(wire_checksum(piece))
        works[-1].wait()
        wanted = _sums_list(expected)
        return wanted, [i for i, (got, want) in enumerate(zip(sums, wanted, strict=True))
                        if got != want]

    def close(self) -> None:
        self.pg = None
