"""Rank bodies of FSDP2 and DTensor tensor-parallel trainers writing one directory
(importable by spawn). The test gathers the model (``full_tensor()``, on the user's gloo
group) after each send and compares it with what a directory reader applied."""

from __future__ import annotations

from typing import Any

import torch
from sharded_ranks import init_gloo
from torch import nn


def mlp(hidden: int = 13) -> nn.Sequential:
    """Odd sizes, so FSDP2 splits rows unevenly over 2 and 4 ranks."""
    return nn.Sequential(nn.Linear(10, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, 7))


def tp_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 37), nn.ReLU(), nn.Linear(37, 48), nn.LayerNorm(48))


def _compare(receiver: Any, local: nn.Module, full: dict[str, torch.Tensor], version: int) -> float:
    """Apply ``version`` in the reader; the largest difference from the gathered model."""
    if receiver.version != version:
        assert receiver.receive(timeout=20) == version
    state = local.state_dict()
    assert set(state) == set(full), (sorted(state), sorted(full))
    return max(float((state[n].float() - t.to(state[n].dtype).float()).abs().max())
               for n, t in full.items())


def _run(rank: int, world: int, scheme: Any, model: nn.Module, reader_model: nn.Module,
         steps: int, step_fn: Any) -> dict[str, Any]:
    """``steps`` versions through ``scheme`` (the one sharded scheme every rank is handed)."""
    receiver = None
    if rank == 0:
        receiver = scheme.create_receiver(0)
        receiver.register_model(reader_model)
    diffs, versions = [], []
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(model)
        for step in range(steps):
            if step:
                step_fn(step)
            version = sender.update_weights()
            versions.append(version)
            full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t
                    for n, t in model.state_dict().items()}  # the test gathers, not weightsync
            if receiver is not None:
                diffs.append(_compare(receiver, reader_model, full, version))
    if receiver is not None:
        receiver.close()
    return {"versions": versions, "diffs": diffs}


def fsdp_mlp(rank: int, world: int) -> tuple[nn.Module, Any]:
    """The :func:`mlp` under FSDP2 (``fully_shard`` per layer and at the root, in this
    rank's gloo group) and ``train(step)``: one SGD step on this rank's batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = mlp()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(step: int) -> None:
        x = torch.randn(8, 10, generator=torch.Generator().manual_seed(step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, train


def fsdp_rank(rank: int, world: int, scheme: Any, port: int, steps: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` per layer and at the root) trained with SGD on CPU/gloo."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        model, train = fsdp_mlp(rank, world)
        return _run(rank, world, scheme, model, mlp(), steps, train)
    finally:
        dist.destroy_process_group()


def tp_parallel(world: int) -> nn.Module:
    """The :func:`tp_model` under tensor parallelism in this rank's gloo group: a colwise
    (``Shard(0)``) and a rowwise (``Shard(1)``) Linear, their biases ``Shard(0)`` /
    ``Replicate()``, and a LayerNorm replicated by ``distribute_tensor``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = tp_model()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    norm = model[3]
    for name, param in list(norm.named_parameters()):
        norm.register_parameter(name, nn.Parameter(
            distribute_tensor(param.data, mesh, [Replicate()])))
    return model


def tp_rank(rank: int, world: int, scheme: Any, port: int, steps: int) -> dict[str, Any]:
    """Tensor parallel (:func:`tp_parallel`), sent cast to bfloat16 (``scheme``'s dtype)."""
    import torch.distributed as dist

    init_gloo(rank, world, port)
    try:
        model = tp_parallel(world)

        @torch.no_grad()
        def update(step: int) -> None:
            for param in model.parameters():
                param.mul_(0.9).add_(0.01 * step)

        return _run(rank, world, scheme, model, tp_model().to(torch.bfloat16), steps, update)
    finally:
        dist.destroy_process_group()


def fsdp_llama_rank(rank: int, world: int, scheme: Any, port: int,
                    steps: int) -> dict[str, Any] | None:
    """A tiny Llama (``vllm_model``) sharded with FSDP2 per decoder layer; version ``s`` holds
    ``vllm_model.perturb`` steps 1..s applied to the seed model. Rank 0 returns the gathered
    state of the last version (gathered by the test, for the comparison only)."""
    import torch.distributed as dist
    import vllm_model as vm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    init_gloo(rank, world, port)
    try:
        reference = vm.build_model()  # every rank computes the same plain model
        model = vm.build_model()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with scheme.create_sender(rank=rank) as sender:
            sender.register_model(model)
            for step in range(steps):
                if step:
                    vm.perturb(reference, step)
                    with torch.no_grad():
                        full = dict(reference.named_parameters())
                        for name, param in model.named_parameters():
                            param.copy_(distribute_tensor(full[name].detach(), param.device_mesh,
                                                          param.placements))
                sender.update_weights()
            gathered = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy()
                        for n, t in model.state_dict().items()}  # numpy: pickled by value
        return gathered if rank == 0 else None
    finally:
        dist.destroy_process_group()
