"""``weightsync demo --llm``: RL post-training of a small language model in one loop.

Each step a real vLLM engine generates a group of answers per prompt, the trainer scores
them, takes a policy-gradient step (GRPO-style advantages) and syncs its new weights into
the engine: through weightsync (the directory of safetensors slots, then ``update_engine``:
pause, one version on every rank, prefix cache reset, version label), or the way users
write it today (``--sync reload``: save a checkpoint, then vLLM's ``reload_weights`` on
it). Every sample carries the version that generated it; the demo fails loudly if a sample
carries another version than the engine held, or if the engine's greedy answers ever
differ from the trainer's own after a sync.

With ``--lora`` the trainer trains a peft LoRA adapter on every projection instead of the
whole model, and only the adapter travels (``adapter="policy"``, then ``update_adapter``:
each version served as ``policy-v<N>``); the log shows its bytes per sync beside the full
model's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync.demo import llm_task as task

logger = logging.getLogger(__name__)

SYNC_MODES = ("weightsync", "reload")
#: what the engine runs with here: offline, a small KV cache, no compilation
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
              "VLLM_LOGGING_LEVEL": "WARNING"}


#: LoRA trains fewer weights from a zero update: it takes a larger step
LORA_LR_FACTOR = 5.0


class PromiseBroken(RuntimeError):
    """A sample labelled with a version the engine did not hold, or an engine whose
    weights differ from the trainer's after a sync."""


@dataclass
class LLMDemoOptions:
    steps: int = 200
    max_seconds: float = 180.0
    model_size: str = "tiny"
    sync: str = "weightsync"
    tensor_parallel: int = 1
    prompts: int = 8
    group: int = 8
    learning_rate: float = 1e-3
    check_every: int = 10
    lora: bool = False
    lora_rank: int = 16
    seed: int = 0
    output_dir: str = "demo-output"
    plot: bool = True
    log: Callable[[str], None] = print


@dataclass
class LLMDemoResult:
    steps: int
    final_version: int
    first_reward: float
    last_reward: float
    greedy_checks: int
    seconds: float
    startup_seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    plot: str | None = None
    interrupted: bool = False
    sync_bytes: int = 0  # bytes written per sync (the adapter's alone with --lora)
    full_bytes: int = 0  # the whole model's bytes, what a full sync writes

    def median(self, key: str) -> float:
        values = [h[key] for h in self.history]
        return statistics.median(values) if values else 0.0


def _engine(model_dir: Path, options: LLMDemoOptions) -> Any:
    os.environ.update(ENGINE_ENV)
    tp = options.tensor_parallel
    if tp > 1 and not torch.cuda.is_available():
        # vLLM's CPU build binds each rank's threads per NUMA node; one node here: one core each
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(rank % (os.cpu_count() or 1)) for rank in range(tp)))
    from vllm import LLM

    from weightsync.integrations.vllm import EXTENSION_CLS

    lora: dict[str, Any] = dict(enable_lora=True, max_lora_rank=options.lora_rank,
                                max_loras=1) if options.lora else {}
    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
               dtype="float32", max_model_len=64, max_num_seqs=options.prompts * options.group,
               seed=options.seed, enable_prefix_caching=True, block_size=32,
               tensor_parallel_size=tp, worker_extension_cls=EXTENSION_CLS, **lora)


def _shutdown(llm: Any) -> None:
    """Stop the engine's process and workers (vLLM's own shutdown)."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="weightsync-llm-demo-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _generate(llm: Any, prompts: list[list[int]], group: int, version: int,
              lora_request: Any = None) -> task.Batch:
    """``group`` sampled answers per prompt, each checked to come from ``version``."""
    from vllm import SamplingParams

    params = SamplingParams(n=group, temperature=1.0, max_tokens=task.ANSWER_TOKENS,
                            ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=lora_request)
    batch = task.Batch([], [], [], [])
    for prompt, out in zip(prompts, outputs, strict=True):
        for sample in out.outputs:
            answer = list(sample.token_ids)
            spans = getattr(sample, "weight_versions", None) or []
            labels = {int(span.version) for span in spans} or {_engine_label(llm)}
            if labels != {version}:
                raise PromiseBroken(f"a sample carries version(s) {sorted(labels)}, but the "
                                    f"engine held version {version} when it was generated")
            batch.prompts.append(prompt)
            batch.answers.append(answer)
            batch.rewards.append(task.reward(prompt, answer))
            batch.versions.append(version)
    return batch


def _engine_label(llm: Any) -> int:
    label = llm.get_weight_version()
    return int(label) if label is not None else -1


def _greedy(llm: Any, prompts: list[list[int]], lora_request: Any = None) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=task.ANSWER_TOKENS, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outputs]


class _Sync:
    """Moves the trainer's weights into the engine, one way or the other (``lora``: the
    adapter alone; generate with :attr:`lora_request`)."""

    def __init__(self, mode: str, llm: Any, model: Any, scratch: Path, num_workers: int) -> None:
        import weightsync as ws
        from weightsync.integrations.vllm import connect_engine, update_adapter

        self.mode, self.llm, self.model, self.scratch = mode, llm, model, scratch
        self.version = 0
        self.lora_request: Any = None
        if mode == "lora":
            scheme = ws.VLLMDoubleBufferSyncScheme(scratch / "adapter", adapter="policy")
            self.sender = scheme.create_sender()
            self.sender.register_model(model)
            self.version = self.sender.update_weights()
            self.lora_request = update_adapter(llm, str(scratch / "adapter"))
            llm.update_weight_version(str(self.version))  # samples carry it, as with full syncs
        elif mode == "weightsync":
            scheme = ws.VLLMDoubleBufferSyncScheme(scratch / "weights", num_workers=num_workers)
            self.sender = scheme.create_sender()
            self.sender.register_model(model)
            self.version = self.sender.update_weights()
            connect_engine(llm, str(scratch / "weights"))
        else:
            llm.update_weight_version(str(self.version))

    @property
    def nbytes(self) -> int:
        """Bytes written per sync (0 for a checkpoint reload, which vLLM reads in full)."""
        return int(self.sender.stats()["layout_nbytes"]) if self.mode != "reload" else 0

    def __call__(self) -> int:
        from weightsync.integrations.vllm import update_adapter, update_engine

        if self.mode == "lora":
            self.version = self.sender.update_weights()
            self.lora_request = update_adapter(self.llm, str(self.scratch / "adapter"))
            self.llm.update_weight_version(str(self.version))
            return self.version
        if self.mode == "weightsync":
            version = self.sender.update_weights()
            update_engine(self.llm, version)
            self.version = version
            return version
        checkpoint = self.scratch / "checkpoint"
        self.model.save_pretrained(checkpoint, safe_serialization=True)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(checkpoint)})
        self.llm.reset_prefix_cache()
        self.version += 1
        self.llm.update_weight_version(str(self.version))
        return self.version

    def close(self) -> None:
        if self.mode != "reload":
            self.sender.close()


def run_llm_demo(options: LLMDemoOptions) -> LLMDemoResult:
    """Train, generate and sync until ``options.steps`` or ``options.max_seconds``."""
    if options.sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {options.sync!r}")
    if options.model_size not in task.SIZES:
        raise ValueError(f"model_size must be one of {sorted(task.SIZES)}, got {options.model_size!r}")
    if options.lora and options.sync != "weightsync":
        raise ValueError("--lora syncs through weightsync (the adapter alone); drop --sync reload")
    log = options.log
    rng = random.Random(options.seed)
    model = task.build_model(options.model_size, options.seed)
    params = sum(p.numel() for p in model.parameters())
    full_bytes = sum(t.nbytes for t in model.state_dict().values())
    check_prompts = task.make_prompts(4, random.Random(options.seed + 1))
    history: list[dict[str, float]] = []
    checks, interrupted, llm, sync, startup = 0, False, None, None, 0.0
    started = time.perf_counter()
    with _scratch() as scratch:
        try:
            log(f"starting a vLLM engine on a {params / 1e6:.1f} M-parameter model "
                f"({options.model_size}, tensor parallel {options.tensor_parallel}), "
                f"sync: {options.sync}...")
            task.save_checkpoint(model, scratch / "model")
            if options.lora:  # the engine serves the base; the adapter is trained and synced
                model = task.with_lora(model, options.lora_rank)
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=options.learning_rate
                                          * (LORA_LR_FACTOR if options.lora else 1))
            llm = _engine(scratch / "model", options)
            sync = _Sync("lora" if options.lora else options.sync, llm, model, scratch,
                         options.tensor_parallel)
            startup = time.perf_counter() - started
            log(f"engine ready in {startup:.1f} s")
            if options.lora:
                log(f"LoRA rank {options.lora_rank} on every projection: "
                    f"{_mb(sync.nbytes)} per sync (the adapter alone), against "
                    f"{_mb(full_bytes)} for the full model ({sync.nbytes / full_bytes:.1%})")
            log(f"{'step':>5} {'version':>7} {'reward':>7} {'generate':>9} {'train':>8} "
                f"{'sync':>8}  sample")
            t_loop = time.perf_counter()
            for step in range(1, options.steps + 1):
                if time.perf_counter() - t_loop > options.max_seconds:
                    break
                t0 = time.perf_counter()
                prompts = task.make_prompts(options.prompts, rng)
                batch = _generate(llm, prompts, options.group, sync.version, sync.lora_request)
                t1 = time.perf_counter()
                model.train()
                loss = task.policy_gradient_loss(model, batch, options.group)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                model.eval()
                t2 = time.perf_counter()
                version = sync()
                t3 = time.perf_counter()
                mean_reward = statistics.fmean(batch.rewards)
                history.append({"step": step, "version": version, "reward": mean_reward,
                                "generate_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2})
                sample = f"{task.render(batch.prompts[0][1:-1])} -> {task.render(batch.answers[0])}"
                if step <= 5 or step % 10 == 0:
                    log(f"{step:>5} {version:>7} {mean_reward:>7.3f} {1e3 * (t1 - t0):>7.0f}ms "
                        f"{1e3 * (t2 - t1):>6.0f}ms {1e3 * (t3 - t2):>6.1f}ms  {sample}")
                if step % options.check_every == 0 or step == options.steps:
                    engine = _greedy(llm, check_prompts, sync.lora_request)
                    trainer = task.trainer_greedy(task.merged(model) if options.lora else model,
                                                  check_prompts)
                    if engine != trainer:
                        raise PromiseBroken(f"after the sync of version {version} the engine's greedy "
                                            f"answers {engine} differ from the trainer's {trainer}")
                    checks += 1
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: stopping the engine")
        finally:
            if sync is not None:
                sync.close()
            if llm is not None:
                _shutdown(llm)
                del llm
    sync_bytes = sync.nbytes if sync is not None else 0
    result = LLMDemoResult(
        steps=len(history), final_version=int(history[-1]["version"]) if history else 0,
        first_reward=statistics.fmean(h["reward"] for h in history[:5]) if history else 0.0,
        last_reward=statistics.fmean(h["reward"] for h in history[-5:]) if history else 0.0,
        greedy_checks=checks, seconds=time.perf_counter() - started,
        startup_seconds=startup, history=history, interrupted=interrupted,
        sync_bytes=sync_bytes, full_bytes=full_bytes)
    log(f"{result.steps} steps, version {result.final_version}: mean reward "
        f"{result.first_reward:.3f} (first 5 steps) -> {result.last_reward:.3f} (last 5); "
        f"median per step: generate {1e3 * result.median('generate_s'):.0f} ms, train "
        f"{1e3 * result.median('train_s'):.0f} ms, sync {1e3 * result.median('sync_s'):.1f} ms "
        f"({'lora' if options.lora else options.sync}); {checks} greedy checks passed")
    if options.lora:
        log(f"bytes per sync: {_mb(sync_bytes)} (LoRA adapter) vs {_mb(full_bytes)} (full model)")
    if options.plot and history:
        result.plot = _plot(history, options)
        log(f"plot written to {result.plot}")
    return result


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def _plot(history: list[dict[str, float]], options: LLMDemoOptions) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is missing: no plot")
        return None
    steps = [h["step"] for h in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [h["reward"] for h in history])
    top.set_ylabel("mean reward")
    mode = "lora" if options.lora else options.sync
    top.set_title(f"weightsync demo --llm ({options.model_size}, sync: {mode})")
    gen = [1e3 * h["generate_s"] for h in history]
    train = [1e3 * h["train_s"] for h in history]
    sync = [1e3 * h["sync_s"] for h in history]
    bottom.stackplot(steps, gen, train, sync, labels=["generate", "train", "sync"])
    bottom.set_ylabel("ms per step")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper right")
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"weightsync-demo-llm-{options.model_size}-{mode}.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
