"""A diagonal-Gaussian actor: observation features -> N(mean, diag std^2) over one action.

The policy kind that steering composes exactly (``robo_post.steering``, whose rules take
and return the ``Gaussian`` defined here), and the form of a learned goal-conditioned
prior whose variance is honest: trained by maximum likelihood, its std is the spread of
the data's actions at a state, not a constant.
Means and stds are in env action units; the network works in actions mapped to
[-1, 1] by the bounds (saved with the weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from robo_post.models.encoders import BoundedActions, ObservationEncoder, PublishedModel, SeededRunner, mlp, obs_batch
from robo_post.models.features import Feature, FeatureConfigJSON

ARTIFACT_KIND = "gaussian"


@dataclass(frozen=True)
class Gaussian:
    """A diagonal Gaussian over actions: ``mean`` and ``log_std`` (..., A)."""

    mean: torch.Tensor
    log_std: torch.Tensor

    @property
    def std(self) -> torch.Tensor:
        return self.log_std.exp()

    @property
    def precision(self) -> torch.Tensor:
        return torch.exp(-2.0 * self.log_std)


@dataclass
class GaussianPolicyConfig(FeatureConfigJSON):
    """Architecture of a Gaussian actor; saved as JSON beside its weights.

    Attributes:
        features: observation key -> ``Feature`` the model reads.
        action_dim: size of one action.
        use_text: encode ``obs["instruction"]`` with the frozen MiniLM encoder.
        embed_dim / hidden_dim: widths of the modality embeddings and the MLP.
        action_low / action_high: env action bounds (the network's [-1, 1]).
        log_std_min / log_std_max: clamp of the log std in normalised units (keeps the
            likelihood bounded on repeated actions).
    """

    features: dict[str, Feature]
    action_dim: int
    use_text: bool = False
    embed_dim: int = 64
    hidden_dim: int = 256
    action_low: list[float] = field(default_factory=list)
    action_high: list[float] = field(default_factory=list)
    log_std_min: float = -5.0
    log_std_max: float = 1.0


class GaussianPolicy(PublishedModel, BoundedActions, nn.Module):
    """Observation encoder + MLP head to a state-dependent mean and log std."""

    artifact_kind, config_class = ARTIFACT_KIND, GaussianPolicyConfig

    def __init__(self, config: GaussianPolicyConfig):
        super().__init__()
        self.config = c = config
        self.encoder = ObservationEncoder(c.features, c.use_text, c.embed_dim, c.hidden_dim)
        self.head = mlp([c.hidden_dim, c.hidden_dim, 2 * c.action_dim])
        self.register_action_bounds(c.action_low, c.action_high, c.action_dim)

    def set_state_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        self.encoder.set_state_stats(mean, std)

    def _normalised(self, obs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.head(self.encoder(obs)).chunk(2, dim=-1)
        return mean, log_std.clamp(self.config.log_std_min, self.config.log_std_max)

    def distribution(self, obs: dict[str, Any]) -> Gaussian:
        """The action distribution at a batch of observations, in env units (B, A)."""
        mean, log_std = self._normalised(obs)
        half = 0.5 * (self.action_high - self.action_low)
        return Gaussian(self.action_low + (mean + 1.0) * half, log_std + torch.log(half))

    def nll(self, obs: dict[str, Any], actions: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood (per action dim) of env-unit actions (B, A)."""
        mean, log_std = self._normalised(obs)
        half = 0.5 * (self.action_high - self.action_low)
        x = (actions.to(self.device) - self.action_low) / half - 1.0
        z = (x - mean) * torch.exp(-log_std)
        return (0.5 * z.pow(2) + log_std + 0.5 * math.log(2 * math.pi)).mean()


class GaussianPolicyRunner(SeededRunner):
    """Fleet ``Policy`` over a Gaussian actor: its mean (``deterministic``) or a sample seeded per episode."""

    @torch.no_grad()
    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        c = self.model.config
        dist = self.model.distribution(obs_batch(obs, c.features, c.use_text, env))
        action = dist.mean if self.deterministic else (
            dist.mean + dist.std * torch.randn(dist.mean.shape, generator=self.generator, device=dist.mean.device))
        return action[0].cpu().numpy()
