"""The ``vllm serve`` launcher the tests share (it lives in the package, where
``weightsync bench --transports vllm-serve`` uses it too), and greedy tokens of the tests'
prompts, and the two-host fixtures' bodies of the tests that serve on another host."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_model as vm
from vllm_engine import vllm_or_skip

from weightsync.bench.multihost import ADDRESS_B, TwoHostCluster, two_host_network
from weightsync.bench.vllm_server import SRC, VLLMServer, free_port  # noqa: F401


def greedy(server: Any, model: str | None = None,
           prompts: list[list[int]] = vm.PROMPTS) -> list[list[int]]:
    """The server's greedy continuation of the tests' prompts (from ``model``, a LoRA
    adapter's name; default: the base model)."""
    return server.greedy(prompts, vm.NEW_TOKENS, model)


def two_hosts(*modules: str) -> Iterator[TwoHostCluster]:
    """Two network namespaces joined by a veth pair, this process on host A (a module
    fixture's body); skips where they cannot be made here or ``modules`` are missing."""
    vllm_or_skip()
    for module in ("zstandard", *modules):
        pytest.importorskip(module)
    if os.geteuid() != 0:
        pytest.skip("two hosts unavailable: needs root to create network and mount namespaces")
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"two hosts unavailable: needs the {tool} command")
    with two_host_network() as made:
        made.enter("a")  # the trainer (this process) lives on host A
        yield made


def serve_tiny_llama(prefix: str, **options: Any) -> Iterator[VLLMServer]:
    """``vllm serve`` from its own copy of the tiny Llama, stopped and removed after (a
    module fixture's body); ``options`` go to :class:`VLLMServer` (host, port, netns...)."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    served = VLLMServer(vm.save_model(vm.build_model(), work / "model"), **options)
    try:
        served.start().wait_ready()
        yield served
    finally:
        served.stop()
        shutil.rmtree(work, ignore_errors=True)


def serve_on_host_b(hosts: TwoHostCluster, prefix: str, **options: Any) -> Iterator[VLLMServer]:
    """:func:`serve_tiny_llama` on host B of ``hosts``."""
    yield from serve_tiny_llama(prefix, host=ADDRESS_B, port=8000, netns=hosts.ns_b, **options)
