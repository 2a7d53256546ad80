"""TorchRL's VLLMDoubleBufferSyncScheme and weightsync's drop-in, on the same vLLM engine
and the same trainer updates: after each update, do the engine's greedy tokens follow the
trainer's?

    python examples/torchrl_llm.py --steps 2

Runs on vLLM's CPU build with a tiny random Llama built here (nothing downloaded, about a
minute on 2 cores). Exits 0 with a message where vLLM or TorchRL is not installed.
Switching a TorchRL program is one import line:

    from torchrl.weight_update.llm import VLLMDoubleBufferSyncScheme          # TorchRL
    from weightsync.integrations.torchrl import VLLMDoubleBufferSyncScheme   # weightsync
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from typing import Any

import torch

PROMPTS = [[5, 17, 42, 8, 99, 3], [300, 1, 2, 77]]
NEW_TOKENS = 8


def tiny_llama(seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


@torch.no_grad()
def trainer_greedy(model: Any) -> list[list[int]]:
    """The trainer's greedy tokens, one forward per token, no end-of-sequence stop."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(ids[0, len(prompt):].tolist())
    return out


def engine_greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.no_grad()
def optimizer_step(model: Any, step: int) -> None:
    """A stand-in for training: move every weight by a seeded random amount."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std())


def run_scheme(name: str, scheme_cls: Any, directory: str, llm: Any, trainer: Any,
               steps: int) -> bool:
    """Commit ``steps`` updates through ``scheme_cls`` and poll the engine after each;
    print whether its greedy tokens equal the trainer's. Returns True if they always do."""
    scheme = scheme_cls(remote_addr=directory)
    sender = scheme.create_sender()
    sender.register_model(trainer)
    receiver = scheme.create_receiver(llm)
    followed = True
    try:
        for step in range(1, steps + 1):
            optimizer_step(trainer, step)
            sender.update_weights()
            try:
                applied = receiver.poll_and_apply(timeout=60.0)
            except Exception as exc:  # what a TorchRL user sees on a plain vllm.LLM
                print(f"  {name} update {step}: poll_and_apply raised "
                      f"{type(exc).__name__}: {str(exc)[:100]}")
                followed = False
                continue
            same = engine_greedy(llm) == trainer_greedy(trainer)
            followed &= same
            print(f"  {name} update {step}: poll_and_apply -> {applied}, greedy tokens "
                  f"{'equal' if same else 'DIFFER from'} the trainer's")
        if hasattr(receiver, "poll_and_apply") and name == "weightsync":
            print(f"  {name}: a poll with nothing new -> {receiver.poll_and_apply()}")
    finally:
        close = getattr(sender, "close", None)
        if close is not None:
            close()
    return followed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="trainer updates per scheme")
    args = parser.parse_args()
    missing = [m for m in ("vllm", "torchrl", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"skipped: this example needs {', '.join(missing)} (the vLLM CPU build works)")
        return
    for key, value in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(key, value)
    from torchrl.weight_update.llm import VLLMDoubleBufferSyncScheme as TorchRLScheme
    from vllm import LLM

    from weightsync.integrations.torchrl import VLLMDoubleBufferSyncScheme as WeightsyncScheme
    from weightsync.integrations.vllm import EXTENSION_CLS

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="weightsync-example-", dir=base)
    try:
        trainer = tiny_llama()
        trainer.save_pretrained(os.path.join(work, "model"), safe_serialization=True)
        llm = LLM(model=os.path.join(work, "model"), skip_tokenizer_init=True,
                  enforce_eager=True, dtype="float32", max_model_len=64, max_num_seqs=2,
                  seed=0, worker_extension_cls=EXTENSION_CLS)
        try:
            print("TorchRL's VLLMDoubleBufferSyncScheme on a vllm.LLM:")
            torchrl_ok = run_scheme("torchrl", TorchRLScheme, os.path.join(work, "torchrl"),
                                    llm, trainer, args.steps)
            print("weightsync.integrations.torchrl.VLLMDoubleBufferSyncScheme, same engine:")
            ours_ok = run_scheme("weightsync", WeightsyncScheme, os.path.join(work, "ws"),
                                 llm, trainer, args.steps)
            print(f"engine follows the trainer: torchrl={torchrl_ok} weightsync={ours_ok}")
            if not ours_ok:
                raise SystemExit("weightsync's scheme did not keep the engine on the trainer")
        finally:
            llm.llm_engine.engine_core.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
