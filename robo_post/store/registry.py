"""Policy registry beside the data: ``ROOT/policies/v000001/{model.safetensors, config.json, checksums.json}``
on a file system, ``ROOT/policies/v000001.json`` (the version's record) beside its files on object storage.

A version becomes visible in one step (a folder renamed into place; a create-only record),
so readers either see a complete version or none. Each file's CRC32C
is recorded at publishing and checked on every load: damage done afterwards is an
error naming the version and file, never a policy that silently acts differently.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any, Callable, Mapping

import crc32c
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from robo_post.store.schema import StoreError, check_folder
from robo_post.utils.io import is_object_url, naming, write_json_atomic

_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_VERSION_RECORD = re.compile(r"^v(\d{6,})\.json$")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CHECKSUM_FILE = "checksums.json"
_CHECKSUMMED = "checksummed"  # config key: this version was published with CHECKSUM_FILE


class PolicyVersionExistsError(StoreError):
    """A policy with this version number was already published."""


class PolicyNotFoundError(StoreError, LookupError):
    """No such policy version in the registry."""


class PolicyArtifactError(StoreError):
    """A published version's files are missing, unreadable or changed since publishing."""


class RegistryNotWritableError(StoreError):
    """Nothing can be published to the registry (a read-only store, a full disk)."""


class PolicyRegistry:
    """Versioned policy artifacts (safetensors weights + JSON config) in a store.

    Args:
        store_root: root of the trajectory store: a directory, or an object-storage URL
            (``s3://bucket/prefix``, ``gs://``, ``az://``, ``file://``).
    """

    def __init__(self, store_root: str):
        self._files = _BucketVersions(store_root) if is_object_url(store_root) else _LocalVersions(store_root)
        self.location = self._files.location

    def check_writable(self) -> None:
        """Fail before a training run, not at its end, when nothing can be published here."""
        self._files.check_writable()

    def versions(self) -> list[int]:
        """Published versions, ascending."""
        return self._files.versions()

    def latest(self) -> int | None:
        """The newest published version, or ``None`` if nothing was published."""
        versions = self.versions()
        return versions[-1] if versions else None

    def publish(
        self, weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], version: int | None = None
    ) -> int:
        """Publish a policy; returns its version (``latest() + 1`` when not given).

        Raises:
            PolicyVersionExistsError: the version is taken (also on a lost race
                between two publishers picking the same number).
        """
        if version is None:
            version = (self.latest() or 0) + 1
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"policy version must be a positive int, got {version!r}")
        if self._files.has(version):
            raise PolicyVersionExistsError(f"policy version {version} already exists")
        tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        files = {WEIGHTS_FILE: save_safetensors(tensors),
                 CONFIG_FILE: json.dumps({**config, "version": version, _CHECKSUMMED: True}, indent=1,
                                         allow_nan=False).encode()}
        if not self._files.write(version, files, {name: crc32c.crc32c(data) for name, data in files.items()}):
            raise PolicyVersionExistsError(f"policy version {version} already exists")
        return version

    def peek_config(self, version: int) -> dict[str, Any] | None:
        """``version``'s config as its file reads, unchecked and without its weights (to list
        versions; ``load`` is what checks a version), or None where it does not read as one."""
        try:
            config = json.loads(self._read(version, CONFIG_FILE))
        except (PolicyArtifactError, ValueError):
            return None
        return config if isinstance(config, dict) else None

    def load(self, version: int | None = None, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Load ``(weights, config)`` of ``version`` (default: latest)."""
        if version is None:
            version = self.latest()
            if version is None:
                raise PolicyNotFoundError(f"no policy published in {self.location}")
        if not self._files.has(version):
            raise PolicyNotFoundError(f"policy version {version} not found in {self.location}")
        data = {name: self._read(version, name) for name in (WEIGHTS_FILE, CONFIG_FILE)}
        expected = self._files.checksums(version)  # None: published before checksums were recorded
        if expected is not None:
            for name, raw in data.items():
                if crc32c.crc32c(raw) != expected.get(name):
                    raise PolicyArtifactError(f"policy version {version}: {self._files.path(version, name)} does not "
                                              "match the checksum recorded when it was published (changed or "
                                              "damaged since)")
        try:
            weights = {k: v.to(device) for k, v in load_safetensors(data[WEIGHTS_FILE]).items()}
        except Exception as e:  # safetensors raises its own error type for a malformed file
            raise _unreadable(version, self._files.path(version, WEIGHTS_FILE), e) from e
        try:
            config = json.loads(data[CONFIG_FILE])
            if not isinstance(config, dict):
                raise ValueError(f"a JSON {type(config).__name__}, not an object")
        except ValueError as e:
            raise _unreadable(version, self._files.path(version, CONFIG_FILE), e) from e
        # A version published with checksums says so in its config: without the file, damaged
        # weights would load unchecked.
        if config.pop(_CHECKSUMMED, False) and expected is None:
            raise PolicyArtifactError(f"policy version {version}: {self._files.path(version, CHECKSUM_FILE)} is "
                                      "missing (written when it was published); its files cannot be checked")
        if config.get("version", version) != version:  # a version folder copied or renamed by hand
            raise PolicyArtifactError(f"policy version {version}: {self._files.path(version, CONFIG_FILE)} is version "
                                      f"{config['version']}'s (a copied or renamed version folder)")
        return weights, config

    def _read(self, version: int, name: str) -> bytes:
        data = self._files.read(version, name)
        if data is None:
            raise PolicyArtifactError(f"policy version {version}: cannot read {self._files.path(version, name)} "
                                      "(it is missing)")
        return data


class _LocalVersions:
    """Versions as folders ``vNNNNNN/`` on a file system: a version is assembled under a temporary
    name and renamed into place in one step (the rename fails if the name was taken meanwhile)."""

    def __init__(self, store_root: str):
        self.location = os.path.join(store_root, "policies")
        check_policies_folder(store_root)
        os.makedirs(self.location, exist_ok=True)

    def path(self, version: int, name: str) -> str:
        return os.path.join(self.location, _dirname(version), name)

    def check_writable(self) -> None:
        probe = os.path.join(self.location, f".probe-{uuid.uuid4().hex}")
        try:
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:
            raise RegistryNotWritableError(f"cannot publish policies to {self.location}: {e.strerror or e}") from e

    def versions(self) -> list[int]:
        out = []
        for name in os.listdir(self.location):
            m = _VERSION_DIR.match(name)
            # Only the folder `load` reads: a `v0000002` beside `v000002` (a copy, a hand-made
            # folder) or a plain file named like a version would count a version twice or one
            # that cannot load.
            if m and name == _dirname(int(m.group(1))) and os.path.isdir(os.path.join(self.location, name)):
                out.append(int(m.group(1)))
        return sorted(out)

    def has(self, version: int) -> bool:
        return os.path.isdir(os.path.join(self.location, _dirname(version)))

    def write(self, version: int, files: dict[str, bytes], checksums: dict[str, int]) -> bool:
        final = os.path.join(self.location, _dirname(version))
        tmp = os.path.join(self.location, f".tmp-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            for name, data in files.items():
                # written by us, not safetensors' save_file, which makes the file 0600: fleet processes
                # of another user must read the weights as they read the config (the umask decides)
                with naming(final), open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            write_json_atomic(os.path.join(tmp, CHECKSUM_FILE), checksums)
            try:
                os.rename(tmp, final)  # atomic; fails if `final` appeared meanwhile
            except OSError:
                return False
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
        return True

    def read(self, version: int, name: str) -> bytes | None:
        path = self.path(version, name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PolicyArtifactError(f"policy version {version}: cannot read {path} ({e})") from e

    def checksums(self, version: int) -> dict[str, int] | None:
        raw = self.read(version, CHECKSUM_FILE)  # versions published before checksums have none
        if raw is None:
            return None
        try:
            return dict(json.loads(raw))
        except (ValueError, TypeError) as e:
            raise _unreadable(version, self.path(version, CHECKSUM_FILE), e) from e


class _BucketVersions:
    """Versions on object storage. A version's files are uploaded under a fresh name
    (``vNNNNNN-<random>/``), then one create-only record ``vNNNNNN.json`` (If-None-Match) naming
    them with their checksums publishes it: readers see a version only once it is complete, and
    of two publishers racing for a number, the one whose record lands first wins; the other's
    create fails, so it deletes its uploads and reports the version taken."""

    def __init__(self, store_root: str):
        from robo_post.store.bucket import Objects

        self.objects = Objects(store_root.rstrip("/") + "/policies", create=True)
        self.location = self.objects.url
        self._records: dict[int, dict[str, Any]] = {}  # records never change once created

    def path(self, version: int, name: str) -> str:
        if name == CHECKSUM_FILE:
            return f"{self.location}/{_dirname(version)}.json"
        try:
            folder = (self._record(version) or {}).get("folder", f"{_dirname(version)}-*")
        except PolicyArtifactError:
            folder = f"{_dirname(version)}-*"
        return f"{self.location}/{folder}/{name}"

    def check_writable(self) -> None:
        probe = f".probe-{uuid.uuid4().hex}"
        try:
            self.objects.create(probe, b"")
            self.objects.delete([probe])
        except StoreError as e:
            raise RegistryNotWritableError(f"cannot publish policies to {self.location}: {e}") from e

    def versions(self) -> list[int]:
        out = []
        for name in self.objects.files(""):
            m = _VERSION_RECORD.match(name)
            if m and name == f"{_dirname(int(m.group(1)))}.json":
                out.append(int(m.group(1)))
        return sorted(out)

    def _record(self, version: int) -> dict[str, Any] | None:
        if version in self._records:
            return self._records[version]
        raw = self.objects.get(f"{_dirname(version)}.json")
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            if not (isinstance(record, dict) and isinstance(record.get("folder"), str)
                    and isinstance(record.get("checksums"), dict)):
                raise ValueError("not a version record (folder and checksums)")
        except ValueError as e:
            raise _unreadable(version, self.path(version, CHECKSUM_FILE), e) from e
        self._records[version] = record
        return record

    def has(self, version: int) -> bool:
        try:
            return self._record(version) is not None
        except PolicyArtifactError:  # a damaged record still takes its number
            return True

    def write(self, version: int, files: dict[str, bytes], checksums: dict[str, int]) -> bool:
        folder = f"{_dirname(version)}-{uuid.uuid4().hex}"
        keys = [f"{folder}/{name}" for name in files]
        for key, data in zip(keys, files.values()):
            self.objects.create(key, data)  # a fresh folder: nothing to overwrite
        record = json.dumps({"folder": folder, "checksums": checksums}).encode()
        if self.objects.create(f"{_dirname(version)}.json", record):
            return True
        self.objects.delete(keys)
        return False

    def read(self, version: int, name: str) -> bytes | None:
        record = self._record(version)
        return None if record is None else self.objects.get(f"{record['folder']}/{name}")

    def checksums(self, version: int) -> dict[str, int] | None:
        record = self._record(version)
        return None if record is None else record["checksums"]


def _unreadable(version: int, path: str, e: Exception) -> PolicyArtifactError:
    return PolicyArtifactError(f"policy version {version}: {path} is unreadable ({type(e).__name__}: {e})")


def version_problems(registry: PolicyRegistry, recorded: set[str], record_path: Callable[[str], str]) -> list[str]:
    """What ``store validate`` reports of the published versions: each one whose files fail their
    checks, and each trained on a snapshot whose record (at ``record_path(id)``) is not among
    the ``recorded`` snapshot ids."""
    problems = []
    for version in registry.versions():
        try:
            _, config = registry.load(version)
        except StoreError as e:  # PolicyArtifactError names the version and the file
            problems.append(str(e))
            continue
        # The snapshot a version was trained on reopens by id only through its record.
        snapshot = config.get("snapshot")
        if isinstance(snapshot, str) and snapshot not in recorded:
            problems.append(f"policy v{version} was trained on snapshot {snapshot}, whose record "
                            f"{record_path(snapshot)} is missing: that snapshot cannot be reopened by id (a resumed "
                            "or repeated run on it fails); no episode is lost, and nothing can write the record again")
    return problems


def check_policies_folder(store_root: str) -> None:
    """Raise ``StoreLayoutError`` when the store's ``policies`` is there but not a folder."""
    check_folder(os.path.join(store_root, "policies"), "its published policies", "move it aside, and put back the "
                 "folder of policies it replaced, if any (`robo-post store repair` cannot: a new, empty folder would "
                 "number policies from 1 again, reusing versions that recorded episodes name)")


def _dirname(version: int) -> str:
    return f"v{version:06d}"


