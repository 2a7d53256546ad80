"""weightsync's drop-in for TorchRL's ``VLLMDoubleBufferSyncScheme`` on a real vLLM engine
(CPU build): after every update the engine's greedy tokens equal the trainer's
transformers greedy tokens, a poll with nothing new returns False at once, and an
``LLMCollector`` with the weightsync updater stamps each frame with the version that
generated it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import vllm_model as vm

pytest.importorskip("torchrl", reason="needs torchrl")

from weightsync.integrations.torchrl import (
    VLLM_DOUBLE_BUFFER_BACKEND,
    VLLMDoubleBufferSyncScheme,
)

pytestmark = [pytest.mark.torchrl, pytest.mark.timeout(900)]


def test_is_torchrl_scheme_built_as_torchrl_builds_it(tmp_path: Path):
    from torchrl.weight_update import WeightSyncScheme

    fields = {"_target_": "torchrl.weight_update.llm.VLLMDoubleBufferSyncScheme",
              "_partial_": False, "remote_addr": str(tmp_path / "w"), "local_addr": None,
              "num_threads": 2, "strategy": "tensordict"}
    scheme = VLLMDoubleBufferSyncScheme.from_config(fields)
    assert isinstance(scheme, WeightSyncScheme)
    assert (scheme.remote_addr, scheme.local_addr, scheme.num_threads) == (
        str(tmp_path / "w"), str(tmp_path / "w"), 2)
    positional = VLLMDoubleBufferSyncScheme(str(tmp_path / "a"), str(tmp_path / "b"), 1, "state_dict")
    assert (positional.local_addr, positional.strategy_name) == (str(tmp_path / "b"), "state_dict")
    via_backend = WeightSyncScheme.from_backend(VLLM_DOUBLE_BUFFER_BACKEND, remote_addr=str(tmp_path))
    assert isinstance(via_backend, VLLMDoubleBufferSyncScheme)


@pytest.mark.vllm
def test_llm_follows_the_trainer_after_every_update(served, directory: Path):
    llm, trainer = served.llm, vm.build_model()
    scheme = VLLMDoubleBufferSyncScheme(str(directory))
    receiver = scheme.create_receiver(llm)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        assert receiver.poll_and_apply() is False  # nothing committed yet
        assert sender.update_weights() == 0
        assert receiver.poll_and_apply() is True
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(trainer)
        seen = []
        for step in (1, 2, 3):
            vm.perturb(trainer, step)
            assert sender.update_weights() == step
            assert receiver.poll_and_apply(timeout=60) is True
            assert receiver.engine_versions() == [step] and receiver.version == step
            assert llm.get_weight_version() == str(step)
            tokens = vm.vllm_greedy(llm)
            assert tokens == vm.transformers_greedy(trainer)
            seen.append(tokens)
        assert len({str(t) for t in seen}) == 3, "each update must change the greedy tokens"
        started = time.perf_counter()
        assert receiver.poll_and_apply(timeout=60) is False  # nothing newer
        assert time.perf_counter() - started < 1.0, "a poll with nothing new must not wait"
        # a named version still in a slot: the engine goes back to it exactly
        assert receiver.apply_weights(2) == 2
        assert vm.vllm_greedy(llm) == seen[1]
        assert receiver.poll_and_apply() is True and receiver.version == 3
        assert vm.vllm_greedy(llm) == seen[2]
        with pytest.raises(TypeError, match="version number"):
            receiver.apply_weights({"lm_head.weight": trainer.lm_head.weight})
