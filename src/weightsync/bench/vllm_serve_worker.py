"""The server side of ``weightsync bench --transports vllm-serve``'s baselines: methods
mixed into the benchmarked ``vllm serve``'s workers (``--worker-extension-cls``) and called
through its dev ``/collective_rpc`` route. Each receives bytes from the bench process over
one bare TCP connection; ``bench_floor`` then reloads the tensors from memory, and
``bench_naive`` writes the checkpoint file to this host's disk and reloads it from there.
Both return the worker's seconds per phase. Nothing here imports vLLM."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from weightsync.transports.net.packed import PackedVersion, parse_header
from weightsync.transports.net.wire import recv_frame, recv_into_exact, split_address, tensor_view

_NAIVE_DIR = "/tmp/weightsync-bench-naive"
_warm: dict[int, torch.Tensor] = {}  # the floor receives into one warm buffer, as weightsync


def _receive(address: str, reuse: bool = False) -> tuple[dict[str, Any], torch.Tensor]:
    host, port = split_address(address)
    with socket.create_connection((host, port), timeout=600) as sock:
        header = recv_frame(sock)
        nbytes = int(header["nbytes"])
        buffer = _warm.get(nbytes) if reuse else None
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            if reuse:
                _warm[nbytes] = buffer
        recv_into_exact(sock, tensor_view(buffer))
        sock.sendall(b"k")
    return header, buffer


class BenchWorkerExtension:
    """``bench_floor(address)`` and ``bench_naive(address)``, called on every worker."""

    def _reload(self, pairs: Any) -> None:
        worker: Any = self
        worker.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)

    def bench_floor(self, address: str) -> dict[str, float]:
        """Receive the bf16 version's bytes into memory, then reload the engine from them."""
        t0 = time.perf_counter()
        header, buffer = _receive(address, reuse=True)
        version, _session, entries, _nbytes = parse_header(header, 1 << 42)
        t1 = time.perf_counter()
        self._reload(list(PackedVersion(version, entries, buffer).tensors().items()))
        return {"receive": t1 - t0, "reload": time.perf_counter() - t1}

    def bench_naive(self, address: str) -> dict[str, float]:
        """Receive a checkpoint file onto this host's disk, then reload the engine from it."""
        from safetensors.torch import load_file

        os.makedirs(_NAIVE_DIR, exist_ok=True)
        path = os.path.join(_NAIVE_DIR, "model.safetensors")
        t0 = time.perf_counter()
        _header, buffer = _receive(address)
        with open(path, "wb") as f:
            f.write(tensor_view(buffer))
            f.flush()
            os.fsync(f.fileno())
        del buffer
        t1 = time.perf_counter()
        self._reload(list(load_file(path).items()))
        os.unlink(path)
        return {"copy": t1 - t0, "reload": time.perf_counter() - t1}
