"""A rank of a 2-rank FSDP2 trainer (``fully_shard`` per layer and at the root, on a CPU
gloo mesh) driving a remote ``vllm serve`` through the network path with
``trainer_ranks=2``: each rank serves only its own shards. Spawned by the tests (this module
is imported in the child). Every rank applies the same seeded perturbation to its shards
(no collective in weightsync; the perturbation itself is computed from a full reference
copy every rank holds), then a small step (a few rows); rank 0 reports, after each update,
the server's greedy tokens and the reference's, cast to bf16."""

from __future__ import annotations

from typing import Any

import torch
import vllm_model as vm


def _copy_shards(model: Any, reference: Any) -> None:
    """Each FSDP2 parameter's local shard := its rows of the reference's full tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements)
            region = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
            param.to_local().copy_(full[name][region])


def _server_greedy(url: str, model_dir: str) -> list[list[int]]:
    import requests

    out = []
    for prompt in vm.PROMPTS:
        reply = requests.post(f"{url}/v1/completions", timeout=60, json={
            "model": model_dir, "prompt": prompt, "max_tokens": vm.NEW_TOKENS,
            "temperature": 0.0, "return_token_ids": True})
        reply.raise_for_status()
        out.append(list(reply.json()["choices"][0]["token_ids"]))
    return out


def fsdp_rank(rank: int, world: int, port: int, url: str, model_dir: str, address: str,
              rank_key: str, steps: int, ranks_address: str = "") -> list[dict[str, Any]]:
    from rank_harness import init_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    init_gloo(rank, world, port)
    reference = vm.build_model()
    model = vm.build_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=rank, trainer_ranks=world, rank_key=rank_key,
                                  address=address, dtype="bfloat16", delta=True, timeout=120,
                                  ranks_address=ranks_address),
        client=HTTPVLLMWeightSyncClient(url, timeout=120), source=ModuleSource(model))
    report = []
    try:
        for step in range(1, steps + 2):
            if step <= steps:
                vm.perturb(reference, step)
            else:  # a small step: a few rows change, so every rank sends a delta
                with torch.no_grad():
                    reference.lm_head.weight[:4] += 0.05
            _copy_shards(model, reference)
            label = engine.send_weights()
            last = engine.stats()["last"]
            entry = {"step": step, "version": last["version"], "label": label,
                     "wire_bytes": last["wire_bytes"],
                     "chunks": last["chunks"], "delta_chunks": last["delta_chunks"]}
            if rank == 0:
                entry["server"] = _server_greedy(url, model_dir)
                entry["expected"] = vm.transformers_greedy(vm.rounded_copy(reference,
                                                                           torch.bfloat16))
            report.append(entry)
    finally:
        engine.shutdown()
    return report
