"""The directory's commit (``update_weights``) and a copy-mode reader's apply (``poll``) at
400 MB of random fp32 in /dev/shm, beside a memcpy of the same size timed right after each
apply: medians of 20 rounds after 4 warm ones. Run it with ``PYTHONPATH`` pointing at two
builds' ``src`` in turn (e.g. a ``git worktree`` of an older commit) to compare them on
one machine."""

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from weightsync import VLLMDoubleBufferSyncScheme
from weightsync.bench.local import make_model

NBYTES = 400_000_000


def main() -> None:
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    weights = dict(make_model(NBYTES).state_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in weights.values():
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
    scheme = VLLMDoubleBufferSyncScheme(root / "slots", num_workers=1)
    sender = scheme.create_sender()
    sender.register_model(weights)
    receiver = scheme.create_receiver(0)
    receiver.register_model(make_model(NBYTES))
    src, dst = torch.ones(NBYTES, dtype=torch.uint8), torch.zeros(NBYTES, dtype=torch.uint8)
    update, apply, memcpy = [], [], []
    try:
        for i in range(24):
            t0 = time.perf_counter()
            sender.update_weights()
            t1 = time.perf_counter()
            receiver.poll()
            t2 = time.perf_counter()
            dst.copy_(src)
            t3 = time.perf_counter()
            if i >= 4:
                update.append(t1 - t0)
                apply.append(t2 - t1)
                memcpy.append(t3 - t2)
    finally:
        receiver.close()
        sender.close()
        shutil.rmtree(root, ignore_errors=True)
    m = statistics.median
    print(f"update {m(update) * 1e3:.1f} ms ({m(update) / m(memcpy):.2f}x memcpy)  "
          f"apply {m(apply) * 1e3:.1f} ms ({m(apply) / m(memcpy):.2f}x)  "
          f"memcpy {m(memcpy) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
