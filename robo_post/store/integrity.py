"""Full integrity scan of a store (``robo-post store validate``)."""

from __future__ import annotations

import json

from robo_post.store.registry import PolicyRegistry
from robo_post.store.schema import EpisodeValidationError, StoreError, validate_array
from robo_post.store.store import Store
from robo_post.store.writer import episode_checksum


def validate_store(root: str) -> tuple[int, list[str]]:
    """Re-read and re-check everything committed in the store at ``root``.

    Returns ``(episodes_checked, problems)``; an empty problem list means healthy.
    Checks: schema, commit records vs. metadata, contiguous row ranges, array
    extents, per-episode checksum, schema constraints on every row, and that every
    published policy has loadable weights and config.
    """
    try:
        store = Store.open(root)
        snap = store.snapshot()
    except (StoreError, OSError, ValueError, KeyError) as e:
        return 0, [f"cannot open store: {e}"]
    problems: list[str] = []
    checked = 0
    schema = store.schema
    by_shard: dict[str, list] = {}
    for ep in snap:
        by_shard.setdefault(ep.client_id, []).append(ep)
    for shard, eps in by_shard.items():
        steps = objs = 0
        for i, ep in enumerate(eps):
            if ep.episode != i or ep.step_start != steps or ep.obs_start != objs:
                problems.append(f"{ep.key}: row ranges not contiguous")
            steps += ep.length
            objs += ep.length + 1
        try:
            data = snap.load_shard(shard)
        except Exception as e:  # any zarr/codec failure means unreadable data
            problems.append(f"shard {shard}: arrays unreadable: {e}")
            continue
        if len(data["action"]) < steps or len(data["step"]) < steps:
            problems.append(f"shard {shard}: arrays shorter than committed steps")
            continue
        for ep in eps:
            T, s0, o0 = ep.length, ep.step_start, ep.obs_start
            arrays = {f"obs/{k}": data["obs"][k][o0 : o0 + T + 1] for k in schema.observations}
            arrays["action"] = data["action"][s0 : s0 + T]
            arrays["step"] = data["step"][s0 : s0 + T]
            if episode_checksum(arrays, ep.checksum_kind) != ep.checksum:
                problems.append(f"{ep.key}: checksum mismatch (data changed after commit)")
                continue
            try:
                for k, spec in schema.observations.items():
                    validate_array(f"obs/{k}", arrays[f"obs/{k}"], spec, T + 1)
                validate_array("action", arrays["action"], schema.action, T)
            except EpisodeValidationError as e:
                problems.append(f"{ep.key}: {e}")
            checked += 1
    registry = PolicyRegistry(store.root)
    for version in registry.versions():
        try:
            registry.load(version)
        except (StoreError, OSError, ValueError, json.JSONDecodeError) as e:
            problems.append(f"policy v{version}: {e}")
    return checked, problems
