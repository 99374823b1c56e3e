"""Value distributions along episodes: DIVL's p(. | s_t) for one success and one failure.

LWD's diagnostic figure: along a successful episode the mode of the categorical
value should rise towards 1; along a failed one it should stall low. Written
after each learner phase as ``value_distributions-<phase>.png`` (+ ``.json``)
and shown in the run report.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from robo_post.algos.divl import DIVL, cat_quantile
from robo_post.store import EpisodeInfo, Snapshot


@torch.no_grad()
def value_trace(divl: DIVL, snap: Snapshot, episode: EpisodeInfo, batch: int = 256) -> dict[str, Any]:
    """p(. | s_t) (T + 1, K) for every observation of ``episode``, with its mode, mean and tau-quantile."""
    data = snap.load(episode)
    T1 = episode.length + 1
    probs = []
    for lo in range(0, T1, batch):
        obs = {k: torch.as_tensor(np.asarray(v[lo: lo + batch])).to(divl.device) for k, v in data["obs"].items()}
        obs["instruction"] = [episode.instruction] * len(next(iter(obs.values())))
        probs.append(divl.value_distribution(obs))
    p = torch.cat(probs)
    z = divl.atoms
    return {
        "episode": episode.key, "task": episode.task_id, "success": episode.success,
        "atoms": z.cpu().tolist(), "probs": p.cpu().numpy(),
        "mode": z[p.argmax(-1)].cpu().numpy(), "mean": (p * z).sum(-1).cpu().numpy(),
        "quantile": cat_quantile(p, z, divl.tau(p), divl.config.quantile_interp).cpu().numpy(),
    }


def pick_episodes(eps: list[EpisodeInfo]) -> list[EpisodeInfo]:
    """One success and one failure, of the same task when one has both (the first such task)."""
    for task in dict.fromkeys(e.task_id for e in eps):
        pair = [next((e for e in eps if e.task_id == task and e.success is s), None) for s in (True, False)]
        if all(pair):
            return pair
    return [e for e in (next((e for e in eps if e.success), None), next((e for e in eps if not e.success), None)) if e]


def write_value_report(run_dir: str, phase: str, divl: DIVL, snap: Snapshot,
                       episodes: list[EpisodeInfo] | None = None) -> str | None:
    """Plot and save the traces of a success and a failure among ``episodes`` (default: all of
    ``snap``); returns the PNG path (None when there is no episode to show)."""
    episodes = pick_episodes(snap.episodes() if episodes is None else episodes)
    if not episodes:
        return None
    traces = [value_trace(divl, snap, e) for e in episodes]
    fig = Figure(figsize=(6 * len(traces), 3.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(traces)))
    for ax, tr in zip(axes, traces):
        z = np.asarray(tr["atoms"])
        ax.imshow(tr["probs"].T, origin="lower", aspect="auto", cmap="viridis",
                  extent=(-0.5, len(tr["probs"]) - 0.5, z[0], z[-1]))
        ax.plot(tr["mode"], color="w", lw=1.5, label="mode")
        ax.plot(tr["quantile"], color="tab:orange", lw=1.2, ls="--", label="tau-quantile (bootstrap)")
        ax.set_title(f"{'success' if tr['success'] else 'failure'}: {tr['task']} ({tr['episode']})", fontsize=11)
        ax.set_xlabel("step")
        ax.set_ylabel("value atom")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"DIVL value distribution p(. | s_t) along episodes ({phase})", fontsize=12)
    png = os.path.join(run_dir, f"value_distributions-{phase}.png")
    fig.savefig(png, dpi=100)
    summary = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in tr.items() if k != "probs"}
               for tr in traces]
    with open(os.path.join(run_dir, f"value_distributions-{phase}.json"), "w") as f:
        json.dump(summary, f)
    return png
