"""Driver-side calls on a vLLM ``LLM`` whose workers carry the weightsync extension: join a
trainer's directory, and one call that performs a whole update correctly.

``update_engine`` pauses generation (vLLM's own pause, ``mode="wait"`` by default: requests
in flight finish on the old weights, new ones queue), loads ONE named version on every
rank, resets the prefix cache (its entries were computed with the old weights), sets the
engine's ``weight_version`` label (each finished output carries it in
``outputs[i].weight_versions``) and resumes. Nothing here imports vLLM."""

from __future__ import annotations

import logging
from typing import Any

from weightsync.core import errors
from weightsync.core.checks import checked_int
from weightsync.core.deadline import required_timeout
from weightsync.core.errors import WeightSyncError
from weightsync.integrations.vllm.extension import engine_directory

logger = logging.getLogger(__name__)

#: pause modes that never let one request see two versions: drain ("wait") or drop ("abort").
#: vLLM's third mode, "keep", freezes requests and resumes them on the new weights.
SAFE_PAUSE_MODES = ("wait", "abort")


def _raise_for(outcome: dict[str, Any], action: str) -> None:
    """Raise weightsync's own exception for a worker's reported failure."""
    cls = getattr(errors, str(outcome.get("error")), None)
    if not (isinstance(cls, type) and issubclass(cls, WeightSyncError)):
        cls = WeightSyncError
    message = f"{action}: vLLM worker {outcome.get('rank')}: {outcome.get('message')}"
    if cls is errors.SchemaMismatchError:
        raise errors.SchemaMismatchError(message, key=outcome.get("key"))
    raise cls(message)


def _call(llm: Any, method: str, *args: Any, action: str) -> list[Any]:
    """``weightsync_<method>(*args)`` on every worker; each worker's result, rank order.
    The first failure is raised as the weightsync exception the worker raised."""
    outcomes = llm.collective_rpc("weightsync_call", args=(method, *args))
    outcomes = sorted(outcomes, key=lambda o: o["rank"])
    for outcome in outcomes:
        if "error" in outcome:
            _raise_for(outcome, action)
    return [o["ok"] for o in outcomes]


def engine_versions(llm: Any) -> list[int]:
    """The version each worker of ``llm`` holds, in rank order (-1: not connected)."""
    return [int(v) for v in _call(llm, "version", action="reading versions")]


def _label(llm: Any, version: int) -> None:
    """Name the held version in the engine, so every generated sample can be tagged."""
    llm.update_weight_version(str(version))


def connect_engine(llm: Any, directory: str, *, timeout: float = 60.0) -> int:
    """Connect every worker of ``llm`` to ``directory``; returns the version they all hold.

    Each worker loads the newest committed version (a version committed between two
    workers' loads is then loaded by all of them). Raises ``SchemaMismatchError`` naming the
    key when the served model's layout differs from the slots', and
    ``WeightSyncTimeoutError`` when nothing is committed within ``timeout``."""
    timeout = required_timeout(timeout, "timeout")
    held = _call(llm, "connect", engine_directory(directory), None, timeout,
                 _world(llm), action=f"connecting to {directory}")
    version = max(int(v) for v in held)
    if min(int(v) for v in held) != version:
        _call(llm, "apply", version, float(timeout), action=f"aligning ranks on version {version}")
    llm.reset_prefix_cache()
    _label(llm, version)
    return version


def _world(llm: Any) -> int:
    """How many workers ``llm`` has (all ranks of all its data-parallel replicas); an engine
    made of several (TorchRL's ``AsyncVLLM`` driver) names its total as ``world_size``."""
    total = getattr(llm, "world_size", None)
    if isinstance(total, int) and not isinstance(total, bool):
        return total
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    if parallel is None:
        return 1
    return int(getattr(parallel, "world_size", 1)) * int(getattr(parallel, "data_parallel_size", 1))


def update_engine(
    llm: Any, version: int | None = None, *, mode: str = "wait", timeout: float = 60.0
) -> int | None:
    """Bring every worker of ``llm`` to one version; returns it, or None if they all hold
    it already (or nothing newer is committed).

    ``version``: the committed version to load (default: the newest one). ``mode``:
    how requests in flight are handled while the weights change, "wait" (drain them on
    the old weights) or "abort". On success the prefix cache is empty and the engine's
    ``weight_version`` is ``str(version)``. If any rank cannot load the version, the call
    raises ``WeightSyncError`` naming the rank, after bringing every rank back to one
    common version (the newest they can all load), so no rank is left on another."""
    timeout = required_timeout(timeout, "timeout")
    if mode not in SAFE_PAUSE_MODES:
        raise ValueError(
            f"mode must be one of {SAFE_PAUSE_MODES} (vLLM's 'keep' resumes requests on new "
            f"weights: one sample would mix two versions), got {mode!r}"
        )
    held = engine_versions(llm)
    if min(held) < 0:
        raise RuntimeError("call connect_engine(llm, directory) before update_engine")
    if version is None:
        newest = [v for v in _call(llm, "newest", action="reading the manifest") if v is not None]
        if not newest:
            return None
        version = max(int(v) for v in newest)  # ranks are one engine: all take the newest
    version = checked_int(version, "version")
    if all(v == version for v in held):
        return None
    llm.sleep(level=0, mode=mode)  # vLLM's pause: queue new requests, drain or drop the rest
    try:
        outcomes = sorted(llm.collective_rpc("weightsync_call", args=("apply", version, float(timeout))),
                          key=lambda o: o["rank"])
        failed = [o for o in outcomes if "error" in o]
        if failed:
            _realign(llm, timeout)
            _raise_for(failed[0], f"loading version {version} on every rank")
        llm.reset_prefix_cache()
        _label(llm, version)
    finally:
        llm.wake_up(tags=["scheduling"])
    logger.info("vLLM engine now holds version %d on %d worker(s)", version, len(held))
    return version


def _realign(llm: Any, timeout: float) -> None:
    """After a failed update: bring every rank to the newest version all of them can load."""
    held = engine_versions(llm)
    if len(set(held)) == 1:
        return
    newest = [v for v in _call(llm, "newest", action="realigning ranks") if v is not None]
    target = max(int(v) for v in newest) if newest else max(held)
    logger.warning("ranks hold versions %s after a failed update: realigning on %d", held, target)
    _call(llm, "apply", target, float(timeout), action=f"realigning ranks on version {target}")
    llm.reset_prefix_cache()
    _label(llm, target)
