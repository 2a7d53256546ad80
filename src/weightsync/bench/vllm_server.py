"""A real ``vllm serve`` (CPU build) for the tests and ``weightsync bench``: started as a
subprocess in its own process group (optionally inside another network namespace with private ``/dev/shm`` and
``/tmp``), waited for within a deadline, queried for greedy tokens over ``/v1/completions``,
and always stopped, with its whole process group."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from weightsync.core.liveness import process_stat

#: the ``src`` directory this weightsync is imported from: the server imports the same one
SRC = str(Path(__file__).resolve().parents[2])
START_TIMEOUT = 240.0
#: offline, a small KV cache, no telemetry
SERVE_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_args(model_dir: str, host: str, port: int, *extra: str) -> list[str]:
    """``vllm serve`` for a small model: CPU, eager, no prefix caching (a cached prefix
    would survive a weight update), weightsync as the weight-transfer backend. Run as the
    API server module: the ``vllm`` command of the CPU build looks up the version of a
    distribution named ``vllm`` (it is ``vllm-cpu``) and fails before serving."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--host", host, "--port", str(port),
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
        "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0", "--block-size", "32",
        "--no-enable-prefix-caching", "--weight-transfer-config", '{"backend": "weightsync"}',
        *extra,
    ]


class VLLMServer:
    """One ``vllm serve`` process; ``url`` is its base URL."""

    def __init__(self, model_dir: str, *, host: str = "127.0.0.1", port: int | None = None,
                 netns: str | None = None, extra: tuple[str, ...] = (),
                 log_path: str | None = None, env: dict[str, str] | None = None) -> None:
        self.model_dir = model_dir
        self.host = host
        self.port = port or free_port()
        self.netns = netns
        self.extra = extra
        self.env = env or {}
        self.log_path = log_path or f"/var/tmp/ws-vllm-serve-{os.getpid()}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _command(self) -> list[str]:
        args = serve_args(self.model_dir, self.host, self.port, *self.extra)
        if self.netns is None:
            return args
        # another host: its own network namespace, and its own /dev/shm and /tmp (tmpfs in
        # a private mount namespace), so it shares no file system with the trainer's side
        script = ("mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /tmp && "
                  f"exec {shlex.join(args)}")
        return ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation",
                "private", "sh", "-c", script]

    def start(self) -> VLLMServer:
        env = os.environ | SERVE_ENV | self.env | {
            "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
        }
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self._command(), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        import requests

        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready within {timeout:.0f}s:\n{self.log()}")

    def log(self, tail: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-tail:]
        except OSError:
            return ""

    def greedy(self, prompts: list[list[int]], new_tokens: int,
               model: str | None = None) -> list[list[int]]:
        """The server's greedy continuation of each prompt (token ids), from ``model`` (a
        LoRA adapter's name; default: the base model)."""
        import requests

        out = []
        for prompt in prompts:
            reply = requests.post(f"{self.url}/v1/completions", timeout=60, json={
                "model": model or self.model_dir, "prompt": prompt, "max_tokens": new_tokens,
                "temperature": 0.0, "return_token_ids": True,
            })
            reply.raise_for_status()
            out.append(list(reply.json()["choices"][0]["token_ids"]))
        return out

    def post(self, route: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        import requests

        reply = requests.post(f"{self.url}/{route}", json=body, timeout=timeout)
        reply.raise_for_status()
        return reply.json()

    def is_paused(self) -> bool:
        """Whether the server's generation is paused (vLLM's ``/is_paused``)."""
        import requests

        reply = requests.get(f"{self.url}/is_paused", timeout=10)
        reply.raise_for_status()
        return bool(reply.json()["is_paused"])

    def weight_version(self) -> str | None:
        import requests

        reply = requests.get(f"{self.url}/weight_info", timeout=10)
        reply.raise_for_status()
        return json.loads(reply.text)["weight_version"]

    def worker_cores(self) -> frozenset[int]:
        """The CPUs the server's engine workers are bound to (vLLM's CPU build binds each
        to its OpenMP cores; empty when none is bound)."""
        if self.proc is None:
            return frozenset()
        from weightsync.integrations.vllm.spare_cores import bound_cores

        return bound_cores(_group(self.proc.pid), frozenset(os.sched_getaffinity(self.proc.pid)))

    def thread_cores(self) -> set[frozenset[int]]:
        """The CPU sets the threads of the server's processes may run on."""
        found: set[frozenset[int]] = set()
        for pid in _group(self.proc.pid) if self.proc is not None else []:
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        found.add(frozenset(os.sched_getaffinity(int(tid))))
        return found

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's whole process group (its engine core and workers)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and every process of its group (never leaves one behind), and
        remove its log."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.2)
            if not _group_alive(self.proc.pid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc = None
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = process_stat(int(entry))
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` is alive and not a zombie."""
    return bool(_group(pgid))
