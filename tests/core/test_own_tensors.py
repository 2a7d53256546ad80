"""OwnTensors: one walk of the module tree, walked again exactly when the tree changed."""

from __future__ import annotations

import torch

from weightsync.core.own_tensors import OwnTensors


def make_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


def test_an_unchanged_model_is_walked_once_and_matches_its_state_dict():
    model = make_model()
    own = OwnTensors(model)
    for _ in range(5):
        found = own.get()
        assert found.keys() == model.state_dict().keys()
        assert all(found[k] is t for k, t in model.state_dict(keep_vars=True).items())
    assert own.walks == 1


def test_a_load_with_assign_is_seen():
    model = make_model()
    own = OwnTensors(model)
    before = own.get()
    model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()},
                          assign=True)
    after = own.get()
    assert after["0.weight"] is model[0].weight and after["0.weight"] is not before["0.weight"]


def test_a_replaced_submodule_is_seen_through_setattr_and_through_its_parents_dict():
    model = make_model()
    own = OwnTensors(model)
    own.get()
    model[2] = torch.nn.Linear(8, 2)
    assert own.get()["2.weight"] is model[2].weight
    model._modules["2"] = torch.nn.Linear(8, 2)  # no registration hook runs here
    assert own.get()["2.weight"] is model[2].weight


def test_buffers_replaced_by_a_dtype_round_trip_are_seen():
    model = make_model()
    own = OwnTensors(model)
    old = own.get()["1.running_mean"]
    model.double().float()  # replaces each buffer in its owner's dict, with no hook
    new = own.get()["1.running_mean"]
    assert new is model[1].running_mean and new is not old


def test_a_deleted_or_added_tensor_changes_the_names():
    model = make_model()
    own = OwnTensors(model)
    own.get()
    del model[0].bias
    assert "0.bias" not in own.get()
    model[0].register_buffer("extra", torch.ones(1))
    assert "0.extra" in own.get()


def test_a_model_whose_state_dict_renames_its_tensors_is_walked_at_every_call():
    model = make_model()

    def rename(module, state, prefix, local_metadata):
        for key in list(state):
            state["renamed." + key] = state.pop(key)

    model._register_state_dict_hook(rename)
    own = OwnTensors(model)
    assert all(k.startswith("renamed.") for k in own.get())
    own.get()
    assert own.walks == 2


def test_a_change_to_another_model_costs_a_walk_but_changes_nothing():
    model = make_model()
    own = OwnTensors(model)
    first = own.get()
    make_model()  # registering anyone's parameters bumps the shared counter
    assert own.get() == first and own.walks == 2
