"""A tiny random Llama for the real-engine vLLM tests, built at test time, and the
trainer-side helpers the tests share (greedy decoding with transformers, perturbation).

Nothing is downloaded: the model is saved with ``save_pretrained`` into a local directory
and the engine runs with ``skip_tokenizer_init=True`` on prompt token ids."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-5,
)
PROMPTS = [[5, 17, 42, 8, 99, 3], [300, 1, 2, 77]]
NEW_TOKENS = 12

# What every engine in these tests runs with: offline, tiny KV cache, no compilation.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def build_model(seed: int = 0, **overrides: Any) -> Any:
    """A random ``LlamaForCausalLM`` (float32) with ``CONFIG`` plus ``overrides``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**CONFIG, **overrides})
    model = transformers.LlamaForCausalLM(config)
    return model.eval()


def save_model(model: Any, directory: str | os.PathLike[str]) -> str:
    """Write ``model`` as a local checkpoint vLLM can serve (config + safetensors)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def engine_kwargs(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """``LLM(**engine_kwargs(...))`` for a small CPU engine on ``model_dir``."""
    return {
        "model": model_dir, "skip_tokenizer_init": True, "enforce_eager": True,
        "dtype": "float32", "max_model_len": 128, "max_num_seqs": 4, "seed": 0,
        "enable_prefix_caching": True, "block_size": 32,
        "worker_extension_cls": "weightsync.integrations.vllm.WeightSyncWorkerExtension",
        **overrides,
    }


@torch.no_grad()
def transformers_greedy(model: Any, prompts: list[list[int]] = PROMPTS,
                        new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """The trainer's greedy continuation of each prompt (new tokens only)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        # an explicit mask: without it, a prompt token equal to the pad id would be masked
        ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)[0].tolist()
        out.append(ids[len(prompt):])
    return out


def vllm_greedy(llm: Any, prompts: list[list[int]] = PROMPTS,
                new_tokens: int = NEW_TOKENS, lora_request: Any = None) -> list[list[int]]:
    """The engine's greedy continuation of each prompt (new tokens only), with the LoRA
    adapter of ``lora_request`` if given."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                           lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.no_grad()
def perturb(model: Any, step: int, scale: float = 0.3) -> None:
    """Change every weight by a seeded random amount: a stand-in for an optimizer step
    that moves the greedy output for sure."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())


LORA_TARGETS = ["q_proj", "v_proj", "o_proj"]


def peft_model(rank: int = 8, seed: int = 0, targets: list[str] | None = None) -> Any:
    """``build_model(seed)`` wrapped by peft with a LoRA adapter on ``targets``, its weights
    set by :func:`set_adapter` (step 0)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=targets or LORA_TARGETS)
    model = peft.get_peft_model(build_model(seed), config).eval()
    set_adapter(model, 0)
    return model


@torch.no_grad()
def set_adapter(model: Any, step: int, scale: float = 0.15) -> None:
    """Seeded random LoRA weights for ``step`` (the same in any process): a stand-in for a
    training step that moves the greedy output for sure; the base is not touched."""
    gen = torch.Generator().manual_seed(5000 + step)
    for name, p in sorted(model.named_parameters()):
        if ".lora_" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def merged_greedy(model: Any, prompts: list[list[int]] = PROMPTS,
                  new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """The greedy tokens of ``model`` (a peft model) with its adapter merged into a copy of
    the base, as a full-weight sync would serve it."""
    import copy

    merged = copy.deepcopy(model).merge_and_unload()
    return transformers_greedy(merged, prompts, new_tokens)


def rounded_copy(model: Any, dtype: torch.dtype) -> Any:
    """A copy of ``model`` whose weights went through ``dtype`` and back: what an engine
    serves after an update sent in ``dtype``."""
    copy = build_model()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return copy
