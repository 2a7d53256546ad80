"""``weightsync demo --collector torchrl``: the CartPole demo with TorchRL's own
``MultiSyncCollector`` gathering the data, kept in sync by a weightsync scheme.

The learner is the default demo's (REINFORCE, same network, 8+ whole episodes per update);
only the collection differs: TorchRL's collector workers play, and every update reaches
them through ``collector.update_policy_weights_()`` on weightsync's shared memory (``shm``)
or byte streams (``mp``). Every frame carries the ``policy_version`` that produced it.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync.demo.trainer import SOLVED_RETURN, make_policy, reinforce_loss

logger = logging.getLogger(__name__)

TRANSPORTS = ("shm", "mp")
#: frames each worker plays per collector batch (one full-length CartPole episode)
FRAMES_PER_WORKER = 500


def make_cartpole() -> Any:
    """The env factory handed to TorchRL's workers (module level: picklable)."""
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


@dataclass
class TorchRLDemoResult:
    """What one run did; ``seconds`` counts training time, after the workers started."""

    transport: str
    solved: bool
    iterations: int
    final_version: int
    seconds: float
    startup_seconds: float
    episodes: int
    last_mean_return: float
    median_send_ms: float
    #: (version tagged by the collector, version the trainer had sent) per training episode
    episode_versions: list[tuple[int, int]] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)


class _EpisodeSplitter:
    """Cuts each worker's stream of frames into whole episodes, carrying the unfinished
    tail of a batch over to that worker's next batch."""

    def __init__(self, workers: int) -> None:
        self.tails: list[list[dict[str, Any]]] = [[] for _ in range(workers)]

    def episodes(self, batch: Any) -> list[dict[str, Any]]:
        done = batch["next", "done"].squeeze(-1)
        out = []
        for w in range(batch.shape[0]):
            self.tails[w].append({
                "obs": batch["observation"][w], "actions": batch["action"][w].argmax(-1),
                "rewards": batch["next", "reward"][w].reshape(-1),
                "versions": batch["policy_version"][w], "done": done[w],
            })
            out.extend(self._cut(w))
        return out

    def _cut(self, w: int) -> list[dict[str, Any]]:
        parts = {k: torch.cat([p[k] for p in self.tails[w]]) for k in self.tails[w][0]}
        ends = parts["done"].nonzero().flatten().tolist()
        episodes, start = [], 0
        for end in ends:
            sl = slice(start, end + 1)
            episodes.append({
                "obs": parts["obs"][sl].numpy(), "actions": parts["actions"][sl].numpy(),
                "rewards": parts["rewards"][sl].numpy(),
                "version": int(parts["versions"][sl].min()),
            })
            start = end + 1
        self.tails[w] = [{k: v[start:] for k, v in parts.items()}]
        return episodes


def train(transport: str = "shm", workers: int = 2, max_iterations: int = 100_000,
          max_seconds: float = 300.0, seed: int = 0, batch_episodes: int = 8, lr: float = 3e-3,
          gamma: float = 0.99, log: Any = print) -> TorchRLDemoResult:
    """Learn CartPole-v1 with TorchRL's MultiSyncCollector on a weightsync scheme."""
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiSyncCollector
    from torchrl.modules import OneHotCategorical, ProbabilisticActor

    from weightsync.integrations.torchrl import (
        MultiProcessWeightSyncScheme,
        SharedMemWeightSyncScheme,
    )

    if transport not in TRANSPORTS:
        raise ValueError(f"--collector torchrl runs over {' or '.join(TRANSPORTS)}, "
                         f"not {transport!r}")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    net = make_policy()
    actor = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"], out_keys=["action"], distribution_class=OneHotCategorical)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    scheme_cls = SharedMemWeightSyncScheme if transport == "shm" else MultiProcessWeightSyncScheme
    scheme = scheme_cls(timeout=60)
    log(f"starting TorchRL's MultiSyncCollector with {workers} workers, synced over "
        f"weightsync's {scheme_cls.__name__} ({transport})...")
    t_launch = time.monotonic()
    collector = MultiSyncCollector(
        [make_cartpole] * workers, actor, frames_per_batch=FRAMES_PER_WORKER * workers,
        total_frames=-1, weight_sync_schemes={"policy": scheme}, track_policy_version=True)
    splitter = _EpisodeSplitter(workers)
    returns: deque[float] = deque(maxlen=20)
    episodes_seen, iteration, send_ms = 0, 0, []
    history: list[dict[str, float]] = []
    episode_versions: list[tuple[int, int]] = []
    pending: list[dict[str, Any]] = []
    t_train = time.monotonic()
    last_line = 0.0
    try:
        collector.set_seed(seed)
        t_train = time.monotonic()
        log(f"workers ready in {t_train - t_launch:.1f}s; training")
        for batch in collector:
            for episode in splitter.episodes(batch):
                episodes_seen += 1
                returns.append(float(episode["rewards"].sum()))
                episode_versions.append((episode["version"], scheme.version))
                pending.append(episode)
            solved = len(returns) == returns.maxlen and statistics.fmean(returns) >= SOLVED_RETURN
            out_of_time = time.monotonic() - t_train >= max_seconds
            if solved or out_of_time or iteration >= max_iterations:
                break
            if len(pending) < batch_episodes:
                continue  # long episodes: gather more before the next update
            loss = reinforce_loss(net, pending, gamma)
            pending = []
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            t0 = time.perf_counter()
            collector.update_policy_weights_()
            send_ms.append((time.perf_counter() - t0) * 1e3)
            iteration += 1
            mean_return = statistics.fmean(returns)
            history.append({"t": time.monotonic() - t_train, "mean_return": mean_return,
                            "send_ms": send_ms[-1], "version": scheme.version})
            if time.monotonic() - last_line > 2.0:
                last_line = time.monotonic()
                log(f"iteration {iteration:4d}  version {scheme.version:4d}  mean return "
                    f"{mean_return:6.1f}  send {send_ms[-1]:.2f} ms")
    finally:
        seconds = time.monotonic() - t_train
        final_version = scheme.version
        collector.shutdown()
    last = statistics.fmean(returns) if returns else 0.0
    return TorchRLDemoResult(
        transport, len(returns) == returns.maxlen and last >= SOLVED_RETURN, iteration,
        final_version, seconds, t_train - t_launch, episodes_seen, last,
        statistics.median(send_ms) if send_ms else float("nan"), episode_versions, history)


def summary(result: TorchRLDemoResult, workers: int) -> str:
    outcome = "SOLVED" if result.solved else "stopped"
    return (f"{outcome}: CartPole-v1 with TorchRL's MultiSyncCollector ({workers} workers) "
            f"over weightsync {result.transport} in {result.seconds:.1f}s of training "
            f"(workers started in {result.startup_seconds:.1f}s): {result.iterations} "
            f"iterations, {result.episodes} episodes, mean return of the last 20 episodes "
            f"{result.last_mean_return:.1f}, version {result.final_version}, median send "
            f"{result.median_send_ms:.2f} ms")


def run_demo(args: argparse.Namespace) -> int:
    """The CLI's entry: train, print the summary, write it as JSON into ``output_dir``;
    exit status 0 when solved (or for a short run capped by ``max_iterations``)."""
    workers = int(getattr(args, "workers", 2))
    max_iterations = int(getattr(args, "max_iterations", 100_000))
    transport = getattr(args, "transport", "shm")
    if transport not in TRANSPORTS:
        print(f"weightsync demo: --collector torchrl runs over --transport "
              f"{' or '.join(TRANSPORTS)}, not {transport!r}", file=sys.stderr)
        return 2
    result = train(
        transport=transport, workers=workers,
        max_iterations=max_iterations, max_seconds=float(getattr(args, "max_seconds", 300.0)),
        seed=int(getattr(args, "seed", 0)))
    line = summary(result, workers)
    print(line)
    output_dir = getattr(args, "output_dir", None)
    if output_dir:
        path = Path(output_dir) / f"weightsync-demo-torchrl-{result.transport}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(result)
        data.pop("episode_versions")
        path.write_text(json.dumps(data | {"summary": line}, indent=1))
        print(f"summary written to {path}")
    short_run = max_iterations < 100_000 or getattr(args, "allow_unsolved", False)
    return 0 if result.solved or short_run else 1
