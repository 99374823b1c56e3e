"""A ROS 2 bridge's liveness, read from its status file ``STORE/fleet/<client_id>.json``
(``robo-post fleet ros2-status``): no ROS needed to read it."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from robo_post.utils.io import host_dir

STALE_S = 10.0  # a running bridge whose status file heartbeat is older than this is dead


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a killed child not yet reaped is a zombie: gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class BridgeStatusError(ValueError):
    """A bridge's status file is damaged: not a JSON object, or its ``pid`` or ``heartbeat`` unreadable."""


def read_bridge_status(root: str, client_id: str, stale_s: float = STALE_S, now: float | None = None) -> dict[str, Any]:
    """A bridge's status file, with ``state`` set to ``dead`` (and ``dead_reason``) when it
    says ``running`` but its pid is gone (same host) or its heartbeat is older than ``stale_s``.

    Raises:
        FileNotFoundError: no status file for ``client_id``.
        BridgeStatusError: the file is damaged.
    """
    path = os.path.join(host_dir(root, "fleet"), f"{client_id}.json")
    try:
        with open(path) as f:
            status = json.load(f)
        if not isinstance(status, dict):
            raise TypeError(f"a JSON {type(status).__name__}, not an object")
        if status.get("state") != "running":
            return status
        pid, heartbeat = int(status["pid"]), float(status.get("heartbeat", 0.0))
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise BridgeStatusError(f"{path} is not a bridge status ({e!r})") from None
    now = time.time() if now is None else now
    age = now - heartbeat
    if status.get("host") == socket.gethostname() and not _pid_alive(pid):
        return {**status, "state": "dead", "dead_reason": f"process {status['pid']} is gone"}
    if age > stale_s:
        return {**status, "state": "dead", "dead_reason": f"no heartbeat for {age:.1f} s (> {stale_s} s)"}
    return status


def bridge_statuses(root: str, stale_s: float = STALE_S) -> list[dict[str, Any]]:
    """``read_bridge_status`` of every ROS 2 bridge with a status file under ``root``."""
    folder = Path(host_dir(root, "fleet"))
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or not a status file
        if isinstance(status, dict) and status.get("kind") == "ros2-bridge":
            out.append(read_bridge_status(root, path.stem, stale_s))
    return out
