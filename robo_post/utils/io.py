"""File helpers shared by the store, the learner, eval, the fleet and the pipelines:
store locations (a path or an object-storage URL), atomic JSON writes, errors that name
their file, non-blocking file locks and reading a metrics log that a killed writer may have
cut short."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import urllib.parse
from typing import Any, Callable, Iterator


OBJECT_SCHEMES = ("s3", "gs", "az", "file")
"""URL schemes of stores on object storage (``bucket.py``): S3 and its compatibles, Google Cloud
Storage, Azure Blob Storage, and a local folder through the same layer (``file://``)."""


def is_object_url(root: str) -> bool:
    """Whether ``root`` names a store on object storage (``s3://bucket/prefix``, ...) rather than a path."""
    return isinstance(root, str) and root.partition("://")[0].lower() in OBJECT_SCHEMES and "://" in root


def absolute_root(root: str) -> str:
    """A store root as runs record it: an object-storage URL as given, a path made absolute."""
    return root if is_object_url(root) else os.path.abspath(root)


def host_dir(root: str, name: str) -> str:
    """The folder of this host's process state ``name`` (``fleet``: client status, logs, locks)
    for the store at ``root``: inside a store on disk; for one on object storage, a local folder
    by its URL under ``$ROBO_POST_STATE_DIR`` (default ``~/.cache/robo-post``), since logs and
    locks belong to the host that runs the processes."""
    if not is_object_url(root):
        return os.path.join(root, name)
    parts = urllib.parse.urlsplit(root)
    base = os.environ.get("ROBO_POST_STATE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "robo-post")
    return os.path.join(base, parts.scheme, parts.netloc or "local", parts.path.strip("/"), name)


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Re-raise an ``OSError`` that names no file (a write or close on a full disk or past a
    file-size limit) as one naming ``path``, so the user learns where."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, path) from None


def write_json_atomic(path: str, obj: Any, fsync: bool = True, indent: int | None = None,
                      default: Callable[[Any], Any] | None = None) -> None:
    """Write JSON to ``path`` so readers (and a rerun after a kill) see the old or the new file, never a mix."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"  # unique per writer thread too
    try:
        with naming(path), open(tmp, "w") as f:
            json.dump(obj, f, indent=indent, default=default)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk would otherwise leave one per attempt
            os.remove(tmp)
        raise


def try_lock(path: str, refused: Callable[[], Exception]) -> int:
    """Take an exclusive flock on ``path`` (a directory, or a lock file created if missing)
    without waiting; returns the descriptor that holds it (closing it releases the lock, as
    does the process dying).

    Raises:
        ``refused()``: another process holds it.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY if os.path.isdir(path) else os.O_CREAT | os.O_RDWR
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise refused() from None
    return fd


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (none when it is missing), without a last row a killed
    (or still running) trainer had not finished writing.

    Raises:
        ValueError: a row is not JSON, naming the file.
    """
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except ValueError as e:
        raise ValueError(f"{path} is not a metrics log ({e})") from e
