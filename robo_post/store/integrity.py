"""Full integrity scan of a store (``robo-post store validate``), and rebuilding lost
or damaged commit records (``robo-post store repair``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import zarr

from robo_post.store.chunks import read_rows
from robo_post.store.commit import inspect_commit, write_commit_file
from robo_post.store.registry import PolicyRegistry, check_policies_folder, version_problems
from robo_post.store.schema import (
    ROLES,
    EpisodeTooLargeError,
    EpisodeValidationError,
    StoreError,
    StoreIntegrityError,
    StoreLayoutError,
    UnsupportedFormatError,
    check_episode_size,
    validate_array,
)
from robo_post.store.records import (LOST_SUFFIX, SALVAGE_SUFFIX, Unrepairable, array_names, index_ranges,
                                     write_salvaged)
from robo_post.store.store import EpisodeInfo, Snapshot, Store, describe_lost
from robo_post.store.writer import decode_record, episode_checksum, lock_shard
from robo_post.utils.io import is_object_url


class EpisodeDataError(StoreIntegrityError):
    """A committed episode's data is unreadable or fails its checksum.

    Attributes:
        shard: the shard.
        episode: the episode's index in the shard.
        trailing: every episode from this one to the shard's last one fails too, the
            pattern an OS crash or power loss leaves behind a writer with ``fsync=False``.
        fsync: whether the failing episodes were written with ``fsync=True`` (all of
            them), False (all without), None (unknown: records of earlier releases, or mixed).
    """

    def __init__(self, shard: str, episode: int, n_episodes: int, trailing: bool, reason: str,
                 fsync: bool | None = None):
        self.shard, self.episode, self.trailing = shard, episode, trailing
        message = f"{shard}/{episode}: {reason}"
        if trailing:
            which = "it is the shard's last episode" if episode == n_episodes - 1 else (
                f"so do all the shard's last {n_episodes - episode} episodes ({episode}..{n_episodes - 1})"
            )
            if fsync is False:
                message += (
                    f"; {which}: the data likely never reached the disk"
                    " (OS crash or power loss while written with fsync=False)"
                )
            elif fsync:
                # Synced before their commit records: a crash does not explain the loss.
                message += f"; {which}, written with fsync=True: the data was damaged or truncated after commit"
            else:
                message += (
                    f"; {which}: if written with fsync=False, the data likely never reached the disk"
                    " (OS crash or power loss); otherwise it was damaged after commit"
                )
            message += "; `robo-post store repair --apply` drops " + ("it" if episode == n_episodes - 1 else "them")
        else:
            message += (" (data changed after commit; `robo-post store repair --apply` cuts it out and keeps"
                        " the intact episodes after it)")
        super().__init__(message)


def validate_store(root: str) -> tuple[int, list[str]]:
    """Re-read and re-check everything committed in the store at ``root``.

    Returns ``(episodes_checked, problems)``; an empty problem list means healthy.
    Checks: schema (and its checksum), each shard's commit record (a missing or
    damaged one is a problem, with how many verified episode records lie past the
    record in use), commit record vs. ``episodes.jsonl`` (sizes, record checksums,
    contiguous row ranges), array extents, per-episode checksum, schema constraints on every row (extras too),
    known episode roles, that no shard commits fewer episodes than a recorded snapshot
    saw (a shard deleted whole), that every folder of the store is one (not a file), and
    that every published policy has loadable weights and config. An episode that is unreadable
    or fails its checksum is reported as an ``EpisodeDataError`` (naming shard and
    episode index, and whether the shard's trailing episodes all fail).
    """
    if is_object_url(root):  # the same checks, on the layout of object storage
        from robo_post.store.bucket import snapshot_ids, validate_bucket

        checked, problems = validate_bucket(root)
        try:
            recorded = snapshot_ids(root)
        except StoreError:  # the store does not open: validate_bucket said so
            return checked, problems
        return checked, problems + version_problems(PolicyRegistry(root), recorded,
                                                    lambda snapshot: f"{root}/snapshots/{snapshot}.json")
    try:
        store = Store.open(root, verify=False)
    except (StoreError, OSError, ValueError, KeyError) as e:
        return 0, [f"cannot open store: {e}"]
    problems = [str(e) for e in _layout_errors(store)]
    counts: dict[str, dict[str, int]] = {}
    committed: dict[str, tuple[int, int] | None] = {}  # (episodes, seq); None: damaged record (reported below)
    for shard in store.shards(strict=False):  # a file in the place of one: reported above
        path = os.path.join(store.root, "shards", shard)
        try:
            status = inspect_commit(path)
        except UnsupportedFormatError as e:
            return 0, [f"cannot open store: {e}"]
        committed[shard] = None if status.problem is not None else (status.counts["episodes"], status.seq)
        if status.problem is not None:
            hidden = len(scan_index(store, shard).good) - (status.counts or {"episodes": 0})["episodes"]
            note = f"; episodes.jsonl holds {hidden} complete records past it" if status.counts and hidden > 0 else ""
            problems.append(f"shard {shard}: {status.problem}{note} (`robo-post store repair` rebuilds the record)")
        if status.counts is None or status.counts["episodes"] == 0:
            continue
        try:
            store.shard_episodes(shard, status.counts)
        except (StoreError, OSError) as e:
            problems.append(f"shard {shard}: {e}")
            continue
        counts[shard] = status.counts
    snap = Snapshot(store, "validate", counts, verify=False)
    checked = 0
    schema = store.schema
    by_shard: dict[str, list] = {}
    for ep in snap:
        by_shard.setdefault(ep.client_id, []).append(ep)
    for shard, eps in by_shard.items():
        steps = 0
        for ep in eps:  # row ranges: checked when the snapshot read the records
            if ep.role not in ROLES:
                problems.append(f"{ep.key}: unknown role {ep.role!r}")
            steps += ep.length
        try:
            data = snap.load_shard(shard)
        except Exception:  # any zarr/codec failure means unreadable data: find which episodes
            data = None
            try:
                snap._shard_arrays(shard)
            except StoreIntegrityError as e:  # an array's metadata: it names the array, no episode is to blame
                problems.append(str(e))
                continue
        if data is not None and min(len(a) for a in (data["action"], data["step"], *data["extras"].values())) < steps:
            problems.append(f"shard {shard}: arrays shorter than committed steps")
            continue
        bad: dict[int, str] = {}
        for ep in eps:
            T, s0, o0 = ep.length, ep.step_start, ep.obs_start
            if data is None:
                try:
                    check_episode_size(schema, ep.key, T, "not checked")
                except EpisodeTooLargeError as e:  # damaged, or written on a larger machine: not for this one to judge
                    problems.append(str(e))
                    continue
                ranges = {f"obs/{k}": (o0, o0 + T + 1) for k in schema.observations}
                ranges.update(action=(s0, s0 + T), step=(s0, s0 + T))
                ranges.update({f"extras/{k}": (s0, s0 + T) for k in schema.extras})
                arrays = {}
                try:
                    for name, (lo, hi) in ranges.items():
                        arrays[name] = snap._read(shard, name, lo, hi)
                except Exception as e:
                    bad[ep.episode] = f"arrays unreadable: {name}: {e}"
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
            synced = {ep.fsync for ep in eps[first_trailing:]}
            fsync = synced.pop() if len(synced) == 1 else None
            problems.append(str(EpisodeDataError(shard, first_trailing, len(eps), True, bad[first_trailing], fsync)))
    problems += [f"{path}: damaged snapshot record: {shards!r} (`robo-post store repair` sets it aside)"
                 for _, path, shards in _snapshot_records(store.root) if isinstance(shards, Exception)]
    problems += [loss.problem for loss in _lost_since_snapshots(store.root, committed)]
    if os.path.isdir(os.path.join(store.root, "policies")):
        recorded = {name.removesuffix(".json") for name, _, _ in _snapshot_records(store.root)}
        problems += version_problems(PolicyRegistry(store.root), recorded,
                                     lambda snapshot: os.path.join(store.root, "snapshots", snapshot + ".json"))
    return checked, problems


def _snapshot_records(root: str) -> list[tuple[str, str, dict[str, int] | Exception]]:
    """``(name, path, {shard: episodes seen} or the error reading it)`` per recorded snapshot."""
    directory = os.path.join(root, "snapshots")
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json")) if os.path.isdir(directory) else []
    records = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                shards = {str(k): int(c["episodes"]) for k, c in json.loads(f.read())["shards"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            shards = e
        records.append((name, path, shards))
    return records


def _layout_errors(store: Store) -> list[StoreLayoutError]:
    """Every path where the store keeps a folder that is something else (e.g. a file)."""
    errors = store.layout_errors()
    try:
        check_policies_folder(store.root)
    except StoreLayoutError as e:
        errors.append(e)
    return errors


@dataclass
class LostEpisodes:
    """Episodes of a shard that a recorded snapshot saw and the shard no longer commits.

    Attributes:
        problem: what ``validate`` says about them.
        records: every snapshot record that saw more episodes of the shard than it commits.
    """

    problem: str
    records: list[str]


def _lost_since_snapshots(root: str, committed: dict[str, tuple[int, int] | None]) -> list[LostEpisodes]:
    """Shards that lost episodes a recorded snapshot saw: a shard deleted whole, or with its
    commit record and index, leaves nothing else to notice. Every commit raises the record's
    ``seq`` and adds episodes, so a shard with fewer episodes than a snapshot saw and a ``seq``
    below that count started over; one that ``store repair`` cut back has a higher ``seq``."""
    seen: dict[str, list[tuple[int, str, str]]] = {}  # shard -> (episodes seen, snapshot id, record) per record
    for name, path, shards in _snapshot_records(root):
        if not isinstance(shards, Exception):  # a damaged record is reported on its own
            for shard, n in shards.items():
                seen.setdefault(shard, []).append((n, name[: -len(".json")], path))
    losses = []
    for shard, records in sorted(seen.items()):
        n, snapshot_id, _ = max(records, key=lambda r: r[0])
        if shard not in committed:
            now = 0
            problem = f"shard {shard}: its directory is gone, yet snapshot {snapshot_id} saw {n} committed episodes in it"
        elif committed[shard] is not None and (now := committed[shard][0]) < n and committed[shard][1] < n:
            lost = f"episode {now} was" if now == n - 1 else f"episodes {now}..{n - 1} were"
            problem = f"shard {shard}: commits {now} episodes, yet snapshot {snapshot_id} saw {n}: {lost} lost"
        else:
            continue
        losses.append(LostEpisodes(problem, [path for seen_n, _, path in records if seen_n > now]))
    return losses


def lost_since_snapshots(store: Store) -> list[str]:
    """``validate``'s check that no shard lost episodes a recorded snapshot saw (a shard folder
    deleted whole), alone: it reads commit and snapshot records only, no episode data, so the
    commands that read or add to a store can say so before they use what is left."""
    if is_object_url(store.root):
        from robo_post.store.bucket import lost_since_snapshots as lost_in_bucket

        return lost_in_bucket(store)
    committed: dict[str, tuple[int, int] | None] = {}
    for shard in store.shards(strict=False):
        status = inspect_commit(os.path.join(store.root, "shards", shard))
        committed[shard] = None if status.problem is not None else (status.counts["episodes"], status.seq)
    return [loss.problem for loss in _lost_since_snapshots(store.root, committed)]


def warn_lost_shards(root: str, going_on: str) -> None:
    """Print a warning to stderr per shard of the store at ``root`` that lost episodes a recorded
    snapshot saw (``lost_since_snapshots``); ``going_on`` says what the command does anyway."""
    for problem in lost_since_snapshots(Store.open(root)):
        print(f"warning: {problem}: {going_on} (`robo-post store validate {root}`)", file=sys.stderr)


@dataclass
class IndexScan:
    """What ``scan_index`` found in a shard's ``episodes.jsonl``.

    Attributes:
        good: the longest run of episodes at the start of the index whose records are
            whole, pass their checksum, follow one another and whose data passes its
            checksum, as ``(episode, end offset of its record)``.
        stopped: why that run stopped (None: it covers the whole index).
        later: episodes past the run that verify on their own: a whole record whose data,
            at the rows it names, passes its checksum (rows after the run's and each other's).
        records: the complete (newline-terminated) records in the index.
        opened: the index and every array of the shard opened (False: nothing was checked).
    """

    good: list[tuple[EpisodeInfo, int]]
    stopped: str | None
    later: list[EpisodeInfo]
    records: int
    opened: bool = True


def _episode_rows(arrays: dict[str, zarr.Array], ep: EpisodeInfo) -> dict[str, np.ndarray]:
    """An episode's rows of every array, read as if the commit ended with it."""
    rows = {}
    for name, arr in arrays.items():
        lo, hi = (ep.obs_start, ep.obs_start + ep.length + 1) if name.startswith("obs/") else (
            ep.step_start, ep.step_start + ep.length)
        rows[name] = read_rows(arr, lo, hi, hi)
    return rows


def _shard_arrays(store: Store, shard: str) -> dict[str, zarr.Array]:
    group = zarr.open_group(os.path.join(store.root, "shards", shard, "data"), mode="r")
    return {name: group[name] for name in array_names(store.schema)}


def scan_index(store: Store, shard: str, limit: int | None = None) -> IndexScan:
    """Read a shard's ``episodes.jsonl`` record by record and check each episode's data
    (see :class:`IndexScan`); ``limit``: look at the first ``limit`` records only."""
    path = os.path.join(store.root, "shards", shard)
    try:
        with open(os.path.join(path, "episodes.jsonl"), "rb") as f:
            data = f.read()
    except Exception as e:  # a missing or damaged file: nothing verifies
        return IndexScan([], f"unreadable: {e!r}", [], 0, opened=False)
    lines = data.split(b"\n")[:-1]  # the last piece has no newline: not a complete record
    if limit is not None:
        lines = lines[:limit]
    try:
        arrays = _shard_arrays(store, shard)
    except Exception as e:
        lost = store.lost_arrays(shard)
        if lost:  # every episode has rows in every array: none verifies
            return IndexScan([], describe_lost(lost), [], len(lines))
        # a damaged zarr.json: the rows behind it may be intact
        return IndexScan([], f"unreadable: {e!r}", [], 0, opened=False)
    good: list[tuple[EpisodeInfo, int]] = []
    later: list[EpisodeInfo] = []
    stopped = None
    offset = steps = obs = 0  # where the next record and its rows must start
    for i, line in enumerate(lines):
        try:
            ep = EpisodeInfo.from_record(decode_record(line))
        except (ValueError, KeyError, TypeError) as e:
            stopped = stopped or f"record of episode {i} is damaged: {e!r}"
            continue
        if stopped is None and (ep.client_id, ep.episode, ep.step_start, ep.obs_start) != (shard, i, steps, steps + i):
            stopped = f"record of episode {i} does not follow the one before it"
        # Past the run, a record counts only for rows after every row counted so far (a
        # repeated record would otherwise count its episode twice).
        if stopped is not None and (ep.client_id != shard or ep.step_start < steps or ep.obs_start < obs):
            continue
        try:
            intact = episode_checksum(_episode_rows(arrays, ep)) == ep.checksum
        except Exception as e:  # zarr or the codec on damaged bytes
            stopped = stopped or f"data of episode {i} unreadable: {e!r}"
            continue
        if not intact:
            stopped = stopped or f"data of episode {i} fails its checksum"
            continue
        steps, obs = ep.step_start + ep.length, ep.obs_start + ep.length + 1
        if stopped is None:
            offset += len(line) + 1
            good.append((ep, offset))
        else:
            later.append(ep)
    return IndexScan(good, stopped, later, len(lines))


def repair_store(root: str, apply: bool = False) -> list[str]:
    """Cut every damaged shard back to the episodes at its start that verify, and keep the
    intact episodes past the damage. Returns one line per damaged shard or snapshot record
    saying what was (with ``apply``) or would be done; without ``apply`` nothing is written.
    Damage it cannot repair gets an ``Unrepairable`` line: a file where the store keeps its
    shards, a shard or its policies (what was in the folder it replaced is not in the store).

    A shard is damaged when its commit record is missing, damaged or disagrees with its
    episode index, or when a committed episode's record or data fails its checksum
    (``scan_index``). Its commit record is rebuilt to cover the leading episodes that
    verify; records past them stay in ``episodes.jsonl`` until the next writer of the shard
    drops them. A shard's commit record can only cover a prefix, so the episodes past the
    damage that verify on their own are first copied, with their metadata and checksums,
    into shard ``<shard>-salvaged`` (``attrs["salvaged_from"]`` names the original); a repair
    killed on the way and run again copies none twice. A shard whose rows of an array are gone
    (its folder missing, or a file in its place, which is set aside as ``<array>.damaged``)
    has no episode that verifies: it is cut back to none.

    A damaged snapshot record is renamed ``<id>.json.damaged``; one that saw episodes a
    shard no longer commits (a shard deleted whole) ``<id>.json`` + ``LOST_SUFFIX``, and a
    file at ``snapshots`` is set aside as ``snapshots.damaged``, a new folder taking its place:
    snapshot records only reopen earlier snapshots and reveal lost episodes, and no episode is
    in them.
    """
    if is_object_url(root):  # the same repairs, on the layout of object storage
        from robo_post.store.bucket import repair_bucket

        return repair_bucket(root, apply)
    store = Store.open(root, verify=False)
    actions: list[str] = []
    snapshots = os.path.join(store.root, "snapshots")
    for error in _layout_errors(store):
        if error.path != snapshots:
            actions.append(Unrepairable(f"cannot repair: {error}"))
            continue
        aside = _free_name(f"{snapshots}.damaged")
        actions.append(f"{snapshots} is not the folder where the store keeps its snapshot records; "
                       f"{'set' if apply else 'would set'} it aside as {os.path.basename(aside)} and "
                       f"{'made' if apply else 'make'} a new, empty folder (snapshots recorded before cannot be "
                       "reopened by id; no episode is lost)")
        if apply:
            os.replace(snapshots, aside)
            os.mkdir(snapshots)
    for shard in store.shards(strict=False):  # a file in the place of one: reported above
        path = os.path.join(store.root, "shards", shard)
        lost = _lost_array_metadata(store, path)
        if lost:
            # An array's zarr.json holds no rows, only what the schema gives (dtype, chunks) and a
            # length the writer sets from the commit record: a writer opening the shard writes it
            # again. Whether the rows then verify is checked below like any episode's data.
            line = f"shard {shard}: the zarr.json of {', '.join(lost)} is missing or damaged; "
            if not apply:
                line += "would rewrite it from the store's schema"
            else:
                for name in lost:  # a damaged one is kept beside
                    with contextlib.suppress(FileNotFoundError):
                        meta = os.path.join(path, name, "zarr.json")
                        os.replace(meta, f"{meta}.damaged")
                try:
                    with store.writer(shard):
                        pass
                    line += "rewrote it from the store's schema"
                except StoreError as e:
                    line += f"cannot rewrite it yet: {e}"
            actions.append(line)
        status = inspect_commit(path)
        why = status.problem
        if why is None and status.counts["episodes"]:
            try:
                store.shard_episodes(shard, status.counts)
            except (StoreError, OSError) as e:
                why = str(e)
        # With a healthy record, only what it commits counts: records past it were never committed.
        scan = scan_index(store, shard, limit=status.counts["episodes"] if why is None else None)
        if why is None:
            # Arrays that do not open (e.g. a lost zarr.json) hold intact rows: `validate` names them.
            if len(scan.good) == status.counts["episodes"] or not scan.opened:
                continue
            why = "the data of a committed episode does not verify"
        good = scan.good
        counts = {
            "episodes": len(good),
            "steps": sum(ep.length for ep, _ in good),
            "meta_bytes": good[-1][1] if good else 0,
        }
        verb = "rebuilt" if apply else "would rebuild"
        line = (f"shard {shard}: {why}; {verb} commit.bin as {counts['episodes']} episodes "
                f"({counts['steps']} steps, {counts['meta_bytes']} bytes of episodes.jsonl)")
        if status.counts is not None:
            line += f", where the record in use says {status.counts['episodes']}"
        with _shard_lock(path, shard) if apply else contextlib.nullcontext():
            if scan.stopped is not None:
                line += f"; the index stops verifying at episode {len(good)} ({scan.stopped})"
                target = shard + SALVAGE_SUFFIX
                if scan.later:
                    copied = _salvage(store, shard, scan.later, target) if apply else len(scan.later)
                    which = ("the later episode that verifies on its own" if len(scan.later) == 1 else
                             f"the {len(scan.later)} later episodes that verify on their own")
                    line += (f"; {'copied' if apply else 'would copy'} {which} "
                             f"({index_ranges([ep.episode for ep in scan.later])}) into shard {target}")
                    if apply and copied < len(scan.later):
                        line += f" ({len(scan.later) - copied} of them were there from an earlier repair)"
                lost = scan.records - len(good) - len(scan.later)
                if lost:
                    line += (f"; {lost} episode record{'s' if lost > 1 else ''} from episode {len(good)} on "
                             f"{'are' if lost > 1 else 'is'} left out, for good once the shard's next writer "
                             "overwrites them")
            for blocked in [p for p in store.lost_arrays(shard) if os.path.lexists(p)]:
                # A file where an array's folder belongs would keep the shard's next writer from making it again.
                aside = _free_name(f"{blocked}.damaged")
                line += f"; {'set' if apply else 'would set'} {blocked} aside as {os.path.basename(aside)}"
                if apply:
                    os.replace(blocked, aside)
            if apply:
                _rewrite_commit(path, max(status.seq, 0) + 1, counts)
        actions.append(line)
    # A snapshot record only says what a snapshot saw (to notice lost episodes later): a damaged
    # one is kept beside, under another name, so that validation can pass again.
    for name, path, shards in _snapshot_records(store.root):
        if isinstance(shards, Exception):
            verb = "set it aside" if apply else "would set it aside"
            actions.append(f"snapshot record {path}: damaged ({shards!r}); {verb} as {name}.damaged")
            if apply:
                os.replace(path, f"{path}.damaged")
    committed = {}
    for shard in store.shards(strict=False):
        status = inspect_commit(os.path.join(store.root, "shards", shard))
        committed[shard] = None if status.problem is not None else (status.counts["episodes"], status.seq)
    for loss in _lost_since_snapshots(store.root, committed):
        # Nothing left in the store can bring those episodes back; the records only keep validate failing.
        which = ("the snapshot record that saw them" if len(loss.records) == 1 else
                 f"the {len(loss.records)} snapshot records that saw them")
        actions.append(f"{loss.problem}: they are gone from the store (a backup of the shard can bring them back); "
                       f"{'set' if apply else 'would set'} aside {which} as <id>.json{LOST_SUFFIX}, so that the "
                       "store validates again")
        if apply:
            for record in loss.records:
                os.replace(record, _free_name(record + LOST_SUFFIX))
    return actions


def _free_name(path: str) -> str:
    """``path``, or ``path-2``, ``path-3``, ... if taken: what is set aside never replaces
    what was set aside before."""
    n, free = 1, path
    while os.path.lexists(free):
        n += 1
        free = f"{path}-{n}"
    return free


def _lost_array_metadata(store: Store, path: str) -> list[str]:
    """The folders under the shard at ``path`` whose ``zarr.json`` is missing or not a JSON object:
    an array's, or a group's (zarr opens no group without one: the shard's arrays are unreadable)."""
    arrays = array_names(store.schema)
    lost = []
    for name in ["data", "data/obs", "data/extras", *(f"data/{a}" for a in arrays)]:
        meta = os.path.join(path, name, "zarr.json")
        if not os.path.isdir(os.path.dirname(meta)):
            continue
        try:
            with open(meta, "rb") as f:
                if not isinstance(json.load(f), dict):
                    raise ValueError("not a JSON object")
        except (OSError, ValueError):
            lost.append(name)
    return lost


def _salvage(store: Store, shard: str, episodes: list[EpisodeInfo], target: str) -> int:
    """Copy ``episodes`` of ``shard`` into shard ``target``, skipping any copied there
    before (same origin, same checksum); returns how many were copied now."""
    copied_before = set()
    if target in store.shards():
        copied_before = {(ep.attrs.get("salvaged_from"), ep.checksum) for ep in store.shard_episodes(target)}
    arrays = _shard_arrays(store, shard)
    schema = store.schema
    copied = 0
    with store.writer(target) as writer:
        for ep in episodes:
            if (ep.key, ep.checksum) in copied_before:
                continue
            write_salvaged(writer, schema, _episode_rows(arrays, ep), ep)
            copied += 1
    return copied


@contextlib.contextmanager
def _shard_lock(path: str, shard: str) -> Iterator[None]:
    """Hold a shard's writer lock (refused while a writer has it open)."""
    fd = lock_shard(path, shard)
    try:
        yield
    finally:
        os.close(fd)


def _rewrite_commit(path: str, seq: int, counts: dict[str, int]) -> None:
    """Replace a shard's commit.bin (the caller holds the shard's lock)."""
    write_commit_file(path, seq, counts, both_slots=True)
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # the rename
    finally:
        os.close(dir_fd)
