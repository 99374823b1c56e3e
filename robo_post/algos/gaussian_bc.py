"""Maximum-likelihood behaviour cloning of a diagonal-Gaussian actor (``algo=gaussian_bc``).

What steering composes: a frozen actor of this kind, or a goal-conditioned prior
learned from store data whose std is fitted, not assumed. Trained on the first
action of each sampled chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

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


class GaussianBC:
    """Owns a ``GaussianPolicy`` and its optimiser; ``update(batch)`` is one gradient step."""

    def __init__(self, config: GaussianBCConfig, model_config: GaussianPolicyConfig, device: str | torch.device = "cpu"):
        self.config = config
        self.policy = GaussianPolicy(model_config).to(device)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=config.lr, weight_decay=config.weight_decay,
            fused=True)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.policy}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"policy": self.optimizer}

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.policy.artifact(**{"algorithm": "gaussian_bc", **provenance})

    def update(self, batch: dict) -> dict[str, torch.Tensor]:
        """One step on a sampler batch (``obs``, ``actions`` (B, H, A): the first action is the target)."""
        self.policy.train()
        loss = self.policy.nll(batch["obs"], batch["actions"][:, 0])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.grad_clip)
        self.optimizer.step()
        return {"nll": loss.detach(), "grad_norm": grad_norm.detach()}
