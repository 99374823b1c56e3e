"""Behaviour cloning of a categorical actor over integer actions (``algo=categorical_bc``).

The offline method for datasets whose actions are a ``Discrete`` or ``MultiDiscrete``
space: cross-entropy on the first action of each sampled chunk. Trained on the successful
episodes by default, like the other BC methods (``data.success=null`` for all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from robo_post.algos.bc_flow import SupervisedPolicy
from robo_post.models.categorical import CategoricalPolicy, CategoricalPolicyConfig


class CategoricalBCConfigError(ValueError):
    """A categorical BC setting outside its range."""


@dataclass
class CategoricalBCConfig:
    """Optimisation of categorical BC.

    Attributes:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        grad_clip: max global gradient norm.
        label_smoothing: share of each target spread over all values, in [0, 1) (keeps the
            probabilities of actions the data never took above zero).
        model: ``CategoricalPolicyConfig`` settings (``embed_dim``, ``hidden_dim``).
    """

    lr: float = 1e-3
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    model: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise CategoricalBCConfigError(f"algo.label_smoothing must be in [0, 1), got {self.label_smoothing}")


class CategoricalBC(SupervisedPolicy):
    """Owns a ``CategoricalPolicy`` and its optimiser; ``update(batch)`` is one gradient step."""

    algorithm = "categorical_bc"

    def __init__(self, config: CategoricalBCConfig, model_config: CategoricalPolicyConfig,
                 device: str | torch.device = "cpu"):
        super().__init__(CategoricalPolicy(model_config).to(device), config.lr, config.weight_decay, config.grad_clip)
        self.config = config

    def update(self, batch: dict) -> dict[str, torch.Tensor]:
        """One step on a sampler batch (``obs``, integer ``actions`` (B, H[, D]): the first action is the target)."""
        self.policy.train()
        loss = self.policy.nll(batch["obs"], batch["actions"][:, 0], self.config.label_smoothing)
        return {"nll": loss.detach(), "grad_norm": self.step(loss)}
