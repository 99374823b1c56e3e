"""Steering a frozen actor to a new goal: the PoE grid on the point mass and on MuJoCo Reacher.

1. Point mass: old-goal demonstrations (noisy scripted controller, goal fixed at
   (0.5, 0.5)) -> ``algo=gaussian_bc`` with the goal left out of its inputs: a frozen
   Gaussian actor that always goes to the old goal. Steered towards each episode's
   observed goal by the env's PD prior.
2. Reacher: an SB3 SAC agent trained on a fixed target, saved to a zip and loaded with
   SB3's loader; steered toward each episode's target by the Jacobian-transpose prior.
3. Reacher at new fixed targets (``--only new_targets``): the same SAC agent, every episode
   at one of four targets it was not trained for, with the good and the honest random prior.
4. Deployment at those targets (``--only deploy``): ``robo-post steer`` with
   ``selector.kind=auto`` (good and honest random prior) and with the KL budget alone.

For each, ``robo-post steer-eval`` runs the grid: prior qualities (good, degraded,
honest random, overconfident random) x rules (PoE, KL-Reg, additive) x alpha, plus
prior-only, the KL-budget selector (eps 0.5 and 2) and the bandit selector (30 and 60
calibration episodes), every arm on the same seeds. This script prints the cells, the
HELP / FROZEN / HURT counts (paired bootstrap 95% CIs of the success-rate difference
against the frozen actor, then of the return difference, against 0 and against a 1%
equivalence margin), each selector's alpha
next to the oracle's (scored against the alphas tied with the oracle within the 1%
margin) with the calibration episodes it spent, and the largest deterministic PoE -
KL-Reg return difference.

    python benchmarks/poe_steering.py                     # all four parts, full grid
    python benchmarks/poe_steering.py --quick             # small grid (smoke test)
    python benchmarks/poe_steering.py --only point_mass
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from robo_post.steering.evaluate import format_table, label

HERE = os.path.dirname(os.path.abspath(__file__))
MARGIN = 0.01  # equivalence margin, a fraction of |frozen return|
OLD_TARGET = [0.1, 0.1]  # the Reacher target the SAC agent is trained for
NEW_TARGETS = ([-0.1, 0.1], [-0.1, -0.1], [0.1, -0.1], [0.0, 0.15])  # each over 0.1 m from it


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "robo_post.cli", *args], check=True)


def point_mass(work: str, episodes: int, quick: bool) -> dict:
    store = os.path.join(work, "point_mass_old")
    if not os.path.exists(os.path.join(store, "policies")):  # the actor is built once, then reused
        cli("collect", "env=point_mass", "+env.kwargs.goal=[0.5,0.5]", "policy.noise=0.3",
            f"episodes={40 if quick else 200}", f"store={store}", "show=false")
        cli("train", "algo=gaussian_bc", f"store={store}", f"run_dir={store}-bc", f"updates={1500 if quick else 5000}",
            "model.features={goal: null}", "data.success=null", "batch_size=64", "show=false")
    out = os.path.join(work, "point_mass_grid")
    cli("steer-eval", "env=point_mass", "actor.kind=registry", f"actor.store={store}", f"episodes={episodes}",
        f"out_dir={out}", f"margin={MARGIN}", "show=false")
    return json.load(open(os.path.join(out, "steering.json")))["results"]


def reacher_zip(work: str, sac_steps: int) -> str:
    """An SB3 SAC agent trained ``sac_steps`` steps on the old target (0.1, 0.1), saved once."""
    import torch
    from stable_baselines3 import SAC

    from robo_post.envs.registry import env_spec

    torch.set_num_threads(1)
    zip_path = os.path.join(work, f"reacher_sac_{sac_steps}.zip")
    if not os.path.exists(zip_path):
        env = env_spec("reacher").make(None, target=OLD_TARGET)
        model = SAC("MultiInputPolicy", env, seed=0, verbose=0, learning_starts=1000)
        t0 = time.perf_counter()
        model.learn(sac_steps)
        print(f"SAC on the fixed target: {sac_steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
        model.save(zip_path)
    return zip_path


def reacher(work: str, episodes: int, sac_steps: int) -> dict:
    out = os.path.join(work, "reacher_grid")
    cli("steer-eval", "env=reacher", "actor.kind=sb3", f"actor.path={reacher_zip(work, sac_steps)}", "actor.algo=SAC",
        f"episodes={episodes}", f"out_dir={out}", f"margin={MARGIN}", "show=false")
    return json.load(open(os.path.join(out, "steering.json")))["results"]


def new_targets(work: str, episodes: int, sac_steps: int) -> dict:
    """The SAC agent of the old target at each new target: PoE per alpha, the KL selector (eps 2) and
    the bandit, with the good and the honest random prior; success is within 5 cm at the last step."""
    zip_path = reacher_zip(work, sac_steps)
    report = {}
    for target in NEW_TARGETS:
        name = f"{target[0]:g},{target[1]:g}"
        out = os.path.join(work, f"reacher_target_{target[0]:g}_{target[1]:g}")
        cli("steer-eval", "env=reacher", f"+env.kwargs.target=[{name}]", "actor.kind=sb3", f"actor.path={zip_path}",
            "actor.algo=SAC", f"episodes={episodes}", "qualities=[good,random_honest]", "rules=[poe]",
            "kl_budgets=[2.0]", "stochastic=false", f"out_dir={out}", f"margin={MARGIN}", "show=false")
        results = json.load(open(os.path.join(out, "steering.json")))["results"]
        report[name] = {}
        for quality, res in results.items():
            cells = {(c["arm"], c["alpha"]): c for c in res["cells"]}
            report[name][quality] = {
                "frozen_success": cells[("frozen", 0.0)]["success"],
                "poe_success": {a: cells[("poe", a)]["success"] for a in (0.1, 0.3, 0.5, 0.7, 0.9)},
                "oracle_set": res["oracle_set"],
                "selectors": {s["selector"]: {"alpha": s["alpha"], "success": s["success"], "label": s["label"],
                                              "episodes_spent": s.get("episodes_spent"),
                                              "kl_curve": s.get("kl_curve")} for s in res["selectors"]},
            }
    print(f"\n=== Reacher, SAC for the target {OLD_TARGET} at new targets ({episodes} episodes per arm) ===")
    print(f"{'target':<12}{'prior':<15}{'frozen':>7}{'PoE 0.5':>8}  "
          "selector: alpha, success, label [calibration episodes]")
    for name, by_quality in report.items():
        for quality, r in by_quality.items():
            chosen = "; ".join(f"{k}: {v['alpha']:g}, {v['success']:.2f}, {v['label']}"
                               + (f" [{v['episodes_spent']}]" if v["episodes_spent"] else "")
                               for k, v in r["selectors"].items())
            print(f"{name:<12}{quality:<15}{r['frozen_success']:>7.2f}{r['poe_success'][0.5]:>8.2f}  {chosen}")
    return report


def deploy(work: str, episodes: int, sac_steps: int) -> dict:
    """``robo-post steer`` at each new target: ``selector.kind=auto`` (KL fallback eps 2) with the good and
    the honest random prior, and the KL budget (eps 2) alone; success of the deployed episodes."""
    zip_path = reacher_zip(work, sac_steps)
    runs = {"auto, good prior": ["selector.kind=auto", "prior.quality=good"],
            "auto, honest random prior": ["selector.kind=auto", "prior.quality=random_honest"],
            "KL budget, good prior": ["prior.quality=good"]}
    report = {}
    for target in NEW_TARGETS:
        name = f"{target[0]:g},{target[1]:g}"
        report[name] = {}
        for run, overrides in runs.items():
            store = os.path.join(work, "deploy", f"{target[0]:g}_{target[1]:g}_{len(report[name])}")
            out = subprocess.run([sys.executable, "-m", "robo_post.cli", "steer", "env=reacher",
                                  f"+env.kwargs.target=[{name}]", "actor.kind=sb3", f"actor.path={zip_path}",
                                  "actor.algo=SAC", "selector.kl_budget=2", *overrides, f"episodes={episodes}",
                                  "fleet.n_clients=1", f"store={store}", "show=false"],
                                 check=True, capture_output=True, text=True).stdout
            summary = json.loads(out)
            report[name][run] = {"selector": summary["selection"]["kind"], "alpha": summary["steering"]["alpha"],
                                 "success": summary["success"], "episodes": summary["episodes"],
                                 "calibration_episodes": summary["selection"].get("episodes"),
                                 "mean_return": summary["mean_return"]}
    print(f"\n=== robo-post steer at new Reacher targets ({episodes} deployed episodes each) ===")
    for name, by_run in report.items():
        print(f"{name:<12}" + "; ".join(f"{run}: {r['selector']} alpha {r['alpha']:g}, success {r['success']:.2f}"
                                        for run, r in by_run.items()))
    return report


def label_vs_zero(cell: dict) -> str:
    """A cell's label without the equivalence margin: success first where defined, then return (as steer-eval)."""
    by_success = label(*cell["success_ci"]) if "success_ci" in cell else "FROZEN"
    return by_success if by_success != "FROZEN" else label(*cell["ci"])


def summarise(name: str, results: dict) -> dict:
    print(f"\n=== {name} ===")
    print(format_table(results))
    summary = {}
    for quality, res in results.items():
        frozen = next(c for c in res["cells"] if c["arm"] == "frozen")
        counts, counts_margin = {}, {}
        for c in res["cells"]:
            if c["arm"] in ("poe", "klreg", "additive", "prior"):
                key = c["arm"]
                counts.setdefault(key, {"HELP": 0, "FROZEN": 0, "HURT": 0})[label_vs_zero(c)] += 1
                counts_margin.setdefault(key, {"HELP": 0, "FROZEN": 0, "HURT": 0})[c["label"]] += 1
        summary[quality] = {
            "frozen_return": frozen["return"], "frozen_success": frozen["success"], "labels": counts,
            "labels_1pct_margin": counts_margin, "oracle_alpha": res["oracle_alpha"], "oracle_set": res["oracle_set"],
            "selectors": {s["selector"]: {"alpha": s["alpha"], "steps_from_oracle_set": s["steps_from_oracle"],
                                          "success": s["success"], "return": s["return"], "label": s["label"],
                                          "episodes_spent": s.get("episodes_spent")}
                          for s in res["selectors"]},
            "deterministic_poe_klreg_gap": res["deterministic_poe_klreg_gap"],
        }
    print(f"\n{'prior':<22}{'rule':<10}{'HELP/FROZEN/HURT':>18}{'  (1% margin)':>16}")
    for quality, s in summary.items():
        for rule, c in s["labels"].items():
            m = s["labels_1pct_margin"][rule]
            print(f"{quality:<22}{rule:<10}{c['HELP']:>8}/{c['FROZEN']}/{c['HURT']:<6}{m['HELP']:>8}/{m['FROZEN']}/{m['HURT']}")
    for kind in ("KL budget", "bandit"):
        near = [v["steps_from_oracle_set"] <= 1 for s in summary.values() for k, v in s["selectors"].items()
                if k.startswith(kind)]
        hurt = [v["label"] == "HURT" for s in summary.values() for k, v in s["selectors"].items() if k.startswith(kind)]
        print(f"{kind} selector within one grid step of the oracle set: {sum(near)}/{len(near)} cells, "
              f"HURT in {sum(hurt)}")
    print(f"max |deterministic PoE - KL-Reg| return: {max(s['deterministic_poe_klreg_gap'] for s in summary.values()):.2e}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small grid (40 episodes per arm)")
    parser.add_argument("--only", choices=["point_mass", "reacher", "new_targets", "deploy"])
    parser.add_argument("--sac-steps", type=int, default=20_000)
    parser.add_argument("--work", default="runs/bench_steering")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "poe_steering.json"))
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    t0 = time.perf_counter()
    report = {}
    if args.only in (None, "point_mass"):
        report["point_mass"] = summarise("point mass (Gaussian BC actor, PD prior)",
                                         point_mass(args.work, 40 if args.quick else 200, args.quick))
    if args.only in (None, "reacher"):
        report["reacher"] = summarise("Reacher (SB3 SAC actor from its zip, Jacobian-transpose prior)",
                                      reacher(args.work, 40 if args.quick else 100,
                                              5000 if args.quick else args.sac_steps))
    if args.only in (None, "new_targets"):
        report["new_targets"] = new_targets(args.work, 10 if args.quick else 30, 5000 if args.quick else args.sac_steps)
    if args.only in (None, "deploy"):
        report["deploy"] = deploy(args.work, 10 if args.quick else 30, 5000 if args.quick else args.sac_steps)
    report["wall_s"] = time.perf_counter() - t0
    print(f"\nwall {report['wall_s']:.0f} s")
    if not args.quick:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=lambda x: float(x) if isinstance(x, np.floating) else str(x))


if __name__ == "__main__":
    main()
