# Copyright (c) Meta Platforms, Inc. and affiliates.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in this directory (TorchRL's LICENSE, copied with these files).
#
# Copied from pytorch/rl test/collectors/test_evaluator.py at commit ae9719f17b1517af5c2523a36c4616f003ee55cf
# (TorchRL 0.14.x): only the weight-sync tests and the module-level helpers they use;
# the tests themselves are unchanged. conftest.py runs them on weightsync's schemes.
from __future__ import annotations
from functools import partial
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Evaluator
from torchrl.modules import RandomPolicy
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv


def _make_env():
    return ContinuousActionVecMockEnv()


def _make_policy(env=None):
    if env is None:
        env = _make_env()
    obs_dim = env.observation_spec["observation"].shape[-1]
    act_dim = env.action_spec.shape[-1]
    return TensorDictModule(
        nn.Linear(obs_dim, act_dim),
        in_keys=["observation"],
        out_keys=["action"],
    )


class TestEvaluatorProcess:
    """Tests for the process-based backend.

    Note: the ``spawn`` mp context requires picklable callables, so we
    use top-level functions (``_make_env``, ``_make_policy``) rather than
    lambdas.
    """

    def test_with_weights(self):
        train_policy = _make_policy()
        evaluator = Evaluator(
            _make_env,
            policy_factory=_make_policy,
            max_steps=50,
            backend="process",
        )
        try:
            metrics = evaluator.evaluate(weights=train_policy, step=0)
            assert "eval/reward" in metrics
        finally:
            evaluator.shutdown()


class TestEvaluatorProcessBackendAsMultiCollector:
    """Tests that backend='process' uses MultiSyncCollector internally."""

    def test_process_backend_with_weights(self):
        """Process backend with weight transfer works."""
        train_policy = _make_policy()
        with torch.no_grad():
            for parameter in train_policy.parameters():
                parameter.fill_(1.25)
        evaluator = Evaluator(
            _make_env,
            policy_factory=_make_policy,
            max_steps=50,
            backend="process",
        )
        try:
            metrics = evaluator.evaluate(weights=train_policy, step=0)
            assert "eval/reward" in metrics
            worker_state = evaluator._backend._collector.state_dict()["worker0"][
                "policy_state_dict"
            ]
            for key, value in train_policy.state_dict().items():
                torch.testing.assert_close(worker_state[key], value)
        finally:
            evaluator.shutdown()

    def test_process_backend_stateless_policy_without_weights(self):
        """A stateless process policy does not initialize weight transport."""
        action_spec = _make_env().action_spec
        evaluator = Evaluator(
            _make_env,
            policy_factory=partial(RandomPolicy, action_spec),
            max_steps=50,
            backend="process",
        )
        try:
            metrics = evaluator.evaluate(step=0)
            assert "eval/reward" in metrics
            assert not evaluator._backend._collector._weight_sync_schemes
            with pytest.raises(TypeError, match="requires an nn.Module policy"):
                evaluator.evaluate(weights=TensorDict({"weight": torch.ones(())}))
        finally:
            evaluator.shutdown()

    def test_process_backend_enables_weights_after_unweighted_eval(self):
        """The first weight update rebuilds an unconfigured process collector."""
        train_policy = _make_policy()
        with torch.no_grad():
            for parameter in train_policy.parameters():
                parameter.fill_(1.25)
        evaluator = Evaluator(
            _make_env,
            policy_factory=_make_policy,
            max_steps=50,
            backend="process",
        )
        try:
            evaluator.evaluate(step=0)
            unconfigured_collector = evaluator._backend._collector
            assert not unconfigured_collector._weight_sync_schemes

            evaluator.evaluate(weights=train_policy, step=1)

            assert evaluator._backend._collector is not unconfigured_collector
            worker_state = evaluator._backend._collector.state_dict()["worker0"][
                "policy_state_dict"
            ]
            for key, value in train_policy.state_dict().items():
                torch.testing.assert_close(worker_state[key], value)
        finally:
            evaluator.shutdown()


if __name__ == "__main__":
    pytest.main([__file__, "-v", "-x"])
