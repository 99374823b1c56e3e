"""Helpers shared by test files (importable: pytest puts this folder on sys.path)."""

import json
import subprocess
import sys


def run_cli(*args: str, timeout: int = 300, ok: bool = True) -> subprocess.CompletedProcess:
    """``robo-post ARGS`` in a subprocess with this interpreter; with ``ok`` it must succeed."""
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", *args], capture_output=True, text=True, timeout=timeout)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def summary_of(stdout: str) -> dict:
    """The JSON summary a `robo-post train` prints after its progress lines."""
    return json.loads(stdout[stdout.index("{\n"):])
