"""weightsync as the weight-transfer backend of a real ``vllm serve`` (CPU build), driven
the way vLLM documents it: a plain trainer process (not a vLLM process) calls
``WeightTransferTrainerFactory.trainer_init`` with vLLM's ``HTTPVLLMWeightSyncClient``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vllm_model as vm
from vllm_engine import vllm_or_skip
from vllm_server import SRC, VLLMServer, greedy, serve_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server() -> Iterator[VLLMServer]:
    """One ``vllm serve`` on 127.0.0.1 for the module (it takes 20-60 s to start)."""
    vllm_or_skip()
    yield from serve_tiny_llama("ws-vllm-serve-")


@pytest.mark.parametrize("first", ["vllm", "weightsync"])
def test_importing_the_backend_registers_the_trainer_engine_in_a_fresh_process(first: str):
    """vLLM loads plugins only in its own processes: importing weightsync's vLLM package
    must be enough for a trainer's ``trainer_init`` to find the engine, whether vLLM was
    imported before it or after (importing weightsync does not import vLLM); twice is
    harmless."""
    vllm_or_skip()
    factory = "from vllm.distributed.weight_transfer import WeightTransferTrainerFactory as F\n"
    code = (
        (factory if first == "vllm" else "")
        + "import sys\n"
        "import weightsync.integrations.vllm\n"
        + ("assert 'vllm' not in sys.modules, 'importing weightsync imported vLLM'\n"
           + factory if first == "weightsync" else "")
        + "assert 'weightsync' in F._registry\n"
        "from weightsync.integrations.vllm import backend\n"
        "from weightsync.integrations.vllm.plugin import register\n"
        "register()\n"
        "assert F._registry['weightsync']() is backend.WeightSyncTrainerEngine\n"
        "print('ok')\n"
    )
    env = os.environ | vm.ENGINE_ENV | {"PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_trainer_drives_vllm_serve_through_a_directory(server: VLLMServer, directory: Path):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    trainer = vm.build_model()
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, directory=str(directory), dtype="bfloat16"),
        client=HTTPVLLMWeightSyncClient(server.url, timeout=120), source=ModuleSource(trainer),
    )
    try:
        for step in (1, 2, 3):
            vm.perturb(trainer, step)
            assert engine.send_weights() == server.weight_version()
            assert greedy(server) == vm.transformers_greedy(vm.rounded_copy(trainer, torch.bfloat16))
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def cached_server() -> Iterator[VLLMServer]:
    """A second ``vllm serve`` with prefix caching on, as vLLM serves by default."""
    vllm_or_skip()
    yield from serve_tiny_llama("ws-vllm-serve-cached-", extra=("--enable-prefix-caching",))


def test_a_prompt_cached_before_an_update_is_answered_by_the_new_weights(
        cached_server: VLLMServer, directory: Path):
    """With prefix caching on, a long prompt answered before an update leaves its blocks
    (computed with the old weights) in the cache: ``send_weights()`` empties each server's
    prefix cache before labelling the version, so the same prompt is then answered exactly
    as the new weights answer it (without it the cached blocks mix the two versions)."""
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    long = [[(37 * i) % 500 + 3 for i in range(96)]]  # three full blocks of 32 tokens
    trainer = vm.build_model()
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, directory=str(directory), dtype="bfloat16"),
        client=HTTPVLLMWeightSyncClient(cached_server.url, timeout=120),
        source=ModuleSource(trainer))
    try:
        for step in (1, 2):
            greedy(cached_server, prompts=long)  # its blocks stay in the prefix cache
            vm.perturb(trainer, step)
            engine.send_weights()
            assert greedy(cached_server, prompts=long) == vm.transformers_greedy(
                vm.rounded_copy(trainer, torch.bfloat16), long), step
    finally:
        engine.shutdown()

