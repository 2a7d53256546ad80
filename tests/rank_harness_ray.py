"""The rank harness's Ray side (``rank_harness.py``): the actors the sharded tests feed
(importable by Ray workers through PYTHONPATH), the Ray medium of the conformance suite (the
worker a Ray actor, each rank a process that joins the test's Ray instance; rank 0 hands the
scheme the actor's handle), and the bodies of FSDP2 / tensor-parallel / ``LocalShard`` ranks
on the Ray scheme. Every rank is its own process with its own user's gloo group and its own
connection to the test's Ray instance; rank 0 finds the actors by name and, after each send,
compares every actor's tensors with the model the ranks gathered (``full_tensor()``, on the
user's group: the test gathers, not weightsync)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from typing import Any

import ray
import torch
from rank_harness import (
    Forger,
    Model,
    Transport,
    forged_done,
    forged_hello,
    fsdp_mlp,
    init_gloo,
    made_up_key,
    mlp,
    tp_model,
    tp_parallel,
    uniform,
)
from torch import nn

import weightsync as ws
from weightsync.integrations.ray import RayWeightReceiverMixin
from weightsync.schemes.ray import SHARDED_NAMESPACE

#: the Ray namespace the test's actors are named in (the scheme's rendezvous has its own)
NAMESPACE = "weightsync-tests"


# ================================================================ the conformance suite's medium
@ray.remote(num_cpus=0)
class Collector(RayWeightReceiverMixin):
    def __init__(self, scheme: Any) -> None:
        self.model = Model()
        self.weightsync_setup(scheme, 0, self.model)

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        self.weightsync_receiver.poll()
        return (self.weightsync_receiver.version,
                {k: v.detach().clone() for k, v in self.model.state_dict().items()})


class RankSide:
    """What a rank process gets: the scheme, and how to reach the test's Ray instance and
    the actor (rank 0 hands the scheme its handle)."""

    def __init__(self, scheme: Any, address: str, actor: str) -> None:
        self.scheme, self.address, self.actor = scheme, address, actor

    def create_sender(self, rank: int) -> Any:
        ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
        handles = [ray.get_actor(self.actor, namespace=NAMESPACE)] if rank == 0 else None
        return self.scheme.create_sender(handles, rank=rank)


class RayWorker:
    """The actor, seen from the test: ``holds`` as the same-host workers'."""

    def __init__(self, name: str, scheme: Any) -> None:
        self.actor = Collector.options(name=name, namespace=NAMESPACE).remote(scheme)
        ray.get(self.actor.weights.remote(), timeout=60)

    def holds(self, version: int) -> None:
        deadline = time.monotonic() + 30
        while True:
            held, state = ray.get(self.actor.weights.remote(), timeout=30)
            if held >= version or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert held == version, (held, version)
        model = Model()
        model.load_state_dict(state)
        assert uniform(model) == float(version)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


class RayForger(Forger):
    """A process that can make Ray calls (an actor) posting on rank 0's rendezvous actor
    without the rank key."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _board(self) -> Any:
        return ray.get_actor(self.name, namespace=SHARDED_NAMESPACE)

    def hello(self, rank: int) -> None:
        ray.get(self._board().post_hello.remote(rank, forged_hello(rank)), timeout=30)

    def done(self, rank: int, timeout: float) -> str:
        board, deadline = self._board(), time.monotonic() + timeout
        while True:
            snapshot = ray.get(board.board.remote(), timeout=30)
            plan = snapshot["plan"]
            if plan is not None and snapshot["outcome"] is None \
                    and str(rank) in plan["incarnations"]:
                break
            assert time.monotonic() < deadline, "rank 0 posted no plan to forge a done for"
            time.sleep(0.01)
        ray.get(board.post_done.remote(rank, plan["attempt"], forged_done(rank, plan)),
                timeout=30)
        return str(plan["attempt"])


class Ray(Transport):
    name = "ray"

    def __init__(self, timeout: float, address: str) -> None:
        self.scheme = ws.RayWeightSyncScheme(num_workers=1, trainer_ranks=2, timeout=timeout)
        self.address = address
        self.actor = f"conformance-{uuid.uuid4().hex[:8]}"

    def rank_scheme(self) -> Any:
        return RankSide(self.scheme, self.address, self.actor)

    def worker_scheme(self) -> Any:
        for_workers = getattr(self.scheme, "for_workers", None)  # absent before the rank key
        return self.scheme if for_workers is None else for_workers()  # what actors are handed

    def posing_scheme(self) -> Any:
        """An actor's copy with a rank key of its own, joining as a rank would."""
        return RankSide(made_up_key(self.worker_scheme()), self.address, self.actor)

    def forger(self) -> Forger:
        return RayForger(self.scheme.connection_info_name)

    def worker(self) -> RayWorker:
        return RayWorker(self.actor, self.worker_scheme())


# ================================================================ sharded Ray ranks
class Pair(nn.Module):
    """Plain tensors ``w`` (8 x 4) and ``b`` (4): the LocalShard cases."""

    def __init__(self, cols: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8, cols))
        self.b = nn.Parameter(torch.zeros(4))


def actor_model(kind: str) -> nn.Module:
    if kind == "fsdp":
        return mlp()
    if kind == "tp":
        return tp_model().to(torch.bfloat16)
    return Pair()


@ray.remote(num_cpus=0)
class ShardedCollector(RayWeightReceiverMixin):
    def __init__(self, scheme: Any, idx: int, kind: str) -> None:
        self.model = actor_model(kind)
        self.weightsync_setup(scheme, idx, self.model)

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        self.weightsync_receiver.poll()
        return (self.weightsync_receiver.version,
                {k: v.detach().clone() for k, v in self.model.state_dict().items()})


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for n, t in model.state_dict().items()}


def _diff(got: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(full), (sorted(got), sorted(full))
    return max(float((got[n].float() - full[n].to(got[n].dtype).float()).abs().max())
               for n in full)


def _actor_states(names: list[str], full: dict[str, torch.Tensor]) -> list[tuple[int, float]]:
    out = []
    for name in names:
        version, state = ray.get(ray.get_actor(name, namespace=NAMESPACE).weights.remote(),
                                 timeout=30)
        out.append((version, _diff(state, full)))
    return out


def _tp(rank: int, world: int) -> tuple[nn.Module, Any]:
    """A colwise (``Shard(0)``) and a rowwise (``Shard(1)``) Linear and a replicated norm."""
    model = tp_parallel(world)
    return model, _local_update(model)


def _local_update(model: nn.Module) -> Any:
    @torch.no_grad()
    def update(step: int) -> None:  # pointwise on every shard: no collective
        for param in model.parameters():
            param.mul_(0.9).add_(0.01 * step)

    return update


def _connect_ray(address: str) -> None:
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
             _node_ip_address="127.0.0.1")


def trainer_rank(rank: int, world: int, address: str, scheme: Any, names: list[str],
                 port: int, steps: int, kind: str) -> dict[str, Any]:
    """``steps`` sends after connect(); rank 0 returns every actor's (version, largest
    difference from the gathered model) after each."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    _connect_ray(address)
    try:
        model, update = fsdp_mlp(rank, world) if kind == "fsdp" else _tp(rank, world)
        handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names] if rank == 0 else None
        versions, states = [], []
        with scheme.create_sender(handles, rank=rank) as sender:
            sender.register_model(model)
            for step in range(steps + 1):
                if step:
                    update(step)
                version = sender.connect(timeout=60) if not step else sender.send()
                versions.append(version)
                full = _gathered(model)
                if rank == 0:
                    states.append(_actor_states(names, full))
                dist.barrier()
        return {"versions": versions, "states": states}
    finally:
        dist.destroy_process_group()
        ray.shutdown()


def killed_rank(rank: int, world: int, address: str, scheme: Any, names: list[str],
                port: int) -> dict[str, Any]:
    """FSDP2 over 2 ranks, small chunks; rank 1 SIGKILLs itself after its first chunk of
    version 2. Rank 0 returns its error and what the actors hold then."""

    from weightsync.transports.ray import shard_stream

    init_gloo(rank, world, port)
    _connect_ray(address)
    shard_stream.CHUNK_BYTES = 64  # rank 0 picks it for every rank: several chunks each
    if rank == 1:
        def die(version: int, index: int) -> None:
            if version == 2 and index == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        shard_stream.send_hook = die
    model, _train = fsdp_mlp(rank, world)
    update = _local_update(model)
    handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names] if rank == 0 else None
    sender = scheme.create_sender(handles, rank=rank)
    sender.register_model(model)
    sender.connect(timeout=60)
    update(1)
    assert sender.send() == 1
    full = _gathered(model)
    update(2)  # every shard changes: a partly applied version 2 would show
    try:
        sender.send(timeout=20)
    except ws.TrainerRankLostError as exc:
        outcome: dict[str, Any] = {"error": type(exc).__name__, "rank": exc.rank,
                                   "message": str(exc)}
    else:
        outcome = {"error": None}
    outcome["states"] = _actor_states(names, full)
    sender.close()
    ray.shutdown()
    return outcome


def local_shard_rank(rank: int, world: int, address: str, scheme: Any, names: list[str],
                     port: int, case: str) -> dict[str, Any]:
    """LocalShard blocks of ``w`` (rows 0..5 on rank 0, 5..8 on rank 1; ``b`` a plain
    tensor, written by rank 0). ``case``: "ok", "shape" (rank 1 registers ``w`` with 5
    columns) or "overlap" (rank 1 registers rows 4..8). Returns each send's version, or
    the error raised."""
    import torch.distributed as dist

    init_gloo(rank, world, port)  # only so that rank 0 closes after rank 1 heard the verdict
    _connect_ray(address)
    try:
        cols = 5 if case == "shape" and rank == 1 else 4
        lo = (4 if case == "overlap" else 5) if rank == 1 else 0
        hi = 8 if rank == 1 else 5
        block = torch.arange(lo * cols, hi * cols, dtype=torch.float32).reshape(hi - lo, cols)
        weights = {"w": ws.LocalShard(block, (8, cols), (lo, 0)),
                   "b": torch.full((4,), 7.0)}
        handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names] if rank == 0 else None
        with scheme.create_sender(handles, rank=rank) as sender:
            sender.register_model(weights)
            try:
                version = sender.connect(timeout=30)
            except ws.SchemaMismatchError as exc:
                dist.barrier()
                return {"error": type(exc).__name__, "message": str(exc), "key": exc.key}
            states = _actor_states(names, {"w": torch.arange(32.0).reshape(8, 4),
                                           "b": torch.full((4,), 7.0)}) if rank == 0 else []
            dist.barrier()
            return {"version": version, "states": states}
    finally:
        dist.destroy_process_group()
        ray.shutdown()


def restarted_rank(rank: int, world: int, address: str, scheme: Any, names: list[str],
                   incarnation: int) -> dict[str, Any]:
    """LocalShard rows of ``w`` (0..5 on rank 0, 5..8 on rank 1) and ``b`` (rank 0).
    Rank 0 writes ``base + n`` into its rows and ``b`` for version n; rank 1 always
    ``base``. Rank 1's first incarnation SIGKILLs itself inside version 1; rank 0's send
    raises, then its next send (version 1 again: a failed version is not counted) goes out
    once a new rank 1 joined."""
    from weightsync.transports.ray import shard_stream

    _connect_ray(address)
    base = torch.arange(32.0).reshape(8, 4)
    lo, hi = (0, 5) if rank == 0 else (5, 8)
    block = base[lo:hi].clone()
    weights = {"w": ws.LocalShard(block, (8, 4), (lo, 0)), "b": torch.full((4,), 7.0)}
    if rank == 0:
        shard_stream.CHUNK_BYTES = 16  # one row a chunk: rank 1 sends 3
    elif incarnation == 0:
        def die(version: int, index: int) -> None:
            if version == 1 and index == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        shard_stream.send_hook = die

    def expected(n: int) -> dict[str, torch.Tensor]:
        w = base.clone()
        w[:5] += n
        return {"w": w, "b": torch.full((4,), 7.0 + n)}

    handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names] if rank == 0 else None
    try:
        with scheme.create_sender(handles, rank=rank) as sender:
            sender.register_model(weights)
            first = sender.connect(timeout=60)
            if rank == 1:
                if incarnation == 0:
                    sender.send(timeout=60)  # dies in here
                return {"connect": first, "joined_at": sender.writer.joined_at}
            out: dict[str, Any] = {"connect": first}
            block.add_(1.0)
            weights["b"].fill_(8.0)
            try:
                sender.send(timeout=20)
            except ws.TrainerRankLostError as exc:
                out["error"], out["rank"] = type(exc).__name__, exc.rank
            out["after_failure"] = _actor_states(names, expected(0))
            block.add_(1.0)
            weights["b"].fill_(9.0)
            out["retry"] = sender.send(timeout=60)
            out["after_retry"] = _actor_states(names, expected(2))
            return out
    finally:
        ray.shutdown()


def faulty_rank(rank: int, world: int, address: str, scheme: Any, names: list[str],
                port: int, fault: str) -> dict[str, Any]:
    """LocalShard rows as in :func:`restarted_rank`; inside version 1, rank 1 SIGSTOPs
    itself (``fault="stop"``) or rank 0 SIGKILLs itself (``"kill0"``). Each surviving
    rank returns the error its send raised and how long the send took. (The user's gloo
    group only holds rank 0 back until rank 1 heard that version 0 was committed: a rank 0
    that dies at once after committing leaves no one to tell it.)"""
    import torch.distributed as dist

    from weightsync.transports.ray import shard_stream

    init_gloo(rank, world, port)
    _connect_ray(address)
    base = torch.arange(32.0).reshape(8, 4)
    lo, hi = (0, 5) if rank == 0 else (5, 8)
    block = base[lo:hi].clone()
    weights = {"w": ws.LocalShard(block, (8, 4), (lo, 0)), "b": torch.full((4,), 7.0)}
    if rank == 0:
        shard_stream.CHUNK_BYTES = 16  # one row a chunk
    faulty, how = (1, signal.SIGSTOP) if fault == "stop" else (0, signal.SIGKILL)
    if rank == faulty:
        def hook(version: int, index: int) -> None:
            if version == 1 and index == 1:
                os.kill(os.getpid(), how)

        shard_stream.send_hook = hook
    handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names] if rank == 0 else None
    out: dict[str, Any] = {}
    try:
        with scheme.create_sender(handles, rank=rank) as sender:
            sender.register_model(weights)
            out["connect"] = sender.connect(timeout=60)
            dist.barrier()
            block.add_(1.0)
            t0 = time.monotonic()
            try:
                sender.send(timeout=8 if rank == 0 else 20)
            except ws.TrainerRankLostError as exc:
                out["error"], out["rank"] = type(exc).__name__, exc.rank
            out["seconds"] = time.monotonic() - t0
            if rank == 0:
                out["states"] = _actor_states(names, {"w": base, "b": torch.full((4,), 7.0)})
            return out
    finally:
        ray.shutdown()
