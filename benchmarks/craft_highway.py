"""CRAFT on highway-env with discrete meta-actions: pretrained vs. proxy-only vs. residual-only vs. CRAFT vs. CRAFT without KL.

Per seed: a candidate-scoring policy is behaviour-cloned from a mediocre heuristic
driver recorded by the fleet (SLOWER when the gap ahead is under 20 m, else IDLE),
then fine-tuned on-policy through the fleet by each arm with the same budget
(``--iterations`` x ``--episodes`` episodes), all from the same pretrained version:

- proxy only (RIFT-like): counterfactual group advantages, no residual, no KL;
- residual only: grounded event residual (dual-clipped REINFORCE), no proxy, no KL;
- CRAFT: proxy + residual + EMA-teacher KL (the defaults);
- CRAFT without KL;
- CRAFT with EVPO's explained-variance gate on the residual's baseline (``algo.baseline=evpo``).

``--arms`` runs a subset (the pretrained policy is always evaluated). Every version is evaluated greedily on the same fixed seeds. Printed per arm: return,
crash rate and mean speed with 95% t-intervals over seeds, KL to the teacher at the end,
wall time, and (CRAFT, first seed) the proxy-oracle correlation of group advantages on
the states its final policy visits (exact reactive clones scored beside the
non-reactive proxy).

``--scenario`` runs the same comparison on highway-env's merge or roundabout instead of
the fast highway (same observation, meta-actions and vocabulary; see
``robo_post.envs.highway_meta``): every collect, training run and evaluation gets it as
an env kwarg, and the pretrained policy is cloned from all the heuristic's demos, crashed
ones included.

``--env driving`` runs the arms on the continuous-action driving env
(``robo_post.envs.driving``, ``--scenario`` one of its scenarios, default highway-fast)
with CRAFT's proposal policy: K action chunks sampled from a Gaussian policy are the
candidates, scored counterfactually in non-reactive clones. The pretrained policy is
cloned by maximum likelihood from the scripted driving expert run with action noise
(``--demo-noise``), crash-free demos only; episodes last ``--duration`` decisions.
Crash counts a collision or leaving the road.

    python benchmarks/craft_highway.py                       # 3 seeds
    python benchmarks/craft_highway.py --quick               # 1 seed, tiny budget (smoke test)
    python benchmarks/craft_highway.py --scenario merge      # runs/bench_craft_merge, results/craft_merge.json
    python benchmarks/craft_highway.py --env driving         # runs/bench_craft_driving, results/craft_driving.json
    python benchmarks/craft_highway.py --drivers             # fixed drivers only, on the evaluation seeds
    python benchmarks/craft_highway.py --reuse --eval-episodes 50   # the finished runs again, on 50 seeds
    python benchmarks/craft_highway.py --reuse --teacher     # also the final EMA teachers of the finished runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = {
    "proxy_only": ["algo.use_residual=false", "algo.beta_sd=0"],
    # the guard and the veto read the proxy's scores, which this arm leaves out
    "residual_only": ["algo.use_proxy=false", "algo.beta_sd=0", "algo.guard_weight=0", "algo.veto_updates=0"],
    "craft": [],
    "craft_no_kl": ["algo.beta_sd=0"],
    "craft_evpo": ["algo.baseline=evpo"],
}


def cli(*args: str) -> str:
    """``robo-post ARGS``'s stdout; a failure stops the benchmark with the command and its error."""
    run = subprocess.run([sys.executable, "-m", "robo_post.cli", *args], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"robo-post {' '.join(args)} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return run.stdout


def summary_of(out: str) -> dict:
    return json.loads(out[out.index("{\n"):])


def finished(run_dir: str, reuse: bool) -> dict | None:
    """With ``--reuse``, the summary of a training run that already finished in ``run_dir`` (its
    ``summary.json``: version, learner wall time), so it is evaluated again instead of retrained."""
    path = os.path.join(run_dir, "summary.json")
    if not (reuse and os.path.exists(path)):
        return None
    with open(path) as f:
        return json.load(f)


def make_env(env_name: str, task: str | None, env_kwargs: dict):
    from robo_post.envs.registry import env_spec

    return env_spec(env_name).make(task, **env_kwargs)


def greedy_policy(store: str, version: int, teacher_of: str | None = None):
    """One published version as a greedy fleet policy that does not ask the env for counterfactual extras;
    with ``teacher_of`` (the run dir that published it), that run's final EMA teacher in its place,
    its weights read from the run's checkpoint."""
    import torch
    from safetensors.torch import load_file

    from robo_post.fleet.policies import build_policy
    from robo_post.store.registry import PolicyRegistry

    torch.set_num_threads(1)
    weights, config = PolicyRegistry(store).load(version)
    if teacher_of is not None:
        head = "module.teacher.policy."
        tensors = load_file(os.path.join(teacher_of, "checkpoint", "tensors.safetensors"))
        weights = {k[len(head):]: v for k, v in tensors.items() if k.startswith(head)}
    return build_policy(weights, {**config, "deterministic": True, "env_extras": False})


def evaluate(store: str, version: int, seeds: list[int], env_kwargs: dict, env_name: str = "highway_meta",
             task: str | None = None) -> dict:
    """Greedy episodes of one version on fixed seeds: return, crash, mean speed per episode."""
    return rollouts(greedy_policy(store, version), seeds, env_kwargs, env_name, task)


def rollouts(policy, seeds: list[int], env_kwargs: dict, env_name: str = "highway_meta", task: str | None = None
             ) -> dict:
    """Episodes of a fleet-style policy (``reset(env, seed)``, ``act(obs, env)``) on fixed seeds:
    mean return, crash rate (the first entry of the env's per-step ``events``: a crash, or
    for driving also leaving the road) and mean speed."""
    env = make_env(env_name, task, env_kwargs)
    returns, crashes, speeds = [], [], []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        policy.reset(env, seed)
        ret, speed = 0.0, []
        while True:
            obs, reward, terminated, truncated, info = env.step(policy.act(obs, env))
            ret += float(reward)
            speed.append(float(info["speed"]))
            if terminated or truncated:
                break
        returns.append(ret)
        crashes.append(float(info["events"][0]))
        speeds.append(float(np.mean(speed)))
    env.close()
    return {"return": float(np.mean(returns)), "crash": float(np.mean(crashes)), "speed": float(np.mean(speeds))}


def oracle_correlation(store: str, version: int, seeds: list[int], env_kwargs: dict, env_name: str = "highway_meta",
                       task: str | None = None) -> float | None:
    """Proxy-oracle correlation of group advantages on the states a version visits greedily.

    Every state is scored twice, in non-reactive clones (the proxy) and in exact ones
    (the oracle): cheaper than recording the oracle through a whole training run.
    """
    import torch

    from robo_post.fleet.policies import build_policy
    from robo_post.learner.craft_driver import proxy_oracle_correlation
    from robo_post.store.registry import PolicyRegistry

    torch.set_num_threads(1)
    weights, config = PolicyRegistry(store).load(version)
    policy = build_policy(weights, {**config, "deterministic": True, "env_extras": True})
    env = make_env(env_name, task, {**env_kwargs, "oracle": True})
    scores: dict[str, list] = {"proxy_scores": [], "oracle_scores": []}
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        policy.reset(env, seed)
        while True:
            action = policy.act(obs, env)
            extras = policy.extras()
            for key in scores:
                scores[key].append(extras[key])
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
    env.close()
    return proxy_oracle_correlation({k: np.stack(v) for k, v in scores.items()})


def interval(values: list[float]) -> str:
    from scipy import stats

    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return f"{v.mean():.2f}"
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return f"{v.mean():.2f} [{v.mean() - half:.2f}, {v.mean() + half:.2f}]"


class FixedDriver:
    """A scripted meta-action driver as a fleet-style policy for :func:`rollouts`."""

    def __init__(self, choose):
        self.choose = choose

    def reset(self, env, seed) -> None:
        pass

    def act(self, obs, env) -> int:
        return int(self.choose(env))


def fixed_drivers(seeds: list[int], env_kwargs: dict) -> dict[str, dict]:
    """Return, crash rate and mean speed of the scripted references on the evaluation seeds: the
    heuristic the policies are cloned from, the same driver keeping right when it can, always SLOWER."""
    from robo_post.envs.highway_meta import SLOWER, HeuristicDriver

    drivers = {"heuristic": HeuristicDriver(), "heuristic, keep right": HeuristicDriver(keep_right=True),
               "always SLOWER": lambda env: SLOWER}
    return {name: rollouts(FixedDriver(d), seeds, env_kwargs) for name, d in drivers.items()}


def main() -> None:
    from robo_post.envs.driving import SCENARIOS as DRIVING_SCENARIOS
    from robo_post.envs.highway_meta import SCENARIOS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=("highway_meta", "driving"), default="highway_meta",
                        help="highway_meta: vocabulary policy; driving: proposal policy on continuous actions")
    parser.add_argument("--scenario", choices=SCENARIOS + DRIVING_SCENARIOS, default=None,
                        help="highway_meta: highway (default) | merge | roundabout; driving: highway-fast (default) | "
                             "merge | roundabout")
    parser.add_argument("--demo-noise", type=float, default=None,
                        help="std of the demonstrator's action noise (default 0; driving 0.4)")
    parser.add_argument("--duration", type=int, default=75, help="driving: decisions per episode")
    parser.add_argument("--env-kwargs", default="{}",
                        help="JSON env kwargs for every collect, run and evaluation (e.g. '{\"lane_features\": true}')")
    parser.add_argument("--train", default="",
                        help="extra space-separated `robo-post train` overrides for every run (e.g. algo.lr=1e-4)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="training seeds are first-seed .. first-seed + seeds - 1 (e.g. 3 more seeds after a 3-seed run)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--episodes", type=int, default=8, help="episodes per iteration")
    parser.add_argument("--eval-episodes", type=int, default=30)
    parser.add_argument("--demos", type=int, default=30)
    parser.add_argument("--oracle-episodes", type=int, default=3,
                        help="greedy CRAFT episodes (first seed) whose states are scored by proxy and oracle")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    parser.add_argument("--reuse", action="store_true",
                        help="evaluate the runs already finished in --work (e.g. on more --eval-episodes) instead of "
                             "training them again; the others are trained")
    parser.add_argument("--teacher", action="store_true",
                        help="also evaluate each run's final EMA teacher (arm <arm>_teacher), read from its checkpoint")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--drivers", action="store_true",
                        help="only evaluate the scripted drivers (heuristic, heuristic keeping right, always SLOWER)")
    parser.add_argument("--work", default=None,
                        help="work dir (default runs/bench_craft, runs/bench_craft_<scenario> off the highway)")
    parser.add_argument("--out", default=None, help="results file (default results/craft_<scenario>.json)")
    args = parser.parse_args()
    driving = args.env == "driving"
    if args.scenario is None:
        args.scenario = "highway-fast" if driving else "highway"
    if args.scenario not in (DRIVING_SCENARIOS if driving else SCENARIOS):
        parser.error(f"--scenario {args.scenario!r} is not a scene of env {args.env}")
    if args.demo_noise is None:
        args.demo_noise = 0.4 if driving else 0.0
    name = f"driving_{args.scenario}" if driving and args.scenario != "highway-fast" else (
        "driving" if driving else args.scenario)
    if args.work is None:
        args.work = "runs/bench_craft" if name == "highway" else f"runs/bench_craft_{name}"
    if args.out is None:
        args.out = os.path.join(HERE, "results", f"craft_{name}.json")
    task = args.scenario if driving else None  # a driving scenario is the env's task
    # highway is the env's default scene: no kwarg, so its commands and stores stay as before.
    env_kwargs = {"duration": args.duration} if driving else {} if args.scenario == "highway" else {
        "scenario": args.scenario}
    env_kwargs.update(json.loads(args.env_kwargs))
    # Off the highway the policy is cloned from every demo, not only the crash-free ones: the
    # heuristic crashes in most merge episodes, and its actions are the same either way.
    demo_filter = [] if args.scenario in ("highway", "highway-fast") else ["data.success=null"]
    if args.quick:
        args.seeds, args.iterations, args.episodes, args.eval_episodes, args.demos = 1, 1, 2, 4, 4
        args.oracle_episodes = 1
    arms = {arm: ARMS[arm] for arm in args.arms.split(",")} if set(args.arms.split(",")) <= ARMS.keys() else None
    if arms is None:
        parser.error(f"--arms {args.arms!r}: choose from {', '.join(ARMS)}")
    eval_seeds = list(range(100, 100 + args.eval_episodes))
    if args.drivers:
        if driving:
            parser.error("--drivers needs --env highway_meta (the scripted meta-action drivers)")
        for name, r in fixed_drivers(eval_seeds, env_kwargs).items():
            print(f"{name:<24} return {r['return']:6.2f}  crash rate {r['crash']:.2f}  mean speed {r['speed']:.2f}")
        return
    store = os.path.join(args.work, "demos")
    t_all = time.perf_counter()
    if not os.path.exists(os.path.join(store, "store.json")):
        cli("collect", f"env={args.env}", *[f"+env.kwargs.{k}={v}" for k, v in env_kwargs.items()], "policy=expert",
            *([f"policy.noise={args.demo_noise}"] if args.demo_noise else []), *([f"env.tasks=[{task}]"] if task else []),
            f"episodes={args.demos}", f"store={store}", "show=false")
    results: dict[str, list[dict]] = {arm: [] for arm in ["pretrained", *arms]}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        base = ["train", "algo=craft", f"store={store}", f"seed={seed}", "show=false", "torch_threads=1",
                *[f"+algo.env_kwargs.{k}={v}" for k, v in env_kwargs.items()], *demo_filter, *args.train.split()]
        pre = finished(f"{args.work}/s{seed}/pretrain", args.reuse) or summary_of(cli(
            *base, f"run_dir={args.work}/s{seed}/pretrain", "algo.iterations=0",
            f"algo.online_store={args.work}/s{seed}/pretrain-online"))
        reference = pre["pretrained_version"]
        results["pretrained"].append({**evaluate(store, reference, eval_seeds, env_kwargs, args.env, task),
                                      "wall_s": 0.0})
        print(f"seed {seed} pretrained: {results['pretrained'][-1]}", flush=True)
        for arm, overrides in arms.items():
            out = finished(f"{args.work}/s{seed}/{arm}", args.reuse)
            if out is None:
                t0 = time.perf_counter()
                out = summary_of(cli(*base, f"run_dir={args.work}/s{seed}/{arm}", f"algo.reference_version={reference}",
                                     f"algo.iterations={args.iterations}", f"algo.episodes_per_iteration={args.episodes}",
                                     f"algo.online_store={args.work}/s{seed}/{arm}-online", *overrides))
                out["wall_s"] = time.perf_counter() - t0
            rows = [json.loads(line) for line in open(f"{args.work}/s{seed}/{arm}/metrics.jsonl")]
            corr = (oracle_correlation(store, out["version"], eval_seeds[:args.oracle_episodes], env_kwargs, args.env,
                                       task) if arm == "craft" and seed == args.first_seed else None)
            results[arm].append({**evaluate(store, out["version"], eval_seeds, env_kwargs, args.env, task),
                                 "version": out["version"], "wall_s": out["wall_s"],
                                 "kl_teacher": rows[-1]["kl_teacher"], "proxy_oracle_corr": corr})
            print(f"seed {seed} {arm}: {results[arm][-1]}", flush=True)
            if args.teacher:
                teacher = greedy_policy(store, out["version"], teacher_of=f"{args.work}/s{seed}/{arm}")
                results.setdefault(f"{arm}_teacher", []).append(
                    {**rollouts(teacher, eval_seeds, env_kwargs, args.env, task), "wall_s": out["wall_s"]})
                print(f"seed {seed} {arm}_teacher: {results[f'{arm}_teacher'][-1]}", flush=True)
    print(f"\n{'arm':<15}{'return':>26}{'crash rate':>26}{'mean speed':>26}{'KL teacher':>12}{'wall s':>8}")
    for arm, rows in results.items():
        kl = [r["kl_teacher"] for r in rows if "kl_teacher" in r]
        print(f"{arm:<15}{interval([r['return'] for r in rows]):>26}{interval([r['crash'] for r in rows]):>26}"
              f"{interval([r['speed'] for r in rows]):>26}{(f'{np.mean(kl):.4f}' if kl else '-'):>12}"
              f"{np.mean([r['wall_s'] for r in rows]):>8.0f}")
    corr = [r["proxy_oracle_corr"] for r in results.get("craft", []) if r.get("proxy_oracle_corr") is not None]
    if corr:
        print(f"proxy-oracle correlation of group advantages (CRAFT, seed {args.first_seed}): {corr[0]:.3f}")
    if name == "highway":  # the spec's targets are for the fast highway (meta-actions) only
        print("targets: CRAFT return >= 22, crash rate <= 0.10, mean speed > 20 m/s, ahead of both ablations")
    print(f"wall {time.perf_counter() - t_all:.0f} s")
    if not args.quick:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
