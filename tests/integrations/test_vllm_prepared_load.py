"""A version loaded into a shadow of the served model (``prepared_load``) against vLLM's own
reload, on a real engine (a Llama with tied embeddings, bf16 versions): the served model is
untouched while the shadow loads beside generation, and after the swap it generates exactly
what vLLM's reload of the same version generates (tokens and logprobs, bit for bit); and
nothing of a shadow outlives its swap, without waiting for Python's cyclic collector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_engine import vllm_or_skip

CHECK = Path(__file__).with_name("prepared_load_check.py")
SRC = str(Path(__file__).parents[2] / "src")


def test_a_version_loaded_in_a_shadow_and_swapped_in_is_vllms_reload_of_it():
    vllm_or_skip()
    with tempfile.TemporaryDirectory(prefix="ws-prepared-") as work:
        env = os.environ | {"PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, str(CHECK), work], env=env, capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["versions_differ"], found  # else the comparisons below prove nothing
    assert found["served_untouched_while_loading"], found
    assert found["generations_while_loading"] >= 1, found
    assert found["swapped_v1_is_vllms_v1"], found
    assert found["swapped_v2_is_vllms_v2"], found
    # the second shadow wrote its copies into the weights the first swap retired, never
    # into what the engine served meanwhile
    assert found["spares"] > 0 and found["spares_hold_none_served"], found
    assert found["served_untouched_while_loading_into_spares"], found
    assert found["spare_bytes_reused"] >= 0.99 * found["spare_bytes"], found
    assert found["reload_after_swaps_is_vllms_v0"], found
    # a shadow is freed with its swap or release, by reference counting (the check runs
    # with the cyclic collector off): none of its modules, nor vLLM's reload state for
    # them, outlives it (each held a version's weights and packed kernels), and the kernels
    # a swap retires are freed once the caller drops them
    assert found["kernels"] > 0, found
    assert found["retired_kernels_left"] == 0, found
    assert found["shadows_left"] == 0, found
    assert found["reload_state_added"] == 0, found
