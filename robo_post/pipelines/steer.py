"""`robo-post steer` and `robo-post steer-eval`: steer a frozen actor with a goal-conditioned prior.

``steer`` builds the steered policy (choosing alpha with the KL-budget selector when
``selector.kl_budget`` is set, with the bandit selector when ``selector.kind=bandit``, or with
the bandit where the env reports success and the KL budget elsewhere when ``selector.kind=auto``),
publishes it as a registry version of kind ``steered`` in the deployment store and runs
the fleet pinned to that version; every step records the actor's, the prior's and the
steered mean and std as store extras.

``steer-eval`` runs the evaluation grid (``robo_post.steering.evaluate``) over prior
qualities, rules and alphas on paired seeds and writes the report page.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from robo_post.config import check_dir_path
from robo_post.envs.registry import env_spec, spec_for_env
from robo_post.fleet.client import make_env, store_schema
from robo_post.fleet.collect import client_configs, env_config, make_launcher
from robo_post.fleet.launcher import raise_unfinished
from robo_post.learner.publish import publish_once
from robo_post.models.gaussian import Gaussian
from robo_post.steering.auto import select_alpha_auto
from robo_post.steering.bandit import bandit_arms, halving_plan, select_alpha_bandit
from robo_post.steering.evaluate import GridConfig, evaluate_prior, format_table, run_episodes, write_report
from robo_post.steering.poe import SteeringConfigError, kl_diag, select_alpha
from robo_post.steering.policy import (SteeredPolicy, SteeringConfig, build_source, extra_specs, resolve_source,
                                       steered_artifact)
from robo_post.steering.sources import QUALITIES, SteeringSourceError
from robo_post.store.registry import PolicyRegistry
from robo_post.store.store import Store
from robo_post.utils.io import write_json_atomic


def _container(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _sources(cfg: DictConfig, env: Any, prior_cfg: dict[str, Any] | None = None):
    """(actor artifact, prior artifact, actor source, prior source), checked against the env's action space."""
    actor_art = resolve_source(_container(cfg.actor), "actor")
    prior_art = resolve_source(prior_cfg or _container(cfg.prior), "prior")
    actor = build_source(*actor_art, env, cfg.device)
    prior = build_source(*prior_art, env, cfg.device)
    obs, _ = env.reset(seed=0)
    batch = {k: np.asarray(v)[None] for k, v in obs.items()}
    for what, source in (("actor", actor), ("prior", prior)):
        # A learned source built for another env would fail deep in its network, or act in other units.
        if hasattr(source, "mismatch") and (why := source.mismatch(obs, env.action_space)):
            raise SteeringSourceError(f"{what} {why} (env {spec_for_env(env).key!r})")
        shape = tuple(source.distribution(batch).mean.shape[1:])
        if shape != env.action_space.shape:
            raise SteeringSourceError(f"{what} acts in shape {shape}; the env's actions are {env.action_space.shape}")
    return actor_art, prior_art, actor, prior


def _frozen_calibration(cfg: DictConfig, env_cfg: dict[str, Any], task: str | None, actor: Any, spec: Any,
                        bounds: tuple[np.ndarray, np.ndarray]):
    """The frozen actor's ``selector.episodes`` calibration episodes (seeds apart from the fleet's), with their states."""
    frozen = SteeredPolicy(actor, actor, SteeringConfig("frozen", 0.0), *bounds)
    seeds = [cfg.seed + 7_000_000 + i for i in range(cfg.selector.episodes)]
    return run_episodes(lambda: make_env(env_cfg, task), frozen.act, frozen.reset, seeds, spec.success,
                        keep_states=True)


def _visited_states(cfg: DictConfig, env_cfg: dict[str, Any], task: str | None, actor: Any, spec: Any,
                    bounds: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
    """States the KL selector reads: the observations of ``selector.store``'s episodes, else those the
    frozen actor visits in its calibration episodes."""
    if cfg.selector.store:
        store = Store.open(cfg.selector.store)
        # the sources read the env's observations; another env's store fails inside their networks
        want = {k: tuple(s.shape) for k, s in store_schema(env_cfg, task).observations.items()}
        got = {k: tuple(store.schema.observations[k].shape) for k in want if k in store.schema.observations}
        if got != want:
            recorded = {k: tuple(s.shape) for k, s in store.schema.observations.items()}
            raise SteeringSourceError(f"selector.store {cfg.selector.store} records observations {recorded}; "
                                      f"env {spec.key!r} observes {want}")
        snap = store.snapshot(record=False)
        episodes = list(snap.episodes())
        if not episodes:
            raise SteeringSourceError(f"selector.store {cfg.selector.store} has no episodes to read states from")
        loaded = [snap.load(e)["obs"] for e in episodes]
        return {k: np.concatenate([o[k] for o in loaded]) for k in loaded[0]}
    return _frozen_calibration(cfg, env_cfg, task, actor, spec, bounds).states


def deployed_kl(store: Store, episodes: list) -> float | None:
    """Mean ``KL(steered || actor)`` over the deployed steps of ``episodes``, from their store
    extras: what the steered policy actually moved on its own states (the selector's budget
    is measured on the frozen actor's)."""
    if not episodes:
        return None
    snap = store.snapshot(record=False)
    kls = []
    for episode in episodes:
        extras = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in snap.load(episode)["extras"].items()}
        steered = Gaussian(extras["steered_mean"], extras["steered_std"].log())
        kls.append(kl_diag(steered, Gaussian(extras["actor_mean"], extras["actor_std"].log())))
    return float(torch.cat(kls).mean())


def _bandit_play(cfg: DictConfig, env_cfg: dict[str, Any], task: str | None, actor: Any, prior: Any, spec: Any,
                 bounds: tuple[np.ndarray, np.ndarray]):
    """``(alpha, seeds) -> rollouts`` of the configured rule at ``alpha``: the bandit's calibration episodes."""
    def play(alpha: float, seeds: list[int]):
        policy = SteeredPolicy(actor, prior, SteeringConfig(cfg.rule, alpha, cfg.klreg_form, cfg.additive_form,
                                                            cfg.deterministic), *bounds)
        return run_episodes(lambda: make_env(env_cfg, task), policy.act, policy.reset, seeds, spec.success)
    return play


def _check_selector(sel: DictConfig) -> None:
    """Settings of one selector kind given to the other, and a bandit budget too small for its grid.

    Raises:
        SteeringConfigError: naming the setting.
    """
    if sel.kind == "bandit":
        for key in ("kl_budget", "store"):
            if sel[key] is not None:
                raise SteeringConfigError(f"selector.{key}={sel[key]} is read by selector.kind=kl_budget; "
                                          "selector.kind=bandit plays episodes (selector.bandit_episodes)")
    if sel.kind == "auto":
        if sel.kl_budget is None:
            raise SteeringConfigError("selector.kind=auto needs selector.kl_budget (its selector where the env "
                                      "reports no success), e.g. selector.kl_budget=0.5")
        if sel.store is not None:
            raise SteeringConfigError(f"selector.store={sel.store} is read by selector.kind=kl_budget; "
                                      "selector.kind=auto plays frozen calibration episodes (selector.episodes)")
    if sel.kind in ("bandit", "auto"):
        _check_budgets("selector.bandit_episodes", [sel.bandit_episodes], sel.alpha_grid, sel.alpha_max)


def _check_budgets(key: str, budgets: list[int], grid: list[float], alpha_max: float | None) -> None:
    """Each bandit budget covers the arms of ``grid`` (``halving_plan``); raises SteeringConfigError naming ``key``."""
    for budget in budgets:
        try:
            halving_plan(len(bandit_arms(grid, alpha_max)), budget)
        except SteeringConfigError as e:
            raise SteeringConfigError(f"{key}={budget}: {e}") from None


def steer(cfg: DictConfig) -> dict[str, Any]:
    """Build, publish and deploy a steered policy; returns the deployment summary."""
    _check_selector(cfg.selector)  # before the sources are loaded and anything is written
    torch.set_num_threads(1)
    env_cfg, tasks = env_config(cfg)
    task = tasks[0] if tasks else None
    spec = env_spec(env_cfg["name"])
    env = make_env(env_cfg, task)
    try:
        actor_art, prior_art, actor, prior = _sources(cfg, env)
        bounds = env.action_space.low, env.action_space.high
    finally:
        env.close()
    alpha, selection = float(cfg.alpha), None
    sel = cfg.selector
    if sel.kind == "auto":
        alpha, selection = select_alpha_auto(
            _frozen_calibration(cfg, env_cfg, task, actor, spec, bounds), actor, prior,
            _bandit_play(cfg, env_cfg, task, actor, prior, spec, bounds), sel.alpha_grid, sel.kl_budget,
            sel.bandit_episodes, sel.alpha_max, sel.margin, seed=cfg.seed + 8_000_000)
        selection = {**selection, "selector": "auto", "alpha_grid": list(sel.alpha_grid)}
    elif sel.kind == "bandit":
        play = _bandit_play(cfg, env_cfg, task, actor, prior, spec, bounds)
        choice = select_alpha_bandit(play, sel.alpha_grid, sel.bandit_episodes, sel.alpha_max, sel.margin,
                                     seed=cfg.seed + 8_000_000)
        alpha, selection = choice.alpha, {"kind": "bandit", "bandit_episodes": sel.bandit_episodes,
                                          "alpha_grid": list(sel.alpha_grid), **choice.record()}
    elif sel.kl_budget is not None:
        states = _visited_states(cfg, env_cfg, task, actor, spec, bounds)
        with torch.no_grad():
            alpha, kls = select_alpha(actor.distribution(states), prior.distribution(states), sel.alpha_grid,
                                      sel.kl_budget, sel.alpha_max)
        selection = {"kind": "kl_budget", "kl_budget": sel.kl_budget, "alpha_grid": list(sel.alpha_grid),
                     "kl_curve": kls, "states": len(next(iter(states.values())))}
    steering = SteeringConfig(cfg.rule, alpha, cfg.klreg_form, cfg.additive_form, cfg.deterministic)

    schema = store_schema(env_cfg, task)
    schema = dataclasses.replace(schema, extras=extra_specs(int(np.prod(schema.action.shape))))
    store = Store.create(cfg.store, schema, exist_ok=True)
    # A rerun deploys the same steered policy again under its version, not under a copy.
    version = publish_once(PolicyRegistry(store.root), *steered_artifact(actor_art, prior_art, steering, spec.key,
                                                                         selection=selection))
    fleet_cfg = cfg.copy()
    with open_dict(fleet_cfg):  # clients pinned to the steered version (`policy` is never run)
        fleet_cfg.policy = {"kind": "random"}
        fleet_cfg.fleet.policy_version = version
    configs = client_configs(fleet_cfg, store)
    before = {c.client_id: store.read_commit(c.client_id)["episodes"] for c in configs}
    statuses = make_launcher(fleet_cfg, configs).run(show=cfg.show)
    raise_unfinished(statuses, "steered clients", store.root)
    episodes = [e for c in configs for e in store.shard_episodes(c.client_id)[before[c.client_id]:]]
    judged = [e.success for e in episodes if e.success is not None]
    summary = {"version": version, "store": store.root, "steering": dataclasses.asdict(steering),
               "selection": selection, "episodes": len(episodes), "deployed_kl": deployed_kl(store, episodes),
               "mean_return": float(np.mean([e.ret for e in episodes])) if episodes else None,
               "success": float(np.mean(judged)) if judged else None}
    os.makedirs(os.path.join(store.root, "steer"), exist_ok=True)
    write_json_atomic(os.path.join(store.root, "steer", f"v{version}.json"), summary, indent=1)
    return summary


def steer_eval(cfg: DictConfig) -> dict[str, Any]:
    """The evaluation grid for every prior quality in ``qualities``; writes the report page."""
    check_dir_path("out_dir", cfg.out_dir)  # before the grid's minutes of episodes, not after
    _check_budgets("bandit_episodes", list(cfg.bandit_episodes or []), cfg.alpha_grid, cfg.alpha_max)
    torch.set_num_threads(1)
    env_cfg, tasks = env_config(cfg)
    task = tasks[0] if tasks else None
    spec = env_spec(env_cfg["name"])
    grid = GridConfig(rules=tuple(cfg.rules), alpha_grid=tuple(cfg.alpha_grid), kl_budgets=tuple(cfg.kl_budgets),
                      bandit_episodes=tuple(cfg.bandit_episodes or ()), bandit_margin=cfg.bandit_margin,
                      alpha_max=cfg.alpha_max, episodes=cfg.episodes, calibration_episodes=cfg.calibration_episodes,
                      stochastic=cfg.stochastic, margin=cfg.margin, seed=cfg.seed)
    base_prior = _container(cfg.prior)
    qualities = list(cfg.qualities) if base_prior.get("kind") == "scripted" else [base_prior.get("kind", "prior")]
    unknown = sorted(set(qualities) - set(QUALITIES)) if base_prior.get("kind") == "scripted" else []
    if unknown:
        raise SteeringSourceError(f"unknown prior qualities {unknown}; known: {sorted(QUALITIES)}")
    results = {}
    for quality in qualities:
        prior_cfg = {**base_prior, "quality": quality} if base_prior.get("kind") == "scripted" else base_prior
        env = make_env(env_cfg, task)
        try:
            _, _, actor, prior = _sources(cfg, env, prior_cfg)
            low, high = env.action_space.low, env.action_space.high
        finally:
            env.close()
        results[quality] = evaluate_prior(lambda: make_env(env_cfg, task), actor, prior, low, high, spec.success, grid)
        if cfg.show:
            print(format_table({quality: results[quality]}), flush=True)
    page = write_report(results, grid, cfg.out_dir, f"Steering on {spec.key}")
    return {"report": page, "json": os.path.join(cfg.out_dir, "steering.json")}
