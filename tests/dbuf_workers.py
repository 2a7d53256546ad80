"""Process bodies for the double-buffer tests (importable by spawn)."""

from __future__ import annotations

import time
from typing import Any

import torch

import weightsync as ws


def big_model(mb: int = 64) -> dict[str, torch.Tensor]:
    n = mb * (1 << 20) // 4 // 8
    return {f"block{i}.weight": torch.zeros(n) for i in range(8)}


def hammer_reader(scheme: Any, idx: int, out: Any, stop: Any) -> None:
    model = {f"t{i}": torch.zeros(4096) for i in range(8)}
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    receiver.connect(timeout=30)
    reads = violations = applied = 0
    while not stop.is_set():
        try:
            if receiver.poll() is not None:
                applied += 1
        except ws.SenderLostError:
            break
        expected = float(receiver.version)
        if any(not bool((t == expected).all()) for t in model.values()):
            violations += 1
        reads += 1
    out.put(("hammer", idx, reads, violations, applied, receiver.version))
    receiver.close()


def looping_sender(scheme: Any, out: Any) -> None:
    """Commits version after version of a large model until killed."""
    weights = big_model()
    sender = scheme.create_sender()
    sender.register_model(weights)
    out.put(("started", sender.version))
    while True:
        v = sender.version + 1
        for t in weights.values():
            t.fill_(float(v))
        sender.update_weights()
        out.put(("committed", sender.version))


def llm_receiver(scheme: Any, idx: int, out: Any, stop: Any, config: dict, prompt: list) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(123)  # different init from the trainer's: only the sync can align them
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    receiver = scheme.create_receiver(worker_idx=idx)
    receiver.register_model(model)
    receiver.connect(timeout=60)
    last = -1
    deadline = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            receiver.receive(timeout=0.2)
        except ws.SenderLostError:
            break
        if receiver.version != last:
            last = receiver.version
            with torch.no_grad():
                tokens = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        pad_token_id=0)
            out.put(("generated", last, tokens[0].tolist()))
    receiver.close()


def late_echo_worker(scheme: Any, idx: int, out: Any, stop: Any, delay: float) -> None:
    """A worker restarting after ``delay`` seconds: connect, report, then follow versions."""
    time.sleep(delay)
    from workers import echo_worker

    echo_worker(scheme, idx, out, stop)


def hold_slot_locks(paths: list[str], exclusive: bool, out: Any, stop: Any) -> None:
    """A reader (or a stuck writer) that holds ``fcntl`` locks on slot files until stopped."""
    import fcntl
    import os

    fds = [os.open(p, os.O_RDWR) for p in paths]
    for fd in fds:
        fcntl.lockf(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    out.put(("locked", len(fds)))
    stop.wait(60)
    for fd in fds:
        os.close(fd)
