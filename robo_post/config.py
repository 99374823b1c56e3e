"""Hydra configs packaged with robo-post (``robo_post.configs``), composed without a CLI."""

from __future__ import annotations

import importlib.resources
import os
from typing import Any

from omegaconf import DictConfig


def compose(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with hydra ``overrides`` (``key=value`` strings)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = str(importlib.resources.files("robo_post.configs"))
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)


# Settings (at any level: `lwd.show`) that change what is printed or logged, not what a job produces.
DISPLAY_SETTINGS = ("show", "tracking")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{dotted.key: leaf}`` (an empty dict is a leaf)."""
    if not (isinstance(node, dict) and node):
        return {prefix: node}
    return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}.{key}" if prefix else key).items()}


def _is_path(key: str) -> bool:
    """Whether a dotted setting names a folder (``store``, ``run_dir``, ``algo.online_store``, ...)."""
    name = key.rpartition(".")[2]
    return name in ("store", "run_dir") or name.endswith(("_store", "_dir"))


def _is_url(value: str) -> bool:
    """A store on object storage (``s3://bucket/prefix``): a location, not a folder to resolve."""
    return "://" in value


def absolute_paths(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a resolved container) with every folder setting made absolute, as a run
    records it: resumed from another directory, or with ``./s`` for ``s``, it names the same folders
    (object-storage URLs stay as given)."""
    def walk(node: Any, prefix: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{prefix}.{k}" if prefix else k) for k, v in node.items()}
        return os.path.abspath(node) if isinstance(node, str) and _is_path(prefix) and not _is_url(node) else node
    return walk(config, "")


def changed_settings(recorded: dict[str, Any], given: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted.key: (recorded, given)}`` for every setting two resolved configs differ in,
    display settings (``DISPLAY_SETTINGS``) left out; folders are compared as resolved paths."""
    def settings(node: Any) -> dict[str, Any]:
        return {k: os.path.realpath(v) if isinstance(v, str) and _is_path(k) and not _is_url(v) else v
                for k, v in _flat(node).items()
                if not set(k.split(".")) & set(DISPLAY_SETTINGS)}

    old, new = settings(recorded), settings(given)
    # A key set to None on one side and absent on the other differs (``model.features={goal: null}``
    # against the default ``features: null``); it is shown as None.
    absent = object()
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())
            if old.get(k, absent) != new.get(k, absent)}


def describe_changes(changed: dict[str, tuple[Any, Any]], limit: int | None = 5) -> str:
    """``key: old -> new, ...`` for a ``changed_settings`` result, the first ``limit`` of them."""
    items = list(changed.items())
    shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in items[:limit])
    return shown + (", ..." if limit is not None and len(items) > limit else "")


def check_dir_path(key: str, path: str) -> None:
    """Refuse setting ``key=path`` where ``path`` is a file: a job writing its folder there would
    fail deep inside with an errno that names neither the setting nor the way out."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{key}={path} is a file, not a directory: give the job a directory of its own")
