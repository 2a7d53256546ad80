"""The ``vllm serve`` launcher the tests share (it lives in the package, where
``weightsync bench --transports vllm-serve`` uses it too), and greedy tokens of the tests'
prompts."""

from typing import Any

import vllm_model as vm

from weightsync.bench.vllm_server import SRC, VLLMServer, free_port  # noqa: F401


def greedy(server: Any) -> list[list[int]]:
    """The server's greedy continuation of the tests' prompts."""
    return server.greedy(vm.PROMPTS, vm.NEW_TOKENS)
