"""Full integrity scan of a store (``robo-post store validate``)."""

from __future__ import annotations

import json

from robo_post.store.registry import PolicyRegistry
from robo_post.store.schema import ROLES, EpisodeValidationError, StoreError, StoreIntegrityError, validate_array
from robo_post.store.store import Store
from robo_post.store.writer import episode_checksum


class EpisodeDataError(StoreIntegrityError):
    """A committed episode's data is unreadable or fails its checksum.

    Attributes:
        shard: the shard.
        episode: the episode's index in the shard.
        trailing: every episode from this one to the shard's last one fails too, the
            pattern an OS crash or power loss leaves behind a writer with ``fsync=False``.
    """

    def __init__(self, shard: str, episode: int, n_episodes: int, trailing: bool, reason: str):
        self.shard, self.episode, self.trailing = shard, episode, trailing
        message = f"{shard}/{episode}: {reason}"
        if trailing:
            which = "it is the shard's last episode" if episode == n_episodes - 1 else (
                f"so do all the shard's last {n_episodes - episode} episodes ({episode}..{n_episodes - 1})"
            )
            message += (
                f"; {which}: the data likely never reached the disk"
                " (OS crash or power loss while written with fsync=False)"
            )
        else:
            message += " (data changed after commit)"
        super().__init__(message)


def validate_store(root: str) -> tuple[int, list[str]]:
    """Re-read and re-check everything committed in the store at ``root``.

    Returns ``(episodes_checked, problems)``; an empty problem list means healthy.
    Checks: schema, commit records vs. metadata, contiguous row ranges, array
    extents, per-episode checksum, schema constraints on every row (extras too),
    known episode roles, and that every published policy has loadable weights and
    config. An episode that is unreadable
    or fails its checksum is reported as an ``EpisodeDataError`` (naming shard and
    episode index, and whether the shard's trailing episodes all fail).
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
            if ep.role not in ROLES:
                problems.append(f"{ep.key}: unknown role {ep.role!r}")
            steps += ep.length
            objs += ep.length + 1
        try:
            data = snap.load_shard(shard)
        except Exception:  # any zarr/codec failure means unreadable data: find which episodes
            data = None
        if data is not None and min(len(a) for a in (data["action"], data["step"], *data["extras"].values())) < steps:
            problems.append(f"shard {shard}: arrays shorter than committed steps")
            continue
        bad: dict[int, str] = {}
        for ep in eps:
            T, s0, o0 = ep.length, ep.step_start, ep.obs_start
            if data is None:
                ranges = {f"obs/{k}": (o0, o0 + T + 1) for k in schema.observations}
                ranges.update(action=(s0, s0 + T), step=(s0, s0 + T))
                ranges.update({f"extras/{k}": (s0, s0 + T) for k in schema.extras})
                try:
                    arrays = {name: snap._read(shard, name, lo, hi) for name, (lo, hi) in ranges.items()}
                except Exception as e:
                    bad[ep.episode] = f"arrays unreadable: {e}"
                    continue
            else:
                arrays = {f"obs/{k}": data["obs"][k][o0 : o0 + T + 1] for k in schema.observations}
                arrays["action"] = data["action"][s0 : s0 + T]
                arrays["step"] = data["step"][s0 : s0 + T]
                arrays.update({f"extras/{k}": data["extras"][k][s0 : s0 + T] for k in schema.extras})
            if episode_checksum(arrays) != ep.checksum:
                bad[ep.episode] = "checksum mismatch"
                continue
            try:
                for k, spec in schema.observations.items():
                    validate_array(f"obs/{k}", arrays[f"obs/{k}"], spec, T + 1)
                validate_array("action", arrays["action"], schema.action, T)
                for k, spec in schema.extras.items():
                    validate_array(f"extras/{k}", arrays[f"extras/{k}"], spec, T)
            except EpisodeValidationError as e:
                problems.append(f"{ep.key}: {e}")
            checked += 1
        # The longest run of failing episodes that ends with the shard's last one.
        first_trailing = len(eps)
        while first_trailing > 0 and first_trailing - 1 in bad:
            first_trailing -= 1
        for index, reason in bad.items():
            if index < first_trailing:
                problems.append(str(EpisodeDataError(shard, index, len(eps), False, reason)))
        if first_trailing < len(eps):
            problems.append(str(EpisodeDataError(shard, first_trailing, len(eps), True, bad[first_trailing])))
    registry = PolicyRegistry(store.root)
    for version in registry.versions():
        try:
            registry.load(version)
        except (StoreError, OSError, ValueError, json.JSONDecodeError) as e:
            problems.append(f"policy v{version}: {e}")
    return checked, problems
