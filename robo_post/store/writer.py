"""One writer per shard: buffer an episode's steps, validate, commit atomically.

Commit protocol (why a killed writer never exposes a partial episode):

1. validate the whole episode in memory; on any problem raise and touch nothing;
2. append the step rows past the committed end of each array: full chunks to the
   array's zarr shard file, the partly filled last chunk raw into its region there
   (``chunks.ShardAppender``); already-committed rows are never rewritten in place;
3. append the episode record to ``episodes.jsonl``;
4. with ``fsync=True`` only: fdatasync every file steps 2-3 wrote or appended to,
   and fsync every directory in which they created a file;
5. atomically update the commit record ``commit.bin`` (see ``commit.py``), which
   is the only thing readers trust for how many episodes, steps and metadata
   bytes exist; with ``fsync=True`` it is then fdatasync'd.

A crash before step 5 leaves bytes past the committed end, which readers ignore
and the next writer of the shard overwrites. The writer's own state (counts,
chunk tails) only advances once step 5 succeeded, so a failed commit leaves it
in step with the disk.

Durability: with the default ``fsync=True``, ``commit()`` returns only once the
episode and its commit record are on disk, so it survives power loss (6
fdatasyncs per episode of four arrays). With ``fsync=False`` there is no sync call
on the commit path: a commit is still atomic and survives the writer process
being killed at any point (the page cache outlives the process), but after an OS
crash or power loss the most recent episodes may be lost: the commit record can
reach the disk before their data, and ``robo-post store validate`` then reports
them as failing their checksum.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import TYPE_CHECKING, Any, Mapping

import crc32c
import numpy as np
import zarr

from robo_post.store.chunks import SyncSet, new_array, open_appender, pwrite_all
from robo_post.store.commit import CommitRecord, inspect_commit
from robo_post.store.schema import (
    MAX_EXACT_INT,
    STEP_COLUMNS,
    ArraySpec,
    EpisodeValidationError,
    ShardDamagedError,
    ShardLockedError,
    StoreIntegrityError,
    UnsupportedFormatError,
    check_episode_size,
    check_name,
    check_role,
    stack_field,
    validate_array,
)
from robo_post.utils.io import try_lock

if TYPE_CHECKING:
    from robo_post.store.store import Store

# Target bytes per chunk along time. Rows of a partly filled chunk that compresses are
# written twice (raw to its region, then in the sealed chunk), so chunks stay small
# next to an episode's bytes.
CHUNK_BYTES = 1 << 19
_COL = {name: i for i, name in enumerate(STEP_COLUMNS)}
_FLAG_COLS = [_COL[name] for name in ("terminated", "truncated", "intervention")]  # 0 or 1


# An episode record (one line of episodes.jsonl) ends with this key and the CRC32C of
# the line's bytes before it, so a changed byte in the metadata is caught on read.
META_CRC_KEY = "meta_crc32c"
_META_CRC_SUFFIX = f', "{META_CRC_KEY}": '.encode()


def encode_record(meta: Mapping[str, Any]) -> bytes:
    """One ``episodes.jsonl`` line: ``meta`` as JSON, its CRC32C appended as the last key."""
    body = json.dumps(meta, allow_nan=False)[:-1].encode()  # without the closing brace
    return body + _META_CRC_SUFFIX + str(crc32c.crc32c(body)).encode() + b"}\n"


def decode_record(line: bytes) -> dict[str, Any]:
    """Parse one ``episodes.jsonl`` line (without its newline), checking its CRC32C when
    it has one (records of earlier releases do not). Raises ``ValueError``."""
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if META_CRC_KEY in record:
        cut = line.rfind(_META_CRC_SUFFIX)
        if cut < 0 or record[META_CRC_KEY] != crc32c.crc32c(line[:cut]):
            raise ValueError("record fails its checksum")
    return record


def time_chunk(spec: ArraySpec) -> int:
    """Rows per chunk so one chunk holds about CHUNK_BYTES (16..1024 rows)."""
    return int(np.clip(CHUNK_BYTES // max(spec.step_nbytes, 1), 16, 1024))


def episode_checksum(arrays: Mapping[str, np.ndarray]) -> int:
    """CRC32C over every stored array of an episode (observations, action, step table,
    extras), in a fixed key order: the ``crc32c`` package's SSE4.2 code, 0.1 ms per 64x64
    camera episode, 3x faster than google-crc32c's wheel and 9x faster than zlib."""
    crc = 0
    for key in sorted(arrays):
        crc = crc32c.crc32c(np.ascontiguousarray(arrays[key]).reshape(-1).view(np.uint8), crc)
    return crc


def lock_shard(path: str, shard: str) -> int:
    """Take shard ``shard``'s (directory ``path``) writer lock; returns the descriptor that holds it.

    Raises:
        ShardLockedError: another process holds it.
    """
    return try_lock(os.path.join(path, ".lock"),
                    lambda: ShardLockedError(f"shard {shard!r} is already open for writing by another process"))


class EpisodeWriter:
    """What every shard writer shares: buffering steps, validating an episode whole, and its
    record; where the episode goes is the subclass's (``_append``). One live writer per shard.

    Use ``add()`` once per step, then ``commit()`` (or ``discard()``). Or hand a
    whole episode to ``write_episode()``.

    Attributes:
        n_episodes, n_steps: what the shard commits (this writer's episodes included).
    """

    def __init__(self, store: "Store", client_id: str, fsync: bool):
        self.store = store
        self.client_id = check_name(client_id)
        self.fsync = fsync
        self.schema = store.schema
        self.n_episodes = self.n_steps = 0
        self._steps: list[dict[str, Any]] = []

    def _append(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        """Store one validated episode (``arrays``: name -> rows, ``meta``: its record) and commit
        it atomically, advancing ``n_episodes`` and ``n_steps`` only once it is committed."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the shard."""
        raise NotImplementedError

    # --- step-wise API --------------------------------------------------------
    def add(
        self,
        obs: Mapping[str, Any],
        action: Any,
        reward: float,
        terminated: bool = False,
        truncated: bool = False,
        policy_version: int = 0,
        intervention: bool = False,
        timestamp: float | None = None,
        behavior_logprob: float | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        """Buffer one step: ``obs`` is the observation the ``action`` was taken in;
        ``extras`` gives a value for every extra the schema declares (name -> value)."""
        self._steps.append(
            {
                "obs": obs,
                "action": action,
                "extras": extras or {},
                "step": (
                    reward,
                    terminated,
                    truncated,
                    policy_version,
                    intervention,
                    time.time() if timestamp is None else timestamp,
                    np.nan if behavior_logprob is None else behavior_logprob,
                ),
            }
        )

    @property
    def pending_steps(self) -> int:
        """Steps buffered by ``add()`` since the last commit/discard."""
        return len(self._steps)

    def discard(self) -> None:
        """Drop the buffered steps of the current episode."""
        self._steps = []

    def commit(self, final_obs: Mapping[str, Any] | None = None, *, role: str = "other", **meta: Any) -> int:
        """Validate and atomically append the buffered episode; return its index in the shard.

        Durable against power loss only with ``fsync=True`` (see the class docstring).

        Args:
            final_obs: the observation after the last action (used to bootstrap
                truncated episodes). Defaults to the last step's observation.
            role: where the episode came from, one of ``ROLES``.
            **meta: per-episode metadata, see ``write_episode``.
        """
        steps, self._steps = self._steps, []
        if not steps:
            raise EpisodeValidationError("steps", "episode is empty")
        self._check_size(len(steps))  # stacking the steps would copy them all
        obs_keys = set(self.schema.observations)
        for i, s in enumerate(steps):
            if set(s["obs"]) != obs_keys:
                raise _key_error("obs", set(s["obs"]), obs_keys, i)
            _check_extra_names(s["extras"], self.schema.extras, i)
        obs_rows = [s["obs"] for s in steps] + [final_obs if final_obs is not None else steps[-1]["obs"]]
        observations = {
            k: stack_field(f"obs/{k}", [o[k] for o in obs_rows], spec) for k, spec in self.schema.observations.items()
        }
        actions = stack_field("action", [s["action"] for s in steps], self.schema.action)
        extras = {
            k: stack_field(f"extras/{k}", [s["extras"][k] for s in steps], spec) for k, spec in self.schema.extras.items()
        }
        table = self._build_table(len(steps), *zip(*(s["step"] for s in steps)))  # one column per step field
        return self.write_episode(observations, actions, table=table, extras=extras, role=role, **meta)

    # --- whole-episode API ------------------------------------------------------
    def write_episode(
        self,
        observations: Mapping[str, np.ndarray],
        actions: np.ndarray,
        rewards: np.ndarray | None = None,
        terminated: np.ndarray | None = None,
        truncated: np.ndarray | None = None,
        policy_versions: np.ndarray | int = 0,
        interventions: np.ndarray | None = None,
        timestamps: np.ndarray | None = None,
        behavior_logprobs: np.ndarray | None = None,
        *,
        table: np.ndarray | None = None,
        task_id: str = "",
        instruction: str = "",
        seed: int | None = None,
        success: bool | None = None,
        policy_version: int | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
        attrs: Mapping[str, Any] | None = None,
        extras: Mapping[str, np.ndarray] | None = None,
        role: str = "other",
    ) -> int:
        """Validate and atomically append one whole episode of T steps (durable against
        power loss only with ``fsync=True``).

        Args:
            observations: key -> (T + 1, ...) array; row T is the observation after
                the last action. (T, ...) is accepted and the last row repeated.
            actions: (T, *action_shape).
            rewards, terminated, truncated, interventions, timestamps,
            behavior_logprobs: (T,) per-step columns (``table`` replaces them all).
            policy_versions: (T,) or one int for every step.
            task_id, instruction, seed, success, policy_version, start_time,
            end_time, attrs: per-episode metadata (``attrs`` must be JSON-serialisable).
            extras: name -> (T, ...) array for every extra the schema declares.
            role: where the episode came from, one of ``ROLES`` (``Snapshot.episodes``
                filters on it).

        Raises:
            EpisodeValidationError: naming the field and step; nothing is written.
            EpisodeTooLargeError: its arrays would take more than ``episode_byte_limit()``
                (a quarter of this machine's memory); refused before any copy of them.
        """
        actions = np.asarray(actions)
        T = len(actions) if actions.ndim else 0
        if T == 0:
            raise EpisodeValidationError("action", "episode is empty")
        # Before the first copy: broadcast or memory-mapped arrays can declare more rows than memory holds.
        self._check_size(T)
        if table is None:
            table = self._build_table(
                T, rewards, terminated, truncated, policy_versions, interventions, timestamps, behavior_logprobs
            )
        observations = dict(observations)
        obs_keys = set(self.schema.observations)
        if set(observations) != obs_keys:
            raise _key_error("obs", set(observations), obs_keys, None)
        for key, spec in self.schema.observations.items():
            arr = np.asarray(observations[key])
            if arr.ndim and len(arr) == T:
                arr = np.concatenate([arr, arr[-1:]])
            validate_array(f"obs/{key}", arr, spec, T + 1)
            observations[key] = arr.astype(spec.dtype, copy=False)
        validate_array("action", actions, self.schema.action, T)
        actions = actions.astype(self.schema.action.dtype, copy=False)
        extras = dict(extras or {})
        _check_extra_names(extras, self.schema.extras, None)
        for key, spec in self.schema.extras.items():
            arr = np.asarray(extras[key])
            validate_array(f"extras/{key}", arr, spec, T)
            extras[key] = arr.astype(spec.dtype, copy=False)
        self._validate_table(table, T)
        meta = self._episode_meta(T, table, task_id, instruction, seed, success, policy_version, start_time, end_time, attrs)
        meta["role"] = check_role(role)

        arrays = {f"obs/{k}": v for k, v in observations.items()}
        arrays["action"] = actions
        arrays["step"] = table
        arrays.update({f"extras/{k}": v for k, v in extras.items()})
        meta["crc32c"] = episode_checksum(arrays)
        meta["fsync"] = self.fsync  # what validate's diagnosis of lost data depends on
        self._append(arrays, meta)
        return self.n_episodes - 1

    def _check_size(self, T: int) -> None:
        """``EpisodeTooLargeError`` for an episode of ``T`` steps too large to write and read back here."""
        check_episode_size(self.schema, f"{self.client_id}/{self.n_episodes}", T, "not written")

    @staticmethod
    def _build_table(T, rewards, terminated, truncated, policy_versions, interventions, timestamps, logprobs):
        table = np.zeros((T, len(STEP_COLUMNS)), dtype=np.float64)
        now = time.time()
        columns = {
            "reward": rewards,
            "terminated": terminated,
            "truncated": truncated,
            "policy_version": policy_versions,
            "intervention": interventions,
            "timestamp": now if timestamps is None else timestamps,
            "behavior_logprob": np.nan if logprobs is None else logprobs,
        }
        for name, values in columns.items():
            if values is None:
                continue
            values = np.asarray(values)
            # numpy would parse strings ("1.0" -> 1.0) and fail on others untyped.
            if values.dtype.kind not in "biuf":
                raise EpisodeValidationError(name, f"dtype {values.dtype}, expected numbers")
            values = np.asarray(values, dtype=np.float64)
            if values.ndim and values.shape != (T,):
                raise EpisodeValidationError(name, f"shape {values.shape}, expected ({T},) to match the actions")
            table[:, _COL[name]] = values
        return table

    @staticmethod
    def _validate_table(table: np.ndarray, T: int) -> None:
        if table.shape != (T, len(STEP_COLUMNS)):
            raise EpisodeValidationError("step", f"table shape {table.shape}, expected ({T}, {len(STEP_COLUMNS)})")
        # Every rule as one (T, column) mask, so a valid episode costs a few whole-table ops.
        bad = ~np.isfinite(table)
        logprob = _COL["behavior_logprob"]
        if np.isnan(table[:, logprob]).all():
            bad[:, logprob] = False  # NaN on every step: not recorded (NaN on only some steps is bad)
        flags = table[:, _FLAG_COLS]
        bad[:, _FLAG_COLS] |= (flags != 0) & (flags != 1)
        pv = table[:, _COL["policy_version"]]
        # Versions read back as int64 and float64: whole numbers in [0, 2**53) only.
        bad[:, _COL["policy_version"]] |= (pv < 0) | (pv >= MAX_EXACT_INT) | (pv != np.round(pv))
        if bad.any():
            j = int(np.flatnonzero(bad.any(axis=0))[0])
            i = int(np.flatnonzero(bad[:, j])[0])
            raise EpisodeValidationError(STEP_COLUMNS[j], f"invalid value {table[i, j]!r}", i)
        ends = table[:-1, _COL["terminated"]] + table[:-1, _COL["truncated"]]
        if ends.any():
            raise EpisodeValidationError("terminated", "episode ends before its last step", int(np.flatnonzero(ends)[0]))

    def _episode_meta(self, T, table, task_id, instruction, seed, success, policy_version, start_time, end_time, attrs):
        for name, value in (("task_id", task_id), ("instruction", instruction)):
            if not isinstance(value, str):
                raise EpisodeValidationError(name, f"must be a string, got {type(value).__name__}")
        if seed is not None and not isinstance(seed, (int, np.integer)):
            raise EpisodeValidationError("seed", f"must be an int or None, got {seed!r}")
        if success is not None and not isinstance(success, (bool, np.bool_)):
            raise EpisodeValidationError("success", f"must be a bool or None, got {success!r}")
        if policy_version is not None and (
            isinstance(policy_version, (bool, np.bool_))
            or not isinstance(policy_version, (int, np.integer))
            or not 0 <= policy_version < MAX_EXACT_INT
        ):
            raise EpisodeValidationError("policy_version", f"must be an int in [0, 2**53), got {policy_version!r}")
        for name, value in (("start_time", start_time), ("end_time", end_time)):
            if value is not None and (
                isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating))
                or not np.isfinite(value)
            ):
                raise EpisodeValidationError(name, f"must be a finite number or None, got {value!r}")
        try:
            # Must read back equal: JSON turns tuples into lists and keys into strings.
            if json.loads(json.dumps(dict(attrs or {}), allow_nan=False)) != dict(attrs or {}):
                raise ValueError("it would not read back equal (tuples or non-string keys?)")
        except (TypeError, ValueError) as e:
            raise EpisodeValidationError("attrs", f"not JSON-serialisable: {e}") from None
        ts = table[:, _COL["timestamp"]]
        pv = table[:, _COL["policy_version"]]
        with np.errstate(over="ignore"):  # an overflow is refused right below
            ret = float(table[:, _COL["reward"]].sum())
        if not np.isfinite(ret):
            raise EpisodeValidationError("reward", f"the episode's return overflows float64 ({ret})")
        return {
            "episode": self.n_episodes,
            "client_id": self.client_id,
            "task_id": task_id,
            "instruction": instruction,
            "seed": None if seed is None else int(seed),
            "success": None if success is None else bool(success),
            "length": T,
            "step_start": self.n_steps,
            "obs_start": self.n_steps + self.n_episodes,
            "policy_version": int(pv.max() if policy_version is None else policy_version),
            "terminated": bool(table[-1, _COL["terminated"]]),
            "start_time": float(ts[0] if start_time is None else start_time),
            "end_time": float(ts[-1] if end_time is None else end_time),
            "return": ret,
            "attrs": dict(attrs or {}),
        }

    def __enter__(self) -> "EpisodeWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardWriter(EpisodeWriter):
    """Appends episodes to one shard of a store on a local disk (see the module docstring).
    One live writer per shard, held by a file lock.

    Args:
        store: the open store.
        client_id: shard name; must be a safe name (``check_name``).
        fsync: True (default): ``commit()`` returns only once the episode's files,
            the directories that gained new files and then the commit record are
            synced, so committed episodes survive power loss. False: a commit is
            atomic and survives the writer process being killed, but the most
            recent episodes may be lost in an OS crash or power loss; no sync calls.
    """

    def __init__(self, store: "Store", client_id: str, fsync: bool = True):
        super().__init__(store, client_id, fsync)
        self.path = os.path.join(store.root, "shards", self.client_id)
        os.makedirs(self.path, exist_ok=True)
        self._lock_fd = lock_shard(self.path, self.client_id)
        self._columns = {}
        try:
            self._recover()
            self._meta_fd = os.open(os.path.join(self.path, "episodes.jsonl"), os.O_WRONLY)
        except BaseException:  # e.g. a shard this version refuses: release it for the next try
            for column in self._columns.values():
                column.close()
            os.close(self._lock_fd)
            raise

    # --- recovery -----------------------------------------------------------
    def _recover(self) -> None:
        """Open (or create) the shard and drop anything past the last commit."""
        status = inspect_commit(self.path)
        if status.problem is not None:  # before any change: truncating the index would drop episodes
            raise ShardDamagedError(self.client_id, status.problem)
        commit = status.counts
        self.n_episodes, self.n_steps, self._meta_bytes = commit["episodes"], commit["steps"], commit["meta_bytes"]
        try:  # a short or damaged index would be padded (or cut) to the committed size below
            self.store.shard_episodes(self.client_id, commit)
        except StoreIntegrityError as e:
            raise StoreIntegrityError(f"shard {self.client_id!r}: {e}; nothing was changed (`robo-post store repair "
                                      "--apply` cuts the damage out and keeps every intact episode; until then new "
                                      "episodes can go to another shard or store)") from None
        meta_path = os.path.join(self.path, "episodes.jsonl")
        with open(meta_path, "ab") as f:  # creates the file on first open
            f.truncate(self._meta_bytes)
        data = os.path.join(self.path, "data")
        specs = {f"obs/{k}": s for k, s in self.schema.observations.items()}
        specs["action"] = self.schema.action
        specs["step"] = ArraySpec("float64", (len(STEP_COLUMNS),))
        specs.update({f"extras/{k}": s for k, s in self.schema.extras.items()})
        name = None
        try:
            root = zarr.open_group(data, mode="a")
            for group in sorted({name.rsplit("/", 1)[0] for name in specs if "/" in name}):
                # A group's zarr.json holds no data: one lost (readers do without it) is written again.
                root.require_group(group)
            for name, spec in specs.items():
                if name in root:
                    arr = root[name]
                else:
                    arr = new_array(root, name, spec.dtype, spec.shape, time_chunk(spec))
                end = self.n_steps + self.n_episodes if name.startswith("obs/") else self.n_steps
                self._columns[name] = open_appender(arr, end, self.fsync)
        except UnsupportedFormatError:
            raise
        except Exception as e:  # a damaged zarr.json or tail chunk: zarr and the codecs raise almost anything
            where = data if name is None else os.path.join(data, name)
            detail = str(e) if isinstance(e, StoreIntegrityError) else repr(e)
            raise StoreIntegrityError(f"shard {self.client_id!r}: cannot append to {where}: {detail} (`robo-post "
                                      "store validate` lists the damaged episodes; new ones can go to another "
                                      "client id)") from e
        self._commit = CommitRecord(self.path, commit, self.fsync)
        if self.fsync:
            self._sync_layout(root)

    def _sync_layout(self, root: zarr.Group) -> None:
        """Make the shard's files and directories as created so far durable: each
        commit only syncs what it writes itself. Cheap when nothing is dirty."""
        sync = SyncSet()
        sync.add_path(os.path.join(self.path, "episodes.jsonl"))
        sync.add_dir(os.path.join(self.store.root, "shards"))
        sync.add_dir(self.path)
        for name in self._columns:  # data/, data/obs/, data/<array>/ and their zarr.json
            parts = name.split("/")
            for depth in range(len(parts) + 1):
                directory = os.path.join(str(root.store.root), *parts[:depth])
                sync.add_path(os.path.join(directory, "zarr.json"))
                sync.add_dir(directory)
        sync.sync()

    def _append(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        line, T = encode_record(meta), meta["length"]

        # Nothing in memory advances until the commit record is written: a failure on the
        # way leaves the writer in step with the committed state on disk.
        sync = SyncSet() if self.fsync else None
        try:
            tails = {name: self._columns[name].write(values, sync) for name, values in arrays.items()}
            pwrite_all(self._meta_fd, [line], self._meta_bytes)
            if sync is not None:  # the data first: the record must never point at lost bytes
                os.fdatasync(self._meta_fd)
                sync.sync()
        finally:
            if sync is not None:
                sync.close()
        index = self.n_episodes
        commit = {"episodes": index + 1, "steps": self.n_steps + T, "meta_bytes": self._meta_bytes + len(line)}
        self._commit.write(commit)  # the episode is visible from here on
        self.n_episodes, self.n_steps, self._meta_bytes = commit["episodes"], commit["steps"], commit["meta_bytes"]
        for name, tail in tails.items():
            self._columns[name].advance(tail)
        self._commit.sync()

    def close(self) -> None:
        """Move each array's partial last chunk into zarr, then release the shard lock
        (the OS also releases it if the process dies; readers then use the raw regions)."""
        if self._lock_fd is not None:
            for column in self._columns.values():
                column.flush()
                column.close()
            os.close(self._meta_fd)
            self._commit.close()
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None


def _check_extra_names(given: Mapping[str, Any], declared: Mapping[str, ArraySpec], step: int | None) -> None:
    """Raise naming the first declared extra missing from ``given``, or the first unknown one."""
    for name in declared:
        if name not in given:
            raise EpisodeValidationError(f"extras/{name}", "missing: the schema declares it for every step", step)
    for name in given:
        if name not in declared:
            raise EpisodeValidationError(f"extras/{name}", f"not declared in the schema (extras: {sorted(declared)})", step)


def _key_error(field: str, got: set, want: set, step: int | None) -> EpisodeValidationError:
    missing, unknown = sorted(want - got), sorted(got - want)
    parts = ([f"missing keys {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else [])
    return EpisodeValidationError(field, "; ".join(parts), step)
