"""LoRA adapter sync against the full merged sync, into one real vLLM engine
(``weightsync bench --transports lora``).

The model is the LLM demo's small one (~100 M parameters, float32); a peft adapter of each
rank sits on every attention and MLP projection. Per version:

* adapter only: ``update_weights()`` of ``VLLMDoubleBufferSyncScheme(adapter=...)`` (the
  base guard included), then ``update_adapter(llm, directory)``: the adapter is loaded in
  the engine (vLLM copies it into its LoRA slots at the first request that uses it);
* full merged (today's path): the adapter merged into the base in the trainer, every weight
  written by ``update_weights()``, then ``update_engine(llm)`` (pause, load, reset, resume).

Rows are seconds per version applied in the engine, commit included; the floor column is
the full merged sync of the same run, so "x floor" is the adapter's share of it.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from weightsync.bench.rows import BenchRow, make_row
from weightsync.units import format_size

logger = logging.getLogger(__name__)

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL_FLOOR = "full merged"


def _engine(model_dir: Path, max_rank: int) -> Any:
    import os

    from weightsync.demo.llm import ENGINE_ENV

    os.environ.update(ENGINE_ENV)
    from vllm import LLM

    from weightsync.integrations.vllm import EXTENSION_CLS

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
               dtype="float32", max_model_len=64, max_num_seqs=4, seed=0, block_size=32,
               enable_lora=True, max_lora_rank=max_rank, max_loras=1,
               worker_extension_cls=EXTENSION_CLS)


@torch.no_grad()
def _step(model: Any, step: int) -> None:
    """A stand-in for a training step of the adapter: new seeded LoRA weights."""
    gen = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.01)


def _adapter_times(llm: Any, model: Any, root: Path, rank: int, repeats: int,
                   ) -> tuple[list[float], int, float]:
    """Seconds per adapter version applied, the bytes of one version, and the median
    seconds of the base guard alone."""
    import weightsync as ws
    from weightsync.integrations.vllm import update_adapter

    directory = root / f"adapter-r{rank}"
    times: list[float] = []
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, adapter="policy")
    with scheme.create_sender() as sender:
        sender.register_model(model)
        for i in range(repeats + 2):
            _step(model, i)
            t0 = time.perf_counter()
            sender.update_weights()
            update_adapter(llm, str(directory))
            if i > 1:  # every slot written once: warm
                times.append(time.perf_counter() - t0)
        nbytes = int(sender.stats()["layout_nbytes"])
        adapter = sender._adapter
        assert adapter is not None
        guard = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            adapter.tensors()
            guard.append(time.perf_counter() - t0)
    return times, nbytes, statistics.median(guard)


def _full_times(llm: Any, model: Any, root: Path, repeats: int) -> tuple[list[float], int]:
    """Seconds per full merged version applied (merge, commit, update_engine)."""
    import weightsync as ws
    from weightsync.integrations.vllm import connect_engine, update_engine

    directory = root / "full"
    merged = model.merge_and_unload()  # the base with the adapter folded in, as served
    times: list[float] = []
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(merged)
        sender.update_weights()
        connect_engine(llm, str(directory))
        for i in range(repeats + 2):
            with torch.no_grad():  # a new merged version: the merged projections change
                merged.model.layers[0].self_attn.q_proj.weight.add_(1e-4)
            t0 = time.perf_counter()
            version = sender.update_weights()
            update_engine(llm, version)
            if i > 1:
                times.append(time.perf_counter() - t0)
        nbytes = int(sender.stats()["layout_nbytes"])
    return times, nbytes


def run_lora_bench(ranks: Sequence[int], repeats: int,
                   progress: Callable[[str], None] | None = None,
                   notes: list[str] | None = None) -> list[BenchRow]:
    """One row per adapter rank and one for the full merged sync, in one engine."""
    import peft

    from weightsync.demo import llm_task as task

    root = Path(tempfile.mkdtemp(prefix="weightsync-bench-lora-", dir=_shm()))
    llm = None
    try:
        base = task.build_model("small", 0).eval()
        task.save_checkpoint(base, root / "model")
        if progress:
            progress("lora: starting the vLLM engine")
        llm = _engine(root / "model", max(ranks))
        measured = []
        for rank in ranks:
            if progress:
                progress(f"lora rank {rank}")
            config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                     target_modules=PROJECTIONS)
            model = peft.get_peft_model(task.build_model("small", 0).eval(), config)
            times, nbytes, guard = _adapter_times(llm, model, root, rank, repeats)
            measured.append((rank, times, nbytes))
            if notes is not None:
                notes.append(f"lora rank {rank}: the base guard (no base weight changed) took "
                             f"{guard * 1e3:.2f} ms per version")
        if progress:
            progress("lora: full merged sync")
        full, full_bytes = _full_times(llm, model, root, repeats)
        floor = statistics.median(full)
        size = format_size(full_bytes)
        rows = [make_row(f"lora adapter r{rank} (vLLM)", format_size(nbytes), nbytes, 1, times,
                         floor, FULL_FLOOR) for rank, times, nbytes in measured]
        rows.append(make_row("full merged (vLLM)", size, full_bytes, 1, full, floor, FULL_FLOOR))
        return rows
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _shm() -> str | None:
    import os

    return "/dev/shm" if os.path.isdir("/dev/shm") else None
