"""LoRA adapters on a real ``vllm serve --enable-lora`` on the trainer's host (the
directory path): the trainer's engine sends only the peft model's adapter, and after each
``send_weights()`` clients asking for ``model="policy"`` get that version, with no stale
prefix cache, while the base model answers as always."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vllm_model as vm
from vllm_engine import vllm_or_skip
from vllm_lora_serve import (
    ADAPTER,
    LONG_PROMPT,
    LORA_SERVE_ARGS,
    LORA_SERVE_ENV,
    PROMPTS,
    adapter_engine,
    check_versions,
    merged_greedy,
)
from vllm_server import VLLMServer, greedy, serve_tiny_llama

from weightsync.core.errors import BaseWeightChangedError
from weightsync.serving.adapter_files import AdapterFiles

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server() -> Iterator[VLLMServer]:
    """One ``vllm serve --enable-lora`` on 127.0.0.1 for the module."""
    vllm_or_skip()
    pytest.importorskip("peft")
    yield from serve_tiny_llama("ws-vllm-serve-lora-", extra=LORA_SERVE_ARGS, env=LORA_SERVE_ENV)
    # vLLM kills its workers at exit: the next server on the host removes what they left
    AdapterFiles(f"/dev/shm/ws-next-server-{os.getpid()}", "policy", max_rank=8, keep=1).close()
    left = [path for path in STAGED if os.path.exists(path)]
    assert left == [], f"adapter files of a server gone, left behind: {left}"


STAGED: list[str] = []  # every adapter directory the server was given


def _engine(model, server: VLLMServer, **info):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    engine = adapter_engine(model, HTTPVLLMWeightSyncClient(server.url, timeout=120), **info)
    STAGED.extend(engine._adapter_dirs.values())
    return engine


def test_the_stable_name_serves_every_adapter_version(server: VLLMServer, directory: Path):
    model = vm.peft_model()
    engine = _engine(model, server, directory=str(directory), dtype="bfloat16", adapter_keep=2)
    try:
        check_versions(server, engine, model, [1, 2, 3], torch.bfloat16)
        staged = sorted(p.name for p in Path(engine._adapter_dirs[0]).glob("policy-v*"))
        assert staged == ["policy-v2", "policy-v3"]  # the newest adapter_keep versions
    finally:
        engine.shutdown()


def test_swap_mode_serves_every_version_too(server: VLLMServer, directory: Path):
    """``adapter_load="swap"`` (unload, then a plain load: no re-reads at each step)."""
    model = vm.peft_model()
    engine = _engine(model, server, directory=str(directory), adapter_load="swap")
    try:
        check_versions(server, engine, model, [7, 8], None)
    finally:
        engine.shutdown()


def test_the_checks_see_a_stale_prefix_cache(server: VLLMServer, directory: Path, tmp_path: Path):
    """Why a new path per version: changed weights reloaded in place at the *same* path
    answer the cached long prompt with neither version's tokens (vLLM keys blocks by name
    and path), while the stable name, moved to a new path, answers exactly."""
    import requests

    model = vm.peft_model()
    engine = _engine(model, server, directory=str(directory))
    fixed = tmp_path / "fixed"
    fixed.mkdir()

    def load_fixed(version: int) -> list[list[int]]:
        for part in Path(engine._adapter_dirs[0], f"policy-v{version}").iterdir():
            shutil.copy(part, fixed / part.name)
        reply = requests.post(f"{server.url}/v1/load_lora_adapter", timeout=60, json={
            "lora_name": "fixed", "lora_path": str(fixed), "load_inplace": True})
        assert reply.status_code == 200, reply.text
        return greedy(server, "fixed", [LONG_PROMPT])

    try:
        expected = {}
        for step in (1, 2):
            vm.set_adapter(model, step)
            engine.send_weights()
            expected[step] = merged_greedy(model, None)[-1:]
        assert load_fixed(1) == expected[1]
        stale = load_fixed(2)
        assert stale != expected[2] and stale != expected[1]
        assert greedy(server, ADAPTER, [LONG_PROMPT]) == expected[2]
    finally:
        engine.shutdown()
        requests.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "fixed"},
                      timeout=60)


def test_a_changed_base_weight_is_refused_and_the_served_version_kept(
        server: VLLMServer, directory: Path):
    model = vm.peft_model()
    engine = _engine(model, server, directory=str(directory))
    try:
        vm.set_adapter(model, 5)
        label = engine.send_weights()
        served = greedy(server, ADAPTER, PROMPTS)
        with torch.no_grad():
            model.base_model.model.lm_head.weight.mul_(1.01)
        vm.set_adapter(model, 6)
        with pytest.raises(BaseWeightChangedError, match="lm_head"):
            engine.send_weights()
        assert server.weight_version() == label
        assert greedy(server, ADAPTER, PROMPTS) == served
    finally:
        engine.shutdown()
