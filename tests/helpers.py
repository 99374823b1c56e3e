"""Helpers shared by test files (importable: pytest puts this folder on sys.path)."""

import contextlib
import io
import json
import os
import subprocess
import sys


def run_cli(*args: str, timeout: int = 300, ok: bool = True) -> subprocess.CompletedProcess:
    """``robo-post ARGS`` in a subprocess with this interpreter; with ``ok`` it must succeed."""
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", *args], capture_output=True, text=True, timeout=timeout)
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def cli_in_process(*args: str, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``robo-post ARGS`` called in this process (``robo_post.cli.main``) with its output captured,
    as ``run_cli`` returns it: for the checks of what a command prints that need no process of
    its own (an interpreter's start-up costs seconds; a kill, a signal or the environment
    a command starts with still need ``run_cli``)."""
    from robo_post.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["robo-post", *args], code, out.getvalue(), err.getvalue())


def summary_of(stdout: str) -> dict:
    """The JSON summary a `robo-post train` prints after its progress lines."""
    return json.loads(stdout[stdout.index("{\n"):])
