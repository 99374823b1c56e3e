"""The trajectory store on object storage: S3 and its compatibles, Google Cloud Storage, Azure
Blob Storage, and a local folder through the same layer (``file://``), via obstore and zarr's
``ObjectStore``.

An object store has no rename, no append, no fsync and no locks, but every PUT is atomic (a
reader sees the whole old or the whole new object) and durable once it returns, and it can
create an object only if it does not exist yet (a conditional ``If-None-Match: *`` PUT on S3,
a generation precondition on GCS, ``If-None-Match`` on Azure, ``O_EXCL`` on a local disk).
The layout uses nothing else: it never overwrites an object, so no reader can see a torn one
and no late writer can clobber one::

    PREFIX/store.json                             schema (+ its CRC32C), created once
    PREFIX/shards/<client>/episodes/<N>-<token>/  zarr v3 group of episode N's rows: obs/<key>,
                                                  action, step, extras/<name>; <token> is its
                                                  writer's, so no two writers share a key
    PREFIX/shards/<client>/commits/<N>.json       episode N's record (``episodes.jsonl``'s line,
                                                  plus ``data``: the group above), created once
    PREFIX/shards/<client>/lease/<G>.json         the writer lease, generation G
    PREFIX/snapshots/<id>.json                    shard -> committed counts, to reopen a snapshot

(``<N>`` and ``<G>`` are zero-padded, so listing order is numeric order.)

Guarantees, as on a local disk:

- *An episode is visible only after its commit.* Its rows go to a group no commit names
  yet; then its record is created at ``commits/<N>.json``. A shard commits episodes
  ``0..n-1``, the run of records from 0 without a gap; readers load only what the record
  names, whose rows were all written before it.
- *A killed writer loses only its episode in flight*: what it left is a group no record
  names (``store repair --apply`` deletes it once no writer holds the shard).
- *One writer per shard*, enforced twice. The lease (below) refuses a second writer with
  ``ShardLockedError`` while the first is alive. And the commit record is created only if
  absent: of two writers that both believe they own the shard (one paused past its lease),
  exactly one commits episode N; the other gets ``ShardLockedError`` and its episode is not
  committed. Correctness rests on that conditional create, never on clocks.
- *Consistent snapshots while writers append*: a snapshot is a count of episodes per shard;
  committed objects never change, so it reads the same bytes for as long as it lives, and
  reopens by id later (its record in ``snapshots/``).

The lease is a chain of create-only objects, not one object updated in place: generation
G + 1 can be created by one writer only, with If-None-Match alone, which every backend
(and zarr's ``ObjectStore``) supports. A writer takes the shard when the newest
generation is released or expired, renews by creating the next generation once half its
lease has passed, and releases it on ``close``. A writer killed without closing holds the
shard until its lease expires (``lease_s``, default 30 s).

Credentials come from the environment only (``AWS_ACCESS_KEY_ID``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_ACCOUNT_KEY``, instance roles, ...; obstore
reads them, along with ``AWS_ENDPOINT_URL`` for S3 compatibles); a URL with credentials in it is
refused, and no object the store writes holds any.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import json
import os
import socket
import time
import urllib.parse
import uuid
from typing import Any, Iterable

import numpy as np
import obstore
import zarr
from obstore.exceptions import AlreadyExistsError, PermissionDeniedError, UnauthenticatedError
from zarr.codecs import BloscCodec
from zarr.storage import ObjectStore

from robo_post.store.schema import (
    InvalidNameError,
    ShardLockedError,
    StoreAccessError,
    StoreError,
    StoreIntegrityError,
    StoreNotFoundError,
    StoreSchema,
    StoreURLError,
    check_episode_size,
    check_name,
)
from robo_post.store.records import (
    LOST_SUFFIX,
    SALVAGE_SUFFIX,
    EpisodeInfo,
    Snapshot,
    Unrepairable,
    index_ranges,
    parse_schema,
    array_names,
    same_layout,
    schema_bytes,
    split_table,
    unpack,
    write_salvaged,
)
from robo_post.store.writer import EpisodeWriter, decode_record, encode_record, episode_checksum, time_chunk

LEASE_S = 30.0
"""Default writer lease, seconds: how long a shard stays taken after its writer was killed."""
TAKEOVER_MARGIN_S = 5.0  # a taking-over writer waits this much past a lease, for clock skew and slow requests
_WIDTH = 9  # digits of episode indices and lease generations in object names
# Requests in flight at once. Tasks on _POOL make requests and never wait on other tasks; tasks
# on _EPISODES (one episode each) wait on _POOL's: one pool for both could deadlock.
_POOL = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="robo-post-objects")
_EPISODES = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="robo-post-episodes")
# Deadlines of every request (the store talks over a network): a dead endpoint fails in
# seconds, not after obstore's default three minutes of retries.
_CLIENT = {"connect_timeout": "5s", "timeout": "60s"}
_RETRY = {"max_retries": 3, "retry_timeout": datetime.timedelta(seconds=30)}
_S3_BUCKET = set("abcdefghijklmnopqrstuvwxyz0123456789.-")


# --- locations --------------------------------------------------------------------------
def open_location(url: str, create: bool = False) -> Any:
    """The obstore store for a store URL (``s3://bucket/prefix``, ``gs://``, ``az://container/
    prefix``, ``file:///abs/path``), its credentials taken from the environment.

    Raises:
        StoreURLError: the URL is malformed, holds credentials, or names no bucket.
        StoreNotFoundError: a ``file://`` folder that does not exist (unless ``create``).
    """
    from obstore.store import AzureStore, GCSStore, LocalStore, S3Store

    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        raise StoreURLError(f"store URL {_redact(url)} holds credentials: they would end up in configs and logs; "
                            "give them in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ...) instead")
    if parts.query or parts.fragment:
        raise StoreURLError(f"store URL {url!r} has a query or fragment; give scheme://bucket/prefix only")
    prefix = parts.path.strip("/")
    if any(p in ("", ".", "..") for p in prefix.split("/")) and prefix:
        raise StoreURLError(f"store URL {url!r}: its prefix has an empty, '.' or '..' part")
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise StoreURLError(f"store URL {url!r}: a file URL names an absolute path, file:///abs/path")
        path = "/" + prefix
        if not os.path.isdir(path):
            if not create:
                raise StoreNotFoundError(f"no robo-post store at {url} (no folder {path})")
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create a store at {url}: {e.strerror or e}") from None
        return LocalStore(path)
    bucket = parts.netloc
    if not bucket:
        raise StoreURLError(f"store URL {url!r} names no bucket: give {scheme}://BUCKET/prefix")
    client = dict(_CLIENT)
    # Client options given in code replace obstore's from the environment: keep its plain-HTTP
    # switch (a local S3 compatible such as MinIO or a test server).
    allow_http = os.environ.get({"s3": "AWS_ALLOW_HTTP", "az": "AZURE_ALLOW_HTTP"}.get(scheme, ""), "")
    if allow_http.lower() in ("1", "true"):
        client["allow_http"] = True
    options = {"prefix": prefix or None, "client_options": client, "retry_config": _RETRY}
    try:
        if scheme == "s3":
            if not (3 <= len(bucket) <= 63 and set(bucket) <= _S3_BUCKET and bucket[0].isalnum()):
                raise StoreURLError(f"store URL {url!r}: {bucket!r} is not an S3 bucket name (3-63 characters "
                                    "of a-z, 0-9, '.', '-')")
            return S3Store(bucket, **options)
        if scheme == "gs":
            return GCSStore(bucket, **options)
        if scheme == "az":
            return AzureStore(bucket, **options)
    except StoreError:
        raise
    except Exception as e:  # obstore refuses a configuration (a bad variable in the environment)
        raise StoreAccessError(f"cannot configure access to {url}: {_first_line(e)}") from None
    raise StoreURLError(f"store URL {url!r}: unknown scheme {scheme!r}; use s3://, gs://, az:// or file://")


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://***@{parts.hostname or ''}{parts.path}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _error(e: Exception, url: str, doing: str) -> StoreError:
    """An obstore failure as a typed store error naming the store and what was being done."""
    text = str(e)
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or any(
        s in text for s in ("169.254.169.254", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                            "credential", "Credential")):
        return StoreAccessError(
            f"cannot {doing} in {url}: access refused or no credentials ({_first_line(e)}); credentials come from "
            "the environment only: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile or instance role) "
            "for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://, AZURE_STORAGE_ACCOUNT_NAME and _KEY for az://")
    if any(s in text for s in ("NoSuchBucket", "ContainerNotFound", "bucket does not exist")):
        return StoreNotFoundError(f"no robo-post store at {url}: its bucket does not exist (create it first)")
    return StoreError(f"cannot {doing} in {url}: {_first_line(e)}")


class Objects:
    """The few operations the store needs, on one obstore store, with typed errors."""

    def __init__(self, url: str, create: bool = False):
        self.url = url
        self.store = open_location(url, create)

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is none."""
        try:
            return obstore.get(self.store, key).bytes().to_bytes()
        except FileNotFoundError as e:  # what obstore raises for a missing object
            if "NoSuchBucket" in str(e):
                raise _error(e, self.url, f"read {key}") from None
            return None
        except Exception as e:
            raise _error(e, self.url, f"read {key}") from None

    def create(self, key: str, data: bytes) -> bool:
        """Create the object unless one exists; whether this call created it."""
        try:
            obstore.put(self.store, key, data, mode="create")
            return True
        except AlreadyExistsError:
            return False
        except Exception as e:
            raise _error(e, self.url, f"write {key}") from None

    def list(self, prefix: str) -> list[dict[str, Any]]:
        """Every object under ``prefix`` (``path``, ``size``, ``last_modified``)."""
        try:
            return [m for batch in obstore.list(self.store, prefix) for m in batch]
        except Exception as e:
            raise _error(e, self.url, f"list {prefix}") from None

    def children(self, prefix: str) -> list[str]:
        """Names of the 'folders' right under ``prefix``."""
        try:
            found = obstore.list_with_delimiter(self.store, prefix)
        except Exception as e:
            raise _error(e, self.url, f"list {prefix}") from None
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"])

    def put(self, key: str, data: bytes) -> None:
        """Write the object, replacing any."""
        try:
            obstore.put(self.store, key, data)
        except Exception as e:
            raise _error(e, self.url, f"write {key}") from None

    def files(self, prefix: str) -> list[str]:
        """Names of the objects right under ``prefix`` (not those in its 'folders')."""
        try:
            found = obstore.list_with_delimiter(self.store, prefix or None)
        except Exception as e:
            raise _error(e, self.url, f"list {prefix}") from None
        return sorted(m["path"].rsplit("/", 1)[-1] for m in found["objects"])

    def delete(self, keys: list[str]) -> None:
        if keys:
            try:
                obstore.delete(self.store, keys)
            except Exception as e:
                raise _error(e, self.url, f"delete {keys[0]}") from None


def read_object(url: str) -> bytes | None:
    """The bytes of the object at ``url`` (``s3://bucket/prefix/name``), None when there is none."""
    folder, name = url.rstrip("/").rsplit("/", 1)
    return Objects(folder).get(name)


def write_object(url: str, data: bytes) -> None:
    """Write the object at ``url``, replacing any."""
    folder, name = url.rstrip("/").rsplit("/", 1)
    Objects(folder, create=True).put(name, data)


def object_names(url: str) -> list[str]:
    """Names of the objects right under the 'folder' ``url``."""
    return Objects(url, create=True).files("")


def _index_key(n: int) -> str:
    return f"{n:0{_WIDTH}d}"


def _parse_index(name: str) -> int | None:
    head = name.split("-", 1)[0].removesuffix(".json")
    return int(head) if len(head) == _WIDTH and head.isdigit() else None


# --- the store --------------------------------------------------------------------------
class BucketStore:
    """A trajectory store on object storage, with the interface and guarantees of ``Store``
    (see the module docstring for the layout). ``Store.open`` / ``Store.create`` return one
    for a URL; ``root`` is that URL.

    Committed records never change, so they are read once per ``BucketStore`` and kept.
    """

    def __init__(self, root: str, schema: StoreSchema, verify: bool = True, objects: Objects | None = None):
        self.root = root.rstrip("/")
        self.schema = schema
        self.verify = verify
        self.objects = objects or Objects(self.root)
        self.zarr = ObjectStore(self.objects.store, read_only=True)
        self._records: dict[tuple[str, int], tuple[EpisodeInfo, str]] = {}

    @classmethod
    def create(cls, root: str, schema: StoreSchema, exist_ok: bool = False) -> "BucketStore":
        """Create a store with ``schema`` at the URL ``root`` (with ``exist_ok``, open the one there,
        whose schema must equal ``schema``). Raises ``StoreURLError``, ``StoreAccessError``,
        ``StoreNotFoundError`` (a missing bucket) or ``StoreError``."""
        objects = Objects(root, create=True)
        if not objects.create("store.json", schema_bytes(schema)):
            if not exist_ok:
                raise StoreError(f"a store already exists at {root}")
            return same_layout(cls.open(root), schema)
        return cls(root, schema, objects=objects)

    @classmethod
    def open(cls, root: str, verify: bool = True) -> "BucketStore":
        """Open the store at the URL ``root``: ``StoreNotFoundError`` when none is there (or its
        bucket is missing), ``SchemaVersionError`` / ``StoreIntegrityError`` as ``Store.open``."""
        objects = Objects(root)
        data = objects.get("store.json")
        if data is None:
            raise StoreNotFoundError(f"no robo-post store at {root} (missing store.json)")
        return cls(root, parse_schema(data, f"{root.rstrip('/')}/store.json"), verify, objects)

    # --- writing -------------------------------------------------------------------
    def writer(self, client_id: str, fsync: bool = True, lease_s: float = LEASE_S,
               takeover: bool = False) -> "BucketShardWriter":
        """Open shard ``client_id`` for writing: ``ShardLockedError`` while another writer's lease
        on it lasts. With ``takeover`` (a writer restarted after its process or node died) it
        first waits out that lease, up to ``lease_s`` and a margin: nothing else frees the shard.
        Every commit is durable when it returns (``fsync`` is accepted for the interface; an
        object store acknowledges a PUT once it is stored)."""
        deadline = time.monotonic() + (lease_s + TAKEOVER_MARGIN_S if takeover else 0.0)
        while True:
            try:
                return BucketShardWriter(self, client_id, lease_s=lease_s)
            except ShardLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)

    # --- shards ----------------------------------------------------------------------
    def shards(self, strict: bool = True) -> list[str]:
        """Names of all shards, sorted."""
        return [n for n in self.objects.children("shards") if not n.startswith(".")]

    def layout_errors(self) -> list:
        """None: an object store has no folders that a file could stand in for."""
        return []

    def commit_listing(self, shard: str) -> tuple[int, list[int]]:
        """``(n, later)``: the shard commits episodes ``0..n-1`` (the records from 0 without a
        gap); ``later`` are the indices of records past a gap (damage: hidden episodes)."""
        check_name(shard, "shard")
        found = {_parse_index(m["path"].rsplit("/", 1)[-1]) for m in self.objects.list(f"shards/{shard}/commits/")}
        found.discard(None)
        n = 0
        while n in found:
            n += 1
        return n, sorted(i for i in found if i > n)

    def read_commit(self, shard: str) -> dict[str, int]:
        """The committed counts of one shard (zeros for a shard never committed)."""
        n, _ = self.commit_listing(shard)
        if n == 0:
            return {"episodes": 0, "steps": 0, "meta_bytes": 0}
        last, _ = self.record(shard, n - 1)
        return {"episodes": n, "steps": last.step_start + last.length, "meta_bytes": 0}

    def lost_arrays(self, shard: str) -> dict[str, list[str]]:
        """None: each episode's rows are objects of their own (``validate`` names a lost one)."""
        return {}

    def record(self, shard: str, index: int) -> tuple[EpisodeInfo, str]:
        """Episode ``index`` of ``shard``: its record and the name of its data group.
        ``StoreIntegrityError`` when the record is missing or damaged."""
        key = (shard, index)
        if key not in self._records:
            path = f"shards/{shard}/commits/{_index_key(index)}.json"
            data = self.objects.get(path)
            if data is None:
                raise StoreIntegrityError(f"{self.root}/{path}: missing, yet the shard commits episode {index}")
            try:
                raw = decode_record(data.rstrip(b"\n"))
                info, name = EpisodeInfo.from_record(raw), raw["data"]
                if not isinstance(name, str) or _parse_index(name) != index:
                    raise ValueError(f"names data {name!r}, not episode {index}'s")
            except (ValueError, KeyError, TypeError) as e:
                raise StoreIntegrityError(f"{self.root}/{path}: damaged episode record: {e}") from None
            self._records[key] = (info, name)
        return self._records[key]

    def shard_episodes(self, shard: str, counts: dict[str, int] | None = None) -> list[EpisodeInfo]:
        """Committed episode records of one shard (up to ``counts``, default: now);
        ``StoreIntegrityError`` when they are damaged or do not follow one another."""
        c = self.read_commit(shard) if counts is None else counts
        n = c["episodes"]
        missing = [i for i in range(n) if (shard, i) not in self._records]
        for _ in _POOL.map(lambda i: self.record(shard, i), missing):  # fetched concurrently, checked in order
            pass
        episodes, steps = [], 0
        for i in range(n):
            ep, _ = self.record(shard, i)
            if (ep.client_id, ep.episode, ep.step_start, ep.obs_start) != (shard, i, steps, steps + i) or ep.length < 1:
                raise StoreIntegrityError(f"{self.root}/shards/{shard}: record of episode {i} does not follow the "
                                          "one before it")
            episodes.append(ep)
            steps += ep.length
        if steps != c["steps"]:
            raise StoreIntegrityError(f"{self.root}/shards/{shard}: episodes hold {steps} steps, the snapshot says "
                                      f"{c['steps']}")
        return episodes

    def episode_arrays(self, shard: str, index: int) -> dict[str, np.ndarray]:
        """Every stored array of a committed episode (name -> rows), read concurrently."""
        _, name = self.record(shard, index)
        names = array_names(self.schema)

        def read(array: str) -> np.ndarray:
            return zarr.open_array(self.zarr, path=f"shards/{shard}/episodes/{name}/{array}", mode="r")[...]

        return dict(zip(names, _POOL.map(read, names)))

    # --- snapshots -------------------------------------------------------------------
    def snapshot(self, snapshot_id: str | None = None, *, verify: bool | None = None,
                 record: bool = True) -> "BucketSnapshot":
        """A consistent view of every shard's committed episodes (see ``Store.snapshot``)."""
        verify = self.verify if verify is None else verify
        if snapshot_id is not None:
            check_name(snapshot_id, "snapshot id")
            path = f"snapshots/{snapshot_id}.json"
            data = self.objects.get(path)
            if data is None:
                raise StoreError(f"unknown snapshot id {snapshot_id!r} in store {self.root}")
            try:
                counts = json.loads(data)["shards"]
                counts = {str(s): {k: int(c[k]) for k in ("episodes", "steps", "meta_bytes")} for s, c in counts.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise StoreIntegrityError(f"{self.root}/{path}: damaged snapshot record: {e!r}") from None
            return BucketSnapshot(self, snapshot_id, counts, verify=verify)
        shards = self.shards()
        counts = dict(zip(shards, _POOL.map(self.read_commit, shards)))
        counts = {s: c for s, c in counts.items() if c["episodes"] > 0}
        digest = hashlib.sha256(json.dumps(counts, sort_keys=True).encode()).hexdigest()[:16]
        snap = BucketSnapshot(self, f"snap-{digest}", counts, verify=verify)
        snap.recorded = False
        if record:  # the same id always records the same counts: an existing record is this one
            self.objects.create(f"snapshots/{snap.id}.json", json.dumps({"shards": counts}).encode())
            snap.recorded = True
        return snap

    def size_bytes(self) -> int:
        """Bytes of every object under the store's prefix."""
        return sum(m["size"] for m in self.objects.list(""))


class BucketSnapshot(Snapshot):
    """A snapshot of a ``BucketStore``: the same reads as ``Snapshot``, each episode's rows
    from its own objects."""

    def load(self, episode: EpisodeInfo) -> dict[str, Any]:
        """One episode as numpy arrays (see ``Snapshot.load``)."""
        check_episode_size(self.store.schema, episode.key, episode.length, "not read")
        arrays = self._episode(episode)
        out = unpack(self.store.schema, arrays)
        out.update(split_table(arrays["step"]))
        out["info"] = episode
        return out

    def load_shard(self, shard: str) -> dict[str, Any]:
        """Every committed row of a shard, episodes concatenated in order (see ``Snapshot.load_shard``)."""
        if shard not in self.counts:
            raise InvalidNameError(f"shard {shard!r} is not in snapshot {self.id}")
        episodes = self._by_shard[shard]
        for ep in episodes:
            check_episode_size(self.store.schema, ep.key, ep.length, "not read")
        per_episode = list(_EPISODES.map(self._episode, episodes))
        names = array_names(self.store.schema)
        arrays = {name: np.concatenate([a[name] for a in per_episode]) for name in names}
        out = unpack(self.store.schema, arrays)
        out["step"] = arrays["step"]
        return out

    def _episode(self, episode: EpisodeInfo) -> dict[str, np.ndarray]:
        try:
            arrays = self.store.episode_arrays(episode.client_id, episode.episode)
        except StoreError:
            raise
        except Exception as e:  # a missing or damaged object: zarr and the codecs raise almost anything
            raise StoreIntegrityError(f"{episode.key}: data unreadable in {self.store.root}: {_first_line(e)} "
                                      f"(`robo-post store validate {self.store.root}`)") from e
        T = episode.length
        shapes_ok = all(len(a) == (T + 1 if name.startswith("obs/") else T) for name, a in arrays.items())
        if not shapes_ok or (self.verify and episode_checksum(arrays) != episode.checksum):
            raise StoreIntegrityError(f"episode {episode.key} fails its checksum: its data changed after commit "
                                      f"(`robo-post store validate {self.store.root}` lists every damaged episode)")
        return arrays


# --- the writer -------------------------------------------------------------------------
class ShardLease:
    """The writer lease of one shard: a chain of create-only objects ``lease/<G>.json``, each
    ``{owner, token, expires, released}`` (see the module docstring).

    Args:
        objects: the store's objects.
        shard: the shard.
        token: the holder's id, written into each generation.
        lease_s: how long a generation lasts.
    """

    def __init__(self, objects: Objects, shard: str, token: str, lease_s: float):
        if not lease_s > 0:
            raise ValueError(f"lease_s must be positive, got {lease_s!r}")
        self.objects, self.shard, self.token, self.lease_s = objects, shard, token, float(lease_s)
        self.generation: int | None = None  # the one this holder created last; None: not held
        self.renew_at = 0.0

    def _key(self, generation: int) -> str:
        return f"shards/{self.shard}/lease/{_index_key(generation)}.json"

    def _generations(self) -> list[int]:
        return sorted(g for m in self.objects.list(f"shards/{self.shard}/lease/")
                      if (g := _parse_index(m["path"].rsplit("/", 1)[-1])) is not None)

    def holder(self, generations: list[int] | None = None) -> dict[str, Any] | None:
        """The newest generation's content while it holds the shard (not released, not expired)."""
        generations = self._generations() if generations is None else generations
        if not generations:
            return None
        data = self.objects.get(self._key(generations[-1]))
        held = json.loads(data) if data else {}
        return held if not held.get("released") and held.get("expires", 0) > time.time() else None

    def take(self) -> None:
        """Take the shard: ``ShardLockedError`` while another holder's lease lasts."""
        leases = self._generations()
        held = self.holder(leases)
        if held is not None:
            raise ShardLockedError(
                f"shard {self.shard!r} is already open for writing by {held.get('owner', 'another writer')} "
                f"(its lease lasts {held['expires'] - time.time():.0f} s more unless renewed; a writer killed "
                "without closing holds it that long)")
        self.generation = leases[-1] if leases else -1
        self._next(released=False, taking=True)
        self.objects.delete([self._key(g) for g in leases])  # earlier generations: no one reads them

    def renew_if_due(self) -> None:
        """Renew once half the lease has passed: ``ShardLockedError`` when another holder took it."""
        if self.generation is None:
            raise ShardLockedError(f"shard {self.shard!r}: this writer is closed or lost its lease")
        if time.time() >= self.renew_at:
            self._next(released=False)

    def release(self) -> None:
        """Let the next holder take the shard at once (nothing to do if another took it)."""
        if self.generation is not None:
            try:
                self._next(released=True)
            except ShardLockedError:
                pass
            self.generation = None

    def _next(self, released: bool, taking: bool = False) -> None:
        """Create the next generation: ``ShardLockedError`` when another holder created it first."""
        generation = self.generation + 1
        now = time.time()
        body = {"owner": f"{socket.gethostname()}:{os.getpid()}", "token": self.token,
                "expires": now + self.lease_s, "released": released}
        if not self.objects.create(self._key(generation), json.dumps(body).encode()):
            self.generation = None
            raise ShardLockedError(f"shard {self.shard!r}: another writer " + (
                "took it at the same moment" if taking else "took it after this writer's lease expired"))
        if not taking:
            self.objects.delete([self._key(self.generation)])
        self.generation, self.renew_at = generation, now + self.lease_s / 2


class BucketShardWriter(EpisodeWriter):
    """Appends episodes to one shard of a ``BucketStore`` (see the module docstring for the
    commit protocol and the lease).

    Args:
        store: the open store.
        client_id: shard name (``check_name``).
        lease_s: how long the writer's lease lasts without a renewal (renewed at commits past
            half of it): a writer killed without closing holds the shard that long.

    Raises:
        ShardLockedError: another writer's lease on the shard lasts.
    """

    def __init__(self, store: BucketStore, client_id: str, lease_s: float = LEASE_S):
        super().__init__(store, client_id, fsync=True)
        self.objects = store.objects
        self.token = uuid.uuid4().hex[:16]  # names this writer's data groups and lease
        self._prefix = f"shards/{self.client_id}"
        self._specs = {**{f"obs/{k}": s for k, s in self.schema.observations.items()}, "action": self.schema.action,
                       **{f"extras/{k}": s for k, s in self.schema.extras.items()}}
        self.lease = ShardLease(self.objects, self.client_id, self.token, lease_s)
        self.lease.take()
        try:
            counts = store.read_commit(self.client_id)
            store.shard_episodes(self.client_id, counts)  # damaged records: refuse before adding to them
        except BaseException:
            self.close()
            raise
        self.n_episodes, self.n_steps = counts["episodes"], counts["steps"]

    # --- committing ----------------------------------------------------------------
    def _append(self, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.lease.renew_if_due()  # before the upload: a writer that lost the shard writes nothing
        index = self.n_episodes
        name = f"{_index_key(index)}-{self.token}"
        group = f"{self._prefix}/episodes/{name}"
        self._write_group(group, arrays)
        record = encode_record({**meta, "data": name})
        if not self.objects.create(f"{self._prefix}/commits/{_index_key(index)}.json", record):
            self.lease.generation = None
            raise ShardLockedError(f"shard {self.client_id!r}: another writer committed episode {index} first (this "
                                   "writer's lease had expired); this episode was not committed")
        self.n_episodes, self.n_steps = index + 1, self.n_steps + meta["length"]

    def _write_group(self, group: str, arrays: dict[str, np.ndarray]) -> None:
        """Write the episode's rows as a zarr group of its own: encoded by zarr in memory, then
        every object uploaded at once (zarr's own ``create_array`` on the object store would check
        and write each parent group of the key, a dozen requests per array)."""
        objects: dict[str, Any] = {}
        memory = zarr.open_group(zarr.storage.MemoryStore(objects), mode="w")
        for name, values in arrays.items():
            spec = self._specs.get(name)
            rows = min(time_chunk(spec) if spec is not None else 1024, len(values))
            memory.create_array(
                name, data=np.ascontiguousarray(values), chunks=(rows, *values.shape[1:]), fill_value=0,
                compressors=BloscCodec(cname="lz4", clevel=5,
                                       shuffle="shuffle" if values.dtype.itemsize > 1 else "noshuffle"),
            )

        def upload(key: str) -> None:
            if not self.objects.create(f"{group}/{key}", objects[key].to_bytes()):
                raise StoreError(f"{self.store.root}/{group}/{key} exists already: two writers share token {self.token}")

        for _ in _POOL.map(upload, list(objects)):
            pass

    def close(self) -> None:
        """Release the shard (its lease) for the next writer."""
        self.lease.release()


# --- validate and repair ----------------------------------------------------------------
def _verify_episode(store: BucketStore, shard: str, index: int) -> tuple[EpisodeInfo | None, str | None]:
    """Episode ``index``'s record and None, or what is wrong with it (record or data)."""
    from robo_post.store.schema import EpisodeValidationError, validate_array

    try:
        ep, _ = store.record(shard, index)
    except StoreIntegrityError as e:
        return None, str(e)
    try:
        arrays = store.episode_arrays(shard, index)
    except Exception as e:
        return ep, f"data unreadable: {_first_line(e)}"
    if episode_checksum(arrays) != ep.checksum:
        return ep, "data fails its checksum (changed after commit)"
    schema = store.schema
    try:
        for k, spec in schema.observations.items():
            validate_array(f"obs/{k}", arrays[f"obs/{k}"], spec, ep.length + 1)
        validate_array("action", arrays["action"], schema.action, ep.length)
        for k, spec in schema.extras.items():
            validate_array(f"extras/{k}", arrays[f"extras/{k}"], spec, ep.length)
    except EpisodeValidationError as e:
        return ep, str(e)
    return ep, None


def _scan_shard(store: BucketStore, shard: str) -> tuple[int, list[int], dict[int, str], list[EpisodeInfo]]:
    """``(n, later, bad, good)``: commit listing, episodes that fail (index -> why), and the
    leading run of episodes that verify and follow one another."""
    n, later = store.commit_listing(shard)
    indices = list(range(n)) + later
    results = dict(zip(indices, _EPISODES.map(lambda i: _verify_episode(store, shard, i), indices)))
    bad = {i: why for i, (_, why) in results.items() if why is not None}
    good, steps = [], 0
    for i in range(n):
        ep, why = results[i]
        if why is not None or (ep.client_id, ep.episode, ep.step_start, ep.obs_start) != (shard, i, steps, steps + i):
            bad.setdefault(i, "record does not follow the one before it")
            break
        good.append(ep)
        steps += ep.length
    return n, later, bad, good


def _snapshot_records(store: BucketStore) -> list[tuple[str, dict[str, int] | Exception]]:
    records = []
    for m in store.objects.list("snapshots/"):
        key = m["path"]
        if not key.endswith(".json"):
            continue
        try:
            shards = {str(k): int(c["episodes"]) for k, c in json.loads(store.objects.get(key) or b"")["shards"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            shards = e
        records.append((key, shards))
    return records


def validate_bucket(root: str) -> tuple[int, list[str]]:
    """``validate_store`` for a store on object storage: schema, each shard's commit records
    (a gap hides the episodes past it), every record's checksum and order, every episode's data
    (checksum, schema constraints), and that no shard commits fewer episodes than a recorded
    snapshot saw. Returns ``(episodes_checked, problems)``."""
    try:
        store = BucketStore.open(root, verify=False)
    except StoreError as e:
        return 0, [f"cannot open store: {e}"]
    problems, checked, committed = [], 0, {}
    for shard in store.shards():
        n, later, bad, good = _scan_shard(store, shard)
        committed[shard] = n
        checked += len(good)
        if later:
            problems.append(f"shard {shard}: the record of episode {n} is missing, yet records {index_ranges(later)} "
                            "exist: those episodes are hidden (`robo-post store repair --apply` keeps the ones that "
                            "verify)")
        for i, why in sorted(bad.items()):
            problems.append(f"{shard}/{i}: {why} (`robo-post store repair --apply` cuts it out and keeps the intact "
                            "episodes after it)")
    problems += [f"{store.root}/{key}: damaged snapshot record: {shards!r} (`robo-post store repair` sets it aside)"
                 for key, shards in _snapshot_records(store) if isinstance(shards, Exception)]
    return checked, problems + lost_since_snapshots(store, committed)


def snapshot_ids(root: str) -> set[str]:
    """Ids of the snapshots recorded in the store on object storage at ``root``."""
    return {key.rsplit("/", 1)[-1].removesuffix(".json") for key, _ in _snapshot_records(BucketStore.open(root, verify=False))}


def lost_since_snapshots(store: BucketStore, committed: dict[str, int] | None = None) -> list[str]:
    """Shards that commit fewer episodes than a recorded snapshot saw (records deleted, a shard
    deleted whole), from commit listings and snapshot records only; ``committed``: shard -> its
    committed episodes, when known."""
    if committed is None:
        committed = {shard: store.commit_listing(shard)[0] for shard in store.shards()}
    problems = []
    for key, shards in _snapshot_records(store):
        for shard, seen in sorted(shards.items()) if isinstance(shards, dict) else []:
            if committed.get(shard, 0) < seen:
                problems.append(f"shard {shard}: commits {committed.get(shard, 0)} episodes, yet snapshot "
                                f"{key.rsplit('/', 1)[-1][:-5]} saw {seen}: episodes were lost")
    return problems


def repair_bucket(root: str, apply: bool = False) -> list[str]:
    """``repair_store`` for a store on object storage. Per damaged shard (holding its lease, so
    never under a live writer): the episodes past the damage that verify on their own are copied
    into shard ``<shard>-salvaged`` (``attrs["salvaged_from"]``), then the commit records from the
    first damaged one on are deleted, the first one first, which hides the rest at once. Data
    groups that no record names (a killed writer's episode in flight) are deleted; snapshot
    records that are damaged, or saw episodes no longer committed, are set aside
    (``<id>.json.damaged``, ``<id>.json.saw-lost-episodes``). Without ``apply`` nothing changes."""
    store = BucketStore.open(root, verify=False)
    verb = (lambda done, would: done) if apply else (lambda done, would: would)
    actions, committed = [], {}
    for shard in store.shards():
        n, later, bad, good = _scan_shard(store, shard)
        committed[shard] = len(good)
        named = {store.record(shard, i)[1] for i in range(len(good))}
        lease = ShardLease(store.objects, shard, f"repair-{uuid.uuid4().hex[:8]}", LEASE_S)
        orphans = _unnamed(store, shard, named)
        if lease.holder() is not None:  # the live writer's episode in flight is not an orphan
            orphans = [p for p in orphans if (_parse_index(p.split("/")[3]) or 0) < n]
        if not bad and not later and not orphans:
            continue
        if apply:
            try:
                lease.take()  # no writer may append while the shard is cut back
            except ShardLockedError as e:
                actions.append(Unrepairable(f"cannot repair shard {shard} now: {e}; run it again once that writer "
                                            "has closed"))
                continue
        try:
            line = f"shard {shard}:"
            if bad or later:
                first = min([*bad, *([n] if later else [])])
                keep = [i for i in [*range(len(good) + 1, n), *later] if i not in bad]
                cut = sorted({*range(len(good), n), *later})
                line += (f" episode {first}: {bad.get(first, 'its commit record is missing')};"
                         f" {verb('cut', 'would cut')} the shard back to {len(good)} episodes")
                if keep:
                    line += (f"; {verb('copied', 'would copy')} {len(keep)} later episodes that verify "
                             f"({index_ranges(keep)}) into shard {shard}{SALVAGE_SUFFIX}")
                if apply:
                    _salvage(store, shard, keep, shard + SALVAGE_SUFFIX)
                    store.objects.delete([f"shards/{shard}/commits/{_index_key(i)}.json" for i in cut])
                    for i in cut:
                        store._records.pop((shard, i), None)
                    orphans = _unnamed(store, shard, named)
            if orphans:
                groups = {p.split("/")[3] for p in orphans}
                line += (f" {verb('deleted', 'would delete')} the data of {len(groups)} uncommitted episodes "
                         f"({len(orphans)} objects: writers killed mid-episode, or cut by repair)")
                if apply:
                    store.objects.delete(orphans)
            actions.append(line)
        finally:
            lease.release()
    for key, shards in _snapshot_records(store):
        if isinstance(shards, Exception):
            actions.append(f"snapshot record {store.root}/{key}: damaged; {verb('set', 'would set')} it aside as "
                           f"{key.rsplit('/', 1)[-1]}.damaged")
            aside = f"{key}.damaged"
        elif any(committed.get(s, 0) < seen for s, seen in shards.items()):
            actions.append(f"snapshot record {store.root}/{key} saw episodes the store no longer commits; "
                           f"{verb('set', 'would set')} it aside as {key.rsplit('/', 1)[-1]}{LOST_SUFFIX}")
            aside = key + LOST_SUFFIX
        else:
            continue
        if apply:
            store.objects.create(aside, store.objects.get(key) or b"")
            store.objects.delete([key])
    return actions


def _unnamed(store: BucketStore, shard: str, named: set[str]) -> list[str]:
    """The objects of every data group of ``shard`` that no committed record names."""
    return [m["path"] for m in store.objects.list(f"shards/{shard}/episodes/")
            if m["path"].split("/")[3] not in named]


def _salvage(store: BucketStore, shard: str, indices: Iterable[int], target: str) -> None:
    """Copy the episodes ``indices`` of ``shard`` into shard ``target``, skipping any copied before."""
    indices = list(indices)
    if not indices:
        return
    with store.writer(target) as writer:
        before = {(ep.attrs.get("salvaged_from"), ep.checksum) for ep in store.shard_episodes(target)}
        for i in indices:
            ep, _ = store.record(shard, i)
            if (ep.key, ep.checksum) in before:
                continue
            write_salvaged(writer, store.schema, store.episode_arrays(shard, i), ep)
