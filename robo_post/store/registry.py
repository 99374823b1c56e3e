"""Policy registry beside the data: ``ROOT/policies/v000001/{model.safetensors, config.json, checksums.json}``.

A version directory is assembled under a temporary name and renamed into place
in one step, so readers either see a complete version or none. Each file's CRC32C
is recorded at publishing and checked on every load: damage done afterwards is an
error naming the version and file, never a policy that silently acts differently.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any, Mapping

import crc32c
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from robo_post.store.schema import StoreError, check_folder, is_object_url
from robo_post.utils.io import naming, write_json_atomic

_VERSION_DIR = re.compile(r"^v(\d{6,})$")
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
        store_root: root directory of the trajectory store.
    """

    def __init__(self, store_root: str):
        if is_object_url(store_root):
            raise StoreError(f"the policy registry of {store_root}: publishing policies to object storage is not "
                             "supported yet; keep the registry in a store on a local or shared disk")
        self.dir = os.path.join(store_root, "policies")
        check_policies_folder(store_root)
        os.makedirs(self.dir, exist_ok=True)

    def check_writable(self) -> None:
        """Fail before a training run, not at its end, when nothing can be published here."""
        probe = os.path.join(self.dir, f".probe-{uuid.uuid4().hex}")
        try:
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:
            raise RegistryNotWritableError(f"cannot publish policies to {self.dir}: {e.strerror or e}") from e

    def versions(self) -> list[int]:
        """Published versions, ascending."""
        out = []
        for name in os.listdir(self.dir):
            m = _VERSION_DIR.match(name)
            # Only the folder `load` reads: a `v0000002` beside `v000002` (a copy, a hand-made
            # folder) or a plain file named like a version would count a version twice or one
            # that cannot load.
            if m and name == _dirname(int(m.group(1))) and os.path.isdir(os.path.join(self.dir, name)):
                out.append(int(m.group(1)))
        return sorted(out)

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
        final = os.path.join(self.dir, _dirname(version))
        if os.path.exists(final):
            raise PolicyVersionExistsError(f"policy version {version} already exists")
        tmp = os.path.join(self.dir, f".tmp-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
            # written by us, not safetensors' save_file, which makes the file 0600: fleet processes
            # of another user must read the weights as they read the config (the umask decides)
            with naming(final), open(os.path.join(tmp, WEIGHTS_FILE), "wb") as f:
                f.write(save_safetensors(tensors))
            with naming(final), open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump({**config, "version": version, _CHECKSUMMED: True}, f, indent=1, allow_nan=False)
            checksums = {}
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                with open(os.path.join(tmp, name), "rb") as f:
                    checksums[name] = crc32c.crc32c(f.read())
                    os.fsync(f.fileno())
            write_json_atomic(os.path.join(tmp, CHECKSUM_FILE), checksums)
            try:
                os.rename(tmp, final)  # atomic; fails if `final` appeared meanwhile
            except OSError:
                raise PolicyVersionExistsError(f"policy version {version} already exists") from None
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
        return version

    def peek_config(self, version: int) -> dict[str, Any] | None:
        """``version``'s config as its file reads, unchecked and without its weights (to list
        versions; ``load`` is what checks a version), or None where it does not read as one."""
        try:
            config = json.loads(_read(os.path.join(self.dir, _dirname(version)), CONFIG_FILE, version))
        except (PolicyArtifactError, ValueError):
            return None
        return config if isinstance(config, dict) else None

    def load(self, version: int | None = None, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Load ``(weights, config)`` of ``version`` (default: latest)."""
        if version is None:
            version = self.latest()
            if version is None:
                raise PolicyNotFoundError(f"no policy published in {self.dir}")
        path = os.path.join(self.dir, _dirname(version))
        if not os.path.isdir(path):
            raise PolicyNotFoundError(f"policy version {version} not found in {self.dir}")
        data = {name: _read(path, name, version) for name in (WEIGHTS_FILE, CONFIG_FILE)}
        checksummed = os.path.exists(os.path.join(path, CHECKSUM_FILE))  # versions published before checksums have none
        if checksummed:
            try:
                expected = dict(json.loads(_read(path, CHECKSUM_FILE, version)))
            except (ValueError, TypeError) as e:
                raise _unreadable(path, CHECKSUM_FILE, version, e) from e
            for name, raw in data.items():
                if crc32c.crc32c(raw) != expected.get(name):
                    raise PolicyArtifactError(f"policy version {version}: {os.path.join(path, name)} does not match "
                                              f"the checksum recorded when it was published (changed or damaged since)")
        try:
            weights = {k: v.to(device) for k, v in load_safetensors(data[WEIGHTS_FILE]).items()}
        except Exception as e:  # safetensors raises its own error type for a malformed file
            raise _unreadable(path, WEIGHTS_FILE, version, e) from e
        try:
            config = json.loads(data[CONFIG_FILE])
            if not isinstance(config, dict):
                raise ValueError(f"a JSON {type(config).__name__}, not an object")
        except ValueError as e:
            raise _unreadable(path, CONFIG_FILE, version, e) from e
        # A version published with checksums says so in its config: without the file, damaged
        # weights would load unchecked.
        if config.pop(_CHECKSUMMED, False) and not checksummed:
            raise PolicyArtifactError(f"policy version {version}: {os.path.join(path, CHECKSUM_FILE)} is missing "
                                      f"(written when it was published); its files cannot be checked")
        if config.get("version", version) != version:  # a version folder copied or renamed by hand
            raise PolicyArtifactError(f"policy version {version}: {os.path.join(path, CONFIG_FILE)} is version "
                                      f"{config['version']}'s (a copied or renamed version folder)")
        return weights, config


def check_policies_folder(store_root: str) -> None:
    """Raise ``StoreLayoutError`` when the store's ``policies`` is there but not a folder."""
    check_folder(os.path.join(store_root, "policies"), "its published policies", "move it aside, and put back the "
                 "folder of policies it replaced, if any (`robo-post store repair` cannot: a new, empty folder would "
                 "number policies from 1 again, reusing versions that recorded episodes name)")


def _dirname(version: int) -> str:
    return f"v{version:06d}"


def _unreadable(path: str, name: str, version: int, e: Exception) -> PolicyArtifactError:
    return PolicyArtifactError(f"policy version {version}: {os.path.join(path, name)} is unreadable "
                               f"({type(e).__name__}: {e})")


def _read(path: str, name: str, version: int) -> bytes:
    try:
        with open(os.path.join(path, name), "rb") as f:
            return f.read()
    except OSError as e:
        raise PolicyArtifactError(f"policy version {version}: cannot read {os.path.join(path, name)} ({e})") from e
