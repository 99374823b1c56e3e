"""DIVL: Distributional Implicit Value Learning (docs/methods.md, "DIVL").

DIVL fits, per state, a categorical distribution over the target-critic values
of the *replay* actions, reads a tau-quantile of it as the TD bootstrap
("DIVL: quantile read-out") and sets tau per bootstrap state from the
distribution's normalised entropy ("DIVL: adaptive quantile bootstrap"). Q stays a
scalar trained with MSE: this is not distributional RL, and no max over
out-of-support actions is ever taken.

Batches come from ``robo_post.store.sampler.WindowSampler``. The n-step chunk
backup (docs/methods.md, "Chunked TD targets") lives there: ``rewards`` is the
discounted n-chunk reward and ``discounts`` is ``gamma^(nH) * alive_n`` (0 when the episode
terminated inside the window), so the critic target is always
``rewards + discounts * Quant_tau(V(next_obs))``. Chunks that run past the episode
end keep the sampler's padding (last action repeated) as the critic input.

The update skeleton (V step, TD target, Q step, target EMA; LWD Algorithm 2 and
docs/methods.md, "DIVL: critic target and the order of one learner step")
is shared with the IQL baseline through ``ValueLearner``; DIVL and IQL differ
only in the value loss and the bootstrap read-out.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from robo_post.models.critic import CriticConfig, CriticNet, ema_update

CriticFn = Callable[[dict[str, Any], torch.Tensor], torch.Tensor]


# --- building blocks (docs/methods.md, "DIVL") -------------------------------------
def atom_support(v_min: float, v_max: float, num_atoms: int, device: torch.device | str | None = None) -> torch.Tensor:
    """K evenly spaced atoms z_1 < ... < z_K on [v_min, v_max] (docs/methods.md, "DIVL: value support")."""
    return torch.linspace(v_min, v_max, num_atoms, device=device)


def c51_project(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Two-atom (C51) projection of scalars y (B,) onto atoms z (K,) -> (B, K) (LWD Eq. 20-21;
    docs/methods.md, "DIVL: labels and the C51 projection").

    The mass splits linearly between the neighbouring atoms z_l <= y < z_{l+1}, which
    keeps the mean: sum_i m_i z_i = clip(y, z_1, z_K). Locating l by ``searchsorted``
    instead of floor((y - v_min) / dz) makes y exactly on an atom (float atoms from
    linspace included) a one-hot, so the ``l == u`` mass-loss case cannot arise.
    """
    y = y.to(z.dtype).clamp(z[0], z[-1])  # in the atoms' precision (fp32 under bf16 autocast)
    lo = (torch.searchsorted(z, y.contiguous(), right=True) - 1).clamp(0, len(z) - 2)
    frac = (y - z[lo]) / (z[lo + 1] - z[lo])
    m = torch.zeros(*y.shape, len(z), device=y.device, dtype=y.dtype)
    m.scatter_add_(-1, lo[..., None], (1.0 - frac)[..., None])
    m.scatter_add_(-1, lo[..., None] + 1, frac[..., None])
    return m


def cat_quantile(p: torch.Tensor, z: torch.Tensor, tau: torch.Tensor | float, interp: str = "atom") -> torch.Tensor:
    """tau-quantile (B,) of categorical p (B, K) on atoms z (K,); no gradient (docs/methods.md,
    "DIVL: quantile read-out").

    ``atom``: z_{j*}, j* = min{j : F(z_j) >= tau}. ``linear``: interpolate the CDF
    linearly between z_{j*-1} and z_{j*}.
    """
    with torch.no_grad():
        F_ = p.cumsum(-1)
        # Forced last CDF: dividing by the total makes F(z_K) = 1 exactly, and F at the
        # last atom with mass too, so tau ~ 1 cannot fall off the end through rounding.
        F_ = F_ / F_[..., -1:]
        tau = torch.as_tensor(tau, dtype=p.dtype, device=p.device).expand(p.shape[:-1])
        j = (F_ < tau[..., None]).sum(-1).clamp(max=len(z) - 1)
        q = z[j]
        if interp == "atom":
            return q
        if interp != "linear":
            raise ValueError(f"quantile_interp must be 'atom' or 'linear', got {interp!r}")
        F_hi = F_.gather(-1, j[..., None]).squeeze(-1)
        F_lo = torch.where(j > 0, F_.gather(-1, (j - 1).clamp(min=0)[..., None]).squeeze(-1), torch.zeros_like(F_hi))
        frac = ((tau - F_lo) / (F_hi - F_lo).clamp_min(1e-12)).clamp(0.0, 1.0)
        return torch.where(j > 0, q - (1.0 - frac) * (z[1] - z[0]), q)


def norm_entropy(p: torch.Tensor) -> torch.Tensor:
    """Normalised entropy H~ = -sum p log p / log K in [0, 1] (docs/methods.md, "DIVL: adaptive quantile bootstrap")."""
    return -(p * p.clamp_min(1e-12).log()).sum(-1) / math.log(p.shape[-1])


def adaptive_tau(p: torch.Tensor, tau_base: float, alpha: float, tau_min: float, tau_max: float) -> torch.Tensor:
    """tau(s') = clip(tau_base - alpha * H~(s'), tau_min, tau_max), stop-gradient (docs/methods.md,
    "DIVL: adaptive quantile bootstrap")."""
    return (tau_base - alpha * norm_entropy(p.detach())).clamp(tau_min, tau_max)


def asymmetric_loss(u: torch.Tensor, tau: float | torch.Tensor, power: int) -> torch.Tensor:
    """rho_{tau,p}(u) = |tau - 1(u < 0)| |u|^p: p = 2 expectile (IQL), p = 1 pinball (docs/methods.md,
    "DIVL: relation to IQL")."""
    return (tau - (u < 0).to(u.dtype)).abs() * u.abs().pow(power)


def twin_critic_fn(online: CriticNet, target: CriticNet, net: str) -> CriticFn:
    """``critic_fn(obs, normalised_chunk) -> (num_q, B)`` from the ``online`` or ``target`` critic: what the
    value learner hands to the actor (docs/methods.md, "QAM: lean adjoint")."""
    if net not in ("target", "online"):
        raise ValueError(f"net must be 'target' or 'online', got {net!r}")
    module = target if net == "target" else online
    return lambda obs, chunk: module.q(module.encode(obs), chunk)


def weighted_mean(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean over the last (batch) dim; with prioritized replay, weighted by the IS weights (B,)."""
    return x.mean(-1) if weights is None else (x * weights.to(x.device)).mean(-1)


def td_target(rewards: torch.Tensor, discounts: torch.Tensor, v_next: torch.Tensor) -> torch.Tensor:
    """Chunk TD target r + gamma^(nH) * alive * V(s_{t+nH}); the sampler folds alive into discounts
    (docs/methods.md, "Chunked TD targets")."""
    return rewards + discounts * v_next


# --- shared learner skeleton -----------------------------------------------------
@dataclass
class ValueLearnerConfig:
    """Optimisation settings shared by DIVL and IQL (docs/methods.md, "DIVL: configuration").

    Attributes:
        lr: Adam learning rate of value and critic (LWD Appendix B2: 5e-4).
        lr_decay_steps: cosine-decay the learning rate to 0 over this many updates
            (LWD uses cosine decay); 0 keeps it constant.
        ema_rate: target-network EMA rate rho.
        v_target: ``online`` bootstraps from the V just updated (LWD Eq. 14, Algorithm 2);
            ``ema`` from the EMA copy of encoder and value head (as the third-party LWD
            port ``WenLongZhang888/openpi`` does).
        update_mode: ``sequential`` steps V, then builds the TD target from the
            updated V, then steps Q; the shared encoder lives only in the Q optimiser
            and is stepped once with the gradients of both losses. ``joint`` builds the
            target from the previous V and steps everything once.
        q_head_reduce: ``sum`` or ``mean`` of the two heads' MSE (only rescales the loss).
    """

    lr: float = 5e-4
    lr_decay_steps: int = 0
    ema_rate: float = 0.005
    v_target: str = "online"
    update_mode: str = "sequential"
    q_head_reduce: str = "sum"


class ValueLearner:
    """Twin scalar critic + value head trained in-sample (IQL family).

    Subclasses define ``value_loss`` (fit V to target-critic values of replay
    actions) and ``bootstrap`` (read V(s') for the TD target).
    """

    # It values the data's own actions, so backups through several of them are consistent
    # (``robo_post.algos.actor_critic.backup_chunks``).
    multi_step = True

    def __init__(self, critic: CriticConfig, config: ValueLearnerConfig, value_outputs: int,
                 device: torch.device | str = "cpu"):
        if config.v_target not in ("online", "ema") or config.update_mode not in ("sequential", "joint"):
            raise ValueError(f"bad v_target/update_mode: {config.v_target!r}/{config.update_mode!r}")
        if config.q_head_reduce not in ("sum", "mean"):
            raise ValueError(f"q_head_reduce must be 'sum' or 'mean', got {config.q_head_reduce!r}")
        self.config = config
        self.device = torch.device(device)
        self.net = CriticNet(critic, value_outputs).to(self.device)
        self.target = copy.deepcopy(self.net).requires_grad_(False)
        # Shared encoder in exactly one optimiser, so one learner step steps it once.
        self.opt_v = torch.optim.Adam(self.net.value_head.parameters(), lr=config.lr, fused=True)
        self.opt_q = torch.optim.Adam(self.net.encoder_parameters() + list(self.net.q_heads.parameters()), lr=config.lr,
                                      fused=True)
        self.net.adopt_legacy_optimizer_state(self.opt_q)  # checkpoints from before the batched Q ensemble resume
        self.schedulers = [_cosine(opt, config.lr_decay_steps) for opt in (self.opt_v, self.opt_q)]
        self.steps = 0
        self.td_error: torch.Tensor | None = None  # |TD error| (B,) of the last update

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"value": self.opt_v, "critic": self.opt_q}

    def value_loss(self, v_out: torch.Tensor, q_label: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def bootstrap(self, v_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def set_stage(self, stage: str) -> None:
        """``offline`` or ``online``; only DIVL has per-stage settings."""

    def update(self, batch: dict[str, Any], next_chunks: Any = None) -> dict[str, torch.Tensor]:
        """One learner step on a sampler batch; returns metrics (docs/methods.md, "DIVL: critic
        target and the order of one learner step", steps 1-4)."""
        cfg, net = self.config, self.net
        chunk = net.normalize_actions(batch["actions"])
        rewards = batch["rewards"].to(self.device).float()
        discounts = batch["discounts"].to(self.device).float()

        # 1. Value step on min-of-twin target-critic values of the replay actions.
        with torch.no_grad():
            q_label = self.target.q(self.target.encode(batch["obs"]), chunk).min(0).values
        z = net.encode(batch["obs"])
        loss_v, metrics = self.value_loss(net.value(z), q_label)
        self.opt_v.zero_grad(set_to_none=True)
        self.opt_q.zero_grad(set_to_none=True)
        loss_v.backward(retain_graph=True)  # z's graph is reused by the Q loss
        if cfg.update_mode == "sequential":
            self.opt_v.step()  # Algorithm 2: the TD target reads the UPDATED value head

        # 2. TD target from V at the bootstrap state (stop-gradient).
        with torch.no_grad():
            src = net if cfg.v_target == "online" else self.target
            v_next, boot_metrics = self.bootstrap(src.value(src.encode(batch["next_obs"])))
            y = td_target(rewards, discounts, v_next)

        # 3. Critic step: scalar MSE on both heads (LWD Eq. 15), importance-weighted under prioritized replay.
        q = net.q(z, chunk)
        per_head = weighted_mean((q - y).pow(2), batch.get("weights"))
        loss_q = per_head.sum() if cfg.q_head_reduce == "sum" else per_head.mean()
        loss_q.backward()
        if cfg.update_mode == "joint":
            self.opt_v.step()
        self.opt_q.step()
        for s in self.schedulers:
            if s is not None:
                s.step()

        # 4. Target EMA.
        ema_update(self.target, net, cfg.ema_rate)
        self.steps += 1
        self.td_error = (y - q.detach().mean(0)).abs()  # (B,) base priorities for prioritized replay
        return {"loss_v": loss_v.detach(), "loss_q": loss_q.detach(), "q_mean": q.mean().detach(),
                "q_label_mean": q_label.mean().detach(), "td_target_mean": y.mean().detach(),
                **metrics, **boot_metrics}

    @torch.no_grad()
    def state_value(self, obs: dict[str, Any]) -> torch.Tensor:
        """The bootstrap read-out V(s) (B,) with the online networks (for evaluation)."""
        return self.bootstrap(self.net.value(self.net.encode(obs)))[0]

    def q_values(self, obs: dict[str, Any], chunk: torch.Tensor, net: str = "target") -> torch.Tensor:
        """Q of every head (num_q, B) at a normalised chunk (B, H, A); differentiable in ``chunk``."""
        return twin_critic_fn(self.net, self.target, net)(obs, chunk)

    def critic_fn(self, net: str = "target") -> CriticFn:
        """``critic_fn(obs, normalised_chunk) -> (num_q, B)`` for QAM/FQL (docs/methods.md, "QAM: lean adjoint").

        ``net`` is ``QAMConfig.q_net``. Only d/d(chunk) is ever taken, so the actor
        update leaves critic parameters and their ``.grad`` untouched (a tested property).
        """
        return twin_critic_fn(self.net, self.target, net)


def _cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    if steps <= 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, steps) / steps)))


# --- DIVL ------------------------------------------------------------------------
@dataclass
class DIVLConfig(ValueLearnerConfig):
    """DIVL hyperparameters (docs/methods.md, "DIVL: configuration"; CPU-scale defaults,
    LWD values in brackets).

    The n-step chunk backup is set on the sampler, ``WindowSampler(n_step=...)``:
    offline 1 for short tasks and up to 10 for long ones, online 1 (docs/methods.md,
    "Chunked TD targets: choosing n").

    Attributes:
        num_atoms: K atoms of the categorical value (51; LWD 201).
        v_min / v_max: support of the atoms; [-0.1, 1.1] for binary success so the
            two-atom projection is well defined at 0 and 1; rescale with the reward
            (docs/methods.md, "DIVL: value support"). The
            learner sets them from the data's range of returns unless given.
        tau_base_offline: tau_base in the offline stage (0.6).
        tau_base_online: tau_base after ``set_stage("online")`` (0.9).
        alpha: entropy slope of the adaptive tau (0.3).
        tau_min / tau_max: clip of tau (0.5 / 0.95; not given by LWD).
        adaptive_tau: ``False`` uses the constant tau = clip(tau_base) (alpha ignored).
        quantile_interp: ``atom`` (paper) or ``linear`` read-out.
    """

    num_atoms: int = 51
    v_min: float = -0.1
    v_max: float = 1.1
    tau_base_offline: float = 0.6
    tau_base_online: float = 0.9
    alpha: float = 0.3
    tau_min: float = 0.5
    tau_max: float = 0.95
    adaptive_tau: bool = True
    quantile_interp: str = "atom"

    def __post_init__(self) -> None:
        # A support of zero or negative width gave NaN or negative cross-entropies, published.
        if not (math.isfinite(self.v_min) and math.isfinite(self.v_max) and self.v_min < self.v_max):
            raise ValueError(f"algo.value.v_min={self.v_min} and algo.value.v_max={self.v_max}: the value support "
                             "needs finite v_min < v_max")
        if self.num_atoms < 2:
            raise ValueError(f"algo.value.num_atoms={self.num_atoms}: a categorical value needs at least 2 atoms")


class DIVL(ValueLearner):
    """DIVL value learner: categorical V over replay-action critic values, quantile bootstrap."""

    def __init__(self, critic: CriticConfig, config: DIVLConfig | None = None, device: torch.device | str = "cpu"):
        config = config or DIVLConfig()
        super().__init__(critic, config, config.num_atoms, device)
        self.atoms = atom_support(config.v_min, config.v_max, config.num_atoms, self.device)
        self.tau_base = config.tau_base_offline

    def set_stage(self, stage: str) -> None:
        """Switch tau_base between the ``offline`` and ``online`` stages."""
        if stage not in ("offline", "online"):
            raise ValueError(f"stage must be 'offline' or 'online', got {stage!r}")
        self.tau_base = self.config.tau_base_offline if stage == "offline" else self.config.tau_base_online

    def value_loss(self, logits: torch.Tensor, q_label: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross-entropy to the C51-projected labels (LWD Eq. 12/21)."""
        m = c51_project(q_label, self.atoms)
        loss = -(m * F.log_softmax(logits, -1)).sum(-1).mean()
        p = logits.detach().softmax(-1)
        # Mass on the two end atoms: high when the support is too narrow for the returns.
        return loss, {"value_entropy": norm_entropy(p).mean().detach(), "edge_mass": (p[:, 0] + p[:, -1]).mean().detach()}

    def tau(self, p: torch.Tensor) -> torch.Tensor:
        """Per-state tau (B,) at the bootstrap state (docs/methods.md, "DIVL: adaptive quantile bootstrap")."""
        cfg = self.config
        alpha = cfg.alpha if cfg.adaptive_tau else 0.0
        return adaptive_tau(p, self.tau_base, alpha, cfg.tau_min, cfg.tau_max)

    def bootstrap(self, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Quant_tau(V(s')) with tau from the normalised entropy at s' (LWD Eq. 13/17/18)."""
        p = logits.softmax(-1)
        tau = self.tau(p)
        v = cat_quantile(p, self.atoms, tau, self.config.quantile_interp)
        return v, {"tau_mean": tau.mean().detach(), "entropy_next_mean": norm_entropy(p).mean().detach(),
                   "v_next_mean": v.mean().detach()}

    @torch.no_grad()
    def value_distribution(self, obs: dict[str, Any]) -> torch.Tensor:
        """p_psi(. | s) (B, K) from the online value head."""
        return self.net.value(self.net.encode(obs)).softmax(-1)
