"""A small random transformers causal LM trained in this process, served by a receiver in
another process through the double buffer: greedy generations must match token for token."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from dbuf_workers import llm_receiver
from workers import drain

import weightsync as ws

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    initializer_range=0.2, tie_word_embeddings=False,
)
PROMPT = [5, 17, 42, 8]


@pytest.mark.slow
def test_trained_llm_generates_identically_on_the_receiver(workers):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = Path(tempfile.mkdtemp(prefix="ws-llm-", dir=shm))
    scheme = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, timeout=60)
    workers.start(llm_receiver, scheme, 0, CONFIG, PROMPT, method="spawn")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, CONFIG["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(1))
    try:
        with scheme.create_sender() as sender:
            sender.register_model(model)
            sender.connect(timeout=120)
            for _ in range(3):
                model.train()
                loss = model(input_ids=data, labels=data).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sender.send(timeout=60)
            model.eval()
            with torch.no_grad():
                expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                          pad_token_id=0)[0].tolist()
            seen = {}
            while seen.get("version") != sender.version:
                _, version, tokens = drain(workers.out, 1, timeout=120)[0]
                seen = {"version": version, "tokens": tokens}
            assert seen["version"] == 3
            assert seen["tokens"] == expected
            assert len(set(expected[len(PROMPT):])) > 1, "a degenerate generation proves little"
    finally:
        workers.stop.set()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.slow
def test_example_leaves_no_directory_behind():
    """The example's slots live in a folder of its own in /dev/shm, removed when it ends."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    script = Path(__file__).parents[2] / "examples" / "transformers_double_buffer.py"
    result = subprocess.run([sys.executable, str(script), "--steps", "1"], capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "served version 1" in result.stdout
    used = Path(result.stdout.split("slots in ", 1)[1].split()[0])
    assert used.parent == shm and used.name.startswith("weightsync-example-")
    assert not used.exists()
