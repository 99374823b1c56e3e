"""FQL: Flow Q-Learning policy extraction, the one-step baseline of QAM (docs/methods.md, "FQL"; FQL paper).

A one-step policy mu(s, eps) maps noise straight to an action chunk. It is
distilled from the multi-step reference flow on the same noise and pushed up the
critic:

    L(mu) = alpha * E ||mu(s, eps) - clip(ODE_beta(s, eps))||^2 - E[Q(s, clip(mu(s, eps)))]

By default the reference is the frozen BC flow, as for QAM in LWD; ``base =
ema_cotrained`` co-trains a BC flow and distills from its EMA, as the FQL paper does.
The actor reads its critic through the same ``critic_fn(obs, normalised_chunk) ->
(E, B)`` hand-off as QAM, so it can sit on any critic; ``FQLCritic`` is FQL's own: plain TD whose bootstrap action is the
one-step policy's chunk at the next state, y = r + gamma^H * agg_j Q'_j(s', mu(s', eps)).

The one-step policy reuses the ``FlowPolicy`` architecture: mu(s, eps) = eps +
v_mu(s, eps, 0), i.e. a single Euler step, initialised from the reference.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from robo_post.algos.bc_flow import base_bc_loss
from robo_post.algos.divl import CriticFn, td_target, twin_critic_fn, weighted_mean
from robo_post.algos.qam import batch_q_scale, pinned_q_scale
from robo_post.models.critic import CriticConfig, CriticNet, aggregate_heads, ema_update
from robo_post.models.flow import FlowPolicy


@dataclass
class FQLConfig:
    """FQL hyperparameters.

    Attributes:
        alpha: distillation (behaviour-constraint) weight; FQL tunes it per domain
            (10 to 1000 on OGBench).
        q_scale: Q units the Q term is divided by, so ``alpha`` means the same on any reward scale.
            ``None`` (default) measures it on every batch as the spread of Q over the reference's
            own chunks at the batch's states (``robo_post.algos.qam.q_spread``), floored by the
            critic heads' disagreement (``q_resolution``); a number pins it
            (FQL's code divides by the batch mean |Q| instead).
        q_agg: ``mean`` or ``min`` over critic heads.
        lr: Adam learning rate (FQL: 3e-4).
        grad_clip: global gradient-norm clip; 0 disables it (FQL has none).
        q_net: critic the actor climbs: ``online`` (FQL code) or ``target``.
        base: ``frozen`` reference, or ``ema_cotrained``: a BC flow trained on the batch
            (or its ``imitation`` part, ``lwd.imitation``) whose EMA is the reference.
        ema_rate: EMA rate of the reference when ``base = ema_cotrained``.
    """

    alpha: float = 10.0
    q_scale: float | None = None
    q_agg: str = "mean"
    lr: float = 3e-4
    grad_clip: float = 0.0
    q_net: str = "online"
    base: str = "frozen"
    ema_rate: float = 0.005


class FQL:
    """One-step policy distilled from a frozen reference flow and steered by a critic.

    Args:
        reference: the BC flow policy (copied and frozen).
        config: ``FQLConfig``.
        device: torch device.
    """

    def __init__(self, reference: FlowPolicy, config: FQLConfig | None = None, device: torch.device | str = "cpu"):
        self.config = config or FQLConfig()
        if self.config.q_agg not in ("mean", "min"):
            raise ValueError(f"q_agg must be 'mean' or 'min', got {self.config.q_agg!r}")
        if self.config.base not in ("frozen", "ema_cotrained"):
            raise ValueError(f"base must be 'frozen' or 'ema_cotrained', got {self.config.base!r}")
        self.device = torch.device(device)
        self.q_scale = pinned_q_scale(self.config.q_scale, self.device)
        self.reference = copy.deepcopy(reference).to(self.device).requires_grad_(False)
        self.one_step = copy.deepcopy(reference).to(self.device).requires_grad_(True)
        # A FlowPolicy with one Euler step samples exactly mu(s, eps) = eps + v(s, eps, 0), clipped.
        self.one_step.config = dataclasses.replace(reference.config, flow_steps=1)
        self.params = list(self.one_step.parameters())
        self.bc = None
        if self.config.base == "ema_cotrained":
            self.bc = copy.deepcopy(reference).to(self.device).requires_grad_(True)
            self.params += list(self.bc.parameters())
        self.opt = torch.optim.Adam(self.params, lr=self.config.lr, fused=True)
        self.steps = 0

    @property
    def policy(self) -> FlowPolicy:
        """The policy being trained: the one-step flow."""
        return self.one_step

    def one_step_actions(self, obs: dict[str, Any], noise: torch.Tensor) -> torch.Tensor:
        """mu(s, eps): normalised, unclipped chunks (B, H, A) from noise (B, H, A)."""
        z = self.one_step.encode(obs)
        return noise + self.one_step.velocity(z, noise, torch.zeros(noise.shape[0], device=self.device))

    def update(self, batch: dict[str, Any], critic_fn: CriticFn) -> dict[str, torch.Tensor]:
        """One actor step on a sampler batch (uses ``obs`` and the chunk shape of ``actions``)."""
        cfg, obs = self.config, batch["obs"]
        noise = torch.randn(batch["actions"].shape, device=self.device)
        with torch.no_grad():
            target = self.reference.normalize_actions(self.reference.sample(obs, noise=noise))  # clipped ODE endpoint
        actions = self.one_step_actions(obs, noise)
        distill = (actions - target).pow(2).mean()
        qs = critic_fn(obs, actions.clamp(-1.0, 1.0))
        q = aggregate_heads(qs, cfg.q_agg)
        q_scale = batch_q_scale(self.q_scale, critic_fn, self.reference, obs, None, cfg.q_agg,
                                self.reference.normalize_actions(batch["actions"].to(self.device)))
        q_loss = -q.mean() / q_scale
        loss = cfg.alpha * distill + q_loss
        metrics = {"distill_loss": distill.detach(), "q_loss": q_loss.detach(), "q_mean": q.mean().detach(),
                   "q_scale": q_scale.detach()}
        if self.bc is not None:
            bc_base = base_bc_loss(self.bc, batch)
            loss = loss + bc_base
            metrics["bc_loss_base"] = bc_base.detach()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.opt.step()
        if self.bc is not None:
            ema_update(self.reference, self.bc, cfg.ema_rate)
        self.steps += 1
        return metrics

    @torch.no_grad()
    def next_chunks(self, obs: dict[str, Any]) -> torch.Tensor:
        """Clipped normalised one-step chunks (B, H, A) at ``obs``: FQL's bootstrap action."""
        c = self.one_step.config
        B = len(next(v for v in obs.values() if isinstance(v, torch.Tensor)))
        return self.one_step_actions(obs, torch.randn(B, c.horizon, c.action_dim, device=self.device)).clamp(-1.0, 1.0)

    @torch.no_grad()
    def act(self, obs: dict[str, Any], noise: torch.Tensor | None = None) -> torch.Tensor:
        """Action chunks (B, H, A) in env units from one network evaluation, clipped."""
        if noise is None:
            B = len(next(v for v in obs.values() if isinstance(v, torch.Tensor)))
            c = self.one_step.config
            noise = torch.randn(B, c.horizon, c.action_dim, device=self.device)
        return self.one_step.unnormalize_actions(self.one_step_actions(obs, noise.to(self.device)).clamp(-1.0, 1.0))


@dataclass
class FQLCriticConfig:
    """FQL's critic (``seohongpark/fql`` defaults).

    Attributes:
        lr: Adam learning rate.
        ema_rate: target-network EMA rate.
        q_agg: ``mean`` (FQL default) or ``min`` (FQL on antmaze) over the target heads.
    """

    lr: float = 3e-4
    ema_rate: float = 0.005
    q_agg: str = "mean"


class FQLCritic:
    """Twin Q (no value head) trained by TD with the actor's next chunk as the bootstrap action.

    Args:
        critic: architecture (same ``CriticNet`` as DIVL and IQL, ``value_outputs = 0``).
        config: ``FQLCriticConfig``.
        device: torch device.
    """

    # It values its own actor's actions, so a backup through several of the data's actions is
    # biased towards the behaviour: one chunk per backup (``backup_chunks``).
    multi_step = False

    def __init__(self, critic: CriticConfig, config: FQLCriticConfig | None = None, device: torch.device | str = "cpu"):
        self.config = config or FQLCriticConfig()
        if self.config.q_agg not in ("mean", "min"):
            raise ValueError(f"q_agg must be 'mean' or 'min', got {self.config.q_agg!r}")
        self.device = torch.device(device)
        self.net = CriticNet(critic, 0).to(self.device)
        self.target = copy.deepcopy(self.net).requires_grad_(False)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=self.config.lr, fused=True)
        self.net.adopt_legacy_optimizer_state(self.opt)  # checkpoints from before the stacked Q ensemble
        self.steps = 0
        self.td_error: torch.Tensor | None = None  # |TD error| (B,) of the last update

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"critic": self.opt}

    def set_stage(self, stage: str) -> None:
        """FQL's critic has no per-stage settings."""

    def update(self, batch: dict[str, Any], next_chunks: Any) -> dict[str, torch.Tensor]:
        """One TD step; ``next_chunks(obs) -> (B, H, A)`` normalised chunks from the actor."""
        net, target = self.net, self.target
        with torch.no_grad():
            qs_next = target.q(target.encode(batch["next_obs"]), next_chunks(batch["next_obs"]))
            q_next = aggregate_heads(qs_next, self.config.q_agg)
            y = td_target(batch["rewards"].to(self.device).float(), batch["discounts"].to(self.device).float(), q_next)
        q = net.q(net.encode(batch["obs"]), net.normalize_actions(batch["actions"]))
        loss = weighted_mean((q - y).pow(2), batch.get("weights")).sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        ema_update(target, net, self.config.ema_rate)
        self.steps += 1
        self.td_error = (y - q.detach().mean(0)).abs()  # (B,) base priorities for prioritized replay
        return {"loss_q": loss.detach(), "q_mean": q.mean().detach(), "td_target_mean": y.mean().detach()}

    def critic_fn(self, net: str = "online") -> CriticFn:
        """``critic_fn(obs, normalised_chunk) -> (2, B)``, differentiable in the chunk only."""
        return twin_critic_fn(self.net, self.target, net)
