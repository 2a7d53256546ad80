"""Workers of a ``NetWeightSyncScheme`` on one "host" (a network namespace with its own
/dev/shm and /tmp): ``python net_host_workers.py SCHEME_PICKLE OUT_DIR IDX [IDX...]``.

Each index runs in its own forked process and appends JSON lines to ``OUT_DIR/worker<i>``
(its own file, so a killed worker blocks no other): ``["pid", i, pid]``, then
``["version", i, v, checksum]`` per version applied, ``["error", i, kind, message]`` on a
weightsync error. Every process ends by ``OUT_DIR/stop`` or after two minutes.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import pickle
import sys
import time

import torch

import weightsync as ws


def make_model(width: int | None = None) -> torch.nn.Module:
    """The model of every test of this kind; ``width`` (default: ``WS_NET_WIDTH``, else
    256) sizes its first layer (2896: about 17 MB in bf16, three chunks)."""
    width = width or int(os.environ.get("WS_NET_WIDTH", "256"))
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 64))


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


def forge_relayed_chunks() -> None:
    """Make this process's relay a liar (``WS_TAMPER_RELAY=1``): each chunk it forwards has
    its first bytes flipped, under a checksum and a MAC recomputed over the forged bytes,
    so that only the trainer's digest can tell."""
    from weightsync.transports.net import publisher
    from weightsync.transports.net.wire import chunk_checksum

    honest = publisher.VersionPublisher._send_chunk

    class Forged:
        def __init__(self, version: int, index: int, chunk: torch.Tensor) -> None:
            self.version, self._chunk = version, chunk
            self.checksums = {index: chunk_checksum(chunk)}

        def chunk(self, index: int) -> torch.Tensor:
            return self._chunk

    def forged(conn, seal, packed, index, kind, payload, figures):  # type: ignore[no-untyped-def]
        bad = packed.chunk(index).clone()
        bad[:8] ^= 0xFF
        return honest(conn, seal, Forged(packed.version, index, bad), index, kind, bad, figures)

    publisher.VersionPublisher._send_chunk = staticmethod(forged)  # type: ignore[method-assign]


def main() -> None:
    path, out_dir, *indices = sys.argv[1:]
    # what each worker's stager did goes to its host's log (net_hosts.host_logs)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s: %(message)s")
    logging.getLogger("weightsync.transports.net").setLevel(logging.INFO)
    if os.environ.get("WS_TAMPER_RELAY") == "1":
        forge_relayed_chunks()
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
