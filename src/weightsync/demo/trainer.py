"""``weightsync demo``: a trainer learns CartPole-v1 while collector processes gather
episodes with a policy that weightsync keeps in sync after every training step.

The learner is REINFORCE with reward-to-go and normalised advantages, in plain PyTorch.
Every episode carries the policy version that played it, so the display shows how far
behind the trainer the data is (the version lag). Episodes more than ``max_lag`` versions
old are dropped: the method is on-policy. Ctrl-C stops the run cleanly and prints the
summary so far.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from weightsync.demo.collectors import (
    CollectorError,
    Collectors,
    StopRequest,
    make_policy,
    process_collectors,
    ray_collectors,
    sigint_ignored,
)
from weightsync.demo.display import SOLVED_RETURN, Display, plot_history
from weightsync.units import format_duration

TRANSPORTS = ("shm", "mp", "file", "ray")
#: the longest wait for one episode from any collector
EPISODE_TIMEOUT_S = 60.0

__all__ = ["SOLVED_RETURN", "TRANSPORTS", "CollectorError", "DemoResult", "make_policy",
           "reinforce_loss", "run_demo"]


def reinforce_loss(policy: torch.nn.Module, episodes: list[dict[str, Any]], gamma: float) -> torch.Tensor:
    """REINFORCE with reward-to-go, normalised advantages and a small entropy bonus."""
    obs = torch.cat([torch.as_tensor(np.array(e["obs"])) for e in episodes])
    actions = torch.cat([torch.as_tensor(np.array(e["actions"])) for e in episodes])
    returns = []
    for e in episodes:
        ret, out = 0.0, []
        for r in reversed(e["rewards"].tolist()):
            ret = r + gamma * ret
            out.append(ret)
        returns.append(torch.tensor(out[::-1]))
    advantages = torch.cat(returns)
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    log_probs = torch.log_softmax(policy(obs), dim=-1)  # one forward pass for both terms
    logp = log_probs.gather(1, actions[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return -(logp * advantages).mean() - 0.01 * entropy.mean()


@dataclass
class DemoResult:
    """What one run did; ``seconds`` counts training time, after the collectors started."""

    transport: str
    solved: bool
    iterations: int
    final_version: int
    seconds: float
    episodes: int
    first_mean_return: float  # as the first progress line shows it
    last_mean_return: float
    median_send_ms: float
    mean_lag: float
    batch_versions: list[int] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)
    plot: str | None = None
    startup_seconds: float = 0.0
    interrupted: bool = False


def _collectors(transport: str, workers: int, seed: int) -> Collectors:
    if transport == "ray":
        return ray_collectors(workers, seed)
    return process_collectors(transport, workers, seed)


def run_demo(
    transport: str = "shm", workers: int = 2, max_iterations: int = 100_000,
    max_seconds: float = 180.0, batch_episodes: int = 8, lr: float = 3e-3, gamma: float = 0.99,
    max_lag: int = 3, seed: int = 0, plot: str | bool | None = True,
    output_dir: str | Path = "demo-output", live: bool = True,
    log: Callable[[str], None] = print,
) -> DemoResult:
    """Train until solved, ``max_iterations`` or ``max_seconds`` (or Ctrl-C), then log a
    summary. ``plot``: True writes ``weightsync-demo-<transport>.png`` into ``output_dir``,
    a string is the PNG's path, None or False writes none. Raises :class:`CollectorError`
    if a collector fails (at start-up: at once, with its own error)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    returns: deque[float] = deque(maxlen=20)
    all_returns: list[float] = []
    history: list[dict[str, float]] = []
    send_s: list[float] = []
    lags: list[int] = []
    batch_versions: list[int] = []
    iteration, final_version, interrupted = 0, 0, False
    t_launch = time.monotonic()
    t_train = t_launch
    display = Display(live, log)
    stop = StopRequest()
    log(f"starting {workers} collector{'s' if workers > 1 else ''} over {transport}...")
    collectors = _collectors(transport, workers, seed)
    try:
        with collectors.make_sender() as sender:
            try:
                sender.register_model(policy)
                collectors.start()
                sender.connect(timeout=120)
                t_train = time.monotonic()
                log(f"collectors ready in {format_duration(t_train - t_launch)}; training "
                    f"(Ctrl-C stops and prints the summary)")
                display.start()
                with stop.armed():  # Ctrl-C: the step under way ends, then the run
                    while (iteration < max_iterations and not stop.requested
                           and time.monotonic() - t_train < max_seconds):
                        batch: list[dict[str, Any]] = []
                        while len(batch) < batch_episodes and not stop.requested:
                            episode = collectors.next_episode(EPISODE_TIMEOUT_S)
                            lag = sender.version - int(episode["version"])
                            lags.append(lag)
                            total = float(episode["rewards"].sum())
                            returns.append(total)
                            all_returns.append(total)
                            if lag <= max_lag:
                                batch.append(episode)
                        if stop.requested:
                            break
                        batch_versions.extend(int(e["version"]) for e in batch)
                        loss = reinforce_loss(policy, batch, gamma)
                        optimizer.zero_grad()
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                        optimizer.step()
                        t0 = time.perf_counter()
                        version = (sender.update_weights() if transport == "file"
                                   else sender.send(timeout=60))
                        send_s.append(time.perf_counter() - t0)
                        iteration += 1
                        mean_return = statistics.fmean(returns)
                        history.append({"t": time.monotonic() - t_train,
                                        "mean_return": mean_return,
                                        "send_ms": send_s[-1] * 1e3, "version": version,
                                        "lag": statistics.fmean(lags[-batch_episodes:])})
                        display.update(iteration, version, mean_return, history[-1]["lag"],
                                       send_s[-1], history[-1]["t"])
                        if len(returns) == returns.maxlen and mean_return >= SOLVED_RETURN:
                            break
                interrupted = stop.requested
            except KeyboardInterrupt:
                interrupted = True
            finally:
                display.stop()
                with sigint_ignored():
                    collectors.stop()  # they say goodbye before the sender closes
            final_version = sender.version
    except KeyboardInterrupt:  # while the sender closed
        interrupted = True
    finally:
        with sigint_ignored():
            collectors.stop()  # again, if the sender could not be created: a no-op otherwise
    solved = len(returns) == returns.maxlen and statistics.fmean(returns) >= SOLVED_RETURN
    result = DemoResult(
        transport, solved, iteration, final_version,
        history[-1]["t"] if history else 0.0, len(all_returns),
        history[0]["mean_return"] if history else 0.0,
        history[-1]["mean_return"] if history else 0.0,
        statistics.median(send_s) * 1e3 if send_s else float("nan"),
        statistics.fmean(lags) if lags else 0.0, batch_versions, history,
        startup_seconds=t_train - t_launch, interrupted=interrupted,
    )
    if plot and history:
        path = Path(plot) if isinstance(plot, str) else (
            Path(output_dir) / f"weightsync-demo-{transport}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        with sigint_ignored():
            result.plot = plot_history(
                history, len(all_returns), str(path),
                f"CartPole-v1, {workers} collectors synced over {transport}",
                result.seconds if solved else None)
    log(_summary(result, workers))
    return result


def _summary(result: DemoResult, workers: int) -> str:
    outcome = ("interrupted" if result.interrupted else
               "SOLVED" if result.solved else "stopped")
    return (
        f"{outcome}: CartPole-v1 over {result.transport}, {format_duration(result.seconds)} of "
        f"training (collectors started in {format_duration(result.startup_seconds)}): "
        f"{result.iterations} iterations, {result.episodes} episodes from {workers} collectors, "
        f"mean return {result.first_mean_return:.1f} -> {result.last_mean_return:.1f}, "
        f"version {result.final_version}, median send "
        f"{format_duration(result.median_send_ms / 1e3)}, mean lag {result.mean_lag:.2f} versions"
        + (f"; plot: {result.plot}" if result.plot else "")
    )
