"""Fault injection with real processes: SIGKILL during commits, and concurrent writers."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from robo_post.store import ArraySpec, Store, StoreIntegrityError, StoreSchema
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


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_four_concurrent_writers_200_episodes(tmp_path, request, backend):
    if backend == "s3":  # the writer processes inherit the server's credentials from the environment
        root = f"s3://{request.getfixturevalue('s3_server').bucket()}/store"
    else:
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


def _small_store(tmp_path, close: bool) -> tuple[str, str]:
    """Three committed episodes in shard "x" (partial last chunks), its writer closed (chunks
    sealed) or gone without closing (a killed writer: the partial chunks still in their regions)."""
    root = str(tmp_path / "store")
    Store.create(root, SCHEMA)
    proc = subprocess.run([sys.executable, "-c", WRITER, root, "x", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if close:
        Store.open(root).writer("x").close()
    return root, os.path.join(root, "shards", "x", "data")


def test_a_writer_refuses_a_chunk_file_cut_short_after_commit(tmp_path):
    """zarr reads a cut-off chunk file's missing bytes as zeros: a writer used to append to it
    silently (rc 0 from `collect`) and seal those zeros into the chunk."""
    for close in (False, True):
        root, data = _small_store(tmp_path / str(close), close)
        path = os.path.join(data, "action", "c.0.0")
        size = os.path.getsize(path)
        for cut in (size - 3, 100):  # inside the last chunk's bytes; inside the shard index
            with open(path, "r+b") as f:
                f.truncate(cut)
            with pytest.raises(StoreIntegrityError, match=rf"{re.escape(path)}: {cut} bytes, .*cut short after commit"):
                Store.open(root).writer("x")
            assert os.path.getsize(path) == cut  # nothing appended
        Store.open(root).writer("y").close()  # the lock of the refused shard only is released


def test_a_lost_group_metadata_file_is_written_again_by_the_next_writer(tmp_path):
    """A group's zarr.json holds no data and readers do without it, so `validate` found nothing,
    but every writer of the shard failed (FileNotFoundError) syncing it."""
    root, data = _small_store(tmp_path, close=True)
    os.remove(os.path.join(data, "obs", "zarr.json"))
    proc = subprocess.run([sys.executable, "-c", WRITER, root, "x", "5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(os.path.join(data, "obs", "zarr.json"))
    assert validate_store(root) == (5, [])
    snap = Store.open(root).snapshot()
    assert [snap.load(e)["obs"]["proprio"][0, 0] for e in snap] == [0, 1, 2, 3, 4]


def test_a_writer_names_the_array_whose_metadata_is_damaged(tmp_path):
    """A damaged zarr.json used to reach `collect` as a bare JSONDecodeError naming no file."""
    root, data = _small_store(tmp_path, close=True)
    with open(os.path.join(data, "action", "zarr.json"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(StoreIntegrityError, match=rf"shard 'x': cannot append to {re.escape(data)}/action: "
                                                  "JSONDecodeError"):
        Store.open(root).writer("x")
    with pytest.raises(StoreIntegrityError):  # the shard was released: a retry fails the same way
        Store.open(root).writer("x")
    checked, problems = validate_store(root)  # the array is named, not the first one read (obs/image)
    assert checked == 0 and len(problems) == 1
    assert problems[0].startswith(f"shard x: {data}/action unreadable: JSONDecodeError"), problems
