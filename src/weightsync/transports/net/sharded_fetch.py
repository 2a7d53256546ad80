"""A receiving host's end of a sharded trainer on the network transport: it fetches every
trainer rank's part of a version at once, each from that rank's own listener (one
:class:`~.fetch.VersionFetcher` per rank, each with its own delta base), and puts the
global tensors together once the parts are checked to tile every tensor exactly once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from weightsync.core.errors import IntegrityError, WeightSyncError
from weightsync.core.shards import check_parts
from weightsync.transports.net.fetch import VersionFetcher
from weightsync.transports.net.packed import PackedVersion, plan


class ShardedFetcher:
    """A receiving host's end: one :class:`~.fetch.VersionFetcher` per trainer rank (each
    keeps its own delta base), fetched at once, put together into the global tensors."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._fetchers: dict[int, VersionFetcher] = {}

    def fetch(self, addresses: Sequence[str], token: str, want: int | None,
              timeout: float, commit: Callable[[int, dict[str, torch.Tensor]], None] | None = None
              ) -> tuple[int, dict[str, torch.Tensor]]:
        """Version ``want`` (None: the ranks' current one) from every rank, verified and put
        together: ``(version, name -> global tensor)``. ``commit(version, tensors)``: run
        once every part arrived, before rank 0 hears its part did (so rank 0's verdict means
        "staged"); if it raises, rank 0 is told why."""
        for rank in [r for r in self._fetchers if r >= len(addresses)]:
            del self._fetchers[rank]
        fetchers = [self._fetchers.setdefault(r, VersionFetcher(f"{self.name} <- trainer rank {r}"))
                    for r in range(len(addresses))]
        futures: dict[int, Future[PackedVersion]] = {}
        whole: list[tuple[int, dict[str, torch.Tensor]]] = []

        def put_together(first: PackedVersion) -> None:  # in rank 0's fetch, before its verdict
            parts = [first, *(futures[r].result() for r in range(1, len(addresses)))]
            versions = {p.version for p in parts}
            if len(versions) != 1:
                raise WeightSyncError(f"host {self.name}: the trainer ranks serve different "
                                      f"versions {sorted(versions)}; ask for one by number")
            whole.append((versions.pop(), assemble(parts, self.name)))
            if commit is not None:
                commit(*whole[0])

        with ThreadPoolExecutor(len(addresses), thread_name_prefix="weightsync-net-fetch") as pool:
            # rank 0's last: its fetch puts the parts together, once every other is submitted
            for rank in reversed(range(len(addresses))):
                futures[rank] = pool.submit(fetchers[rank].fetch, addresses[rank], token, want,
                                            timeout, put_together if rank == 0 else None)
            for rank in range(len(addresses)):
                futures[rank].result()
        return whole[0]

    @property
    def last_kinds(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for fetcher in self._fetchers.values():
            for kind, count in fetcher.last_kinds.items():
                kinds[kind] = kinds.get(kind, 0) + count
        return kinds


def fetch_packed(fetcher: ShardedFetcher, addresses: Sequence[str], credential: str,
                 want: int, timeout: float, allocate: Callable[[int], torch.Tensor]
                 ) -> PackedVersion:
    """Version ``want`` from every rank, put together and packed into ``allocate(nbytes)``
    (a host stage's file) as one contiguous version, as a single trainer's would be: what
    reads it never knows the trainer was sharded. Packed before rank 0 hears the parts
    arrived, so its verdict means "staged"."""
    out: list[PackedVersion] = []

    def commit(version: int, tensors: dict[str, torch.Tensor]) -> None:
        packed = plan(tensors, version, None, allocate(plan(tensors, version).nbytes))
        packed.fill(tensors)
        out.append(packed)

    fetcher.fetch(addresses, credential, want, timeout, commit=commit)
    return out[0]


def assemble(parts: Sequence[PackedVersion], where: str) -> dict[str, torch.Tensor]:
    """The global tensors the ranks' parts tile: each part's region copied into a tensor of
    the global shape the ranks declare (the parts' bounding shape if they declare none),
    once the regions are checked to cover each tensor exactly once (``check_parts``; rank 0
    checked the ranks' hellos, this checks what arrived)."""
    found: dict[str, list[tuple[torch.Tensor, list[int]]]] = {}
    for rank, part in enumerate(parts):
        tensors = part.tensors()
        for name, tensor in tensors.items():
            bounds = part.regions.get(name)
            if bounds is None:
                raise IntegrityError(f"host {where}: trainer rank {rank} sent {name!r} without "
                                     "its region")
            found.setdefault(name, []).append((tensor, bounds))
    shapes: dict[str, list[int]] = {}
    for name, pieces in found.items():
        dtypes = {t.dtype for t, _ in pieces}
        if len(dtypes) != 1:
            raise IntegrityError(f"host {where}: the ranks sent {name!r} as {sorted(map(str, dtypes))}")
        dims = {len(b) for _, b in pieces}
        if len(dims) != 1:
            raise IntegrityError(f"host {where}: the ranks sent {name!r} with "
                                 f"{sorted(d // 2 for d in dims)} dimensions")
        shapes[name] = [max(b[2 * d + 1] for _, b in pieces) for d in range(dims.pop() // 2)]
        declared = {tuple(part.shapes[name]) for part in parts if name in part.shapes}
        if len(declared) > 1:
            raise IntegrityError(f"host {where}: the ranks give {name!r} different global "
                                 f"shapes {sorted(declared)}")
        if declared:  # the shape the parts must cover (a missing last block is a gap)
            shapes[name] = list(declared.pop())
    check_parts(shapes, {rank: part.regions for rank, part in enumerate(parts)}, f"host {where}")
    out: dict[str, torch.Tensor] = {}
    for name, pieces in found.items():
        whole = torch.empty(shapes[name], dtype=pieces[0][0].dtype)
        for tensor, bounds in pieces:
            whole[tuple(slice(bounds[2 * d], bounds[2 * d + 1]) for d in range(len(bounds) // 2))
                  ].copy_(tensor)
        out[name] = whole
    return out
