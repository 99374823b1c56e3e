"""A user's own Minari data on a standard gymnasium MuJoCo task: do our critic-based methods
beat BC on all the data and d3rlpy's IQL, with value ranges from the data?

What: a falling task (``InvertedDoublePendulum-v5``: the episode terminates when the pole
falls; surviving to the time limit is the success), mixed-quality data recorded by the fleet,
exported to Minari and imported into a fresh store the way a user brings a foreign dataset:
with an explicit success rule (``--success-from truncation``). Every step goes through the
``robo-post`` CLI, as a user would run it; the commands are printed and saved in the results.

How, top to bottom:

1. An SB3 agent (PPO) trained from the CLI (``robo-post train algo=sb3``) in two stages in one
   run_dir: ``--weak-timesteps`` published as v1 (the weaker checkpoint), then resumed to
   ``--expert-timesteps`` and published as v2 (the expert); re-running the finished run with
   ``algo.deterministic=false`` trains nothing and publishes the same weights as v3, which
   samples its actions (the noisy expert).
2. The fleet records weak (v1), expert (v2) and noisy (v3) episodes, each with its version
   pinned (``fleet.policy_version``), and random ones (``policy=random``).
3. ``robo-post store export-minari`` then ``store import-minari --success-from truncation``
   into a fresh store: the training data.
4. Same update budget (``--updates`` at ``--batch-size`` windows) for: BC on all data
   (``data.success=null``), filtered BC (the default ``data.success=true``), DIVL+QAM,
   IQL+QAM and FQL (``algo.reference_version=<BC on all data>``: their updates come on top
   of that reference's), each with the defaults of ``robo-post train``; the value ranges are
   the driver's (measured on the data). ``--variant NAME=ALGO k=v ...`` adds more runs
   (command-line settings only); the default variants are ``bc_all_2x`` (BC on all data,
   twice the updates: the critic methods' total including their reference) and
   ``divl_qam_bon8`` (DIVL+QAM acting by the best of 8 chunks under its critic).
5. d3rlpy's IQL (external peer, d3rlpy 2.7) on the same transitions read from the imported
   store, the same number of gradient steps at the same batch size (transitions, not
   windows), IQL's locomotion settings (expectile 0.7, AWR temperature 3), standardised
   observations; time-outs are d3rlpy timeouts (bootstrapped), terminations terminal.
6. Evaluation: ``robo-post eval store=... env=<id> version=[...] episodes_per_task=N`` for
   every version (one client, so one fixed list of eval seeds), the expert on the SB3 store
   with the same seeds, and d3rlpy's policy in-process on exactly those seeds and env
   (``episode_seed(seed, "eval-c0", k)``, the eval client's), deterministic actions.
   Returns are reported with 95% t intervals and as ratios to the dataset's mean episode
   return and to the expert's mean eval return (95% bootstrap intervals, both samples
   resampled).

Target: a critic-based method beats BC on all data and d3rlpy's IQL.
Misses are reported, never raised (exit 0).

Measured (results/foreign_dataset.json, 12 min on 2 shared cores; command in the file): data
180 episodes, 9742 steps, mean episode return 493 (6 episodes survive to the 200-step limit).
Eval return (30 episodes): BC all data 606, filtered BC 1708, DIVL+QAM 596, IQL+QAM 559, FQL
687, BC all data at 4000 updates 814, d3rlpy IQL 203, expert 986. FQL beats BC on all data
(intervals overlap), every critic method beats d3rlpy's IQL (disjoint); filtered BC (6
episodes) beats every method (docs/notes/offline-learning.md has the figures under earlier defaults).
With PPO at learning rate 1e-3 and target_kl 0.05 the published 300k-step agent had collapsed
(episodes of 8-16 steps while its training log read ~1700): the published version is the last
policy, so a stabler setting (target_kl 0.02) is the default.

Run:
    python benchmarks/foreign_dataset.py --quick    # smoke variant, a few minutes
    python benchmarks/foreign_dataset.py            # the full benchmark
Writes benchmarks/results/foreign_dataset[_quick].json (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_SEED = 1000003  # robo-post eval's default base seed
CRITICS = ("divl_qam", "iql_qam", "fql")
SOURCES = ("expert", "noisy", "weak", "random")
LABELS = {"bc_all": "BC, all data", "bc_success": "BC, successes only", "divl_qam": "DIVL+QAM",
          "iql_qam": "IQL+QAM", "fql": "FQL", "d3rlpy_iql": "d3rlpy IQL", "expert": "expert (SB3, v2)"}
COMMANDS: list[str] = []


# --- the CLI ----------------------------------------------------------------------------
def robo_post(*args: str, timeout: int = 3600) -> str:
    """Run ``robo-post ARGS`` (this interpreter's), record the command, return stdout."""
    cmd = [sys.executable, "-m", "robo_post.cli", *args]
    shown = "robo-post " + " ".join(shlex.quote(a) for a in args)
    COMMANDS.append(shown)
    print(f"$ {shown}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {shown}\n{r.stderr[-4000:]}")
    print(f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    return r.stdout


def train(store: str, run_dir: str, *overrides: str) -> dict[str, Any]:
    """``robo-post train``; its summary (the run is reused when its summary exists: no republish)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        robo_post("train", f"store={store}", f"run_dir={run_dir}", "show=false", *overrides)
    with open(path) as f:
        return json.load(f)


# --- statistics ------------------------------------------------------------------------
def t_interval(x: np.ndarray) -> list[float]:
    from scipy import stats

    if len(x) < 2:
        return [float("nan")] * 2
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    return [float(x.mean() - half), float(x.mean() + half)]


def ratio_interval(num: np.ndarray, den: np.ndarray, rng: np.random.Generator, n: int = 10_000) -> list[float]:
    """95% bootstrap interval of mean(num) / mean(den), both samples resampled."""
    a = num[rng.integers(0, len(num), (n, len(num)))].mean(1)
    b = den[rng.integers(0, len(den), (n, len(den)))].mean(1)
    return [float(v) for v in np.percentile(a / b, [2.5, 97.5])]


# --- d3rlpy (external peer) ----------------------------------------------------------------
def run_d3rlpy(method: str, store_root: str, updates: int, batch_size: int, gamma: float, seed: int) -> tuple[Any, dict]:
    """d3rlpy's ``d3rlpy_bc``, ``d3rlpy_iql`` or ``d3rlpy_td3bc`` on the store's transitions, with their
    published locomotion settings and standardised observations, ``updates`` gradient steps."""
    with contextlib.redirect_stderr(io.StringIO()):  # d3rlpy imports the old gym, which prints a notice
        import d3rlpy
    import structlog
    from d3rlpy.algos.utility import build_scalers_with_transition_picker
    from d3rlpy.preprocessing import StandardObservationScaler
    from offline_to_online import d3rlpy_dataset  # the same store -> d3rlpy conversion as the E3 benchmark

    from robo_post.store import Store

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    d3rlpy.seed(seed)
    snap = Store.open(store_root).snapshot()
    (key,) = snap.store.schema.observations
    dataset = d3rlpy_dataset(snap, snap.episodes(), key)
    scaler = StandardObservationScaler()
    configs = {
        "d3rlpy_bc": lambda: d3rlpy.algos.BCConfig(batch_size=batch_size, observation_scaler=scaler),
        "d3rlpy_iql": lambda: d3rlpy.algos.IQLConfig(batch_size=batch_size, gamma=gamma, expectile=0.7,
                                                     weight_temp=3.0, observation_scaler=scaler),
        "d3rlpy_td3bc": lambda: d3rlpy.algos.TD3PlusBCConfig(batch_size=batch_size, gamma=gamma, alpha=2.5,
                                                             observation_scaler=scaler),
    }
    algo = configs[method]().create(device="cpu:0")
    build_scalers_with_transition_picker(algo, dataset)  # what ``fit`` does first, without its logger
    algo.build_with_dataset(dataset)
    t0 = time.perf_counter()
    metrics: dict = {}
    for _ in range(updates):
        metrics = algo.update(dataset.sample_transition_batch(batch_size))
    return algo, {"transitions": dataset.transition_count, "episodes": dataset.size(), "obs_key": key,
                  "wall_s": time.perf_counter() - t0, "final": {k: float(v) for k, v in metrics.items()}}


def eval_d3rlpy(algo: Any, key: str, env_id: str, env_kwargs: dict, episodes: int) -> np.ndarray:
    """Returns of ``algo``'s deterministic policy on the eval client's seeds and env."""
    from robo_post.envs.registry import env_spec
    from robo_post.fleet.client import episode_seed, executable_action

    env = env_spec(env_id).make(None, **env_kwargs)
    returns = []
    for k in range(episodes):
        obs, _ = env.reset(seed=episode_seed(EVAL_SEED, "eval-c0", k))
        total, done = 0.0, False
        while not done:
            action = executable_action(algo.predict(obs[key][None].astype(np.float32))[0], env.action_space)
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return np.array(returns)


# --- main --------------------------------------------------------------------------------
def parse_variant(text: str) -> tuple[str, str, list[str]]:
    name, _, rest = text.partition("=")
    algo, *overrides = shlex.split(rest)
    if not name or algo not in ("bc_flow",) + CRITICS:
        raise argparse.ArgumentTypeError(f"--variant NAME=ALGO k=v ... with ALGO in bc_flow, {', '.join(CRITICS)}: {text!r}")
    return name, algo, overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke variant: tiny agent, data and budgets")
    parser.add_argument("--env", default="InvertedDoublePendulum-v5")
    parser.add_argument("--max-episode-steps", type=int, default=200,
                        help="time limit of every env (training, collection, eval); 0 = the env's own (1000)")
    parser.add_argument("--agent", default="PPO")
    parser.add_argument("--agent-hyperparameters", default="{learning_rate: 0.001, target_kl: 0.02}",
                        help="algo.hyperparameters of the SB3 agent (hydra dict)")
    parser.add_argument("--weak-timesteps", type=int, default=40_000)
    parser.add_argument("--expert-timesteps", type=int, default=200_000)
    parser.add_argument("--episodes", default="expert=30,noisy=30,weak=60,random=60",
                        help="episodes recorded per source")
    parser.add_argument("--updates", type=int, default=2000, help="update budget of every method")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="model.hidden_dim=128 model.embed_dim=64", help="extra overrides of every robo-post train run, e.g. model.hidden_dim=128")
    parser.add_argument("--eval-episodes", type=int, default=30)
    parser.add_argument("--variant", action="append", type=parse_variant, default=None,
                        help="extra run NAME=ALGO k=v ... (critic methods start from BC on all data unless "
                             "algo.reference_version is given); repeatable")
    parser.add_argument("--no-d3rlpy", action="store_true")
    parser.add_argument("--workdir", default=None, help="default runs/foreign_dataset[_quick]")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the workdir: finished stages (agent, data, runs with a summary) are reused")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/foreign_dataset[_quick].json)")
    args = parser.parse_args()
    if args.quick:
        args.weak_timesteps, args.expert_timesteps = 2048, 8192
        args.episodes, args.updates, args.eval_episodes = "expert=4,noisy=4,weak=6,random=6", 200, 4
        args.model = "model.hidden_dim=64 model.embed_dim=32"
    if args.variant is None:
        args.variant = [parse_variant(f"bc_all_2x=bc_flow data.success=null updates={2 * args.updates}"),
                        parse_variant("divl_qam_bon8=divl_qam algo.best_of_n=8")]
    suffix = "_quick" if args.quick else ""
    work = os.path.abspath(args.workdir or os.path.join(REPO, "runs", f"foreign_dataset{suffix}"))
    out = args.out or os.path.join(RESULTS, f"foreign_dataset{suffix}.json")
    if os.path.exists(work) and not args.reuse:
        shutil.rmtree(work)
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    counts = {k: int(v) for k, v in (kv.split("=") for kv in args.episodes.split(","))}
    env_kw = {"max_episode_steps": args.max_episode_steps} if args.max_episode_steps else {}
    limit = [f"+env.kwargs.max_episode_steps={args.max_episode_steps}"] if env_kw else []
    t_start = time.perf_counter()

    # 1-2. The agent (two stages, three versions) and the fleet's data, in registry order.
    sb3_store, sb3_run = os.path.join(work, "sb3_store"), os.path.join(work, "sb3")
    agent = [f"algo.env={args.env}", f"algo.agent={args.agent}", f"+algo.hyperparameters={args.agent_hyperparameters}",
             f"seed={args.seed}"] + ([f"+algo.env_kwargs.max_episode_steps={args.max_episode_steps}"] if env_kw else [])
    every = f"checkpoint_every={args.weak_timesteps}"

    def collect(source: str, *policy: str) -> None:
        robo_post("collect", f"env={args.env}", f"store={sb3_store}", f"episodes={counts[source]}",
                  "fleet.n_clients=1", f"fleet.client_prefix={source}", "show=false", f"seed={args.seed}", *limit, *policy)

    t0 = time.perf_counter()
    stages = {}
    if not os.path.exists(os.path.join(work, "data_done")):
        for source, stage in (("weak", [f"algo.timesteps={args.weak_timesteps}"]),
                              ("expert", [f"algo.timesteps={args.expert_timesteps}"]),
                              ("noisy", [f"algo.timesteps={args.expert_timesteps}", "algo.deterministic=false"])):
            robo_post("train", "algo=sb3", *agent, *stage, f"store={sb3_store}", f"run_dir={sb3_run}", "show=false", every)
            with open(os.path.join(sb3_run, "summary.json")) as f:
                stages[source] = json.load(f)
            collect(source, f"fleet.policy_version={stages[source]['version']}")  # that version, pinned
        collect("random", "policy=random")
        minari_root = os.path.join(work, "minari")
        robo_post("store", "export-minari", sb3_store, "user/idp-mixed-v0", "--minari-root", minari_root)
        robo_post("store", "import-minari", "user/idp-mixed-v0", os.path.join(work, "store"), "--minari-root",
                  minari_root, "--success-from", "truncation")
        with open(os.path.join(work, "data_done"), "w") as f:
            json.dump(stages, f)
    with open(os.path.join(work, "data_done")) as f:
        stages = json.load(f)
    data_s = time.perf_counter() - t0
    store = os.path.join(work, "store")
    info = json.loads(robo_post("store", "info", store, "--json"))

    from robo_post.store import Store

    episodes = Store.open(store).snapshot().episodes()
    version_source = {stages[s]["version"]: s for s in stages}
    by_source: dict[str, list] = {s: [] for s in SOURCES}
    for e in episodes:  # the fleet's policy label survives the Minari round trip in attrs
        label = e.attrs.get("policy", "")
        by_source[version_source.get(int(label[1:]), "?") if label.startswith("v") else "random"].append(e)
    data_returns = np.array([e.ret for e in episodes])
    data_summary = {
        "episodes": len(episodes), "steps": info["steps"], "success_rate": info["success_rate"],
        "mean_return": float(data_returns.mean()), "return_ci95": t_interval(data_returns),
        "by_source": {s: {"episodes": len(es), "steps": int(sum(e.length for e in es)),
                          "mean_return": float(np.mean([e.ret for e in es])) if es else None,
                          "success_rate": float(np.mean([bool(e.success) for e in es])) if es else None}
                      for s, es in by_source.items()},
        "agent": {s: {"version": st["version"], "timesteps": st["timesteps"],
                      "train_episode_return": st["final"].get("episode_return")} for s, st in stages.items()},
    }

    # 3-4. Same budget for every method; the critic methods start from BC on all data.
    common = [f"updates={args.updates}", f"batch_size={args.batch_size}", f"seed={args.seed}", *shlex.split(args.model)]
    runs: dict[str, dict] = {}
    overrides: dict[str, list[str]] = {}

    def run(name: str, algo: str, extra: list[str]) -> None:
        o = [f"algo={algo}", *common, *extra]
        if algo in CRITICS and not any(x.startswith("algo.reference_version=") for x in extra):
            o.append(f"algo.reference_version={runs['bc_all']['version']}")
        overrides[name] = o
        runs[name] = train(store, os.path.join(work, "runs", name), *o)
        print(f"  {name}: v{runs[name]['version']}, {runs[name]['episodes']} episodes, value range "
              f"{runs[name].get('value_range')}, {runs[name]['wall_s']:.0f}s", flush=True)

    run("bc_all", "bc_flow", ["data.success=null"])
    skipped = []
    if data_summary["success_rate"]:
        run("bc_success", "bc_flow", [])
    else:  # nothing survived to the limit (the quick variant's tiny agent): nothing to filter for
        skipped.append("bc_success: no successful episodes in the data")
    for algo in CRITICS:
        run(algo, algo, [])
    for name, algo, extra in args.variant:
        run(name, algo, extra)

    d3 = None
    if not args.no_d3rlpy:
        d3_algo, d3 = run_d3rlpy("d3rlpy_iql", store, args.updates, args.batch_size, 0.99, args.seed)
        COMMANDS.append(f"(in-process) d3rlpy IQLConfig(batch_size={args.batch_size}, gamma=0.99, expectile=0.7, "
                        f"weight_temp=3.0, StandardObservationScaler) x {args.updates} updates on {store}")
        print(f"  d3rlpy_iql: {d3['transitions']} transitions, {d3['wall_s']:.0f}s", flush=True)

    # 5. Evaluation: one client (one list of seeds) for every policy.
    ev = [f"env={args.env}", f"episodes_per_task={args.eval_episodes}", "n_clients=1", "show=false",
          *([f"+env_kwargs.max_episode_steps={args.max_episode_steps}"] if env_kw else [])]
    versions = [r["version"] for r in runs.values()]
    robo_post("eval", f"store={store}", f"version=[{','.join(map(str, versions))}]", *ev)
    robo_post("eval", f"store={sb3_store}", f"version={stages['expert']['version']}", *ev)
    from robo_post.eval.rollout import load_results

    def eval_returns(eval_store: str, version: int) -> np.ndarray:
        matches = [r for r in load_results(eval_store) if r["policy"]["version"] == version
                   and r["episodes_per_task"] == args.eval_episodes]
        return np.array([e["return"] for e in matches[-1]["episodes"]])

    returns = {name: eval_returns(store + "-eval", r["version"]) for name, r in runs.items()}
    returns["expert"] = eval_returns(sb3_store + "-eval", stages["expert"]["version"])
    if d3 is not None:
        returns["d3rlpy_iql"] = eval_d3rlpy(d3_algo, d3["obs_key"], args.env, env_kw, args.eval_episodes)
    wall = time.perf_counter() - t_start

    # Report.
    expert = returns["expert"]
    rows = {}
    for name, x in returns.items():
        rows[name] = {
            "mean_return": float(x.mean()), "return_ci95": t_interval(x),
            "vs_data": float(x.mean() / data_returns.mean()), "vs_data_ci95": ratio_interval(x, data_returns, rng),
            "vs_expert": float(x.mean() / expert.mean()), "vs_expert_ci95": ratio_interval(x, expert, rng),
            "returns": x.tolist(),
        }
    print(f"\nforeign Minari dataset on {args.env} (time limit {args.max_episode_steps or 'default'}): "
          f"{data_summary['episodes']} episodes, {data_summary['steps']} steps, success (truncation) "
          f"{data_summary['success_rate']:.2f}, mean episode return {data_returns.mean():.1f}; wall {wall / 60:.1f} min")
    for s, d in data_summary["by_source"].items():
        print(f"  {s:<7} {d['episodes']:>4} episodes {d['steps']:>7} steps  mean return "
              f"{d['mean_return'] if d['mean_return'] is None else round(d['mean_return'], 1)}  success {d['success_rate']}")
    print(f"\n{args.updates} updates at batch {args.batch_size} each ({args.eval_episodes} eval episodes, same seeds)")
    header = f"{'method':<22}{'return [95% CI]':<28}{'/ data mean [95% CI]':<26}{'/ expert [95% CI]':<26}"
    print(header)
    for name, r in rows.items():
        lo, hi = r["return_ci95"]
        print(f"{LABELS.get(name, name):<22}{r['mean_return']:8.1f} [{lo:7.1f}, {hi:7.1f}]     "
              f"{r['vs_data']:5.2f} [{r['vs_data_ci95'][0]:.2f}, {r['vs_data_ci95'][1]:.2f}]      "
              f"{r['vs_expert']:5.2f} [{r['vs_expert_ci95'][0]:.2f}, {r['vs_expert_ci95'][1]:.2f}]")

    critic_names = [n for n in runs if runs[n]["algo"] in CRITICS]
    best = max(critic_names, key=lambda n: rows[n]["mean_return"])
    baselines = ["bc_all"] + (["d3rlpy_iql"] if "d3rlpy_iql" in rows else [])
    checks = []
    for b in baselines:
        beats = rows[best]["mean_return"] > rows[b]["mean_return"]
        separate = rows[best]["return_ci95"][0] > rows[b]["return_ci95"][1]
        checks.append({"target": f"{best} > {b}", "pass": bool(beats), "cis_disjoint": bool(separate),
                       "detail": f"{rows[best]['mean_return']:.1f} vs {rows[b]['mean_return']:.1f}"})
    print("\ntarget: a critic-based method beats BC on all data and d3rlpy's IQL (value ranges from the data)")
    for c in checks:
        print(f"  {'PASS' if c['pass'] else 'MISS'}  {c['target']}: {c['detail']}"
              f"{' (95% CIs disjoint)' if c['cis_disjoint'] else ' (95% CIs overlap)'}")

    result = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable.split('/')[-1], "benchmarks/foreign_dataset.py",
                                                       *sys.argv[1:]]),
        "args": vars(args) | {"variant": [[n, a, o] for n, a, o in args.variant]},
        "wall_s": wall, "data_s": data_s, "data": data_summary,
        "runs": {n: {"overrides": overrides[n], "version": r["version"], "episodes": r["episodes"],
                     "steps": r["steps"], "value_range": r.get("value_range"), "wall_s": r["wall_s"],
                     "final": r.get("final")} for n, r in runs.items()},
        "d3rlpy_iql": d3, "not_run": skipped, "results": rows, "targets": checks, "commands": COMMANDS,
    }
    write_results(out, result)


def write_results(out: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
