"""Closed loop on the tabletop tasks: BC, then offline and online critic-based extraction,
DIVL+QAM and FQL side by side from the same demos and the same BC policy.

    .venv/bin/python benchmarks/tabletop_loop.py                     # run.yaml defaults (~40 min on 2 cores)
    .venv/bin/python benchmarks/tabletop_loop.py --out runs/s1 seed=1 preset.eval_episodes=50 \
        --results benchmarks/results/tabletop_loop_interventions_seed1.json
    .venv/bin/python benchmarks/tabletop_loop.py recipe=none         # the plain loop: no overseer, frozen base
    .venv/bin/python benchmarks/tabletop_loop.py preset=long         # longer, stronger run
    .venv/bin/python benchmarks/tabletop_loop.py preset.online_publish_every=150 --algos divl_qam iql_qam fql

Any other argument is a hydra override of ``configs/run.yaml`` (the `robo-post run`
config). Stages:

1. ``shared``: `robo-post run` with the learner off: scripted demos + near-miss play
   recorded by the fleet, flow BC -> v1, BC evaluated, then BC's deploy episodes (800
   under the overseer in the default recipe, ``configs/recipe/``).
2. one directory per algorithm: a copy of the shared store (same data, same v1),
   then `robo-post run lwd.algo=ALGO`: offline extraction -> v2, then online with the
   fleet running the newest version -> v3, v4, ...; every new version evaluated
   on the same eval layouts (seen and held-out instruction phrasings).

Prints success per task for every version of every algorithm, the learner speed
(updates/s, data-wait fraction from ``metrics.jsonl``), a 95% Wilson interval on each
mean success (over all its episodes: about +-10 points at 20 per task), and the issue's targets
(+15 points mean success over BC after the online phase, DIVL+QAM beating FQL,
data-wait < 10%) with PASS/MISS. Results go to ``benchmarks/results/tabletop_loop.json``.
Each stage is skipped when its output exists, so a killed benchmark resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np

from robo_post.config import compose
from robo_post.eval import wilson_interval
from robo_post.pipelines.run import run
from robo_post.store import PolicyRegistry


def _run(root: str, overrides: list[str], extra: list[str]) -> dict:
    path = os.path.join(root, "summary.json")
    if not os.path.exists(path):
        run(compose("run", [*overrides, *extra, f"run_dir={root}"]))
    with open(path) as f:
        return json.load(f)


def _speed(lwd_dir: str) -> dict[str, float]:
    with open(os.path.join(lwd_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {"updates_per_s": float(np.mean([r["updates_per_s"] for r in rows])),
            "data_wait": float(np.mean([r["data_wait"] for r in rows])), "updates": rows[-1]["update"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench-tabletop-loop", help="working directory")
    parser.add_argument("--algos", nargs="+", default=["divl_qam", "fql"])
    parser.add_argument("--results", default="benchmarks/results/tabletop_loop.json")
    args, overrides = parser.parse_known_args()
    overrides = ["show=false", *overrides]

    shared = os.path.join(args.out, "shared")
    bc = _run(shared, overrides, ["lwd.enabled=false"])
    rows = [{"algo": "bc_flow", "phase": "bc", "version": r["version"], **r} for r in bc["results"]]
    speeds = {}
    for algo in args.algos:
        root = os.path.join(args.out, algo)
        if not os.path.exists(os.path.join(root, "store")):
            shutil.copytree(os.path.join(shared, "store"), os.path.join(root, "store.partial"))
            os.rename(os.path.join(root, "store.partial"), os.path.join(root, "store"))
        registry = PolicyRegistry(os.path.join(root, "store"))
        # Evaluate only this algorithm's versions: v1 is the shared BC, already evaluated.
        summary = _run(root, overrides, [f"lwd.algo={algo}", "eval.from_version=2"])
        for r in summary["results"]:
            phase = registry.load(r["version"])[1].get("phase", "?")
            rows.append({"algo": algo, "phase": phase, **r})
        speeds[algo] = _speed(os.path.join(root, "lwd"))

    tasks = list(rows[0]["per_task"])
    episodes_per_task = compose("run", overrides).eval.episodes_per_task
    for split in ("train", "heldout"):
        print(f"\nSuccess rate, {split} instruction phrasings (eval episodes per task: {episodes_per_task})")
        print(f"{'algo':<10} {'phase':<10} {'ver':>3} " + " ".join(f"{t:>7}" for t in tasks) + f" {'mean':>7}  95% interval")
        for r in rows:
            if r["split"] == split:
                n = len(tasks) * episodes_per_task
                low, high = wilson_interval(round(r["mean_success"] * n), n)
                print(f"{r['algo']:<10} {r['phase']:<10} {r['version']:>3} "
                      + " ".join(f"{100 * r['per_task'][t]:6.1f}%" for t in tasks)
                      + f" {100 * r['mean_success']:6.1f}%  {100 * low:.0f}-{100 * high:.0f}%")
    print(f"\nLearner speed (metrics.jsonl window means): " + "; ".join(
        f"{a}: {s['updates_per_s']:.2f} updates/s, data-wait {100 * s['data_wait']:.1f}%" for a, s in speeds.items()))

    def final(algo: str, split: str = "train") -> float:
        return [r for r in rows if r["algo"] == algo and r["split"] == split][-1]["mean_success"]

    bc_mean = final("bc_flow")
    print("\nTargets (train phrasings):")
    for algo in args.algos:
        gain = 100 * (final(algo) - bc_mean)
        print(f"  {algo} after the online phase vs BC: {gain:+.1f} points (target >= +15): {'PASS' if gain >= 15 else 'MISS'}")
    if {"divl_qam", "fql"} <= set(args.algos):
        d, f = final("divl_qam"), final("fql")
        print(f"  DIVL+QAM {100 * d:.1f}% vs FQL {100 * f:.1f}%: {'PASS' if d > f else 'MISS'}")
    for algo, s in speeds.items():
        print(f"  {algo} data-wait {100 * s['data_wait']:.1f}% (target < 10%): {'PASS' if s['data_wait'] < 0.1 else 'MISS'}")
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    with open(args.results, "w") as f:
        json.dump({"overrides": overrides, "rows": rows, "speed": speeds}, f, indent=1)
    print(f"\nwrote {args.results}")


if __name__ == "__main__":
    main()
