"""Export store snapshots to Minari datasets and import Minari datasets into a store.

Where robo-post data lives inside a Minari dataset (all of it round-trips exactly):

- observations (T + 1 rows, row T = final observation), actions, rewards,
  terminations, truncations: Minari's own arrays. Images are stored raw
  (``jpeg_encoding=False``); Minari's default JPEG encoding is lossy.
- the per-step columns Minari lacks (policy_version, intervention, timestamp,
  behavior_logprob) and the schema's extras (``infos["robo_post"]["extras"]``):
  ``infos["robo_post"]``, the only per-step extra data Minari stores. Infos have
  the T + 1 rows of the observations (DataCollector's convention, and required
  by Minari's arrow format): row t describes action t, row T repeats row T - 1.
  Infos survive ``minari.combine_datasets``; the per-episode metadata and seeds
  below do not (Minari drops them there).
- per-episode metadata: the episode's Minari metadata, as one JSON string under
  ``"robo_post"`` (HDF5 attributes cannot hold None, lists or dicts; a JSON
  string keeps every value and type exactly). The seed is also written as
  Minari's native ``seed`` when it fits int64, for Minari users.
- the store schema (units, bounds, attrs): dataset ``metadata.json`` under
  ``"robo_post"``, so importing our own export recreates the identical schema.

Integer actions are exported as a Discrete (scalar) or MultiDiscrete space.

Foreign datasets need a Dict of Box/Discrete (or a bare Box/Discrete) observation
space and a Box, Discrete or MultiDiscrete action space; their infos are not
imported. Their episodes carry no robo-post success label, so importing one needs
an explicit success rule (``SUCCESS_RULES``); it is recorded in each episode's
``attrs["success_rule"]``.

Every imported episode records where it came from in ``attrs["imported_from"]``
(dataset id and episode index), so importing a dataset again, or after an import
that was killed or failed part way, adds only the episodes the store lacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import types
import uuid
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import gymnasium as gym
import minari
import numpy as np
from minari.data_collector import EpisodeBuffer
from minari.dataset.minari_dataset import parse_dataset_id
from minari.storage import get_dataset_path

from robo_post.store.convert import (SOURCE_ATTR, SuccessRuleError, episode_import, import_lock,
                                     remove_dead_exports, warn_relabel)
from robo_post.store.schema import (
    BARE_OBS_ATTR,
    BARE_OBS_KEY,
    ArraySpec,
    StoreError,
    StoreNotFoundError,
    StoreSchema,
    infer_role,
)
from robo_post.store.store import EpisodeInfo, Snapshot, Store, remove_empty_store
from robo_post.store.writer import ShardWriter
from robo_post.utils.io import try_lock

# Step columns carried in infos["robo_post"]; the other three are Minari arrays.
INFO_COLUMNS = {
    "policy_version": np.int64,
    "intervention": np.bool_,
    "timestamp": np.float64,
    "behavior_logprob": np.float64,
}
META_KEY = "robo_post"
_WRITE_ARG = {name: f"{name}s" for name in INFO_COLUMNS}  # write_episode's plural kwargs


# How an imported episode's success is decided (``import_minari(success_from=...)``).
SUCCESS_RULES = {
    "termination": "the last step terminated",
    "truncation": "the last step was truncated",
    "info:KEY": "the last step's info[KEY] is truthy",
    "return>=X": "the episode's return is at least the number X",
    "none": "success unknown (None)",
}


@dataclasses.dataclass(frozen=True)
class MinariImport:
    """What ``import_minari`` did: episodes appended, episodes skipped as the store already held
    them, and (with ``skip_invalid``) the dataset's episodes refused: ``(index, reason)``."""

    imported: int
    skipped: int
    invalid: tuple[tuple[int, str], ...] = ()


class UnsupportedSpaceError(StoreError, ValueError):
    """A Minari dataset's spaces cannot be represented in a robo-post store."""


def _rules_help() -> str:
    return "; ".join(f"{rule!r}: {meaning}" for rule, meaning in SUCCESS_RULES.items())


def success_rule(rule: str) -> Callable[[Any], bool | None]:
    """The function deciding a Minari episode's success under ``rule`` (see
    ``SUCCESS_RULES``); ``SuccessRuleError`` naming a malformed rule."""
    if rule == "termination":
        return lambda episode: bool(episode.terminations[-1])
    if rule == "truncation":
        return lambda episode: bool(episode.truncations[-1])
    if rule == "none":
        return lambda episode: None
    if rule.startswith("info:") and len(rule) > len("info:"):
        key = rule[len("info:") :]

        def from_info(episode) -> bool:
            infos = episode.infos or {}
            if key not in infos:
                raise SuccessRuleError(f"success rule {rule!r}: episode {episode.id} has no info {key!r}")
            return bool(np.asarray(infos[key])[-1])  # row T: the info of the last step

        return from_info
    if rule.startswith("return>="):
        try:
            threshold = float(rule[len("return>=") :])
        except ValueError:
            threshold = float("nan")
        if np.isfinite(threshold):
            return lambda episode: bool(np.sum(episode.rewards, dtype=np.float64) >= threshold)
    raise SuccessRuleError(f"bad success rule {rule!r}; use one of: {_rules_help()}")


def stored_success(rule: str, episode: EpisodeInfo) -> bool | None:
    """``rule`` applied to an episode already in a store (an ``EpisodeInfo``: how it ended and its
    return). A store keeps no infos nor features, so an ``info:KEY`` rule (or a LeRobot import's
    ``feature:KEY``) gives None; an episode that did not terminate was truncated."""
    if rule.startswith(("info:", "feature:")):
        return None
    ended = types.SimpleNamespace(id=episode.key, terminations=[episode.terminated],
                                  truncations=[not episode.terminated], rewards=[episode.ret], infos={})
    return success_rule(rule)(ended)


def imported_rule(episodes: Iterable[EpisodeInfo]) -> str | None:
    """The success rule ``episodes`` were imported with, when every imported one shares it."""
    rules = {e.attrs["success_rule"] for e in episodes if "success_rule" in e.attrs}
    return rules.pop() if len(rules) == 1 else None


@contextlib.contextmanager
def _datasets_path(minari_root: str | os.PathLike | None) -> Iterator[None]:
    """Point Minari at ``minari_root`` for the block (Minari only reads an env var).

    Not thread-safe: the variable is process-wide.
    """
    if minari_root is None:
        yield
        return
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = os.path.abspath(minari_root)
    try:
        yield
    finally:
        if old is None:
            del os.environ["MINARI_DATASETS_PATH"]
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def _check_dataset_id(dataset_id: str) -> None:
    try:
        parse_dataset_id(dataset_id)
    except (ValueError, TypeError):  # TypeError: id without "-vN"
        raise StoreError(f"bad Minari dataset id {dataset_id!r}: use (namespace/)name-vN") from None


def _action_space(spec: ArraySpec) -> gym.spaces.Space:
    """The gymnasium space of the store's actions: Discrete / MultiDiscrete for bounded
    integer actions, else a Box."""
    if np.dtype(spec.dtype).kind not in "iu" or spec.low is None or spec.high is None:
        return _box(spec)
    low = np.broadcast_to(np.asarray(spec.low, dtype=np.int64), spec.shape)
    high = np.broadcast_to(np.asarray(spec.high, dtype=np.int64), spec.shape)
    if spec.shape == ():
        return gym.spaces.Discrete(int(high - low + 1), start=int(low))
    return gym.spaces.MultiDiscrete(high - low + 1, start=low)


def _box(spec: ArraySpec) -> gym.spaces.Box:
    """The gymnasium Box of one store field; missing bounds span the dtype."""
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "f":
        lo, hi = -np.inf, np.inf
    elif dtype.kind == "b":
        lo, hi = False, True
    else:
        lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max  # uint8 -> Box(0, 255)
    lo = lo if spec.low is None else spec.low
    hi = hi if spec.high is None else spec.high
    return gym.spaces.Box(
        low=np.broadcast_to(np.asarray(lo, dtype=dtype), spec.shape),
        high=np.broadcast_to(np.asarray(hi, dtype=dtype), spec.shape),
        shape=spec.shape,
        dtype=dtype,
    )


def _episode_buffer(snapshot: Snapshot, info: EpisodeInfo, bare_key: str | None) -> tuple[EpisodeBuffer, dict]:
    """One episode as a Minari buffer, plus its Minari episode metadata."""
    data = snapshot.load(info)
    columns = {name: data[name].astype(dtype) for name, dtype in INFO_COLUMNS.items()}
    record = {
        "client_id": info.client_id,
        "episode": info.episode,
        "task_id": info.task_id,
        "instruction": info.instruction,
        "seed": info.seed,
        "success": info.success,
        "policy_version": info.policy_version,
        "start_time": info.start_time,
        "end_time": info.end_time,
        "attrs": info.attrs,
        "role": info.role,
    }
    infos = {k: np.concatenate([v, v[-1:]]) for k, v in columns.items()}
    if data["extras"]:
        infos["extras"] = {k: np.concatenate([v, v[-1:]]) for k, v in data["extras"].items()}
    buffer = EpisodeBuffer(
        seed=info.seed if info.seed is not None and -(2**63) <= info.seed < 2**63 else None,  # HDF5 attr limit
        observations=data["obs"][bare_key] if bare_key else data["obs"],
        actions=data["action"],
        rewards=data["reward"],
        terminations=data["terminated"],
        truncations=data["truncated"],
        infos={META_KEY: infos},
    )
    return buffer, {META_KEY: json.dumps(record, allow_nan=False)}


def _recorded_env(schema: StoreSchema, episodes: Sequence[EpisodeInfo], spaces: dict[str, gym.Space],
                  action_space: gym.Space) -> tuple[gym.envs.registration.EnvSpec | None, bool]:
    """(spec, bare) of the env the episodes were recorded in, so that Minari's ``recover_environment``
    makes it: the store's env when gymnasium knows its id, with the env kwargs every episode was
    recorded with, when that env's spaces are the exported ones; ``bare`` when its observation is
    the one Box the fleet stored under ``BARE_OBS_KEY`` (exported bare, as the env gives it)."""
    env_id = schema.attrs.get("env")
    try:
        spec = gym.spec(env_id) if env_id else None
    except gym.error.Error:
        spec = None
    if spec is None:
        return None, False
    recorded = [e.attrs.get("env_kwargs") or {} for e in episodes]
    agreed = {k: v for k, v in recorded[0].items() if all(k in r and r[k] == v for r in recorded)}
    max_steps = agreed.pop("max_episode_steps", spec.max_episode_steps)
    spec = dataclasses.replace(spec, kwargs={**spec.kwargs, **agreed}, max_episode_steps=max_steps)
    try:
        env = spec.make()
    except Exception:  # noqa: BLE001 (an env that cannot be made here has no spec to give)
        return None, False
    obs, act = env.observation_space, env.action_space
    env.close()
    bare = list(spaces) == [BARE_OBS_KEY] and obs == spaces[BARE_OBS_KEY]
    return (spec if act == action_space and (bare or obs == gym.spaces.Dict(spaces)) else None), bare


def export_minari(
    snapshot: Snapshot,
    dataset_id: str,
    episodes: Sequence[EpisodeInfo] | None = None,
    minari_root: str | os.PathLike | None = None,
) -> str:
    """Write episodes of ``snapshot`` as a new Minari dataset; return its directory.

    Args:
        snapshot: the store snapshot to read.
        dataset_id: Minari id, ``(namespace/)name-vN``; must not exist yet.
        episodes: which episodes (e.g. ``snapshot.episodes(task=...)``); default all.
        minari_root: datasets directory; default Minari's own
            (``$MINARI_DATASETS_PATH`` or ``~/.minari/datasets``).

    Raises:
        StoreError: bad or existing dataset id, or no episodes to export. The dataset
            appears whole or not at all, also when the export is killed.
    """
    _check_dataset_id(dataset_id)
    episodes = list(snapshot.episodes() if episodes is None else episodes)
    if not episodes:
        raise StoreError("no episodes to export")
    schema = snapshot.store.schema
    bare_key = schema.attrs.get(BARE_OBS_ATTR)
    spaces = {k: _box(s) for k, s in schema.observations.items()}
    env_spec, bare = _recorded_env(schema, episodes, spaces, _action_space(schema.action))
    bare_key = BARE_OBS_KEY if bare else bare_key
    obs_space = spaces[bare_key] if bare_key else gym.spaces.Dict(spaces)

    with _datasets_path(minari_root):
        root = str(get_dataset_path())
        path = str(get_dataset_path(dataset_id))
    if os.path.exists(path):
        raise StoreError(f"Minari dataset {dataset_id!r} already exists at {path}")
    # Minari writes in place: the dataset is built beside the datasets folder and renamed into
    # it whole, so a killed export leaves no partial dataset that reads as a complete one.
    remove_dead_exports(root)
    staging = f"{root.rstrip(os.sep)}.export-{uuid.uuid4().hex}"
    os.makedirs(staging)
    held = try_lock(staging, lambda: StoreError(f"{staging} is in use"))  # alive while this export runs
    with _datasets_path(staging):
        try:
            first, *rest = episodes
            buffer, meta = _episode_buffer(snapshot, first, bare_key)
            metas = [meta]
            with warnings.catch_warnings():
                # Minari nags about author/email/permalink/env metadata we do not have.
                warnings.filterwarnings("ignore", category=UserWarning, module=r"minari\.")
                dataset = minari.create_dataset_from_buffers(
                    dataset_id,
                    [buffer],
                    env=env_spec,
                    observation_space=obs_space,
                    action_space=_action_space(schema.action),
                    algorithm_name="robo-post",
                    description=f"exported from robo-post store {snapshot.store.root} snapshot {snapshot.id}",
                    jpeg_encoding=False,
                )
            # One episode at a time keeps memory flat for large snapshots.
            for info in rest:
                buffer, meta = _episode_buffer(snapshot, info, bare_key)
                dataset.update_dataset_from_buffer([buffer])
                metas.append(meta)
            dataset.storage.update_episode_metadata(metas, range(len(metas)))
            dataset.storage.update_metadata({META_KEY: {"schema": schema.to_json(), "snapshot": snapshot.id}})
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                os.rename(os.path.join(staging, dataset_id), path)  # fails if `path` appeared meanwhile
            except OSError:
                raise StoreError(f"Minari dataset {dataset_id!r} already exists at {path}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            os.close(held)
    return path


def _schema_from_spaces(dataset_id: str, observation_space: gym.Space, action_space: gym.Space) -> StoreSchema:
    """Store schema for a dataset's spaces, or ``UnsupportedSpaceError`` naming the culprit."""
    where = f"Minari dataset {dataset_id!r}"
    supported = (gym.spaces.Discrete, gym.spaces.MultiDiscrete)
    if not (isinstance(action_space, supported) or (isinstance(action_space, gym.spaces.Box) and action_space.dtype.kind in "fiu")):
        raise UnsupportedSpaceError(
            f"{where}: action space {action_space} unsupported; the store needs a Box, Discrete or MultiDiscrete"
        )
    if isinstance(action_space, gym.spaces.Box) and action_space.shape == ():
        raise UnsupportedSpaceError(f"{where}: action space {action_space} is a scalar Box; the store needs "
                                    "Box actions of shape (n,)")
    spaces = observation_space.spaces if isinstance(observation_space, gym.spaces.Dict) else {}
    for key, space in spaces.items():
        if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
            raise UnsupportedSpaceError(
                f"{where}: observation {key!r} is a nested {type(space).__name__} space; "
                "the store needs a flat Dict of Box/Discrete spaces"
            )
    try:
        return StoreSchema.from_spaces(observation_space, action_space)
    except StoreError:
        raise
    except ValueError as e:  # unsupported leaf space or dtype; the message names the key
        raise UnsupportedSpaceError(f"{where}: {e}") from None


def import_minari(
    dataset_id: str,
    store_root: str | os.PathLike,
    client_id: str | None = "minari",
    minari_root: str | os.PathLike | None = None,
    task_id: str | None = None,
    success_from: str | None = None,
    skip_invalid: bool = False,
) -> MinariImport:
    """Append the episodes of a Minari dataset that the store does not hold yet.

    The store is created if absent: with the exported schema for datasets written
    by ``export_minari``, else from the dataset's spaces. Every episode goes
    through ``ShardWriter.write_episode`` and is validated. Foreign episodes get
    role ``"imported"``; exported ones keep the role they were exported with (the
    one their shard's name gives if exported before roles were recorded). Each
    records its dataset and index in ``attrs["imported_from"]``; an episode the
    store already holds from the same dataset (any shard) is skipped, so an import
    can be rerun after a kill or a failure.

    Args:
        dataset_id: Minari id of a local dataset.
        store_root: store directory.
        client_id: shard to write; ``None`` restores each exported episode's
            original shard (``"minari"`` for foreign episodes).
        minari_root: datasets directory; default Minari's own.
        task_id: task of every episode; default the exported task, else ``dataset_id``.
        success_from: how to decide each episode's success, one of ``SUCCESS_RULES``
            (``termination``, ``truncation``, ``info:KEY``, ``return>=X``, ``none``).
            Required for foreign datasets; by default exported episodes keep their
            recorded success. A rule given is recorded in ``attrs["success_rule"]``.
        skip_invalid: import the other episodes when one fails validation (NaN, an
            action out of bounds, ...), listing it in ``MinariImport.invalid``; by
            default such an episode stops the import.

    Raises:
        SuccessRuleError: a foreign dataset and no rule, a malformed rule, or an
            ``info:KEY`` rule on episodes without that info.
        UnsupportedSpaceError: the dataset's spaces do not fit a store (names the key).
        StoreError: dataset not found, an episode fails validation (episodes
            before it stay committed), or an episode imported before from a
            dataset of the same id differs from the dataset's episode now.
    """
    _check_dataset_id(dataset_id)
    decide = None if success_from is None else success_rule(success_from)
    # Explicit root: join it ourselves, as get_dataset_path() creates missing roots.
    root = get_dataset_path(dataset_id) if minari_root is None else os.path.join(minari_root, dataset_id)
    path = os.path.join(root, "data")
    if not os.path.isdir(path):
        raise StoreError(f"no Minari dataset {dataset_id!r} at {path}: create it with Minari (a DataCollector or "
                         f"create_dataset_from_buffers), `minari download {dataset_id}` where Minari's server is "
                         "reachable, or point --minari-root at the folder that holds it")
    with _reading(dataset_id, path):  # before the store exists: a damaged dataset creates nothing
        dataset = minari.MinariDataset(path)
        metas = list(dataset.storage.get_episode_metadata(dataset.episode_indices))
        env_spec = dataset.spec.env_spec
        exported = dataset.storage.metadata.get(META_KEY)
    if not metas:
        raise StoreError(f"Minari dataset {dataset_id!r} at {path} holds no episodes")
    schema = _schema_from_spaces(dataset_id, dataset.observation_space, dataset.action_space)
    if env_spec is not None:  # the env the data came from: eval and chunk defaults find it by id
        schema = dataclasses.replace(schema, attrs={**schema.attrs, "env": env_spec.id})
    if exported is not None:
        schema = StoreSchema.from_json(exported["schema"])
    elif decide is None:
        # Never guess: terminating is success in one task and failure (a crash) in another.
        raise SuccessRuleError(
            f"Minari dataset {dataset_id!r} was not exported by robo-post, so its episodes carry no success label: "
            f"pass success_from (CLI: --success-from RULE), one of: {_rules_help()}"
        )
    existed = os.path.exists(store_root)
    try:
        store = Store.open(str(store_root))
        created = False
    except StoreNotFoundError:
        store = Store.create(str(store_root), schema)
        created = True
    # The env the data was recorded in, as eval rebuilds it (its step limit above all).
    env_kwargs = {**_json_safe(env_spec.kwargs), "max_episode_steps": env_spec.max_episode_steps} if (
        env_spec is not None and env_spec.max_episode_steps is not None) else None
    # A bare Box: a foreign dataset's, or the fleet's one observation exported as its env gives it.
    bare_key = schema.attrs.get(BARE_OBS_ATTR) or (
        None if isinstance(dataset.observation_space, gym.spaces.Dict) else BARE_OBS_KEY)
    n, invalid = 0, []
    with contextlib.ExitStack() as stack:
        # One import at a time per store: two imports of one dataset into different shards
        # would each find its episodes missing and both write them.
        stack.enter_context(import_lock(store.root))
        # A store this import created and left empty is removed (a foreign dataset's first
        # episode refused): the next try creates it afresh, with this dataset's schema.
        stack.callback(lambda: remove_empty_store(store.root, existed) if created and n == 0 else None)
        held = {}  # dataset index -> the episode imported from it
        for e in store.snapshot(verify=False, record=False):
            source = e.attrs.get(SOURCE_ATTR)
            if isinstance(source, dict) and source.get("dataset") == dataset_id:  # attrs are free-form: check the shape
                held[source.get("episode")] = e
        writers: dict[str, ShardWriter] = {}
        relabel: list[Any] = []  # the rules of held episodes that another rule would label otherwise
        episodes = dataset.iterate_episodes()
        for index, meta in zip(dataset.episode_indices, metas, strict=True):
            index = int(index)
            with episode_import(f"Minari dataset {dataset_id!r}", index, n, store_root, skip_invalid, invalid):
                with _reading(dataset_id, path):
                    episode = next(episodes)
                if index in held:
                    _check_same(held[index], episode)
                    if decide is not None and held[index].attrs.get("success_rule") != success_from:
                        relabel.append(held[index].attrs.get("success_rule"))
                    continue
                record = json.loads(meta[META_KEY]) if META_KEY in meta else {}
                shard = client_id if client_id is not None else record.get("client_id", "minari")
                if shard not in writers:
                    writers[shard] = stack.enter_context(store.writer(shard))
                extra = dict((episode.infos or {}).get(META_KEY, {}))
                extras = {k: np.asarray(v)[: len(episode)] for k, v in extra.pop("extras", {}).items()}
                columns = {_WRITE_ARG[k]: np.asarray(v)[: len(episode)] for k, v in extra.items() if k in _WRITE_ARG}
                attrs = {**(record.get("attrs") or {}), SOURCE_ATTR: {"dataset": dataset_id, "episode": index}}
                if env_kwargs is not None and exported is None:  # exported episodes carry their own
                    attrs["env_kwargs"] = env_kwargs
                if decide is not None:
                    success = decide(episode)
                    attrs["success_rule"] = success_from
                elif "success" in record:
                    success = record["success"]
                else:  # exported, but Minari dropped the episode metadata (e.g. combine_datasets)
                    raise SuccessRuleError(
                        f"episode {episode.id} of {dataset_id!r} has no recorded success: pass success_from, one of: "
                        f"{_rules_help()}"
                    )
                writers[shard].write_episode(
                    {bare_key: episode.observations} if bare_key else episode.observations,
                    episode.actions,
                    rewards=episode.rewards,
                    terminated=episode.terminations,
                    truncated=episode.truncations,
                    **columns,
                    task_id=task_id if task_id is not None else record.get("task_id", dataset_id),
                    instruction=record.get("instruction", ""),
                    seed=record["seed"] if "seed" in record else meta.get("seed"),
                    success=success,
                    policy_version=record.get("policy_version"),
                    start_time=record.get("start_time"),
                    end_time=record.get("end_time"),
                    attrs=attrs,
                    extras=extras,
                    # Exported before roles were recorded: the role its shard's name gave it.
                    role=record.get("role") or (infer_role(record["client_id"]) if "client_id" in record else "imported"),
                )
                n += 1
    warn_relabel(relabel, repr(dataset_id), store_root, success_from)
    return MinariImport(imported=n, skipped=len(metas) - n - len(invalid), invalid=tuple(invalid))


def _json_safe(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of an env's kwargs that JSON can hold (the episode attrs they are recorded in)."""
    safe = {}
    for key, value in kwargs.items():
        with contextlib.suppress(TypeError, ValueError):
            safe[key] = json.loads(json.dumps(value, allow_nan=False))
    return safe


def _check_same(held: EpisodeInfo, episode: Any) -> None:
    """Skipping an episode imported before is only right if it is the same episode:
    a dataset recreated under the same id would otherwise be merged silently."""
    ret = float(np.sum(episode.rewards, dtype=np.float64))
    if held.length != len(episode) or not np.isclose(held.ret, ret, rtol=1e-6, atol=1e-9):
        raise StoreError(  # import_minari's handler prefixes the dataset and episode
            f"imported before as {held.key} with {held.length} steps and return {held.ret:.6g}, but the dataset's "
            f"episode now has {len(episode)} steps and return {ret:.6g}: the dataset changed since; import it into "
            "another store, or under another id"
        )


@contextlib.contextmanager
def _reading(dataset_id: str, path: str) -> Iterator[None]:
    """Any failure of Minari or HDF5/Arrow to read a damaged dataset as a ``StoreError``
    naming the dataset (they raise OSError, JSON, Arrow or KeyError alike)."""
    try:
        yield
    except StoreError:
        raise
    except Exception as e:
        raise StoreError(f"Minari dataset {dataset_id!r} at {path} is unreadable: {e!r}") from e
