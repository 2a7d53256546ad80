"""Local Ray instances for the tests: what one leaves running (for the tests that check Ray
shuts down cleanly), and workers that import TorchRL without vLLM."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any
from unittest import mock

#: A process started with this set to "1" runs as if vLLM were not installed (a line in the
#: test environment's site-packages, written by scripts/env-vllm.sh).
WITHOUT_VLLM = "WEIGHTSYNC_TEST_WITHOUT_VLLM"


def workers_without_vllm() -> AbstractContextManager[Any]:
    """A Ray instance started inside (its raylet, and so every worker it starts and the
    processes those start) runs Python as if vLLM were not installed: TorchRL imports vLLM
    whenever it is installed, which costs each collector actor and each of its worker
    processes 6 s of CPU here (11 s to import TorchRL's collectors, 5 s without vLLM),
    for tests whose Ray workers never use vLLM."""
    return mock.patch.dict(os.environ, {WITHOUT_VLLM: "1"})


def ray_processes(session_dir: str) -> list[str]:
    """Live raylet/gcs processes of the Ray instance of ``session_dir`` (others may run
    beside it)."""
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True,
                         timeout=30).stdout
    return [line for line in out.splitlines()
            if ("raylet" in line or "gcs_server" in line) and session_dir in line
            and line.split()[1][:1] != "Z"]


def local_ray_instance(tests_dir: str) -> Iterator[str]:
    """The body of a module-scoped fixture: one local Ray instance whose workers import
    from ``tests_dir`` and the caller's PYTHONPATH; yields its GCS address, then shuts it
    down and checks that none of its processes is left."""
    import ray

    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False,
        _node_ip_address="127.0.0.1", namespace="weightsync-tests",
        object_store_memory=100 * 1024 * 1024,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
            [tests_dir, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])}},
    )
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    deadline = time.monotonic() + 20
    while ray_processes(session_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(session_dir), ray_processes(session_dir)
