"""A 2-rank FSDP2 trainer feeds a real vLLM engine (CPU build) through the directory: each
rank writes its own shards, nothing is gathered for the sync, and the engine's weight-transfer
backend and greedy tokens are those of the gathered model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_model as vm
from rank_harness import free_port, fsdp_llama_rank, run_ranks, sharded_scheme

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_fsdp2_trainer_feeds_a_vllm_engine(served, directory: Path):
    llm = served.llm
    scheme = sharded_scheme(directory, 2, 60)  # handed to both ranks: one rank key
    outcomes = run_ranks(fsdp_llama_rank, 2, 300, scheme, free_port(), 3)
    assert all(o.ok for o in outcomes), [(o.rank, o.error, o.traceback[-1500:]) for o in outcomes]
    gathered = outcomes[0].value
    expected = vm.build_model()
    for step in (1, 2):
        vm.perturb(expected, step)
    plain = vm.build_model()
    plain.load_state_dict({n: torch.from_numpy(a) for n, a in gathered.items()})
    for name, tensor in expected.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name
    llm.init_weight_transfer_engine({"init_info": {"directory": str(directory)}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 2}})
    llm.finish_weight_update(weight_version="2")
    llm.reset_prefix_cache()
    assert llm.get_weight_version() == "2"
    tokens = vm.vllm_greedy(llm)
    assert tokens == vm.transformers_greedy(plain)
    assert tokens != vm.transformers_greedy(vm.build_model())  # the sync changed the output
