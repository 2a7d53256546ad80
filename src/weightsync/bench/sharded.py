"""A sharded trainer, timed: FSDP2 over gloo ranks writing their shards into SharedMem
(``trainer_ranks``) until every zero-copy worker holds the version, beside one memcpy of
the whole model and the gather a user writes today (``get_model_state_dict`` with
``full_state_dict=True``, then one process sends it), all in the same run. Each rank's
peak extra anonymous memory during a send is measured too (shared slots are not counted:
they are the transport's, mapped by every process)."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsync.bench.floors import join_or_kill, memcpy_floor, split_copy_times
from weightsync.bench.rows import BenchRow, make_row

_WIDTH = 4096  # Linear(4096, 4096): 64 MiB of fp32 per layer
_TIMEOUT = 300.0


def _layers(nbytes: int) -> int:
    return max(2, round(nbytes / (_WIDTH * (_WIDTH + 1) * 4)))


def _model(layers: int, device: str) -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(_WIDTH, _WIDTH, device=device)
                                 for _ in range(layers)))


def _anon_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``): heap, not shared slots."""
    with open(f"/proc/{os.getpid()}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _PeakAnon:
    """The most anonymous memory above the level at entry, sampled every millisecond."""

    def __enter__(self) -> _PeakAnon:
        self.base = self.peak = _anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _anon_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_bytes())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _rank(rank: int, world: int, port: int, layers: int, sharded: Any, single: Any,
          repeats: int, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(layers, "meta")
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model.to_empty(device="cpu")  # each rank allocates its shard only
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()  # type: ignore[attr-defined]  # a DTensor
    sender = sharded.create_sender(rank=rank)
    sender.register_model(model)
    sender.connect(timeout=_TIMEOUT)
    for _ in range(repeats):
        dist.barrier()
        with _PeakAnon() as peak:
            started = time.monotonic()
            sender.send(timeout=_TIMEOUT)
        out.put(("sharded", rank, started, peak.extra))
    sender.close()
    # the gather baseline: the full state dict on every rank (rank 0 sends it)
    plain = single.create_sender() if rank == 0 else None
    options = StateDictOptions(full_state_dict=True)
    for repeat in range(repeats + 1):
        dist.barrier()
        with _PeakAnon() as peak:
            started = time.monotonic()
            full = get_model_state_dict(model, options=options)
            if plain is not None:
                if repeat == 0:
                    plain.register_model(full)
                    plain.connect(timeout=_TIMEOUT)
                else:
                    plain.send(full, timeout=_TIMEOUT)
            del full
        if repeat:
            out.put(("gather", rank, started, peak.extra))
    if plain is not None:
        plain.close()
    dist.barrier()
    dist.destroy_process_group()


def _worker(idx: int, layers: int, sharded: Any, single: Any, repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    for label, scheme in (("sharded", sharded), ("gather", single)):
        model = _model(layers, "meta").to_empty(device="cpu")
        with scheme.create_receiver(idx, zero_copy=True) as receiver:
            receiver.register_model(model)
            first = receiver.connect(timeout=_TIMEOUT)
            while receiver.version < first + repeats:
                if receiver.receive(timeout=_TIMEOUT) is not None:
                    out.put((label, idx, time.monotonic()))
        del model


def run_sharded_bench(size: str, nbytes: int, repeats: int,
                      progress: Callable[[str], None], world: int = 2,
                      workers: int = 2) -> list[BenchRow]:
    """Rows for one model size: the memcpy split over the ranks (what ``world`` processes
    writing one model together cannot beat), sharded, the gather baseline, and the ranks'
    memory."""
    import torch.multiprocessing as mp

    from weightsync.schemes.shared_mem import SharedMemWeightSyncScheme

    layers = _layers(nbytes)
    nbytes = layers * _WIDTH * (_WIDTH + 1) * 4
    progress(f"sharded SharedMem, {world} FSDP2 ranks, {size}")
    sharded = SharedMemWeightSyncScheme(workers, trainer_ranks=world, timeout=_TIMEOUT)
    single = SharedMemWeightSyncScheme(workers, timeout=_TIMEOUT)
    ctx = mp.get_context("spawn")
    rank_out, worker_out = [ctx.Queue() for _ in range(world)], [ctx.Queue() for _ in range(workers)]
    port = 20000 + os.getpid() % 20000
    procs = [ctx.Process(target=_rank, daemon=True,
                         args=(r, world, port, layers, sharded.for_trainer_ranks(), single, repeats,
                               rank_out[r]))
             for r in range(world)]
    procs += [ctx.Process(target=_worker, daemon=True,
                          args=(w, layers, sharded.for_workers(), single, repeats, worker_out[w]))
              for w in range(workers)]
    for p in procs:
        p.start()
    try:
        starts: dict[str, list[list[float]]] = {"sharded": [], "gather": []}
        extra: dict[str, list[int]] = {"sharded": [], "gather": []}
        ends: dict[str, list[list[float]]] = {"sharded": [], "gather": []}
        for r in range(world):
            got = [_get(rank_out[r]) for _ in range(2 * repeats)]
            for label in starts:
                mine = [g for g in got if g[0] == label]
                starts[label].append([g[2] for g in mine])
                extra[label].append(max(g[3] for g in mine))
        for w in range(workers):
            got = [_get(worker_out[w]) for _ in range(2 * repeats)]
            for label in ends:
                ends[label].append([g[2] for g in got if g[0] == label])
    finally:
        join_or_kill(procs, 30)
    floor = memcpy_floor(nbytes)
    rows = [make_row(f"floor: memcpy split over {world} processes at once (1 thread each)",
                     size, nbytes, workers, split_copy_times(nbytes, world, repeats), floor)]
    for label, name in (("sharded", f"sharded shm ({world} FSDP2 ranks) applied everywhere"),
                        ("gather", f"gather on rank 0 + shm send ({world} FSDP2 ranks)")):
        times = [max(e[i] for e in ends[label]) - min(s[i] for s in starts[label])
                 for i in range(repeats)]
        row = make_row(name, size, nbytes, workers, times, floor)
        row.transport += f" [peak extra memory per rank: {max(extra[label]) / 2**20:.0f} MiB]"
        rows.append(row)
    return rows


def _get(q: Any) -> Any:
    try:
        return q.get(timeout=_TIMEOUT)
    except queue.Empty:
        raise TimeoutError("a sharded bench process said nothing in time") from None

