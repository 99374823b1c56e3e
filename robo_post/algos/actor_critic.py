"""Critic-based policy extraction: a value learner paired with a policy extractor.

Each is a value learner paired with a policy extractor, both starting from a
published BC flow policy (the frozen reference):

============  ===========================================  ==============================
name          value learner (critic)                       policy extraction
============  ===========================================  ==============================
``divl_qam``  DIVL: categorical V, adaptive quantile TD    QAM (adjoint matching)
``iql_qam``   IQL: expectile V                             QAM
``fql``       FQL's TD critic (bootstrap from the actor)   FQL (one-step distillation + Q)
============  ===========================================  ==============================

All share the networks (``CriticNet``, ``FlowPolicy``), the sampler batches and
the method interface of ``robo_post.algos.registry`` (``modules``, ``optimizers``,
``update(batch)``, ``policy``, ``artifact``). Value learners take
``update(batch, next_chunks)`` (only FQL's critic bootstraps from the actor's
chunks) and actors ``update(batch, critic_fn)``. With ``best_of_n > 1`` the
published policy acts by best-of-N under the target critic (``RankedFlowPolicy``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from robo_post.algos.divl import DIVL, DIVLConfig
from robo_post.algos.fql import FQL, FQLConfig, FQLCritic, FQLCriticConfig
from robo_post.algos.iql import IQL, IQLConfig
from robo_post.algos.qam import QAM, QAMConfig
from robo_post.models.critic import CriticConfig
from robo_post.models.flow import FlowPolicy
from robo_post.models.ranked import RankedFlowPolicy


# name -> (value learner, its config, actor, its config)
PAIRS = {
    "divl_qam": (DIVL, DIVLConfig, QAM, QAMConfig),
    "iql_qam": (IQL, IQLConfig, QAM, QAMConfig),
    "fql": (FQLCritic, FQLCriticConfig, FQL, FQLConfig),
}


@dataclass
class ActorCriticConfig:
    """Settings of a critic-based extraction method (``algo=divl_qam|iql_qam|fql``).

    Attributes:
        reference_version: registry version of the BC flow the actor starts from; ``None`` = flow BC
            on the same episodes (``robo_post.learner.drivers.choose_reference``).
        critic_warmup: updates that train only the critic before the actor moves; ``None`` = half
            of the run's updates (an actor that follows a critic still far from its values moves
            the policy by the critic's noise).
        best_of_n: chunks the published policy proposes per decision (1 = plain sampling).
        n_step: chunk backups per offline TD target; ``None`` = measured from the data and the
            budget (``backup_chunks``).
        bootstrap_truncated: bootstrap time-outs (gym semantics); ``False`` makes them failures;
            ``None`` reads it per episode from its success label (``WindowSampler``).
        critic: ``CriticConfig`` overrides, e.g. ``{"use_images": False}``.
        value: overrides of the value learner's config (``v_min``/``v_max`` default to the data's range).
        actor: overrides of the actor's config.
        imitation: ``{"enabled", "roles"}``: a co-trained base imitates the successful episodes
            of these roles and every intervention step.
    """

    reference_version: int | None = None
    critic_warmup: int | None = None
    best_of_n: int = 1
    n_step: int | None = None
    bootstrap_truncated: bool | None = None
    critic: dict[str, Any] = field(default_factory=dict)
    value: dict[str, Any] = field(default_factory=dict)
    actor: dict[str, Any] = field(default_factory=dict)
    imitation: dict[str, Any] = field(default_factory=lambda: {"enabled": False, "roles": ["demo"]})


def backup_chunks(name: str, config: ActorCriticConfig, episode_lengths: Sequence[int], horizon: int,
                  gamma: float, updates: int) -> int:
    """Chunks per TD backup for ``n_step=None``, from the data and the critic's budget.

    After k target lags of K-step backups a critic holds the first k * K steps of the
    discounted return: the share 1 - gamma^(k K). Value has to travel
    D = min(3 / (1 - gamma), mean episode length) env steps back from the rewards, the
    horizon that holds 95% of it (gamma^(3 / (1 - gamma)) ~ e^-3) or the whole episode. A
    target network with EMA rate rho completes about W * rho lags in the critic's W warm-up
    updates (the whole run when there is no warm-up), so each backup must span
    K >= D / (W * rho) steps: n = ceil(K / H), between 1 and ceil(D / H). Sized for one
    horizon instead (63%), a pendulum critic ended at 69% of the held-out discounted returns.

    A critic that values its own actor's actions (FQL's) takes one chunk per backup: the
    data's later actions are not its actor's (FQL on a mixed pendulum dataset: 572 with one
    step, 314 with 4, 332 with 12; DIVL: 455, -, 797).
    """
    if not PAIRS[name][0].multi_step:
        return 1
    rate = PAIRS[name][1](**config.value).ema_rate
    mean_length = sum(episode_lengths) / max(len(episode_lengths), 1)
    distance = min(3.0 / (1.0 - gamma), mean_length) if gamma < 1 else mean_length
    backups = max((config.critic_warmup or updates) * rate, 1.0)
    return max(1, math.ceil(distance / backups / horizon))  # backups >= 1: at most ceil(D / H)


class ActorCritic:
    """A value learner and a policy extractor trained together, one step each per update.

    Args:
        name: a key of ``PAIRS``.
        reference: the BC flow policy (frozen reference; the actor starts as a copy).
        value: overrides of the value learner's config dataclass.
        actor: overrides of the actor's config dataclass.
        critic: overrides of the critic architecture (``CriticConfig``; by default it sees
            what the policy sees), e.g. ``{"use_images": False}`` for a critic without the camera.
        critic_warmup: updates that train only the critic before the actor moves.
        best_of_n: chunks the published policy proposes per decision, executing the one
            the target critic rates highest (``q_agg`` of the actor config; 1 = plain sampling).
        device: torch device.
    """

    def __init__(self, name: str, reference: FlowPolicy, value: dict[str, Any] | None = None,
                 actor: dict[str, Any] | None = None, critic_warmup: int = 0, best_of_n: int = 1,
                 device: torch.device | str = "cpu", critic: dict[str, Any] | None = None):
        if name not in PAIRS:
            raise ValueError(f"unknown algo {name!r}; choose one of {sorted(PAIRS)}")
        value_cls, value_cfg, actor_cls, actor_cfg = PAIRS[name]
        self.name = name
        self.value = value_cls(CriticConfig.like(reference.config, **(critic or {})), value_cfg(**(value or {})), device)
        for net in (self.value.net, self.value.target):  # the critic sees the state standardised like the policy
            net.set_state_stats(reference.encoder.state_mean.cpu(), reference.encoder.state_std.cpu())
        self.actor = actor_cls(reference, actor_cfg(**(actor or {})), device)
        if critic_warmup is None:  # ActorCriticConfig's None is the driver's to resolve from the budget
            raise ValueError("critic_warmup=None means half of the update budget, which `robo-post train` "
                             "resolves; pass a number of updates")
        self.critic_warmup = critic_warmup
        if best_of_n < 1:
            raise ValueError(f"best_of_n must be >= 1, got {best_of_n}")
        self.best_of_n = best_of_n
        self.updates = 0  # learner steps so far, across phases (train_loop restores it on resume)

    @property
    def policy(self) -> FlowPolicy:
        """The policy being trained (QAM's fine flow or FQL's one-step policy)."""
        return self.actor.policy

    @property
    def acting_policy(self) -> FlowPolicy | RankedFlowPolicy:
        """What the published artifact runs: ``policy``, ranked by the target critic if ``best_of_n > 1``."""
        if self.best_of_n == 1:
            return self.policy
        return RankedFlowPolicy(self.policy, self.value.target, self.best_of_n, self.actor.config.q_agg)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        modules = {"critic": self.value.net, "critic_target": self.value.target, "actor": self.policy,
                   "reference": self.actor.reference}
        if self.actor.bc is not None:  # a co-trained base resumes with the rest
            modules["base_bc"] = self.actor.bc
        return modules

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {**self.value.optimizers, "actor": self.actor.opt}

    def set_stage(self, stage: str) -> None:
        """``offline`` or ``online``: DIVL switches tau_base; the others have no stage settings."""
        self.value.set_stage(stage)

    def update(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        self.updates += 1
        metrics = self.value.update(batch, self.actor.next_chunks)
        if self.updates > self.critic_warmup:
            metrics.update(self.actor.update(batch, self.value.critic_fn(self.actor.config.q_net)))
        return metrics

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The trained policy as a registry artifact: kind ``flow`` (``FlowPolicy`` weights + JSON),
        or ``flow_ranked`` (flow + target critic) when ``best_of_n > 1``."""
        return self.acting_policy.artifact(**{"algorithm": self.name, **provenance})
