"""Tensor parallelism on a real vLLM engine (CPU build, ``tensor_parallel_size=2``, one core
per rank): one update loads one named version on every rank, and no rank is left on
another version, also when ranks polling on their own had drifted apart."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_model as vm
from vllm_engine import descendants, shutdown_engine

import weightsync as ws
from weightsync.integrations.vllm import connect_engine, engine_versions, update_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tp_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vLLM is not installed; bash scripts/env.sh installs it")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor_parallel_size=2 on the CPU build needs 2 cores (one per rank)")
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    os.environ.update(vm.ENGINE_ENV)
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one NUMA node here: bind by hand
    model_dir = vm.save_model(vm.build_model(), tmp_path_factory.mktemp("tp") / "model")
    existing = descendants()
    try:
        llm = LLM(**vm.engine_kwargs(model_dir, tensor_parallel_size=2,
                                     weight_transfer_config=WeightTransferConfig(backend="weightsync")))
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    procs = descendants() - existing
    try:
        yield llm
    finally:
        shutdown_engine(llm, procs)


def test_one_update_loads_one_version_on_both_ranks(tp_llm, directory: Path):
    trainer = vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        assert connect_engine(tp_llm, str(directory)) == 0
        assert engine_versions(tp_llm) == [0, 0]
        for step in (1, 2):
            vm.perturb(trainer, step)
            sender.update_weights()
            assert update_engine(tp_llm) == step
            assert engine_versions(tp_llm) == [step, step]
            assert vm.vllm_greedy(tp_llm) == vm.transformers_greedy(trainer)
        assert update_engine(tp_llm) is None


def test_ranks_that_drifted_apart_are_brought_to_one_version(tp_llm, directory: Path):
    trainer = vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        connect_engine(tp_llm, str(directory))
        # a version committed for rank 0 only: ranks polling on their own now disagree,
        # which is what one update per engine must never leave behind
        vm.perturb(trainer, 1)
        sender.send_async(worker_ids=[0])
        assert tp_llm.collective_rpc("weightsync_update") == [1, None]
        assert engine_versions(tp_llm) == [1, 0]
        # a named version no rank can load: the update fails, naming the rank, and the
        # ranks end on one common version (the newest committed) rather than mixed
        with pytest.raises(ws.WeightSyncError, match=r"vLLM worker \d: .*version 7 is not in any slot"):
            update_engine(tp_llm, version=7)
        assert engine_versions(tp_llm) == [1, 1]
        assert vm.vllm_greedy(tp_llm) == vm.transformers_greedy(trainer)
        vm.perturb(trainer, 2)
        sender.update_weights()
        started = time.monotonic()
        assert update_engine(tp_llm) == 2
        assert time.monotonic() - started < 120
        assert engine_versions(tp_llm) == [2, 2]
        assert vm.vllm_greedy(tp_llm) == vm.transformers_greedy(trainer)


def test_backend_loads_the_named_version_on_both_ranks(tp_llm, directory: Path):
    trainer = vm.build_model()
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2)
    with scheme.create_sender() as sender:
        sender.register_model(trainer)
        sender.update_weights()
        tp_llm.init_weight_transfer_engine({"init_info": {"directory": str(directory), "num_workers": 2}})
        vm.perturb(trainer, 1)
        version = sender.update_weights()
        tp_llm.start_weight_update()
        tp_llm.update_weights({"update_info": {"version": version}})
        tp_llm.finish_weight_update(weight_version=str(version))
        tp_llm.reset_prefix_cache()
        assert tp_llm.get_weight_version() == str(version)
        assert vm.vllm_greedy(tp_llm) == vm.transformers_greedy(trainer)
