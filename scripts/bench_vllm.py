"""Time weightsync updates of a real vLLM engine beside vLLM's own ``reload_weights`` from
the same tensors (benchmark figures for docs/vllm.md, not a test).

    .venv/bin/python scripts/bench_vllm.py [--hidden 256 --layers 2 --vocab 512 --rounds 10]

Rows (median of ``--rounds``):
  commit            trainer: ``sender.update_weights()`` (write a slot + checksum + manifest)
  apply, in worker  inside the vLLM worker: read + verify the slot, load via reload_weights
  reload_weights    inside the vLLM worker: vLLM's own reload from the same tensors in memory
  weightsync_update driver: ``llm.collective_rpc("weightsync_update")``
  update_engine     driver: pause, load on every rank, reset prefix cache, label, resume
  backend update    driver: ``start_weight_update`` + ``update_weights`` + ``finish_weight_update``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))


def _timed_update(worker: Any) -> tuple[float, Any]:
    """In the worker: weightsync's apply of the newest version, timed there."""
    started = time.perf_counter()
    version = worker.weightsync_update()
    return time.perf_counter() - started, version


def _timed_reload(worker: Any, checkpoint: str) -> float:
    """In the worker: vLLM's own reload from the same tensors, read into the worker's memory
    beforehand (from the checkpoint the engine was started with)."""
    from safetensors.torch import load_file

    weights = load_file(checkpoint)
    started = time.perf_counter()
    worker.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    import vllm_model as vm

    os.environ.update(vm.ENGINE_ENV)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # to ship the timing functions
    import torch
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    import weightsync as ws
    from weightsync.integrations.vllm import connect_engine, update_engine

    shape = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 num_hidden_layers=args.layers, vocab_size=args.vocab)
    trainer = vm.build_model(**shape)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    work = Path(tempfile.mkdtemp(prefix="ws-bench-vllm-"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    ext_dir, backend_dir = (Path(tempfile.mkdtemp(prefix=p, dir=shm)) for p in ("ws-b1-", "ws-b2-"))
    model_dir = vm.save_model(trainer, work / "model")
    checkpoint = str(next(Path(model_dir).glob("*.safetensors")))
    llm = LLM(**vm.engine_kwargs(model_dir,
                                 weight_transfer_config=WeightTransferConfig(backend="weightsync")))
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    try:
        ext = ws.VLLMDoubleBufferSyncScheme(ext_dir).create_sender()
        backend = ws.VLLMDoubleBufferSyncScheme(backend_dir).create_sender()
        for sender in (ext, backend):
            sender.register_model(trainer)
            sender.update_weights()
        connect_engine(llm, str(ext_dir))
        llm.init_weight_transfer_engine({"init_info": {"directory": str(backend_dir)}})
        for step in range(args.rounds):
            vm.perturb(trainer, step)
            started = time.perf_counter()
            ext.update_weights()
            add("commit", time.perf_counter() - started)
            (inside, _), = llm.collective_rpc(_timed_update)
            add("apply, in worker", inside)
            add("reload_weights", llm.collective_rpc(_timed_reload, args=(checkpoint,))[0])
            ext.update_weights()
            started = time.perf_counter()
            llm.collective_rpc("weightsync_update")
            add("weightsync_update", time.perf_counter() - started)
            ext.update_weights()
            started = time.perf_counter()
            update_engine(llm)
            add("update_engine", time.perf_counter() - started)
            version = backend.update_weights()
            started = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version}})
            llm.finish_weight_update(weight_version=str(version))
            add("backend update", time.perf_counter() - started)
        ext.close()
        backend.close()
    finally:
        llm.llm_engine.engine_core.shutdown()
        for path in (work, ext_dir, backend_dir):
            shutil.rmtree(path, ignore_errors=True)
    print(f"model: {shape}, {nbytes / 2**20:.1f} MiB float32; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs; median of {args.rounds} rounds")
    print("| step | ms |\n|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {1000 * statistics.median(values):.1f} |")


if __name__ == "__main__":
    main()
