"""A transformers causal LM trained in one process and served from a directory of
double-buffered safetensors slots by another (what a vLLM engine does via the extension).

Run: python examples/transformers_double_buffer.py [--steps N] [--directory DIR] [--keep]

By default the slots live in a new private folder in /dev/shm that is removed at the end
(``--keep`` leaves it for inspection; a ``--directory`` you name is always left in place).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import weightsync as ws

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
PROMPT = [[3, 14, 15, 9]]


def server(scheme: ws.VLLMDoubleBufferSyncScheme, out: mp.Queue) -> None:
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(model)  # in place; an engine would use register_loader(load_weights)
    receiver.connect(timeout=60)
    while True:
        try:
            version = receiver.receive(timeout=1.0)
        except ws.SenderLostError:
            break
        if version is not None:
            with torch.no_grad():
                tokens = model.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False,
                                        pad_token_id=0)
            out.put((version, tokens[0].tolist()))
    receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--directory", default=None, help="default: a new folder in /dev/shm")
    parser.add_argument("--keep", action="store_true", help="keep the default folder at the end")
    args = parser.parse_args()
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    directory = args.directory or tempfile.mkdtemp(prefix="weightsync-example-", dir=shm)
    print(f"slots in {directory}")
    try:
        train_and_serve(directory, args.steps)
    finally:
        if args.directory is None and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"the slots stay in {directory}")


def train_and_serve(directory: str, steps: int) -> None:
    """Train a few steps, sending each version to a server process; print what it serves."""
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, dtype=torch.bfloat16)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=server, args=(scheme, out))
    proc.start()
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.randint(0, CONFIG["vocab_size"], (4, 16))
        with scheme.create_sender() as sender:
            sender.register_model(model)
            sender.connect(timeout=120)
            for _ in range(steps):
                loss = model(input_ids=data, labels=data).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                version = sender.send(timeout=60)  # returns once the server has applied it
                print(f"step loss {loss.item():.3f} -> served version {version}")
            served = None
            while served is None or served[0] != version:
                served = out.get(timeout=60)
            print(f"server generates {served[1]} with version {served[0]} (bf16 slots)")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


if __name__ == "__main__":
    main()
