"""Feature extractors for SB3 policies, chosen by name in ``policy_kwargs``.

SB3 takes ``features_extractor_class`` as a Python class, which a JSON config or a
published artifact cannot hold. Here a name stands for it (``"spatial_conv"``) and
``resolve_policy_kwargs`` turns the name into the class when the agent is built, so
the artifact keeps the name and rebuilds the same network.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import torch
from stable_baselines3.common.preprocessing import get_flattened_obs_dim
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn


class SpatialConv(BaseFeaturesExtractor):
    """Convolutions over the last two axes of every Box key with 3 or more axes; the
    leading axes are channels (a ``(2, 5, n, n)`` grid observation is 10 planes of
    n x n). 'Same' padding keeps small grids at their size, so the flattened maps keep
    where things are while every unit sees its neighbourhood: a coin next to the agent
    looks alike in every world, which a flat MLP has to learn cell by cell. Other keys
    are flattened and appended.

    Args:
        observation_space: a Box or a Dict of Boxes.
        channels: output channels of each convolution (ReLU after each).
        kernel: odd kernel size.
    """

    def __init__(self, observation_space: gym.Space, channels: Sequence[int] = (32, 64), kernel: int = 3):
        spaces = observation_space.spaces if isinstance(observation_space, gym.spaces.Dict) else {None: observation_space}
        if kernel % 2 != 1:
            raise ValueError(f"spatial_conv kernel must be odd (same padding), got {kernel}")
        branches, dim = {}, 0
        for key, space in spaces.items():
            shape = space.shape or ()
            if len(shape) >= 3:
                layers, c = [], math.prod(shape[:-2])
                for out in channels:
                    layers += [nn.Conv2d(c, int(out), kernel, padding=kernel // 2), nn.ReLU()]
                    c = int(out)
                branches[str(key)] = nn.Sequential(*layers, nn.Flatten())
                dim += c * shape[-2] * shape[-1]
            else:
                branches[str(key)] = nn.Flatten()
                dim += get_flattened_obs_dim(space)
        if not any(len(s.shape or ()) >= 3 for s in spaces.values()):
            raise ValueError(f"spatial_conv needs an observation key with 3 or more axes, got {observation_space}")
        super().__init__(observation_space, dim)
        self.keys = list(spaces)
        self.shapes = {str(k): s.shape for k, s in spaces.items()}
        self.branches = nn.ModuleDict(branches)

    def forward(self, obs: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        parts = []
        for key in self.keys:
            x = (obs if key is None else obs[key]).float()
            shape = self.shapes[str(key)]
            if len(shape) >= 3:
                x = x.reshape(len(x), -1, *shape[-2:])
            parts.append(self.branches[str(key)](x))
        return torch.cat(parts, 1)


FEATURE_EXTRACTORS: dict[str, type[BaseFeaturesExtractor]] = {"spatial_conv": SpatialConv}


def resolve_policy_kwargs(hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of SB3 ``hyperparameters`` whose ``policy_kwargs.features_extractor_class``,
    if it is a name, is replaced by its class (``ValueError`` naming the choices if unknown).
    The copy also keeps SB3 (A2C writes its optimiser class into ``policy_kwargs``) from
    changing a config that must stay JSON."""
    hyper = copy.deepcopy(hyperparameters)
    kwargs = hyper.get("policy_kwargs") or {}
    name = kwargs.get("features_extractor_class")
    if isinstance(name, str):
        if name not in FEATURE_EXTRACTORS:
            raise ValueError(f"unknown features_extractor_class {name!r}; choose one of {sorted(FEATURE_EXTRACTORS)}")
        kwargs["features_extractor_class"] = FEATURE_EXTRACTORS[name]
    return hyper
