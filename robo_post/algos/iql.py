"""IQL value learning: the baseline DIVL replaces (docs/methods.md, "IQL baseline").

Same networks, data, update order and critic hand-off as DIVL (``ValueLearner``);
only the value step differs: a scalar V regressed with the asymmetric loss
rho_{tau,p}(Q_target_min(s, a) - V(s)) on replay actions, and V(s') used as is in
the TD target ``rewards + discounts * V(next_obs)``.

``loss_power = 2`` is IQL's expectile regression. ``loss_power = 1`` is the pinball
loss, which by LWD's Proposition 1 (docs/methods.md, "DIVL: relation to IQL") has the
same optimum as DIVL at a fixed tau (docs/methods.md, "Demonstrations: E2", check e).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from robo_post.algos.divl import ValueLearner, ValueLearnerConfig, asymmetric_loss
from robo_post.models.critic import CriticConfig


@dataclass
class IQLConfig(ValueLearnerConfig):
    """IQL hyperparameters (plus the shared optimisation settings).

    Attributes:
        expectile: tau of the asymmetric loss (``seohongpark/fql`` default 0.9; IQL
            paper 0.7 for locomotion, 0.9 for AntMaze).
        loss_power: p of rho_{tau,p}: 2 expectile (IQL), 1 pinball (Proposition 1).
    """

    expectile: float = 0.9
    loss_power: int = 2


class IQL(ValueLearner):
    """IQL value learner with the twin scalar critic of DIVL."""

    def __init__(self, critic: CriticConfig, config: IQLConfig | None = None, device: torch.device | str = "cpu"):
        config = config or IQLConfig()
        if config.loss_power not in (1, 2):
            raise ValueError(f"loss_power must be 1 or 2, got {config.loss_power}")
        super().__init__(critic, config, 1, device)

    def value_loss(self, v_out: torch.Tensor, q_label: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """E[rho_{tau,p}(Q_target_min(s, a) - V(s))] (LWD Eq. 3-4)."""
        v = v_out.squeeze(-1)
        loss = asymmetric_loss(q_label - v, self.config.expectile, self.config.loss_power).mean()
        return loss, {"v_mean": v.mean().detach()}

    def bootstrap(self, v_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """V(s') itself (LWD Eq. 5)."""
        v = v_out.squeeze(-1)
        return v, {"v_next_mean": v.mean().detach()}
