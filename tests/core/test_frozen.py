"""FrozenWeights: every way a base tensor can change is caught, by name, and the check
stays cheap."""

from __future__ import annotations

import time

import pytest
import torch

from weightsync.core.errors import BaseWeightChangedError
from weightsync.core.frozen import FrozenWeights


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))


def _guard(model: torch.nn.Module) -> FrozenWeights:
    return FrozenWeights(dict(model.named_parameters()))


def test_an_unchanged_model_passes():
    model = _model()
    guard = _guard(model)
    guard.check(dict(model.named_parameters()))
    model(torch.randn(3, 64)).sum().backward()  # gradients are not weights
    guard.check(dict(model.named_parameters()))


@pytest.mark.parametrize("change", ["in_place", "through_data", "replaced_data", "new_param",
                                    "optimizer_step", "one_element"])
def test_each_change_is_refused_naming_the_key(change: str):
    model = _model()
    guard = _guard(model)
    weight = model[0].weight
    with torch.no_grad():
        if change == "in_place":
            weight.mul_(1.5)
        elif change == "through_data":  # bypasses the version counter (peft's merge does this)
            weight.data.mul_(1.5)
        elif change == "replaced_data":
            weight.data = weight.data.clone()
        elif change == "new_param":
            model[0].weight = torch.nn.Parameter(weight.detach().clone())
        elif change == "one_element":
            weight.data.view(-1)[0] += 1.0
    if change == "optimizer_step":
        model(torch.randn(3, 64)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(BaseWeightChangedError, match="'0.weight'") as caught:
        guard.check(dict(model.named_parameters()))
    assert caught.value.key == "0.weight"


def test_a_removed_tensor_is_refused():
    model = _model()
    guard = _guard(model)
    params = dict(model.named_parameters())
    del params["1.bias"]
    with pytest.raises(BaseWeightChangedError, match="removed") as caught:
        guard.check(params)
    assert caught.value.key == "1.bias"


def test_a_check_costs_microseconds_per_tensor_whatever_its_size():
    big = {f"w{i}": torch.zeros(1024, 1024) for i in range(64)}  # 256 MiB
    guard = FrozenWeights(big)
    guard.check(big)
    started = time.perf_counter()
    for _ in range(5):
        guard.check(big)
    per_check = (time.perf_counter() - started) / 5
    assert per_check < 0.05, f"{per_check * 1e3:.1f} ms for 64 tensors"
