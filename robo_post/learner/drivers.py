"""The off-policy driver: ``off_policy``, the loop that trains a method on windows of a
store snapshot (``MethodSpec.driver``).

It selects the episodes, builds the window sampler, measures what the method is sized from
(``DataSpec``: feature spec, normalisers, value range), builds the method through the
registry, runs ``train_loop`` (logging, checkpoint/resume) and publishes the result to the
store's policy registry with its provenance. A critic method without a reference version
starts from flow BC on its own episodes (``choose_reference``), trained first if need be.
Methods that need another loop name their own driver (``sb3_driver``, ``craft_driver``);
the table of drivers is ``robo_post.learner.train.DRIVERS``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from robo_post.algos.actor_critic import backup_chunks
from robo_post.algos.divl import DIVL
from robo_post.algos.registry import MethodSpec, check_continuous, method_spec
from robo_post.config import compose
from robo_post.learner.checkpoint import has_checkpoint
from robo_post.learner.critic_report import (critic_diagnostics, critic_trend, held_out, warn_unconverged,
                                             warn_value_edges)
from robo_post.learner.critic_report import describe as describe_diagnostics
from robo_post.learner.data import (add_imitation, chunk_defaults, imitation_sampler, load_reference, measure,
                                    select_episodes)
from robo_post.learner.loop import train_loop
from robo_post.learner.publish import publish_once
from robo_post.learner.runs import begin_run, check_resume, finished_run
from robo_post.learner.tracking import tracking_settings
from robo_post.learner.value_report import write_value_report
from robo_post.store import EpisodeInfo, PolicyRegistry, Snapshot, Store, WindowSampler
from robo_post.utils.device import resolve_device
from robo_post.utils.io import read_metrics, write_json_atomic

# Bounds of the update budget measured from the data (``updates=null``).
MIN_UPDATES, MAX_UPDATES = 3000, 100_000


# What makes two runs' training episodes the same selection (``data.*``).
SELECTION_KEYS = ("snapshot", "tasks", "success", "roles", "clients")
# Settings a reference BC run takes over from the critic run that needs it.
REFERENCE_SETTINGS = ("store", "device", "torch_threads", "seed", "epochs", "batch_size", "gamma", "prefetch", "amp",
                      "compile", "log_every", "checkpoint_every", "show", "tracking", "model", "data")


def matching_reference(registry: PolicyRegistry, data: dict[str, Any], episodes: int) -> int | None:
    """The newest flow BC version trained on ``episodes`` episodes of the selection ``data``."""
    for version in reversed(registry.versions()):
        config = registry.peek_config(version) or {}
        trained = (config.get("config") or {}).get("data") or {}
        if (config.get("kind") == "flow" and config.get("algorithm") == "bc_flow" and config.get("episodes") == episodes
                and all(trained.get(k) == data.get(k) for k in SELECTION_KEYS)):
            return version
    return None


def choose_reference(cfg: DictConfig, spec: MethodSpec, episodes: int) -> int:
    """The BC flow a critic method starts from when ``algo.reference_version`` is null: flow BC
    on the very episodes the critic learns from (its ``data`` selection, usually every episode),
    the behaviour policy its critic evaluates and the policy it is meant to improve on. The
    newest such published version, else one trained first (``RUN/reference``, published)."""
    registry = PolicyRegistry(cfg.store)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    selection = f"data.success={json.dumps(data.get('success'))}" + "".join(
        f", data.{k}={json.dumps(data[k])}" for k in ("tasks", "roles", "clients") if data.get(k) is not None)
    found = matching_reference(registry, data, episodes)
    if found is not None:
        print(f"algo={spec.name} starts from v{found}, flow BC on the same {episodes} episodes ({selection})",
              file=sys.stderr)
        return found
    run_dir = os.path.join(cfg.run_dir, "reference")
    print(f"algo={spec.name}: no flow BC published on its {episodes} episodes ({selection}); training one first in "
          f"{run_dir} (algo.reference_version=N starts from version N instead)", file=sys.stderr)
    reference = OmegaConf.merge(compose("train", ["algo=bc_flow"]), {k: cfg[k] for k in REFERENCE_SETTINGS if k in cfg},
                                {"run_dir": run_dir, "updates": None, "publish": True})
    return off_policy(reference, method_spec("bc_flow"))["version"]


SNAPSHOT_FILE = "snapshot.json"


def _resumed_snapshot(run_dir: str) -> str | None:
    """The snapshot a run resuming from its checkpoint started on (None for a fresh run): the
    windows it trains on, and so its resumed weights and published version, stay those of an
    uninterrupted run, however many episodes the store gained meanwhile."""
    if not has_checkpoint(os.path.join(run_dir, "checkpoint")):
        return None
    try:
        with open(os.path.join(run_dir, SNAPSHOT_FILE)) as f:
            return json.load(f)["snapshot"]
    except FileNotFoundError:  # a store that could not record its snapshot: the newest one
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{os.path.join(run_dir, SNAPSHOT_FILE)} is damaged ({e!r}); pin data.snapshot, "
                         f"or a new run_dir starts over") from None


def _warn_unread_model_settings(cfg: DictConfig, spec: MethodSpec) -> None:
    """Name the flow-policy settings under ``model`` this method does not read (they were
    accepted, recorded in config.yaml and ignored): a policy that acts one action at a time
    has no chunks or flow steps, and a method that starts from a reference keeps its chunks."""
    flow = "flow_steps" in spec.model_keys
    unread = (([] if flow and not spec.needs_reference else ["horizon", "execute_steps", "deterministic", "mode_draws", "predicts"])
              + ([] if flow else ["flow_steps"]))
    default = compose("train", []).model  # the model group is train's own (a plugin has no algo/ config file)
    for key in unread:
        if cfg.model.get(key) != default.get(key):
            why = "it keeps its reference policy's" if spec.needs_reference else "its policy has none"
            print(f"warning: algo={spec.name} does not read model.{key}={cfg.model.get(key)} ({why}); it is ignored",
                  file=sys.stderr)


def training_episodes(snap: Snapshot, cfg: DictConfig, spec: MethodSpec) -> tuple[list[EpisodeInfo], list[EpisodeInfo]]:
    """(episodes the method trains on, episodes held out): ``cfg.data``'s selection, less the
    share a critic method keeps out for its diagnostics (``data.holdout``)."""
    episodes = select_episodes(snap, cfg.data)
    holdout = held_out(episodes, cfg.data.get("holdout", 0.0), cfg.seed) if spec.needs_reference else []
    keys = {h.key for h in holdout}
    return [e for e in episodes if e.key not in keys], holdout


def resolve_updates(cfg: DictConfig, spec: MethodSpec) -> Snapshot | None:
    """``updates=null``: ``epochs`` passes over the training steps at ``batch_size``, within
    [MIN_UPDATES, MAX_UPDATES], written into ``cfg`` (so the run records the number); returns
    the snapshot it measured, for the run to train on (None when ``updates`` is set). A budget
    fixed in updates under-trains large datasets and over-trains small ones: flow BC of 20
    expert episodes (20,000 steps) kept 14% of their return at 3000 updates of 64 windows
    (10 passes) and all of it at 77 passes (docs/notes/offline-learning.md)."""
    if cfg.updates is not None:
        return None
    snap = Store.open(cfg.store).snapshot(cfg.data.snapshot or _resumed_snapshot(cfg.run_dir))
    steps = sum(e.length for e in training_episodes(snap, cfg, spec)[0])
    updates = int(np.clip(round(cfg.epochs * steps / cfg.batch_size), MIN_UPDATES, MAX_UPDATES))
    print(f"updates={updates}: {cfg.epochs} passes over {steps} steps at batch_size={cfg.batch_size}, within "
          f"[{MIN_UPDATES}, {MAX_UPDATES}] (set updates=N to fix the budget)", file=sys.stderr)
    with open_dict(cfg):
        cfg.updates = updates
    return snap


def off_policy(cfg: DictConfig, spec: MethodSpec) -> dict[str, Any]:
    """`robo-post train` for a method trained on snapshot windows; publishes the result
    (a run that already finished returns its summary instead)."""
    measured = resolve_updates(cfg, spec)
    if (done := finished_run(cfg.run_dir, "update", cfg.updates, cfg)) is not None:
        return done
    check_resume(cfg.run_dir, cfg, "update", cfg.updates, "updates")
    tracking_settings(cfg.get("tracking"))  # an enabled tracker that is not installed fails before any work
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    device = resolve_device(cfg.device)
    store = Store.open(cfg.store)
    snap = measured or store.snapshot(cfg.data.snapshot or _resumed_snapshot(cfg.run_dir))
    episodes, holdout = training_episodes(snap, cfg, spec)
    values = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
    if "model" in spec.config.__dataclass_fields__:
        values.setdefault("model", {k: cfg.model[k] for k in spec.model_keys if cfg.model.get(k) is not None})
    _warn_unread_model_settings(cfg, spec)
    config = spec.make_config(values)
    if hasattr(config, "critic_warmup") and config.critic_warmup is None:
        config.critic_warmup = cfg.updates // 2  # the critic's half of the budget, then both
    if cfg.updates <= getattr(config, "critic_warmup", 0):
        print(f"warning: updates={cfg.updates} <= algo.critic_warmup={config.critic_warmup}: only the critic "
              "trains, and the published actor is the reference policy unchanged", file=sys.stderr)
    if spec.needs_reference:  # it starts from a flow policy, which integer actions cannot have
        check_continuous(spec.name, np.dtype(store.schema.action.dtype).kind in "iu")
        if config.reference_version is None:
            config.reference_version = choose_reference(cfg, spec, len(episodes) + len(holdout))
    reference, parent = (load_reference(store, config.reference_version, device) if spec.needs_reference
                         else (None, None))
    horizon = reference.config.horizon if reference is not None else cfg.model.horizon or chunk_defaults(store.schema)[0]
    if getattr(config, "n_step", 1) is None:
        config.n_step = backup_chunks(spec.name, config, [e.length for e in episodes], horizon, cfg.gamma, cfg.updates)
        print(f"n_step={config.n_step}: {config.n_step * horizon}-step backups (algo.n_step=N fixes it)", file=sys.stderr)
    sampler = WindowSampler.from_snapshot(  # with prefetch, the prefetcher moves batches to the device
        snap, episodes, horizon=horizon, n_step=getattr(config, "n_step", 1), gamma=cfg.gamma,
        device="cpu" if cfg.prefetch else device, seed=cfg.seed,
        bootstrap_truncated=getattr(config, "bootstrap_truncated", True),
    )
    data = measure(store.schema, sampler, cfg.model, cfg.gamma, reference)
    method = spec.build(config, data, device, reference)
    imitation = imitation_sampler(config, method, [sampler], cfg.seed + 3)
    rngs = {"sampler": sampler.rng} | ({"imitation": imitation.rng} if imitation is not None else {})

    run_dir = cfg.run_dir
    begin_run(run_dir, cfg, "update", cfg.updates)
    if snap.recorded:
        write_json_atomic(os.path.join(run_dir, SNAPSHOT_FILE), {"snapshot": snap.id})
    evaluate = None
    if cfg.eval.every:
        from robo_post.envs.registry import env_spec
        from robo_post.eval.rollout import in_process_success
        from robo_post.fleet.client import recorded_env_kwargs

        tasks = sorted({e.task_id for e in episodes})
        env = store.schema.attrs.get("env")
        kwargs = None
        if env is not None:
            entry = env_spec(env)
            kwargs = recorded_env_kwargs(store.root, entry)  # the dataset's step limit, as `robo-post eval` runs it
            if entry.task_kwarg is None:  # an env without tasks: imported episodes name their dataset instead
                tasks = [entry.id]
        evaluate = lambda update: in_process_success(method.policy, tasks, cfg.eval.episodes_per_task,  # noqa: E731
                                                     env=env, env_kwargs=kwargs)
    t0 = time.perf_counter()
    logged = train_loop(method, lambda: add_imitation(sampler.sample(cfg.batch_size), imitation, cfg.batch_size),
                        run_dir, cfg.updates, rngs, log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every,
                        eval_every=cfg.eval.every, evaluate=evaluate, show=cfg.show, prefetch=cfg.prefetch,
                        amp=cfg.amp, compile=cfg.get("compile", False), tracking=cfg.get("tracking"))
    wall = time.perf_counter() - t0
    warn_value_edges(logged, data.value_range)
    trend = critic_trend(logged or read_metrics(os.path.join(run_dir, "metrics.jsonl")), data.return_span)
    warn_unconverged(trend)
    diagnostics = critic_diagnostics(method, snap, holdout or episodes, cfg.gamma, held=bool(holdout), seed=cfg.seed)
    if diagnostics is not None:
        print(describe_diagnostics(diagnostics), file=sys.stderr)
    if isinstance(getattr(method, "value", None), DIVL):
        write_value_report(run_dir, "offline", method.value, snap, episodes)
    weights, artifact_config = method.artifact(
        algorithm=spec.name, phase="offline", parent_version=parent, snapshot=snap.id, episodes=len(episodes), updates=cfg.updates,
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    version = publish_once(PolicyRegistry(store.root), weights, artifact_config) if cfg.publish else None
    # no update this time (published again, or killed after its last checkpoint): the training's last row
    final = (logged or read_metrics(os.path.join(run_dir, "metrics.jsonl")) or [{}])[-1]
    summary = {"algo": spec.name, "version": version, "parent_version": parent, "snapshot": snap.id,
               "episodes": len(episodes), "steps": len(sampler), "value_range": list(data.value_range),
               "wall_s": wall, "final": final}
    if hasattr(config, "n_step"):  # as measured (n_step: null) or set
        summary["backup"] = {"n_step": config.n_step, "steps": config.n_step * sampler.horizon,
                             "critic_warmup": config.critic_warmup}
    if trend is not None:
        summary["critic_trend"] = trend
    if diagnostics is not None:
        summary["critic_diagnostics"] = diagnostics
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary, indent=1)
    return summary
