"""LoRA adapters on a real ``vllm serve --enable-lora`` on the trainer's host (the
directory path): the trainer's engine sends only the peft model's adapter, and after each
``send_weights()`` clients asking for ``model="policy"`` get that version, with no stale
prefix cache, while the base model answers as always."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vllm_model as vm
from vllm_engine import vllm_or_skip
from vllm_lora_serve import ADAPTER, LORA_SERVE_ARGS, LORA_SERVE_ENV, PROMPTS, adapter_engine, check_versions
from vllm_server import VLLMServer, greedy

from weightsync.core.errors import BaseWeightChangedError

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server() -> Iterator[VLLMServer]:
    """One ``vllm serve --enable-lora`` on 127.0.0.1 for the module."""
    vllm_or_skip()
    pytest.importorskip("peft")
    work = Path(tempfile.mkdtemp(prefix="ws-vllm-serve-lora-", dir="/var/tmp"))
    served = VLLMServer(vm.save_model(vm.build_model(), work / "model"), extra=LORA_SERVE_ARGS,
                        env=LORA_SERVE_ENV)
    try:
        served.start().wait_ready()
        yield served
    finally:
        served.stop()
        shutil.rmtree(work, ignore_errors=True)


def _client(server: VLLMServer):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    return HTTPVLLMWeightSyncClient(server.url, timeout=120)


def test_the_stable_name_serves_every_adapter_version(server: VLLMServer, directory: Path):
    model = vm.peft_model()
    engine = adapter_engine(model, _client(server), directory=str(directory), dtype="bfloat16",
                            adapter_keep=2)
    try:
        check_versions(server, engine, model, [1, 2, 3], torch.bfloat16)
        staged = sorted(p.name for p in Path(engine._adapter_dirs[0]).iterdir())
        assert staged == ["policy-v2", "policy-v3"]  # the newest adapter_keep versions
    finally:
        engine.shutdown()


def test_a_changed_base_weight_is_refused_and_the_served_version_kept(
        server: VLLMServer, directory: Path):
    model = vm.peft_model()
    engine = adapter_engine(model, _client(server), directory=str(directory))
    try:
        vm.set_adapter(model, 5)
        engine.send_weights()
        served = greedy(server, ADAPTER, PROMPTS)
        with torch.no_grad():
            model.base_model.model.lm_head.weight.mul_(1.01)
        vm.set_adapter(model, 6)
        with pytest.raises(BaseWeightChangedError, match="lm_head"):
            engine.send_weights()
        assert server.weight_version() == "1"
        assert greedy(server, ADAPTER, PROMPTS) == served
    finally:
        engine.shutdown()
