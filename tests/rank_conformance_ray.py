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
from rank_conformance import Model, Transport, uniform

import weightsync as ws
from weightsync.integrations.ray import RayWeightReceiverMixin

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


class Ray(Transport):
    name = "ray"

    def __init__(self, timeout: float, address: str) -> None:
        self.scheme = ws.RayWeightSyncScheme(num_workers=1, trainer_ranks=2, timeout=timeout)
        self.address = address
        self.actor = f"conformance-{uuid.uuid4().hex[:8]}"

    def rank_scheme(self) -> Any:
        return RankSide(self.scheme, self.address, self.actor)

    def worker_scheme(self) -> Any:
        return self.scheme

    def posing_scheme(self) -> Any:
        """An actor holds the scheme (Ray calls are inside the boundary)."""
        return RankSide(self.scheme, self.address, self.actor)

    def worker(self) -> RayWorker:
        return RayWorker(self.actor, self.scheme)
