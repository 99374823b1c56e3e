"""What the dataset converters (Minari, LeRobot) share: how an import records where an episode
came from, its typed success-rule error, the store's import lock, and the clean-up of staging
folders that killed exports left behind."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from typing import Iterator

from robo_post.store.schema import StoreError
from robo_post.store.writer import try_lock

# Per imported episode: {"dataset": the dataset's id or folder, "episode": its index there}.
SOURCE_ATTR = "imported_from"


class SuccessRuleError(StoreError, ValueError):
    """No usable success rule for an import: none given for a foreign dataset, a malformed rule,
    or an info key or feature the dataset lacks."""


def kept(n: int, store_root: str | os.PathLike) -> str:
    """What an import that stopped part way leaves in the store, in words."""
    return f"{n} earlier episode(s) stay imported in {store_root}" if n else "nothing was imported"


@contextlib.contextmanager
def import_lock(root: str) -> Iterator[None]:
    """Hold the store's import lock (a flock on its directory); wait while another import holds it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another import into {root} to finish", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_dead_exports(root: str) -> None:
    """Remove the staging folders ``<root>.export-*`` of killed exports: those whose lock no live
    export holds (an export running meanwhile keeps its own)."""
    parent, prefix = os.path.dirname(root.rstrip(os.sep)) or ".", os.path.basename(root.rstrip(os.sep)) + ".export-"
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        path = os.path.join(parent, name)
        if not name.startswith(prefix) or not os.path.isdir(path):
            continue
        try:
            fd = try_lock(path, lambda: BlockingIOError())
        except OSError:  # a live export's (or not ours to remove)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
