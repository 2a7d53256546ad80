"""Workers of a ``NetWeightSyncScheme`` on one "host" (a network namespace with its own
/dev/shm and /tmp): ``python net_host_workers.py SCHEME_PICKLE OUT_DIR IDX [IDX...]``.

Each index runs in its own forked process and appends JSON lines to ``OUT_DIR/worker<i>``
(its own file, so a killed worker blocks no other): ``["pid", i, pid]``, then
``["version", i, v, checksum]`` per version applied, ``["error", i, kind, message]`` on a
weightsync error. Every process ends by ``OUT_DIR/stop`` or after two minutes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import sys
import time

import torch

import weightsync as ws


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))


def checksum(model: torch.nn.Module) -> float:
    return float(sum(t.detach().double().sum() for t in model.state_dict().values()))


def run_worker(scheme: object, idx: int, out_dir: str) -> None:
    with open(os.path.join(out_dir, f"worker{idx}"), "a", buffering=1) as out:
        def say(*item: object) -> None:
            out.write(json.dumps(item) + "\n")

        say("pid", idx, os.getpid())
        model = make_model()
        receiver = scheme.create_receiver(idx)  # type: ignore[attr-defined]
        receiver.register_model(model)
        end = time.monotonic() + 120
        try:
            say("version", idx, receiver.connect(timeout=60), checksum(model))
            while time.monotonic() < end and not os.path.exists(os.path.join(out_dir, "stop")):
                version = receiver.receive(timeout=0.2)
                if version is not None:
                    say("version", idx, version, checksum(model))
        except ws.WeightSyncError as exc:
            say("error", idx, type(exc).__name__, str(exc), receiver.version, checksum(model))
        finally:
            receiver.close()


def main() -> None:
    path, out_dir, *indices = sys.argv[1:]
    with open(path, "rb") as f:
        scheme = pickle.load(f)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=run_worker, args=(scheme, int(i), out_dir)) for i in indices]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(150)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
