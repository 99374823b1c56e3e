"""Oversize episodes: refused with a typed error before their arrays are allocated, when written
(arrays that declare a billion steps) and when read (a record whose length was edited to a
billion steps), while every other episode of the store still reads back equal."""

import os
import tracemalloc

import numpy as np
import pytest
from test_store import SCHEMA, commit, make_episode, tree_hash

from robo_post.cli import main
from robo_post.store import EpisodeTooLargeError, EpisodeValidationError, Store
from robo_post.store import schema as schema_module
from robo_post.store.commit import inspect_commit, write_commit_file
from robo_post.store.integrity import validate_store
from robo_post.store.schema import episode_byte_limit, episode_nbytes
from robo_post.store.writer import decode_record, encode_record

BILLION = 10**9
# SCHEMA's bytes per step: proprio 5 float32 + an 8x8x3 image (observations), 2 float32 actions,
# the 7 float64 step columns.
OBS_BYTES, STEP_BYTES = 5 * 4 + 8 * 8 * 3, 2 * 4 + 7 * 8


@pytest.fixture
def filled(tmp_path):
    """A store with episodes a/0, a/1 and b/0, and their arrays as loaded right after writing."""
    store = Store.create(str(tmp_path / "store"), SCHEMA)
    rng = np.random.default_rng(0)
    for shard, lengths in (("a", (4, 6)), ("b", (5,))):
        with store.writer(shard) as w:
            for T in lengths:
                commit(w, make_episode(rng, T))
    snap = store.snapshot(record=False)
    return store, {e.key: snap.load(e) for e in snap}


def assert_reads_back(store, loaded, keys):
    snap = store.snapshot(record=False)
    for e in snap.episodes():
        if e.key in keys:
            got = snap.load(e)
            for k in SCHEMA.observations:
                np.testing.assert_array_equal(got["obs"][k], loaded[e.key]["obs"][k])
            np.testing.assert_array_equal(got["action"], loaded[e.key]["action"])
            np.testing.assert_array_equal(got["reward"], loaded[e.key]["reward"])


def test_limit_is_a_quarter_of_physical_memory():
    with open("/proc/meminfo") as f:
        total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    assert episode_byte_limit() == total_kib * 1024 // 4
    assert episode_nbytes(SCHEMA, 10) == 11 * OBS_BYTES + 10 * STEP_BYTES


def test_a_billion_declared_steps_are_refused_before_any_copy(filled):
    store, loaded = filled
    before = tree_hash(store.root)
    # Broadcast views: a billion steps in a few bytes. The step table alone needed 52 GiB: a raw
    # MemoryError from numpy before this check.
    obs = {"proprio": np.broadcast_to(np.zeros(5, np.float32), (BILLION + 1, 5)),
           "image": np.broadcast_to(np.zeros((8, 8, 3), np.uint8), (BILLION + 1, 8, 8, 3))}
    actions = np.broadcast_to(np.zeros(2, np.float32), (BILLION, 2))
    with store.writer("a") as w:
        tracemalloc.start()
        with pytest.raises(EpisodeTooLargeError) as err:
            w.write_episode(obs, actions)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        e = err.value
        assert isinstance(e, EpisodeValidationError) and e.field == "length"
        assert (e.episode, e.length, e.limit) == ("a/2", BILLION, episode_byte_limit())
        assert e.nbytes == (BILLION + 1) * OBS_BYTES + BILLION * STEP_BYTES  # 257 GiB
        assert "episode a/2 not written" in str(e) and "257.0 GiB" in str(e) and "limit of" in str(e)
        assert peak < 1 << 20
        assert tree_hash(store.root) == before  # nothing written
        commit(w, make_episode(np.random.default_rng(1), 3))  # the writer goes on: the next episode is a/2
    assert [e.key for e in store.snapshot(record=False).episodes(client="a")] == ["a/0", "a/1", "a/2"]
    assert_reads_back(store, loaded, {"a/0", "a/1", "b/0"})
    assert validate_store(store.root) == (4, [])


def test_the_check_comes_before_each_allocation(filled, monkeypatch):
    """Under a limit of 64 kB, episodes of 20,000 broadcast steps (5.5 MB) and of 300 added steps
    (83 kB) are refused having allocated none of their size (the step table would be 1.1 MB)."""
    store, _ = filled
    monkeypatch.setattr(schema_module, "episode_byte_limit", lambda: 64 * 1024)
    T = 20_000
    obs = {"proprio": np.broadcast_to(np.zeros(5, np.float32), (T + 1, 5)),
           "image": np.broadcast_to(np.zeros((8, 8, 3), np.uint8), (T + 1, 8, 8, 3))}
    rng = np.random.default_rng(2)
    steps = make_episode(rng, 300)
    with store.writer("b") as w:
        tracemalloc.start()
        with pytest.raises(EpisodeTooLargeError, match="episode b/1 not written: its 20000 steps"):
            w.write_episode(obs, np.broadcast_to(np.zeros(2, np.float32), (T, 2)))
        assert tracemalloc.get_traced_memory()[1] < 32 * 1024
        for t in range(300):
            w.add(steps["obs"][t], steps["actions"][t], 0.0)
        tracemalloc.reset_peak()
        held = tracemalloc.get_traced_memory()[0]  # the added steps
        with pytest.raises(EpisodeTooLargeError, match="episode b/1 not written: its 300 steps"):
            w.commit()  # before the steps are stacked
        assert tracemalloc.get_traced_memory()[1] - held < 32 * 1024
        tracemalloc.stop()
        assert w.pending_steps == 0 and w.n_episodes == 1


def test_a_record_edited_to_a_billion_steps(filled, capsys):
    """Record a/1 declares a billion steps, with a fresh record checksum and a commit record to
    match (a writer bug, or an edit that kept the checksums; one that broke them is caught by them)."""
    store, loaded = filled
    shard = os.path.join(store.root, "shards", "a")
    with open(os.path.join(shard, "episodes.jsonl"), "rb") as f:
        lines = f.read().split(b"\n")[:-1]
    record = decode_record(lines[1])
    del record["meta_crc32c"]
    lines[1] = encode_record({**record, "length": BILLION}).rstrip(b"\n")
    index = b"\n".join(lines) + b"\n"
    with open(os.path.join(shard, "episodes.jsonl"), "wb") as f:
        f.write(index)
    status = inspect_commit(shard)
    write_commit_file(shard, status.seq + 1, {"episodes": 2, "steps": 4 + BILLION, "meta_bytes": len(index)},
                      both_slots=True)

    snap = store.snapshot(record=False)
    edited = next(e for e in snap if e.key == "a/1")
    assert edited.length == BILLION
    for read in (lambda: snap.load(edited), lambda: snap.load_shard("a")):
        with pytest.raises(EpisodeTooLargeError) as err:
            read()
        assert (err.value.episode, err.value.length) == ("a/1", BILLION)
        assert "episode a/1 not read: its 1000000000 steps need" in str(err.value)
    assert_reads_back(store, loaded, {"a/0", "b/0"})  # the rest of the store is intact
    checked, problems = validate_store(store.root)
    assert checked == 2 and len(problems) == 1 and "episode a/1 not checked" in problems[0]
    assert main(["store", "view", store.root, "a/1", "--out", os.path.join(store.root, "..", "x.rrd")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "EpisodeTooLargeError" in err and "a/1 not read" in err
