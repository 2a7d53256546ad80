"""LoRA adapters on a real ``vllm serve --enable-lora`` on another host: the server runs in
a second network namespace with its own ``/dev/shm`` and ``/tmp`` (no file system shared
with the trainer); the trainer, in the first namespace, sends only the peft model's adapter
over the network path (``WeightSyncTrainerInitInfo(address=..., adapter="policy")``), and
clients asking for ``model="policy"`` get each new version."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import vllm_model as vm
from vllm_lora_serve import (
    LORA_SERVE_ARGS,
    LORA_SERVE_ENV,
    PROMPTS,
    adapter_engine,
    check_versions,
    merged_greedy,
)
from vllm_server import VLLMServer, serve_on_host_b, two_hosts

from weightsync.bench.multihost import ADDRESS_A, ADDRESS_B, TwoHostCluster

pytestmark = [pytest.mark.vllm, pytest.mark.multihost, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHostCluster]:
    yield from two_hosts("peft")


@pytest.fixture(scope="module")
def server(hosts: TwoHostCluster) -> Iterator[VLLMServer]:
    """``vllm serve --enable-lora`` on host B (it boots from its own copy of the tiny Llama)."""
    yield from serve_on_host_b(hosts, "ws-vllm-lora-remote-", extra=LORA_SERVE_ARGS,
                               env=LORA_SERVE_ENV)


def test_adapter_versions_reach_a_server_on_another_host(server: VLLMServer):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    model = vm.peft_model()
    engine = adapter_engine(model, HTTPVLLMWeightSyncClient(server.url, timeout=120),
                            address=f"{ADDRESS_A}:0", dtype="bfloat16", delta=True)
    try:
        adapter_bf16 = sum(2 * p.numel() for n, p in model.named_parameters() if ".lora_" in n)
        whole = engine.stats()["last"]["wire_bytes"]
        assert adapter_bf16 <= whole < adapter_bf16 + 64 * 1024  # the adapter alone travels
        check_versions(server, engine, model, [1, 2, 3], torch.bfloat16)
        for version in engine.stats()["versions"]:
            assert version["failed"] == {} and version["wire_bytes"] < whole + 64 * 1024
            print(f"adapter version {version['version']} ({version['call']}): "
                  f"{version['wire_bytes']} bytes on the wire, {version['seconds']:.3f} s")
        # the versions live on the server's host only: nothing shared with the trainer's
        assert not os.path.exists(engine._adapter_dirs[0])
    finally:
        engine.shutdown()


def test_tensor_parallel_2_stages_each_adapter_version_once(hosts: TwoHostCluster,
                                                            server: VLLMServer):
    """``--tensor-parallel-size 2``: the host's rank 0 fetches and stages each version once;
    vLLM's LoRA loader reads it on both ranks, and the stable name answers exactly."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    tp = VLLMServer(server.model_dir, host=ADDRESS_B, port=8002, netns=hosts.ns_b,
                    extra=(*LORA_SERVE_ARGS, "--tensor-parallel-size", "2"),
                    env={**LORA_SERVE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        tp.start().wait_ready()
        model = vm.peft_model()
        engine = adapter_engine(model, HTTPVLLMWeightSyncClient(tp.url, timeout=120),
                                address=f"{ADDRESS_A}:0", dtype="bfloat16")
        try:
            check_versions(tp, engine, model, [1, 2], torch.bfloat16)
            assert all(len(v["hosts"]) == 1 for v in engine.stats()["versions"])  # once a host
        finally:
            engine.shutdown()
    finally:
        tp.stop()


def test_a_trainer_killed_mid_version_leaves_the_name_on_its_last_version(
        hosts: TwoHostCluster, server: VLLMServer):
    import signal
    import subprocess
    import sys

    from vllm_server import SRC, greedy

    env = os.environ | vm.ENGINE_ENV | {
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), SRC])}
    script = os.path.join(os.path.dirname(__file__), "vllm_remote_lora_trainer.py")
    done = subprocess.run(["ip", "netns", "exec", hosts.ns_a, sys.executable, script, server.url,
                           f"{ADDRESS_A}:0"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:] + server.log(20000)
    said, label = done.stdout.split()
    assert said == "sent"
    expected = vm.peft_model()
    vm.set_adapter(expected, 1)
    assert server.weight_version() == label  # version 2 never finished
    assert greedy(server, "policy", PROMPTS) == merged_greedy(expected, None)
