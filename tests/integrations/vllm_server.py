"""The ``vllm serve`` launcher the tests share (it lives in the package, where
``weightsync bench --transports vllm-serve`` uses it too), and greedy tokens of the tests'
prompts."""

from typing import Any

import vllm_model as vm

from weightsync.bench.vllm_server import SRC, VLLMServer, free_port  # noqa: F401


def greedy(server: Any, model: str | None = None,
           prompts: list[list[int]] = vm.PROMPTS) -> list[list[int]]:
    """The server's greedy continuation of the tests' prompts (from ``model``, a LoRA
    adapter's name; default: the base model)."""
    return server.greedy(prompts, vm.NEW_TOKENS, model)
