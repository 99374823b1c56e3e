"""The trajectory store: many single-writer shards, read through consistent snapshots.

Layout on disk::

    ROOT/store.json                      schema (+ schema_version, + its CRC32C)
    ROOT/shards/<client>/data/           zarr v3 group: obs/<key>, action, step,
                                         extras/<name> (sharded; see chunks.py)
    ROOT/shards/<client>/episodes.jsonl  one JSON record per episode (ending with its CRC32C)
    ROOT/shards/<client>/commit.bin      {episodes, steps, meta_bytes}: what is committed
                                         (see commit.py)
    ROOT/snapshots/<id>.json             shard -> committed counts, to reopen a snapshot
                                         (written only where the store is writable)
    ROOT/policies/v000001/               policy registry (see registry.py)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil

from robo_post.store.commit import read_commit
from robo_post.store.records import (  # noqa: F401  (EpisodeInfo, describe_lost: imported from here too)
    EpisodeInfo,
    Snapshot,
    array_names,
    describe_lost,
    parse_schema,
    same_layout,
    schema_crc,
)
from robo_post.store.schema import (
    StoreError,
    StoreIntegrityError,
    StoreLayoutError,
    StoreNotFoundError,
    StoreSchema,
    check_folder,
    check_name,
)
from robo_post.store.writer import ShardWriter, decode_record
from robo_post.utils.io import is_object_url, write_json_atomic

# Errors of a write refused for want of permission or on a read-only file system.
_READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)
# ... or for want of space: reading a full store needs no record of what it read.
_FULL = (errno.ENOSPC, errno.EDQUOT)
# What a store's folder may hold before its store.json exists: other creators racing, fleet logs.
_STORE_ENTRIES = {"shards", "snapshots", "policies", "fleet"}
# What the store keeps in each of its folders, and the way out when a file stands there instead.
_SHARDS = ("its shards", "move it aside, and put back the folder of shards it replaced (`robo-post store repair` "
           "cannot: every episode of the store is in that folder)")
_SNAPSHOTS = ("its snapshot records", "move it aside (`robo-post store repair --apply` does, and makes a new folder: "
              "the records only reopen earlier snapshots by id and reveal lost episodes)")


def _layout_errors(paths: list[tuple[str, tuple[str, str]]]) -> list[StoreLayoutError]:
    """``StoreLayoutError`` of each ``(path, (what, way out))`` that is there but not a folder."""
    errors = []
    for path, (what, way_out) in paths:
        try:
            check_folder(path, what, way_out)
        except StoreLayoutError as e:
            errors.append(e)
    return errors


def _shard_folder(shard: str) -> tuple[str, str]:
    return (f"shard {shard}", f"move it out of shards/ (`robo-post store repair` cannot: shard {shard}'s episodes "
                              "were in the folder it replaced)")


def _check_root(root: str) -> None:
    """Refuse a store path that names no folder one could create: empty (it would be the working
    directory), with a NUL byte, or under an existing file."""
    if not isinstance(root, str) or not root.strip():
        raise StoreError(f"a store needs a path, got {root!r}")
    if "\0" in root:
        raise StoreError(f"store path {root!r} holds a NUL byte")
    parent = os.path.dirname(os.path.abspath(root))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise StoreError(f"cannot create a store at {root}: {parent} is a file, not a folder")


def _refuse_lost_schema(root: str) -> None:
    """Raise ``StoreIntegrityError`` when ``root`` has lost its ``store.json`` but still holds
    recorded shards: a store made anew there would take them under another schema, and every
    check would then read them as damaged.
    """
    shards = os.path.join(root, "shards")
    if os.path.exists(os.path.join(root, "store.json")) or not os.path.isdir(shards):
        return
    held = [n for n in os.listdir(shards) if os.path.exists(os.path.join(shards, n, "commit.bin"))]
    if held:
        raise StoreIntegrityError(
            f"{root}/store.json is missing, but the store still holds {len(held)} shards of recorded episodes: "
            "put back a store.json (that of a store collected from the same env and env kwargs can replace it; "
            "the episodes are untouched) rather than making a new store over them")


class Store:
    """A trajectory store rooted at a directory.

    Create with ``Store.create(path, schema)``, open with ``Store.open(path)``. Given a URL
    instead (``s3://bucket/prefix``, ``gs://``, ``az://``, ``file:///abs/path``), both return a
    ``bucket.BucketStore``: the same interface and guarantees, on object storage.
    Write through ``store.writer(client_id)``; read through ``store.snapshot()``.

    Args:
        verify: default of ``snapshot(verify=...)``: check each episode's checksum
            when its data is read.
    """

    def __init__(self, root: str, schema: StoreSchema, verify: bool = True):
        self.root = os.path.abspath(root)
        self.schema = schema
        self.verify = verify

    @classmethod
    def create(cls, root: str, schema: StoreSchema, exist_ok: bool = False) -> "Store":
        """Create a store with ``schema``. With ``exist_ok``, open it if it already exists
        (its schema must then equal ``schema``).

        Raises:
            StoreError: ``root`` is empty, holds a NUL byte, lies under a file, or cannot be
                written (a read-only or special file system), naming it; nothing is left there.
        """
        if is_object_url(root):
            from robo_post.store.bucket import BucketStore

            return BucketStore.create(root, schema, exist_ok)
        _check_root(root)
        path = os.path.join(root, "store.json")
        _refuse_lost_schema(root)
        if os.path.exists(path):
            if not exist_ok:
                raise StoreError(f"a store already exists at {root}")
            return same_layout(cls.open(root), schema)
        if os.path.exists(root) and not os.path.isdir(root):
            raise StoreError(f"{root} is a file, not a robo-post store; give a new or empty path")
        # A store= typo naming a folder of other files would scatter the store's files among them.
        foreign = sorted(n for n in (os.listdir(root) if os.path.isdir(root) else [])
                         if n not in _STORE_ENTRIES and not n.startswith("store.json"))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise StoreError(f"{root} is a folder of other files ({shown}), not a robo-post store; "
                             "give a new or empty path")
        existed = os.path.isdir(root)
        try:
            for sub in ("shards", "snapshots", "policies"):
                os.makedirs(os.path.join(root, sub), exist_ok=True)
            meta = schema.to_json()
            write_json_atomic(path, {**meta, "crc32c": schema_crc(meta)})
        except OSError as e:  # nothing was stored yet: take back the empty folders made here
            for sub in ("shards", "snapshots", "policies") + (() if existed else ("",)):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, sub))
            raise StoreError(f"cannot create a store at {root}: {e.strerror or e}; give a writable path") from None
        return cls(root, schema)

    @classmethod
    def open(cls, root: str, verify: bool = True) -> "Store":
        """Open an existing store. Raises ``StoreNotFoundError``, ``SchemaVersionError``, or
        ``StoreIntegrityError`` naming ``store.json`` when that is damaged.

        Args:
            verify: check each episode's checksum when snapshots read its data (the
                default); False skips that for trusted local data.
        """
        if is_object_url(root):
            from robo_post.store.bucket import BucketStore

            return BucketStore.open(root, verify)
        path = os.path.join(root, "store.json")
        _refuse_lost_schema(root)
        if not os.path.exists(path):
            what = f"{root} is a file, not a robo-post store" if os.path.isfile(root) else f"no robo-post store at {root}"
            raise StoreNotFoundError(f"{what} (missing store.json)")
        with open(path, "rb") as f:
            schema = parse_schema(f.read(), path)
        return cls(root, schema, verify)

    # --- writing -----------------------------------------------------------------
    def writer(self, client_id: str, fsync: bool = True, takeover: bool = False) -> ShardWriter:
        """Open the shard ``client_id`` for writing (creating it if new).

        Commits are atomic and survive the writer process being killed. With
        ``fsync=True`` (default) each commit is durable (survives power loss) before
        it returns, at the cost of syncing every file it wrote; with ``fsync=False``
        the most recent episodes may be lost in an OS crash or power loss (see
        ``ShardWriter``). ``takeover`` (a writer restarted after its process died) changes
        nothing on a disk: the OS frees a dead writer's lock at once.
        """
        check_folder(os.path.join(self.root, "shards"), *_SHARDS)
        check_folder(os.path.join(self.root, "shards", check_name(client_id)), *_shard_folder(client_id))
        return ShardWriter(self, client_id, fsync=fsync)

    # --- shards ------------------------------------------------------------------
    def shards(self, strict: bool = True) -> list[str]:
        """Names of all shards, sorted.

        Args:
            strict: raise ``StoreLayoutError`` when ``shards`` or an entry in it is a file
                (hidden ones aside): a file where a shard's folder should be would otherwise
                hide that shard's loss. False: skip them (``validate`` reports them).
        """
        errors = self._shard_layout_errors() if strict else []
        if errors:
            raise errors[0]
        d = os.path.join(self.root, "shards")
        return sorted(n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))) if os.path.isdir(d) else []

    def layout_errors(self) -> list[StoreLayoutError]:
        """Every path where the store keeps a folder (``shards``, ``snapshots``, each shard)
        that is a file or anything else but a folder. ``policies`` is the registry's to check
        (``registry.check_policies_folder``)."""
        return self._shard_layout_errors() + _layout_errors([(os.path.join(self.root, "snapshots"), _SNAPSHOTS)])

    def _shard_layout_errors(self) -> list[StoreLayoutError]:
        shards = os.path.join(self.root, "shards")
        paths = [(shards, _SHARDS)]
        if os.path.isdir(shards):
            paths += [(os.path.join(shards, n), _shard_folder(n)) for n in sorted(os.listdir(shards))
                      if not n.startswith(".")]
        return _layout_errors(paths)

    def read_commit(self, shard: str) -> dict[str, int]:
        """The committed counts of one shard (zeros for a shard never committed)."""
        path = os.path.join(self.root, "shards", shard)
        check_folder(path, *_shard_folder(shard))
        return read_commit(path)

    def lost_arrays(self, shard: str) -> dict[str, list[str]]:
        """Where rows of ``shard`` are gone: the outermost folder (``data``, ``data/obs``, an
        array's) that is missing or is not a folder (e.g. a file) -> the arrays under it. A
        lost ``zarr.json`` in a folder that is still there leaves the rows intact."""
        names = array_names(self.schema)
        data = os.path.join(self.root, "shards", shard, "data")
        lost: dict[str, list[str]] = {}
        for name in names:
            parts = name.split("/")
            for depth in range(len(parts) + 1):  # data, then data/obs, then data/obs/<key>
                path = os.path.join(data, *parts[:depth])
                if not os.path.isdir(path):
                    lost.setdefault(path, []).append(name)
                    break
        return lost

    def shard_episodes(self, shard: str, counts: dict[str, int] | None = None) -> list[EpisodeInfo]:
        """Committed episode records of one shard (up to ``counts``, default: now).

        Raises ``StoreIntegrityError`` when the records do not match ``counts``, fail
        their checksum, or do not tile the shard's rows in order.
        """
        c = self.read_commit(shard) if counts is None else counts
        if c["episodes"] == 0:
            return []
        path = os.path.join(self.root, "shards", shard, "episodes.jsonl")
        try:
            with open(path, "rb") as f:
                data = f.read(c["meta_bytes"])
        except FileNotFoundError:
            raise StoreIntegrityError(f"{path}: missing, yet {c['episodes']} episodes are committed") from None
        lines = data.split(b"\n")

        def decode(i: int, line: bytes) -> EpisodeInfo:
            try:
                return EpisodeInfo.from_record(decode_record(line))
            except (ValueError, KeyError, TypeError) as e:
                raise StoreIntegrityError(f"{path}: record of episode {shard}/{i} is damaged: {e!r}") from None

        if len(data) != c["meta_bytes"] or lines[-1] or len(lines) - 1 != c["episodes"]:
            # A record edited or damaged in place usually changes length: name it rather than the sizes.
            for i, line in enumerate(lines[:-1]):
                decode(i, line)
            if len(data) < c["meta_bytes"]:
                wrong = f"holds {len(data)} bytes, commit says {c['meta_bytes']}: it was cut short"
            elif lines[-1]:
                wrong = (f"the {c['meta_bytes']} committed bytes end inside record {len(lines) - 1}, commit says "
                         f"they hold {c['episodes']} whole records: a record changed length after commit")
            else:
                wrong = f"the {c['meta_bytes']} committed bytes hold {len(lines) - 1} records, commit says {c['episodes']}"
            raise StoreIntegrityError(f"{path}: {wrong}")
        episodes, steps = [], 0
        for i, line in enumerate(lines[:-1]):
            ep = decode(i, line)
            if (ep.client_id, ep.episode, ep.step_start, ep.obs_start) != (shard, i, steps, steps + i) or ep.length < 1:
                raise StoreIntegrityError(f"{path}: record of episode {shard}/{i} does not follow the one before it")
            episodes.append(ep)
            steps += ep.length
        if steps != c["steps"]:
            raise StoreIntegrityError(f"{path}: episodes hold {steps} steps, commit says {c['steps']}")
        return episodes

    # --- snapshots ---------------------------------------------------------------
    def snapshot(self, snapshot_id: str | None = None, *, verify: bool | None = None, record: bool = True) -> "Snapshot":
        """A consistent view of every shard's committed episodes.

        With no id, take a new snapshot of what is committed now. With an id, reopen
        exactly that snapshot.

        Args:
            verify: check each episode's checksum when its data is read
                (``StoreIntegrityError`` naming the episode); default: the store's.
            record: write the new snapshot's record into ``snapshots/`` so its id can
                be reopened later. Skipped where the store is not writable (the
                snapshot's ``recorded`` is then False): reading never needs write access.
        """
        verify = self.verify if verify is None else verify
        if snapshot_id is not None or record:
            check_folder(os.path.join(self.root, "snapshots"), *_SNAPSHOTS)
        if snapshot_id is not None:
            check_name(snapshot_id, "snapshot id")
            path = os.path.join(self.root, "snapshots", f"{snapshot_id}.json")
            if not os.path.exists(path):
                raise StoreError(f"unknown snapshot id {snapshot_id!r} in store {self.root}")
            try:
                with open(path, "rb") as f:
                    counts = json.loads(f.read())["shards"]
                counts = {str(s): {k: int(c[k]) for k in ("episodes", "steps", "meta_bytes")} for s, c in counts.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise StoreIntegrityError(f"{path}: damaged snapshot record: {e!r}") from None
            return Snapshot(self, snapshot_id, counts, verify=verify)
        counts = {s: self.read_commit(s) for s in self.shards()}
        counts = {s: c for s, c in counts.items() if c["episodes"] > 0}
        digest = hashlib.sha256(json.dumps(counts, sort_keys=True).encode()).hexdigest()[:16]
        snapshot_id = f"snap-{digest}"
        snap = Snapshot(self, snapshot_id, counts, verify=verify)
        path = os.path.join(self.root, "snapshots", f"{snapshot_id}.json")
        snap.recorded = os.path.exists(path)
        if record and not snap.recorded:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_json_atomic(path, {"shards": counts}, fsync=False)
                snap.recorded = True
            except OSError as e:
                if e.errno not in _READ_ONLY + _FULL:
                    raise
        return snap

    def size_bytes(self) -> int:
        """Bytes on disk under the store root."""
        total = 0
        for dirpath, _, files in os.walk(self.root):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
        return total


def remove_empty_store(root: str, folder_existed: bool) -> None:
    """Remove the store at ``root`` if it holds no episode and no policy (one a command created
    and then refused to fill): the folder too, unless it was there before (a user's folder)."""
    store = Store.open(root, verify=False)
    policies = os.path.join(root, "policies")
    if (any(store.read_commit(shard)["episodes"] for shard in store.shards())
            or any(not name.startswith(".") for name in os.listdir(policies))):
        return
    if not folder_existed:
        shutil.rmtree(root)
        return
    for name in _STORE_ENTRIES:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
    os.remove(os.path.join(root, "store.json"))
