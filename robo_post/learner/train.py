"""`robo-post train`: train a registered method (``algo=``) and publish its policy."""

from __future__ import annotations

import os
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from robo_post.algos.registry import MethodSpec, method_spec
from robo_post.learner import craft_driver
from robo_post.learner.drivers import off_policy
from robo_post.learner.runs import run_lock
from robo_post.learner.sb3_driver import sb3
from robo_post.store.integrity import warn_lost_shards
from robo_post.store.registry import PolicyRegistry

# The loops methods run in, by the name a method's spec gives (``MethodSpec.driver``).
DRIVERS: dict[str, Callable[[DictConfig, MethodSpec], dict[str, Any]]] = {
    "off_policy": off_policy, "sb3": sb3, "craft": craft_driver.craft}
# check(config, env) raises when a driver cannot train a method's typed config in ``env`` (the key
# a store records); `robo-post run` calls it before it records any data.
ENV_CHECKS: dict[str, Callable[[Any, str], None]] = {"craft": craft_driver.check_env}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.algo.name`` with the driver it registered; returns the driver's summary."""
    spec = method_spec(cfg.algo.name)
    if spec.driver not in DRIVERS:
        raise ValueError(f"algo={spec.name} runs with driver {spec.driver!r}, which is not registered; "
                         f"drivers: {sorted(DRIVERS)}")
    if os.path.exists(os.path.join(cfg.store, "store.json")):  # a missing store is the driver's error to name
        PolicyRegistry(cfg.store).check_writable()
        warn_lost_shards(cfg.store, "training on the rest")
    with run_lock(cfg.run_dir):
        return DRIVERS[spec.driver](cfg, spec)


def check_env(algo: DictConfig, env: str) -> None:
    """Raise when method ``algo.name`` with settings ``algo`` cannot train in ``env``: the check
    its driver registered, if any (e.g. CRAFT needs per-step events)."""
    spec = method_spec(algo.name)
    check = ENV_CHECKS.get(spec.driver)
    if check is not None:
        values = OmegaConf.to_container(algo, resolve=True)
        check(spec.make_config({k: v for k, v in values.items() if k != "name"}), env)
