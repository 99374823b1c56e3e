"""Fault injection with real processes: SIGKILL during commits, and concurrent writers."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np

from robo_post.store import ArraySpec, Store, StoreSchema
from robo_post.store.integrity import validate_store

SCHEMA = StoreSchema(
    observations={"proprio": ArraySpec("float32", (4,)), "image": ArraySpec("uint8", (64, 64, 3))},
    action=ArraySpec("float32", (2,), low=-1.0, high=1.0),
)

# Writes episodes forever (or N), announcing each commit before and after it runs.
WRITER = """
import sys, numpy as np
from robo_post.store import Store
root, client, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = Store.open(root)
w = store.writer(client)
rng = np.random.default_rng(0)
T = 40
obs = {"proprio": rng.normal(size=(T + 1, 4)).astype(np.float32),
       "image": rng.integers(0, 256, (T + 1, 64, 64, 3), dtype=np.uint8)}
act = rng.uniform(-1, 1, (T, 2)).astype(np.float32)
i = w.n_episodes
print("ready", i, flush=True)
while n < 0 or i < n:
    obs["proprio"][:, 0] = i  # every episode distinguishable
    print("begin", i, flush=True)
    w.write_episode(obs, act, truncated=np.arange(T) == T - 1, task_id="t", attrs={"client": client, "n": i})
    print("done", i, flush=True)
    i += 1
"""


def _spawn(root, client, n=-1):
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, root, client, str(n)], stdout=subprocess.PIPE, text=True, bufsize=1
    )


def test_sigkill_during_commits_never_exposes_partial_episodes(tmp_path):
    root = str(tmp_path / "store")
    store = Store.create(root, SCHEMA)
    rnd = random.Random(0)
    committed = visible = rounds = 0
    while committed < 25 or rounds < 6:  # several kills, at random points, over >= 25 commits
        proc = _spawn(root, "victim")
        assert proc.stdout.readline().split()[0] == "ready"
        time.sleep(rnd.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        out = proc.stdout.read().split("\n")
        proc.wait()
        begun = sum(line.startswith("begin") for line in out)
        done = sum(line.startswith("done") for line in out)
        now = store.read_commit("victim")["episodes"]
        # Every returned commit is visible; at most the one in flight may also have landed, whole.
        assert now - visible in ((done, done + 1) if begun > done else (done,)), (now, visible, begun, done)
        visible, committed, rounds = now, committed + done, rounds + 1
        checked, problems = validate_store(root)
        assert problems == [] and checked == visible
    snap = store.snapshot()
    assert len(snap) == visible >= 25
    assert [e.attrs["n"] for e in snap] == list(range(visible))  # no duplicates, no gaps
    for e in snap.episodes()[-3:]:
        assert (snap.load(e)["obs"]["proprio"][:, 0] == e.attrs["n"]).all()


def test_four_concurrent_writers_200_episodes(tmp_path):
    root = str(tmp_path / "store")
    Store.create(root, SCHEMA)
    procs = [_spawn(root, f"w{k}", 50) for k in range(4)]
    for p in procs:
        p.stdout.read()
        assert p.wait() == 0
    snap = Store.open(root).snapshot()
    keys = [(e.attrs["client"], e.attrs["n"]) for e in snap]
    assert len(keys) == 200 and len(set(keys)) == 200
    assert set(keys) == {(f"w{k}", i) for k in range(4) for i in range(50)}
    checked, problems = validate_store(root)
    assert problems == [] and checked == 200
    np.testing.assert_array_equal(snap.load(snap.episodes(client="w3")[49])["obs"]["proprio"][:, 0], 49)
