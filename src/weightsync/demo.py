"""``weightsync demo``: a trainer learns CartPole-v1 while collector processes gather
episodes with a policy that weightsync keeps in sync after every training step.

The learner is REINFORCE with reward-to-go and normalised advantages, in plain PyTorch.
Every episode carries the policy version that played it, so the display shows how far
behind the trainer the data is (the version lag). Episodes more than ``max_lag`` versions
old are dropped: the method is on-policy.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SOLVED_RETURN = 475.0
TRANSPORTS = ("shm", "mp", "file", "ray")


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 2),
    )


# ---------------------------------------------------------------------- collectors
def play_episode(env: Any, policy: torch.nn.Module, generator: torch.Generator) -> dict[str, Any]:
    obs, _ = env.reset(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
    observations, actions, rewards = [], [], []
    done = False
    with torch.no_grad():
        while not done:
            x = torch.as_tensor(obs, dtype=torch.float32)
            probs = torch.softmax(policy(x), dim=-1)
            action = int(torch.multinomial(probs, 1, generator=generator))
            observations.append(x)
            actions.append(action)
            obs, reward, terminated, truncated, _ = env.step(action)
            rewards.append(float(reward))
            done = terminated or truncated
    # numpy arrays: queues pickle them plainly (torch tensors would travel as shared fds)
    return {"obs": torch.stack(observations).numpy(), "actions": torch.tensor(actions).numpy(),
            "rewards": torch.tensor(rewards).numpy()}


def collector_loop(receiver: Any, policy: torch.nn.Module, idx: int, out: Any,
                   should_stop: Callable[[], bool], seed: int) -> None:
    """Play episodes forever, taking the newest weights before each one."""
    import gymnasium as gym

    from weightsync.core.errors import SenderLostError

    torch.set_num_threads(1)
    env = gym.make("CartPole-v1")
    generator = torch.Generator().manual_seed(seed + idx)
    while not should_stop():
        try:
            receiver.poll()
        except SenderLostError:
            break
        episode = play_episode(env, policy, generator)
        episode.update(worker=idx, version=receiver.version)
        out.put(episode)
    env.close()


def _process_collector(scheme: Any, idx: int, out: Any, stop: Any, seed: int) -> None:
    policy = make_policy()
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(policy)
    receiver.connect(timeout=120)
    try:
        collector_loop(receiver, policy, idx, out, stop.is_set, seed)
    finally:
        receiver.close()


def _ray_collector_class() -> Any:
    import ray

    from weightsync.integrations.ray import RayWeightReceiverMixin

    @ray.remote(num_cpus=0, max_concurrency=2)  # type: ignore[call-overload]  # deliveries run beside the loop
    class Collector(RayWeightReceiverMixin):
        def __init__(self, scheme: Any, idx: int, out: Any, seed: int) -> None:
            self.policy = make_policy()
            self.idx, self.out, self.seed = idx, out, seed
            self.stopped = False
            self.weightsync_setup(scheme, idx, self.policy, announce=False)

        def run(self) -> None:
            self.weightsync_receiver.connect(timeout=120)
            collector_loop(self.weightsync_receiver, self.policy, self.idx, self.out,
                           lambda: self.stopped, self.seed)

        def stop(self) -> None:
            self.stopped = True

    return Collector


# ---------------------------------------------------------------------- learner
def reinforce_loss(policy: torch.nn.Module, episodes: list[dict[str, Any]], gamma: float) -> torch.Tensor:
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
    transport: str
    solved: bool
    iterations: int
    final_version: int
    seconds: float
    episodes: int
    first_mean_return: float
    last_mean_return: float
    median_send_ms: float
    mean_lag: float
    batch_versions: list[int] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)
    plot: str | None = None


def run_demo(
    transport: str = "shm", workers: int = 2, max_iterations: int = 100_000,
    max_seconds: float = 180.0, batch_episodes: int = 8, lr: float = 3e-3, gamma: float = 0.99,
    max_lag: int = 3, seed: int = 0, plot: str | None = "weightsync-demo.png",
    live: bool = True, log: Callable[[str], None] = print,
) -> DemoResult:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    make_sender, out, start_collectors, stop_collectors = _transport(transport, workers, seed)
    returns: deque[float] = deque(maxlen=20)
    all_returns: list[float] = []
    history: list[dict[str, float]] = []
    send_ms: list[float] = []
    lags: list[int] = []
    batch_versions: list[int] = []
    t_start = time.monotonic()
    iteration = 0
    display = _Display(live, log)
    try:
        with make_sender() as sender:
            sender.register_model(policy)
            start_collectors()
            sender.connect(timeout=120)
            display.start()
            while iteration < max_iterations and time.monotonic() - t_start < max_seconds:
                batch: list[dict[str, Any]] = []
                while len(batch) < batch_episodes:
                    episode = out.get(timeout=60)
                    lag = sender.version - int(episode["version"])
                    lags.append(lag)
                    total = float(episode["rewards"].sum())
                    returns.append(total)
                    all_returns.append(total)
                    if lag <= max_lag:
                        batch.append(episode)
                batch_versions.extend(int(e["version"]) for e in batch)
                loss = reinforce_loss(policy, batch, gamma)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                optimizer.step()
                t0 = time.perf_counter()
                version = sender.update_weights() if transport == "file" else sender.send(timeout=60)
                send_ms.append((time.perf_counter() - t0) * 1e3)
                iteration += 1
                mean_return = statistics.fmean(returns)
                history.append({"t": time.monotonic() - t_start, "mean_return": mean_return,
                                "send_ms": send_ms[-1], "version": version,
                                "lag": statistics.fmean(lags[-batch_episodes:])})
                display.update(iteration, version, mean_return, history[-1]["lag"], send_ms[-1])
                if len(returns) == returns.maxlen and mean_return >= SOLVED_RETURN:
                    break
            final_version = sender.version
    finally:
        display.stop()
        stop_collectors()
    seconds = time.monotonic() - t_start
    solved = len(returns) == returns.maxlen and statistics.fmean(returns) >= SOLVED_RETURN
    result = DemoResult(
        transport, solved, iteration, final_version, seconds, len(all_returns),
        statistics.fmean(all_returns[:20]) if all_returns else 0.0,
        statistics.fmean(returns) if returns else 0.0,
        statistics.median(send_ms) if send_ms else float("nan"),
        statistics.fmean(lags) if lags else 0.0, batch_versions, history,
    )
    if plot:
        result.plot = _plot(history, all_returns, plot, transport)
    log(
        f"{'SOLVED' if solved else 'stopped'} CartPole-v1 over {transport} in {seconds:.1f}s: "
        f"{iteration} iterations, {len(all_returns)} episodes from {workers} collectors, "
        f"mean return {result.first_mean_return:.1f} -> {result.last_mean_return:.1f}, "
        f"version {final_version}, median send {result.median_send_ms:.2f} ms, mean lag "
        f"{result.mean_lag:.2f} versions" + (f"; plot: {result.plot}" if result.plot else "")
    )
    return result


Collectors = tuple[Callable[[], Any], Any, Callable[[], None], Callable[[], None]]


def _transport(transport: str, workers: int, seed: int) -> Collectors:
    """A sender factory, the episode queue, and start/stop for the collectors."""
    import weightsync as ws

    if transport == "ray":
        return _ray_transport(workers, seed)
    if transport == "file":
        directory = tempfile.mkdtemp(prefix="weightsync-demo-",
                                     dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        scheme: Any = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=workers, timeout=60)
    elif transport == "mp":
        scheme = ws.MultiProcessWeightSyncScheme(num_workers=workers, timeout=60)
    else:
        scheme = ws.SharedMemWeightSyncScheme(num_workers=workers, timeout=60)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_process_collector, args=(scheme, i, out, stop, seed), daemon=True)
             for i in range(workers)]

    def start() -> None:
        for p in procs:
            p.start()

    def finish() -> None:
        stop.set()
        deadline = time.monotonic() + 20
        for p in procs:
            while p.is_alive() and time.monotonic() < deadline:
                with _suppress_any():
                    while True:
                        out.get_nowait()  # a child cannot exit with unflushed queue data
                p.join(0.05)
            if p.is_alive():
                p.kill()
                p.join(5)
        if transport == "file":
            import shutil

            shutil.rmtree(scheme.directory, ignore_errors=True)

    return scheme.create_sender, out, start, finish


def _ray_transport(workers: int, seed: int) -> Collectors:
    import ray
    from ray.util.queue import Queue

    import weightsync as ws

    started = not ray.is_initialized()
    if started:
        # a local instance of our own: keep its traffic on this machine
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024)
    scheme = ws.RayWeightSyncScheme(num_workers=workers, timeout=60)
    out = Queue()
    collector_cls = _ray_collector_class()
    actors = [collector_cls.remote(scheme, i, out, seed) for i in range(workers)]
    runs: list[Any] = []

    def start() -> None:
        pass  # the loops start after connect: see _RayQueue.get

    def finish() -> None:
        for actor in actors:
            with _suppress_any():
                ray.get(actor.stop.remote(), timeout=10)
        with _suppress_any():
            ray.get(runs, timeout=20)
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()

    class _RayQueue:
        def get(self, timeout: float) -> Any:
            if not runs:
                runs.extend(actor.run.remote() for actor in actors)
            return out.get(timeout=timeout)

    return lambda: scheme.create_sender(actors), _RayQueue(), start, finish


class _suppress_any:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, *rest: Any) -> bool:
        return kind is not None and issubclass(kind, Exception)


class _Display:
    """A live rich table in a terminal; one line every few iterations elsewhere (CI)."""

    def __init__(self, live: bool, log: Callable[[str], None]) -> None:
        self.log = log
        self.live = None
        self.last_line = 0.0
        if live:
            from rich.console import Console

            console = Console()
            if console.is_terminal:
                from rich.live import Live

                self.live = Live(console=console, refresh_per_second=8)

    def start(self) -> None:
        if self.live is not None:
            self.live.start()

    def update(self, iteration: int, version: int, mean_return: float, lag: float,
               send_ms: float) -> None:
        if self.live is not None:
            from rich.table import Table

            table = Table(title="weightsync demo: CartPole-v1")
            for name in ("iteration", "version", "mean return (last 20)", "version lag",
                         "send ms"):
                table.add_column(name, justify="right")
            table.add_row(str(iteration), str(version), f"{mean_return:.1f}", f"{lag:.2f}",
                          f"{send_ms:.2f}")
            self.live.update(table)
        elif time.monotonic() - self.last_line > 2.0:
            self.last_line = time.monotonic()
            self.log(f"iteration {iteration:4d}  version {version:4d}  mean return "
                     f"{mean_return:6.1f}  lag {lag:.2f}  send {send_ms:.2f} ms")

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()


def _plot(history: list[dict[str, float]], returns: list[float], path: str, transport: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [h["t"] for h in history]
    top.plot(t, [h["mean_return"] for h in history], label="mean return (last 20 episodes)")
    top.axhline(SOLVED_RETURN, color="grey", linestyle="--", label="solved")
    top.set_ylabel("return")
    top.legend(loc="lower right")
    top.set_title(f"CartPole-v1, collectors synced over {transport} ({len(returns)} episodes)")
    bottom.plot(t, [h["send_ms"] for h in history], ".", markersize=3)
    bottom.set_ylabel("send latency (ms)")
    bottom.set_xlabel("seconds")
    bottom.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
