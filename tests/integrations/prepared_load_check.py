"""Run by ``test_vllm_prepared_load.py`` in a process of its own: a real vLLM engine with its
model in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the check can reach the
served model. Prints one JSON line of findings."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import weakref

sys.path.insert(0, os.path.dirname(__file__))

import vllm_model as vm

os.environ.update(vm.ENGINE_ENV)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch


def main(work: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from weightsync.integrations.vllm.prepared_load import PreparedLoad, SparePool

    # tied embeddings: a tensor two modules share must stay one in the shadow
    kwargs = vm.engine_kwargs(vm.save_model(vm.build_model(tie_word_embeddings=True),
                                            f"{work}/model"))
    kwargs.pop("worker_extension_cls")
    llm = LLM(**kwargs)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    model, model_config = worker.model_runner.model, worker.model_config
    params = SamplingParams(max_tokens=vm.NEW_TOKENS, temperature=0.0, logprobs=0)

    def generate() -> list[list[float]]:
        """Each prompt's greedy tokens and their logprobs, as one list per prompt."""
        outs = llm.generate([{"prompt_token_ids": p} for p in vm.PROMPTS], params,
                            use_tqdm=False)
        return [[float(t) for t in o.outputs[0].token_ids]
                + [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]
                for o in outs]

    def version(seed: int) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint of another random model, in bf16 as the network path stages it."""
        model = vm.build_model(seed=seed, tie_word_embeddings=True)
        return [(name, t.to(torch.bfloat16)) for name, t in model.state_dict().items()]

    def reload(pairs: list[tuple[str, torch.Tensor]]) -> None:  # vLLM's own way
        initialize_layerwise_reload(model)
        model.load_weights(pairs)
        finalize_layerwise_reload(model, model_config)

    found: dict[str, object] = {}
    v0, v1, v2 = version(10), version(11), version(12)
    reference = {}
    for name, pairs in (("v1", v1), ("v2", v2), ("v0", v0)):
        reload(pairs)
        reference[name] = generate()
    found["versions_differ"] = len({json.dumps(r) for r in reference.values()}) == 3

    # v0 served; v1 loads into a shadow in another thread while the engine generates.
    # Python's cyclic collector stays off from here: what a swap retires must be freed by
    # reference counting alone, as soon as it is dropped (a server swapping every few
    # seconds cannot wait for a collection while versions pile up)
    gc.disable()
    reload_state = len(LAYERWISE_INFO)  # vLLM's per-layer reload state, the served model's
    shadow = PreparedLoad(model, 1)
    loader = threading.Thread(target=shadow.load, args=(v1, model_config))
    during: list[bool] = []
    loader.start()
    while loader.is_alive() or not during:
        during.append(generate() == reference["v0"])
    loader.join()
    found["served_untouched_while_loading"] = all(during)
    found["generations_while_loading"] = len(during)
    started = time.perf_counter()
    retired = shadow.swap_in()
    found["swap_seconds"] = time.perf_counter() - started
    # v0's weights, retired, are where the next shadow's copies go (no new memory)
    spares = SparePool(retired, served=model)
    del retired
    found["swapped_v1_is_vllms_v1"] = generate() == reference["v1"]
    served_storage = {t.untyped_storage().data_ptr()
                      for t in (*model.parameters(), *model.buffers())}
    spare_bytes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in spares}
    spare_storage = set(spare_bytes)
    found["spares"] = len(spares)
    found["spare_bytes"] = sum(spare_bytes.values())
    found["spares_hold_none_served"] = not (served_storage & spare_storage)

    again = PreparedLoad(model, 2, spares)
    del spares
    loader = threading.Thread(target=again.load, args=(v2, model_config))
    during = []
    loader.start()
    while loader.is_alive() or not during:  # v0's old memory is written, v1 served
        during.append(generate() == reference["v1"])
    loader.join()
    found["served_untouched_while_loading_into_spares"] = all(during)
    shadow_storage = {t.untyped_storage().data_ptr() for _served, module, _before in again.pairs
                      for t in (*module._parameters.values(), *module._buffers.values())
                      if t is not None}
    # (a few scalars, attention scales, are made anew when vLLM finalizes the layer)
    found["spare_bytes_reused"] = sum(spare_bytes[p] for p in shadow_storage & spare_storage)
    shadows = [weakref.ref(module) for _served, module, _before in again.pairs]
    # the kernels v1 is served with (its shadow's, swapped in): v2's swap retires them
    kernels = [weakref.ref(module.__dict__["cpu_linear"]) for module in model.modules()
               if "cpu_linear" in module.__dict__]
    again.swap_in()
    found["swapped_v2_is_vllms_v2"] = generate() == reference["v2"]
    found["kernels"] = len(kernels)
    found["retired_kernels_left"] = sum(ref() is not None for ref in kernels)
    # a shadow loaded and never swapped in (a version superseded before its take)
    dropped = PreparedLoad(model, 0)
    dropped.load(v0, model_config)
    shadows += [weakref.ref(module) for _served, module, _before in dropped.pairs]
    dropped.release()
    # nothing of the shadows outlives their swap or release (each held a version's weights
    # and packed kernels)
    del shadow, again, dropped
    found["shadows_left"] = sum(ref() is not None for ref in shadows)
    found["reload_state_added"] = len(LAYERWISE_INFO) - reload_state
    gc.enable()
    reload(v0)  # vLLM's own reload still works on a model that took swaps
    found["reload_after_swaps_is_vllms_v0"] = generate() == reference["v0"]
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
