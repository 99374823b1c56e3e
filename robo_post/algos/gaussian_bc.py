"""Maximum-likelihood behaviour cloning of a diagonal-Gaussian actor (``algo=gaussian_bc``).

What steering composes: a frozen actor of this kind, or a goal-conditioned prior
learned from store data whose std is fitted, not assumed. Trained on the first
action of each sampled chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from robo_post.algos.bc_flow import SupervisedPolicy
from robo_post.models.gaussian import GaussianPolicy, GaussianPolicyConfig


@dataclass
class GaussianBCConfig:
    """Optimisation of Gaussian BC.

    Attributes:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        grad_clip: max global gradient norm.
        model: ``GaussianPolicyConfig`` settings (``embed_dim``, ``hidden_dim``, ``log_std_min``, ...).
    """

    lr: float = 1e-3
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    model: dict[str, Any] = field(default_factory=dict)


class GaussianBC(SupervisedPolicy):
    """Owns a ``GaussianPolicy`` and its optimiser; ``update(batch)`` is one gradient step."""

    algorithm = "gaussian_bc"

    def __init__(self, config: GaussianBCConfig, model_config: GaussianPolicyConfig, device: str | torch.device = "cpu"):
        super().__init__(GaussianPolicy(model_config).to(device), config.lr, config.weight_decay, config.grad_clip)
        self.config = config

    def update(self, batch: dict) -> dict[str, torch.Tensor]:
        """One step on a sampler batch (``obs``, ``actions`` (B, H, A): the first action is the target)."""
        self.policy.train()
        loss = self.policy.nll(batch["obs"], batch["actions"][:, 0])
        return {"nll": loss.detach(), "grad_norm": self.step(loss)}
