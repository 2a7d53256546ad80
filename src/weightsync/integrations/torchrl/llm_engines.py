"""The engines ``connect_engine`` / ``update_engine`` drive for the LLM scheme's receiver: a
``vllm.LLM`` as is, or TorchRL's Ray-hosted ``AsyncVLLM`` fanned out to its replicas."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


def is_async_vllm(engine: Any) -> bool:
    """Whether ``engine`` is TorchRL's Ray-hosted ``AsyncVLLM``."""
    return type(engine).__name__ == "AsyncVLLM" and hasattr(engine, "actors")


def engine_driver(engine: Any) -> Any:
    """What ``connect_engine`` / ``update_engine`` drive for ``engine``: a ``vllm.LLM``
    itself, TorchRL's ``AsyncVLLM`` through a driver that fans each call out to its
    Ray-hosted replicas."""
    if is_async_vllm(engine):
        return AsyncVLLMDriver(engine)
    missing = [m for m in ("collective_rpc", "reset_prefix_cache", "sleep", "wake_up")
               if not callable(getattr(engine, m, None))]
    if missing:
        raise TypeError(f"{type(engine).__name__} is not a vllm.LLM or TorchRL AsyncVLLM "
                        f"(it lacks {missing})")
    return engine


class AsyncVLLMDriver:
    """TorchRL's ``AsyncVLLM`` seen as one engine by ``connect_engine`` / ``update_engine``:
    each call runs on every Ray actor (replica), worker results in replica-major order.

    Worker calls go through the actors' ``collective_rpc_v1``; replica ``r``'s ranks
    acknowledge as ``r * ranks_per_replica + rank``. Pause, resume and the
    ``weight_version`` label are vLLM ``AsyncLLM`` calls run on each actor's own event loop
    (TorchRL's actors expose ``sleep(level)`` without vLLM's pause mode), so requests in
    flight drain on the old weights (``mode="wait"``) rather than being aborted."""

    def __init__(self, engine: Any, timeout: float = 300.0) -> None:
        import ray

        self._ray = ray
        self.engine = engine
        self.actors = list(engine.actors)
        if not self.actors:
            raise RuntimeError("the AsyncVLLM has no replica actors (not launched, or shut down)")
        args = engine.engine_args
        self.ranks_per_replica = (int(getattr(args, "tensor_parallel_size", 1) or 1)
                                  * int(getattr(args, "pipeline_parallel_size", 1) or 1)
                                  * int(getattr(args, "data_parallel_size", 1) or 1))
        self.timeout = float(timeout)

    @property
    def world_size(self) -> int:
        """All ranks of all replicas: each acknowledges versions under its own index."""
        return len(self.actors) * self.ranks_per_replica

    def _all(self, method: str, *args: Any) -> list[Any]:
        refs = [getattr(actor, method).remote(*args) for actor in self.actors]
        return list(self._ray.get(refs, timeout=self.timeout))

    def _engine_all(self, method: str, **kwargs: Any) -> list[Any]:
        """``await actor.engine.<method>(**kwargs)`` (vLLM's ``AsyncLLM``) on every replica,
        on the event loop its engine runs on; each replica's result."""
        refs = [actor.__ray_call__.remote(_run_on_engine_loop, method, kwargs, self.timeout)
                for actor in self.actors]
        return list(self._ray.get(refs, timeout=self.timeout + 10.0))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Run ``method`` on every worker of every replica; ranks are made engine-wide (and
        a ``connect`` tells each replica's workers the ranks before theirs)."""
        connect = method == "weightsync_call" and bool(args) and args[0] == "connect"
        refs = []
        for replica, actor in enumerate(self.actors):
            call_args = args
            if connect:  # ("connect", directory, worker_idx, timeout, num_workers[, offset])
                call_args = (*args[:5], *[None] * (5 - len(args)),
                             replica * self.ranks_per_replica)
            refs.append(actor.collective_rpc_v1.remote(method, None, call_args, None))
        out: list[Any] = []
        for replica, results in enumerate(self._ray.get(refs, timeout=self.timeout)):
            for result in results:
                if isinstance(result, dict) and "rank" in result:
                    rank = replica * self.ranks_per_replica + int(result["rank"])
                    result = {**result, "rank": rank}
                out.append(result)
        return out

    def reset_prefix_cache(self) -> None:
        """Empty every replica's prefix cache; warns where vLLM reports it only partly
        cleared (blocks still held by requests in flight)."""
        for replica, cleared in enumerate(self._all("reset_prefix_cache")):
            if cleared is False:
                logger.warning("AsyncVLLM replica %d: prefix cache not fully reset", replica)

    def sleep(self, level: int = 0, mode: str = "wait") -> None:
        """vLLM's pause on every replica (``level=0``: stop scheduling, keep the KV cache;
        ``mode``: drain requests in flight, or abort them)."""
        self._engine_all("sleep", level=level, mode=mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Resume every replica (``tags=["scheduling"]`` after a ``level=0`` pause)."""
        self._all("wake_up", tags)

    def update_weight_version(self, version: str) -> None:
        """Label every replica's engine with ``version`` (vLLM's ``weight_version``)."""
        self._engine_all("update_weight_version", new_version=version)

    def get_weight_version(self) -> list[str]:
        """Each replica's ``weight_version`` label."""
        return [str(v) for v in self._engine_all("get_weight_version")]


def _engine_loop(engine: Any) -> asyncio.AbstractEventLoop | None:
    """The event loop a vLLM ``AsyncLLM`` runs its tasks on (its output handler's, else its
    engine-core client's: started by the first request or RPC); None before either."""
    core = getattr(getattr(engine, "engine_core", None), "resources", None)
    for task in (getattr(engine, "output_handler", None), getattr(core, "output_queue_task", None)):
        if isinstance(task, asyncio.Future):
            return task.get_loop()
    return None


def _run_on_engine_loop(actor: Any, method: str, kwargs: dict[str, Any], timeout: float) -> Any:
    """Inside a replica actor (``__ray_call__``, which Ray runs off the actor's event loop):
    ``await actor.engine.<method>(**kwargs)`` on the engine's loop; its result."""
    loop = _engine_loop(actor.engine)
    if loop is None:
        raise RuntimeError("this AsyncVLLM replica's engine has no event loop yet "
                           "(no request or RPC reached it)")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("called on the engine's own event loop: it cannot wait for itself")
    future = asyncio.run_coroutine_threadsafe(getattr(actor.engine, method)(**kwargs), loop)
    return future.result(timeout)

