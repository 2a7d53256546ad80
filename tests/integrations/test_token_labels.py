"""The checks of per-token weight-version labels (:mod:`token_labels`) without a server: the
replay of a request that lived through an update, and the spans' expansion (a real
``vllm serve`` is checked with them in ``test_vllm_serve_remote.py``)."""

from __future__ import annotations

import copy

import pytest
import token_labels as tl
import vllm_model as vm

#: measured: max |vLLM - transformers| over 120 float32 tokens is below 1e-4; another
#: version (vm.perturb at scale 0.3, or another seed) moves every token by 0.1 or more
TOL = 1e-3
PROMPTS = [*vm.PROMPTS, [11, 250, 7, 400, 63]]
NEW_TOKENS = 40


def test_a_request_resumed_on_new_weights_is_checked_with_its_old_kv_cache():
    """Labels ``v0`` then ``v1`` on one request: logprobs made with the KV cache of ``v0``
    kept (vLLM's ``mode="keep"``) pass; the same labels with a fresh prefix on ``v1`` do not,
    nor does a switch at another token."""
    v0 = vm.build_model()
    v1 = copy.deepcopy(v0)
    vm.perturb(v1, 1)
    models = {"v0": v0, "v1": v1}
    prompt, tokens = PROMPTS[0], [(7 * i + 3) % 512 for i in range(16)]
    labels = ["v0"] * 10 + ["v1"] * 6
    kept = tl.replay_logprobs(tl.Sample(prompt, tokens, [0.0] * 16, labels), models)
    logprobs = [kept[label][i] for i, label in enumerate(labels)]
    sample = tl.Sample(prompt, tokens, logprobs, labels)
    assert sample.spans == [("v0", 0, 10), ("v1", 10, 16)]
    assert tl.check_labels([sample], models, TOL, kv="kept") == []
    assert len(tl.check_labels([sample], models, TOL, kv="fresh")) >= 5
    moved = tl.Sample(prompt, tokens, logprobs, ["v0"] * 9 + ["v1"] * 7)
    assert tl.check_labels([moved], models, TOL, kv="kept")[0].startswith("sample 0 token 9 ")
    unknown = tl.check_labels([tl.Sample(prompt, tokens, logprobs, ["v2"] * 16)], models, TOL)
    assert unknown == ["sample 0: no model for the labels ['v2'] (spans [('v2', 0, 16)])"]


def test_spans_expand_to_one_label_a_token_or_fail():
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}]
    assert tl.expand_spans(spans, 3) == ["default", "default", "3"]
    assert tl.expand_spans(None, 0) == []
    for bad, n in ((None, 1), (spans, 4), (spans[1:], 1), ([*spans, spans[1]], 4)):
        with pytest.raises(ValueError):
            tl.expand_spans(bad, n)
