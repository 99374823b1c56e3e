"""Export store snapshots as LeRobot datasets (format v3.0) and import LeRobot v3.0 datasets into a
store, with pyarrow and PyAV only: the ``lerobot`` package is not needed (``benchmarks/lerobot_compat.py``
checks both directions against it in its own environment).
The layout is in ``lerobot_format``, camera frames in ``lerobot_video``.

What maps to what (store <-> LeRobot):

- observation key K <-> feature ``observation.K`` (``state`` <-> ``observation.state``,
  ``images.top`` <-> ``observation.images.top``). A uint8 (H, W, 3) observation is a camera: a
  ``video`` feature (mp4, H.264 where PyAV has libx264, else AV1; lossy) or, exported with
  ``images=True``, an ``image`` feature (PNG in the data files; exact). Other observations are
  numeric features of their dtype and shape (a scalar as shape (1,)).
- action <-> ``action``; extra E <-> feature E. Importing, any numeric feature that is none of
  these becomes an extra of its name (``next.success``, ``complementary_info.*``, ...).
- reward <-> ``next.reward`` (float64, so it reads back exactly; a dataset without it imports
  reward 0), terminated <-> ``next.done``, truncated <-> ``next.truncated`` (a dataset without
  it: an episode whose last frame is not done was truncated there).
- instruction <-> the frames' task (``meta/tasks.parquet``; an episode without instruction
  exports its task id). An imported episode's instruction is its first frame's task; when its
  frames have several, ``attrs["lerobot_tasks"]`` lists them all.
- a feature's per-element ``names`` <-> ``schema.attrs["lerobot"]["names"][feature]``, beside
  the dataset's ``fps`` and ``robot_type``. The store keeps no frame rate: an export uses
  ``fps``, else the imported dataset's, else 30.
- success: a foreign dataset's episodes carry no robo-post success label, so importing one
  needs a rule (``SUCCESS_RULES``, e.g. ``feature:next.success``), kept in
  ``attrs["success_rule"]``.

What LeRobot has no place for goes to ``meta/robo_post/`` (LeRobot ignores that folder), so a
store's own export imports back exactly, video frames aside: ``schema.json`` (the store schema:
dtypes, bounds, units, attrs) and ``episodes.parquet`` (per episode: its record (shard, task id,
seed, success, role, attrs, ...), its steps' policy_version, intervention, timestamp (unix
seconds) and behavior_logprob, and its final observation, which a layout of one row per
frame has no row for). A foreign dataset's episodes get their last frame's observation as
final observation, policy version 0, no intervention, the import time as timestamps and no
log-probabilities; features that are neither numeric nor a camera (strings, ...) are left out
and listed.

Every imported episode records the dataset's folder (its real path) and the episode's index in
``attrs["imported_from"]``, so importing a folder again, or after an import that was killed or
failed part way, adds only the episodes the store lacks (as ``import_minari`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import uuid
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from robo_post.store.convert import (SOURCE_ATTR, SuccessRuleError, episode_import, import_lock,
                                     remove_dead_exports, warn_relabel)
from robo_post.store.lerobot_format import (
    CAMERA_DTYPES, CHUNKS_SIZE, CODEBASE_VERSION, DATA_FILES_MB, DATA_PATH, EPISODES_PATH, INDEX_FEATURES, INFO_PATH,
    STATS_PATH, TASKS_PATH, VIDEO_FILES_MB, VIDEO_PATH, DataFiles, DataReader, FeatureMismatchError, LeRobotFileError,
    aggregate_stats, episode_stats, from_column, next_file, read_episodes, read_info, read_parquet, read_tasks,
    to_column, write_json, write_tasks,
)
from robo_post.store.lerobot_video import VideoFiles, VideoReader, from_images, to_images, video_codec, video_info
from robo_post.store.schema import (
    OBS_DTYPES, ArraySpec, InvalidNameError, StoreError, StoreNotFoundError, StoreSchema,
    check_name,
)
from robo_post.store.store import EpisodeInfo, Snapshot, Store, remove_empty_store
from robo_post.store.writer import ShardWriter
from robo_post.utils.io import try_lock

DEFAULT_FPS = 30
OBS_PREFIX = "observation."
STEP_FEATURES = {"next.reward": "float64", "next.done": "bool", "next.truncated": "bool"}
_RESERVED = {"action", *STEP_FEATURES, *INDEX_FEATURES}
SIDECAR_SCHEMA = "meta/robo_post/schema.json"
SIDECAR_EPISODES = "meta/robo_post/episodes.parquet"
# The store's per-step columns that LeRobot has no feature for (in the sidecar, one list per episode).
SIDECAR_COLUMNS = {"policy_version": pa.int64(), "intervention": pa.bool_(), "timestamp": pa.float64(),
                   "behavior_logprob": pa.float64()}
_WRITE_ARG = {name: f"{name}s" for name in SIDECAR_COLUMNS}  # write_episode's plural kwargs
_CAMERA_NAMES = ["height", "width", "channels"]

# How an imported episode's success is decided (``import_lerobot(success_from=...)``).
SUCCESS_RULES = {
    "termination": "the last frame's next.done is set",
    "truncation": "the last frame was truncated (next.truncated, or not done where the dataset lacks it)",
    "feature:KEY": "the last frame's feature KEY is truthy (e.g. feature:next.success)",
    "return>=X": "the episode's return (sum of next.reward) is at least the number X",
    "none": "success unknown (None)",
}


@dataclasses.dataclass(frozen=True)
class LeRobotImport:
    """What ``import_lerobot`` did: episodes appended, episodes skipped as the store already held
    them, (with ``skip_invalid``) the dataset's episodes refused, ``(index, reason)``, and the
    features left out (neither numeric nor a camera)."""

    imported: int
    skipped: int
    invalid: tuple[tuple[int, str], ...] = ()
    ignored: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Field:
    """One LeRobot feature and the store field it is: ``kind`` obs, camera, action or extra."""

    feature: str
    kind: str
    name: str  # the observation or extra key; "action"
    spec: ArraySpec

    @property
    def shape(self) -> tuple[int, ...]:
        """The feature's shape: a store scalar is LeRobot's (1,)."""
        return self.spec.shape or (1,)


@dataclasses.dataclass(frozen=True)
class _Episode:
    """What a success rule reads of one dataset episode."""

    frames: pa.Table
    terminated: np.ndarray
    truncated: np.ndarray
    rewards: np.ndarray


def _rules_help() -> str:
    return "; ".join(f"{rule!r}: {meaning}" for rule, meaning in SUCCESS_RULES.items())


def success_rule(rule: str, features: dict[str, Any]) -> Callable[[_Episode], bool | None]:
    """The function deciding an episode's success under ``rule`` (see ``SUCCESS_RULES``);
    ``SuccessRuleError`` naming a malformed rule or a feature the dataset lacks."""
    if rule == "termination":
        return lambda episode: bool(episode.terminated[-1])
    if rule == "truncation":
        return lambda episode: bool(episode.truncated[-1])
    if rule == "none":
        return lambda episode: None
    if rule.startswith("feature:") and len(rule) > len("feature:"):
        key = rule[len("feature:"):]
        if key not in features or features[key]["dtype"] not in OBS_DTYPES:
            numeric = sorted(k for k, f in features.items() if f["dtype"] in OBS_DTYPES)
            raise SuccessRuleError(f"success rule {rule!r}: the dataset has no numeric feature {key!r}; it has {numeric}")
        return lambda episode: bool(np.any(episode.frames.column(key)[len(episode.frames) - 1].as_py()))
    if rule.startswith("return>="):
        try:
            threshold = float(rule[len("return>="):])
        except ValueError:
            threshold = float("nan")
        if np.isfinite(threshold):
            return lambda episode: bool(np.sum(episode.rewards, dtype=np.float64) >= threshold)
    raise SuccessRuleError(f"bad success rule {rule!r}; use one of: {_rules_help()}")


def _is_camera(spec: ArraySpec) -> bool:
    return spec.dtype == "uint8" and len(spec.shape) == 3 and spec.shape[2] == 3


def _store_fields(schema: StoreSchema) -> list[_Field]:
    """The LeRobot features of a store's fields (``StoreError`` for an extra whose name LeRobot uses)."""
    fields = [_Field(OBS_PREFIX + key, "camera" if _is_camera(spec) else "obs", key, spec)
              for key, spec in schema.observations.items()]
    fields.append(_Field("action", "action", "action", schema.action))
    for name, spec in schema.extras.items():
        if name in _RESERVED or name.startswith(OBS_PREFIX):
            raise StoreError(f"extra {name!r} cannot be a LeRobot feature of its name: LeRobot uses {name!r} for "
                             f"{'an observation' if name.startswith(OBS_PREFIX) else 'its own column'}")
        fields.append(_Field(name, "extra", name, spec))
    return fields


def _camera_shape(key: str, feature: dict[str, Any]) -> tuple[int, int, int]:
    """A camera feature's (H, W, 3): its shape in the order its ``names`` give (HWC unless they
    say channels first)."""
    shape, names = tuple(feature["shape"]), feature.get("names")
    channels_first = isinstance(names, list) and len(names) == 3 and str(names[0]).startswith("channel")
    hwc = (shape[1], shape[2], shape[0]) if channels_first and len(shape) == 3 else shape
    if len(hwc) != 3 or hwc[2] != 3:
        raise FeatureMismatchError(f"camera feature {key!r} has shape {list(shape)} (names {names}); the store takes "
                                   "RGB frames (height, width, 3)")
    return hwc


def _dataset_fields(info: dict[str, Any]) -> tuple[list[_Field], list[str]]:
    """The store fields of a foreign dataset's features, and the features left out."""
    fields, ignored = [], []
    for key, feature in info["features"].items():
        if key in INDEX_FEATURES or key in STEP_FEATURES:
            continue
        dtype = feature["dtype"]
        if dtype in CAMERA_DTYPES:
            field = _Field(key, "camera", key.removeprefix(OBS_PREFIX), ArraySpec("uint8", _camera_shape(key, feature)))
        elif dtype in OBS_DTYPES:
            kind = "action" if key == "action" else "obs" if key.startswith(OBS_PREFIX) else "extra"
            name = key.removeprefix(OBS_PREFIX) if kind == "obs" else key
            field = _Field(key, kind, name, ArraySpec(dtype, tuple(feature["shape"])))
        else:
            ignored.append(key)
            continue
        try:
            check_name(field.name, "store key")
        except InvalidNameError as e:
            raise FeatureMismatchError(f"feature {key!r}: {e}") from None
        fields.append(field)
    actions = [f for f in fields if f.kind == "action"]
    if not actions or np.dtype(actions[0].spec.dtype).kind not in "fiu":
        raise FeatureMismatchError(f"{INFO_PATH} declares no numeric 'action' feature; features: {sorted(info['features'])}")
    if not any(f.kind in ("obs", "camera") for f in fields):
        raise FeatureMismatchError(f"{INFO_PATH} declares no observation.* feature the store can hold")
    return fields, ignored


def _dataset_schema(fields: list[_Field], info: dict[str, Any]) -> StoreSchema:
    """The store schema of a foreign dataset: its fields, with its names, fps and robot_type in attrs."""
    names = {f.feature: info["features"][f.feature]["names"] for f in fields
             if f.kind != "camera" and info["features"][f.feature].get("names") is not None}
    return StoreSchema(
        observations={f.name: f.spec for f in fields if f.kind in ("obs", "camera")},
        action=next(f.spec for f in fields if f.kind == "action"),
        extras={f.name: f.spec for f in fields if f.kind == "extra"},
        attrs={"lerobot": {"fps": int(info["fps"]), "robot_type": info.get("robot_type"), "names": names}},
    )


def _check_fields(fields: list[_Field], info: dict[str, Any]) -> None:
    """An export's features as its store schema says: else the dataset was changed since."""
    for f in fields:
        feature = info["features"].get(f.feature)
        want = ("video", "image") if f.kind == "camera" else (f.spec.dtype,)
        if feature is None or feature["dtype"] not in want or tuple(feature["shape"]) != f.shape:
            got = "absent" if feature is None else f"{feature['dtype']} {feature['shape']}"
            raise FeatureMismatchError(f"feature {f.feature!r} is {got} in {INFO_PATH}, but the store schema in "
                                       f"{SIDECAR_SCHEMA} says {'/'.join(want)} {list(f.shape)}")


# --- export ---------------------------------------------------------------------------------
def _features(fields: list[_Field], fps: int, codec: str | None, names: dict[str, Any]) -> dict[str, dict]:
    """``meta/info.json``'s features of an export."""
    features = {}
    for f in fields:
        if f.kind == "camera":
            features[f.feature] = {"dtype": "image" if codec is None else "video", "shape": list(f.shape),
                                   "names": _CAMERA_NAMES}
            if codec is not None:
                features[f.feature]["info"] = video_info(codec, fps, *f.shape[:2])
        else:
            features[f.feature] = {"dtype": f.spec.dtype, "shape": list(f.shape), "names": names.get(f.feature)}
    for key, dtype in {**STEP_FEATURES, **INDEX_FEATURES}.items():
        features[key] = {"dtype": dtype, "shape": [1], "names": None}
    return features


def _frame_columns(fields: list[_Field], data: dict[str, Any], T: int, first: int, episode: int,
                   task: int, fps: int) -> dict[str, np.ndarray]:
    """Every feature's ``(T, *shape)`` values of one stored episode (``data``: ``Snapshot.load``)."""
    stored = {"obs": lambda f: data["obs"][f.name][:T], "camera": lambda f: data["obs"][f.name][:T],
              "action": lambda f: data["action"], "extra": lambda f: data["extras"][f.name]}
    columns = {f.feature: stored[f.kind](f).reshape(T, *f.shape) for f in fields}
    frame = np.arange(T, dtype=np.int64)
    columns.update({
        "next.reward": data["reward"], "next.done": data["terminated"], "next.truncated": data["truncated"],
        "timestamp": (frame / fps).astype(np.float32), "frame_index": frame,
        "episode_index": np.full(T, episode, np.int64), "index": first + frame, "task_index": np.full(T, task, np.int64),
    })
    return columns


def _sidecar_row(index: int, info: EpisodeInfo, data: dict[str, Any]) -> dict[str, Any]:
    """An episode's row of ``meta/robo_post/episodes.parquet``: what LeRobot has no place for."""
    record = {"client_id": info.client_id, "episode": info.episode, "task_id": info.task_id,
              "instruction": info.instruction, "seed": info.seed, "success": info.success,
              "policy_version": info.policy_version, "start_time": info.start_time, "end_time": info.end_time,
              "attrs": info.attrs, "role": info.role}
    row = {"episode_index": index, "record": json.dumps(record, allow_nan=False)}
    row.update({name: data[name] for name in SIDECAR_COLUMNS})
    # The final observation as its raw bytes: the schema gives dtype and shape back.
    row.update({f"final/{key}": values[-1].tobytes() for key, values in data["obs"].items()})
    return row


def _write_sidecar(root: str, schema: StoreSchema, snapshot: Snapshot, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.join(root, os.path.dirname(SIDECAR_SCHEMA)))
    write_json(os.path.join(root, SIDECAR_SCHEMA), {"schema": schema.to_json(), "snapshot": snapshot.id})
    columns = {"episode_index": pa.array([r["episode_index"] for r in rows], pa.int64()),
               "record": pa.array([r["record"] for r in rows], pa.string())}
    columns.update({name: pa.array([r[name] for r in rows], pa.list_(kind)) for name, kind in SIDECAR_COLUMNS.items()})
    columns.update({f"final/{key}": pa.array([r[f"final/{key}"] for r in rows], pa.binary())
                    for key in schema.observations})
    pq.write_table(pa.table(columns), os.path.join(root, SIDECAR_EPISODES))


def _write_episodes_meta(root: str, rows: list[dict[str, Any]], limit_mb: float, chunks_size: int) -> None:
    """``meta/episodes/chunk-*/file-*.parquet``: the rows, in as many files as the size limit needs."""
    per_file = max(1, math.floor(len(rows) * limit_mb * 2**20 / max(pa.Table.from_pylist(rows).nbytes, 1)))
    chunk = file = 0
    for start in range(0, len(rows), per_file):
        part = [{**row, "meta/episodes/chunk_index": chunk, "meta/episodes/file_index": file}
                for row in rows[start:start + per_file]]
        path = os.path.join(root, EPISODES_PATH.format(chunk_index=chunk, file_index=file))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(pa.Table.from_pylist(part), path)
        chunk, file = next_file(chunk, file, chunks_size)


def _write_dataset(root: str, snapshot: Snapshot, episodes: Sequence[EpisodeInfo], fps: int, codec: str | None,
                   limits: tuple[float, float, int]) -> None:
    """Every file of the dataset, into the empty folder ``root``."""
    data_mb, video_mb, chunks_size = limits
    schema = snapshot.store.schema
    fields = _store_fields(schema)
    lerobot = schema.attrs.get("lerobot") if isinstance(schema.attrs.get("lerobot"), dict) else {}
    features = _features(fields, fps, codec, lerobot.get("names") or {})
    videos = {f.feature: VideoFiles(root, f.feature, codec, fps, f.shape, video_mb, chunks_size)
              for f in fields if f.kind == "camera" and codec is not None}
    data_files = DataFiles(root, data_mb, chunks_size)
    tasks: dict[str, int] = {}
    rows, sidecar, stats, frames = [], [], [], 0
    try:
        for index, info in enumerate(episodes):
            data, T = snapshot.load(info), info.length
            task = info.instruction or info.task_id
            columns = _frame_columns(fields, data, T, frames, index, tasks.setdefault(task, len(tasks)), fps)
            table = {key: to_images(values) if features[key]["dtype"] == "image"
                     else to_column(values, tuple(features[key]["shape"]))
                     for key, values in columns.items() if key not in videos}
            chunk, file = data_files.write(pa.table(table))
            row = {"episode_index": index, "tasks": [task], "length": T, "data/chunk_index": chunk,
                   "data/file_index": file, "dataset_from_index": frames, "dataset_to_index": frames + T}
            for key, video in videos.items():
                row.update(video.append(columns[key]))
            ep_stats = {key: episode_stats(values, features[key]["dtype"] in CAMERA_DTYPES)
                        for key, values in columns.items()}
            row.update({f"stats/{key}/{name}": v.tolist() for key, s in ep_stats.items() for name, v in s.items()})
            rows.append(row)
            stats.append(ep_stats)
            sidecar.append(_sidecar_row(index, info, data))
            frames += T
    finally:
        data_files.close()
        for video in videos.values():
            video.close()
    _write_episodes_meta(root, rows, data_mb, chunks_size)
    write_tasks(os.path.join(root, TASKS_PATH), list(tasks))
    write_json(os.path.join(root, STATS_PATH),
               {key: {name: v.tolist() for name, v in aggregate_stats([s[key] for s in stats]).items()}
                for key in features})
    _write_sidecar(root, schema, snapshot, sidecar)
    write_json(os.path.join(root, INFO_PATH), {
        "codebase_version": CODEBASE_VERSION, "robot_type": lerobot.get("robot_type"),
        "total_episodes": len(rows), "total_frames": frames, "total_tasks": len(tasks), "chunks_size": chunks_size,
        "data_files_size_in_mb": data_mb, "video_files_size_in_mb": video_mb, "fps": fps,
        "splits": {"train": f"0:{len(rows)}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH if videos else None,
        "features": features,
    })


def export_lerobot(
    snapshot: Snapshot,
    path: str | os.PathLike,
    episodes: Sequence[EpisodeInfo] | None = None,
    *,
    fps: int | None = None,
    images: bool = False,
    codec: str | None = None,
    data_files_size_in_mb: float = DATA_FILES_MB,
    video_files_size_in_mb: float = VIDEO_FILES_MB,
    chunks_size: int = CHUNKS_SIZE,
) -> str:
    """Write episodes of ``snapshot`` as a new LeRobot v3.0 dataset in the folder ``path``; return it.

    Args:
        snapshot: the store snapshot to read.
        path: the dataset's folder; must not exist yet.
        episodes: which episodes (e.g. ``snapshot.episodes(task=...)``); default all.
        fps: frames per second; default the imported dataset's (``schema.attrs["lerobot"]``), else 30.
        images: camera frames as PNG images in the data files (exact) instead of videos.
        codec: video encoder; default ``video_codec()`` (libx264, else libsvtav1).
        data_files_size_in_mb, video_files_size_in_mb, chunks_size: LeRobot's file limits.

    Raises:
        StoreError: an existing ``path``, no episodes, an extra named like a LeRobot column, or a
            camera of odd height or width for video (yuv420p halves both). The dataset appears
            whole or not at all, also when the export is killed.
    """
    episodes = list(snapshot.episodes() if episodes is None else episodes)
    if not episodes:
        raise StoreError("no episodes to export")
    path = os.path.abspath(path)
    if os.path.lexists(path):
        raise StoreError(f"{path} already exists: export into a new folder")
    schema = snapshot.store.schema
    lerobot = schema.attrs.get("lerobot") if isinstance(schema.attrs.get("lerobot"), dict) else {}
    fps = fps if fps is not None else lerobot.get("fps") or DEFAULT_FPS
    if isinstance(fps, bool) or not isinstance(fps, int) or fps <= 0:
        raise StoreError(f"fps must be a positive integer, not {fps!r}")
    codec = None if images else codec or video_codec()
    for f in _store_fields(schema):
        if f.kind == "camera" and codec is not None and (f.shape[0] % 2 or f.shape[1] % 2):
            raise StoreError(f"camera {f.name!r} is {f.shape[0]}x{f.shape[1]}: video (yuv420p) needs an even height "
                             "and width; export with images=True (CLI: --images) to embed PNG frames")
    remove_dead_exports(path)
    staging = f"{path}.export-{uuid.uuid4().hex}"
    os.makedirs(staging)
    held = try_lock(staging, lambda: StoreError(f"{staging} is in use"))  # alive while this export runs
    try:
        _write_dataset(staging, snapshot, episodes, fps, codec, (data_files_size_in_mb, video_files_size_in_mb,
                                                                 chunks_size))
        if os.path.lexists(path):  # appeared meanwhile: rename would replace an empty folder
            raise StoreError(f"{path} already exists: export into a new folder")
        os.rename(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(held)
    return path


# --- import ---------------------------------------------------------------------------------
def _read_sidecar(root: str) -> tuple[StoreSchema | None, dict[int, dict[str, Any]]]:
    """The store schema and per-episode rows of a store's own export; (None, {}) for a foreign dataset."""
    path = os.path.join(root, SIDECAR_SCHEMA)
    if not os.path.isfile(path):
        return None, {}
    try:
        with open(path) as f:
            schema = StoreSchema.from_json(json.load(f)["schema"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LeRobotFileError(f"{path} is unreadable: {e!r}") from None
    table = read_parquet(os.path.join(root, SIDECAR_EPISODES), "robo-post episode metadata")
    return schema, {row["episode_index"]: row for row in table.to_pylist()}


def _sidecar_columns(row: dict[str, Any] | None, schema: StoreSchema, T: int) -> tuple[dict, dict, dict]:
    """(record, per-step columns, final observations) of an exported episode; empty for a foreign one."""
    if row is None:
        return {}, {}, {}
    columns = {name: np.asarray(row[name], dtype=kind.to_pandas_dtype()) for name, kind in SIDECAR_COLUMNS.items()}
    if any(len(v) != T for v in columns.values()):
        raise FeatureMismatchError(f"{SIDECAR_EPISODES} disagrees with the data: its step columns are not "
                                   f"{T} long; the dataset was changed since its export")
    final = {key: np.frombuffer(row[f"final/{key}"], dtype=spec.dtype).reshape(spec.shape)
             for key, spec in schema.observations.items()}
    return json.loads(row["record"]), columns, final


def _field_values(f: _Field, frames: pa.Table, row: dict[str, Any], features: dict[str, Any],
                  videos: dict[str, VideoReader]) -> np.ndarray:
    """One field's ``(T, *spec.shape)`` values of an episode."""
    T, what = len(frames), f"feature {f.feature!r} of episode {row['episode_index']}"
    if f.feature in videos:
        prefix = f"videos/{f.feature}/"
        if row.get(prefix + "from_timestamp") is None:
            raise LeRobotFileError(f"episode {row['episode_index']}'s metadata has no {prefix}* columns")
        times = row[prefix + "from_timestamp"] + frames.column("timestamp").to_numpy(zero_copy_only=False)
        return videos[f.feature].frames(row[prefix + "chunk_index"], row[prefix + "file_index"],
                                        times.astype(np.float64), f.spec.shape)
    if f.feature not in frames.column_names:
        raise FeatureMismatchError(f"{what}: declared in {INFO_PATH} but not a column of the data file")
    if features[f.feature]["dtype"] == "image":
        return from_images(frames.column(f.feature), f.spec.shape, what)
    return from_column(frames.column(f.feature), f.shape, f.spec.dtype, what).reshape(T, *f.spec.shape)


def _per_frame(frames: pa.Table, key: str) -> np.ndarray | None:
    """A (1,) feature as one value per frame, of whatever type it has; None when the dataset lacks it."""
    return from_column(frames.column(key), (1,), None, key).reshape(-1) if key in frames.column_names else None


def _check_same(held: EpisodeInfo, T: int, ret: float) -> None:
    """Skipping an episode imported before is only right if it is the same episode: a dataset
    rewritten in the same folder would otherwise be merged silently."""
    if held.length != T or not np.isclose(held.ret, ret, rtol=1e-6, atol=1e-9):
        raise StoreError(  # import_lerobot's handler prefixes the dataset and episode
            f"imported before as {held.key} with {held.length} steps and return {held.ret:.6g}, but the dataset's "
            f"episode now has {T} steps and return {ret:.6g}: the dataset changed since; import it into another store")


def import_lerobot(
    path: str | os.PathLike,
    store_root: str | os.PathLike,
    client_id: str | None = "lerobot",
    task_id: str | None = None,
    success_from: str | None = None,
    skip_invalid: bool = False,
) -> LeRobotImport:
    """Append the episodes of the LeRobot v3.0 dataset in folder ``path`` that the store lacks.

    The store is created if absent: with the exported schema for datasets written by
    ``export_lerobot``, else from the dataset's features. Importing into an existing store
    appends; a store whose observations, action or extras differ from the dataset's is refused
    before anything is written. Every episode goes through ``ShardWriter.write_episode`` and
    is validated; episodes already imported from the same folder are skipped.

    Args:
        path: the dataset's folder (``meta/info.json``, ``data/``, ...).
        store_root: store directory.
        client_id: shard to write; ``None`` restores each exported episode's original shard
            (``"lerobot"`` for foreign episodes).
        task_id: task of every episode; default the exported task, else the folder's name.
        success_from: how to decide each episode's success, one of ``SUCCESS_RULES``. Required
            for foreign datasets; by default exported episodes keep their recorded success.
        skip_invalid: import the other episodes when one fails validation, listing it in
            ``LeRobotImport.invalid``; by default such an episode stops the import.

    Raises:
        NotLeRobotDatasetError, LeRobotVersionError: not a LeRobot v3.0 dataset folder.
        LeRobotFileError: a parquet file missing or unreadable. FeatureMismatchError: the data
            disagrees with ``meta/info.json``, or a feature does not fit the store.
        VideoDecodeError: a video missing, undecodable, or short of an episode's frames.
        SuccessRuleError: a foreign dataset and no rule, a malformed rule, or a feature it lacks.
        StoreError: an episode fails validation, a store of another layout, or an episode
            imported before from this folder that differs now. Episodes before a failure stay
            committed; importing again adds only the rest.
    """
    root = os.path.realpath(path)
    info = read_info(root)
    exported, sidecar = _read_sidecar(root)
    decide = None if success_from is None else success_rule(success_from, info["features"])
    if exported is not None:
        schema, ignored = exported, []
        fields = _store_fields(schema)
        _check_fields(fields, info)
    else:
        fields, ignored = _dataset_fields(info)
        schema = _dataset_schema(fields, info)
        if decide is None:  # never guess: a done frame is success in one task and a crash in another
            raise SuccessRuleError(f"LeRobot dataset {root} was not exported by robo-post, so its episodes carry no "
                                   f"success label: pass success_from (CLI: --success-from RULE), one of: "
                                   f"{_rules_help()}")
    videos = {f.feature: VideoReader(root, info.get("video_path") or "", f.feature) for f in fields
              if info["features"][f.feature]["dtype"] == "video"}
    if videos and not isinstance(info.get("video_path"), str):
        raise LeRobotFileError(f"{root}/{INFO_PATH} has video features {sorted(videos)} but no video_path")
    tasks, rows = read_tasks(root), read_episodes(root)
    existed = os.path.exists(store_root)
    try:
        store, created = Store.open(str(store_root)), False
    except StoreNotFoundError:
        store, created = Store.create(str(store_root), schema), True
    differences = [d for d in store.schema.layout_differences(schema) if not d.startswith("attrs[")]
    if differences:
        raise StoreError(f"{store_root} holds episodes of another layout than {root}: {'; '.join(differences)} "
                         "(store first); import into another store")
    data = DataReader(root, info["data_path"])
    n, invalid, relabel = 0, [], []
    with contextlib.ExitStack() as stack:
        stack.enter_context(import_lock(store.root))  # one import at a time: see import_minari
        stack.callback(lambda: remove_empty_store(store.root, existed) if created and n == 0 else None)
        for reader in videos.values():
            stack.callback(reader.close)
        held = {e.attrs[SOURCE_ATTR].get("episode"): e for e in store.snapshot(verify=False, record=False)
                if isinstance(e.attrs.get(SOURCE_ATTR), dict) and e.attrs[SOURCE_ATTR].get("dataset") == root}
        writers: dict[str, ShardWriter] = {}
        for row in rows:
            index = row["episode_index"]
            with episode_import(f"LeRobot dataset {root}", index, n, store_root, skip_invalid, invalid):
                frames = data.frames(row)
                T = len(frames)
                record, columns, final = _sidecar_columns(sidecar.get(index), schema, T)
                if exported is not None and not record:
                    raise LeRobotFileError(f"{SIDECAR_EPISODES} has no row for this episode: the dataset was "
                                           "changed since its export")
                rewards = _per_frame(frames, "next.reward")
                rewards = np.zeros(T) if rewards is None else rewards.astype(np.float64)
                if index in held:
                    _check_same(held[index], T, float(np.sum(rewards)))
                    if decide is not None and held[index].attrs.get("success_rule") != success_from:
                        relabel.append(held[index].attrs.get("success_rule"))
                    continue
                done, cut = _per_frame(frames, "next.done"), _per_frame(frames, "next.truncated")
                terminated = np.zeros(T, bool) if done is None else done != 0
                truncated = (np.arange(T) == T - 1) & ~terminated if cut is None else cut != 0
                values = {f.feature: _field_values(f, frames, row, info["features"], videos) for f in fields}
                obs = {f.name: np.concatenate([values[f.feature], final[f.name][None]]) if final
                       else values[f.feature] for f in fields if f.kind in ("obs", "camera")}
                task_indices = frames.column("task_index").to_pylist() if "task_index" in frames.column_names else []
                unknown = sorted(set(task_indices) - set(tasks))
                if unknown:
                    raise LeRobotFileError(f"task_index {unknown} not in {TASKS_PATH}")
                episode_tasks = list(dict.fromkeys(tasks[i] for i in task_indices))
                attrs = {**(record.get("attrs") or {}), SOURCE_ATTR: {"dataset": root, "episode": index}}
                if len(episode_tasks) > 1:
                    attrs["lerobot_tasks"] = episode_tasks
                if decide is not None:
                    success = decide(_Episode(frames, terminated, truncated, rewards))
                    attrs["success_rule"] = success_from
                else:
                    success = record.get("success")
                shard = client_id if client_id is not None else record.get("client_id", "lerobot")
                if shard not in writers:
                    writers[shard] = stack.enter_context(store.writer(shard))
                writers[shard].write_episode(
                    obs, values["action"],
                    rewards=rewards, terminated=terminated, truncated=truncated,
                    **{_WRITE_ARG[name]: v for name, v in columns.items()},
                    task_id=task_id if task_id is not None else record.get("task_id", os.path.basename(root)),
                    instruction=record.get("instruction", episode_tasks[0] if episode_tasks else ""),
                    seed=record.get("seed"), success=success, policy_version=record.get("policy_version"),
                    start_time=record.get("start_time"), end_time=record.get("end_time"), attrs=attrs,
                    extras={f.name: values[f.feature] for f in fields if f.kind == "extra"},
                    role=record.get("role", "imported"),
                )
                n += 1
    warn_relabel(relabel, root, store_root, success_from)
    return LeRobotImport(imported=n, skipped=len(rows) - n - len(invalid), invalid=tuple(invalid),
                         ignored=tuple(ignored))
