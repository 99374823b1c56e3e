"""Evaluate one policy version on tabletop tasks with a fleet of pinned-version clients.

Eval episodes go to their own store (``out_store``), never the training store, so
evaluation cannot leak into training data. Each evaluation writes its own shards,
named after a digest of everything that determines the episodes (policy weights,
tasks, split, counts, env, seed): re-running an identical evaluation resumes or
reuses those shards instead of recording again, and any change records afresh.

Results are a JSON-ready dict (see ``evaluate``), saved to
``OUT_STORE/evals/<tag>.json``; ``load_results`` reads them back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from typing import Any, Iterable, Literal

import numpy as np
import safetensors.torch

from robo_post.fleet.client import ClientConfig, store_schema
from robo_post.fleet.launcher import LocalLauncher
from robo_post.store import EpisodeInfo, PolicyRegistry, Store
from robo_post.store.writer import write_json_atomic

Split = Literal["train", "heldout"]

# Base seed of eval episodes. Training fleets default to seed 0; a distinct base
# seed (and distinct client ids) gives eval episodes layouts the learner never saw.
EVAL_SEED = 1_000_003
Z_95 = 1.959963984540054  # standard-normal quantile at 0.975
RESULTS_DIR = "evals"


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (default: 95%).

    Unlike the normal approximation it stays inside [0, 1] and is sensible at
    0/n and n/n, which is where small eval sets usually land. ``n = 0`` gives (0, 1).
    """
    if n == 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p, z2 = successes / n, z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def pct(x: float | None) -> str:
    """A rate as a whole percentage, ``–`` when undefined."""
    return "–" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def format_rate(stats: dict[str, Any]) -> str:
    """``80% [49%–94%]``: success rate and 95% interval of one task's stats."""
    lo, hi = stats["ci95"]
    return f"{pct(stats['success_rate'])} [{pct(lo)}–{pct(hi)}]"


def policy_label(version: int | None) -> str:
    """Display name of an evaluated policy: ``v3``, or ``expert`` for version 0/None."""
    return f"v{version}" if version else "expert"


def evaluate(
    policy_store: str,
    version: int | None,
    tasks: Iterable[str],
    episodes_per_task: int,
    split: Split = "train",
    n_clients: int = 2,
    env_kwargs: dict[str, Any] | None = None,
    out_store: str | None = None,
    seed: int = EVAL_SEED,
    show: bool = False,
) -> dict[str, Any]:
    """Run one policy version on every task and return success rates with 95% CIs.

    Args:
        policy_store: store whose registry holds the policy (also the training store).
        version: registry version to evaluate, pinned (no hot-swap). ``0`` or ``None``
            runs the scripted expert instead (a sanity check of the eval pipeline).
        tasks: tabletop task names.
        episodes_per_task: episodes per task, spread over the clients.
        split: instruction phrasings: ``train`` or ``heldout`` (unseen wording).
        n_clients: parallel client processes.
        env_kwargs: ``TabletopEnv`` kwargs. ``None`` infers them from the policy:
            camera images at the policy's ``image_size`` if it reads images, else
            state-only. ``instruction_split`` is always taken from ``split``.
        out_store: eval store (created if missing); default ``<policy_store>-eval``.
        seed: base seed of eval episodes; keep it apart from training seeds.
        show: live per-client progress table.

    Returns:
        A JSON-ready dict, also saved at its ``results_path``:

        - ``policy``: ``version`` (0 = expert), ``label``, ``store``, ``config`` (provenance).
        - ``tasks``: task -> ``episodes``, ``successes``, ``success_rate``, ``ci95``
          (Wilson ``[low, high]``), ``mean_length``, ``mean_return``.
        - ``mean_success_rate``: unweighted mean over tasks; ``overall``: the same
          stats over all episodes pooled.
        - ``episodes``: one row per episode (key, task, seed, success, length, ...).
        - ``train_seed_overlap``: eval episodes whose seed also occurs in the policy store.
        - ``split``, ``env``, ``seed``, ``eval_store``, ``shards``, ``tag``, ``wall_s``, ``created``.
    """
    tasks = list(tasks)
    if not tasks or episodes_per_task < 1 or n_clients < 1:
        raise ValueError("need at least one task, one episode per task and one client")
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'heldout'")
    policy_store = os.path.abspath(policy_store)
    out_store = os.path.abspath(out_store or policy_store.rstrip("/") + "-eval")
    if out_store == policy_store:
        raise ValueError("out_store must differ from policy_store so eval episodes never become training data")
    version = version or None
    policy_config, weights_digest = _policy_identity(policy_store, version)
    env = {"name": "tabletop", **(env_kwargs if env_kwargs is not None else _infer_env_kwargs(policy_config))}
    env["instruction_split"] = split
    needed = _infer_env_kwargs(policy_config)  # fail here, not as crash-looping clients
    has_images = env.get("render_images", True) and env.get("image_size", 64) == needed.get("image_size")
    if needed["render_images"] and not has_images:
        raise ValueError(f"policy v{version} reads {needed['image_size']}px camera images; env_kwargs lack them")

    spec = {"policy_store": policy_store, "version": version, "weights": weights_digest, "tasks": tasks,
            "episodes_per_task": episodes_per_task, "n_clients": n_clients, "env": env, "seed": seed}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    tag = f"{policy_label(version)}-{split}-{digest}"
    store = Store.create(out_store, store_schema(env, tasks[0]), exist_ok=True)

    # Client i runs k_i episodes of every task (tasks cycle episode by episode), so
    # each task gets exactly episodes_per_task episodes and the work is balanced.
    per_client = [episodes_per_task // n_clients + (i < episodes_per_task % n_clients) for i in range(n_clients)]
    configs = [
        ClientConfig(
            store=store.root, client_id=f"eval-{tag}-c{i}", episodes=k * len(tasks), env=env, tasks=tasks,
            policy={"kind": "expert"}, follow_registry=False, seed=seed, seed_key=f"eval-c{i}",  # same layouts for every version
            policy_store=policy_store if version else None, policy_version=version,
        )
        for i, k in enumerate(per_client)
        if k > 0
    ]
    t0 = time.perf_counter()
    # Shards already holding their episodes (an identical earlier eval) need no client.
    pending = [c for c in configs if store.read_commit(c.client_id)["episodes"] < c.episodes]
    statuses = LocalLauncher(pending).run(show=show) if pending else []
    failed = [s for s in statuses if s.get("state") != "done"]
    if failed:
        errors = "; ".join(f"{s['client_id']}: {str(s.get('last_error') or s.get('state')).strip()}" for s in failed)
        raise RuntimeError(f"eval clients did not finish: {errors} (logs in {store.root}/fleet/)")

    snap = store.snapshot()
    episodes = [e for c in configs for e in snap.episodes(client=c.client_id)[: c.episodes]]
    result = _summarise(episodes, tasks)
    result.update(
        policy={"version": version or 0, "label": policy_label(version), "store": policy_store,
                "config": _provenance(policy_config)},
        split=split, env=env, seed=seed, n_clients=n_clients, episodes_per_task=episodes_per_task,
        eval_store=store.root, snapshot=snap.id, shards=[c.client_id for c in configs], tag=tag,
        train_seed_overlap=_seed_overlap(policy_store, episodes), wall_s=time.perf_counter() - t0,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        results_path=os.path.join(store.root, RESULTS_DIR, f"{tag}.json"),
    )
    os.makedirs(os.path.dirname(result["results_path"]), exist_ok=True)
    write_json_atomic(result["results_path"], result, fsync=False)
    return result


def in_process_success(model: Any, tasks: Iterable[str], episodes_per_task: int, seed: int = EVAL_SEED,
                       outcomes: list[bool] | None = None) -> dict[str, float]:
    """Success rate per task of a flow policy rolled out in this process (no store).

    Cheap periodic evaluation during training; the fleet-based ``evaluate`` is the
    reported number. Episodes use ``episode_seed(seed, task, i)`` layouts. If given,
    ``outcomes`` gets each episode's success appended, task by task, as it ends.
    """
    from robo_post.envs.tabletop import TabletopEnv
    from robo_post.fleet.client import episode_seed
    from robo_post.models.flow import FlowPolicyRunner

    was_training = model.training
    runner = FlowPolicyRunner(model, device=str(model.device))
    out = {}
    for task in tasks:
        env = TabletopEnv(task=task, render_images=model.config.image_size is not None,
                          image_size=model.config.image_size or 64)
        wins = 0
        for i in range(episodes_per_task):
            s = episode_seed(seed, task, i)
            obs, info = env.reset(seed=s)
            runner.reset(env, s)
            done = False
            while not done:
                obs, _, terminated, truncated, info = env.step(runner.act(obs, env))
                done = terminated or truncated
            wins += bool(info["success"])
            if outcomes is not None:
                outcomes.append(bool(info["success"]))
        env.close()
        out[f"success/{task}"] = wins / episodes_per_task
    out["success/mean"] = float(np.mean(list(out.values())))
    model.train(was_training)
    return out


def eval_from_config(cfg: Any) -> list[dict[str, Any]]:
    """`robo-post eval`: evaluate every ``cfg.version`` x ``cfg.split`` and print a table.

    ``version`` is a registry version, ``latest``, or 0/null for the scripted expert;
    ``version`` and ``split`` may be lists.
    """
    from omegaconf import OmegaConf
    from rich.console import Console
    from rich.table import Table

    versions = cfg.version if OmegaConf.is_list(cfg.version) else [cfg.version]
    splits = cfg.split if OmegaConf.is_list(cfg.split) else [cfg.split]
    registry = PolicyRegistry(Store.open(cfg.store).root)
    env_kwargs = None if cfg.env_kwargs is None else OmegaConf.to_container(cfg.env_kwargs, resolve=True)
    results = []
    for version in versions:
        if version == "latest":
            version = registry.latest()  # None (expert) while nothing is published
        for split in splits:
            results.append(evaluate(
                cfg.store, version, list(cfg.tasks), cfg.episodes_per_task, split=split, n_clients=cfg.n_clients,
                env_kwargs=env_kwargs, out_store=cfg.out_store, seed=cfg.seed, show=cfg.show,
            ))
    table = Table("policy", "split", *cfg.tasks, "mean", title="success rate [95% Wilson CI]")
    for r in results:
        lo, hi = r["overall"]["ci95"]
        table.add_row(r["policy"]["label"], r["split"], *(format_rate(r["tasks"][t]) for t in cfg.tasks),
                      f"{pct(r['mean_success_rate'])} [{pct(lo)}–{pct(hi)}]")
    console = Console()
    console.print(table)
    for r in results:
        console.print(f"results: {r['results_path']}")
    return results


def load_results(eval_store: str) -> list[dict[str, Any]]:
    """Every result saved in ``EVAL_STORE/evals/``, oldest first."""
    directory = os.path.join(eval_store, RESULTS_DIR)
    if not os.path.isdir(directory):
        return []
    results = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                results.append(json.load(f))
    return sorted(results, key=lambda r: r["created"])


def _policy_identity(policy_store: str, version: int | None) -> tuple[dict[str, Any], str]:
    """The policy's config and a digest of its weights (so a retrained store never
    reuses stale eval shards). The expert has no registry entry."""
    if version is None:
        return {"kind": "expert"}, "expert"
    weights, config = PolicyRegistry(policy_store).load(version)
    return config, hashlib.sha256(safetensors.torch.save(weights)).hexdigest()


def _infer_env_kwargs(policy_config: dict[str, Any]) -> dict[str, Any]:
    image_size = policy_config.get("model", {}).get("image_size")
    if image_size:
        return {"render_images": True, "image_size": int(image_size)}
    return {"render_images": False}  # state-only policies (and the expert) skip rendering: much faster


def _provenance(policy_config: dict[str, Any]) -> dict[str, Any]:
    """The small, human-relevant part of a policy config (not the full training config)."""
    keys = ("kind", "algorithm", "parent_version", "snapshot", "episodes", "updates", "noise", "mode")
    return {k: policy_config[k] for k in keys if k in policy_config}


def _task_stats(episodes: list[EpisodeInfo]) -> dict[str, Any]:
    n, k = len(episodes), sum(bool(e.success) for e in episodes)
    return {
        "episodes": n,
        "successes": k,
        "success_rate": k / n if n else float("nan"),
        "ci95": list(wilson_interval(k, n)),
        "mean_length": float(np.mean([e.length for e in episodes])) if n else float("nan"),
        "mean_return": float(np.mean([e.ret for e in episodes])) if n else float("nan"),
    }


def _summarise(episodes: list[EpisodeInfo], tasks: list[str]) -> dict[str, Any]:
    per_task = {t: _task_stats([e for e in episodes if e.task_id == t]) for t in tasks}
    return {
        "tasks": per_task,
        "mean_success_rate": float(np.mean([s["success_rate"] for s in per_task.values()])),
        "overall": _task_stats(episodes),
        "episodes": [
            {"key": e.key, "task": e.task_id, "seed": e.seed, "success": e.success, "length": e.length,
             "policy_version": e.policy_version, "instruction": e.instruction}
            for e in episodes
        ],
    }


def _seed_overlap(policy_store: str, episodes: list[EpisodeInfo]) -> int:
    """How many eval episodes reuse a layout seed recorded in the policy store."""
    store = Store.open(policy_store)  # read shard metadata directly: a snapshot would write into the training store
    train_seeds = {e.seed for shard in store.shards() for e in store.shard_episodes(shard)}
    return sum(e.seed in train_seeds for e in episodes)
