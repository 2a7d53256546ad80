"""TorchRL's own SharedMemWeightSyncScheme against weightsync's, inside the same TorchRL
collector, with a tear check.

The policy is a probe: every step reports the min and max of all its weights. The trainer
fills every weight with the version number (as an optimizer step writes in place) and calls
``collector.update_policy_weights_()`` while the collector workers keep acting
(``MultiAsyncCollector``). A frame whose min and max differ was computed from a mix of two
versions: a torn read. Also measured: the median ``update_policy_weights_()`` call and the
frames collected per second.

    python examples/torchrl_tear_check.py              # both schemes, 60 updates each
    python examples/torchrl_tear_check.py --updates 200 --tensors 32 --floats 65536
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn


def make_cartpole() -> Any:
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


class VersionProbe(nn.Module):
    """``tensors`` weight tensors of ``floats`` values each; outputs an action that keeps the
    pole up and the min and max of every weight it holds."""

    def __init__(self, tensors: int, floats: int) -> None:
        super().__init__()
        self.chunks = nn.ParameterList(nn.Parameter(torch.zeros(floats)) for _ in range(tensors))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lo = torch.stack([c.detach().min() for c in self.chunks]).min()
        hi = torch.stack([c.detach().max() for c in self.chunks]).max()
        action = nn.functional.one_hot((observation[..., 2] > 0).long(), 2)
        shape = observation.shape[:-1]
        return action, lo.expand(shape).clone(), hi.expand(shape).clone()


def run(scheme: Any, label: str, args: argparse.Namespace) -> dict[str, Any]:
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiAsyncCollector

    policy = TensorDictModule(VersionProbe(args.tensors, args.floats), in_keys=["observation"],
                              out_keys=["action", "probe_min", "probe_max"])
    collector = MultiAsyncCollector(
        [make_cartpole] * args.workers, policy, frames_per_batch=args.frames_per_batch,
        total_frames=-1, weight_sync_schemes={"policy": scheme})
    frames = torn = 0
    update_ms: list[float] = []
    try:
        t0 = time.perf_counter()
        for version, batch in enumerate(collector, start=1):
            lo, hi = batch["probe_min"], batch["probe_max"]
            torn += int((lo != hi).sum())
            frames += lo.numel()
            if version > args.updates:
                break
            with torch.no_grad():  # the trainer's step: every weight becomes `version`
                for chunk in policy.module.chunks:
                    chunk.fill_(float(version))
            start = time.perf_counter()
            collector.update_policy_weights_()
            update_ms.append((time.perf_counter() - start) * 1e3)
        seconds = time.perf_counter() - t0
    finally:
        collector.shutdown()
    return {"scheme": label, "frames": frames, "torn": torn,
            "update_ms": statistics.median(update_ms), "fps": frames / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--frames-per-batch", type=int, default=100)
    parser.add_argument("--tensors", type=int, default=16, help="weight tensors in the probe")
    parser.add_argument("--floats", type=int, default=65536, help="float32 values per tensor")
    args = parser.parse_args()
    try:
        import torchrl.weight_update as torchrl_schemes
    except ImportError:
        raise SystemExit("this example needs TorchRL: pip install 'weightsync[torchrl]'") from None

    import weightsync.integrations.torchrl as weightsync_schemes

    size_mb = args.tensors * args.floats * 4 / 2**20
    print(f"MultiAsyncCollector, {args.workers} workers on CartPole-v1, a {size_mb:.1f} MB "
          f"policy in {args.tensors} tensors, {args.updates} updates while the workers act\n")
    rows = [run(torchrl_schemes.SharedMemWeightSyncScheme(), "torchrl SharedMemWeightSyncScheme",
                args),
            run(weightsync_schemes.SharedMemWeightSyncScheme(),
                "weightsync SharedMemWeightSyncScheme", args)]
    print("| scheme | frames | torn frames (mixed versions) | median update_policy_weights_() | "
          "frames/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scheme']} | {r['frames']} | {r['torn']} | {r['update_ms']:.2f} ms | "
              f"{r['fps']:.0f} |")


if __name__ == "__main__":
    main()
