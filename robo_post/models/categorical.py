"""A categorical actor over integer actions: observation features -> one softmax per
action dimension (one for ``Discrete(n)``, one per entry of a ``MultiDiscrete``).

The discrete counterpart of the Gaussian actor: what behaviour cloning of a dataset with
integer actions (CartPole-like control, grid worlds, meta-action drivers) trains and the
fleet deploys. Each dimension ``d`` takes the values ``action_low[d] .. action_high[d]``
(gymnasium's ``start`` and ``start + n - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from robo_post.models.encoders import ObservationEncoder, PublishedModel, SeededRunner, mlp, obs_batch
from robo_post.models.features import Feature, FeatureConfigJSON

ARTIFACT_KIND = "categorical"


class CategoricalActionError(ValueError):
    """The action bounds do not describe integer actions (or name no action at all)."""


@dataclass
class CategoricalPolicyConfig(FeatureConfigJSON):
    """Architecture of a categorical actor; saved as JSON beside its weights.

    Attributes:
        features: observation key -> ``Feature`` the model reads.
        action_low / action_high: per action dimension, the lowest and highest integer action.
        use_text: encode ``obs["instruction"]`` with the frozen MiniLM encoder.
        embed_dim / hidden_dim: widths of the modality embeddings and the MLP.
    """

    features: dict[str, Feature]
    action_low: list[int]
    action_high: list[int]
    use_text: bool = False
    embed_dim: int = 64
    hidden_dim: int = 256

    def __post_init__(self) -> None:
        low, high = list(self.action_low), list(self.action_high)
        if not low or len(low) != len(high) or any(int(v) != v for v in low + high) or \
                any(h < lo for lo, h in zip(low, high)):
            raise CategoricalActionError(f"a categorical actor needs integer action bounds low <= high per dimension, "
                                         f"got low={low} high={high}")
        self.action_low, self.action_high = [int(v) for v in low], [int(v) for v in high]

    @property
    def sizes(self) -> list[int]:
        """Number of values of each action dimension."""
        return [h - lo + 1 for lo, h in zip(self.action_low, self.action_high)]


class CategoricalPolicy(PublishedModel, nn.Module):
    """Observation encoder + MLP head to the logits of every action dimension."""

    artifact_kind, config_class = ARTIFACT_KIND, CategoricalPolicyConfig

    def __init__(self, config: CategoricalPolicyConfig):
        super().__init__()
        self.config = c = config
        self.encoder = ObservationEncoder(c.features, c.use_text, c.embed_dim, c.hidden_dim)
        self.head = mlp([c.hidden_dim, c.hidden_dim, sum(c.sizes)])
        self.register_buffer("action_low", torch.tensor(c.action_low, dtype=torch.int64))

    @property
    def device(self) -> torch.device:
        return self.action_low.device

    def set_state_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        self.encoder.set_state_stats(mean, std)

    def logits(self, obs: dict[str, Any]) -> list[torch.Tensor]:
        """Per action dimension, the logits (B, n_d) over its values ``low_d .. high_d``."""
        return list(self.head(self.encoder(obs)).split(self.config.sizes, dim=-1))

    def nll(self, obs: dict[str, Any], actions: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        """Mean cross-entropy (per action dimension) of integer actions (B,) or (B, D)."""
        index = actions.to(self.device).reshape(len(actions), -1) - self.action_low
        losses = [F.cross_entropy(logits, index[:, d], label_smoothing=label_smoothing)
                  for d, logits in enumerate(self.logits(obs))]
        return torch.stack(losses).mean()

    @torch.no_grad()
    def act(self, obs: dict[str, Any], generator: torch.Generator | None = None) -> torch.Tensor:
        """Integer actions (B, D): each dimension's most likely value, or a sample when ``generator`` is given."""
        picks = [logits.argmax(-1) if generator is None else
                 torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0] for logits in self.logits(obs)]
        return torch.stack(picks, dim=-1) + self.action_low


class CategoricalPolicyRunner(SeededRunner):
    """Fleet ``Policy`` over a categorical actor: its most likely action (``deterministic``) or a
    sample seeded per episode, shaped as the env's action space (a scalar for ``Discrete``)."""

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        c = self.model.config
        action = self.model.act(obs_batch(obs, c.features, c.use_text, env),
                                None if self.deterministic else self.generator)
        return action[0].cpu().numpy().reshape(env.action_space.shape)

