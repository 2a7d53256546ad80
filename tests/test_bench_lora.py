"""``weightsync bench --transports lora`` on the tiny demo model: adapter-only rows beside
the full merged sync of the same run, bytes growing with the rank, the phases noted."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_adapter_rows_beside_the_full_merged_sync():
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from weightsync.bench.lora import FULL_FLOOR, run_lora_bench

    notes: list[str] = []
    rows = run_lora_bench([2, 8], repeats=2, notes=notes, model_size="tiny")
    assert [r.transport for r in rows] == ["lora adapter r2 (vLLM)", "lora adapter r8 (vLLM)",
                                           "full merged (vLLM)"]
    r2, r8, full = rows
    assert 0 < r2.nbytes < r8.nbytes < full.nbytes
    assert r8.nbytes == 4 * r2.nbytes  # lora_A and lora_B both grow with the rank
    assert all(r.samples == 2 and r.floor == FULL_FLOOR for r in rows)
    assert full.ratio == pytest.approx(1.0)
    assert sum("commit (trainer)" in note for note in notes) == 3
    assert any("base guard" in note for note in notes)
