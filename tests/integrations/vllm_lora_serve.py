"""What the LoRA-on-``vllm serve`` tests share: the server's flags, the trainer engine in
adapter mode, and the check that after each version the stable name ``policy`` answers as
the trainer's peft model merged (its adapter cast as it travelled) while the base model's
answer never changes."""

from __future__ import annotations

import copy
from typing import Any

import torch
import vllm_model as vm
from vllm_server import greedy

ADAPTER = "policy"
MAX_LORA_RANK = 8
#: ``vllm serve --enable-lora`` with runtime adapter loading, and prefix caching on: a block
#: cached with one version must never answer for another
LORA_SERVE_ARGS = ("--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", "1",
                   "--enable-prefix-caching")
LORA_SERVE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
LONG_PROMPT = [(7 * i + 3) % 500 + 1 for i in range(72)]  # 2 full 32-token blocks: cached
PROMPTS = [*vm.PROMPTS, LONG_PROMPT]


def adapter_engine(model: Any, client: Any, **info: Any) -> Any:
    """The weightsync trainer engine sending ``model``'s adapter (vLLM's factory, as a user
    calls it)."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, adapter=ADAPTER, **info), client=client,
        source=ModuleSource(model))


@torch.no_grad()
def merged_greedy(model: Any, dtype: torch.dtype | None) -> list[list[int]]:
    """The peft model's greedy tokens, its adapter cast through ``dtype`` (as it travelled)
    and merged into the base."""
    cast = copy.deepcopy(model)
    if dtype is not None:
        for name, p in cast.named_parameters():
            if ".lora_" in name:
                p.copy_(p.to(dtype).to(p.dtype))
    return vm.merged_greedy(cast, PROMPTS)


def check_versions(server: Any, engine: Any, model: Any, steps: list[int],
                   dtype: torch.dtype | None) -> list[list[list[int]]]:
    """Version 0 (sent at init), then one version per step: after each, ``policy`` answers
    as the merged trainer, the label names the version, the base never changes."""
    base = greedy(server, prompts=PROMPTS)
    assert base == vm.transformers_greedy(vm.build_model(), PROMPTS)
    seen = [greedy(server, ADAPTER, PROMPTS)]
    assert seen[0] == merged_greedy(model, dtype)
    for step in steps:
        vm.set_adapter(model, step)
        label = engine.send_weights()
        assert engine.version == len(seen)
        assert server.weight_version() == label
        seen.append(greedy(server, ADAPTER, PROMPTS))
        assert seen[-1] == merged_greedy(model, dtype), f"version {engine.version}"
        assert greedy(server, prompts=PROMPTS) == base
    assert len({str(tokens) for tokens in seen}) == len(seen), "each version changes the output"
    return seen
