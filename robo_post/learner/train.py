"""Offline training loop shared by every algorithm, and the `robo-post train` job.

The loop is algorithm-agnostic: an algorithm exposes ``modules``, ``optimizers``
and ``update(batch) -> metrics``. The loop logs metric windows to
``RUN/metrics.jsonl``, checkpoints to ``RUN/checkpoint`` (resume continues
bit-for-bit), and publishes the trained policy to the store's registry.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.learner.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from robo_post.models.flow import FlowPolicyConfig
from robo_post.store import PolicyRegistry, Store, StoreSchema, WindowSampler


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def flow_config_from_schema(schema: StoreSchema, model_cfg: dict[str, Any]) -> FlowPolicyConfig:
    """Policy architecture matching the store's observations and action bounds."""
    cfg = dict(model_cfg)
    use_images = cfg.pop("use_images", True) and "image" in schema.observations
    return FlowPolicyConfig(
        proprio_dim=int(np.prod(schema.observations["proprio"].shape)),
        action_dim=int(np.prod(schema.action.shape)),
        image_size=schema.observations["image"].shape[0] if use_images else None,
        action_low=list(np.broadcast_to(schema.action.low, schema.action.shape).astype(float)),
        action_high=list(np.broadcast_to(schema.action.high, schema.action.shape).astype(float)),
        **cfg,
    )


def _truncate_log(path: str, last_update: int) -> None:
    """Drop log lines written after the checkpoint we resume from."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if json.loads(line)["update"] <= last_update]
    with open(path, "w") as f:
        f.writelines(keep)


def train_loop(
    algo: Any,
    sample: Callable[[], dict],
    run_dir: str,
    updates: int,
    rngs: dict[str, np.random.Generator],
    log_every: int = 100,
    checkpoint_every: int = 1000,
    eval_every: int = 0,
    evaluate: Callable[[int], dict[str, float]] | None = None,
    show: bool = True,
    after_update: Callable[[int], None] | None = None,
) -> list[dict[str, float]]:
    """Run ``updates`` updates of ``algo`` (resuming from ``run_dir`` if a checkpoint exists).

    ``after_update(update)`` runs after each update, before its checkpoint (e.g. to publish).

    Returns the logged metric windows (each the mean over ``log_every`` updates).
    """
    os.makedirs(run_dir, exist_ok=True)
    ckpt, log_path = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "metrics.jsonl")
    start = 0
    if has_checkpoint(ckpt):
        start = load_checkpoint(ckpt, algo.modules, algo.optimizers, rngs)["update"]
        _truncate_log(log_path, start)
        if hasattr(algo, "updates"):  # algorithms that schedule on the step count
            algo.updates = start
    logged: list[dict[str, float]] = []
    window: dict[str, list[float]] = {}
    t_window, wait = time.perf_counter(), 0.0
    progress = _progress(show, updates, start)
    with progress, open(log_path, "a") as log:
        task = progress.add_task("train", total=updates, completed=start, info="")
        for update in range(start + 1, updates + 1):
            t0 = time.perf_counter()
            batch = sample()
            wait += time.perf_counter() - t0
            for k, v in algo.update(batch).items():
                window.setdefault(k, []).append(v)
            if after_update is not None:
                after_update(update)
            if update % log_every == 0 or update == updates:
                elapsed = time.perf_counter() - t_window
                row = {"update": update, **{k: float(np.mean(v)) for k, v in window.items()}}
                row.update(updates_per_s=len(next(iter(window.values()))) / elapsed, data_wait=wait / elapsed)
                if evaluate and eval_every and (update % eval_every == 0 or update == updates):
                    row.update({f"eval/{k}": v for k, v in evaluate(update).items()})
                log.write(json.dumps(row) + "\n")
                log.flush()
                logged.append(row)
                window, t_window, wait = {}, time.perf_counter(), 0.0
                first = next(k for k in row if k != "update")
                progress.update(task, info=f"{first} {row[first]:.4f}  {row['updates_per_s']:.1f} upd/s")
            if update % checkpoint_every == 0 or update == updates:
                save_checkpoint(ckpt, algo.modules, algo.optimizers, rngs, {"update": update})
            progress.update(task, completed=update)
    return logged


def _progress(show: bool, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), disable=not show,
    )


def lwd_config(cfg: DictConfig) -> DictConfig:
    """The learner config (``robo_post.learner.lwd``) of a `robo-post train` job with a critic-based algo."""
    a = cfg.algo
    return OmegaConf.create({
        "algo": a.name, "critic": a.critic, "value": a.value, "actor": a.actor, "critic_warmup": a.critic_warmup, "best_of_n": a.best_of_n,
        "imitation": a.imitation,
        "reference_version": a.reference_version, "device": cfg.device, "torch_threads": cfg.torch_threads,
        "seed": cfg.seed, "show": cfg.show,
        "gamma": cfg.gamma, "bootstrap_truncated": a.bootstrap_truncated, "batch_size": cfg.batch_size, "log_every": cfg.log_every,
        "checkpoint_every": cfg.checkpoint_every, "offline": {"updates": cfg.updates, "n_step": a.n_step},
    })


def train(cfg: DictConfig) -> dict[str, Any]:
    """`robo-post train`: train ``cfg.algo`` on a store snapshot and publish the policy.

    ``bc_flow`` trains a flow policy from scratch; the critic-based algorithms
    (``divl_qam``, ``iql_qam``, ``fql``) start from a published BC version.
    """
    from robo_post.algos.bc_flow import BCFlow, BCFlowConfig
    from robo_post.learner.algorithms import ALGORITHMS

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    device = resolve_device(cfg.device)
    store = Store.open(cfg.store)
    snap = store.snapshot(cfg.data.snapshot) if cfg.data.snapshot else store.snapshot()
    episodes = snap.episodes(task=list(cfg.data.tasks) if cfg.data.tasks else None, success=cfg.data.success)
    if cfg.data.clients:
        episodes = [e for e in episodes if any(e.client_id.startswith(f"{p}-") for p in cfg.data.clients)]
    if not episodes:
        raise ValueError(f"no episodes in snapshot {snap.id} match the data filter {OmegaConf.to_container(cfg.data)}")
    if cfg.algo.name != "bc_flow" and cfg.algo.name not in ALGORITHMS:
        raise ValueError(f"unknown algo {cfg.algo.name!r}; choose one of {['bc_flow', *sorted(ALGORITHMS)]}")
    run_dir = cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    tasks = sorted({e.task_id for e in episodes})
    evaluate = None
    if cfg.eval.every:
        from robo_post.eval.rollout import in_process_success

        evaluate = lambda policy: in_process_success(policy, tasks, cfg.eval.episodes_per_task)  # noqa: E731
    if cfg.algo.name != "bc_flow":
        from robo_post.learner import lwd

        return lwd.offline(cfg.store, run_dir, lwd_config(cfg), snapshot=snap.id, episodes=episodes,
                           eval_every=cfg.eval.every, evaluate=evaluate)

    sampler = WindowSampler.from_snapshot(
        snap, episodes, horizon=cfg.model.horizon, n_step=1, gamma=cfg.gamma, device=device, seed=cfg.seed
    )
    model_cfg = flow_config_from_schema(store.schema, OmegaConf.to_container(cfg.model, resolve=True))
    algo = BCFlow(BCFlowConfig(**{k: v for k, v in cfg.algo.items() if k != "name"}), model_cfg, device)
    algo.policy.set_proprio_stats(*sampler.obs_stats("proprio"))
    t0 = time.perf_counter()
    logged = train_loop(
        algo, lambda: sampler.sample(cfg.batch_size), run_dir, cfg.updates, {"sampler": sampler.rng},
        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval.every,
        evaluate=evaluate and (lambda update: evaluate(algo.policy)), show=cfg.show,
    )
    wall = time.perf_counter() - t0
    weights, config = algo.policy.artifact(
        algorithm="bc_flow", parent_version=None, snapshot=snap.id, episodes=len(episodes),
        updates=cfg.updates, config=OmegaConf.to_container(cfg, resolve=True),
    )
    version = PolicyRegistry(store.root).publish(weights, config) if cfg.publish else None
    summary = {"version": version, "snapshot": snap.id, "episodes": len(episodes), "steps": len(sampler),
               "wall_s": wall, "final": logged[-1] if logged else {}}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
