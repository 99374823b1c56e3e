"""`robo-post collect`: record episodes from a fleet of simulated clients into the store."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from robo_post.envs.registry import EnvSpec, NoExpertError, UnknownExpertModeError, env_spec
from robo_post.fleet.client import ClientConfig, Overseer, recorded_env_kwargs, store_schema
from robo_post.fleet.launcher import LocalLauncher, RayLauncher, raise_unfinished
from robo_post.store import PolicyNotFoundError, PolicyRegistry, ShardLockedError, Store, StoreError
from robo_post.store.integrity import warn_lost_shards
from robo_post.store.schema import BARE_OBS_ATTR, infer_role
from robo_post.store.writer import lock_shard
from robo_post.utils.io import host_dir, is_object_url, try_lock


def env_config(cfg: DictConfig) -> tuple[dict[str, Any], list[str]]:
    """``(env, tasks)`` of a config's ``env`` group: the ``ClientConfig.env`` dict and the
    tasks (``[]`` when ``env.tasks`` is null: the env's default tasks). Without an env name
    (``env=store``), the env ``cfg.store`` was recorded in, with the kwargs its episodes were
    recorded with under the given ones.

    Raises:
        ValueError: no env name and no store that names its env.
    """
    given = OmegaConf.to_container(cfg.env.kwargs, resolve=True) or {}
    if cfg.env.name is not None:
        return {"name": cfg.env.name, **given}, list(cfg.env.tasks or [])
    recorded_in = None
    if os.path.exists(os.path.join(cfg.store, "store.json")):
        recorded_in = Store.open(cfg.store).schema.attrs.get("env")
    if recorded_in is None:
        raise ValueError(f"env=store collects in the env the store was recorded in, but {cfg.store} "
                         f"{'names none' if os.path.exists(cfg.store) else 'does not exist'}: give env=NAME")
    recorded = recorded_env_kwargs(cfg.store, env_spec(recorded_in)) or {}
    return {"name": recorded_in, **recorded, **given}, list(cfg.env.tasks or [])


def fleet_role(fleet: DictConfig) -> str:
    """``fleet.role``, else the role the client prefix names (``demo``, ``play``, ``deploy``,
    ``online``, ``eval``), else ``other``."""
    return fleet.get("role") or infer_role(f"{fleet.client_prefix}-")


def client_configs(cfg: DictConfig, store: Store) -> list[ClientConfig]:
    """Split ``cfg.episodes`` new episodes over ``cfg.fleet.n_clients`` clients."""
    fleet = cfg.fleet
    if fleet.layout_repeats < 1:
        raise ValueError(f"fleet.layout_repeats must be >= 1, got {fleet.layout_repeats}")
    env, tasks = env_config(cfg)
    role = fleet_role(fleet)
    per_client = math.ceil(cfg.episodes / fleet.n_clients)
    configs = []
    for i in range(fleet.n_clients):
        client_id = f"{fleet.client_prefix}-{i}"
        already = store.read_commit(client_id)["episodes"]
        configs.append(
            ClientConfig(
                store=store.root,
                client_id=client_id,
                episodes=already + min(per_client, max(cfg.episodes - i * per_client, 0)),
                env=env,
                tasks=tasks,
                policy=OmegaConf.to_container(cfg.policy, resolve=True),
                follow_registry=fleet.follow_registry,
                layout_repeats=fleet.layout_repeats,
                overseer=OmegaConf.to_container(fleet.overseer, resolve=True),
                seed=cfg.seed,
                role=role,
                policy_version=fleet.get("policy_version"),
            )
        )
    return configs


class CollectSettingsError(ValueError):
    """A collect setting every client would fail on (a negative seed, a missing SB3 zip)."""


def check_env_supports(cfg: DictConfig, spec: EnvSpec) -> None:
    """Refuse, before the store or any client is made, what every client would crash on, restart
    and crash again: a scripted expert or an overseer the env's registry entry does not have, a
    negative seed, an SB3 policy without its zip, a pinned version the store does not hold.

    Raises:
        NoExpertError: ``policy=expert`` (the default) with nothing published to run instead.
        UnknownExpertModeError: a ``policy.mode`` the env's expert does not have.
        OverseerUnsupportedError: ``fleet.overseer.enabled`` for an env without an overseer.
        CollectSettingsError: a negative ``seed``; ``policy=sb3`` whose ``policy.path`` is unset or no file.
        PolicyNotFoundError: ``fleet.policy_version`` not published in the store (or unreadable).
    """
    fleet = cfg.fleet
    if fleet.overseer.enabled:
        Overseer(spec, **OmegaConf.to_container(fleet.overseer, resolve=True))
    if cfg.seed < 0:  # episode seeds derive from it; gymnasium takes non-negative seeds only
        raise CollectSettingsError(f"seed={cfg.seed}: seeds must be >= 0")
    policies = os.path.join(str(cfg.store), "policies")
    # no registry yet: nothing published (and PolicyRegistry would create its folder)
    registry = PolicyRegistry(str(cfg.store)) if is_object_url(str(cfg.store)) or os.path.isdir(policies) else None
    published = registry.versions() if registry is not None else []
    if (pinned := fleet.get("policy_version")) is not None:  # each client would fail loading it, and restart
        if pinned not in published:
            raise PolicyNotFoundError(f"fleet.policy_version={pinned} is not published in {policies}; "
                                      f"published: {published or 'none'}")
        registry.load(pinned)  # a damaged version: its typed error, once
    # following the registry, the clients run the given policy until a version is published
    runs_expert = pinned is None and (not fleet.follow_registry or not published)
    if cfg.policy.kind == "sb3" and runs_expert:
        if OmegaConf.is_missing(cfg.policy, "path"):
            raise CollectSettingsError("policy=sb3 needs policy.path=AGENT.zip (the zip SB3's save wrote)")
        path = str(cfg.policy.path)
        if not (os.path.isfile(path) or os.path.isfile(f"{path}.zip")):  # SB3's load adds .zip when missing
            raise CollectSettingsError(f"policy.path={path}: no such file")
    if cfg.policy.kind != "expert" or not runs_expert:
        return
    if spec.expert is None:
        way_out = (f", and nothing is published in {policies} yet for fleet.follow_registry=true to run: the "
                   "clients would run the expert until a version is; collect with another policy (policy=random)"
                   if fleet.follow_registry else "; collect with another policy (policy=random) or run a published "
                   "version (fleet.follow_registry=true)")
        raise NoExpertError(f"env {spec.key!r} has no scripted expert{way_out}")
    if (mode := cfg.policy.get("mode", "expert")) not in spec.expert_modes:
        raise UnknownExpertModeError(f"env {spec.key!r}: its expert has no mode {mode!r}; "
                                     f"modes: {', '.join(spec.expert_modes)}")


def check_launcher(cfg: DictConfig) -> None:
    """Refuse launcher settings ``make_launcher`` cannot use, before anything is written."""
    if cfg.fleet.launcher not in ("local", "ray"):
        raise ValueError(f"unknown fleet.launcher {cfg.fleet.launcher!r}; expected local or ray")
    if cfg.fleet.launcher == "ray" and "address" not in cfg.fleet:
        raise ValueError("fleet.launcher=ray alone lacks the Ray settings (fleet.address, fleet.num_cpus): "
                         "select the Ray fleet with fleet=ray")


def make_launcher(cfg: DictConfig, configs: list[ClientConfig]):
    check_launcher(cfg)
    if cfg.fleet.launcher == "ray":
        return RayLauncher(configs, cfg.fleet.max_restarts, cfg.fleet.address, cfg.fleet.num_cpus)
    return LocalLauncher(configs, cfg.fleet.max_restarts)


def collect(cfg: DictConfig) -> list[dict[str, Any]]:
    """Create the store if needed, run the fleet to completion, return client statuses.

    Raises:
        FleetError: a client did not reach its target.
    """
    check_launcher(cfg)
    env, tasks = env_config(cfg)
    check_env_supports(cfg, env_spec(env["name"]))
    schema = store_schema(env, tasks[0] if tasks else None)
    if os.path.exists(os.path.join(cfg.store, "store.json")):
        stored = Store.open(cfg.store).schema
        if stored.extras and not stored.layout_differences(dataclasses.replace(schema, extras=stored.extras)):
            # a store that also records per-step extras (a steering deployment's distributions,
            # CRAFT's candidate scores): clients record them from what the policy and the env report
            schema = dataclasses.replace(schema, extras=stored.extras)
        bare = stored.attrs.get(BARE_OBS_ATTR)
        if bare is not None and list(schema.observations) == [bare]:
            # an imported dataset's bare observation space (Minari export writes it bare again): the fleet
            # records the same rows under the same key
            schema = dataclasses.replace(schema, attrs={**schema.attrs, BARE_OBS_ATTR: bare})
        spec = env_spec(env["name"])
        recorded = recorded_env_kwargs(cfg.store, spec) or {}
        # the instruction split is each collect's own (recorded_env_kwargs leaves it out too)
        given = {k: v for k, v in env.items() if k not in ("name", spec.split_kwarg)}
        rows_differ = any(line.startswith(("observations[", "action"))
                          for line in stored.layout_differences(dataclasses.replace(schema, extras=stored.extras)))
        if recorded and given != recorded:
            needed = " ".join(f"+env.kwargs.{k}={json.dumps(v)}" for k, v in recorded.items())
            if rows_differ:
                raise StoreError(f"{cfg.store} was recorded in env {env['name']!r} with kwargs {recorded}, and this "
                                 f"env ({env}) records other observations or actions; collect with them: {needed}")
            print(f"warning: {cfg.store} was recorded with env kwargs {recorded}, these episodes with {given}: "
                  f"eval then runs the env's defaults for the kwargs they disagree on ({needed} records them "
                  "alike)", file=sys.stderr)
    store = Store.create(cfg.store, schema, exist_ok=True)
    warn_lost_shards(store.root, "recording on")
    # Another collect with the same client ids counts from the same commits, so its clients
    # would take this one's episodes for their own: held from before the targets are read.
    held = lock_client_ids(store.root, cfg.fleet.client_prefix)
    try:
        configs = client_configs(cfg, store)
        for config in configs:  # clients still writing (of a collect killed a moment ago)
            shard = os.path.join(store.root, "shards", config.client_id)
            if os.path.isdir(shard):
                try:
                    os.close(lock_shard(shard, config.client_id))
                except ShardLockedError as e:
                    raise ShardLockedError(f"{e} (another collect into {store.root}?): nothing was recorded; give "
                                           "this one its own fleet.client_prefix") from None
        statuses = make_launcher(cfg, configs).run(show=cfg.show)
    finally:
        os.close(held)
    raise_unfinished(statuses, "fleet clients", store.root)
    return statuses


def lock_client_ids(root: str, prefix: str, refused: str | None = None) -> int:
    """Take the lock of the client ids ``prefix-*`` in store ``root`` (held by whoever runs
    clients with that prefix into it: a collect, a CRAFT run); returns its descriptor.

    Raises:
        ShardLockedError: another holds it; ``refused`` is the message (default: a collect's).
    """
    os.makedirs(host_dir(root, "fleet"), exist_ok=True)
    message = refused or (f"another collect with fleet.client_prefix={prefix} is running into {root}: nothing was "
                          "recorded; wait for it, or give this one its own fleet.client_prefix")
    return try_lock(os.path.join(host_dir(root, "fleet"), f".collect-{prefix}.lock"), lambda: ShardLockedError(message))
