"""Policies and env factories for the TorchRL collector tests (importable by spawned workers)."""

from __future__ import annotations

import torch
from torch import nn


def make_cartpole() -> object:
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


class VersionProbe(nn.Module):
    """A CartPole policy whose output tells which weights computed it: every weight of
    version v holds the value v, and each step reports the min and max of all its weights."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width, 4))
        self.register_buffer("stat", torch.zeros(width))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = torch.cat([self.weight.detach().reshape(-1), self.stat])
        lo, hi = flat.min(), flat.max()
        # push right when the pole leans right: keeps episodes going, whatever the weights
        right = (observation[..., 2] > 0).long()
        action = nn.functional.one_hot(right, 2).to(torch.int64)
        shape = observation.shape[:-1]
        return action, lo.expand(shape).clone(), hi.expand(shape).clone()


def make_probe_policy() -> nn.Module:
    from tensordict.nn import TensorDictModule

    return TensorDictModule(VersionProbe(), in_keys=["observation"],
                            out_keys=["action", "probe_min", "probe_max"])


@torch.no_grad()
def fill_(policy: nn.Module, value: float) -> None:
    """Write ``value`` into every weight of ``policy`` (the trainer's "new version")."""
    for tensor in policy.state_dict(keep_vars=True).values():
        tensor.data.fill_(value)


def make_filled_probe(value: float, width: int = 256) -> nn.Module:
    """A probe policy whose weights all hold ``value`` (a per-worker factory, with
    ``functools.partial``; ``width`` sets its layout)."""
    from tensordict.nn import TensorDictModule

    probe = VersionProbe(width)
    with torch.no_grad():
        probe.weight.fill_(value)
        probe.stat.fill_(value)
    return TensorDictModule(probe, in_keys=["observation"],
                            out_keys=["action", "probe_min", "probe_max"])
