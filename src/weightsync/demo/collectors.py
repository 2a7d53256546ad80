"""The demo's collectors: processes (or Ray actors) that play CartPole with the newest
weights, each episode tagged with the version that played it.

A collector that fails at start-up sends its error to the trainer, which reports it at
once; collectors ignore Ctrl-C, so that only the trainer handles it and stops them."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: how long the trainer waits for one batch episode before it checks on the collectors
CHECK_EVERY_S = 0.5
#: how long the collectors may take to start (spawn, import torch and gymnasium)
STARTUP_TIMEOUT_S = 120.0


class CollectorError(RuntimeError):
    """A collector failed or died; the message names it and says why."""


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 2),
    )


def play_episode(env: Any, policy: torch.nn.Module, generator: torch.Generator) -> dict[str, Any]:
    """One CartPole episode with ``policy``; observations, actions, rewards as numpy arrays."""
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


def collector_loop(receiver: Any, policy: torch.nn.Module, env: Any, idx: int, out: Any,
                   should_stop: Callable[[], bool], seed: int) -> None:
    """Play episodes until told to stop, taking the newest weights before each one."""
    from weightsync.core.errors import SenderLostError

    generator = torch.Generator().manual_seed(seed + idx)
    while not should_stop():
        try:
            receiver.poll()
        except SenderLostError:
            break
        episode = play_episode(env, policy, generator)
        episode.update(worker=idx, version=receiver.version)
        out.put(episode)


def _process_collector(scheme: Any, idx: int, out: Any, stop: Any, seed: int) -> None:
    """A collector process: set up, say ready (or why not), then play until ``stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    try:
        import gymnasium as gym

        torch.set_num_threads(1)
        env = gym.make("CartPole-v1")
        policy = make_policy()
        receiver = scheme.create_receiver(worker_idx=idx)
        receiver.register_model(policy)
    except BaseException as exc:
        out.put({"worker": idx, "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc()})
        return
    out.put({"worker": idx, "ready": True})
    try:
        receiver.connect(timeout=STARTUP_TIMEOUT_S)
        collector_loop(receiver, policy, env, idx, out, stop.is_set, seed)
    except BaseException as exc:
        if not stop.is_set():
            out.put({"worker": idx, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()})
    finally:
        receiver.close()
        env.close()


@dataclass
class Collectors:
    """What the trainer needs from the collectors, whatever runs them."""

    make_sender: Callable[[], Any]
    start: Callable[[], None]  # start them and wait until each is set up
    next_episode: Callable[[float], dict[str, Any]]  # an episode, or CollectorError
    stop: Callable[[], None]  # stop them all (once); leaves no process or file behind


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ctrl-C ignored inside (only from the main thread): children started here inherit it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class StopRequest:
    """Ctrl-C during training as a request, not an exception: the trainer stops after the
    step under way. A KeyboardInterrupt raised inside a queue read can leave a message half
    read, after which the next read (the collectors' stop drains the queue) waits for bytes
    that never come. A second Ctrl-C raises KeyboardInterrupt, for a step that never ends."""

    def __init__(self) -> None:
        self.requested = False

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    @contextlib.contextmanager
    def armed(self) -> Iterator[StopRequest]:
        """Ctrl-C is this request inside (only from the main thread, and only where Ctrl-C
        is not ignored, as under ``nohup``)."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def process_collectors(transport: str, workers: int, seed: int) -> Collectors:
    """Collector processes (spawned) over SharedMem, MultiProcess or the directory."""
    from weightsync.schemes.registry import scheme_class

    directory: str | None = None
    if transport == "file":
        directory = tempfile.mkdtemp(prefix="weightsync-demo-",
                                     dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        scheme: Any = scheme_class("file")(directory, num_workers=workers, timeout=60)
    else:
        scheme = scheme_class(transport)(num_workers=workers, timeout=60)
    ctx = mp.get_context("spawn")
    out, stop_event = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_process_collector,
                         args=(scheme.for_workers(), i, out, stop_event, seed),
                         daemon=True, name=f"weightsync-demo-collector-{i}")
             for i in range(workers)]

    def failure(message: dict[str, Any]) -> CollectorError:
        return CollectorError(f"collector {message['worker']} failed: {message['error']}")

    def check_alive() -> None:
        for i, p in enumerate(procs):
            if p.exitcode is not None:
                raise CollectorError(f"collector {i} died (exit code {p.exitcode})")

    def start() -> None:
        with sigint_ignored():
            for p in procs:
                p.start()
        ready: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < workers:
            try:
                message = out.get(timeout=CHECK_EVERY_S)
            except Exception:  # queue.Empty
                check_alive()
                if time.monotonic() > deadline:
                    raise CollectorError(
                        f"collectors {sorted(set(range(workers)) - ready)} not set up within "
                        f"{STARTUP_TIMEOUT_S:.0f} s") from None
                continue
            if "error" in message:
                raise failure(message)
            ready.add(int(message["worker"]))

    def next_episode(timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                message: dict[str, Any] = out.get(timeout=CHECK_EVERY_S)
            except Exception:  # queue.Empty
                check_alive()
                if time.monotonic() > deadline:
                    raise CollectorError(
                        f"no episode from any collector within {timeout:.0f} s") from None
                continue
            if "error" in message:
                raise failure(message)
            return message

    stopped = False

    def stop() -> None:
        nonlocal stopped
        if stopped:
            return
        stopped = True
        stop_event.set()
        deadline = time.monotonic() + 20
        for p in procs:
            while p.is_alive() and time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    while True:
                        out.get_nowait()  # a child cannot exit with unflushed queue data
                p.join(0.05)
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(5)
        out.close()
        out.cancel_join_thread()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    return Collectors(scheme.create_sender, start, next_episode, stop)


def _ray_collector_class() -> Any:
    import ray

    from weightsync.integrations.ray import RayWeightReceiverMixin

    @ray.remote(num_cpus=0, max_concurrency=2)  # type: ignore[call-overload]  # deliveries run beside the loop
    class Collector(RayWeightReceiverMixin):
        def __init__(self, scheme: Any, idx: int, out: Any, seed: int) -> None:
            import gymnasium as gym

            torch.set_num_threads(1)
            self.env = gym.make("CartPole-v1")
            self.policy = make_policy()
            self.idx, self.out, self.seed = idx, out, seed
            self.stopped = False
            self.weightsync_setup(scheme, idx, self.policy, announce=False)

        def run(self) -> None:
            self.weightsync_receiver.connect(timeout=STARTUP_TIMEOUT_S)
            collector_loop(self.weightsync_receiver, self.policy, self.env, self.idx, self.out,
                           lambda: self.stopped, self.seed)

        def stop(self) -> None:
            self.stopped = True

    return Collector


def ray_collectors(workers: int, seed: int) -> Collectors:
    """Collector actors in Ray: the caller's cluster, or a local instance of our own."""
    import ray
    from ray.util.queue import Empty, Queue

    from weightsync.schemes.ray import RayWeightSyncScheme

    started = not ray.is_initialized()
    if started:  # a local instance of our own: keep its traffic on this machine
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", object_store_memory=100 * 1024 * 1024)
    scheme = RayWeightSyncScheme(num_workers=workers, timeout=60)
    out = Queue()
    collector_cls = _ray_collector_class()
    actors = [collector_cls.remote(scheme.for_workers(), i, out, seed) for i in range(workers)]
    runs: list[Any] = []

    def next_episode(timeout: float) -> dict[str, Any]:
        if not runs:  # the loops start after the sender's connect
            runs.extend(actor.run.remote() for actor in actors)
        try:
            episode: dict[str, Any] = out.get(timeout=timeout)
        except Empty:
            ready, _ = ray.wait(runs, timeout=0)
            for ref in ready:
                ray.get(ref)  # a collector's own error, raised here
            raise CollectorError(f"no episode from any Ray collector within {timeout:.0f} s") from None
        return episode

    stopped = False

    def stop() -> None:
        nonlocal stopped
        if stopped:
            return
        stopped = True
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.get(runs, timeout=20)
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()

    return Collectors(lambda: scheme.create_sender(actors), lambda: None, next_episode, stop)
