"""Ray across two hosts, timed: 400 MB from a trainer on host A to 1 and 2 actors on host B,
beside one gloo point-to-point transfer of the same bytes between the hosts, in one run.

The hosts are two network namespaces joined by a veth pair (``tests/multihost.py``), so
the figures measure weightsync's overhead over the floor, not a network's bandwidth. Needs
root. Usage: ``.venv/bin/python scripts/bench_ray_multihost.py [--mb 400] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import ray  # noqa: E402
import torch.distributed as dist  # noqa: E402
from multihost import two_host_cluster, unavailable_reason  # noqa: E402

from weightsync.bench.ray_actors import p2p_seconds  # noqa: E402
from weightsync.integrations.ray import RayWeightReceiverMixin  # noqa: E402
from weightsync.schemes.ray import RayWeightSyncScheme  # noqa: E402
from weightsync.transports.ray.group import GroupInfo, WeightGroup, wire_checksums  # noqa: E402


def make_weights(nbytes: int, fill: float = 0.0) -> dict[str, torch.Tensor]:
    """Four float32 tensors of ``nbytes`` in all."""
    n = nbytes // 4 // 4
    return {f"layer{i}.weight": torch.full((n,), fill) for i in range(4)}


@ray.remote(num_cpus=0)
class BenchActor(RayWeightReceiverMixin):
    def __init__(self, scheme: Any, idx: int, nbytes: int) -> None:
        torch.set_num_threads(1)
        self.weightsync_setup(scheme, idx, make_weights(nbytes), announce=False)
        self.p2p_buffer = torch.zeros(nbytes, dtype=torch.uint8)

    def apply(self) -> int:
        self.weightsync_receiver.poll()
        return self.weightsync_receiver.version

    def path(self) -> str | None:
        return self.weightsync_receiver.path

    def p2p_recv(self, info: dict[str, Any]) -> float:
        group = WeightGroup(GroupInfo(**info), 1)
        t0 = time.perf_counter()
        group.pg.recv([self.p2p_buffer], 0, 0).wait()
        return time.perf_counter() - t0


def time_sends(cluster: Any, nbytes: int, workers: int, repeats: int,
               relay: bool = True) -> dict[str, list[float]]:
    """Sends to ``workers`` actors on host B, with and without checksums in turn (the same
    actors and buffers, so the pair differs only by the checksums), each round beside one
    gloo point-to-point transfer to the first actor (``p2p``: the floor measured under the
    same load as that round's sends). ``relay=False``: every actor takes the broadcast
    (``node_local=False``), none copies from host B's relay."""
    scheme = RayWeightSyncScheme(num_workers=workers, timeout=300, node_local=relay)
    actors = [BenchActor.options(**cluster.on("b")).remote(scheme, i, nbytes)
              for i in range(workers)]
    weights = make_weights(nbytes, fill=1.0)
    out: dict[str, list[float]] = {"send": [], "applied": [], "send_no_checksum": [],
                                   "applied_no_checksum": [], "p2p": []}
    address = "10.213.0.1"
    store = dist.TCPStore(address, 0, None, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    payload = torch.ones(nbytes, dtype=torch.uint8)
    try:
        with scheme.create_sender(actors) as sender:
            sender.register_model(weights)
            sender.connect(timeout=300)
            # one broadcast to host B: its first actor relays to the others
            assert ray.get([a.path.remote() for a in actors]) == (
                ["broadcast"] + ["relayed" if relay else "broadcast"] * (workers - 1))
            for i in range(repeats + 1):
                for checksums in (True, False):
                    sender.writer.checksums = checksums  # read at each send
                    t0 = time.perf_counter()
                    sender.send(timeout=300)
                    t1 = time.perf_counter()
                    ray.get([a.apply.remote() for a in actors])
                    if i:  # the first round warms buffers and connections
                        suffix = "" if checksums else "_no_checksum"
                        out["send" + suffix].append(t1 - t0)
                        out["applied" + suffix].append(time.perf_counter() - t0)
                seconds = p2p_seconds(actors[0], store, address, 2000 + i, payload)
                if i:
                    out["p2p"].append(seconds)
    finally:
        for actor in actors:
            ray.kill(actor)
    return out


def time_p2p(cluster: Any, nbytes: int, repeats: int) -> list[float]:
    """One gloo send of ``nbytes`` from host A to an actor on host B (warm buffers)."""
    actor = BenchActor.options(**cluster.on("b")).remote(
        RayWeightSyncScheme(num_workers=1), 0, nbytes)
    address = "10.213.0.1"
    store = dist.TCPStore(address, 0, None, True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    payload = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    try:
        for i in range(repeats + 1):
            seconds = p2p_seconds(actor, store, address, 1000 + i, payload)
            if i:
                times.append(seconds)
    finally:
        ray.kill(actor)
    return times


def time_checksum(nbytes: int, repeats: int) -> list[float]:
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        wire_checksums([buffer])
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--without-relay", action="store_true",
                        help="also time 2+ actors each taking the broadcast (no relay)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot build the two-host cluster: {reason}")
    torch.set_num_threads(1)
    nbytes = args.mb * 1_000_000
    med = statistics.median
    results: dict[str, Any] = {"mb": args.mb, "repeats": args.repeats}
    with two_host_cluster(str(ROOT / "tests")) as cluster:
        results["p2p_s"] = med(time_p2p(cluster, nbytes, args.repeats))
        for workers in args.workers:
            times = time_sends(cluster, nbytes, workers, args.repeats)
            key = f"{workers}_actor{'s' if workers > 1 else ''}"
            results[key] = {phase: med(t) for phase, t in times.items()}
            # per round, against that round's floor: less exposed to load that drifts
            results[key]["send_over_p2p_paired"] = med(
                [s / p for s, p in zip(times["send"], times["p2p"], strict=True)])
            results[key]["checksum_cost_paired"] = med(
                [a / b - 1 for a, b in zip(times["send"], times["send_no_checksum"],
                                           strict=True)])
            print(f"{key}: {results[key]}", flush=True)
            if workers > 1 and args.without_relay:
                times = time_sends(cluster, nbytes, workers, args.repeats, relay=False)
                results[key + "_without_relay"] = {phase: med(t) for phase, t in times.items()}
                print(f"{key}_without_relay: {results[key + '_without_relay']}", flush=True)
        results["p2p_after_s"] = med(time_p2p(cluster, nbytes, args.repeats))
    results["checksum_one_pass_s"] = med(time_checksum(nbytes, args.repeats))
    floor = min(results["p2p_s"], results["p2p_after_s"])
    ratios = results["ratios"] = {}
    for key in ("1_actor", "2_actors"):
        if key in results:
            figures = results[key]
            ratios[f"{key}_over_p2p"] = figures["send"] / floor
            ratios[f"checksum_cost_{key}"] = figures["send"] / figures["send_no_checksum"] - 1
    if "1_actor" in results and "2_actors" in results:
        ratios["2_actors_over_1_actor"] = results["2_actors"]["send"] / results["1_actor"]["send"]
        ratios["2_actors_over_1_actor_no_checksum"] = (
            results["2_actors"]["send_no_checksum"] / results["1_actor"]["send_no_checksum"])
        ratios["2_actors_over_1_actor_paired"] = (  # each against its own rounds' floor
            results["2_actors"]["send_over_p2p_paired"]
            / results["1_actor"]["send_over_p2p_paired"])
    if "1_actor" in results and "2_actors_without_relay" in results:
        ratios["2_actors_without_relay_over_1_actor"] = (
            results["2_actors_without_relay"]["send"] / results["1_actor"]["send"])
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
