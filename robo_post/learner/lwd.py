"""LWD learner: DIVL value learning + QAM policy extraction, offline then online
(docs/specs/lwd_divl_qam.md §4).

One learner step = one DIVL update (value, then critic, then target EMA) followed
by one QAM update of the fine policy against DIVL's critic. Offline it reads a
fixed snapshot with n-step chunk backups; online it mixes offline windows with
windows from fleet episodes recorded since, with 1-step backups (§2.2.9).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.algos.divl import DIVL, DIVLConfig
from robo_post.algos.qam import QAM, QAMConfig
from robo_post.learner.train import resolve_device, train_loop
from robo_post.models.critic import CriticConfig
from robo_post.models.flow import FlowPolicy
from robo_post.store import MixedSampler, PolicyRegistry, Snapshot, Store, WindowSampler


class DIVLQAM:
    """DIVL critic + QAM actor as one algorithm for ``train_loop``.

    Args:
        reference: the BC flow policy (frozen reference; the fine policy starts as a copy).
        divl: DIVL hyperparameters.
        qam: QAM hyperparameters.
        critic_warmup: learner steps that train only the critic before QAM starts.
        device: torch device.
    """

    def __init__(self, reference: FlowPolicy, divl: DIVLConfig, qam: QAMConfig, critic_warmup: int = 0,
                 device: torch.device | str = "cpu"):
        self.divl = DIVL(CriticConfig.like(reference.config), divl, device)
        for net in (self.divl.net, self.divl.target):  # the critic sees proprio standardised like the policy
            net.set_proprio_stats(reference.encoder.proprio_mean.cpu(), reference.encoder.proprio_std.cpu())
        self.qam = QAM(reference, qam, device)
        self.critic_warmup = critic_warmup
        self.updates = 0  # learner steps so far, across phases (train_loop restores it on resume)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"critic": self.divl.net, "critic_target": self.divl.target, "fine": self.qam.fine,
                "reference": self.qam.reference}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"value": self.divl.opt_v, "critic": self.divl.opt_q, "actor": self.qam.opt}

    def update(self, batch: dict[str, Any]) -> dict[str, float]:
        self.updates += 1
        metrics = self.divl.update(batch)
        if self.updates > self.critic_warmup:
            metrics.update(self.qam.update(batch, self.divl.critic_fn(self.qam.config.q_net)))
        return metrics


def _sampler(snap: Snapshot, episodes, cfg: DictConfig, n_step: int, device, seed: int) -> WindowSampler:
    return WindowSampler.from_snapshot(snap, episodes, horizon=cfg.horizon, n_step=n_step, gamma=cfg.gamma,
                                       device=device, seed=seed)


def _publish(store: Store, algo: DIVLQAM, parent: int, snap_id: str, phase: str, cfg: DictConfig) -> int:
    weights, config = algo.qam.fine.artifact(
        algorithm="divl_qam", phase=phase, parent_version=parent, snapshot=snap_id,
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    return PolicyRegistry(store.root).publish(weights, config)


def build(store: Store, cfg: DictConfig, device) -> tuple[DIVLQAM, int]:
    """The learner, starting from the reference policy version ``cfg.reference_version``."""
    registry = PolicyRegistry(store.root)
    reference_version = cfg.reference_version or registry.versions()[0]
    reference = FlowPolicy.from_artifact(*registry.load(reference_version), device=str(device))
    divl = DIVLConfig(**OmegaConf.to_container(cfg.divl, resolve=True))
    qam = QAMConfig(**OmegaConf.to_container(cfg.qam, resolve=True))
    return DIVLQAM(reference, divl, qam, cfg.critic_warmup, device), reference_version


def offline(store_root: str, run_dir: str, cfg: DictConfig) -> dict[str, Any]:
    """Offline DIVL+QAM on every episode of a snapshot (demos, failures, play); publishes the fine policy."""
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    store = Store.open(store_root)
    snap = store.snapshot()
    algo, parent = build(store, cfg, device)
    sampler = _sampler(snap, None, cfg, cfg.offline.n_step, device, cfg.seed)
    t0 = time.perf_counter()
    logged = train_loop(algo, lambda: sampler.sample(cfg.batch_size), run_dir, cfg.offline.updates,
                        {"sampler": sampler.rng}, log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every,
                        show=cfg.show)
    version = _publish(store, algo, parent, snap.id, "offline", cfg)
    summary = {"version": version, "parent_version": parent, "snapshot": snap.id, "episodes": len(snap),
               "wall_s": time.perf_counter() - t0, "final": logged[-1] if logged else {}}
    _write_json(os.path.join(run_dir, "summary.json"), summary)
    return summary


def online_round(store_root: str, run_dir: str, cfg: DictConfig, offline_snapshot: str, round_index: int) -> dict:
    """One online round: resume the learner, mix offline data with fleet episodes recorded
    since the offline snapshot, run ``cfg.online.updates`` updates, publish a version."""
    device = resolve_device(cfg.device)
    store = Store.open(store_root)
    base = store.snapshot(offline_snapshot)
    snap = store.snapshot()
    online_eps = [e for e in snap.new_since(base) if e.client_id.startswith(cfg.online.client_prefix)]
    algo, parent = build(store, cfg, device)
    algo.divl.set_stage("online")
    offline_sampler = _sampler(base, None, cfg, cfg.online.n_step, device, cfg.seed)
    online_sampler = _sampler(snap, online_eps, cfg, cfg.online.n_step, device, cfg.seed + 1)
    mixed = MixedSampler(offline_sampler, online_sampler, cfg.online.online_fraction)
    # The learner continues from the previous phase's checkpoint (networks, optimisers, RNG).
    total = cfg.offline.updates + (round_index + 1) * cfg.online.updates
    t0 = time.perf_counter()
    logged = train_loop(algo, lambda: mixed.sample(cfg.batch_size), run_dir, total,
                        {"offline": offline_sampler.rng, "online": online_sampler.rng},
                        log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every, show=cfg.show)
    latest = PolicyRegistry(store.root).latest()
    version = _publish(store, algo, latest, snap.id, f"online-{round_index}", cfg)
    summary = {"version": version, "parent_version": latest, "snapshot": snap.id, "online_episodes": len(online_eps),
               "wall_s": time.perf_counter() - t0, "final": logged[-1] if logged else {}}
    _write_json(os.path.join(run_dir, f"online-{round_index}.json"), summary)
    return summary


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
