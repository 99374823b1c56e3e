"""Evaluation of steering: per (prior quality, rule, alpha) cell against the frozen actor on the same seeds.

Every arm runs the same episode seeds in lockstep (one batched policy call per step
over the live episodes), so arm - frozen differences are paired. Where the env defines
success, it ranks first: a cell is HELP (HURT) when the paired-bootstrap 95% CI of the
success-rate difference lies above (below) 0. Otherwise, and where success ties, a cell is

- HELP when the paired-bootstrap 95% CI of the mean return difference lies above 0,
- HURT when it lies below 0,
- FROZEN (a tie with the frozen actor) otherwise;

with an equivalence ``margin`` (a fraction of |frozen mean return|), the return CI must clear
+-margin. The oracle alpha is the alpha (0 = frozen, or one of the grid) with the best PoE
success rate, then mean return, among those no other alpha compares as HELP against (all
of them if none is); the oracle set adds every alpha that does not compare as HURT against
it (statistically tied with the best). The KL-budget selector's alpha is
chosen from states the frozen actor visits on separate calibration seeds, without
returns; the bandit selector's from PoE episodes it plays on other calibration seeds
(``robo_post.steering.bandit``). Both are scored by their distance in grid steps to the
oracle set; ``auto_selector`` names the one ``selector.kind=auto`` runs on this env.
"""

from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from robo_post.steering.auto import auto_kind
from robo_post.steering.bandit import rank, select_alpha_bandit
from robo_post.steering.poe import select_alpha
from robo_post.steering.policy import SteeredPolicy, SteeringConfig
from robo_post.steering.sources import Source

LABELS = ("HELP", "FROZEN", "HURT")


@dataclass
class Rollouts:
    """Per-episode returns and successes (None where the env defines none) of one arm."""

    returns: np.ndarray
    successes: np.ndarray | None
    states: dict[str, np.ndarray] | None = None  # every visited observation, when asked for


def run_episodes(make_env: Callable[[], Any], act: Callable[[dict[str, np.ndarray]], np.ndarray],
                 reset: Callable[[int], None], seeds: Sequence[int], success: Callable[[Mapping[str, Any]], Any],
                 keep_states: bool = False) -> Rollouts:
    """Run one episode per seed in lockstep: ``act`` gets the stacked observations of the episodes
    still running. ``reset(seed)`` reseeds the policy once (its noise is drawn per batch row)."""
    envs = [make_env() for _ in seeds]
    reset(int(seeds[0]))
    obs = [env.reset(seed=int(s))[0] for env, s in zip(envs, seeds)]
    returns, succ = np.zeros(len(seeds)), [None] * len(seeds)
    live = list(range(len(seeds)))
    states: dict[str, list[np.ndarray]] = {}
    while live:
        batch = {k: np.stack([obs[i][k] for i in live]) for k in obs[live[0]]}
        if keep_states:
            for k, v in batch.items():
                states.setdefault(k, []).append(v)
        actions = act(batch)
        still = []
        for row, i in enumerate(live):
            obs[i], reward, terminated, truncated, info = envs[i].step(actions[row])
            returns[i] += float(reward)
            if terminated or truncated:
                succ[i] = success(info)
            else:
                still.append(i)
        live = still
    for env in envs:
        env.close()
    successes = None if any(s is None for s in succ) else np.asarray(succ, dtype=float)
    return Rollouts(returns, successes, {k: np.concatenate(v) for k, v in states.items()} if keep_states else None)


def paired_bootstrap(diff: np.ndarray, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of paired differences and its percentile-bootstrap 95% CI (at least 2 differences)."""
    if len(diff) < 2:
        raise ValueError(f"a paired bootstrap CI needs at least 2 differences, got {len(diff)}")
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(n_boot, len(diff)))].mean(1)
    return float(diff.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def label(low: float, high: float, margin: float = 0.0) -> str:
    """HELP / HURT when the CI clears +-margin, else FROZEN."""
    return "HELP" if low > margin else "HURT" if high < -margin else "FROZEN"


def compare(arm: Rollouts, base: Rollouts, margin: float = 0.0) -> str:
    """``arm``'s label against ``base`` on the same seeds: by success where both define it, then
    (a success tie, or no success) by return."""
    if arm.successes is not None and base.successes is not None:
        verdict = label(*paired_bootstrap(arm.successes - base.successes)[1:])
        if verdict != "FROZEN":
            return verdict
    return label(*paired_bootstrap(arm.returns - base.returns)[1:], margin)


def oracle_set(arms: Mapping[float, Rollouts], margin: float = 0.0) -> tuple[float, list[float]]:
    """The oracle alpha of PoE ``arms`` (alpha -> rollouts on the same seeds) and the alphas tied with it.

    The oracle is the best by ``rank`` among the alphas no other alpha compares as HELP against
    (all of them if none is): a success rate higher by one lucky episode does not make an alpha
    that loses return the oracle. The tied set holds every alpha not HURT against the oracle.
    """
    unbeaten = [a for a in arms if not any(compare(arms[b], arms[a], margin) == "HELP" for b in arms if b != a)]
    oracle = max(unbeaten or arms, key=lambda a: rank(arms[a]))
    return oracle, sorted(a for a, r in arms.items() if compare(r, arms[oracle], margin) != "HURT")


@dataclass
class GridConfig:
    """What the evaluation grid runs.

    Attributes:
        rules: composition rules swept over the alpha grid (``prior`` and ``frozen`` run once).
        alpha_grid: alphas of the sweep and of the selector.
        kl_budgets: KL-budget selector budgets (one arm each).
        bandit_episodes: bandit selector episode budgets (one arm each).
        bandit_margin: the bandit's return margin over alpha = 0 (fraction of |frozen return|).
        alpha_max: selector cap (``None``: the largest grid alpha).
        episodes: evaluation episodes per arm (the same seeds for every arm).
        calibration_episodes: frozen-actor episodes, on other seeds, whose states the KL selector reads.
        stochastic: also run PoE and KL-Reg sampled (seeded) at every alpha.
        margin: equivalence margin of the labels, as a fraction of |frozen mean return| (0: the CI vs 0).
        seed: base seed of the episodes.
    """

    rules: tuple[str, ...] = ("poe", "klreg", "additive")
    alpha_grid: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    kl_budgets: tuple[float, ...] = (0.5, 2.0)
    bandit_episodes: tuple[int, ...] = (30, 60)
    bandit_margin: float = 0.01
    alpha_max: float | None = None
    episodes: int = 200
    calibration_episodes: int = 20
    stochastic: bool = True
    margin: float = 0.0
    seed: int = 1_000_003


def evaluate_prior(make_env: Callable[[], Any], actor: Source, prior: Source, low: np.ndarray, high: np.ndarray,
                   success: Callable[[Mapping[str, Any]], Any], grid: GridConfig) -> dict[str, Any]:
    """Every arm of the grid for one prior: returns, successes, HELP/FROZEN/HURT labels, selector vs oracle."""
    seeds = [grid.seed + i for i in range(grid.episodes)]

    def arm(rule: str, alpha: float, deterministic: bool = True, keep_states: bool = False,
            on: Sequence[int] = seeds) -> Rollouts:
        policy = SteeredPolicy(actor, prior, SteeringConfig(rule, alpha, deterministic=deterministic), low, high)
        return run_episodes(make_env, policy.act, policy.reset, on, success, keep_states)

    frozen = arm("frozen", 0.0)
    margin = grid.margin * abs(float(frozen.returns.mean()))
    cells: list[dict[str, Any]] = []

    def cell(name: str, rule: str, alpha: float | None, r: Rollouts, **more: Any) -> dict[str, Any]:
        mean, low_ci, high_ci = paired_bootstrap(r.returns - frozen.returns)
        row = {"arm": name, "rule": rule, "alpha": alpha, "return": float(r.returns.mean()),
               "success": None if r.successes is None else float(r.successes.mean()),
               "diff": mean, "ci": [low_ci, high_ci], "label": compare(r, frozen, margin), **more}
        if r.successes is not None and frozen.successes is not None:
            diff, lo, hi = paired_bootstrap(r.successes - frozen.successes)
            row |= {"success_diff": diff, "success_ci": [lo, hi]}
        cells.append(row)
        return row

    cell("frozen", "frozen", 0.0, frozen)
    cell("prior", "prior", 1.0, arm("prior", 1.0))
    poe = {0.0: frozen}
    det_gap = 0.0
    for rule in grid.rules:
        for alpha in grid.alpha_grid:
            r = arm(rule, alpha)
            cell(f"{rule}", rule, alpha, r)
            if rule == "poe":
                poe[alpha] = r
            if rule == "klreg" and "poe" in grid.rules:
                det_gap = max(det_gap, abs(float(poe[alpha].returns.mean()) - float(r.returns.mean())))
            if grid.stochastic and rule in ("poe", "klreg"):
                cell(f"{rule}_sampled", rule, alpha, arm(rule, alpha, deterministic=False))
    oracle, tied = oracle_set(poe, margin)
    steps = [0.0, *sorted(grid.alpha_grid)]
    selectors = []

    def selected(name: str, alpha: float, **more: Any) -> None:
        row = cell(name, "poe", alpha, poe[alpha] if alpha in poe else arm("poe", alpha), **more)
        row |= {"oracle_alpha": oracle, "oracle_set": tied,
                "steps_from_oracle": min(abs(steps.index(alpha) - steps.index(a)) for a in tied)}
        selectors.append(row)

    # Calibration seeds follow the evaluation seeds and never overlap them.
    calibration_seed = grid.seed + 10 * grid.episodes
    # The KL selector reads states the frozen actor visits on calibration seeds.
    calibration = arm("frozen", 0.0, keep_states=True,
                      on=[calibration_seed + i for i in range(grid.calibration_episodes)])
    with torch.no_grad():
        actor_d, prior_d = actor.distribution(calibration.states), prior.distribution(calibration.states)
    for budget in grid.kl_budgets:
        alpha, kls = select_alpha(actor_d, prior_d, grid.alpha_grid, budget, grid.alpha_max)
        selected(f"selector_{budget:g}", alpha, selector=f"KL budget {budget:g}", kl_budget=budget, kl_curve=kls)
    # The bandit plays PoE episodes on the seeds after those.
    for budget in grid.bandit_episodes:
        choice = select_alpha_bandit(lambda a, s: arm("poe", a, on=s), grid.alpha_grid, budget, grid.alpha_max,
                                     grid.bandit_margin, seed=calibration_seed + grid.calibration_episodes)
        selected(f"bandit_{budget}", choice.alpha, selector=f"bandit {budget} episodes", bandit_episodes=budget,
                 episodes_spent=choice.episodes, bandit=choice.record())
    # what `steer selector.kind=auto` would run here: its rows above are that selector's
    auto = auto_kind(calibration.successes)
    return {"cells": cells, "oracle_alpha": oracle, "oracle_set": tied, "margin": margin,
            "deterministic_poe_klreg_gap": det_gap, "selectors": selectors, "auto_selector": auto}


def heatmap_png(results: Mapping[str, Mapping[str, Any]], rule: str, grid: Sequence[float], title: str) -> bytes:
    """A (prior quality x alpha) heat map of mean return difference vs frozen, cells marked H/F/X."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qualities = list(results)
    values = np.full((len(qualities), len(grid)), np.nan)
    marks = [[""] * len(grid) for _ in qualities]
    for i, q in enumerate(qualities):
        for c in results[q]["cells"]:
            if c["arm"] == rule and c["alpha"] in grid:
                j = list(grid).index(c["alpha"])
                values[i, j] = c["diff"]
                marks[i][j] = {"HELP": "H", "FROZEN": "F", "HURT": "X"}[c["label"]]
    scale = np.nanmax(np.abs(values)) or 1.0
    fig, ax = plt.subplots(figsize=(1.2 * len(grid) + 2.5, 0.6 * len(qualities) + 1.5))
    im = ax.imshow(values, cmap="RdYlGn", vmin=-scale, vmax=scale, aspect="auto")
    for i in range(len(qualities)):
        for j in range(len(grid)):
            ax.text(j, i, f"{marks[i][j]}\n{values[i, j]:+.1f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(grid)), [f"{a:g}" for a in grid])
    ax.set_yticks(range(len(qualities)), qualities)
    ax.set_xlabel("alpha")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="return - frozen")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def _spent(selector: Mapping[str, Any], grid: GridConfig) -> str:
    """Calibration episodes a selector row used: the bandit's steered ones, or the KL selector's frozen ones."""
    if "episodes_spent" in selector:
        return f"{selector['episodes_spent']} steered"
    return f"{grid.calibration_episodes} frozen"


def write_report(results: Mapping[str, Mapping[str, Any]], grid: GridConfig, out_dir: str, title: str) -> str:
    """``steering.json`` and ``steering.html`` (heat map per rule, cell table, selector vs oracle) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "steering.json"), "w") as f:
        json.dump({"title": title, "results": results}, f, indent=1)
    parts = [f"<html><head><meta charset='utf-8'><title>{title}</title></head><body><h1>{title}</h1>",
             "<p>H = HELP, F = FROZEN (tie), X = HURT: paired-bootstrap 95% CI of the success-rate difference "
             "against the frozen actor where the env defines success and it clears 0, else of the return "
             f"difference, on the same {grid.episodes} seeds. Colours: the return difference.</p>"]
    for rule in grid.rules:
        png = base64.b64encode(heatmap_png(results, rule, grid.alpha_grid, f"{rule}: return - frozen")).decode()
        parts.append(f"<h2>{rule}</h2><img src='data:image/png;base64,{png}'>")
    parts.append("<h2>Cells</h2><table border=1 cellpadding=3><tr><th>prior</th><th>arm</th><th>alpha</th>"
                 "<th>return</th><th>success</th><th>diff [95% CI]</th><th>label</th></tr>")
    for quality, res in results.items():
        for c in res["cells"]:
            succ = "" if c["success"] is None else f"{c['success']:.2f}"
            parts.append(f"<tr><td>{quality}</td><td>{c['arm']}</td><td>{c['alpha']}</td><td>{c['return']:.2f}</td>"
                         f"<td>{succ}</td><td>{c['diff']:+.2f} [{c['ci'][0]:+.2f}, {c['ci'][1]:+.2f}]</td>"
                         f"<td>{c['label']}</td></tr>")
    parts.append("</table><h2>Selector vs oracle</h2><table border=1 cellpadding=3><tr><th>prior</th>"
                 "<th>selector</th><th>calibration episodes</th><th>selected alpha</th><th>success</th>"
                 "<th>oracle alpha</th><th>tied with the oracle</th><th>grid steps from the tied set</th></tr>")
    for quality, res in results.items():
        for s in res["selectors"]:
            succ = "" if s["success"] is None else f"{s['success']:.2f}"
            parts.append(f"<tr><td>{quality}</td><td>{s['selector']}</td><td>{_spent(s, grid)}</td>"
                         f"<td>{s['alpha']}</td><td>{succ}</td><td>{s['oracle_alpha']}</td><td>{s['oracle_set']}</td>"
                         f"<td>{s['steps_from_oracle']}</td></tr>")
    autos = sorted({res["auto_selector"] for res in results.values()})
    parts.append(f"</table><p>selector.kind=auto runs the {' / '.join(autos)} selector here: the bandit where the "
                 "frozen calibration episodes report success, else the KL budget.</p></body></html>")
    path = os.path.join(out_dir, "steering.html")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Plain-text summary: one line per cell, then selector vs oracle."""
    lines = [f"{'prior':<22}{'arm':<16}{'alpha':>6}{'return':>10}{'success':>9}{'diff':>9}  {'95% CI':<20}label"]
    for quality, res in results.items():
        for c in res["cells"]:
            succ = "" if c["success"] is None else f"{c['success']:.2f}"
            lines.append(f"{quality:<22}{c['arm']:<16}{c['alpha']:>6.2g}{c['return']:>10.2f}{succ:>9}{c['diff']:>+9.2f}"
                         f"  [{c['ci'][0]:+.2f}, {c['ci'][1]:+.2f}]".ljust(22) + f" {c['label']}")
        for s in res["selectors"]:
            spent = f" after {s['episodes_spent']} calibration episodes" if "episodes_spent" in s else ""
            lines.append(f"{quality:<22}{s['selector']}: alpha*={s['alpha']:g}{spent}, oracle={s['oracle_alpha']:g}"
                         f" (tied: {s['oracle_set']}), {s['steps_from_oracle']} grid steps from the oracle set")
        why = "report success" if res["auto_selector"] == "bandit" else "report no success"
        lines.append(f"{quality:<22}selector.kind=auto runs {res['auto_selector']} (the frozen calibration episodes {why})")
        lines.append(f"{quality:<22}max |deterministic PoE - KL-Reg| return: {res['deterministic_poe_klreg_gap']:.3g}")
    return "\n".join(lines)
