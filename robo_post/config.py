"""Hydra configs packaged with robo-post (``robo_post.configs``), composed without a CLI."""

from __future__ import annotations

import importlib.resources

from omegaconf import DictConfig


def compose(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with hydra ``overrides`` (``key=value`` strings)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = str(importlib.resources.files("robo_post.configs"))
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)
