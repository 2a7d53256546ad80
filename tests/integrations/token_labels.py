"""Check a real ``vllm serve``'s per-token weight-version labels against the weights that
sampled each token.

vLLM's token-in-token-out endpoint (``POST /inference/v1/generate``; the server needs
``--enable-scale-out``, else it answers 403) returns, with a finished request, the output
tokens, each sampled token's logprob, and ``weight_versions``: contiguous spans
``{"version", "start", "end"}`` over output-token indexes, the label being the engine's
``weight_version`` when the step that sampled the tokens ran ("default" before any update).
A label is checked by recomputing each token's logprob with transformers under the model it
names: vLLM's default ``--logprobs-mode raw_logprobs`` is ``log_softmax`` of the raw logits
(before temperature, penalties, top-k/top-p), which is what :func:`recompute_logprobs`
computes, so the comparison is like for like at any temperature.

Request body sent by :func:`stream_tokens`::

    {"token_ids": [...prompt...], "stream": false,
     "sampling_params": {"max_tokens": N, "temperature": 1.0, "seed": S, "logprobs": 0,
                         "ignore_eos": true, "detokenize": false}}

Response fields read: ``choices[0].token_ids``, ``choices[0].logprobs.content[i].logprob``
(``token_id`` checked), ``choices[0].weight_versions`` and ``choices[0].finish_reason``.

``kv="fresh"`` (the default of :func:`step_logprobs` and :func:`check_labels`) expects each
token sampled on a KV cache its own version computed, as weightsync's updates leave it (the
running requests' KV is recomputed after each take); ``kv="kept"`` replays instead a request
that resumed on the new weights with the KV cache the old ones computed (an update that
keeps the running requests' cache), step by step."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

GENERATE_ROUTE = "/inference/v1/generate"
#: the logprob vLLM sends for a token it has none for (or a NaN / -inf one)
MISSING_LOGPROB = -9999.0
KVMode = Literal["kept", "fresh"]


@dataclass
class Sample:
    """One finished request: its prompt, the tokens vLLM sampled, each token's logprob and
    the weight-version label of each token (expanded from the response's spans)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    labels: list[str]
    finish_reason: str | None = None

    @property
    def spans(self) -> list[tuple[str, int, int]]:
        """The labels as ``(version, start, end)`` runs, as vLLM sent them."""
        runs: list[tuple[str, int, int]] = []
        for i, label in enumerate(self.labels):
            if runs and runs[-1][0] == label:
                runs[-1] = (label, runs[-1][1], i + 1)
            else:
                runs.append((label, i, i + 1))
        return runs


def expand_spans(spans: Sequence[Mapping[str, Any]] | None, num_tokens: int) -> list[str]:
    """One label per output token from vLLM's ``weight_versions`` spans; raises when the
    spans are missing, overlap, leave a gap or do not end at ``num_tokens`` (a label that
    does not cover every token exactly once cannot be checked)."""
    if spans is None:
        if num_tokens == 0:
            return []
        raise ValueError(f"no weight_versions for {num_tokens} tokens (was the request finished?)")
    labels: list[str] = []
    for span in spans:
        version, start, end = str(span["version"]), int(span["start"]), int(span["end"])
        if start != len(labels) or end <= start:
            raise ValueError(f"weight_versions spans are not contiguous from 0: {list(spans)}")
        labels.extend([version] * (end - start))
    if len(labels) != num_tokens:
        raise ValueError(f"weight_versions cover {len(labels)} tokens, not {num_tokens}: {list(spans)}")
    return labels


def generate_body(prompt_ids: Sequence[int], max_tokens: int, *, temperature: float = 1.0,
                  seed: int | None = 0) -> dict[str, Any]:
    """The JSON body of one non-streaming token-in-token-out request that asks for the
    sampled token's logprob (``logprobs: 0``) and never stops early at EOS (so every
    request runs its ``max_tokens`` steps, long enough to live through an update)."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature,
                              "logprobs": 0, "ignore_eos": True, "detokenize": False}
    if seed is not None:
        params["seed"] = seed
    return {"token_ids": list(prompt_ids), "stream": False, "sampling_params": params}


def parse_response(prompt_ids: Sequence[int], reply: Mapping[str, Any]) -> Sample:
    """The :class:`Sample` of a ``/inference/v1/generate`` JSON reply (first choice); raises
    when a logprob is missing or belongs to another token than the one sampled."""
    choice = reply["choices"][0]
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(token_ids):
        raise ValueError(f"{len(content)} logprobs for {len(token_ids)} tokens")
    logprobs = []
    for i, (token, entry) in enumerate(zip(token_ids, content, strict=True)):
        if int(entry["token_id"]) != token or float(entry["logprob"]) <= MISSING_LOGPROB:
            raise ValueError(f"token {i}: no logprob for the sampled token {token}: {entry}")
        logprobs.append(float(entry["logprob"]))
    labels = expand_spans(choice.get("weight_versions"), len(token_ids))
    return Sample(list(prompt_ids), token_ids, logprobs, labels, choice.get("finish_reason"))


def stream_tokens(url: str, prompt_ids: Sequence[int], max_tokens: int, *, timeout: float,
                  temperature: float = 1.0, seed: int | None = 0) -> Sample:
    """Generate ``max_tokens`` tokens after ``prompt_ids`` from the server at ``url`` (its
    base URL) in one POST, and return them with their logprobs and labels: the spans only
    come with the finished request, so nothing is gained by streaming."""
    import requests

    reply = requests.post(url.rstrip("/") + GENERATE_ROUTE, timeout=timeout,
                          json=generate_body(prompt_ids, max_tokens, temperature=temperature, seed=seed))
    if reply.status_code != 200:
        raise RuntimeError(f"{GENERATE_ROUTE} answered {reply.status_code}: {reply.text[:500]}")
    return parse_response(prompt_ids, reply.json())


def _token_logprobs(logits: torch.Tensor, token_ids: Sequence[int]) -> list[float]:
    """``log_softmax`` of each row of ``logits`` (float32, as vLLM's raw_logprobs) at the
    matching token."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(token_ids), dtype=torch.long).unsqueeze(-1)
    return logprobs.gather(-1, index).squeeze(-1).tolist()


@torch.inference_mode()
def recompute_logprobs(model: Any, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[float]:
    """The logprob of each of ``token_ids`` under ``model`` (a transformers causal LM) given
    the prompt and the tokens before it: one full forward, so every position's keys and
    values come from ``model`` (what a request that saw only this version computed)."""
    if not token_ids:
        return []
    ids = torch.tensor([[*prompt_ids, *token_ids]])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    # the logits at position p predict token p + 1: the last prompt position predicts token 0
    return _token_logprobs(logits[len(prompt_ids) - 1:-1], token_ids)


@torch.inference_mode()
def replay_logprobs(sample: Sample, models_by_label: Mapping[str, Any]) -> dict[str, list[float]]:
    """Replay the sample step by step as vLLM ran it (a prefill of the prompt, then one
    token a step), each step on the model of the label of the token it sampled, keeping the
    KV cache across label changes (vLLM's ``mode="keep"`` pause); and return, for every
    label, the logprob each token would have had had its step alone run that label's model
    (the same history): the sample's own label must match vLLM's logprob."""
    from transformers import DynamicCache

    missing = sorted(set(sample.labels) - set(models_by_label))
    if missing:
        raise KeyError(f"no model for the labels {missing}")
    out: dict[str, list[float]] = {label: [] for label in models_by_label}
    if not sample.token_ids:
        return out
    any_model = next(iter(models_by_label.values()))
    cache = DynamicCache(config=any_model.config)
    inputs = list(sample.prompt_ids)  # step 0 reads the prompt, step i the token i - 1
    for token, label in zip(sample.token_ids, sample.labels, strict=True):
        ids = torch.tensor([inputs])
        past = cache.get_seq_length()
        mask = torch.ones(1, past + len(inputs), dtype=torch.long)
        for other, model in models_by_label.items():
            if other == label:
                continue
            logits = model(input_ids=ids, attention_mask=mask, past_key_values=copy.deepcopy(cache),
                           use_cache=True).logits[0, -1:]
            out[other].extend(_token_logprobs(logits, [token]))
        logits = models_by_label[label](input_ids=ids, attention_mask=mask, past_key_values=cache,
                                        use_cache=True).logits[0, -1:]
        out[label].extend(_token_logprobs(logits, [token]))
        inputs = [token]
    return out


def step_logprobs(sample: Sample, models_by_label: Mapping[str, Any], *,
                  kv: KVMode = "fresh") -> dict[str, list[float]]:
    """For every label, the logprob of each of the sample's tokens had its step run that
    label's model: ``kv="kept"`` keeps the earlier steps' KV cache as the sample's labels made
    it (:func:`replay_logprobs`); ``kv="fresh"`` recomputes the whole prefix on that model
    (:func:`recompute_logprobs`, an engine that recomputes its cache after an update). The two
    agree on a sample with a single label."""
    if kv == "fresh":
        return {label: recompute_logprobs(model, sample.prompt_ids, sample.token_ids)
                for label, model in models_by_label.items()}
    return replay_logprobs(sample, models_by_label)


def label_deviations(samples: Sequence[Sample], models_by_label: Mapping[str, Any], *,
                     kv: KVMode = "fresh") -> list[list[dict[str, float]]]:
    """``|vLLM logprob - expected|`` of every token of every sample under every label (the
    raw numbers :func:`check_labels` judges; for measuring a tolerance and the gap between
    versions)."""
    out = []
    for sample in samples:
        table = step_logprobs(sample, models_by_label, kv=kv)
        out.append([{label: abs(got - table[label][i]) for label in table}
                    for i, got in enumerate(sample.logprobs)])
    return out


def check_labels(samples: Sequence[Sample], models_by_label: Mapping[str, Any], tol: float, *,
                 kv: KVMode = "fresh") -> list[str]:
    """Every token whose vLLM logprob is farther than ``tol`` from its logprob under the
    model its label names, as one readable line each (sample, token index, label, both
    logprobs and the labels that would match); empty when every label holds. A sample with a
    label that no model is given for is reported once, not checked.

    "Would match" tries each label both on the sample's history (:func:`step_logprobs` with
    ``kv``) and on a full forward of its own (``kv="fresh"``): after a wrong label the kept
    history is itself wrong, and only the second finds the version that really ran."""
    problems: list[str] = []
    for n, sample in enumerate(samples):
        unknown = sorted(set(sample.labels) - set(models_by_label))
        if unknown:
            problems.append(f"sample {n}: no model for the labels {unknown} (spans {sample.spans})")
            continue
        table = step_logprobs(sample, models_by_label, kv=kv)
        fresh = table if kv == "fresh" else step_logprobs(sample, models_by_label, kv="fresh")
        rows = zip(sample.token_ids, sample.labels, sample.logprobs, strict=True)
        for i, (token, label, got) in enumerate(rows):
            expected = table[label][i]
            if abs(got - expected) <= tol:
                continue
            matches = [other for other in table
                       if min(abs(got - table[other][i]), abs(got - fresh[other][i])) <= tol]
            closest = min(table, key=lambda other: abs(got - fresh[other][i]))
            problems.append(
                f"sample {n} token {i} (id {token}) labelled {label!r}: vLLM logprob {got:.6f}, "
                f"expected {expected:.6f} (|diff| {abs(got - expected):.3g} > {tol:g}); "
                + (f"matches {matches}" if matches else
                   f"matches no label (closest, full forward: {closest!r} {fresh[closest][i]:.6f})"))
    return problems
