"""Tied weights: two names for one tensor (an LLM's input embedding and ``lm_head``).

A tied model's ``state_dict`` lists the tensor under each name. The layout keeps it once,
under its first name, and records every other name as an alias: it is packed and sent once,
and a worker whose model has the same tie gets it whole. Both sides must agree on every tie:
a worker that is tied where the trainer is not would silently take one tensor's values for
both, so a difference is a layout mismatch."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _identity(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """What makes two entries one tensor: the same memory viewed the same way."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return None
    return (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tensor.stride())


def find_ties(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``alias -> first name`` for every entry that is the same tensor as an earlier one."""
    first: dict[tuple[object, ...], str] = {}
    ties: dict[str, str] = {}
    for name, tensor in weights.items():
        key = _identity(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is None:
            continue
        if key in first:
            ties[name] = first[key]
        else:
            first[key] = name
    return ties


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are one tensor (as :func:`find_ties` counts a tie)."""
    key = _identity(a)
    return key is not None and key == _identity(b)


def describe_tie(canonical: str | None) -> str:
    """How a name stands in a layout: tied to ``canonical``, or a tensor of its own."""
    return f"tied to {canonical!r} (one tensor)" if canonical else "its own tensor"


def checked_ties(ties: object, names: Mapping[str, object]) -> dict[str, str]:
    """``ties`` from a peer or a file, as ``alias -> name`` of an entry in ``names``, the
    alias itself not an entry; ValueError otherwise."""
    if not isinstance(ties, Mapping):
        raise ValueError(f"ties must be an object of alias -> name, got {type(ties).__name__}")
    out: dict[str, str] = {}
    for alias, canonical in ties.items():
        if not isinstance(alias, str) or not isinstance(canonical, str):
            raise ValueError("ties must map str to str")
        if alias in names or canonical not in names:
            raise ValueError(f"tie {alias!r} -> {canonical!r}: the alias must not be an entry "
                             "and the name it ties to must be one")
        out[alias] = canonical
    return out
