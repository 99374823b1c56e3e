"""Why a critic method did or did not move its policy, measured after training.

Three readings, each on episodes the method did not train on when the run held some out
(``data.holdout``):

- **value against return**: the critic's Q of the data's own chunks, Q(s_t, a_{t:t+H}),
  against the discounted return the episode went on to collect from t (no bootstrap, so
  the last steps of a truncated episode read low);
- **ranking**: Spearman's rank correlation of those two, over every step and over episode
  starts (does the critic order the data as its returns do?);
- **drift**: how far the trained policy's chunks moved from its starting (reference)
  policy's on the same states and the same noise, as an RMS in normalised action units
  (actions span [-1, 1]); near 0 means the critic did not move the policy;
- **action contrast**: how much Q changes with the action at a fixed state: its standard
  deviation over the reference's draws and over uniform random chunks, against the spread
  of the critic's heads on the data's chunks (their disagreement) and over the states.
  A policy extractor reads only this part of Q; a contrast over the reference's draws below
  the heads' disagreement means the critic cannot tell the policy's choices apart
  (measured: 0.001 against 0.024 on a balance task's mixed data, where QAM did not move and
  acting by the best of 16 draws under the critic fell to a twentieth of the return).

Two warnings read the training's own metrics rows: a critic still moving at the end of its
budget (``critic_trend``) and a categorical value piled up at its support's edges.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

from robo_post.store import EpisodeInfo, Snapshot, WindowSampler

BATCH = 512
CONTRAST_DRAWS = 8  # chunks per state for the action contrast
# End-atom probability mass above which the value support is reported as too narrow.
EDGE_MASS_WARN = 0.25
# A critic whose mean Q still moves by more than this share of the data's return span over
# the last quarter of its updates (or whose TD loss grows by more than TD_RISE_WARN) has not
# converged: its actor followed a moving target.
Q_DRIFT_WARN = 0.05
TD_RISE_WARN = 0.2


def held_out(episodes: list[EpisodeInfo], share: float, seed: int) -> list[EpisodeInfo]:
    """``share`` of ``episodes`` (at least 1 when that rounds to 0 and there are 10 or more),
    drawn by ``seed`` from the episodes in key order, so a resumed run holds out the same ones."""
    if share <= 0 or len(episodes) < 2:
        return []
    n = int(share * len(episodes)) or (1 if len(episodes) >= 10 else 0)
    ordered = sorted(episodes, key=lambda e: e.key)
    pick = np.random.default_rng(seed).permutation(len(ordered))[:n]
    return [ordered[i] for i in sorted(pick)]


def _spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b).statistic)


@torch.no_grad()
def critic_diagnostics(method: Any, snap: Snapshot, episodes: list[EpisodeInfo], gamma: float, held: bool,
                       max_steps: int = 8192, seed: int = 0) -> dict[str, Any] | None:
    """The readings of the module docstring for a critic method (``method.value.critic_fn``,
    ``method.actor.reference``, ``method.policy``) on ``episodes``; None for a method without
    a critic or no episodes. ``held``: the episodes were kept out of training."""
    value, actor = getattr(method, "value", None), getattr(method, "actor", None)
    reference = getattr(actor, "reference", None)
    if value is None or reference is None or not episodes:
        return None
    policy, critic = method.policy, value.critic_fn()
    c = policy.config
    sampler = WindowSampler.from_snapshot(snap, episodes, horizon=c.horizon, gamma=gamma, seed=seed)
    rng = np.random.default_rng(seed)
    n = len(sampler)
    firsts = np.cumsum([0] + [e.length for e in sampler.episodes[:-1]])
    rest = np.setdiff1d(np.arange(n), firsts)
    extra = rest if n <= max_steps else rng.choice(rest, max(0, max_steps - len(firsts)), replace=False)
    starts = np.sort(np.concatenate([firsts, extra]))
    gen = torch.Generator(device=policy.device).manual_seed(seed)
    q, drift, heads, draws, randoms = [], [], [], [], []
    for lo in range(0, len(starts), BATCH):
        batch = sampler.sample(0, starts=starts[lo: lo + BATCH])
        obs, actions = batch["obs"], batch["actions"].to(policy.device)
        qs = critic(obs, policy.normalize_actions(actions))
        q.append(qs.mean(0).cpu())
        heads.append(qs.std(0).cpu() if len(qs) > 1 else torch.zeros(qs.shape[1]))
        noise = torch.randn(actions.shape, generator=gen, device=policy.device)
        moved = policy.normalize_actions(policy.sample(obs, noise=noise)) - reference.normalize_actions(
            reference.sample(obs, noise=noise))
        drift.append(moved.pow(2).mean((1, 2)).cpu())
        z = reference.encode(obs)
        draws.append(_q_spread(critic, obs, lambda: reference.integrate(z, torch.randn(
            actions.shape, generator=gen, device=policy.device))))
        randoms.append(_q_spread(critic, obs, lambda: torch.rand(
            actions.shape, generator=gen, device=policy.device) * 2 - 1))
    q_all, g_all = torch.cat(q).numpy(), sampler.returns_to_go()[starts]
    first = np.isin(starts, firsts)
    return {
        "episodes": len(sampler.episodes), "steps": int(len(starts)), "held_out": held,
        "q_mean": float(q_all.mean()), "return_mean": float(g_all.mean()), "q_minus_return": float((q_all - g_all).mean()),
        "spearman_steps": _spearman(q_all, g_all), "spearman_episodes": _spearman(q_all[first], g_all[first]),
        "drift_rms": float(torch.cat(drift).mean().sqrt()),
        "q_contrast_draws": float(torch.cat(draws).mean()), "q_contrast_random": float(torch.cat(randoms).mean()),
        "q_heads_spread": float(torch.cat(heads).mean()), "q_states_spread": float(q_all.std()),
    }


def _q_spread(critic: Any, obs: dict[str, Any], chunks: Any, draws: int = CONTRAST_DRAWS) -> torch.Tensor:
    """Per state (B,), the standard deviation of the critic's Q (heads averaged) over ``draws``
    chunks from ``chunks()`` (normalised, (B, H, A))."""
    return torch.stack([critic(obs, chunks()).mean(0) for _ in range(draws)]).std(0).cpu()


def describe(d: dict[str, Any]) -> str:
    """One line for a user: the readings and what they were measured on."""
    where = f"{d['episodes']} held-out episodes" if d["held_out"] else f"its {d['episodes']} training episodes"

    def rho(x: float | None) -> str:
        return "n/a" if x is None else f"{x:+.2f}"

    line = (f"critic on {where}: Q of the data's chunks {d['q_mean']:.3g} vs their discounted return "
            f"{d['return_mean']:.3g}; Spearman {rho(d['spearman_steps'])} over steps, {rho(d['spearman_episodes'])} "
            f"over episode starts; policy drift from its start {d['drift_rms']:.3f} (RMS, actions in [-1, 1]); "
            f"Q moves {d['q_contrast_draws']:.3g} over the reference's draws and {d['q_contrast_random']:.3g} over "
            f"random chunks at a state (heads disagree by {d['q_heads_spread']:.3g}, states spread "
            f"{d['q_states_spread']:.3g})")
    if d["q_contrast_draws"] < d["q_heads_spread"]:
        line += ("\nwarning: the critic's Q changes less with the action (over the reference's draws) than its heads "
                 "disagree: it cannot tell the policy's choices apart, so its actor has nothing to follow")
    return line


def warn_value_edges(logged: list[dict[str, float]], value_range_: tuple[float, float]) -> None:
    """Say so when a categorical value piles up at its support's edges (support too narrow)."""
    if logged and logged[-1].get("edge_mass", 0.0) > EDGE_MASS_WARN:
        print(f"warning: {logged[-1]['edge_mass']:.0%} of the value distribution sits on the support's end atoms "
              f"[{value_range_[0]:.3g}, {value_range_[1]:.3g}]; widen it with +algo.value.v_min=... +algo.value.v_max=...",
              file=sys.stderr)


def critic_trend(logged: list[dict[str, float]], return_span: float) -> dict[str, Any] | None:
    """How the critic moved over the last quarter of the logged windows: mean Q's change
    (least-squares line, in return units and as a share of the data's return span) and the TD
    loss at that quarter's start and end; ``converged`` is False when Q still drifts by more
    than ``Q_DRIFT_WARN`` of the span or the TD loss grows by more than ``TD_RISE_WARN``.
    None for a method without a critic or fewer than 8 windows."""
    rows = [r for r in logged if "q_mean" in r and "loss_q" in r]
    if len(rows) < 8:
        return None
    tail = rows[-max(4, len(rows) // 4):]
    u = np.array([r["update"] for r in tail], dtype=float)
    q_change = float(np.polyfit(u, [r["q_mean"] for r in tail], 1)[0] * (u[-1] - u[0]))
    td_start, td_end = (float(np.mean([r["loss_q"] for r in part])) for part in (tail[:2], tail[-2:]))
    share = abs(q_change) / max(return_span, 1e-6)
    converged = share <= Q_DRIFT_WARN and td_end <= (1 + TD_RISE_WARN) * td_start
    return {"updates": [int(u[0]), int(u[-1])], "q_change": q_change, "q_change_share_of_span": share,
            "td_loss_start": td_start, "td_loss_end": td_end, "converged": bool(converged)}


def warn_unconverged(trend: dict[str, Any] | None) -> None:
    """Say so when the critic has not converged at the end of the budget (``critic_trend``)."""
    if trend is None or trend["converged"]:
        return
    a, b = trend["updates"]
    print(f"warning: the critic has not converged: over updates {a}-{b} its mean Q moved by {trend['q_change']:+.3g} "
          f"({trend['q_change_share_of_span']:.0%} of the data's return span) and its TD loss went from "
          f"{trend['td_loss_start']:.3g} to {trend['td_loss_end']:.3g}; the actor followed a moving target. More "
          "updates (a larger `updates=`, which resumes this run_dir) let it settle", file=sys.stderr)
