"""LoRA adapters alone, into a real vLLM engine (CPU build, ``enable_lora=True``).

The trainer is a peft model (LoRA on q/v/o of the tiny Llama); after every version the
engine's greedy tokens with the returned ``LoRARequest`` must equal the trainer's adapter
merged into the base in transformers (float32, as the engine computes), and the base model's
tokens with no adapter must never change. One engine serves the whole module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_model as vm
from vllm_engine import descendants, shutdown_engine, vllm_or_skip

import weightsync as ws
from weightsync.core.errors import AdapterRankError
from weightsync.integrations.vllm import adapter_versions, update_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_LORA_RANK = 8
HERE = Path(__file__).parent
LONG_PROMPT = [(7 * i + 3) % 500 + 1 for i in range(72)]  # 2 full 32-token blocks: cacheable


class LoraEngine:
    def __init__(self, llm: Any, base_tokens: list[list[int]]) -> None:
        self.llm = llm
        self.base_tokens = base_tokens

    def check_base(self) -> None:
        """The base model, asked with no adapter, answers as it always did."""
        assert vm.vllm_greedy(self.llm) == self.base_tokens


@pytest.fixture(scope="module")
def engine() -> Iterator[LoraEngine]:
    vllm_or_skip()
    pytest.importorskip("peft")
    os.environ.update(vm.ENGINE_ENV)
    from vllm import LLM

    work = Path(tempfile.mkdtemp(prefix="ws-vllm-lora-model-"))
    base = vm.build_model()
    model_dir = vm.save_model(base, work / "model")
    existing = descendants()
    llm = LLM(**vm.engine_kwargs(model_dir, enable_lora=True, max_lora_rank=MAX_LORA_RANK,
                                 max_loras=2))
    procs = descendants() - existing
    try:
        served = LoraEngine(llm, vm.transformers_greedy(base))
        served.check_base()
        yield served
    finally:
        shutdown_engine(llm, procs)
        shutil.rmtree(work, ignore_errors=True)


def _sender(directory: Path, model: Any) -> Any:
    sender = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, adapter="policy").create_sender()
    sender.register_model(model)
    return sender


def test_every_adapter_version_matches_the_peft_model_merged(engine: LoraEngine, directory: Path):
    model = vm.peft_model()
    seen = []
    with _sender(directory, model) as sender:
        for step in range(3):
            vm.set_adapter(model, step)
            assert sender.update_weights() == step
            request = update_adapter(engine.llm, str(directory))
            assert request.lora_name == f"policy-v{step}"
            expected = vm.merged_greedy(model)
            assert vm.vllm_greedy(engine.llm, lora_request=request) == expected
            engine.check_base()
            assert adapter_versions(engine.llm) == [step]  # older versions were evicted
            assert len(engine.llm.llm_engine.list_loras()) == 1
            seen.append(expected)
            assert update_adapter(engine.llm, str(directory)) is request  # nothing newer
        adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
        assert sender.stats()["layout_nbytes"] == adapter_bytes  # only the adapter travelled
    assert len({str(tokens) for tokens in seen}) == 3, "each version must change the output"
    assert all(tokens != engine.base_tokens for tokens in seen)


def test_connect_waits_for_the_engine_to_load_version_0(engine: LoraEngine, directory: Path):
    model = vm.peft_model()
    with _sender(directory, model) as sender:
        import threading

        loaded: list[Any] = []
        engine_side = threading.Thread(target=lambda: loaded.append(
            update_adapter(engine.llm, str(directory), timeout=60)))
        engine_side.start()
        try:
            assert sender.connect(timeout=60) == 0  # returns once the engine acked version 0
        finally:
            engine_side.join(60)
        assert loaded and loaded[0].lora_name == "policy-v0"
        assert vm.vllm_greedy(engine.llm, lora_request=loaded[0]) == vm.merged_greedy(model)


def test_versions_committed_while_the_engine_loads_do_not_disturb_it(
        engine: LoraEngine, directory: Path):
    """Between copying version 1 and vLLM reading it, the trainer commits four more
    versions (every slot is rewritten): the engine still serves version 1 exactly, then
    takes the newest."""
    model = vm.peft_model()
    llm_engine = engine.llm.llm_engine
    with _sender(directory, model) as sender:
        vm.set_adapter(model, 0)
        sender.update_weights()
        update_adapter(engine.llm, str(directory))
        vm.set_adapter(model, 1)
        sender.update_weights()
        expected_v1 = vm.merged_greedy(model)
        real_add = llm_engine.add_lora

        def add_after_commits(request: Any) -> bool:
            for step in range(2, 6):
                vm.set_adapter(model, step)
                sender.update_weights()
            return bool(real_add(request))

        llm_engine.add_lora = add_after_commits
        try:
            request = update_adapter(engine.llm, str(directory))
        finally:
            del llm_engine.add_lora
        assert request.lora_name == "policy-v1"
        assert vm.vllm_greedy(engine.llm, lora_request=request) == expected_v1
        newest = update_adapter(engine.llm, str(directory))
        assert newest.lora_name == "policy-v5"
        assert vm.vllm_greedy(engine.llm, lora_request=newest) == vm.merged_greedy(model)
        engine.check_base()


def test_a_trainer_killed_mid_commit_leaves_the_last_whole_version(
        engine: LoraEngine, directory: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    child = subprocess.run([sys.executable, str(HERE / "lora_trainer.py"), str(directory), "2"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-2000:]
    assert "committed 2" in child.stdout
    request = update_adapter(engine.llm, str(directory))
    assert request.lora_name == "policy-v1"  # version 2 was never committed
    model = vm.peft_model()
    vm.set_adapter(model, 1)
    assert vm.vllm_greedy(engine.llm, lora_request=request) == vm.merged_greedy(model)
    # a new trainer takes the directory over and goes on from there
    with _sender(directory, model) as sender:
        vm.set_adapter(model, 7)
        assert sender.update_weights() == 2
        request = update_adapter(engine.llm, str(directory))
        assert request.lora_name == "policy-v2"
        assert vm.vllm_greedy(engine.llm, lora_request=request) == vm.merged_greedy(model)
    engine.check_base()


def test_an_adapter_above_max_lora_rank_is_refused_before_any_load(
        engine: LoraEngine, directory: Path):
    loaded_before = set(engine.llm.llm_engine.list_loras())
    versions_before = adapter_versions(engine.llm)
    with _sender(directory, vm.peft_model(rank=64)) as sender:
        sender.update_weights()
        started = time.perf_counter()
        with pytest.raises(AdapterRankError, match="rank 64.*max_lora_rank=8") as caught:
            update_adapter(engine.llm, str(directory))
        assert time.perf_counter() - started < 10
    assert (caught.value.rank, caught.value.max_rank) == (64, MAX_LORA_RANK)
    assert set(engine.llm.llm_engine.list_loras()) == loaded_before
    assert adapter_versions(engine.llm) == versions_before
    engine.check_base()


def test_two_trainers_calling_their_adapters_alike_stay_apart(engine: LoraEngine, tmp_path: Path):
    """Two directories whose adapters share the name "policy" and version numbers, loaded
    in turns: each load gets its own files and LoRA id, and answers as its own trainer."""
    first, second = vm.peft_model(), vm.peft_model()
    vm.set_adapter(second, 40)
    with _sender(tmp_path / "a", first) as a, _sender(tmp_path / "b", second) as b:
        a.update_weights()
        b.update_weights()
        prompts = [*vm.PROMPTS, LONG_PROMPT]  # a cached prefix of one must not serve the other
        for model, directory in [(first, "a"), (second, "b"), (first, "a"), (second, "b")]:
            request = update_adapter(engine.llm, str(tmp_path / directory))
            assert request.lora_name == "policy-v0"
            assert vm.vllm_greedy(engine.llm, prompts, lora_request=request) == \
                vm.merged_greedy(model, prompts)
    engine.check_base()
