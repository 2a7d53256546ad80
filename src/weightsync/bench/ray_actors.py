"""Ray, timed: a send on the trainer and until every actor applied it, on the node-local
path and the broadcast path, against one gloo point-to-point transfer of the same bytes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync.bench.local import make_model
from weightsync.bench.rows import BenchRow, make_row


def _ray_bench_actor_class() -> Any:
    import ray

    from weightsync.integrations.ray import RayWeightReceiverMixin
    from weightsync.transports.ray.group import GroupInfo, WeightGroup

    @ray.remote(num_cpus=0)
    class BenchActor(RayWeightReceiverMixin):
        def __init__(self, scheme: Any, idx: int, nbytes: int) -> None:
            torch.set_num_threads(1)
            self.nbytes = nbytes
            self.weightsync_setup(scheme, idx, make_model(nbytes), announce=False)
            self.p2p_buffer = torch.zeros(nbytes, dtype=torch.uint8)  # warm, like staging

        def apply(self) -> int:
            self.weightsync_receiver.poll()
            return self.weightsync_receiver.version

        def p2p_recv(self, info: dict[str, Any]) -> float:
            group = WeightGroup(GroupInfo(**info), 1)
            t0 = time.perf_counter()
            group.pg.recv([self.p2p_buffer], 0, 0).wait()
            return time.perf_counter() - t0

    return BenchActor


def p2p_seconds(actor: Any, store: Any, address: str, generation: int,
                payload: torch.Tensor) -> float:
    """One gloo point-to-point transfer of ``payload`` from this process to ``actor`` (a
    bench actor with ``p2p_recv``) through ``store``: the floor a Ray send is held against."""
    import ray

    from weightsync.transports.ray.group import GroupInfo, WeightGroup

    info = GroupInfo(address, int(store.port), 2, generation, "gloo", {0: 1}, 120.0)
    ref = actor.p2p_recv.remote(info.__dict__)
    group = WeightGroup(info, 0, store=store, host=address)
    t0 = time.perf_counter()
    group.pg.send([payload], 1, 0).wait()
    ray.get(ref)
    return time.perf_counter() - t0


def bench_ray(
    nbytes: int, workers: int, repeats: int, node_local: bool = True,
) -> dict[str, list[float]]:
    """Seconds per Ray send (sender side), until every actor applied it, and per gloo
    point-to-point transfer of the same bytes (the floor), in one local Ray instance.
    ``node_local=False`` sends through the broadcast, as to actors on other nodes."""
    import datetime

    import ray
    import torch.distributed as dist

    from weightsync.schemes.ray import RayWeightSyncScheme
    from weightsync.transports.ray.group import node_address

    actor_cls = _ray_bench_actor_class()
    scheme = RayWeightSyncScheme(num_workers=workers, timeout=300, node_local=node_local)
    actors = [actor_cls.remote(scheme, i, nbytes) for i in range(workers)]
    weights = make_model(nbytes, fill=1.0)
    times: dict[str, list[float]] = {"send": [], "applied": [], "p2p": []}
    try:
        with scheme.create_sender(actors) as sender:
            sender.register_model(weights)
            sender.connect(timeout=300)
            ray.get([a.apply.remote() for a in actors])
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                sender.send(timeout=300)
                t1 = time.perf_counter()
                ray.get([a.apply.remote() for a in actors])
                t2 = time.perf_counter()
                if i:
                    times["send"].append(t1 - t0)
                    times["applied"].append(t2 - t0)
        address = node_address()
        store = dist.TCPStore(address, 0, None, True, timeout=datetime.timedelta(seconds=120),
                              wait_for_workers=False)
        payload = torch.ones(nbytes, dtype=torch.uint8)
        for i in range(min(repeats, 5) + 1):
            seconds = p2p_seconds(actors[0], store, address, 1000 + i, payload)
            if i:  # the first warms buffers and connections
                times["p2p"].append(seconds)
    finally:
        for actor in actors:
            ray.kill(actor)
    return times


def run_ray_bench(
    size: str, nbytes: int, worker_counts: Sequence[int], repeats: int,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Rows for Ray's node-local and broadcast paths, against one gloo p2p transfer."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024)
    rows = []
    try:
        for path, node_local in (("node-local", True), ("broadcast", False)):
            for n in worker_counts:
                if progress:
                    progress(f"ray {path} {size} x{n}")
                measured = bench_ray(nbytes, n, repeats, node_local)
                floor = statistics.median(measured.pop("p2p"))
                rows += [make_row(f"ray {path} {phase}", size, nbytes, n, times, floor, "gloo p2p")
                         for phase, times in measured.items()]
    finally:
        if started:
            ray.shutdown()
    return rows
