"""The worker extension on a real vLLM engine (CPU build): the recipe as documented, run as
written. After every update, vLLM's greedy tokens must equal the trainer's transformers
greedy tokens, in float32 and with bfloat16 slots."""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from pathlib import Path

import pytest
import torch
import vllm_model as vm

import weightsync as ws
from weightsync.integrations.vllm import connect_engine, engine_versions, update_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LONG_PROMPT = [(7 * i + 3) % 500 + 1 for i in range(72)]  # 2 full 32-token blocks: cacheable


def rounded(model, dtype: torch.dtype):
    """``model`` with every weight rounded through ``dtype`` and back (what bf16 slots hold)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return model


def test_engine_serves_the_model_like_transformers(served, directory: Path):
    """The baseline every comparison rests on (whatever earlier tests loaded)."""
    model = vm.build_model()
    with ws.VLLMDoubleBufferSyncScheme(directory).create_sender() as sender:
        sender.register_model(model)
        sender.update_weights()
        assert connect_engine(served.llm, str(directory)) == 0
    expected = vm.transformers_greedy(model)
    assert vm.vllm_greedy(served.llm) == expected
    assert all(len(set(tokens)) > 3 for tokens in expected), "a degenerate generation proves little"


def test_recipe_float32_updates_match_the_trainer(served, directory: Path):
    llm, trainer = served.llm, vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        assert sender.update_weights() == 0
        assert llm.collective_rpc("weightsync_connect", args=(str(directory),)) == [0]
        before = vm.vllm_greedy(llm)
        for step in (1, 2):
            vm.perturb(trainer, step)
            assert sender.update_weights() == step
            assert llm.collective_rpc("weightsync_update") == [step]
            assert llm.collective_rpc("weightsync_version") == [step]
            llm.reset_prefix_cache()
            assert vm.vllm_greedy(llm) == vm.transformers_greedy(trainer)
        assert vm.vllm_greedy(llm) != before, "the updates must change what the engine generates"
        assert llm.collective_rpc("weightsync_update") == [None]  # nothing new


def test_bfloat16_slots_match_the_trainer_rounded_to_bfloat16(served, directory: Path):
    llm, trainer = served.llm, vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, dtype=torch.bfloat16)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        assert connect_engine(llm, str(directory)) == 0
        for step in (1, 2):
            vm.perturb(trainer, step)
            sender.update_weights()
            assert update_engine(llm) == step
            # the engine computes in float32 from bf16 values: the same as the trainer
            # computing with its weights rounded to bf16
            expected = vm.transformers_greedy(rounded(_copy_of(trainer), torch.bfloat16))
            assert vm.vllm_greedy(llm) == expected
        assert update_engine(llm) is None


def _copy_of(model):
    copy = vm.build_model()
    copy.load_state_dict(model.state_dict())
    return copy


def _trainer_process(directory: str, steps: int, out, done) -> None:
    """A trainer in its own process: the same model, perturbed and committed ``steps`` times."""
    model = vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.update_weights()
    for step in range(1, steps + 1):
        vm.perturb(model, step)
        sender.update_weights()
    out.put(sender.version)
    done.get(timeout=120)  # stay alive (a live sender) until the engine has read
    sender.close()


def test_trainer_in_another_process(served, directory: Path):
    llm = served.llm
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_trainer_process, args=(str(directory), 3, out, done), daemon=True)
    proc.start()
    try:
        assert out.get(timeout=120) == 3
        assert connect_engine(llm, str(directory)) == 3  # joins at the newest committed version
        expected = vm.build_model()
        for step in (1, 2, 3):
            vm.perturb(expected, step)
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(expected)
        assert engine_versions(llm) == [3]
        assert llm.get_weight_version() == "3"
        done.put("done")
        proc.join(60)
        assert proc.exitcode == 0
        # the trainer is gone: nothing new, the engine keeps serving version 3
        assert update_engine(llm) is None
        with pytest.raises(Exception, match="no live sender"):
            llm.collective_rpc("weightsync_update")
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(expected)
    finally:
        done.put("done")
        out.close()
        done.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def test_update_engine_resets_the_prefix_cache_and_labels_samples(served, directory: Path):
    from vllm import SamplingParams

    llm, trainer = served.llm, vm.build_model()
    params = SamplingParams(temperature=0.0, max_tokens=vm.NEW_TOKENS, detokenize=False)
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        connect_engine(llm, str(directory))
        prompt = {"prompt_token_ids": LONG_PROMPT}
        llm.generate([prompt], params, use_tqdm=False)
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        assert again.num_cached_tokens >= 32, "the prompt's blocks must be in the prefix cache"
        vm.perturb(trainer, 1)
        version = sender.update_weights()
        assert update_engine(llm) == version
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert not out.num_cached_tokens, "blocks computed with the old weights were reused"
        assert list(out.outputs[0].token_ids) == vm.transformers_greedy(trainer, [LONG_PROMPT])[0]
        assert llm.get_weight_version() == str(version)
        assert [(s.version, s.start, s.end) for s in out.outputs[0].weight_versions] == [
            (str(version), 0, vm.NEW_TOKENS)]


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_requests_in_flight_never_mix_two_versions(served, directory: Path, mode: str):
    """A request running when the update starts finishes on the old weights ("wait") or is
    aborted ("abort"); it never continues on the new ones."""
    from vllm import SamplingParams

    llm, trainer = served.llm, vm.build_model()
    engine = llm.llm_engine
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        old = connect_engine(llm, str(directory))
        old_tokens = vm.transformers_greedy(trainer, [vm.PROMPTS[0]], new_tokens=60)[0]
        request_id = f"inflight-{uuid.uuid4().hex}"
        engine.add_request(request_id, {"prompt_token_ids": vm.PROMPTS[0]},
                           SamplingParams(temperature=0.0, max_tokens=60, detokenize=False))
        vm.perturb(trainer, 1)
        new = sender.update_weights()
        assert update_engine(llm, mode=mode) == new
        finished = None
        deadline = time.monotonic() + 120
        while finished is None and time.monotonic() < deadline:
            for output in engine.step():
                if output.request_id == request_id and output.finished:
                    finished = output
        assert finished is not None, "the in-flight request never finished"
        completion = finished.outputs[0]
        if mode == "wait":
            assert list(completion.token_ids) == old_tokens
            assert {s.version for s in completion.weight_versions} == {str(old)}
        else:
            assert completion.finish_reason == "abort"
            assert list(completion.token_ids) == old_tokens[: len(completion.token_ids)]
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(trainer)


def test_update_to_a_named_version_and_to_one_that_is_gone(served, directory: Path):
    llm, trainer = served.llm, vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        connect_engine(llm, str(directory))
        snapshots = {}
        for step in (1, 2, 3):
            vm.perturb(trainer, step)
            snapshots[sender.update_weights()] = _copy_of(trainer)
        # two slots: versions 2 and 3 are held; version 1 was overwritten
        with pytest.raises(ws.WeightSyncError, match="version 1 is not in any slot"):
            update_engine(llm, version=1)
        assert engine_versions(llm) == [0]
        assert update_engine(llm, version=2) == 2
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(snapshots[2])
        assert update_engine(llm) == 3
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(snapshots[3])


def test_a_model_of_another_layout_is_refused_at_connect(served, directory: Path):
    llm = served.llm
    held = engine_versions(llm)
    before = vm.vllm_greedy(llm)
    other = vm.build_model(intermediate_size=384)
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(other)
        sender.update_weights()
        with pytest.raises(ws.SchemaMismatchError, match="mlp") as info:
            connect_engine(llm, str(directory))
        assert info.value.key is not None and "mlp" in info.value.key
        with pytest.raises(Exception, match="layout mismatch: 'model.layers.0.mlp"):  # raw recipe
            llm.collective_rpc("weightsync_connect", args=(str(directory),))
    assert vm.vllm_greedy(llm) == before, "a refused version must not touch the engine"
    assert engine_versions(llm) == held, "the engine stays connected where it was"


def test_a_directory_with_nothing_committed_times_out_clearly(served, directory: Path):
    started = time.monotonic()
    with pytest.raises(ws.WeightSyncTimeoutError, match="no committed weights"):
        connect_engine(served.llm, str(directory), timeout=2.0)
    assert time.monotonic() - started < 60
