"""`robo-post run`: the main job, end to end on embedded defaults.

Stages (each is skipped when its output already exists, so a killed run resumes):

1. ``demos``: the fleet records scripted expert demonstrations (with action noise)
   and near-miss "play" episodes (plausible failures) into ``RUN/store``.
2. ``bc``: flow BC on the successful episodes -> policy v1 in the registry.
3. ``eval``: every published version on seen and held-out instruction phrasings.
4. ``report``: Markdown/HTML report with success tables, curves and rollout frames.
"""

from __future__ import annotations

import json
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from robo_post.store import PolicyRegistry, Store


def _compose(name: str, values: dict[str, Any]) -> DictConfig:
    from robo_post.cli import compose

    return OmegaConf.merge(compose(name, []), values)


def collect_stage(cfg: DictConfig, store_root: str, prefix: str, episodes: int, policy: dict[str, Any]) -> None:
    """Record ``episodes`` episodes with a scripted policy under client ids ``prefix-*``."""
    from robo_post.fleet.collect import collect

    store = Store.open(store_root) if os.path.exists(os.path.join(store_root, "store.json")) else None
    done = sum(1 for e in store.snapshot() if e.client_id.startswith(f"{prefix}-")) if store else 0
    if done >= episodes:
        return
    collect(_compose("collect", {
        "store": store_root, "episodes": episodes - done, "seed": cfg.seed, "show": cfg.show,
        "env": {"tasks": list(cfg.env.tasks), "kwargs": OmegaConf.to_container(cfg.env.kwargs)},
        "policy": policy,
        "fleet": {"n_clients": cfg.fleet.n_clients, "client_prefix": prefix, "follow_registry": False},
    }))


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run every stage; returns the evaluation results per policy version and split."""
    from robo_post.eval import evaluate, write_report
    from robo_post.learner.train import train

    os.makedirs(cfg.run_dir, exist_ok=True)
    store_root = os.path.join(cfg.run_dir, "store")
    eval_store = os.path.join(cfg.run_dir, "eval-store")
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))

    collect_stage(cfg, store_root, "demo", cfg.demos.episodes, {"kind": "expert", "noise": cfg.demos.noise})
    collect_stage(cfg, store_root, "play", cfg.play.episodes, {"kind": "expert", "noise": cfg.play.noise, "mode": "near_miss"})

    registry = PolicyRegistry(store_root)
    bc_dir = os.path.join(cfg.run_dir, "bc")
    if registry.latest() is None:
        train(_compose("train", {
            "store": store_root, "run_dir": bc_dir, "device": cfg.device, "seed": cfg.seed, "show": cfg.show,
            **OmegaConf.to_container(cfg.bc, resolve=True),
        }))

    results = []
    for version in registry.versions():
        for split in cfg.eval.splits:
            results.append(evaluate(
                store_root, version, list(cfg.env.tasks), cfg.eval.episodes_per_task, split=split,
                n_clients=cfg.fleet.n_clients, out_store=eval_store, seed=cfg.eval.seed, show=cfg.show,
            ))
    report = write_report(os.path.join(cfg.run_dir, "report"), results, run_dirs=[bc_dir], eval_store=eval_store)
    summary = {
        "report": report,
        "results": [{"version": r["version"], "split": r["split"], "mean_success": r["mean_success_rate"],
                     "per_task": {t: d["success_rate"] for t, d in r["tasks"].items()}} for r in results],
    }
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
