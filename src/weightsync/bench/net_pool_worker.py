"""One worker of the pool bench (``bench.net_pool``) on its host: ``python -m
weightsync.bench.net_pool_worker SCHEME_PICKLE IDX NBYTES STOP_FILE``. It joins the
trainer, then takes each version at once until ``STOP_FILE`` exists (or ten minutes)."""

from __future__ import annotations

import os
import pickle
import sys
import time

import torch

from weightsync.bench.local import make_model


def main() -> None:
    path, idx, nbytes, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    with open(path, "rb") as f:
        scheme = pickle.load(f)
    receiver = scheme.create_receiver(idx)
    receiver.register_model(make_model(nbytes))
    receiver.connect(timeout=300)
    end = time.monotonic() + 600
    try:
        while time.monotonic() < end and not os.path.exists(stop):
            receiver.receive(timeout=0.2)
    finally:
        receiver.close()


if __name__ == "__main__":
    main()
