"""QAM: Q-learning with Adjoint Matching as policy extraction (docs/methods.md, "QAM").

QAM fine-tunes a flow policy v_theta towards pi_beta * exp(Q / lambda) without
backpropagating through the sampler:

1. sample a memoryless-SDE path x_0 .. x_N (stop-gradient; "QAM: memoryless SDE");
2. integrate the lean adjoint backwards from -grad_a Q(s, x_N) / lambda with one
   vector-Jacobian product of the *base* drift per step ("QAM: lean adjoint");
3. regress v_theta onto v_beta - (sigma^2 / 2) * adjoint ("QAM: adjoint-matching loss").

Flow time follows "Flow-matching BC: conventions" (w = 0 noise, w = 1 action);
chunks are normalised to [-1, 1]. The critic is passed in as
``critic_fn(obs, normalised_chunk) -> (E, B)`` Q values of E heads, e.g.
``DIVL.critic_fn(config.q_net)``; only its action gradient is used.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch
from torch import nn

from robo_post.algos.bc_flow import base_bc_loss
from robo_post.algos.divl import CriticFn
from robo_post.models.critic import aggregate_heads, ema_update
from robo_post.models.flow import FlowPolicy

Velocity = Callable[[torch.Tensor, float], torch.Tensor]  # (x, w) -> v(s, x, w) for a fixed batch of states


# --- building blocks ------------------------------------------------------------
@dataclass(frozen=True)
class TimeGrid:
    """Flow-time discretisation of the SDE, the adjoint and the AM loss (QAM's code;
    docs/methods.md, "QAM: paths and the time grid").

    All fields are CPU float64 tensors of length N (``h`` is the step).

    Attributes:
        t: time fed to the velocity networks at step i.
        t_drift: w in the -x / w term of the memoryless drift at step i.
        sigma: noise scale of step i (memoryless: sigma^2 = 2 (1 - w) / w).
        t_adj: time of the base drift whose Jacobian carries the adjoint from
            step i + 1 to step i (the upper end of interval i).
    """

    t: torch.Tensor
    t_drift: torch.Tensor
    sigma: torch.Tensor
    t_adj: torch.Tensor
    h: float

    @cached_property
    def floats(self) -> dict[str, list[float]]:
        """The fields as Python floats, read once: the SDE and adjoint loops index them per step."""
        return {k: getattr(self, k).tolist() for k in ("t", "t_drift", "sigma", "t_adj")}


def time_grid(n: int, kind: str = "shifted", eps: float = 0.1) -> TimeGrid:
    """Grid of ``n`` flow steps (``QAMConfig.time_grid``).

    ``shifted`` (QAM): t_i = i/N, with the drift, sigma and Jacobian evaluated at
    t_i + h, which avoids the w = 0 singularity of x / w and sigma_w.
    ``eps`` (the third-party LWD port ``WenLongZhang888/openpi``): a uniform grid on
    [eps, 1] that starts from N(0, I) at eps.
    The last interval's Jacobian is taken at its midpoint, not at w = 1, where the velocity
    of a chunk-predicting flow, (x_1(x) - x) / (1 - w), is singular.
    """
    i = torch.arange(n, dtype=torch.float64)
    if kind == "shifted":
        h = 1.0 / n
        t = i * h
        return TimeGrid(t, t + h, torch.sqrt(2 * (1 - t + h) / (t + h)), (t + h).clamp(max=1 - h / 2), h)
    if kind == "eps":
        h = (1.0 - eps) / n
        t = eps + i * h
        return TimeGrid(t, t, torch.sqrt(2 * (1 - t) / t), (t + h).clamp(max=1 - h / 2), h)
    raise ValueError(f"time_grid must be 'shifted' or 'eps', got {kind!r}")


def sample_path(v_sde: Velocity, v_last: Velocity, x0: torch.Tensor, grid: TimeGrid,
                keep_path: bool = True) -> torch.Tensor:
    """Memoryless-SDE path (N + 1, *x0.shape), or only x_N if not ``keep_path`` (docs/methods.md,
    "QAM: memoryless SDE" and "QAM: paths and the time grid").

    Steps 0 .. N-2: Euler-Maruyama on dX = (2 v_sde - X / w) dw + sigma_w dB.
    Step N-1: a noiseless Euler step with ``v_last`` (the base; AM Appendix G.1).
    Gradients flow through the path unless the caller disables them (the BPTT
    baseline needs them; QAM samples under ``torch.no_grad``).
    """
    t, t_drift, sigma = grid.floats["t"], grid.floats["t_drift"], grid.floats["sigma"]
    h, n = grid.h, len(t)
    xs = [x0]
    x = x0
    for i in range(n - 1):
        x = x + h * (2 * v_sde(x, t[i]) - x / t_drift[i]) + math.sqrt(h) * sigma[i] * torch.randn_like(x)
        if keep_path:
            xs.append(x)
    x = x + h * v_last(x, t[n - 1])
    return torch.stack(xs + [x]) if keep_path else x


def terminal_adjoint(critic_fn: CriticFn, obs: Any, a1: torch.Tensor, inv_temp: float | torch.Tensor, clip: bool = True,
                     agg: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """(adjoint at w = 1, Q) = (-inv_temp * grad_a Q(s, a1), Q(s, a1)) per sample (docs/methods.md,
    "QAM: lean adjoint").

    ``clip``: evaluate Q at clip(a1, -1, 1), so saturated coordinates get a zero
    adjoint (``clip_adj``). ``agg`` reduces the E heads: ``mean`` or ``min``.
    The gradient is of the batch sum, so each sample gets its own grad_a Q.
    """
    a = a1.detach().requires_grad_(True)
    with torch.enable_grad():
        qs = critic_fn(obs, a.clamp(-1.0, 1.0) if clip else a)
        q = aggregate_heads(qs, agg)
        grad = torch.autograd.grad(q.sum(), a, allow_unused=True)[0] if q.requires_grad else None
    grad = torch.zeros_like(a) if grad is None else grad
    return -inv_temp * grad, q.detach()


@torch.no_grad()
def q_spread(critic_fn: CriticFn, policy: FlowPolicy, obs: Any, z: torch.Tensor, draws: int = 4,
             agg: str = "mean") -> torch.Tensor:
    """Measured action scale of the critic: the standard deviation of Q over ``draws`` chunks
    ``policy`` draws at each state, pooled over the batch's states (root of the mean
    variance; docs/methods.md, "QAM: temperature"). ``z`` is ``policy.encode(obs)``.

    This is the size of the Q differences the policy's own choices make, the scale an
    advantage lives on; it is what a temperature must be measured in for the tilt to
    move a policy by the same share of its spread on any task and reward scale.
    """
    c = policy.config
    qs = torch.stack([aggregate_heads(critic_fn(obs, policy.integrate(
        z, torch.randn(z.shape[0], c.horizon, c.action_dim, device=z.device))), agg) for _ in range(draws)])
    return qs.var(0).mean().sqrt()


def pinned_q_scale(value: float | None, device: torch.device) -> torch.Tensor | None:
    """A pinned ``q_scale`` as a tensor on ``device`` (built once), None to measure it per batch."""
    if value is not None and not value > 0:
        raise ValueError(f"q_scale must be > 0 or None (measured), got {value}")
    return None if value is None else torch.tensor(float(value), device=device)


@torch.no_grad()
def q_resolution(critic_fn: CriticFn, obs: Any, actions: torch.Tensor) -> torch.Tensor:
    """The critic's own uncertainty: the spread between its heads' Q of the data's chunks
    ``actions`` (normalised), pooled over the batch (root of the mean variance); 0 with one head.

    Q differences smaller than this are within what the critic's heads disagree on.
    """
    qs = critic_fn(obs, actions)
    return qs.var(0).mean().sqrt() if qs.shape[0] > 1 else qs.new_zeros(())


def batch_q_scale(pinned: torch.Tensor | None, critic_fn: CriticFn, policy: FlowPolicy, obs: Any,
                  z: torch.Tensor | None, agg: str, actions: torch.Tensor) -> torch.Tensor:
    """The Q units of this batch's tilt: ``pinned``, else the larger of ``q_spread`` of ``policy``
    and the critic's ``q_resolution`` on the batch's normalised chunks ``actions`` (floored at 1e-6);
    ``z`` is ``policy.encode(obs)`` when the caller has it.

    The resolution floor is there for a near-deterministic policy: its chunks' Q spread
    collapses (measured 1e-4 on a balance task's expert data, against 0.05 between the heads),
    and a temperature in those units multiplies the critic's gradient noise by ~10^4; the
    policy then left its expert start for half of its return.
    """
    if pinned is not None:
        return pinned
    spread = q_spread(critic_fn, policy, obs, policy.encode(obs) if z is None else z, agg=agg)
    return torch.maximum(spread, q_resolution(critic_fn, obs, actions)).clamp_min(1e-6)


def adjoint_step(v_base: Velocity, x: torch.Tensor, adj: torch.Tensor, t: float, h: float) -> torch.Tensor:
    """One backward Euler step of the lean adjoint ODE with a single VJP (docs/methods.md, "QAM: lean adjoint").

    adj_i = adj_{i+1} + h * [d/dx (2 v_beta(x, t) - x / t)]^T adj_{i+1}, at x = x_i.
    """
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        drift = 2 * v_base(x, t) - x / t
        (vjp,) = torch.autograd.grad(drift, x, grad_outputs=adj)
    return (adj + h * vjp).detach()


def lean_adjoint(v_base: Velocity, xs: torch.Tensor, adj_terminal: torch.Tensor, grid: TimeGrid) -> torch.Tensor:
    """Adjoints (N, ...) at the grid points x_0 .. x_{N-1}, integrated backwards from w = 1."""
    t_adj = grid.floats["t_adj"]
    adjs, adj = [], adj_terminal
    for i in reversed(range(len(t_adj))):
        adj = adjoint_step(v_base, xs[i], adj, t_adj[i], grid.h)
        adjs.append(adj)
    return torch.stack(adjs[::-1])


def cap_path_kl(adjs: torch.Tensor, sigma: torch.Tensor, h: float, max_kl: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(adjoints, target KL) with each sample's adjoints scaled so the control of its regression
    target costs at most ``max_kl`` nats along its path (docs/methods.md, "QAM: trust region").

    The target's control is u = -sigma * adj, so its path KL is sum_i h sigma_i^2 ||adj_i||^2 / 2
    over the SDE steps (the last, deterministic step excluded, as in ``control_cost``). The lean
    adjoint ODE is linear, so scaling the terminal adjoint scales every adj_i: this is a
    per-state temperature, lowered only where the critic's gradient would buy more than the budget.
    Returns the uncapped target KL (B,) for the logs.
    """
    kl = (0.5 * h * sigma[:-1] ** 2 * adjs[:-1].pow(2)).flatten(2).sum(-1).sum(0)
    scale = (max_kl / kl.clamp_min(1e-12)).sqrt().clamp(max=1.0)
    return adjs * scale.view(1, -1, *([1] * (adjs.dim() - 2))), kl


def am_target(v_base: torch.Tensor, adj: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Velocity target v_beta - (sigma^2 / 2) * adjoint (docs/methods.md, "QAM: adjoint-matching loss")."""
    return v_base - 0.5 * sigma**2 * adj


def am_loss(v_fine: torch.Tensor, v_base: torch.Tensor, adj: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Per-step adjoint-matching loss (N, B): (4 / sigma^2) ||v_theta - target||^2, summed over action dims.

    Equal to ||2 (v_theta - v_beta) / sigma + sigma * adj||^2 (the two forms are tested equal); ``sigma``
    broadcasts against ``v_fine`` (N, B, ...).
    """
    return (4.0 / sigma**2 * (v_fine - am_target(v_base, adj, sigma)).pow(2)).flatten(2).sum(-1)


def control_cost(v_fine: torch.Tensor, v_base: torch.Tensor, sigma: torch.Tensor, h: float) -> torch.Tensor:
    """Girsanov KL of the controlled path, sum over SDE steps of h * ||u||^2 / 2, u = 2 (v_theta - v_beta) / sigma.

    Inputs (N, B, ...); returns (B,). The last step is the uncontrolled base ODE step
    and is excluded. Along fine paths this estimates KL(pi_theta || pi_beta) of the
    path laws, an upper bound on the KL of the actions (docs/methods.md, "QAM: memoryless SDE").
    """
    return (2.0 * h / sigma[:-1] ** 2 * (v_fine[:-1] - v_base[:-1]).pow(2)).flatten(2).sum(-1).sum(0)


def policy_velocity(policy: FlowPolicy, z: torch.Tensor) -> Velocity:
    """v(s, x, w) of ``policy`` for states already encoded as z, as a function of (x, w)."""
    return lambda x, w: policy.velocity(z, x, torch.full((x.shape[0],), w, device=x.device, dtype=x.dtype))


# --- learner ----------------------------------------------------------------------
@dataclass
class QAMConfig:
    """QAM hyperparameters (docs/methods.md, "QAM: configuration"; CPU-scale defaults).

    Attributes:
        inv_temp: kappa of the tilt pi_beta * exp(kappa Q / q_scale).
        max_kl: per-state cap on the regression target's path KL from pi_beta, in nats
            (``cap_path_kl``). ``None`` (default): inv_temp^2 / 2 when ``q_scale`` is measured,
            what the measured unit promises (a kappa-tilt of a Gaussian costs that), binding
            only where the critic's action gradient is steep against the spread it was measured
            by; no cap when ``q_scale`` is pinned (the user chose the absolute temperature).
        q_scale: Q units per unit of ``inv_temp``. ``None`` (default) measures it on every batch
            as the spread of Q over the reference's own chunks at the batch's states
            (``q_spread``), so kappa is in units of the advantages the policy can reach on any
            reward scale, floored by the critic heads' disagreement (``q_resolution``); a number pins it.
        path_source: ``fine`` samples paths from the current fine policy (QAM, AM: the
            fixed point is the exact tilt); ``reference`` from the frozen base (literal
            LWD reading: a first-order approximation; "QAM: paths and the time grid").
        q_net: ``target`` or ``online`` critic for grad_a Q; read by the learner when it
            builds ``critic_fn = value_learner.critic_fn(q_net)``.
        q_agg: ``mean`` or ``min`` over critic heads for grad_a Q.
        base: ``frozen`` keeps pi_beta fixed (LWD); ``ema_cotrained`` trains a BC flow on
            the batch, or on its ``imitation`` part when the learner adds one
            (``lwd.imitation``), and uses its EMA as pi_beta (QAM code).
        init: ``base`` starts pi_theta as a copy of pi_beta (LWD); ``random`` re-initialises
            it (QAM code).
        time_grid: ``shifted`` (QAM h-offset) or ``eps`` (grid on [eps, 1]).
        eps: start of the ``eps`` grid.
        quadrature: ``sum`` over steps (QAM) or ``dw`` weights h (third-party LWD port
            ``WenLongZhang888/openpi``); a constant factor on a uniform grid.
        clip_adj: evaluate the critic at clip(a_1, -1, 1).
        bc_weight: weight of an extra BC flow loss on pi_theta (LWD: 0).
        lr: policy learning rate (3e-4 for the small CPU networks; LWD AdamW 2e-5 on a VLA).
        weight_decay: AdamW weight decay (0 keeps a zero gradient a no-op: a fine policy
            equal to its base then does not move).
        lr_decay_steps: cosine-decay the learning rate to 0 over this many updates; 0 = constant.
        grad_clip: global gradient-norm clip (QAM and LWD: 1.0).
        ema_rate: EMA rate of pi_beta when ``base = ema_cotrained``.
    """

    inv_temp: float = 0.5
    max_kl: float | None = None
    q_scale: float | None = None
    path_source: str = "fine"
    q_net: str = "target"
    q_agg: str = "mean"
    base: str = "frozen"
    init: str = "base"
    time_grid: str = "shifted"
    eps: float = 0.1
    quadrature: str = "sum"
    clip_adj: bool = True
    bc_weight: float = 0.0
    lr: float = 3e-4
    weight_decay: float = 0.0
    lr_decay_steps: int = 0
    grad_clip: float = 1.0
    ema_rate: float = 0.005


class QAM:
    """Adjoint-matching fine-tuning of a copy of a reference flow policy.

    Args:
        reference: the BC flow policy pi_beta (copied; the caller's module is untouched).
        config: ``QAMConfig``.
        device: torch device of the policies.
    """

    def __init__(self, reference: FlowPolicy, config: QAMConfig | None = None, device: torch.device | str = "cpu"):
        self.config = cfg = config or QAMConfig()
        choices = {"path_source": ("fine", "reference"), "q_net": ("target", "online"), "q_agg": ("mean", "min"),
                   "base": ("frozen", "ema_cotrained"), "init": ("base", "random"), "quadrature": ("sum", "dw")}
        for name, allowed in choices.items():
            if getattr(cfg, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
        self.device = torch.device(device)
        self.reference = copy.deepcopy(reference).to(self.device).requires_grad_(False)
        self.fine = copy.deepcopy(reference).to(self.device).requires_grad_(True)
        if cfg.init == "random":
            for m in self.fine.modules():
                if isinstance(m, (nn.Linear, nn.LayerNorm, nn.Conv2d)):
                    m.reset_parameters()
        params = list(self.fine.parameters())
        self.bc = None
        if cfg.base == "ema_cotrained":
            self.bc = copy.deepcopy(reference).to(self.device).requires_grad_(True)
            params += list(self.bc.parameters())
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        steps = cfg.lr_decay_steps
        self.scheduler = None if steps <= 0 else torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: 0.5 * (1.0 + math.cos(math.pi * min(s, steps) / steps)))
        self.q_scale = pinned_q_scale(cfg.q_scale, self.device)
        if cfg.max_kl is not None and not cfg.max_kl > 0:
            raise ValueError(f"max_kl must be > 0 or None (inv_temp^2 / 2), got {cfg.max_kl}")
        if cfg.max_kl is not None:
            self.max_kl = cfg.max_kl
        else:  # what a measured unit promises; a pinned unit is the user's absolute temperature
            self.max_kl = math.inf if cfg.q_scale is not None else 0.5 * cfg.inv_temp**2
        self.grid = time_grid(self.fine.config.flow_steps, cfg.time_grid, cfg.eps)
        # The regression's times and noise scales, on the device once (not copied every update).
        self.grid_t = self.grid.t.to(self.device, torch.float32)
        self.grid_sigma = self.grid.sigma.to(self.device, torch.float32)
        self.steps = 0

    @property
    def policy(self) -> FlowPolicy:
        """The policy being trained: the fine-tuned flow."""
        return self.fine

    @torch.no_grad()
    def next_chunks(self, obs: dict[str, Any]) -> torch.Tensor:
        """Normalised chunks (B, H, A) of the fine policy at ``obs`` (an actor-bootstrapped critic's next action)."""
        z = self.fine.encode(obs)
        c = self.fine.config
        return self.fine.integrate(z, torch.randn(z.shape[0], c.horizon, c.action_dim, device=self.device))

    def update(self, batch: dict[str, Any], critic_fn: CriticFn) -> dict[str, torch.Tensor]:
        """One actor update on a sampler batch; returns metrics.

        Uses ``batch["obs"]`` (and ``actions``/``action_mask`` only for BC terms).
        """
        cfg, grid, fine, ref = self.config, self.grid, self.fine, self.reference
        obs = batch["obs"]
        B, H, A = batch["actions"].shape
        N = len(grid.t)

        # 1. Stop-gradient memoryless-SDE paths from the fine policy (or the reference).
        z_fine = fine.encode(obs)  # encoded once: detached for the paths, with grad for the regression
        with torch.no_grad():
            z_ref = ref.encode(obs)
            src, z_src = (fine, z_fine.detach()) if cfg.path_source == "fine" else (ref, z_ref)
            x0 = torch.randn(B, H, A, device=self.device)
            xs = sample_path(policy_velocity(src, z_src), policy_velocity(ref, z_ref), x0, grid)

        # 2. Lean adjoint from the critic's action gradient at the generated endpoint, with kappa
        #    in units of the Q spread over the reference's chunks (a return-span unit leaves the
        #    tilt ~1% of the spread on dense rewards: the policy does not move).
        q_scale = batch_q_scale(self.q_scale, critic_fn, ref, obs, z_ref, cfg.q_agg,
                                ref.normalize_actions(batch["actions"].to(self.device)))
        adj1, q1 = terminal_adjoint(critic_fn, obs, xs[-1], cfg.inv_temp / q_scale, cfg.clip_adj, cfg.q_agg)
        adjs = lean_adjoint(policy_velocity(ref, z_ref), xs, adj1, grid)
        # A critic steep against the spread it was measured by asks for tens of nats (measured
        # 23 on a sparse goal task's expert data, where the policy lost a third of its successes).
        sigma = self.grid_sigma.view(N, 1, 1, 1)
        adjs, kl_target = cap_path_kl(adjs, sigma, grid.h, self.max_kl)

        # 3. Regress v_theta onto the AM target, all N steps in one batched forward.
        x_flat = xs[:-1].flatten(0, 1)
        t_flat = self.grid_t.to(x_flat.dtype).repeat_interleave(B)
        v_fine = fine.velocity(z_fine.repeat(N, 1), x_flat, t_flat).view(N, B, H, A)
        with torch.no_grad():
            v_base = ref.velocity(z_ref.repeat(N, 1), x_flat, t_flat).view(N, B, H, A)
        sigma = sigma.to(x_flat.dtype)
        loss_am = am_loss(v_fine, v_base, adjs, sigma).sum(0).mean() * (grid.h if cfg.quadrature == "dw" else 1.0)
        loss = loss_am
        metrics: dict[str, torch.Tensor] = {}
        if cfg.bc_weight > 0:
            bc_fine = fine.bc_loss(obs, batch["actions"], batch.get("action_mask"))
            loss = loss + cfg.bc_weight * bc_fine
            metrics["bc_loss_fine"] = bc_fine.detach()
        if self.bc is not None:
            bc_base = base_bc_loss(self.bc, batch)
            loss = loss + bc_base
            metrics["bc_loss_base"] = bc_base.detach()

        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.opt.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.bc is not None:
            ema_update(self.reference, self.bc, cfg.ema_rate)
        self.steps += 1
        kl = control_cost(v_fine.detach(), v_base, sigma, grid.h).mean()
        return {"loss_am": loss_am.detach(), "q_endpoint": q1.mean().detach(), "adj_terminal_abs": adj1.abs().mean().detach(),
                "adj0_abs": adjs[0].abs().mean().detach(), "kl_path": kl.detach(),
                "kl_target": kl_target.mean(), "capped": (kl_target > self.max_kl).float().mean(), "grad_norm": grad_norm.detach(),
                "q_scale": q_scale.detach(), **metrics}

    def act(self, obs: dict[str, Any], seed: int | None = None) -> torch.Tensor:
        """Action chunks (B, H, A) in env units: Euler ODE of the fine policy, clipped
        (docs/methods.md, "QAM: acting and best-of-N")."""
        return self.fine.sample(obs, seed=seed)
