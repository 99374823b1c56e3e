"""Policy registry beside the data: ``ROOT/policies/v000001/{model.safetensors, config.json}``.

A version directory is assembled under a temporary name and renamed into place
in one step, so readers either see a complete version or none.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from robo_post.store.schema import StoreError

_VERSION_DIR = re.compile(r"^v(\d{6,})$")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class PolicyVersionExistsError(StoreError):
    """A policy with this version number was already published."""


class PolicyNotFoundError(StoreError, LookupError):
    """No such policy version in the registry."""


class PolicyRegistry:
    """Versioned policy artifacts (safetensors weights + JSON config) in a store.

    Args:
        store_root: root directory of the trajectory store.
    """

    def __init__(self, store_root: str):
        self.dir = os.path.join(store_root, "policies")
        os.makedirs(self.dir, exist_ok=True)

    def versions(self) -> list[int]:
        """Published versions, ascending."""
        out = []
        for name in os.listdir(self.dir):
            m = _VERSION_DIR.match(name)
            if m:
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
        final = os.path.join(self.dir, f"v{version:06d}")
        if os.path.exists(final):
            raise PolicyVersionExistsError(f"policy version {version} already exists")
        tmp = os.path.join(self.dir, f".tmp-{uuid.uuid4().hex}")
        os.makedirs(tmp)
        try:
            tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
            save_file(tensors, os.path.join(tmp, WEIGHTS_FILE))
            with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump({**config, "version": version}, f, indent=1, allow_nan=False)
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                with open(os.path.join(tmp, name), "rb") as f:
                    os.fsync(f.fileno())
            try:
                os.rename(tmp, final)  # atomic; fails if `final` appeared meanwhile
            except OSError:
                raise PolicyVersionExistsError(f"policy version {version} already exists") from None
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
        return version

    def load(self, version: int | None = None, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Load ``(weights, config)`` of ``version`` (default: latest)."""
        if version is None:
            version = self.latest()
            if version is None:
                raise PolicyNotFoundError(f"no policy published in {self.dir}")
        path = os.path.join(self.dir, f"v{version:06d}")
        if not os.path.isdir(path):
            raise PolicyNotFoundError(f"policy version {version} not found in {self.dir}")
        weights = load_file(os.path.join(path, WEIGHTS_FILE), device=device)
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
        return weights, config
