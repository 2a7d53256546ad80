"""LoRA adapter sync against the full merged sync, into one real vLLM engine
(``weightsync bench --transports lora``).

The model is the LLM demo's small one (~100 M parameters, float32); a peft adapter of each
rank sits on every attention and MLP projection. Per version:

* adapter only: ``update_weights()`` of ``VLLMDoubleBufferSyncScheme(adapter=...)`` (the
  base guard included), then ``update_adapter(llm, directory)``: the adapter is loaded in
  the engine and activated in its LoRA slot;
* full merged (today's path): every weight of the merged model written by
  ``update_weights()``, then ``update_engine(llm)`` (pause, load, reset, resume); the merge
  itself is not timed.

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
def _step(model: Any, adapter: str, step: int) -> None:
    """A stand-in for a training step of ``adapter``: new seeded LoRA weights for it."""
    gen = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        if f".{adapter}." in name and ".lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.01)


def _peft_model(ranks: Sequence[int], size: str) -> Any:
    """The small demo model with one adapter per rank (named ``r8``, ``r16``...), on every
    projection; the base is shared, as it is in the engine."""
    import peft

    from weightsync.demo import llm_task as task

    model = None
    for rank in ranks:
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                 target_modules=PROJECTIONS)
        if model is None:
            model = peft.get_peft_model(task.build_model(size, 0).eval(), config,
                                        adapter_name=f"r{rank}")
        else:
            model.add_adapter(f"r{rank}", config)
    return model


def run_lora_bench(ranks: Sequence[int], repeats: int,
                   progress: Callable[[str], None] | None = None,
                   notes: list[str] | None = None, model_size: str = "small") -> list[BenchRow]:
    """One row per adapter rank and one for the full merged sync, in one engine; the
    versions of each take turns, so a busy machine slows them alike. ``model_size``: the
    LLM demo's model (``small``: ~100 M parameters; ``tiny`` for a quick check)."""
    import weightsync as ws
    from weightsync.demo import llm_task as task
    from weightsync.integrations.vllm import connect_engine, update_adapter, update_engine

    root = Path(tempfile.mkdtemp(prefix="weightsync-bench-lora-", dir=_shm()))
    llm = None
    senders: dict[int, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer on one thread, as in the other benches: the
    try:                      # engine's worker computes on its own threads beside it
        full_model = task.build_model(model_size, 0).eval()  # stands for the merged weights
        task.save_checkpoint(full_model, root / "model")
        if progress:
            progress("lora: starting the vLLM engine")
        llm = _engine(root / "model", max(ranks))
        model = _peft_model(ranks, model_size)
        for rank in ranks:
            model.set_adapter(f"r{rank}")
            scheme = ws.VLLMDoubleBufferSyncScheme(root / f"r{rank}", adapter=f"policy-r{rank}")
            senders[rank] = scheme.create_sender()
            senders[rank].register_model(model)
        full = ws.VLLMDoubleBufferSyncScheme(root / "full").create_sender()
        senders[0] = full
        full.register_model(full_model)
        full.update_weights()
        connect_engine(llm, str(root / "full"))
        times: dict[int, list[float]] = {rank: [] for rank in [*ranks, 0]}
        commits: dict[int, list[float]] = {rank: [] for rank in [*ranks, 0]}
        for i in range(repeats + 2):
            if progress:
                progress(f"lora: round {i + 1} of {repeats + 2}")
            for rank in ranks:
                _step(model, f"r{rank}", i)
                t0 = time.perf_counter()
                senders[rank].update_weights()
                t1 = time.perf_counter()
                update_adapter(llm, str(root / f"r{rank}"))
                if i > 1:  # every slot written once: warm
                    times[rank].append(time.perf_counter() - t0)
                    commits[rank].append(t1 - t0)
            with torch.no_grad():  # a new merged version: the merged projections move
                full_model.model.layers[0].self_attn.q_proj.weight.add_(1e-4)
            t0 = time.perf_counter()
            version = full.update_weights()
            t1 = time.perf_counter()
            update_engine(llm, version)
            if i > 1:
                times[0].append(time.perf_counter() - t0)
                commits[0].append(t1 - t0)
        floor = statistics.median(times[0])
        rows = []
        for rank in ranks:
            nbytes = int(senders[rank].stats()["layout_nbytes"])
            rows.append(make_row(f"lora adapter r{rank} (vLLM)", format_size(nbytes), nbytes,
                                 1, times[rank], floor, FULL_FLOOR))
        nbytes = int(full.stats()["layout_nbytes"])
        rows.append(make_row("full merged (vLLM)", format_size(nbytes), nbytes, 1, times[0],
                             floor, FULL_FLOOR))
        if notes is not None:
            for rank in [*ranks, 0]:
                label = f"lora adapter r{rank}" if rank else "full merged"
                commit = statistics.median(commits[rank])
                engine = statistics.median(t - c for t, c in zip(times[rank], commits[rank],
                                                                 strict=True))
                notes.append(f"{label}: commit (trainer) {commit * 1e3:.1f} ms, applied in "
                             f"the engine after it {engine * 1e3:.1f} ms (medians)")
            adapter = senders[ranks[0]].lora_adapter
            guard = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                adapter.tensors()
                guard.append(time.perf_counter() - t0)
            notes.append(f"lora: the base guard (no base weight changed since connect) takes "
                         f"{statistics.median(guard) * 1e3:.2f} ms per adapter version "
                         f"(included above); the full merged rows exclude the merge itself")
        return rows
    finally:
        torch.set_num_threads(threads)
        for sender in senders.values():
            sender.close()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _shm() -> str | None:
    import os

    return "/dev/shm" if os.path.isdir("/dev/shm") else None
