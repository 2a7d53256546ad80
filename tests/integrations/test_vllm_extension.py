"""The vLLM worker extension, driven the way vLLM drives it: mixed into a worker class and
called by name through ``collective_rpc``. vLLM itself (a CUDA-only wheel) does not run
here; the engine stand-in below has vLLM's ``load_weights(iterable of (name, tensor))``
contract, backed by a real transformers model."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

import weightsync as ws
from weightsync.integrations.vllm import WeightSyncWorkerExtension

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


class EngineModel(torch.nn.Module):
    """A served model with vLLM's loading contract: ``load_weights`` consumes (name, tensor)
    pairs, fusing q/k/v into one parameter as vLLM's Llama does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        attn = self.hf.model.layers[0].self_attn
        self.qkv = torch.nn.Parameter(torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                 attn.v_proj.weight]).detach().clone())
        self.loaded: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.hf.named_parameters())
        q, k, _ = (self.hf.model.layers[0].self_attn.q_proj.weight.shape[0],
                   self.hf.model.layers[0].self_attn.k_proj.weight.shape[0], None)
        with torch.no_grad():
            for name, tensor in weights:
                self.loaded.append(name)
                if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                    start = {"q": 0, "k": q, "v": q + k}[name.split(".")[-2][0]]
                    self.qkv[start : start + tensor.shape[0]].copy_(tensor)
                if name in params:
                    params[name].copy_(tensor)
        return set(self.loaded)


class FakeModelRunner:
    def __init__(self) -> None:
        self.model = EngineModel()


class Worker(WeightSyncWorkerExtension):
    """What vLLM builds from ``worker_extension_cls``: its worker class plus our methods."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.model_runner = FakeModelRunner()


def collective_rpc(workers: list[Worker], method: str, args: tuple = ()) -> list:
    return [getattr(w, method)(*args) for w in workers]


def test_extension_streams_weights_into_load_weights():
    directory = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=2, dtype=torch.bfloat16)
    torch.manual_seed(0)
    trainer = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    engines = [Worker(rank=0), Worker(rank=1)]
    try:
        with scheme.create_sender() as sender:
            sender.register_model(trainer)
            sender.update_weights()
            assert collective_rpc(engines, "weightsync_connect", (str(directory), None, 10.0, 2)) == [0, 0]
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(0.5)
            sender.update_weights()
            assert collective_rpc(engines, "weightsync_update") == [1, 1]
            assert collective_rpc(engines, "weightsync_update") == [None, None]
            assert collective_rpc(engines, "weightsync_version") == [1, 1]
        for engine in engines:
            served = engine.model_runner.model
            attn = trainer.model.layers[0].self_attn
            expected_qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            assert torch.equal(served.qkv, expected_qkv.bfloat16().float())
            for name, p in trainer.named_parameters():
                assert torch.equal(dict(served.hf.named_parameters())[name], p.bfloat16().float())
    finally:
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()


def test_update_before_connect_is_refused():
    with pytest.raises(RuntimeError, match="weightsync_connect"):
        Worker(rank=0).weightsync_update()
