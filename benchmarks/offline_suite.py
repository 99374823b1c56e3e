"""Offline suite: our methods against d3rlpy's on D4RL-style datasets the fleet records from SB3 agents.

What: for each task (standard gymnasium MuJoCo tasks at their own time limits, and the
sparse-reward goal task ``robo_post/SparseReacher-v0``) and each dataset in the D4RL
tradition, every method learns offline from the same transitions at the same update
budget, and is scored on the same evaluation seeds, normalised per task: 0 is a uniform
random policy, 100 the expert agent (deterministic) on those seeds. Each cell is a
(task, dataset, method) triple trained with ``--seeds`` seeds; the table shows the mean
normalised score over seeds with its 95% t interval.

How, top to bottom:

1. Agents. Each task has two SB3 agents, ``medium`` and ``expert`` (one training run, the
   medium one is its checkpoint). They are kept in ``benchmarks/agents/TASK/LEVEL/`` in the
   project's own published format (``model.safetensors`` + ``config.json``, never SB3's
   pickled zip). A task without them is trained from the CLI (``robo-post train algo=sb3``,
   hours for the locomotion tasks on two cores); ``--save-agents`` writes the result there.
2. Recording. The fleet records each source into its own store (``robo-post collect``) with
   the agent published there, sampling its actions: ``expert``, ``medium``, ``random``
   (``policy=random``). Each store is exported to Minari (``store export-minari``).
3. Datasets, imported as a user would (``store import-minari --success-from RULE``, the
   task's rule): ``expert``, ``medium``, ``random`` (one source each) and ``mixed`` (all
   three in one store).
4. Methods, on each dataset's store, every one from ``robo-post train`` defaults except
   the seed: ``bc`` (flow BC on all data, ``data.success=null``), ``bc_filtered`` (the
   default successes-only BC; skipped on a dataset without successes), ``divl_qam``,
   ``iql_qam``, ``fql`` (each starts from flow BC on its episodes, the rule's reference, of
   the same seed); d3rlpy's
   ``d3rlpy_bc``, ``d3rlpy_iql``, ``d3rlpy_td3bc`` with their published locomotion
   settings and standardised observations, for as many gradient steps at batch 256 as
   our BC used (our budget is measured from the data: 100 passes, 3000 to 100000).
5. Evaluation on ``--eval-episodes`` episodes (times the task's ``eval_scale``: 10 for the
   goal task, whose return is 0 or 1, 5 for the dense reacher, whose return varies with its
   random target) with the eval client's seeds
   (``robo-post eval ... n_clients=1``; d3rlpy's policies and the random policy in-process
   on the same seeds).

The authors' JAX QAM (``qam_authors``: their defaults; ``qam_authors_small``: their agent at
our networks' size, 2 critics and 2 x 256 MLPs) runs in its own interpreter through the worker of
``benchmarks/qam_reference.py`` (``--reference-python``, ``--reference-repo``; skipped with one
line saying why when either is missing): their default settings, one action per decision,
trained on the same transitions (actions scaled to [-1, 1], time-outs bootstrapped) for the
same updates at the same batch as d3rlpy's, and scored with the same in-process evaluation.

Ablations: ``--ablate NAME="METHOD OVERRIDES"`` adds a method NAME, one of ours with extra
``robo-post train`` settings (e.g. ``--ablate "bc_h4=bc model.horizon=4"``); its reference BC
takes the same ``model.*`` settings.

Runnable in parts: ``--tasks``, ``--datasets``, ``--methods``, ``--seeds``; a cell whose
result file exists is reused (``--reuse`` keeps the work directory); the table covers every
finished cell of the selection, so parts run on different days add up (``--finished-only``
tabulates them without running anything new).

Run:
    python benchmarks/offline_suite.py --tasks idp --datasets medium --methods bc,d3rlpy_bc --seeds 0
    python benchmarks/offline_suite.py --quick                 # smoke run: one task, tiny budgets
    python benchmarks/offline_suite.py --reuse                 # everything (days on two cores)
Writes benchmarks/results/offline_suite[_quick].json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from foreign_dataset import (COMMANDS, EVAL_SEED, REPO, RESULTS, eval_d3rlpy, robo_post, run_d3rlpy, t_interval,
                             train, write_results)
from qam_reference import OfflineReference, reference_problem, write_reference_dataset
from robo_post.algos.sb3_agent import SB3Agent, SB3AgentConfig
from robo_post.store import Store
from robo_post.store.registry import PolicyRegistry

AGENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agents")


@dataclass(frozen=True)
class Task:
    env: str                  # gymnasium id (env=ID for the CLI)
    medium_timesteps: int     # SB3 SAC steps of the medium agent (a checkpoint of the expert's run)
    expert_timesteps: int
    success_from: str         # import-minari --success-from
    episodes: int = 30        # episodes recorded per source
    train_env: str | None = None  # where the SAC agents learn, when not env (a sparse task's dense twin)
    eval_scale: int = 1           # evaluation episodes per --eval-episodes (a 0/1 outcome needs more)


TASKS = {
    "hopper": Task("Hopper-v5", 50_000, 200_000, "truncation"),
    "walker2d": Task("Walker2d-v5", 50_000, 200_000, "truncation"),
    "halfcheetah": Task("HalfCheetah-v5", 50_000, 150_000, "truncation"),
    "ant": Task("Ant-v5", 100_000, 300_000, "truncation"),
    "idp": Task("InvertedDoublePendulum-v5", 20_000, 40_000, "truncation", episodes=10),  # the balance task
    # Every episode ends at its 50-step time limit: 200 episodes (10,000 steps) per source, and
    # its return varies with the random target: 5x the evaluation episodes.
    "reacher_dense": Task("Reacher-v5", 10_000, 50_000, "truncation", episodes=200, eval_scale=5),
    # The sparse goal task; SAC learns on its dense-reward twin (same observations) and records here.
    # Its return is 0 or 1 (random actions reach the target 30% of the time): 10x the episodes.
    "reacher": Task("robo_post/SparseReacher-v0", 20_000, 100_000, "termination", episodes=100,
                    train_env="robo_post/Reacher-v0", eval_scale=10),
}
SOURCES = ("expert", "medium", "random")
DATASETS = {"expert": ("expert",), "medium": ("medium",), "random": ("random",), "mixed": SOURCES}
OURS = ("bc", "bc_filtered", "divl_qam", "iql_qam", "fql")
D3RLPY = ("d3rlpy_bc", "d3rlpy_iql", "d3rlpy_td3bc")
# The authors' QAM: their defaults (10 critics, 4 x 512 MLPs: ~1 s an update on a shared core
# here, ~10x ours) and their agent at our networks' size (2 critics, 2 x 256).
AUTHORS = {"qam_authors": {},
           "qam_authors_small": {"num_qs": 2, "actor_hidden_dims": [256, 256], "value_hidden_dims": [256, 256]}}
METHODS = OURS + D3RLPY + tuple(AUTHORS)
TRAIN = {"bc": ["algo=bc_flow", "data.success=null"], "bc_filtered": ["algo=bc_flow"],
         "divl_qam": ["algo=divl_qam"], "iql_qam": ["algo=iql_qam"], "fql": ["algo=fql"]}


# --- agents and data -----------------------------------------------------------------------
def agent_files(task: str, level: str) -> tuple[str, str]:
    d = os.path.join(AGENTS, task, level)
    return os.path.join(d, "model.safetensors"), os.path.join(d, "config.json")


def train_agents(task: str, spec: Task, work: str, seed: int, save: bool) -> None:
    """SAC from the CLI into ``work/agent_store``: the medium checkpoint published first, then
    resumed to the expert; ``save`` copies both into ``benchmarks/agents/TASK/``."""
    store, run = os.path.join(work, "agent_store"), os.path.join(work, "agent_run")
    for steps in (spec.medium_timesteps, spec.expert_timesteps):
        robo_post("train", "algo=sb3", "algo.agent=SAC", f"algo.env={spec.train_env or spec.env}", f"algo.timesteps={steps}",
                  f"store={store}", f"run_dir={run}", "show=false", f"seed={seed}",
                  f"checkpoint_every={spec.medium_timesteps}", timeout=48 * 3600)
    for level in ("medium", "expert") if save else ():
        save_agent(task, level, *load_agent(task, level, work))


def save_agent(task: str, level: str, weights: dict, config: dict) -> None:
    """Keep what acting needs: the SAC actor's weights (about 280 kB; the critics are 4x that) and
    the agent's construction."""
    keep = {k: config[k] for k in ("kind", "algorithm", "agent", "policy", "env", "task", "env_kwargs",
                                    "deterministic", "hyperparameters", "timesteps")}
    weights_path, config_path = agent_files(task, level)
    os.makedirs(os.path.dirname(weights_path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items() if k.startswith("actor.")}, weights_path)
    with open(config_path, "w") as f:
        json.dump(keep, f, indent=1)


def load_agent(task: str, level: str, work: str) -> tuple[dict, dict]:
    """(weights, config) of the task's agent: the repository's copy (its critics filled with a fresh
    agent's, which acting never reads), else the one trained in ``work``."""
    weights_path, config_path = agent_files(task, level)
    if os.path.exists(weights_path):
        with open(config_path) as f:
            config = json.load(f)
        agent = SB3Agent(SB3AgentConfig(agent=config["agent"], env=config["env"], task=config["task"],
                                        env_kwargs=config["env_kwargs"], policy=config["policy"],
                                        hyperparameters=config["hyperparameters"]), n_envs=1)
        return agent.model.policy.state_dict() | load_file(weights_path), config
    registry = PolicyRegistry(os.path.join(work, "agent_store"))
    steps = getattr(TASKS[task], f"{level}_timesteps")
    (version, *_) = [v for v in reversed(registry.versions()) if registry.peek_config(v)["timesteps"] == steps]
    return registry.load(version)


def record(task: str, spec: Task, work: str, seed: int, episodes: int) -> dict[str, str]:
    """Record each source into its own store and export it; returns source -> Minari id."""
    minari_root = os.path.join(work, "minari")
    ids = {}
    for source in SOURCES:
        ids[source] = f"suite/{task}-{source}-v0"
        store = os.path.join(work, f"rec_{source}")
        done = os.path.join(store, "recorded")
        if os.path.exists(done):
            continue
        shutil.rmtree(store, ignore_errors=True)
        policy = ["policy=random"]
        if source != "random":
            weights, config = load_agent(task, source, work)
            # Recorded with sampled actions (D4RL's datasets are the agents' stochastic rollouts).
            version = PolicyRegistry(store).publish(weights, {**config, "deterministic": False})
            policy = [f"fleet.policy_version={version}"]
        robo_post("collect", f"env={spec.env}", f"store={store}", f"episodes={episodes}", "fleet.n_clients=1",
                  f"fleet.client_prefix={source}", "show=false", f"seed={seed}", *policy)
        shutil.rmtree(os.path.join(minari_root, "suite", f"{task}-{source}-v0"), ignore_errors=True)
        robo_post("store", "export-minari", store, ids[source], "--minari-root", minari_root)
        open(done, "w").close()
    return ids


def dataset_store(task: str, spec: Task, work: str, dataset: str, ids: dict[str, str]) -> str:
    """The dataset's store, imported from Minari as a user would (``--success-from`` stated)."""
    store = os.path.join(work, "data", dataset)
    done = os.path.join(store, "imported")
    if not os.path.exists(done):
        shutil.rmtree(store, ignore_errors=True)
        for source in DATASETS[dataset]:
            robo_post("store", "import-minari", ids[source], store, "--minari-root", os.path.join(work, "minari"),
                      "--client", source, "--success-from", spec.success_from)
        open(done, "w").close()
    return store


# --- evaluation -------------------------------------------------------------------------------
def eval_version(store: str, env: str, version: int, episodes: int) -> np.ndarray:
    from robo_post.eval.rollout import load_results

    def found() -> list:
        return [r for r in load_results(store + "-eval") if r["policy"]["version"] == version
                and r["episodes_per_task"] == episodes] if os.path.exists(store + "-eval") else []

    if not found():
        robo_post("eval", f"store={store}", f"version={version}", f"env={env}", f"episodes_per_task={episodes}",
                  "n_clients=1", "show=false")
    return np.array([e["return"] for e in found()[-1]["episodes"]])


def random_returns(env_id: str, episodes: int) -> np.ndarray:
    """Uniform random actions on the eval client's seeds (the 0 of the normalised score)."""
    from robo_post.envs.registry import env_spec
    from robo_post.fleet.client import episode_seed

    env = env_spec(env_id).make(None)
    returns = []
    for k in range(episodes):
        seed = episode_seed(EVAL_SEED, "eval-c0", k)
        env.reset(seed=seed)
        env.action_space.seed(seed)
        total, done = 0.0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return np.array(returns)


# --- one cell ---------------------------------------------------------------------------------
def run_authors_qam(store: str, paths: tuple[str, str], updates: int, batch: int, gamma: float,
                    seed: int, config: dict) -> tuple[OfflineReference, dict]:
    """The authors' QAM (their default settings updated by ``config``, one action per decision)
    on the store's transitions in its own interpreter; ``paths``: (python, checkout)."""
    snap = Store.open(store).snapshot()
    (key,) = snap.store.schema.observations
    action = snap.store.schema.action
    if action.low is None or action.high is None:
        raise ValueError(f"the authors' QAM acts in [-1, 1]: {store} records no action bounds to scale from")
    low, high = (np.broadcast_to(np.asarray(b, np.float32), action.shape) for b in (action.low, action.high))
    data = os.path.join(store + "-reference", "transitions.npz")
    os.makedirs(os.path.dirname(data), exist_ok=True)
    transitions = write_reference_dataset(snap, snap.episodes(), key, low, high, data)
    algo = OfflineReference(*paths, data, updates, batch, gamma, seed, low, high, config)
    return algo, {"transitions": transitions, "episodes": len(snap.episodes()), "obs_key": key, "config": config,
                  **algo.info}


def run_cell(task: str, spec: Task, dataset: str, store: str, method: str, seed: int, work: str,
             eval_episodes: int, quick: bool, ablations: dict[str, tuple[str, list[str]]],
             reference: tuple[tuple[str, str], str | None]) -> dict | None:
    out = os.path.join(work, "cells", dataset, method, f"seed{seed}.json")
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    base, extra = ablations.get(method, (method, []))
    episodes = Store.open(store).snapshot().episodes()
    if base == "bc_filtered" and not any(e.success for e in episodes):
        return None  # nothing to filter for
    budget = ["updates=200"] if quick else []
    model = [x for x in extra if x.startswith("model.")]  # an ablated reference is trained with them
    bc_run = os.path.join(work, "runs", dataset, f"bc{'-' + method if model else ''}-seed{seed}")
    if base in OURS:
        pin = []
        if base in ("divl_qam", "iql_qam", "fql"):  # the rule's reference (BC on the same episodes), of this seed
            reference = train(store, bc_run, *TRAIN["bc"], *model, f"seed={seed}", *budget)
            pin = [f"algo.reference_version={reference['version']}"]
        run_dir = bc_run if base == "bc" else os.path.join(work, "runs", dataset, f"{method}-seed{seed}")
        summary = train(store, run_dir, *TRAIN[base], *extra, f"seed={seed}", *budget, *pin)
        returns = eval_version(store, spec.env, summary["version"], eval_episodes)
        cell = {"version": summary["version"], "updates": summary["final"]["update"], "wall_s": summary["wall_s"],
                "overrides": extra, "backup": summary.get("backup"),
                "critic_diagnostics": summary.get("critic_diagnostics")}
    else:
        if base in AUTHORS and reference[1] is not None:
            return None  # said once, in main
        bc = train(store, bc_run, *TRAIN["bc"], f"seed={seed}", *budget)  # the budget our BC measured
        with open(os.path.join(bc_run, "config.yaml")) as f:
            bc_cfg = yaml.safe_load(f)
        updates, batch = bc["final"]["update"], bc_cfg["batch_size"]
        if base in AUTHORS:
            algo, info = run_authors_qam(store, reference[0], updates, batch, bc_cfg["gamma"], seed, AUTHORS[base])
            COMMANDS.append(f"(worker) the authors' QAM {AUTHORS[base] or 'defaults'} x {updates} updates at batch "
                            f"{batch}, seed {seed}, on {store}")
        else:
            algo, info = run_d3rlpy(method, store, updates, batch, bc_cfg["gamma"], seed)
            COMMANDS.append(f"(in-process) d3rlpy {method} x {updates} updates at batch {batch}, seed {seed}, on {store}")
        returns = eval_d3rlpy(algo, info["obs_key"], spec.env, {}, eval_episodes)
        cell = {"updates": updates, "batch_size": batch, **info}
        if base in AUTHORS:
            algo.close()
    cell |= {"task": task, "dataset": dataset, "method": method, "seed": seed, "returns": returns.tolist()}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(cell, f, indent=1)
    return cell


# --- main ----------------------------------------------------------------------------------------
def parse_ablation(text: str) -> tuple[str, tuple[str, list[str]]]:
    name, _, rest = text.partition("=")
    base, *overrides = shlex.split(rest)
    if not name or name in METHODS or base not in OURS or not overrides:
        raise argparse.ArgumentTypeError(f"--ablate NAME=\"METHOD OVERRIDES\" with a new NAME and METHOD one of "
                                         f"{', '.join(OURS)}; got {text!r}")
    return name, (base, overrides)


def parse_list(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return items
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=parse_list(tuple(TASKS)), default=list(TASKS))
    parser.add_argument("--datasets", type=parse_list(tuple(DATASETS)), default=list(DATASETS))
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, from {', '.join(METHODS)} and the --ablate names")
    parser.add_argument("--ablate", type=parse_ablation, action="append", default=[],
                        help='NAME="METHOD OVERRIDES": one of our methods with extra train settings')
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--eval-episodes", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke run: idp, medium, 4 episodes, 200 updates")
    parser.add_argument("--save-agents", action="store_true", help="write agents trained here to benchmarks/agents/")
    parser.add_argument("--workdir", default=None, help="default runs/offline_suite[_quick]")
    parser.add_argument("--reuse", action="store_true", help="keep the workdir: finished agents, data and cells are reused")
    parser.add_argument("--finished-only", action="store_true",
                        help="tabulate the cells already run in the workdir; train, record and run nothing new")
    parser.add_argument("--out", default=None)
    parser.add_argument("--reference-python", help="python of an environment with the authors' QAM's dependencies "
                        "(benchmarks/qam_reference.py)")
    parser.add_argument("--reference-repo", help="checkout of github.com/ColinQiyangLi/qam")
    args = parser.parse_args()
    ablations = dict(args.ablate)
    try:
        args.methods = parse_list(METHODS + tuple(ablations))(args.methods)
    except argparse.ArgumentTypeError as e:
        parser.error(f"--methods: {e}")
    if args.quick:
        args.tasks, args.datasets, args.seeds, args.eval_episodes = ["idp"], ["medium"], [0], 3
    suffix = "_quick" if args.quick else ""
    work = os.path.abspath(args.workdir or os.path.join(REPO, "runs", f"offline_suite{suffix}"))
    out = args.out or os.path.join(RESULTS, f"offline_suite{suffix}.json")
    if os.path.exists(work) and not (args.reuse or args.finished_only):
        shutil.rmtree(work)
    torch.set_num_threads(1)
    reference = ((args.reference_python, args.reference_repo), reference_problem(args.reference_python, args.reference_repo))
    if reference[1] is not None and any(m in AUTHORS for m in args.methods):
        print(f"qam_authors skipped: {reference[1]}")
    t_start = time.perf_counter()
    table: dict[str, dict[str, dict]] = {}
    for task in args.tasks:
        spec, task_work = TASKS[task], os.path.join(work, task)
        if args.finished_only and not os.path.exists(os.path.join(task_work, "rec_expert", "recorded")):
            continue
        os.makedirs(task_work, exist_ok=True)
        if not all(os.path.exists(agent_files(task, lvl)[0]) for lvl in ("medium", "expert")):
            train_agents(task, spec, task_work, 0, args.save_agents)
        ids = record(task, spec, task_work, 0, 4 if args.quick else spec.episodes)
        expert_store = os.path.join(task_work, "rec_expert")
        registry = PolicyRegistry(expert_store)
        det = [v for v in registry.versions() if registry.peek_config(v).get("deterministic")]
        if not det:  # the expert acting on its mode: the 100 of the score
            weights, config = load_agent(task, "expert", task_work)
            det = [registry.publish(weights, {**config, "deterministic": True})]
        eval_episodes = args.eval_episodes * (1 if args.quick else spec.eval_scale)
        hi = float(eval_version(expert_store, spec.env, det[0], eval_episodes).mean())
        lo = float(random_returns(spec.env, eval_episodes).mean())
        for dataset in args.datasets:
            if args.finished_only and not os.path.exists(os.path.join(task_work, "data", dataset, "imported")):
                continue
            store = dataset_store(task, spec, task_work, dataset, ids)
            for method in args.methods:
                scores = []
                for seed in args.seeds:
                    done = os.path.join(task_work, "cells", dataset, method, f"seed{seed}.json")
                    if args.finished_only and not os.path.exists(done):
                        continue
                    cell = run_cell(task, spec, dataset, store, method, seed, task_work, eval_episodes, args.quick,
                                    ablations, reference)
                    if cell is not None:
                        scores.append(100 * (np.mean(cell["returns"]) - lo) / (hi - lo))
                if scores:
                    s = np.array(scores)
                    table.setdefault(f"{task}-{dataset}", {})[method] = {
                        "score": float(s.mean()), "ci95": t_interval(s), "seeds": len(s), "per_seed": s.tolist()}
        table.setdefault("_reference", {})[task] = {"random": lo, "expert": hi}

    more = ", ".join(f"{t}: {args.eval_episodes * TASKS[t].eval_scale}" for t in args.tasks if TASKS[t].eval_scale > 1)
    print(f"\nnormalised score (0 random, 100 expert), mean over seeds [95% t interval]; {args.eval_episodes} eval "
          f"episodes{f' ({more})' if more else ''}")
    methods = args.methods
    print(f"{'dataset':<20}" + "".join(f"{m:>22}" for m in methods))
    for name, row in table.items():
        if name.startswith("_"):
            continue
        cells = []
        for m in methods:
            r = row.get(m)
            cells.append("-" if r is None else f"{r['score']:.1f} [{r['ci95'][0]:.0f}, {r['ci95'][1]:.0f}]")
        print(f"{name:<20}" + "".join(f"{c:>22}" for c in cells))
    result = {"command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/offline_suite.py", *sys.argv[1:]]),
              "args": vars(args), "wall_s": time.perf_counter() - t_start, "table": table, "commands": COMMANDS}
    write_results(out, result)


if __name__ == "__main__":
    main()
