"""The SB3 driver: `robo-post train` for a Stable-Baselines3 agent (``algo=sb3`` and the
methods built on it), trained in its env by SB3's own ``learn``."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.algos.registry import MethodSpec
from robo_post.algos.sb3_agent import check_budget
from robo_post.learner.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from robo_post.learner.loop import truncate_log
from robo_post.learner.publish import publish_once
from robo_post.learner.runs import begin_run, check_resume, finished_run
from robo_post.learner.tracking import Tracker, tracking_settings
from robo_post.store import PolicyRegistry, Store, StoreSchema
from robo_post.store.store import remove_empty_store
from robo_post.utils.device import resolve_device
from robo_post.utils.io import write_json_atomic


def _open_or_create_store(root: str, config: Any) -> Store:
    """The store whose registry receives the agent; created from the env's spaces when absent.
    An unset ``config.env`` becomes the env the store was recorded in, and unset
    ``config.env_kwargs`` the kwargs its episodes agree on: eval and the fleet run a store's
    agents in that env, so the agent trains in it. An existing store must have been recorded
    in the agent's env (the same schema, as ``collect`` checks)."""
    from robo_post.envs.registry import env_spec
    from robo_post.fleet.client import recorded_env_kwargs
    from robo_post.store import StoreNotFoundError

    store = None
    try:
        store = Store.open(root)
    except StoreNotFoundError:
        if config.env is None:
            raise
    else:
        config.env = config.env or store.schema.attrs.get("env")
        if config.env is None:
            return store  # the agent names the missing algo.env
        if not config.env_kwargs:
            config.env_kwargs = recorded_env_kwargs(root, env_spec(config.env)) or {}
    spec = env_spec(config.env)
    probe = spec.make(config.task, **config.env_kwargs)
    try:
        schema = StoreSchema.from_spaces(probe.observation_space, probe.action_space, env=spec.key)
    finally:
        probe.close()
    if store is None:
        return Store.create(root, schema)
    # The spaces and the env must match; the store's other metadata (an import's success rule, ...) is its own.
    recorded = store.schema.attrs.get("env")
    attrs = {**store.schema.attrs, "env": recorded if recorded in (spec.key, spec.id) else spec.key}
    return Store.create(root, dataclasses.replace(schema, attrs=attrs, extras=store.schema.extras), exist_ok=True)


# The learner's settings an SB3 run never reads (SB3 has its own batch size, discount and network):
# a run recorded before one of them was added or changed resumes and republishes as before.
SB3_UNREAD = ("updates", "epochs", "batch_size", "gamma", "amp", "model", "data")


def sb3(cfg: DictConfig, spec: MethodSpec) -> dict[str, Any]:
    """`robo-post train` for an SB3 agent: SB3's ``learn`` in the env, metrics and checkpoints
    at rollout boundaries, the agent published to the store's registry (safetensors + JSON).

    A killed run resumes from its last checkpoint (weights, optimiser, step count); the
    rollout that was in flight is collected again; a finished run returns its summary.
    """
    from stable_baselines3.common.callbacks import BaseCallback

    if (done := finished_run(cfg.run_dir, "timesteps", cfg.algo.timesteps, cfg, SB3_UNREAD)) is not None:
        return done
    check_resume(cfg.run_dir, cfg, "timesteps", cfg.algo.timesteps, "algo.timesteps", unread=SB3_UNREAD)
    tracking_settings(cfg.get("tracking"))
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    values = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
    config = spec.make_config(values)
    existed = os.path.exists(cfg.store)
    created = not os.path.exists(os.path.join(cfg.store, "store.json"))
    store = _open_or_create_store(cfg.store, config)
    if config.seed is None:
        config.seed = cfg.seed
    try:
        agent = spec.build(config, None, resolve_device(cfg.device), None)
        check_budget(config.timesteps, agent.model)
    except BaseException:
        if created:  # refused settings leave no store behind
            remove_empty_store(store.root, existed)
        raise
    run_dir = cfg.run_dir
    begin_run(run_dir, cfg, "timesteps", cfg.algo.timesteps)
    ckpt, log_path = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "metrics.jsonl")
    if has_checkpoint(ckpt):
        agent.model.num_timesteps = load_checkpoint(ckpt, agent.modules, agent.optimizers, {}, ("timesteps",))["timesteps"]
    truncate_log(log_path, agent.model.num_timesteps)  # also the rows of a run killed before its first checkpoint

    class Log(BaseCallback):
        """A metrics row and, every ``checkpoint_every`` steps, a checkpoint per rollout."""

        def __init__(self):
            super().__init__()
            self.train_metrics: dict[str, float] = {}
            self.saved = agent.model.num_timesteps
            self.t = time.perf_counter()

        def _on_rollout_start(self) -> None:  # SB3 has just trained on the previous rollout
            self.train_metrics = {k: float(v) for k, v in self.model.logger.name_to_value.items()
                                  if isinstance(v, (int, float, np.floating))}

        def _on_rollout_end(self) -> None:
            episodes = list(self.model.ep_info_buffer)
            row = {"update": self.num_timesteps, "time": time.time(), **self.train_metrics,
                   "steps_per_s": self.model.n_envs * self.locals.get("n_rollout_steps", 0) / max(time.perf_counter() - self.t, 1e-9)}
            if episodes:
                row.update(episode_return=float(np.mean([e["r"] for e in episodes])),
                           episode_length=float(np.mean([e["l"] for e in episodes])))
            extra = getattr(agent, "rollout_metrics", None)  # a method's own metrics (e.g. exact evaluations)
            if extra is not None:
                row.update(extra(self.num_timesteps))
            with open(log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            tracker.log(row)
            self.t = time.perf_counter()
            if self.num_timesteps - self.saved >= cfg.checkpoint_every:
                save_checkpoint(ckpt, agent.modules, agent.optimizers, {}, {"timesteps": self.num_timesteps})
                self.saved = self.num_timesteps

        def _on_step(self) -> bool:
            return True

    t0 = time.perf_counter()
    remaining = config.timesteps - agent.model.num_timesteps
    if remaining > 0:
        with Tracker(run_dir, cfg.get("tracking"), agent.model.num_timesteps) as tracker:
            agent.model.learn(total_timesteps=remaining, callback=Log(), reset_num_timesteps=False,
                              progress_bar=False)
    save_checkpoint(ckpt, agent.modules, agent.optimizers, {}, {"timesteps": agent.model.num_timesteps})
    weights, artifact_config = agent.artifact(phase="online", parent_version=None, timesteps=agent.model.num_timesteps,
                                              config=OmegaConf.to_container(cfg, resolve=True))
    version = publish_once(PolicyRegistry(store.root), weights, artifact_config) if cfg.publish else None
    rows = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
    summary = {"algo": spec.name, "version": version, "timesteps": agent.model.num_timesteps, "env": config.env,
               "wall_s": time.perf_counter() - t0, "final": rows[-1] if rows else {}}
    # the last metrics row was written before SB3's last update; a method's own evaluation of the published agent
    evaluate = getattr(agent, "final_metrics", None)
    if evaluate is not None:
        summary["evaluation"] = evaluate()
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary, indent=1)
    return summary
