"""Collectors as Ray actors, kept in sync by a trainer in the driver.

Run: python examples/ray_actors.py [--steps N]
With RAY_ADDRESS set it joins that cluster (actors may land on any node); otherwise it
starts a local Ray instance.
"""

from __future__ import annotations

import argparse
import os

import ray
import torch

import weightsync as ws
from weightsync.integrations.ray import RayWeightReceiverMixin


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


@ray.remote(num_cpus=0, max_concurrency=2)  # deliveries land while collect() runs
class Collector(RayWeightReceiverMixin):
    def __init__(self, scheme: ws.RayWeightSyncScheme, idx: int) -> None:
        self.policy = make_policy()
        self.weightsync_setup(scheme, idx, self.policy)

    def collect(self) -> tuple[int, float]:
        self.weightsync_receiver.poll()  # take the newest version, whole, now
        with torch.no_grad():
            score = float(self.policy(torch.ones(1, 4)).sum())
        return self.weightsync_receiver.version, score


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:  # a local instance of our own, its traffic kept on this machine
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024)
    scheme = ws.RayWeightSyncScheme(num_workers=2, backend="gloo", timeout=60)
    collectors = [Collector.remote(scheme, i) for i in range(2)]
    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    with scheme.create_sender(collectors) as sender:
        sender.register_model(policy)
        sender.connect(timeout=120)                  # layouts checked, group built, version 0
        for _ in range(args.steps):
            loss = policy(torch.randn(16, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sender.send(timeout=60)                  # one broadcast for all actors
        with torch.no_grad():
            expected = float(policy(torch.ones(1, 4)).sum())
        results = ray.get([c.collect.remote() for c in collectors])
        print(f"trainer at version {sender.version}; collectors report {results}")
        assert all(v == sender.version and abs(s - expected) < 1e-5 for v, s in results)
    ray.shutdown()


if __name__ == "__main__":
    main()
