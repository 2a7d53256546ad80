"""A 2-rank FSDP2 trainer (CPU, gloo) syncing to a reader process through a directory (or
shared memory), with no gather: each rank writes its own shards, rank 0 commits the version.

    python examples/fsdp_trainer.py [--steps 5] [--scheme directory|shm]

Each step trains the sharded model once, then every rank calls ``sender.send()``; the reader
(any process that sees the directory: a vLLM engine, an eval job) applies whole tensors. For
the check only, the example gathers the model (``full_tensor()``) and compares it with what
the reader holds."""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

import weightsync as ws


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 257), nn.LayerNorm(257), nn.ReLU(), nn.Linear(257, 10))


Scheme = ws.VLLMDoubleBufferSyncScheme | ws.SharedMemWeightSyncScheme


def trainer(rank: int, world: int, scheme: Scheme, port: int, steps: int, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with scheme.create_sender(rank=rank) as sender:
        sender.register_model(model)  # this rank's DTensor shards; nothing gathered
        sender.connect(timeout=60)     # version 0, once the reader holds it
        for step in range(1, steps + 1):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 * step + rank))
            loss = model(x).logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            t0 = time.perf_counter()
            version = sender.send(timeout=30)
            took = time.perf_counter() - t0
            # check only: the gathered model, as numpy arrays (a queue would share a tensor's
            # memory with the receiving process, and this one may exit first)
            full = {n: p.full_tensor().detach().numpy() for n, p in model.state_dict().items()}
            if rank == 0:
                print(f"trainer: step {step} loss {loss.item():.4f} -> version {version} "
                      f"({took * 1e3:.1f} ms, {world} ranks wrote their shards)", flush=True)
                out.put(("trainer", version, full))
    dist.destroy_process_group()


def reader(scheme: Scheme, steps: int, out: Any) -> None:
    model = make_model()
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(model)
    receiver.connect(timeout=60)
    while receiver.version < steps:
        version = receiver.receive(timeout=30)
        if version is None:
            raise TimeoutError("no new version within 30 s")
        out.put(("reader", version, {k: v.numpy().copy() for k, v in model.state_dict().items()}))
    receiver.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--scheme", choices=["directory", "shm"], default="directory",
                        help="directory: a reader on any host that sees it (vLLM); shm: "
                        "SharedMem, workers on the trainer's host")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="weightsync-example-fsdp-",
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    for_ranks: Scheme  # what the trainer ranks get (its pickle carries the ranks' key)
    if args.scheme == "shm":
        for_ranks = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=2)
    else:
        for_ranks = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, trainer_ranks=2)
    for_workers = for_ranks.for_workers()  # what the reader gets: without the ranks' key
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=reader, args=(for_workers, args.steps, out))]
    procs += [ctx.Process(target=trainer, args=(r, 2, for_ranks, port, args.steps, out))
              for r in range(2)]
    for p in procs:
        p.start()
    seen: dict[str, dict[int, dict[str, Any]]] = {"trainer": {}, "reader": {}}
    ok = True
    deadline = time.monotonic() + 120
    try:
        while len(seen["trainer"]) < args.steps and time.monotonic() < deadline:
            try:
                who, version, state = out.get(timeout=1)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    print("a process failed", file=sys.stderr)
                    return 1
                continue
            seen[who][version] = state
        while args.steps not in seen["reader"] and time.monotonic() < deadline:
            try:
                who, v, state = out.get(timeout=1)
                seen[who][v] = state
            except queue.Empty:
                continue
        ok &= args.steps in seen["reader"]
        for version, gathered in sorted(seen["trainer"].items()):
            read = seen["reader"].get(version)
            if read is None:  # SharedMem does not wait for the reader: it took a newer one
                print(f"check: version {version}: skipped by the reader (it took a newer one)")
                continue
            same = all((read[k] == t).all() for k, t in gathered.items())
            ok &= same
            print(f"check: version {version}: reader == gathered model: {'OK' if same else 'MISMATCH'}")
        for p in procs:
            p.join(timeout=30)
        ok &= all(p.exitcode == 0 for p in procs) and len(seen["trainer"]) == args.steps
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(directory, ignore_errors=True)
    print("all checks passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
