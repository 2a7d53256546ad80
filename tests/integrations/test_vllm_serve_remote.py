"""The network path to a real ``vllm serve`` on another host: the server runs in a second
network namespace whose mount namespace has its own ``/dev/shm`` and ``/tmp`` (no file
system shared with the trainer); the trainer, in the first namespace, drives it with vLLM's
``HTTPVLLMWeightSyncClient`` and ``WeightSyncTrainerInitInfo(address=...)``."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vllm_model as vm
from vllm_engine import vllm_or_skip
from vllm_server import VLLMServer

from weightsync.bench.multihost import ADDRESS_A, ADDRESS_B, TwoHostCluster, two_host_network

pytestmark = [pytest.mark.vllm, pytest.mark.multihost, pytest.mark.timeout(900)]


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network and mount namespaces"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    return None


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHostCluster]:
    vllm_or_skip()
    pytest.importorskip("zstandard")
    reason = _unavailable()
    if reason is not None:
        pytest.skip(f"two hosts unavailable: {reason}")
    with two_host_network() as made:
        made.enter("a")  # the trainer (this process) lives on host A
        yield made


@pytest.fixture(scope="module")
def server(hosts: TwoHostCluster) -> Iterator[VLLMServer]:
    """``vllm serve`` on host B (it boots from its own copy of the tiny Llama)."""
    work = Path(tempfile.mkdtemp(prefix="ws-vllm-remote-", dir="/var/tmp"))
    served = VLLMServer(vm.save_model(vm.build_model(), work / "model"), host=ADDRESS_B,
                        port=8000, netns=hosts.ns_b)
    try:
        served.start().wait_ready()
        yield served
    finally:
        served.stop()
        shutil.rmtree(work, ignore_errors=True)


def _engine(trainer, server: VLLMServer, **info):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, address=f"{ADDRESS_A}:0", dtype="bfloat16", **info),
        client=HTTPVLLMWeightSyncClient(server.url, timeout=120), source=ModuleSource(trainer),
    )


def _bf16_greedy(trainer) -> list[list[int]]:
    return vm.transformers_greedy(vm.rounded_copy(trainer, torch.bfloat16))


def test_versions_reach_a_server_on_another_host(server: VLLMServer):
    trainer = vm.build_model()
    engine = _engine(trainer, server)
    try:
        nbytes = engine.stats()["last"]["wire_bytes"]
        assert nbytes > 2 * sum(p.numel() for p in trainer.parameters())  # bf16, whole
        for step in (1, 2, 3):
            vm.perturb(trainer, step)
            engine.send_weights()
            last = engine.stats()["last"]
            assert last["version"] == step and last["delta_chunks"] == 0
            assert last["wire_bytes"] == nbytes
            assert server.weight_version() == str(step)
            assert server.greedy() == _bf16_greedy(trainer)
    finally:
        engine.shutdown()


def test_deltas_after_small_adamw_steps_are_a_fraction_of_the_bytes(server: VLLMServer):
    trainer = vm.build_model()
    engine = _engine(trainer, server, delta=True)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    try:
        whole = engine.stats()["last"]["wire_bytes"]  # a new session: the server gets it whole
        assert engine.stats()["last"]["delta_chunks"] == 0
        for step in (1, 2):
            optimizer.zero_grad()
            ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(step))
            trainer(ids, labels=ids).loss.backward()
            optimizer.step()
            engine.send_weights()
            last = engine.stats()["last"]
            print(f"delta step {step}: {last['wire_bytes']} bytes on the wire of {whole} whole")
            assert last["delta_chunks"] == last["chunks"] > 0
            assert last["wire_bytes"] < 0.3 * whole
            assert server.greedy() == _bf16_greedy(trainer)
    finally:
        engine.shutdown()
