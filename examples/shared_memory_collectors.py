"""Collector processes that keep a policy in sync with a trainer through shared memory.

Run: python examples/shared_memory_collectors.py [--steps N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp

import torch

import weightsync as ws
from weightsync.units import format_duration


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def collector(scheme: ws.SharedMemWeightSyncScheme, idx: int, results: mp.Queue) -> None:
    policy = make_policy()
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(policy)
    receiver.connect(timeout=60)
    versions = []
    while True:
        try:
            receiver.receive(timeout=1.0)  # a real collector would poll() between episodes
        except ws.SenderLostError:  # the trainer closed: done
            break
        with torch.no_grad():
            action = policy(torch.ones(1, 4)).argmax().item()
        versions.append((receiver.version, action))
    results.put((idx, versions[-1][0] if versions else receiver.version))
    receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    scheme = ws.SharedMemWeightSyncScheme(num_workers=2, timeout=30)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=collector, args=(scheme, i, results)) for i in range(2)]
    for p in procs:
        p.start()
    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    with scheme.create_sender() as sender:
        sender.register_model(policy)
        sender.connect(timeout=60)
        for _ in range(args.steps):
            loss = policy(torch.randn(16, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            version = sender.send()
        phases = sender.stats()["last"]["phases"]
        timing = ", ".join(f"{name} {format_duration(sec)}" for name, sec in phases.items())
        print(f"trainer sent {version} versions; the last one took {timing}")
    finals = dict(results.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(30)
    print(f"collectors ended on versions {finals}")
    assert all(v == args.steps for v in finals.values()), finals


if __name__ == "__main__":
    main()
