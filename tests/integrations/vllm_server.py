"""The ``vllm serve`` launcher the tests share (it lives in the package, where
``weightsync bench --transports vllm-serve`` uses it too), and greedy tokens of the tests'
prompts, and the two-host fixtures' bodies of the tests that serve on another host."""

import contextlib
import json
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


@contextlib.contextmanager
def weightsync_info_logs() -> Iterator[dict[str, str]]:
    """The environment of a ``vllm serve`` whose log also holds weightsync's INFO lines (vLLM
    logs its own at WARNING, as in the tests' other servers). The logging config lives in
    /var/tmp, which a server on another host (private /tmp) still sees."""
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(process)d %(name)s %(levelname)s "
                                           "%(message)s"}},
        "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain",
                             "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["out"], "level": "WARNING", "propagate": False},
                    "weightsync": {"handlers": ["out"], "level": "INFO", "propagate": False}},
    }
    fd, path = tempfile.mkstemp(prefix="ws-vllm-logging-", suffix=".json", dir="/var/tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    try:
        yield {"VLLM_LOGGING_CONFIG_PATH": path}
    finally:
        os.unlink(path)


def log_since(server: Any, offset: int) -> str:
    """What ``server`` logged after the first ``offset`` bytes of its log."""
    with open(server.log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
