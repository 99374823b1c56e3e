"""LWD learner: critic-based policy extraction, offline then online
(docs/specs/lwd_divl_qam.md §4).

The algorithm is chosen by name (``robo_post.learner.algorithms``; default
``divl_qam``: DIVL value learning + QAM policy extraction). One learner step is
one critic update followed by one actor update. Offline it reads a fixed
snapshot with n-step chunk backups; online it mixes offline windows with windows
from fleet episodes recorded since, with 1-step backups (§2.2.9), optionally
dropping episodes of stale policy versions (bounded staleness,
docs/specs/craft_poe_drest.md §D3).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.algos.divl import DIVL
from robo_post.learner.algorithms import ActorCritic
from robo_post.learner.train import resolve_device, train_loop
from robo_post.learner.value_report import write_value_report
from robo_post.models.flow import FlowPolicy
from robo_post.store import (EpisodeInfo, FreshPERConfig, ImitationSampler, MixedSampler, PolicyRegistry,
                             PrioritizedSampler, Snapshot, Store, WindowSampler)


def build(store: Store, cfg: DictConfig, device) -> tuple[ActorCritic, int]:
    """The learner, starting from the reference policy version ``cfg.reference_version``."""
    registry = PolicyRegistry(store.root)
    if not registry.versions():
        raise ValueError(f"{cfg.algo} needs a reference (BC) policy, but the registry of {store.root} is empty; "
                         "train one first with `robo-post train algo=bc_flow`")
    reference_version = cfg.reference_version or registry.versions()[0]
    reference = FlowPolicy.from_artifact(*registry.load(reference_version), device=str(device))
    algo = ActorCritic(cfg.algo, reference, OmegaConf.to_container(cfg.value, resolve=True),
                       OmegaConf.to_container(cfg.actor, resolve=True), cfg.critic_warmup, cfg.best_of_n, device,
                       OmegaConf.to_container(cfg.critic, resolve=True))
    return algo, reference_version


def _sampler(algo: ActorCritic, snap: Snapshot, episodes, cfg: DictConfig, n_step: int, device,
             seed: int) -> WindowSampler:
    return WindowSampler.from_snapshot(snap, episodes, horizon=algo.policy.config.horizon, n_step=n_step,
                                       gamma=cfg.gamma, device=device, seed=seed,
                                       bootstrap_truncated=cfg.bootstrap_truncated)


def _imitation(algo: ActorCritic, samplers: list[WindowSampler], cfg: DictConfig) -> ImitationSampler | None:
    """What a co-trained base imitates (``lwd.imitation``): the successful episodes of the
    demonstration clients and every intervention step, among the samplers' windows."""
    if not cfg.imitation.enabled:
        return None
    if algo.actor.bc is None:
        raise ValueError("lwd.imitation.enabled needs a co-trained base to imitate with: set lwd.actor.base=ema_cotrained")
    prefixes = tuple(f"{p}-" for p in cfg.imitation.demo_clients)
    return ImitationSampler(samplers, lambda e: e.success and e.client_id.startswith(prefixes), seed=cfg.seed + 3)


def _add_imitation(batch: dict, imitation: ImitationSampler | None, batch_size: int) -> dict:
    return batch if imitation is None else {**batch, "imitation": imitation.sample(batch_size)}


def _publish(store: Store, algo: ActorCritic, parent: int, snap_id: str, phase: str, cfg: DictConfig) -> int:
    weights, config = algo.artifact(phase=phase, parent_version=parent, snapshot=snap_id,
                                    config=OmegaConf.to_container(cfg, resolve=True))
    return PolicyRegistry(store.root).publish(weights, config)


def offline(store_root: str, run_dir: str, cfg: DictConfig, snapshot: str | None = None,
            episodes: list[EpisodeInfo] | None = None, eval_every: int = 0,
            evaluate: Callable[[FlowPolicy], dict[str, float]] | None = None) -> dict[str, Any]:
    """Offline training on a snapshot (default: now; all its episodes: demos, failures, play);
    publishes the trained policy. ``evaluate(policy)`` runs every ``eval_every`` updates."""
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    store = Store.open(store_root)
    snap = store.snapshot(snapshot)
    algo, parent = build(store, cfg, device)
    sampler = _sampler(algo, snap, episodes, cfg, cfg.offline.n_step, device, cfg.seed)
    imitation = _imitation(algo, [sampler], cfg)
    rngs = {"sampler": sampler.rng}
    if imitation is not None:
        rngs["imitation"] = imitation.rng
    t0 = time.perf_counter()
    logged = train_loop(algo, lambda: _add_imitation(sampler.sample(cfg.batch_size), imitation, cfg.batch_size),
                        run_dir, cfg.offline.updates, rngs, log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every,
                        eval_every=eval_every, evaluate=evaluate and (lambda update: evaluate(algo.policy)),
                        show=cfg.show)
    version = _publish(store, algo, parent, snap.id, "offline", cfg)
    if isinstance(algo.value, DIVL):
        write_value_report(run_dir, "offline", algo.value, snap)
    summary = {"algo": cfg.algo, "version": version, "parent_version": parent, "snapshot": snap.id,
               "episodes": len(sampler.episodes), "wall_s": time.perf_counter() - t0,
               "final": logged[-1] if logged else {}}
    _write_json(os.path.join(run_dir, "summary.json"), summary)
    return summary


def online(store_root: str, run_dir: str, cfg: DictConfig, offline_snapshot: str,
           fleet_running: Callable[[], bool]) -> dict[str, Any]:
    """The online phase, concurrent with the fleet (Learning While Deploying).

    While the fleet records episodes with the newest published version, the learner
    keeps ingesting fleet episodes recorded since ``offline_snapshot`` (client prefix
    ``cfg.online.client_prefix``, optionally within ``max_staleness`` versions), mixes
    them with the offline windows, holds its update-to-data ratio (online updates <=
    ``utd`` x online env steps ingested; waiting for data counts as data-wait), and
    publishes a version every ``publish_every`` updates. ``fleet_running()`` says whether
    more episodes may still arrive; once it is false the learner stops waiting for data.

    A killed phase resumes from the learner's last checkpoint; which fleet episodes a
    batch sees depends on arrival timing, so unlike the offline phase this one is not
    bit-reproducible.
    """
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.torch_threads)
    store = Store.open(store_root)
    registry = PolicyRegistry(store.root)
    on = cfg.online
    base = store.snapshot(offline_snapshot)
    algo, _ = build(store, cfg, device)
    algo.set_stage("online")
    offline_sampler = _sampler(algo, base, None, cfg, on.n_step, device, cfg.seed)
    online_sampler = _sampler(algo, base, [], cfg, on.n_step, device, cfg.seed + 1)
    start, total = cfg.offline.updates, cfg.offline.updates + on.updates
    replay = None  # FreshPER over the online windows: |TD| priorities decaying with age
    if on.replay.enabled:
        replay_cfg = FreshPERConfig(**{k: v for k, v in on.replay.items() if k != "enabled"})
        replay = PrioritizedSampler(online_sampler, replay_cfg, seed=cfg.seed + 2)
    mixed = MixedSampler(offline_sampler, online_sampler if replay is None else replay, on.online_fraction)
    imitation = _imitation(algo, [offline_sampler, online_sampler], cfg)
    state: dict[str, Any] = {"seen": base, "polled": 0.0, "drained": False, "batch": None}

    def ingest() -> None:
        snap = store.snapshot()
        latest = registry.latest()
        new = [e for e in snap.new_since(state["seen"]) if e.client_id.startswith(on.client_prefix)
               and (on.max_staleness is None or latest - e.policy_version <= on.max_staleness)]
        state["seen"], state["polled"] = snap, time.monotonic()
        if not new:
            return
        online_sampler.add_episodes(snap, new)
        if imitation is not None:
            imitation.refresh()
        if replay is not None:  # the new windows, in the order the sampler appended them
            replay.add_windows(_stored_at(run_dir, online_sampler.episodes[-len(new):], algo.updates))

    def sample() -> dict[str, Any]:
        if replay is not None and state["batch"] is not None:  # last batch's |TD| -> its base priorities
            replay.update_priorities(state["batch"], algo.value.td_error)
        while True:
            running = fleet_running()
            # Poll while the fleet runs; once it has stopped, one last look finds everything.
            if not state["drained"] and (not running or time.monotonic() - state["polled"] > on.poll_s):
                ingest()
                state["drained"] = not running
            if not running or algo.updates - start < on.utd * len(online_sampler):
                break
            time.sleep(on.poll_s / 4)  # ahead of the data: wait for the fleet (logged as data_wait)
        if replay is not None:
            replay.step = algo.updates
        state["batch"] = mixed.sample(cfg.batch_size)
        return _add_imitation(state["batch"], imitation, cfg.batch_size)

    published: list[int] = []

    def after_update(update: int) -> None:
        if (update - start) % on.publish_every == 0 or update == total:
            parent = registry.latest()
            published.append(_publish(store, algo, parent, state["seen"].id, f"online-{update}", cfg))

    t0 = time.perf_counter()
    rngs = {"offline": offline_sampler.rng, "online": online_sampler.rng}
    if imitation is not None:
        rngs["imitation"] = imitation.rng
    logged = train_loop(algo, sample, run_dir, total, rngs,
                        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, show=cfg.show,
                        after_update=after_update)
    if isinstance(algo.value, DIVL):  # on the fleet's episodes: the policy's own successes and failures
        write_value_report(run_dir, "online", algo.value, state["seen"], online_sampler.episodes)
    summary = {"algo": cfg.algo, "versions": published, "snapshot": state["seen"].id,
               "online_episodes": len(online_sampler.episodes), "online_steps": len(online_sampler),
               "wall_s": time.perf_counter() - t0, "final": logged[-1] if logged else {}}
    _write_json(os.path.join(run_dir, "online.json"), summary)
    return summary


def _stored_at(run_dir: str, episodes: list[EpisodeInfo], step: int) -> np.ndarray:
    """Learner step at which each window's episode first reached the learner (FreshPER's age origin).

    Recorded per episode in ``RUN/replay_stored_at.json`` so ages survive a resume;
    episodes seen for the first time are stored at ``step``.
    """
    path = os.path.join(run_dir, "replay_stored_at.json")
    known: dict[str, int] = {}
    if os.path.exists(path):
        with open(path) as f:
            known = json.load(f)
    for e in episodes:
        known.setdefault(e.key, step)
    _write_json(path, known)
    return np.repeat([known[e.key] for e in episodes], [e.length for e in episodes])


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
