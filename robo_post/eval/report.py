"""Evaluation report: Markdown (+ a self-contained ``index.html``) with PNG plots.

Sections: success rates per policy version and split (tables with 95% Wilson
intervals and a bar chart) where the env defines success, return, length and the
env's metrics (tables with 95% intervals), learning curves from training runs'
``metrics.jsonl``, and rollout strips (one success and one failure per task; for envs
without success the best and the worst return) from the eval store. Frames come from a
recorded camera (an RGB image observation) when the store has one; other stores are
re-rendered through the env registry (``env.render()``) by replaying each episode's
seed and actions.

Plots use matplotlib's object API (``Figure``), never pyplot, so writing a report
neither needs a display nor changes the caller's matplotlib backend.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import PercentFormatter

from robo_post.config import check_dir_path
from robo_post.envs.registry import EnvMakeError, env_spec
from robo_post.eval.rollout import (format_mean, format_metric, format_rate, load_results, pct as _pct,
                                   read_json_object, read_result)
from robo_post.store import EpisodeInfo, Snapshot, Store
from robo_post.utils.io import read_metrics

N_FRAMES = 8
SUCCESS_COLOR, FAILURE_COLOR = "#1a7f37", "#cf222e"
_SPLIT_ORDER = {"train": 0, "heldout": 1}


def write_report(
    out_dir: str,
    results: Iterable[dict[str, Any]],
    run_dirs: Iterable[str] = (),
    eval_store: str | None = None,
    frames: bool = True,
    title: str = "robo-post evaluation report",
) -> str:
    """Write ``OUT_DIR/report.md``, ``OUT_DIR/index.html`` and their PNGs; return the .md path.

    Args:
        out_dir: output directory (created; files in it are overwritten).
        results: eval result dicts from ``evaluate`` (e.g. one per version and split).
        run_dirs: training run directories holding ``metrics.jsonl`` (and ``summary.json``).
        eval_store: store holding the eval episodes; default: each result's ``eval_store``.
        frames: include rollout frame strips (re-rendering costs ~1 s per episode).
        title: report title.
    """
    check_dir_path("out_dir", out_dir)
    os.makedirs(out_dir, exist_ok=True)
    results = sorted(results, key=lambda r: (r["policy"]["version"], _SPLIT_ORDER.get(r["split"], 9), r["created"]))
    labels = _labels(results)
    doc = _Doc()
    doc.heading(1, title)
    doc.paragraph(
        f"Generated {time.strftime('%Y-%m-%d %H:%M')}. Success rates are per task with 95% Wilson score "
        "intervals; the mean is the unweighted mean over tasks (its interval pools all episodes). "
        "Returns, lengths and mean env metrics have 95% Student-t intervals, rate metrics Wilson intervals. "
        "Eval episodes use their own seeds and store, apart from the training data."
    )
    if results:
        _success_section(doc, out_dir, results, labels)
        _returns_section(doc, results, labels)
    runs = list(run_dirs)
    if runs:
        _learning_section(doc, out_dir, runs)
    if results and frames:
        _rollout_section(doc, out_dir, results, labels, eval_store)
    md_path = os.path.join(out_dir, "report.md")
    with open(md_path, "w") as f:
        f.write(doc.markdown())
    with open(os.path.join(out_dir, "index.html"), "w") as f:
        f.write(doc.html(out_dir, title))
    return md_path


# --- document model: one list of blocks, rendered to Markdown and to HTML -----------
@dataclass
class _Doc:
    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def heading(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def paragraph(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.blocks.append(("table", (header, rows)))

    def image(self, filename: str, alt: str) -> None:
        self.blocks.append(("img", (filename, alt)))

    def markdown(self) -> str:
        out = []
        for kind, value in self.blocks:
            if kind == "h":
                out.append("#" * value[0] + " " + value[1])
            elif kind == "p":
                out.append(value)
            elif kind == "table":
                header, rows = value
                cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
                lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
                lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
                out.append("\n".join(lines))
            else:
                out.append(f"![{value[1]}]({value[0]})")
        return "\n\n".join(out) + "\n"

    def html(self, out_dir: str, title: str) -> str:
        def inline(text: str) -> str:  # escape, then the only Markdown we use: `code` and **bold**
            text = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))
            return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)

        body = []
        for kind, value in self.blocks:
            if kind == "h":
                body.append(f"<h{value[0]}>{inline(value[1])}</h{value[0]}>")
            elif kind == "p":
                body.append(f"<p>{inline(value)}</p>")
            elif kind == "table":
                header, rows = value
                head = "".join(f"<th>{inline(str(h))}</th>" for h in header)
                trs = "".join("<tr>" + "".join(f"<td>{inline(str(c))}</td>" for c in row) + "</tr>" for row in rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>")
            else:  # embedded, so index.html is one file that can be mailed or attached
                with open(os.path.join(out_dir, value[0]), "rb") as f:
                    data = base64.b64encode(f.read()).decode()
                body.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(value[1])}">')
        return _HTML.format(title=html.escape(title), body="\n".join(body))


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1400px; margin: 2em auto; padding: 0 1em; color: #1f2328; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #d0d7de; padding: 4px 10px; text-align: right; }}
th {{ background: #f6f8fa; }} td:first-child, th:first-child {{ text-align: left; }}
img {{ max-width: 100%; margin: 0.5em 0 1.5em; }}
code {{ background: #f6f8fa; padding: 1px 4px; border-radius: 4px; }}
</style></head><body>
{body}
</body></html>
"""


# --- success rates --------------------------------------------------------------------
def _labels(results: list[dict[str, Any]]) -> list[str]:
    """``v3 · heldout`` per result; repeats of one version and split get ``#2``, ``#3``."""
    labels, seen = [], {}
    for r in results:
        base = f"{r['policy']['label']} · {r['split']}"
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base} #{seen[base]}")
    return labels


def _tasks(results: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(t for r in results for t in r["tasks"]))


def _success_section(doc: _Doc, out_dir: str, results: list[dict[str, Any]], labels: list[str]) -> None:
    tasks = _tasks(results)
    if all(r["mean_success_rate"] is None for r in results):
        return  # no evaluated env defines success
    doc.heading(2, "Success rates")
    rows = []
    for r, label in zip(results, labels):
        per_task = [format_rate(r["tasks"][t]) if t in r["tasks"] else "–" for t in tasks]
        if r["mean_success_rate"] is None:
            mean = "–"
        else:
            lo, hi = r["overall"]["ci95"]
            mean = f"**{_pct(r['mean_success_rate'])}** [{_pct(lo)}–{_pct(hi)}]"
        rows.append([label, str(r["episodes_per_task"]), *per_task, mean])
    doc.table(["policy · split", "episodes/task", *tasks, "mean"], rows)
    _bar_chart(os.path.join(out_dir, "success_rates.png"), results, labels, tasks)
    doc.image("success_rates.png", "success rate per task with 95% Wilson intervals")


def _returns_section(doc: _Doc, results: list[dict[str, Any]], labels: list[str]) -> None:
    """Per result: success, return, length and env metrics per task, with 95% intervals."""
    doc.heading(2, "Returns, lengths and env metrics")
    for r, label in zip(results, labels):
        doc.heading(3, label)
        cfg = r["policy"]["config"]
        provenance = ", ".join(f"{k} `{v}`" for k, v in cfg.items() if k != "kind") or "scripted expert"
        doc.paragraph(
            f"Policy `{r['policy']['label']}` from `{r['policy']['store']}` ({provenance}). "
            f"{_count(r['overall']['episodes'], 'episode')} on {_count(r['n_clients'], 'client')} "
            f"in {r['wall_s']:.0f} s, base seed {r['seed']}; {_count(r['train_seed_overlap'], 'eval layout')} "
            f"also occur{'s' if r['train_seed_overlap'] == 1 else ''} in the training store. "
            f"Env `{r['env']['name']}`; success: {r.get('success_rule', 'info[success]')}. "
            f"Results: `{r['results_path']}`."
        )
        metrics = list(dict.fromkeys(m for s in r["tasks"].values() for m in s.get("metrics", {})))
        doc.table(
            ["task", "episodes", "successes", "success rate [95% CI]", "mean return [95% CI]",
             "mean length [95% CI]", *metrics],
            [
                [t, s["episodes"], s["successes"] if s["success_rate"] is not None else "–", format_rate(s),
                 format_mean(s["mean_return"], s.get("return_ci95")), format_mean(s["mean_length"], s.get("length_ci95"), 1),
                 *(format_metric(s["metrics"][m]) if m in s.get("metrics", {}) else "–" for m in metrics)]
                for t, s in r["tasks"].items()
            ],
        )


def _count(n: int, noun: str) -> str:
    """``1 episode``, ``2 episodes``, ``0 episodes``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _bar_chart(path: str, results: list[dict[str, Any]], labels: list[str], tasks: list[str]) -> None:
    groups = tasks + ["mean"]
    n = len(results)
    width = 0.8 / n
    fig = Figure(figsize=(max(8.0, 4.0 + len(groups) * (0.5 + 0.45 * n)), 5.0), layout="constrained")
    crowded = n >= 3  # vertical value labels once bars get narrow
    ax = fig.subplots()
    colors = _palette(n)
    for i, (r, label) in enumerate(zip(results, labels)):
        stats = [r["tasks"].get(t) for t in tasks] + [{**r["overall"], "success_rate": r["mean_success_rate"]}]
        x = np.arange(len(groups)) + (i - (n - 1) / 2) * width
        defined = [s if s and s["success_rate"] is not None else None for s in stats]
        rate = np.array([s["success_rate"] if s else np.nan for s in defined])
        lo = np.array([s["ci95"][0] if s else np.nan for s in defined])
        hi = np.array([s["ci95"][1] if s else np.nan for s in defined])
        # The edge keeps a 0% bar visible as a coloured line at the baseline.
        ax.bar(x, rate, width * 0.92, color=colors[i], edgecolor=colors[i], linewidth=1.5,
               label=f"{label} (n={r['episodes_per_task']}/task)", zorder=2)
        ax.errorbar(x, rate, yerr=[np.clip(rate - lo, 0, None), np.clip(hi - rate, 0, None)],
                    fmt="none", ecolor="#333333", elinewidth=1.2, capsize=3, zorder=3)
        for xi, ri, hii in zip(x, rate, hi):
            if not np.isnan(ri):
                ax.text(xi, hii + 0.02, f"{100 * ri:.0f}%", ha="center", va="bottom", fontsize=8,
                        rotation=90 if crowded else 0)
    ax.axvline(len(tasks) - 0.5, color="#999999", lw=0.8, ls=":")  # separates the mean from the tasks
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=11)
    ax.set_ylim(-0.015, 1.2 if crowded else 1.12)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylabel("success rate", fontsize=11)
    ax.set_title("Success rate per task (error bars: 95% Wilson interval)", fontsize=13)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="policy · split")
    fig.savefig(path, dpi=110)


def _palette(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"] if n <= 10 else colormaps["viridis"]
    return [cmap(i if n <= 10 else i / max(n - 1, 1)) for i in range(n)]


# --- learning curves ---------------------------------------------------------------------
def _numeric_columns(rows: list[dict[str, Any]]) -> list[str]:
    cols = dict.fromkeys(k for row in rows for k, v in row.items()
                         if k not in ("update", "time") and isinstance(v, (int, float)) and not isinstance(v, bool))
    return list(cols)


def _use_log_scale(name: str, values: np.ndarray) -> bool:
    """Log scale for positive losses and for anything spanning more than ~1.5 decades."""
    values = values[np.isfinite(values)]
    if len(values) < 2 or np.any(values <= 0):
        return False
    return "loss" in name or values.max() / values.min() > 30


def _learning_section(doc: _Doc, out_dir: str, run_dirs: list[str]) -> None:
    doc.heading(2, "Learning curves")
    runs: dict[str, list[dict[str, Any]]] = {}
    rows = []
    for run_dir in run_dirs:
        name = os.path.basename(os.path.normpath(run_dir))
        metrics = os.path.join(run_dir, "metrics.jsonl")
        summary_path = os.path.join(run_dir, "summary.json")
        summary: dict[str, Any] = {}
        if os.path.exists(summary_path):
            summary = read_json_object(summary_path, "a run summary")
        logged = read_metrics(metrics)
        # `robo-post run`'s online phase goes on in the offline phase's run_dir, past its summary
        online_path = os.path.join(run_dir, "online.json")
        online = read_json_object(online_path, "an online-phase summary") if os.path.exists(online_path) else None
        versions = [summary["version"]] if summary.get("version") is not None else []
        versions += online.get("versions", []) if online else []
        if os.path.exists(metrics):
            runs[name + (" → " + ", ".join(f"v{v}" for v in versions) if versions else "")] = logged
        # a killed (or running) run has no summary yet: its last logged row is how far it got
        final = summary.get("final", {}) if summary else (logged[-1] if logged else {})
        published = ("– (not finished)" if not summary
                     else "–" if summary.get("version") is None else f"v{summary['version']}")
        rows.append(_run_row(f"`{run_dir}`", published, summary.get("episodes"), final, summary.get("wall_s")))
        if online is not None:
            published = ", ".join(f"v{v}" for v in online.get("versions", [])) or "–"
            rows.append(_run_row(f"`{run_dir}` (online)", published, online.get("online_episodes"),
                                 online.get("final", {}), online.get("wall_s"), final.get("update")))
        elif summary and logged and logged[-1].get("update", 0) > final.get("update", 0):
            rows.append(_run_row(f"`{run_dir}` (online)", "– (not finished)", None, logged[-1], None,
                                 final.get("update")))
    doc.table(["run", "published", "episodes", "updates", "wall time", "final loss"], rows)
    _critic_section(doc, run_dirs)
    runs = {k: v for k, v in runs.items() if v}
    if not runs:
        doc.paragraph("No `metrics.jsonl` rows found in these runs.")
        return
    _plot_curves(os.path.join(out_dir, "learning_curves.png"), runs)
    doc.image("learning_curves.png", "training metrics against update")
    for run_dir in filter(os.path.isdir, run_dirs):  # DIVL's value distributions along a success and a failure
        for name in sorted(n for n in os.listdir(run_dir) if n.startswith("value_distributions-") and n.endswith(".png")):
            shutil.copyfile(os.path.join(run_dir, name), os.path.join(out_dir, name))
            doc.image(name, f"value distribution along a success and a failure ({name[20:-4]})")


def _critic_section(doc: _Doc, run_dirs: list[str]) -> None:
    """Per critic run: its Q against the data's returns, its ranking (Spearman) and the policy's
    drift from its start (``robo_post.learner.critic_report``), and whether the critic converged."""
    rows = []
    for run_dir in run_dirs:
        path = os.path.join(run_dir, "summary.json")
        summary = read_json_object(path, "a run summary") if os.path.exists(path) else {}
        d, trend = summary.get("critic_diagnostics"), summary.get("critic_trend")
        if not d:
            continue
        rho = [("–" if d.get(k) is None else f"{d[k]:+.2f}") for k in ("spearman_steps", "spearman_episodes")]
        converged = "–" if not trend else "yes" if trend.get("converged") else (
            f"no (Q moved {trend['q_change']:+.3g} over the last quarter)")
        contrast = ("–" if "q_contrast_draws" not in d else  # summaries written before it was measured
                    f"{d['q_contrast_draws']:.3g} / {d['q_contrast_random']:.3g} / {d['q_heads_spread']:.3g}")
        rows.append([f"`{run_dir}`", f"{d['episodes']} ({'held out' if d['held_out'] else 'trained on'})",
                     f"{d['q_mean']:.3g} / {d['return_mean']:.3g}", *rho, f"{d['drift_rms']:.3f}", contrast, converged])
    if rows:
        doc.paragraph("Critics, on episodes they did not train on where the run held some out: the mean Q of the "
                      "data's chunks against the discounted return that followed, their rank correlation over steps "
                      "and over episode starts, how far the policy moved from its start (RMS, actions in [-1, 1]), "
                      "and how much Q changes with the action at a state (its spread over the reference's draws and "
                      "over random chunks) against its heads' disagreement: below it, the critic cannot tell the "
                      "policy's choices apart.")
        doc.table(["run", "episodes", "Q / return", "Spearman (steps)", "Spearman (starts)", "policy drift",
                   "Q contrast: draws / random / heads", "critic converged"], rows)


def _run_row(name: str, published: str, episodes: Any, final: dict[str, Any], wall_s: Any,
             before: Any = None) -> list[str]:
    """A learning-table row; ``before``: the update an online phase went on from (its counter
    goes on from the offline phase's), to say how many were its own."""
    update = final.get("update")
    updates = ("–" if update is None else f"{update} ({update - before} online)" if isinstance(before, int)
               and isinstance(update, int) else str(update))
    loss = next((k for k in _LOSSES if isinstance(final.get(k), (int, float))), None)
    return [name, published, "–" if episodes is None else str(episodes), updates,
            "–" if wall_s is None else f"{wall_s:.0f} s",
            "–" if loss is None else f"{final[loss]:.4f} ({loss})"]


# The loss a learning-table row shows: the first of these its method logs.
_LOSSES = ("bc_loss", "nll", "loss", "loss_am", "value_loss")


def _plot_curves(path: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    _curves_figure(runs).savefig(path, dpi=100)


def _curves_figure(runs: dict[str, list[dict[str, Any]]]) -> Figure:
    """One panel per metric of any run, every run's curve in its colour."""
    columns = list(dict.fromkeys(c for rows in runs.values() for c in _numeric_columns(rows)))
    ncols = min(3, len(columns))
    nrows = math.ceil(len(columns) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.6 * nrows + 0.5), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    colors = _palette(len(runs))
    for ax, col in zip(axes, columns):
        all_values = []
        for color, (name, rows) in zip(colors, runs.items()):
            pts = [(r["update"], r[col]) for r in rows if isinstance(r.get(col), (int, float))]
            if not pts:
                continue
            x, y = np.array(pts, dtype=float).T
            all_values.append(y)
            ax.plot(x, y, color=color, lw=1.6, marker="o" if len(x) < 20 else None, ms=4, label=name)
        if all_values and _use_log_scale(col, np.concatenate(all_values)):
            ax.set_yscale("log")
        ax.set_title(col, fontsize=12)
        ax.set_xlabel("update", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    for ax in axes[len(columns):]:
        ax.set_visible(False)
    if len(runs) > 1:  # one legend for every panel: a run may be missing from the first
        handles = [Line2D([], [], color=color, lw=1.6) for color in colors]
        fig.legend(handles, list(runs), loc="outside lower center", ncols=min(len(runs), 4), fontsize=9)
    fig.suptitle("Training metrics (window means) — " + ", ".join(runs), fontsize=13)
    return fig


# --- rollout strips -----------------------------------------------------------------
def _rollout_section(
    doc: _Doc, out_dir: str, results: list[dict[str, Any]], labels: list[str], eval_store: str | None
) -> None:
    doc.heading(2, "Rollouts")
    doc.paragraph(
        f"{N_FRAMES} evenly spaced frames of the first successful and the first failed eval episode "
        "per task (for envs without success: the highest and the lowest return); `t` is the control step."
    )
    snapshots: dict[str, Snapshot] = {}
    replayer, unrenderable = _Replayer(), set()
    try:
        for r, label in zip(results, labels):
            root = eval_store or r["eval_store"]
            if root not in snapshots:
                snapshots[root] = Store.open(root).snapshot()
            snap = snapshots[root]
            episodes = snap.episodes(client=r["shards"])
            for task in r["tasks"]:
                picked = _first_of_each_outcome(episodes, task)
                if not picked:
                    continue
                name = f"rollouts_{_slug(label)}_{_slug(task)}.png"
                try:
                    rows = [(e, *_frames(snap, e, r["env"], replayer)) for e in picked]
                except NoFramesError as e:  # the rest of the report stands without this strip
                    if str(e) not in unrenderable:
                        print(f"warning: no rollout frames: {e}", file=sys.stderr)
                        unrenderable.add(str(e))
                    doc.paragraph(f"No frames for {task} ({label}): {e}.")
                    continue
                _plot_strip(os.path.join(out_dir, name), f"{task} — {label}", rows)
                doc.heading(3, f"{task} — {label}")
                doc.image(name, f"{task} rollouts of {label}")
    finally:
        replayer.close()


def _first_of_each_outcome(episodes: list[EpisodeInfo], task: str) -> list[EpisodeInfo]:
    """The first successful and the first failed episode of ``task``, those that exist;
    where success is undefined, the highest- and the lowest-return episode."""
    mine = [e for e in episodes if e.task_id == task]
    if mine and all(e.success is None for e in mine):
        best, worst = max(mine, key=lambda e: e.ret), min(mine, key=lambda e: e.ret)
        return [best] if best is worst else [best, worst]
    picked = []
    for outcome in (True, False):
        match = next((e for e in mine if e.success is not None and bool(e.success) == outcome), None)
        if match is not None:
            picked.append(match)
    return picked


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")


def _frame_indices(length: int, n: int = N_FRAMES) -> np.ndarray:
    """Up to ``n`` evenly spaced observation indices in [0, length], first and last included."""
    return np.unique(np.linspace(0, length, min(n, length + 1)).round().astype(int))


def _frames(snap: Snapshot, episode: EpisodeInfo, env_cfg: dict[str, Any], replayer: "_Replayer"
            ) -> tuple[np.ndarray, list[np.ndarray], str]:
    """``(indices, frames, note)`` of one episode: a recorded camera, else a replay."""
    data = snap.load(episode)
    idx = _frame_indices(episode.length)
    camera = _camera_key(data["obs"])
    if camera is not None:
        return idx, [data["obs"][camera][i] for i in idx], f"recorded camera `{camera}`"
    frames, final_obs = replayer.replay(episode, env_cfg, data["action"], idx)
    # Simulators replay deterministically from seed + actions; say so if this one did not.
    same = all(np.allclose(np.asarray(final_obs[k], dtype=np.float64), data["obs"][k][-1], atol=1e-4)
               for k in data["obs"])
    return idx, frames, "replayed from seed + actions" + ("" if same else " (DIVERGED from recording)")


def _camera_key(obs: dict[str, np.ndarray]) -> str | None:
    """The first observation that is an RGB image stream: uint8 (T + 1, H, W, 3)."""
    return next((k for k, v in obs.items() if v.dtype == np.uint8 and v.ndim == 4 and v.shape[-1] == 3), None)


class NoFramesError(Exception):
    """An episode without a recorded camera whose env cannot render frames to replay it."""


class _Replayer:
    """Re-renders episodes without a recorded camera: make the env through the registry
    with its frame-rendering kwargs, reset with the recorded seed, step the recorded actions."""

    def __init__(self) -> None:
        self.envs: dict[str, Any] = {}  # or the EnvMakeError of an env that cannot be made so

    def replay(self, episode: EpisodeInfo, env_cfg: dict[str, Any], actions: np.ndarray, idx: np.ndarray
               ) -> tuple[list[np.ndarray], dict[str, Any]]:
        spec = env_spec(env_cfg["name"])
        kwargs = {**{k: v for k, v in env_cfg.items() if k != "name"}, **spec.render_kwargs}
        key = json.dumps([spec.key, episode.task_id, kwargs], sort_keys=True)
        if key not in self.envs:
            try:
                with warnings.catch_warnings():  # gymnasium's note on a render_mode the env does not list
                    warnings.simplefilter("ignore")
                    self.envs[key] = spec.make(episode.task_id, **kwargs)
            except EnvMakeError as e:
                self.envs[key] = e
        env = self.envs[key]
        if isinstance(env, EnvMakeError):
            raise NoFramesError(str(env))
        obs, _ = env.reset(seed=episode.seed)
        wanted, frames = set(idx.tolist()), []
        for t in range(len(actions) + 1):
            if t in wanted:
                frame = env.render()
                if frame is None:
                    raise NoFramesError(f"env {env_cfg['name']!r} renders no frames (render() returned None)")
                frames.append(frame)
            if t < len(actions):
                obs, *_ = env.step(actions[t])
        return frames, obs

    def close(self) -> None:
        for env in self.envs.values():
            if not isinstance(env, EnvMakeError):
                env.close()


def _plot_strip(path: str, title: str, rows: list[tuple[EpisodeInfo, np.ndarray, list[np.ndarray], str]]) -> None:
    ncols = max(len(r[1]) for r in rows)
    fig = Figure(figsize=(2.0 * ncols, 2.55 * len(rows) + 0.5), layout="constrained")
    fig.suptitle(title, fontsize=15, fontweight="bold")
    subfigs = np.atleast_1d(fig.subfigures(len(rows), 1))
    for sub, (episode, idx, frames, note) in zip(subfigs, rows):
        if episode.success is None:
            outcome, color = f"RETURN {episode.ret:.1f}", "#333333"
        else:
            outcome, color = ("SUCCESS", SUCCESS_COLOR) if episode.success else ("FAILURE", FAILURE_COLOR)
        said = f"“{episode.instruction}”  ·  " if episode.instruction else ""
        sub.suptitle(f"{outcome}  ·  {said}{_count(episode.length, 'step')}, seed {episode.seed}, {note}",
                     color=color, fontsize=11)
        axes = sub.subplots(1, ncols)
        for ax, i, frame in zip(np.atleast_1d(axes), idx, frames):
            ax.imshow(frame, interpolation="nearest")
            ax.set_title(f"t = {i}", fontsize=9)
            ax.set_axis_off()
        for ax in np.atleast_1d(axes)[len(frames):]:
            ax.set_axis_off()
    fig.savefig(path, dpi=90)


def _runs_in(path: str) -> list[str]:
    """``path``, or where it holds no ``metrics.jsonl`` the subfolders that do (the phases of a
    `robo-post run` folder: ``bc``, ``lwd``), so a pipeline's folder reports its learning curves."""
    if os.path.exists(os.path.join(path, "metrics.jsonl")):
        return [path]
    phases = sorted(os.path.join(path, n) for n in os.listdir(path)
                    if os.path.isfile(os.path.join(path, n, "metrics.jsonl")))
    return phases or [path]


def report_from_config(cfg: Any) -> str:
    """`robo-post report`: ``cfg`` has ``run_dir`` (path, list or null), ``eval_store``,
    ``results`` (JSON paths or null = all saved in the eval store), ``out_dir``, ``frames``."""
    run_dirs = [] if cfg.run_dir is None else [cfg.run_dir] if isinstance(cfg.run_dir, str) else list(cfg.run_dir)
    # A mistyped path would give a report of empty rows that looks like a run that logged nothing.
    for key, path in [("run_dir", d) for d in run_dirs] + [("eval_store", cfg.eval_store)] * bool(cfg.eval_store):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{key}={path}: no such folder (null to leave it out of the report)")
    run_dirs = [run for d in run_dirs for run in _runs_in(d)]
    if cfg.results is None:
        results = load_results(cfg.eval_store) if cfg.eval_store else []
    else:
        results = [read_result(path) for path in cfg.results]
    return write_report(cfg.out_dir, results, run_dirs, eval_store=cfg.eval_store, frames=cfg.frames)
