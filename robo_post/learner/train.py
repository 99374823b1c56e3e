"""`robo-post train`: train a registered method (``algo=``) and publish its policy."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from robo_post.algos.registry import method_spec
from robo_post.learner import craft_driver  # noqa: F401  (registers the `craft` driver)
from robo_post.learner.drivers import DRIVERS
from robo_post.store.registry import PolicyRegistry


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run ``cfg.algo.name`` with the driver it registered; returns the driver's summary."""
    spec = method_spec(cfg.algo.name)
    if spec.driver not in DRIVERS:
        raise ValueError(f"algo={spec.name} runs with driver {spec.driver!r}, which is not registered; "
                         f"drivers: {sorted(DRIVERS)}")
    if os.path.exists(os.path.join(cfg.store, "store.json")):  # a missing store is the driver's error to name
        PolicyRegistry(cfg.store).check_writable()
    return DRIVERS[spec.driver](cfg, spec)
