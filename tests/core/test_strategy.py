import pytest
import torch
from tensordict import TensorDict

from weightsync import SchemaMismatchError, WeightStrategy
from weightsync.core.strategy import flat_tensors


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def test_module_weights_include_buffers():
    names = set(flat_tensors(model()))
    assert {"0.weight", "0.bias", "1.weight", "1.running_mean", "1.running_var",
            "1.num_batches_tracked"} <= names


@pytest.mark.parametrize("extract_as", ["tensordict", "state_dict"])
def test_extract_then_apply_round_trip(extract_as):
    strategy = WeightStrategy(extract_as=extract_as)
    src, dst = model(), model()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1)
        src[1].running_mean.fill_(3)
    weights = strategy.extract_weights(src)
    assert isinstance(weights, TensorDict if extract_as == "tensordict" else dict)
    strategy.apply_weights(dst, weights)
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_apply_into_tensordict_and_mapping():
    strategy = WeightStrategy()
    td = TensorDict.from_module(model())
    flat = {k: torch.zeros_like(v) for k, v in flat_tensors(td).items()}
    strategy.apply_weights(flat, td)
    assert all(torch.equal(flat[k], v) for k, v in flat_tensors(td).items())
    target = td.clone().zero_()
    strategy.apply_weights(target, td)
    assert (target == td).all()


def test_apply_mismatch_leaves_destination_untouched():
    dst = model()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    bad = {k: v.clone() + 1 for k, v in dst.state_dict().items()}
    bad["1.running_var"] = torch.ones(5)
    with pytest.raises(SchemaMismatchError) as info:
        WeightStrategy().apply_weights(dst, bad)
    assert info.value.key == "1.running_var"
    assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items())


def test_unsupported_types_raise_type_error_saying_what_is_accepted():
    with pytest.raises(TypeError, match="nn.Module, a TensorDictBase or a Mapping"):
        WeightStrategy().extract_weights([torch.zeros(1)])
    with pytest.raises(TypeError, match="'w'"):
        flat_tensors({"w": "not a tensor"})
    with pytest.raises(ValueError, match="extract_as"):
        WeightStrategy(extract_as="numpy")  # type: ignore[arg-type]
