"""The LWD learner: critic-based policy extraction, offline then online while the fleet deploys.

The method is chosen by name from the method registry (``lwd.algo``; default
``divl_qam``: DIVL value learning + QAM policy extraction). Offline, the
off-policy driver trains it on a snapshot with n-step chunk backups; online, it
mixes offline windows with windows from fleet episodes recorded since, with
1-step backups, optionally dropping episodes of stale policy versions (bounded
staleness). See docs/methods.md.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, fields
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.algos.divl import DIVL
from robo_post.algos.registry import method_spec
from robo_post.config import compose
from robo_post.learner.critic_report import warn_value_edges
from robo_post.learner.data import add_imitation, imitation_sampler, load_reference, measure
from robo_post.learner.drivers import off_policy
from robo_post.learner.loop import train_loop
from robo_post.learner.value_report import write_value_report
from robo_post.store import (EpisodeInfo, FreshPERConfig, MixedSampler, PolicyRegistry, PrioritizedSampler, Snapshot,
                             Store, WindowSampler)
from robo_post.utils.device import resolve_device
from robo_post.utils.io import write_json_atomic

def _method_values(cfg: DictConfig, n_step: int) -> dict[str, Any]:
    """The method's own settings among ``lwd.*`` (``algo.*`` of `robo-post train`), with this phase's ``n_step``."""
    names = {f.name for f in fields(method_spec(cfg.algo).config)}
    values = OmegaConf.to_container(cfg, resolve=True)
    return {**{k: v for k, v in values.items() if k in names}, "n_step": n_step}


def offline(store_root: str, run_dir: str, cfg: DictConfig, snapshot: str | None = None) -> dict[str, Any]:
    """Offline training on a snapshot (default: taken now), on all its episodes (demos, failures,
    play, deployments); publishes the trained policy. Runs the registry's off-policy driver."""
    base = compose("train", [f"algo={cfg.algo}"])
    OmegaConf.set_struct(base, False)  # critic/value/actor overrides are open dicts
    values = _method_values(cfg, cfg.offline.n_step)
    # The loop's own BC (the first flow version unless pinned), not `train`'s BC-on-the-same-episodes rule.
    values["reference_version"] = load_reference(Store.open(store_root), values.get("reference_version"), "cpu")[1]
    train_cfg = OmegaConf.merge(base, {
        "store": store_root, "run_dir": run_dir, "device": cfg.device, "torch_threads": cfg.torch_threads,
        "seed": cfg.seed, "show": cfg.show, "gamma": cfg.gamma, "batch_size": cfg.batch_size,
        "log_every": cfg.log_every, "checkpoint_every": cfg.checkpoint_every, "updates": cfg.offline.updates,
        "tracking": OmegaConf.to_container(cfg.tracking, resolve=True) if "tracking" in cfg else {},
        "data": {"success": None, "snapshot": snapshot, "holdout": 0.0}, "algo": values,
    })
    return off_policy(train_cfg, method_spec(cfg.algo))


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
    spec = method_spec(cfg.algo)
    config = spec.make_config(_method_values(cfg, on.n_step))
    reference, _ = load_reference(store, config.reference_version, device)

    def sampler(episodes: list[EpisodeInfo] | None, seed: int) -> WindowSampler:
        return WindowSampler.from_snapshot(base, episodes, horizon=reference.config.horizon, n_step=on.n_step,
                                           gamma=cfg.gamma, device=device, seed=seed,
                                           bootstrap_truncated=config.bootstrap_truncated)

    offline_sampler, online_sampler = sampler(None, cfg.seed), sampler([], cfg.seed + 1)
    # Sized from the offline snapshot, as the offline phase was: the checkpoint loads into the same shapes.
    algo = spec.build(config, measure(store.schema, offline_sampler, None, cfg.gamma, reference), device, reference)
    algo.set_stage("online")
    start, total = cfg.offline.updates, cfg.offline.updates + on.updates
    replay = _replay(on.replay, online_sampler, cfg.seed + 2)
    mixed = MixedSampler(offline_sampler, online_sampler if replay is None else replay, on.online_fraction)
    imitation = imitation_sampler(config, algo, [offline_sampler, online_sampler], cfg.seed + 3)
    state: dict[str, Any] = {"seen": base, "polled": 0.0, "drained": False, "batch": None}

    def ingest() -> None:
        snap = store.snapshot()
        new = _fleet_episodes(snap, state["seen"], on.client_prefix, registry.latest(), on.max_staleness)
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
        return add_imitation(state["batch"], imitation, cfg.batch_size)

    published: list[int] = []

    def after_update(update: int) -> None:
        if (update - start) % on.publish_every == 0 or update == total:
            parent = registry.latest()
            weights, config_ = algo.artifact(phase=f"online-{update}", parent_version=parent, snapshot=state["seen"].id,
                                             config=OmegaConf.to_container(cfg, resolve=True))
            published.append(registry.publish(weights, config_))

    t0 = time.perf_counter()
    rngs = {"offline": offline_sampler.rng, "online": online_sampler.rng}
    if imitation is not None:
        rngs["imitation"] = imitation.rng
    logged = train_loop(algo, sample, run_dir, total, rngs,
                        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, show=cfg.show,
                        after_update=after_update, tracking=cfg.get("tracking"), phase_start=start)
    warn_value_edges(logged, (float(algo.value.atoms[0]), float(algo.value.atoms[-1]))
                     if isinstance(algo.value, DIVL) else (0.0, 0.0))
    if isinstance(algo.value, DIVL):  # on the fleet's episodes: the policy's own successes and failures
        write_value_report(run_dir, "online", algo.value, state["seen"], online_sampler.episodes)
    summary = {"algo": cfg.algo, "versions": published, "snapshot": state["seen"].id,
               "online_episodes": len(online_sampler.episodes), "online_steps": len(online_sampler),
               "wall_s": time.perf_counter() - t0, "final": logged[-1] if logged else {}}
    _write_json(os.path.join(run_dir, "online.json"), summary)
    return summary


def _replay(settings: DictConfig, online_sampler: WindowSampler, seed: int) -> PrioritizedSampler | None:
    """FreshPER over the online windows (|TD| priorities decaying with age) when
    ``online.replay.enabled``; None samples them uniformly."""
    if not settings.enabled:
        return None
    config = FreshPERConfig(**{k: v for k, v in settings.items() if k != "enabled"})
    return PrioritizedSampler(online_sampler, config, seed=seed)


def _fleet_episodes(snap: Snapshot, seen: Snapshot, client_prefix: str, latest: int | None,
                    max_staleness: int | None) -> list[EpisodeInfo]:
    """The episodes ``snap`` holds beyond ``seen`` that the online fleet (clients ``client_prefix*``)
    recorded, each with a policy at most ``max_staleness`` versions older than ``latest`` when set."""
    return [e for e in snap.new_since(seen) if e.client_id.startswith(client_prefix)
            and (max_staleness is None or latest - e.policy_version <= max_staleness)]


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
    write_json_atomic(path, obj, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
