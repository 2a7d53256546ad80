"""Rank bodies for the sharded directory tests (importable by spawn): trainer ranks writing
``LocalShard`` blocks, FSDP2 and DTensor tensor-parallel models into one directory."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import weightsync as ws
from weightsync.transports.directory import sharded

# ---------------------------------------------------------------- LocalShard models
#: name -> (global shape, dtype, split dimension); "norm" is a plain tensor (rank 0 writes it)
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]] = {
    "w": ((7, 10), torch.float32, 0),      # rows, uneven over 2-4 ranks
    "v": ((6, 9), torch.bfloat16, 1),      # columns: strided copies, odd byte ranges
    "b": ((13,), torch.float16, 0),
    "norm": ((5,), torch.float32, None),
}


def global_weights(step: int) -> dict[str, torch.Tensor]:
    """The whole model at ``step`` (every rank computes it and keeps its own blocks)."""
    out = {}
    for i, (name, (shape, dtype, _dim)) in enumerate(SHAPES.items()):
        numel = int(torch.tensor(shape).prod()) if shape else 1
        values = torch.arange(numel, dtype=torch.float64).reshape(shape) * 0.25 + 100 * step + i
        out[name] = values.to(dtype)
    return out


def _bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(size, world)  # the first ``extra`` ranks take one more
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def local_model(step: int, rank: int, world: int, *, wrong: str = "") -> dict[str, Any]:
    """Rank ``rank``'s blocks of :func:`global_weights` as ``LocalShard`` values. ``wrong``:
    "shape" registers another global shape for "w"; "overlap" claims rank 0's rows of "w"."""
    model: dict[str, Any] = {}
    for name, full in global_weights(step).items():
        dim = SHAPES[name][2]
        if dim is None:
            model[name] = full.clone()
            continue
        lo, hi = _bounds(full.shape[dim], 0 if wrong == "overlap" and name == "w" else rank, world)
        offsets = tuple(lo if d == dim else 0 for d in range(full.dim()))
        shape = tuple(full.shape)
        if wrong == "shape" and name == "w":
            shape = (shape[0] + 1, *shape[1:])
        model[name] = ws.LocalShard(full.narrow(dim, lo, hi - lo).clone(), shape, offsets)
    return model


def _fill(model: dict[str, Any], step: int, rank: int, world: int) -> None:
    fresh = local_model(step, rank, world)
    for name, value in model.items():
        target = value.tensor if isinstance(value, ws.LocalShard) else value
        source = fresh[name].tensor if isinstance(fresh[name], ws.LocalShard) else fresh[name]
        target.copy_(source)


def _reader(directory: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    receiver = scheme.create_receiver(0)
    local = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype, _) in SHAPES.items()}
    receiver.register_model(local)
    return receiver, local


def check_read(receiver: Any, local: dict[str, torch.Tensor], version: int, step: int) -> None:
    """The reader applies ``version`` and holds exactly the model of ``step``."""
    if receiver.version != version:
        got = receiver.receive(timeout=10)
        assert got == version, (got, version)
    for name, expected in global_weights(step).items():
        assert torch.equal(local[name], expected), (name, version)


def _install_fault(rank: int, fault: dict[str, Any]) -> None:
    """Stop or kill this rank between writing its pieces and its record of a version."""
    if fault.get("rank") != rank:
        return
    original = sharded.after_part_written

    def hook(r: int, version: int) -> None:
        if version == fault["version"] and not fault.get("fired"):
            fault["fired"] = True
            os.kill(os.getpid(), signal.SIGKILL if fault["how"] == "kill" else signal.SIGSTOP)
        original(r, version)

    sharded.after_part_written = hook


def sharded_scheme(directory: Path, world: int, timeout: float = 30.0,
                   **options: Any) -> Any:
    """The one scheme the test hands every rank (its pickle carries the ranks' key)."""
    return ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, trainer_ranks=world,
                                         timeout=timeout, **options)


def local_shard_rank(rank: int, world: int, scheme: Any, steps: int,
                     fault: dict[str, Any] | None = None) -> dict[str, Any]:
    """Send ``steps`` versions of :func:`local_model` through ``scheme`` (the sharded scheme
    of :func:`sharded_scheme`); rank 0 checks a reader after each. With ``fault``, a failed
    send is recorded and retried (the same step) until it works."""
    _install_fault(rank, fault or {})
    fault = fault or {}
    directory, timeout = scheme.directory, scheme.timeout
    model = local_model(0, rank, world)
    report: dict[str, Any] = {"versions": [], "errors": []}
    reader = _reader(directory) if rank == 0 else None
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(model)
        step = sender.version + 1  # a restarted rank joins after the last committed version
        report["first"] = step
        while step < steps:
            _fill(model, step, rank, world)
            t0 = time.monotonic()
            try:
                # no wait for the reader (it is in rank 0); the faulty version: a short deadline
                version = sender.update_weights(timeout=fault.get("send_timeout", timeout)
                                                if step == fault.get("version")
                                                and not report["errors"] else timeout)
            except (ws.TrainerRankLostError, ws.WeightSyncTimeoutError) as exc:
                report["errors"].append((type(exc).__name__, getattr(exc, "rank", None), str(exc),
                                         round(time.monotonic() - t0, 2), step))
                if reader is not None:  # the reader keeps the last whole version
                    assert reader[0].poll() is None
                    check_read(*reader, step - 1, step - 1)
                if len(report["errors"]) > 3:
                    raise
                continue
            report["versions"].append(version)
            if reader is not None:
                check_read(*reader, version, step)
            step += 1
    if reader is not None:
        reader[0].close()
    return report


def own_scheme_rank(rank: int, world: int, directory: Path, steps: int) -> dict[str, Any]:
    """:func:`local_shard_rank` with a scheme this process makes itself, as every rank of a
    ``torchrun`` job does: the ranks agree on the directory's own rank key."""
    return local_shard_rank(rank, world, sharded_scheme(directory, world), steps)


def wrong_layout_rank(rank: int, world: int, scheme: Any, wrong: str) -> None:
    """Rank 1 registers a model that disagrees with rank 0's (``wrong``: "shape"/"overlap")."""
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(local_model(0, rank, world, wrong=wrong if rank == 1 else ""))
        sender.update_weights()


def racing_rank(rank: int, world: int, scheme: Any, steps: int) -> list[int]:
    """Send ``steps`` versions of :func:`local_model` as fast as the others let it (no wait
    for readers): version n is the model of step n."""
    model = local_model(0, rank, world)
    versions = []
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(model)
        for step in range(sender.version + 1, steps):
            _fill(model, step, rank, world)
            versions.append(sender.update_weights())
    return versions


def hammering_reader(rank: int, world: int, directory: Path, last: int) -> list[int]:
    """Apply every version it can until ``last``; each must be exactly its step's model."""
    receiver, local = _reader(directory)
    receiver.connect(timeout=60)
    seen = [receiver.version]
    while receiver.version < last:
        version = receiver.receive(timeout=60)
        assert version is not None, f"no version after {receiver.version} within 60 s"
        for name, expected in global_weights(version).items():
            assert torch.equal(local[name], expected), (name, version)
        seen.append(version)
    receiver.close()
    return seen
