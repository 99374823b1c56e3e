"""One stored episode as a Rerun recording (``robo-post store view``), to look at in the viewer.

Everything is logged on one sequence timeline, ``step``; entity paths:

- ``obs/<key>``: a camera observation (uint8 (H, W), or (H, W, C) with C in 1, 3, 4) as images;
  ``obs/<key>/<name>``: each entry of any other observation as scalars (``obs/<key>`` itself
  for a scalar observation). Observations hold T + 1 rows: step T is the final observation,
  the one after the last action.
- ``action/<name>`` (``action`` for a scalar action) and ``extras/<extra>/<name>``: scalars,
  T rows.
- ``reward``, ``terminated``, ``truncated``, ``intervention`` (the store's 0/1 flag of a
  step whose action a person gave), ``policy_version``, and ``behavior_logprob`` when the
  episode recorded it: scalars, T rows.
- ``instruction`` (when the episode has one) and ``episode`` (its key, task, role, success,
  return, seed, attrs): static text documents.

An entry's ``<name>`` is the one the schema gives (``schema.attrs["lerobot"]["names"]``, what a
LeRobot import keeps) when it names every entry once, else its index (``0``, ``1``, ``0_2`` for
an array of several axes).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any

import numpy as np

from robo_post.store.schema import STEP_COLUMNS, EpisodeNotFoundError, StoreSchema
from robo_post.store.store import EpisodeInfo, Snapshot

TIMELINE = "step"
# Step columns drawn as scalars; the timestamp is not: the timeline is the step.
SCALAR_COLUMNS = tuple(c for c in STEP_COLUMNS if c != "timestamp")


def find_episode(snap: Snapshot, which: str | None) -> EpisodeInfo:
    """The episode ``which`` names in ``snap``: its key ``SHARD/N`` (as ``store validate`` and
    ``EpisodeInfo.key`` write it), or an index into the snapshot's episodes (shards by name, each
    in commit order; negative counts from the end). ``None``: the newest, the one whose last step
    is latest (``end_time``; on a tie the later in that order).

    Raises:
        EpisodeNotFoundError: the snapshot holds no episode, or none of that key or index; the
            message says which keys there are.
    """
    episodes = snap.episodes()
    if not episodes:
        raise EpisodeNotFoundError(f"store {snap.store.root} holds no committed episode")
    if which is None:
        return max(reversed(episodes), key=lambda e: e.end_time)  # max keeps the first of equals
    try:
        index = int(which)
    except ValueError:
        match = [e for e in episodes if e.key == which]
        if match:
            return match[0]
    else:
        if -len(episodes) <= index < len(episodes):
            return episodes[index]
    raise EpisodeNotFoundError(f"no episode {which!r} in store {snap.store.root}: give a key SHARD/N "
                               f"({_key_ranges(snap)}) or an index in [-{len(episodes)}, {len(episodes) - 1}]")


def _key_ranges(snap: Snapshot) -> str:
    """The snapshot's keys by shard, in words: ``robot-a/0..4, robot-b/0``."""
    return ", ".join(f"{shard}/0" + (f"..{c['episodes'] - 1}" if c["episodes"] > 1 else "")
                     for shard, c in sorted(snap.counts.items()))


def default_path(store_root: str, episode: EpisodeInfo) -> str:
    """``<store folder name>-episode-<shard>-<N>.rrd`` in the working directory."""
    name = os.path.basename(os.path.normpath(store_root))
    return f"{name}-episode-{episode.client_id}-{episode.episode}.rrd"


def is_image(shape: tuple[int, ...], dtype: str) -> bool:
    """Whether a field is drawn as images: uint8 (H, W), or (H, W, C) with C in 1, 3, 4 (what the
    models read as an image too)."""
    return dtype == "uint8" and (len(shape) == 2 or len(shape) == 3 and shape[2] in (1, 3, 4))


def entry_names(schema: StoreSchema, feature: str, shape: tuple[int, ...]) -> list[str]:
    """One name per entry of a field of ``shape`` (flattened in C order): the schema's names of
    LeRobot ``feature`` when they name each entry once, else the entries' indices."""
    size = int(np.prod(shape, dtype=np.int64))
    names = ((schema.attrs.get("lerobot") or {}).get("names") or {}).get(feature)
    if isinstance(names, dict) and len(names) == 1:  # LeRobot also writes {"motors": [...]}
        names = next(iter(names.values()))
    if (isinstance(names, list) and len(names) == size and all(isinstance(n, str) and n for n in names)
            and len(set(names)) == size):
        return names
    return ["_".join(map(str, i)) for i in np.ndindex(*shape)] if len(shape) > 1 else [str(i) for i in range(size)]


def write_recording(snap: Snapshot, episode: EpisodeInfo, path: str) -> str:
    """Write ``episode`` of ``snap`` as a Rerun recording at ``path`` (see the module docstring
    for its layout); returns ``path``. The file appears whole or not at all: it is written
    beside ``path`` and renamed."""
    import rerun as rr

    data = snap.load(episode)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(2, "no such folder for the recording", directory)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    rec = rr.RecordingStream("robo-post", recording_id=uuid.uuid4())
    if not rr.is_enabled(rec):
        raise RuntimeError("Rerun logging is off (RERUN=off in the environment?): unset it to write a recording")
    try:
        rec.save(tmp)
        rec.send_recording_name(f"{os.path.basename(snap.store.root)} {episode.key}")
        _log_episode(rec, snap.store.schema, episode, data)
        rec.flush()
        rec.disconnect()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path


def _log_episode(rec: Any, schema: StoreSchema, episode: EpisodeInfo, data: dict[str, Any]) -> None:
    import rerun as rr

    for key in schema.observations:
        _log_field(rec, schema, f"obs/{_part(key)}", f"observation.{key}", data["obs"][key])
    _log_field(rec, schema, "action", "action", data["action"])
    for key in schema.extras:
        _log_field(rec, schema, f"extras/{_part(key)}", key, data["extras"][key])
    for column in SCALAR_COLUMNS:
        if column == "behavior_logprob" and np.isnan(data[column]).all():
            continue  # not recorded
        _send_scalars(rec, column, data[column])
    if episode.instruction:
        rec.log("instruction", rr.TextDocument(episode.instruction), static=True)
    rec.log("episode", rr.TextDocument(_describe(episode), media_type="text/markdown"), static=True)


def _log_field(rec: Any, schema: StoreSchema, entity: str, feature: str, rows: np.ndarray) -> None:
    """One field's rows: as images when it is one, else one scalar series per entry."""
    import rerun as rr

    shape = rows.shape[1:]
    if is_image(shape, rows.dtype.name):
        color = "L" if len(shape) == 2 or shape[2] == 1 else "RGB" if shape[2] == 3 else "RGBA"
        image_format = rr.components.ImageFormat(width=shape[1], height=shape[0], color_model=color,
                                                 channel_datatype="U8")
        # Rerun's way to log many frames of one size: the format once, the pixels as a column.
        rec.log(entity, rr.Image.from_fields(format=image_format), static=True)
        rec.send_columns(entity, indexes=[_steps(len(rows))],
                         columns=rr.Image.columns(buffer=np.ascontiguousarray(rows).reshape(len(rows), -1)))
        return
    if not shape:
        _send_scalars(rec, entity, rows)
        return
    flat = rows.reshape(len(rows), -1)
    for i, name in enumerate(entry_names(schema, feature, shape)):
        _send_scalars(rec, f"{entity}/{_part(name)}", flat[:, i])


def _send_scalars(rec: Any, entity: str, values: np.ndarray) -> None:
    import rerun as rr

    rec.send_columns(entity, indexes=[_steps(len(values))],
                     columns=rr.Scalars.columns(scalars=np.asarray(values, dtype=np.float64)))


def _steps(n: int) -> Any:
    import rerun as rr

    return rr.TimeColumn(TIMELINE, sequence=np.arange(n))


def _part(name: str) -> str:
    """``name`` as one entity path part (a ``/`` in a LeRobot name would split it)."""
    import rerun as rr

    return rr.escape_entity_path_part(name)


def _describe(e: EpisodeInfo) -> str:
    """The episode's record as a Markdown list, for the ``episode`` document."""
    rows = {"episode": e.key, "task": e.task_id or "(none)", "role": e.role, "length": e.length,
            "success": e.success, "return": e.ret, "terminated": e.terminated, "seed": e.seed,
            "policy version": e.policy_version, "attrs": json.dumps(e.attrs)}
    return "\n".join(f"- **{k}**: {v}" for k, v in rows.items())
