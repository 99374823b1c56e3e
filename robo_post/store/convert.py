"""What the dataset converters (Minari, LeRobot) share: how an import records where an episode
came from, its typed success-rule error, the store's import lock, and the clean-up of staging
folders that killed exports left behind."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from typing import Any, Iterator

from robo_post.store.schema import EpisodeValidationError, StoreError
from robo_post.utils.io import try_lock

# Per imported episode: {"dataset": the dataset's id or folder, "episode": its index there}.
SOURCE_ATTR = "imported_from"


class SuccessRuleError(StoreError, ValueError):
    """No usable success rule for an import: none given for a foreign dataset, a malformed rule,
    or an info key or feature the dataset lacks."""


def kept(n: int, store_root: str | os.PathLike) -> str:
    """What an import that stopped part way leaves in the store, in words."""
    return f"{n} earlier episode(s) stay imported in {store_root}" if n else "nothing was imported"


@contextlib.contextmanager
def episode_import(source: str, index: int, n: int, store_root: str | os.PathLike, skip_invalid: bool,
                   invalid: list[tuple[int, str]]) -> Iterator[None]:
    """Around reading and writing ``source``'s episode ``index`` (``n`` imported so far): an
    episode that fails validation stops the import, or with ``skip_invalid`` is listed in
    ``invalid`` and the import goes on; any other store error says where the import stopped
    (earlier episodes stay committed, and importing again skips them)."""
    try:
        yield
    except EpisodeValidationError as e:
        if not skip_invalid:  # the dataset's own episode: importing again stops here again
            e.args = (f"{source}, episode {index}: {e}; {kept(n, store_root)}; the dataset's episode is invalid: "
                      "fix it and import again (only the rest is added), or pass --skip-invalid to import the others",
                      *e.args[1:])
            raise
        invalid.append((index, str(e)))
    except StoreError as e:  # same type, with where it stopped
        e.args = (f"{source}, episode {index}: {e}; {kept(n, store_root)}"
                  + ("; importing again adds only the rest" if n else ""), *e.args[1:])
        raise


def warn_relabel(relabel: list[Any], source: str, store_root: str | os.PathLike, success_from: str | None) -> None:
    """Say that ``relabel`` (the rules of episodes already held) keep their labels, not ``success_from``'s."""
    if relabel:
        rules = ", ".join(sorted({str(r) for r in relabel}))
        print(f"warning: {len(relabel)} episodes of {source} already in {store_root} keep the success labels of the "
              f"rule they were imported with ({rules}), not --success-from {success_from}: the rule labels only the "
              "episodes an import adds (import into a new store to label them all with it)", file=sys.stderr)


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
