"""weightsync as a vLLM weight-transfer backend, on a real vLLM engine (CPU build): selected
with ``WeightTransferConfig(backend="weightsync")`` (the ``vllm.general_plugins`` entry point
registers it in every vLLM process) and driven with vLLM's own calls."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import vllm_model as vm
from slot_damage import KINDS, damage_slot

import weightsync as ws
from weightsync.transports.directory.manifest import read_manifest, slot_path

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _rounded_copy(model, dtype: torch.dtype):
    copy = vm.build_model()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    return copy


def test_the_plugin_registers_the_backend_in_this_process():
    pytest.importorskip("vllm", reason="vLLM is not installed; bash scripts/env.sh installs it")
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from weightsync.integrations.vllm.backend import WeightSyncWeightTransferEngine

    assert WeightTransferEngineFactory._registry["weightsync"]() is WeightSyncWeightTransferEngine


def test_vllm_calls_load_the_named_version(served, directory: Path):
    """The engine was started with backend="weightsync": its worker process loaded the plugin
    (vLLM refuses an unregistered backend name at start-up)."""
    llm, trainer = served.llm, vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        llm.init_weight_transfer_engine({"init_info": {"directory": str(directory)}})
        for step in (1, 2):
            vm.perturb(trainer, step)
            version = sender.update_weights()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version}})
            llm.finish_weight_update(weight_version=str(version))
            llm.reset_prefix_cache()
            assert vm.vllm_greedy(llm) == vm.transformers_greedy(trainer)
            assert llm.get_weight_version() == str(version)
        for step in (3, 4, 5):  # the engine's slot (version 2) is kept; version 3's is rewritten
            vm.perturb(trainer, step)
            sender.update_weights()
        llm.start_weight_update()
        with pytest.raises(Exception, match="version 3 is not in any slot"):
            llm.update_weights({"update_info": {"version": 3}})  # vLLM ends the update
        llm.start_weight_update()
        llm.update_weights({"update_info": {}})  # no version named: the newest committed
        llm.finish_weight_update(weight_version="5")
        llm.reset_prefix_cache()
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(trainer)


@pytest.mark.parametrize("kind", KINDS)
def test_swapped_or_compensating_bytes_never_reach_the_engine(served, directory: Path, kind):
    """A committed slot damaged in a way a sum of 64-bit words misses (pages or rows
    swapped, a +x/-x pair, two top bits flipped): the engine refuses it and keeps serving
    the version it holds."""
    llm, trainer = served.llm, vm.build_model()
    held = vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        llm.init_weight_transfer_engine({"init_info": {"directory": str(directory)}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": 0}})
        llm.finish_weight_update(weight_version="0")
        vm.perturb(trainer, 1)
        version = sender.update_weights()
        manifest = read_manifest(directory)
        assert manifest is not None
        damage_slot(slot_path(directory, manifest.latest.slot), kind)
        llm.start_weight_update()
        with pytest.raises(Exception, match="checksum mismatch"):
            llm.update_weights({"update_info": {"version": version}})  # vLLM ends the update
        llm.reset_prefix_cache()
        assert llm.get_weight_version() == "0"
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(held)


def test_trainer_engine_drives_a_whole_update_with_bfloat16_slots(served, directory: Path):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weightsync.integrations.vllm.backend import OfflineLLMClient, WeightSyncTrainerInitInfo

    llm, trainer = served.llm, vm.build_model()
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, directory=str(directory), dtype="bfloat16"),
        client=OfflineLLMClient(llm), source=ModuleSource(trainer),
    )
    try:
        assert engine.version == 0
        for step in (1, 2):
            vm.perturb(trainer, step)
            label = engine.send_weights()
            assert engine.version == step
            assert llm.get_weight_version() == label
            assert vm.vllm_greedy(llm) == vm.transformers_greedy(_rounded_copy(trainer, torch.bfloat16))
    finally:
        engine.shutdown()


def test_a_second_trainer_engine_ends_the_first_ones_session(served, directory: Path):
    """Two trainer engines on one real engine: B's init takes the server over, A's next
    update is refused (TrainerSessionEndedError naming both sessions, through vLLM's own
    calls) and the engine keeps serving B's version under B's label."""
    import shutil

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm_engine import shm_dir

    from weightsync.core.errors import TrainerSessionEndedError
    from weightsync.integrations.vllm.backend import OfflineLLMClient, WeightSyncTrainerInitInfo

    llm, a_model, b_model = served.llm, vm.build_model(), vm.build_model(seed=1)
    other = shm_dir("ws-vllm-b-")
    engines = []
    try:
        for where, model in ((directory, a_model), (other, b_model)):
            engines.append(WeightTransferTrainerFactory.trainer_init(
                WeightSyncTrainerInitInfo(rank=0, directory=str(where)),
                client=OfflineLLMClient(llm), source=ModuleSource(model)))
        a, b = engines
        for step in (1, 2):
            vm.perturb(b_model, step)
            label = b.send_weights()
        vm.perturb(a_model, 1)
        with pytest.raises(TrainerSessionEndedError) as raised:
            a.send_weights()  # A's version 1: another trainer's server now
        for named in (f"trainer session {a.session}", f"trainer session {b.session}"):
            assert named in str(raised.value), raised.value
        assert llm.get_weight_version() == label
        assert vm.vllm_greedy(llm) == vm.transformers_greedy(b_model)
    finally:
        for engine in engines:
            engine.shutdown()
        shutil.rmtree(other, ignore_errors=True)


def test_bad_directories_fail_init_clearly(served, directory: Path):
    llm = served.llm
    started = time.monotonic()
    with pytest.raises(Exception, match="no committed weights"):
        llm.init_weight_transfer_engine({"init_info": {"directory": str(directory), "timeout": 2.0}})
    assert time.monotonic() - started < 60
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1)
    with scheme.create_sender() as sender:
        sender.register_model(vm.build_model(num_key_value_heads=4))
        sender.update_weights()
        with pytest.raises(Exception, match="layout mismatch: 'model.layers.0.self_attn.k_proj"):
            llm.init_weight_transfer_engine({"init_info": {"directory": str(directory)}})
