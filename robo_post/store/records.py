"""What a store records and reads back, whatever its backend: episode records, snapshots
(consistent views of committed episodes), the schema file, and the names ``store repair`` gives
to what it sets aside."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import crc32c
import numpy as np
import zarr

from robo_post.store.chunks import read_rows
from robo_post.store.schema import (
    STEP_COLUMNS,
    InvalidNameError,
    SchemaVersionError,
    StoreError,
    StoreIntegrityError,
    StoreSchema,
    check_episode_size,
    infer_role,
)
from robo_post.store.writer import episode_checksum

if TYPE_CHECKING:
    from robo_post.store.store import Store

SALVAGE_SUFFIX = "-salvaged"
"""``store repair`` copies the intact episodes past a shard's damage into shard ``<shard>-salvaged``."""

LOST_SUFFIX = ".saw-lost-episodes"
"""``store repair`` sets a snapshot record that saw episodes lost since aside as ``<id>.json`` + this."""


class Unrepairable(str):
    """A line of ``repair_store``'s answer about damage it cannot repair: it says why and what
    the user can do instead."""


@dataclass(frozen=True)
class EpisodeInfo:
    """Metadata of one committed episode (what ``episodes.jsonl`` holds)."""

    client_id: str
    episode: int
    task_id: str
    instruction: str
    seed: int | None
    success: bool | None
    length: int
    step_start: int
    obs_start: int
    policy_version: int
    terminated: bool
    start_time: float
    end_time: float
    attrs: dict
    checksum: int  # CRC32C over every stored array of the episode, see ``writer.episode_checksum``
    ret: float
    role: str  # one of ``ROLES``; inferred from the shard's name in records written without one
    fsync: bool | None = None  # whether its writer synced commits; None in records of earlier releases

    @property
    def key(self) -> str:
        """Store-wide episode id: ``client/index``."""
        return f"{self.client_id}/{self.episode}"

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "EpisodeInfo":
        return cls(
            r["client_id"], r["episode"], r["task_id"], r["instruction"], r["seed"], r["success"], r["length"],
            r["step_start"], r["obs_start"], r["policy_version"], r["terminated"], r["start_time"], r["end_time"],
            r["attrs"], r["crc32c"], r["return"], r.get("role") or infer_role(r["client_id"]), r.get("fsync"),
        )


class Snapshot:
    """Read-only view of a fixed set of committed episodes across all shards.

    Committed rows are never rewritten, so a snapshot reopened by id later sees
    byte-identical data.

    Args:
        store: the store.
        snapshot_id: its id.
        counts: shard -> committed counts it covers.
        verify: ``load`` and ``load_shard`` check the checksum of every episode they
            read and raise ``StoreIntegrityError`` naming the first that fails.

    Attributes:
        recorded: whether ``snapshots/<id>.json`` exists, so ``store.snapshot(id)``
            can reopen it.
    """

    def __init__(self, store: Store, snapshot_id: str, counts: dict[str, dict[str, int]], verify: bool = True):
        self.store = store
        self.id = snapshot_id
        self.counts = counts
        self.verify = verify
        self.recorded = True
        self._episodes: list[EpisodeInfo] = []
        self._by_shard: dict[str, list[EpisodeInfo]] = {}
        for shard, c in sorted(counts.items()):
            self._by_shard[shard] = store.shard_episodes(shard, c)
            self._episodes.extend(self._by_shard[shard])
        self._arrays: dict[str, dict[str, zarr.Array]] = {}

    def __len__(self) -> int:
        return len(self._episodes)

    @property
    def num_steps(self) -> int:
        return sum(e.length for e in self._episodes)

    def episodes(
        self,
        task: str | Iterable[str] | None = None,
        client: str | Iterable[str] | None = None,
        policy_version: int | Iterable[int] | None = None,
        min_policy_version: int | None = None,
        success: bool | None = None,
        since: float | None = None,
        until: float | None = None,
        role: str | Iterable[str] | None = None,
    ) -> list[EpisodeInfo]:
        """Episodes matching every given filter (times compare against ``end_time``;
        ``role``: one of ``ROLES`` or several)."""

        def _set(x):
            return None if x is None else ({x} if isinstance(x, (str, int)) else set(x))

        tasks, clients, versions, roles = _set(task), _set(client), _set(policy_version), _set(role)
        return [
            e
            for e in self._episodes
            if (tasks is None or e.task_id in tasks)
            and (clients is None or e.client_id in clients)
            and (versions is None or e.policy_version in versions)
            and (min_policy_version is None or e.policy_version >= min_policy_version)
            and (success is None or e.success == success)
            and (since is None or e.end_time >= since)
            and (until is None or e.end_time <= until)
            and (roles is None or e.role in roles)
        ]

    def new_since(self, previous: "Snapshot | None") -> list[EpisodeInfo]:
        """Episodes in this snapshot that ``previous`` did not have (for online learning)."""
        if previous is None:
            return list(self._episodes)
        seen = {s: c["episodes"] for s, c in previous.counts.items()}
        return [e for e in self._episodes if e.episode >= seen.get(e.client_id, 0)]

    def _shard_arrays(self, shard: str) -> dict[str, zarr.Array]:
        if shard not in self._arrays:
            if shard not in self.counts:
                raise InvalidNameError(f"shard {shard!r} is not in snapshot {self.id}")
            path = os.path.join(self.store.root, "shards", shard, "data")
            names = array_names(self.store.schema)
            name = None
            try:
                group = zarr.open_group(path, mode="r")
                arrays = {}
                for name in names:
                    arrays[name] = group[name]
            except Exception as e:  # a missing or damaged zarr.json: zarr raises KeyError, JSON or OS errors
                lost = self.store.lost_arrays(shard)
                if lost:  # no metadata to write again: the rows are gone with the folder
                    raise StoreIntegrityError(f"shard {shard}: {describe_lost(lost)}, so none of its episodes reads "
                                              "whole (`robo-post store repair --apply` leaves them out)") from e
                where = path if name is None else os.path.join(path, name)
                meta = os.path.join(where, "zarr.json")
                reason = "its zarr.json is missing" if not os.path.exists(meta) else repr(e)
                raise StoreIntegrityError(f"shard {shard}: {where} unreadable: {reason} (`robo-post store repair "
                                          "--apply` writes lost array metadata again)") from e
            self._arrays[shard] = arrays
        return self._arrays[shard]

    def _read(self, shard: str, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo..hi`` of array ``name`` of a shard in this snapshot."""
        arr = self._shard_arrays(shard)[name]  # typed error for a shard outside the snapshot
        c = self.counts[shard]
        end = c["steps"] + c["episodes"] if name.startswith("obs/") else c["steps"]
        return read_rows(arr, lo, hi, end)

    def load(self, episode: EpisodeInfo) -> dict[str, Any]:
        """Load one episode as numpy arrays.

        Returns a dict with ``obs`` (key -> (T + 1, ...); row T is the final
        observation), ``action`` (T, ...), ``extras`` (name -> (T, ...); empty when
        the schema declares none), one (T,) array per step column (``reward``,
        ``terminated``, ``truncated``, ``policy_version``, ``intervention``,
        ``timestamp``, ``behavior_logprob``) and ``info``.

        Raises:
            EpisodeTooLargeError: its record declares more steps than fit ``episode_byte_limit()``;
                nothing is read.
        """
        shard, T, s0, o0 = episode.client_id, episode.length, episode.step_start, episode.obs_start
        schema = self.store.schema
        check_episode_size(schema, episode.key, T, "not read")  # a damaged record may declare any length
        ranges = {f"obs/{k}": (o0, o0 + T + 1) for k in schema.observations}
        ranges.update({"action": (s0, s0 + T), "step": (s0, s0 + T)})
        ranges.update({f"extras/{k}": (s0, s0 + T) for k in schema.extras})
        arrays = self._read_checked(shard, ranges, episode.key)
        if self.verify:
            self._check(episode, arrays)
        out = unpack(schema, arrays)
        out.update(split_table(arrays["step"]))
        out["info"] = episode
        return out

    def _read_checked(self, shard: str, ranges: dict[str, tuple[int, int]], what: str) -> dict[str, np.ndarray]:
        """Rows ``lo..hi`` of each named array; any failure to decode them (a damaged
        file makes zarr or the codec raise almost anything) as ``StoreIntegrityError``."""
        arrays = {}
        for name, (lo, hi) in ranges.items():
            try:
                arrays[name] = self._read(shard, name, lo, hi)
            except (StoreError, InvalidNameError):
                raise
            except Exception as e:
                path = os.path.join(self.store.root, "shards", shard, "data", name)
                raise StoreIntegrityError(f"{what}: data of {name} unreadable ({path}): {e!r}") from e
        return arrays

    def _check(self, episode: EpisodeInfo, arrays: dict[str, np.ndarray]) -> None:
        if episode_checksum(arrays) != episode.checksum:
            raise StoreIntegrityError(
                f"episode {episode.key} fails its checksum: its data changed after commit "
                f"(`robo-post store validate {self.store.root}` lists every damaged episode)"
            )

    def load_shard(self, shard: str) -> dict[str, Any]:
        """Every committed row of a shard in one read: ``obs``, ``action``, ``step`` table,
        ``extras`` (name -> rows; empty when the schema declares none). ``EpisodeTooLargeError``
        before any read when one of its episodes declares more steps than fit ``episode_byte_limit()``."""
        self._shard_arrays(shard)  # typed error for a shard outside the snapshot
        for ep in self._by_shard[shard]:
            check_episode_size(self.store.schema, ep.key, ep.length, "not read")
        c = self.counts[shard]
        n_obs, schema = c["steps"] + c["episodes"], self.store.schema
        ranges = {f"obs/{k}": (0, n_obs) for k in schema.observations}
        ranges.update({"action": (0, c["steps"]), "step": (0, c["steps"])})
        ranges.update({f"extras/{k}": (0, c["steps"]) for k in schema.extras})
        arrays = self._read_checked(shard, ranges, f"shard {shard}")
        if self.verify:
            for ep in self._by_shard[shard]:
                T, s0, o0 = ep.length, ep.step_start, ep.obs_start
                self._check(ep, {
                    name: rows[o0 : o0 + T + 1] if name.startswith("obs/") else rows[s0 : s0 + T]
                    for name, rows in arrays.items()
                })
        return {**unpack(schema, arrays), "step": arrays["step"]}

    def __iter__(self) -> Iterator[EpisodeInfo]:
        return iter(self._episodes)


def array_names(schema: StoreSchema) -> list[str]:
    """The stored arrays of an episode, as ``episode_checksum`` names them."""
    return [f"obs/{k}" for k in schema.observations] + ["action", "step"] + [f"extras/{k}" for k in schema.extras]


def unpack(schema: StoreSchema, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Stored arrays by name -> ``obs`` (key -> rows), ``action`` and ``extras`` (name -> rows)."""
    return {
        "obs": {k: arrays[f"obs/{k}"] for k in schema.observations},
        "action": arrays["action"],
        "extras": {k: arrays[f"extras/{k}"] for k in schema.extras},
    }


def same_layout(store: Any, schema: StoreSchema) -> Any:
    """``store`` (an existing store opened again), if its layout is ``schema``'s; else a ``StoreError``."""
    differences = store.schema.layout_differences(schema)
    if differences:
        raise StoreError(f"store at {store.root} has a different schema than requested (stored != requested): "
                         + "; ".join(differences))
    return store


def write_salvaged(writer: Any, schema: StoreSchema, rows: dict[str, np.ndarray], ep: EpisodeInfo) -> None:
    """Write again an episode that repair salvages: its ``rows`` (``obs/K``, ``action``, ``step``,
    ``extras/K`` arrays) and its metadata, its old key recorded as ``salvaged_from``."""
    writer.write_episode(
        {k: rows[f"obs/{k}"] for k in schema.observations}, rows["action"], table=rows["step"],
        extras={k: rows[f"extras/{k}"] for k in schema.extras}, task_id=ep.task_id,
        instruction=ep.instruction, seed=ep.seed, success=ep.success, policy_version=ep.policy_version,
        start_time=ep.start_time, end_time=ep.end_time, attrs={**ep.attrs, "salvaged_from": ep.key},
        role=ep.role,
    )


def describe_lost(lost: dict[str, list[str]]) -> str:
    """``Store.lost_arrays``'s answer in words: ``.../data/action is a file, not a folder: the
    rows of action are gone``."""
    def what(path: str) -> str:
        if not os.path.lexists(path):
            return "is missing"
        return "is a file, not a folder" if os.path.isfile(path) else "is not a folder"

    return "; ".join(f"{path} {what(path)}: the rows of {', '.join(names)} are gone" for path, names in lost.items())


def parse_schema(data: bytes, path: str) -> StoreSchema:
    """The schema in the bytes of a ``store.json`` (read from ``path``, named in errors).

    Raises:
        SchemaVersionError: written by a newer version.
        StoreIntegrityError: damaged or not a store schema.
    """
    try:
        meta = json.loads(data)
        crc = meta.pop("crc32c", None) if isinstance(meta, dict) else None  # absent in stores of earlier releases
        schema = StoreSchema.from_json(meta)  # first: a newer version's file is its to check
        if crc is not None and crc != schema_crc(meta):
            raise ValueError("its content fails its checksum")
    except SchemaVersionError:
        raise
    except (StoreError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreIntegrityError(f"{path}: damaged or not a store schema: {e} (it holds only the store's schema: "
                                  "the store.json of a store collected from the same env and env kwargs can "
                                  "replace it; the episodes are untouched)") from None
    return schema


def schema_bytes(schema: StoreSchema) -> bytes:
    """A ``store.json``'s bytes: the schema and the CRC32C that ``parse_schema`` checks."""
    meta = schema.to_json()
    return json.dumps({**meta, "crc32c": schema_crc(meta)}).encode()


def schema_crc(meta: dict[str, Any]) -> int:
    """CRC32C of a schema's JSON in a canonical form (sorted keys), as kept in ``store.json``."""
    normal = json.loads(json.dumps(meta))  # keys as JSON gives them back (strings), so they sort
    return crc32c.crc32c(json.dumps(normal, sort_keys=True).encode())


def split_table(table: np.ndarray) -> dict[str, np.ndarray]:
    cols = {name: table[:, i] for i, name in enumerate(STEP_COLUMNS)}
    for name in ("terminated", "truncated", "intervention"):
        cols[name] = cols[name].astype(bool)
    cols["policy_version"] = cols["policy_version"].astype(np.int64)
    return cols


def index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0..2, 5"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
