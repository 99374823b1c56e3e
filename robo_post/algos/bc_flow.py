"""Flow-matching behaviour cloning of action chunks (docs/methods.md, "Flow-matching BC").

The BC policy is the reference policy that QAM later fine-tunes, and the
baseline every other method is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from robo_post.models.flow import FlowPolicy, FlowPolicyConfig


@dataclass
class BCFlowConfig:
    """Optimisation of flow BC.

    Attributes:
        lr: Adam learning rate.
        weight_decay: AdamW weight decay.
        grad_clip: max global gradient norm.
        model: ``FlowPolicyConfig`` architecture settings (``embed_dim``, ``hidden_dim``, ``flow_steps``).
    """

    lr: float = 3e-4
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    model: dict[str, Any] = field(default_factory=dict)


def base_bc_loss(base: FlowPolicy, batch: dict) -> torch.Tensor:
    """Flow-matching loss of a co-trained base (QAM's and FQL's ``base = ema_cotrained``) on
    ``batch["imitation"]`` when the learner supplies it (``robo_post.store.ImitationSampler``:
    demonstrations and interventions), else on the batch itself."""
    data = batch.get("imitation", batch)
    return base.bc_loss(data["obs"], data["actions"], data.get("action_mask"))


class SupervisedPolicy:
    """One policy fitted by a supervised loss: its AdamW optimiser, checkpoint view and gradient step.

    Subclasses set ``algorithm`` and define ``update(batch)`` as ``self.step(loss)``.
    """

    algorithm = ""

    def __init__(self, policy: torch.nn.Module, lr: float, weight_decay: float, grad_clip: float):
        self.policy = policy
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
            fused=True,  # one kernel, and no per-step host read of the step count
        )

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.policy}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"policy": self.optimizer}

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.policy.artifact(**{"algorithm": self.algorithm, **provenance})

    def step(self, loss: torch.Tensor) -> torch.Tensor:
        """One clipped gradient step on ``loss``; returns the gradient norm (0-d, on the device)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip)
        self.optimizer.step()
        return grad_norm.detach()


class BCFlow(SupervisedPolicy):
    """Owns a ``FlowPolicy`` and its optimiser; ``update(batch)`` is one gradient step."""

    algorithm = "bc_flow"

    def __init__(self, config: BCFlowConfig, model_config: FlowPolicyConfig, device: str | torch.device = "cpu"):
        super().__init__(FlowPolicy(model_config).to(device), config.lr, config.weight_decay, config.grad_clip)
        self.config = config

    def update(self, batch: dict) -> dict[str, torch.Tensor]:
        """One step on a sampler batch (``obs``, ``actions`` (B, H, A), ``action_mask`` (B, H))."""
        self.policy.train()
        loss = self.policy.bc_loss(batch["obs"], batch["actions"], batch["action_mask"])
        return {"bc_loss": loss.detach(), "grad_norm": self.step(loss)}
