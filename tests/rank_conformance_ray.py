"""The Ray scheme in the rank-protocol conformance suite (``rank_conformance.py``): the
worker is a Ray actor, each rank a process that joins the test's Ray instance; rank 0 hands
the scheme the actor's handle. Importable by spawn and by Ray workers (PYTHONPATH)."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import ray
import torch
from rank_conformance import (
    Forger,
    Model,
    Transport,
    forged_done,
    forged_hello,
    made_up_key,
    uniform,
)

import weightsync as ws
from weightsync.integrations.ray import RayWeightReceiverMixin
from weightsync.schemes.ray import SHARDED_NAMESPACE

#: the Ray namespace the test's actors are named in (the scheme's rendezvous has its own)
NAMESPACE = "weightsync-tests"


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
