"""weightsync's drop-in for TorchRL's ``VLLMDoubleBufferSyncScheme`` on a real vLLM engine
(CPU build): after every update the engine's greedy tokens equal the trainer's
transformers greedy tokens, a poll with nothing new returns False at once, and an
``LLMCollector`` with the weightsync updater stamps each frame with the version that
generated it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
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


# ============================================================== LLMCollector
BATCH, PROMPT_LEN, NEW = 2, 4, 6
COLLECTOR_PROMPTS = [[5, 17, 42, 8], [300, 1, 2, 77]]


@torch.no_grad()
def greedy_reference(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The trainer's greedy continuation, token by token (no end-of-sequence stop: the
    collector's policy runs with ``ignore_eos``), with an explicit attention mask."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(new_tokens):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        out.append(ids[0, len(prompt):].tolist())
    return out


class PadOnlyTokenizer:
    """What ``vLLMWrapper`` needs of a tokenizer in ``input_mode="tokens"``: the pad id
    (the tiny test model has no tokenizer; no prompt token equals it)."""

    pad_token = eos_token = "<pad>"
    pad_token_id = eos_token_id = 0

    def __call__(self, text, **kwargs):
        return {"input_ids": [0]}


def prompt_env():
    """A single-turn env over fixed token prompts: every step ends the dialog."""
    from tensordict import TensorDict
    from torchrl.data import Composite, Unbounded
    from torchrl.envs import EnvBase

    prompts = torch.tensor(COLLECTOR_PROMPTS)

    class PromptEnv(EnvBase):
        def __init__(self):
            super().__init__(batch_size=(BATCH,))
            self.observation_spec = Composite(
                tokens=Composite(prompt=Unbounded((BATCH, PROMPT_LEN), dtype=torch.int64),
                                 shape=(BATCH,)), shape=(BATCH,))
            self.action_spec = Composite(
                tokens=Composite(response=Unbounded((BATCH, NEW), dtype=torch.int64),
                                 shape=(BATCH,)), shape=(BATCH,))
            self.reward_spec = Unbounded((BATCH, 1))

        def _obs(self, done: bool, reward: bool) -> TensorDict:
            flags = torch.full((BATCH, 1), done)
            td = TensorDict({"tokens": {"prompt": prompts.clone()}, "done": flags,
                             "terminated": flags.clone()}, batch_size=(BATCH,))
            if reward:
                td["reward"] = torch.zeros(BATCH, 1)
            return td

        def _reset(self, tensordict=None):
            return self._obs(False, False)

        def _step(self, tensordict):
            return self._obs(True, True)

        def _set_seed(self, seed):
            return None

    return PromptEnv()


@pytest.mark.vllm
def test_llm_collector_stamps_the_version_that_generated_each_frame(served, directory: Path):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.modules.llm import vLLMWrapper

    from weightsync.integrations.torchrl import VLLMDoubleBufferWeightUpdater

    llm, trainer = served.llm, vm.build_model()
    scheme = VLLMDoubleBufferSyncScheme(str(directory))
    policy = vLLMWrapper(llm, tokenizer=PadOnlyTokenizer(), input_mode="tokens", generate=True,
                         pad_output=True, generate_kwargs={
                             "max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True})
    updater = VLLMDoubleBufferWeightUpdater(scheme, llm)
    batches = 4
    collector = LLMCollector(prompt_env(), policy=policy, dialog_turns_per_batch=BATCH,
                             total_dialog_turns=batches * BATCH, weight_updater=updater,
                             track_policy_version=True)
    expected = {}
    with scheme.create_sender() as sender:
        try:
            sender.register_model(trainer)
            expected[sender.update_weights()] = greedy_reference(trainer, COLLECTOR_PROMPTS, NEW)
            collector.update_policy_weights_()
            assert collector.policy_version == 0
            seen = []
            for i, batch in enumerate(collector):
                versions = {int(v) for v in batch["policy_version"].flatten().tolist()}
                versions |= {int(v) for v in batch["next", "policy_version"].flatten().tolist()}
                assert versions == {i}, f"batch {i} is stamped {versions}"
                tokens = batch["tokens", "response"].reshape(BATCH, NEW).tolist()
                assert tokens == expected[i], f"batch {i} was not generated by version {i}"
                seen.append(tokens)
                if i == 1:  # nothing new: TorchRL's counter would move, the version must not
                    collector.update_policy_weights_()
                    assert collector.policy_version == i
                vm.perturb(trainer, i + 1)
                expected[sender.update_weights()] = greedy_reference(trainer, COLLECTOR_PROMPTS, NEW)
                collector.update_policy_weights_()
                assert collector.policy_version == i + 1 == updater.version
            assert len(seen) == batches and len({str(t) for t in seen}) == batches
        finally:
            collector.shutdown()


# ============================================================== AsyncVLLM fan-out
class _Remote:
    """An actor method whose ``.remote(...)`` answers at once (no Ray)."""

    def __init__(self, fn):
        self.remote = fn


class _FakeReplica:
    """A replica actor of ``ranks`` workers answering ``weightsync_call`` by local rank."""

    def __init__(self, ranks: int):
        self.calls: list[tuple] = []
        self.collective_rpc_v1 = _Remote(self._rpc)
        self._ranks = ranks

    def _rpc(self, method, timeout, args, kwargs):
        self.calls.append(args)
        return [{"rank": r, "ok": 0} for r in range(self._ranks)]


def test_async_vllm_driver_gives_every_replica_rank_its_own_index():
    """Two replicas of two ranks: replica 1 connects its workers at offset 2, and the
    driver reports engine-wide ranks 0..3 (Ray replaced by immediate answers)."""
    from types import SimpleNamespace

    from weightsync.integrations.torchrl.llm import AsyncVLLMDriver, engine_driver
    from weightsync.integrations.vllm.driver import _world

    replicas = [_FakeReplica(2), _FakeReplica(2)]
    engine = type("AsyncVLLM", (), {})()
    engine.actors = replicas
    engine.engine_args = SimpleNamespace(tensor_parallel_size=2)
    driver = engine_driver(engine)
    assert isinstance(driver, AsyncVLLMDriver)
    driver._ray = SimpleNamespace(get=lambda refs, timeout=None: list(refs))
    assert driver.world_size == _world(driver) == 4
    out = driver.collective_rpc("weightsync_call", args=("connect", "/w", None, 5.0, 4))
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [r.calls[-1] for r in replicas] == [("connect", "/w", None, 5.0, 4, 0),
                                               ("connect", "/w", None, 5.0, 4, 2)]
    out = driver.collective_rpc("weightsync_call", args=("version",))
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [r.calls[-1] for r in replicas] == [("version",), ("version",)]
