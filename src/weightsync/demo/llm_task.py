"""What the LLM demo learns, and with what: a small causal LM made from a config (nothing
is downloaded), its symbol tokenizer built offline, a programmatic task with a reward, and
the policy-gradient loss of the GRPO kind (a group of samples per prompt, advantages
normalised within the group).

The task: the prompt is a few random symbols; the answer should repeat them, in order, as
often as the answer's length allows ("c a f" -> "c a f c a f"). The reward of a sample is
the fraction of its tokens that match. A randomly initialised model scores about
1/len(SYMBOLS); copying is what attention learns first, so the reward rises within a few
minutes on two CPU cores."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SYMBOLS = "abcdefghij"
SPECIALS = ("<pad>", "<bos>", "<sep>")
PAD, BOS, SEP = 0, 1, 2
PROMPT_SYMBOLS = 3
ANSWER_TOKENS = 6

#: model sizes: the tiny one trains fast; the small one (~100 M parameters) makes the
#: cost of a sync visible beside generation
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4),
}


def vocab() -> list[str]:
    return [*SPECIALS, *SYMBOLS]


def build_model(size: str, seed: int) -> Any:
    """A random Llama-style causal LM (float32) over the demo's symbols."""
    import transformers

    torch.manual_seed(seed)
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab()), max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=SEP,
        initializer_range=0.02, **SIZES[size],
    )
    config = transformers.LlamaConfig(**fields)
    return transformers.LlamaForCausalLM(config)


#: where the demo's LoRA adapter sits: every attention and MLP projection
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model: Any, rank: int) -> Any:
    """``model`` wrapped by peft with a fresh LoRA adapter of ``rank`` (base frozen)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=LORA_TARGETS)
    return peft.get_peft_model(model, config)


def merged(model: Any) -> Any:
    """A copy of a peft ``model`` with its adapter merged into the base (what the engine
    computes with the adapter applied)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def save_checkpoint(model: Any, directory: Path) -> Path:
    """The model and its tokenizer, as a local checkpoint vLLM can serve."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer().save_pretrained(str(directory))
    return directory


def build_tokenizer() -> Any:
    """A word-level tokenizer over the symbols, made offline with ``tokenizers``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {token: i for i, token in enumerate(vocab())}
    core = Tokenizer(models.WordLevel(table, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<sep>", unk_token="<pad>")


def make_prompts(count: int, rng: random.Random) -> list[list[int]]:
    """``count`` prompts: <bos>, a few random symbols, <sep>."""
    first = len(SPECIALS)
    return [[BOS, *(rng.randrange(first, first + len(SYMBOLS)) for _ in range(PROMPT_SYMBOLS)),
             SEP] for _ in range(count)]


def target(prompt: list[int]) -> list[int]:
    symbols = prompt[1:-1]
    return [symbols[i % len(symbols)] for i in range(ANSWER_TOKENS)]


def reward(prompt: list[int], answer: list[int]) -> float:
    """The fraction of the answer's tokens that repeat the prompt's symbols in order."""
    want = target(prompt)
    return sum(a == b for a, b in zip(answer, want, strict=False)) / len(want)


def render(tokens: list[int]) -> str:
    names = vocab()
    return " ".join(names[t] if 0 <= t < len(names) else "?" for t in tokens)


@dataclass
class Batch:
    """One step's samples: prompts repeated ``group`` times, answers, rewards, versions."""

    prompts: list[list[int]]
    answers: list[list[int]]
    rewards: list[float]
    versions: list[int]


def group_advantages(rewards: list[float], group: int) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's std."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)
    return adv.view(-1)


def policy_gradient_loss(model: Any, batch: Batch, group: int) -> torch.Tensor:
    """-(advantage x log-probability of each answer token), averaged over tokens: the
    samples were drawn by the engine from the same weights (on-policy)."""
    advantages = group_advantages(batch.rewards, group)
    width = max(len(p) + len(a) for p, a in zip(batch.prompts, batch.answers, strict=True))
    ids = torch.full((len(batch.prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    attention = torch.zeros_like(ids)
    for row, (prompt, answer) in enumerate(zip(batch.prompts, batch.answers, strict=True)):
        seq = prompt + answer
        ids[row, :len(seq)] = torch.tensor(seq)
        attention[row, :len(seq)] = 1
        mask[row, len(prompt):len(seq)] = True
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
    chosen = mask[:, 1:]
    weighted = logp * advantages[:, None] * chosen
    return -weighted.sum() / chosen.sum().clamp(min=1)


@torch.no_grad()
def trainer_greedy(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """The trainer's own greedy answers (transformers), to hold the engine's against."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=ANSWER_TOKENS, min_new_tokens=ANSWER_TOKENS,
                              pad_token_id=PAD, eos_token_id=None)
        out.append(full[0, len(prompt):].tolist())
    return out
