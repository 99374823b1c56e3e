"""The LeRobot dataset layout, codebase_version "v3.0", read and written with pyarrow alone.

    meta/info.json                          codebase_version, fps, robot_type, totals, chunks_size,
                                            data/video_files_size_in_mb, data_path, video_path,
                                            splits, features {key: {dtype, shape, names[, info]}}
    meta/stats.json                         {feature: {min, max, mean, std, count, q01 ... q99}}
    meta/tasks.parquet                      task_index per task string (a pandas frame indexed by task)
    meta/episodes/chunk-*/file-*.parquet    one row per episode: episode_index, tasks, length,
                                            data/chunk_index, data/file_index, dataset_from_index,
                                            dataset_to_index, videos/<key>/{chunk_index, file_index,
                                            from_timestamp, to_timestamp}, stats/<feature>/<stat>,
                                            meta/episodes/{chunk_index, file_index}
    data/chunk-*/file-*.parquet             one row per frame, several episodes per file: every
                                            non-video feature, timestamp, frame_index,
                                            episode_index, index, task_index
    videos/<key>/chunk-*/file-*.mp4         one camera's episodes back to back; an episode's frame
                                            at ``timestamp`` t is the one at ``from_timestamp + t``

A feature of shape (1,) is a scalar column, (n,) a fixed-size list, (a, b, ...) nested lists; an
``image`` feature is a struct of encoded image ``bytes`` and a ``path`` (Hugging Face ``Image``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from robo_post.store.schema import StoreError

CODEBASE_VERSION = "v3.0"
CHUNKS_SIZE = 1000  # files per chunk folder
DATA_FILES_MB = 100  # a data (and episodes metadata) file is closed past this size
VIDEO_FILES_MB = 200  # a video file is closed past this size
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
_CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + _CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + _CHUNK_FILE + ".mp4"
EPISODES_PATH = EPISODES_DIR + "/" + _CHUNK_FILE + ".parquet"

# The columns every data file has, whatever the robot.
INDEX_FEATURES = {
    "timestamp": "float32",  # seconds since the episode's first frame
    "frame_index": "int64",  # within the episode
    "episode_index": "int64",
    "index": "int64",  # within the dataset
    "task_index": "int64",
}
CAMERA_DTYPES = ("video", "image")
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
_IMAGE_STATS_FRAMES = 100  # image stats of an episode from at most this many evenly spaced frames


class LeRobotError(StoreError, ValueError):
    """A LeRobot dataset that cannot be read, or does not fit a store; the message names what."""


class NotLeRobotDatasetError(LeRobotError):
    """The folder is not a LeRobot dataset: no folder, no ``meta/info.json``, or not JSON."""


class LeRobotVersionError(LeRobotError):
    """A LeRobot dataset of another ``codebase_version`` than v3.0 (e.g. v2.1)."""


class LeRobotFileError(LeRobotError):
    """A file the dataset needs is missing or unreadable (a truncated parquet file, ...)."""


class FeatureMismatchError(LeRobotError):
    """The data disagrees with ``meta/info.json`` (a column's shape or type, missing frames), or a
    feature does not fit the store (its dtype, its key)."""


def read_info(root: str) -> dict[str, Any]:
    """``meta/info.json`` of the dataset at ``root``, checked to be v3.0 with fps and features."""
    path = os.path.join(root, INFO_PATH)
    if not os.path.isdir(root):
        raise NotLeRobotDatasetError(f"{root} is not a folder: a LeRobot dataset is a folder with {INFO_PATH}")
    if not os.path.isfile(path):
        raise NotLeRobotDatasetError(f"{root} is not a LeRobot v3.0 dataset: it has no {INFO_PATH}")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise NotLeRobotDatasetError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(info, dict):
        raise NotLeRobotDatasetError(f"{path} is not a JSON object")
    version = info.get("codebase_version")
    if version != CODEBASE_VERSION:
        hint = (" (convert it with LeRobot's `python -m lerobot.scripts.convert_dataset_v21_to_v30`)"
                if isinstance(version, str) and version.startswith("v2") else "")
        raise LeRobotVersionError(f"{root} is a LeRobot dataset of codebase_version {version!r}; this reads "
                                  f"{CODEBASE_VERSION!r} only{hint}")
    for key, kind in (("fps", (int, float)), ("features", dict), ("data_path", str)):
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            raise LeRobotFileError(f"{path}: {key!r} is missing or of the wrong type")
    for key, feature in info["features"].items():
        if not isinstance(feature, dict) or not isinstance(feature.get("dtype"), str) or not (
                isinstance(feature.get("shape"), list) and all(isinstance(n, int) for n in feature["shape"])):
            raise LeRobotFileError(f"{path}: feature {key!r} needs a dtype and a shape (a list of sizes)")
    return info


def next_file(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    """The chunk and file index after ``(chunk, file)``: a chunk holds ``chunks_size`` files."""
    return (chunk + 1, 0) if file + 1 == chunks_size else (chunk, file + 1)


def read_parquet(path: str, what: str, columns: list[str] | None = None) -> pa.Table:
    """A parquet file as a table; ``LeRobotFileError`` naming ``what`` when it is missing or unreadable."""
    if not os.path.isfile(path):
        raise LeRobotFileError(f"{what} {path} is missing")
    try:
        return pq.read_table(path, columns=columns)
    except Exception as e:  # noqa: BLE001 (pyarrow raises ArrowInvalid, OSError, ... for a damaged file)
        raise LeRobotFileError(f"{what} {path} is unreadable (truncated or damaged?): {e}") from None


def to_column(values: np.ndarray, shape: tuple[int, ...]) -> pa.Array:
    """``(T, *shape)`` values as one column: scalars for shape () or (1,), else nested fixed-size lists."""
    column = pa.array(np.ascontiguousarray(values).reshape(-1))
    for n in reversed(shape if shape not in ((), (1,)) else ()):
        column = pa.FixedSizeListArray.from_arrays(column, n)
    return column


def from_column(column: pa.ChunkedArray | pa.Array, shape: tuple[int, ...], dtype: str | None, what: str) -> np.ndarray:
    """A column's ``(T, *shape)`` values; ``FeatureMismatchError`` naming ``what`` when its nesting,
    list lengths, nulls or type (unless ``dtype`` is None) disagree with the feature's."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows = len(array)
    for depth, n in enumerate(shape):
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
                or pa.types.is_fixed_size_list(array.type)):
            if shape == (1,):  # LeRobot stores a (1,) feature as a scalar column
                break
            raise FeatureMismatchError(f"{what}: a column of {array.type}, but its feature has shape {list(shape)}")
        lengths = array.value_lengths().to_numpy(zero_copy_only=False)
        if array.null_count or (lengths != n).any():
            got = "a null" if array.null_count else f"length {lengths[lengths != n][0]}"
            raise FeatureMismatchError(f"{what}: a value of {got} at depth {depth}, but its feature has shape "
                                       f"{list(shape)}")
        array = array.flatten()
    if pa.types.is_nested(array.type):
        raise FeatureMismatchError(f"{what}: a column of {column.type}, deeper than its feature's shape {list(shape)}")
    if array.null_count:
        raise FeatureMismatchError(f"{what}: holds nulls")
    values = array.to_numpy(zero_copy_only=False)
    if dtype is not None and values.dtype != np.dtype(dtype):
        raise FeatureMismatchError(f"{what}: values of type {values.dtype}, but its feature says {dtype}")
    return values.reshape(rows, *shape)


def episode_stats(values: np.ndarray, camera: bool) -> dict[str, np.ndarray]:
    """LeRobot's per-episode stats of one feature's ``(T, ...)`` values: per element, or per channel
    as (3, 1, 1) in 0-1 for camera frames (from at most 100 evenly spaced frames)."""
    if camera:
        frames = values[np.unique(np.linspace(0, len(values) - 1, _IMAGE_STATS_FRAMES).round().astype(int))]
        x = frames.reshape(-1, 3).astype(np.float64) / 255.0
        count, shape = len(frames), (3, 1, 1)
    else:
        x = values.reshape(len(values), -1).astype(np.float64)
        count, shape = len(values), values.shape[1:] or (1,)
    stats = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0)}
    stats.update({name: np.quantile(x, q, axis=0) for name, q in QUANTILES.items()})
    stats = {name: v.reshape(shape) for name, v in stats.items()}
    stats["count"] = np.array([count])
    return stats


def aggregate_stats(per_episode: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One feature's dataset stats from its episodes' (LeRobot's rule: means and quantiles weighted
    by count, the variance pooled around the overall mean)."""
    counts = np.array([s["count"][0] for s in per_episode], dtype=np.float64)
    weights = (counts / counts.sum()).reshape(-1, *[1] * per_episode[0]["mean"].ndim)

    def stack(name: str) -> np.ndarray:
        return np.stack([s[name] for s in per_episode])

    mean = (weights * stack("mean")).sum(0)
    variance = (weights * (stack("std") ** 2 + (stack("mean") - mean) ** 2)).sum(0)
    out = {"min": stack("min").min(0), "max": stack("max").max(0), "mean": mean, "std": np.sqrt(variance)}
    out.update({name: (weights * stack(name)).sum(0) for name in QUANTILES})
    out["count"] = np.array([int(counts.sum())])
    return out


def write_tasks(path: str, tasks: list[str]) -> None:
    """``meta/tasks.parquet``: ``task_index`` i of ``tasks[i]``, as pandas writes a frame indexed by
    ``task`` (LeRobot reads it with ``pandas.read_parquet`` and looks tasks up in the index)."""
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())})
    pandas_meta = {  # pandas' own schema metadata: which column is the index, and the columns' types
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


def read_tasks(root: str) -> dict[int, str]:
    """``meta/tasks.parquet`` as task_index -> task string (the task column is the frame's index)."""
    path = os.path.join(root, TASKS_PATH)
    table = read_parquet(path, "the task list")
    names = [n for n in table.column_names if n != "task_index"
             and (pa.types.is_string(table.schema.field(n).type) or pa.types.is_large_string(table.schema.field(n).type))]
    if "task_index" not in table.column_names or len(names) != 1:
        raise LeRobotFileError(f"{path} needs a task_index column and one column of task strings, "
                               f"not {table.column_names}")
    return dict(zip(table.column("task_index").to_pylist(), table.column(names[0]).to_pylist()))


def read_episodes(root: str) -> list[dict[str, Any]]:
    """The rows of ``meta/episodes/*/*.parquet`` without their stats, ordered by episode_index."""
    folder = os.path.join(root, EPISODES_DIR)
    paths = sorted(os.path.join(folder, chunk, name) for chunk in (os.listdir(folder) if os.path.isdir(folder) else [])
                   if os.path.isdir(os.path.join(folder, chunk))
                   for name in os.listdir(os.path.join(folder, chunk)) if name.endswith(".parquet"))
    if not paths:
        raise LeRobotFileError(f"{root} has no episode metadata: no {EPISODES_DIR}/chunk-*/file-*.parquet")
    rows = []
    for path in paths:
        try:
            names = pq.read_schema(path).names
        except Exception as e:  # noqa: BLE001 (a damaged footer raises ArrowInvalid, OSError, ...)
            raise LeRobotFileError(f"episode metadata {path} is unreadable (truncated or damaged?): {e}") from None
        table = read_parquet(path, "episode metadata", [n for n in names if not n.startswith("stats/")])
        rows += table.to_pylist()
    for row in rows:
        missing = [k for k in ("episode_index", "length", "data/chunk_index", "data/file_index") if row.get(k) is None]
        if missing:
            raise LeRobotFileError(f"{folder}: an episode row lacks {missing}")
    return sorted(rows, key=lambda row: row["episode_index"])


class DataFiles:
    """The data files being written: one row group per episode, the next file past the size limit."""

    def __init__(self, root: str, limit_mb: float, chunks_size: int):
        self._root, self._limit, self._chunks_size = root, limit_mb * 2**20, chunks_size
        self.chunk = self.file = self._size = 0
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> tuple[int, int]:
        """Append one episode's rows; the chunk and file index they went to."""
        if self._writer is not None and self._size + table.nbytes >= self._limit:
            self.close()
            self.chunk, self.file = next_file(self.chunk, self.file, self._chunks_size)
        if self._writer is None:
            path = os.path.join(self._root, DATA_PATH.format(chunk_index=self.chunk, file_index=self.file))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._writer, self._size = pq.ParquetWriter(path, table.schema, compression="snappy"), 0
        self._writer.write_table(table)
        self._size += table.nbytes  # in memory: a bound on the file's compressed size
        return self.chunk, self.file

    def close(self) -> None:
        """Finish the file being written."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class DataReader:
    """One episode's frames at a time from the data files; the file read last stays loaded, as
    the episodes of one file come one after another."""

    def __init__(self, root: str, template: str):
        self._root, self._template = root, template
        self._path: str | None = None
        self._table: pa.Table | None = None
        self._episodes = np.zeros(0, np.int64)

    def frames(self, row: dict[str, Any]) -> pa.Table:
        """The episode's rows, ordered by frame_index; ``FeatureMismatchError`` when frames are missing."""
        path = os.path.join(self._root, self._template.format(chunk_index=row["data/chunk_index"],
                                                              file_index=row["data/file_index"]))
        if path != self._path:
            table = read_parquet(path, "data file")
            for key in ("episode_index", "frame_index", "timestamp"):
                if key not in table.column_names:
                    raise FeatureMismatchError(f"data file {path} has no {key} column")
            self._path, self._table = path, table
            self._episodes = table.column("episode_index").to_numpy(zero_copy_only=False)
        frames = self._table.take(np.flatnonzero(self._episodes == row["episode_index"]))
        index = frames.column("frame_index").to_numpy(zero_copy_only=False)
        frames, index = frames.take(np.argsort(index, kind="stable")), np.sort(index)
        if not np.array_equal(index, np.arange(row["length"])):
            raise FeatureMismatchError(f"data file {path} holds frames {_span(index)} of episode "
                                       f"{row['episode_index']}, whose length is {row['length']}")
        return frames


def _span(index: np.ndarray) -> str:
    return "none" if not len(index) else f"{len(index)} ({index.min()}..{index.max()})"


def write_json(path: str, obj: Any) -> None:
    """``obj`` as indented JSON (LeRobot's own files are indented by 4)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=4)
