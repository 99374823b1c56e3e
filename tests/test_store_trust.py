"""What the store promises about its data: accepted input reads back exactly (or is
refused), a lost or damaged commit record is detected and repairable, reads verify
checksums, reading needs no write access, and no damage to any file is read silently."""

import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import zarr

from robo_post.store import (
    EpisodeValidationError,
    ShardDamagedError,
    ShardLockedError,
    Store,
    StoreError,
    StoreIntegrityError,
    WindowSampler,
)
from robo_post.store.commit import CommitDamageWarning
from robo_post.store.registry import PolicyRegistry, RegistryNotWritableError
from robo_post.store import integrity
from robo_post.store.integrity import LOST_SUFFIX, Unrepairable, repair_store, validate_store
from robo_post.store.schema import ArraySpec, StoreLayoutError, StoreSchema
from robo_post.store.writer import lock_shard
from test_store import tree_hash
from test_store_append import SCHEMA, clear_chunk, episode, small_chunks, write  # noqa: F401 (fixture)


def _obs(T, proprio_dtype=np.float32):
    return {"proprio": np.zeros((T + 1, 3), proprio_dtype), "image": np.zeros((T + 1, 4, 4, 3), np.uint8)}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "robo_post.cli", *args], capture_output=True, text=True)


# --- 1. accepted input reads back exactly, or is refused naming field and step ------------------
def _big_obs(T):
    obs = _obs(T, np.float64)
    obs["proprio"][2, 1] = 1e39  # finite in float64, inf in float32
    return {"observations": obs}


REFUSED = {  # write_episode keywords for T=4 -> (field, step)
    "float32_overflow": (_big_obs, "obs/proprio", 2),
    "success_not_bool": (lambda T: {"success": "no"}, "success", None),
    "success_int": (lambda T: {"success": 1}, "success", None),
    "policy_versions_2_63": (lambda T: {"policy_versions": 2**63}, "policy_version", 0),
    "policy_versions_2_53": (lambda T: {"policy_versions": [0, 2**53, 0, 0]}, "policy_version", 1),
    "episode_policy_version_2_63": (lambda T: {"policy_version": 2**63}, "policy_version", None),
    "episode_policy_version_negative": (lambda T: {"policy_version": -1}, "policy_version", None),
    "start_time_nan": (lambda T: {"start_time": float("nan")}, "start_time", None),
    "end_time_inf": (lambda T: {"end_time": float("inf")}, "end_time", None),
    "start_time_string": (lambda T: {"start_time": "noon"}, "start_time", None),
    "return_overflows": (lambda T: {"rewards": np.full(T, 1e308)}, "reward", None),
    "attrs_tuple": (lambda T: {"attrs": {"pair": (1, 2)}}, "attrs", None),
    "attrs_int_key": (lambda T: {"attrs": {1: "x"}}, "attrs", None),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_input_that_would_not_read_back_exactly_is_refused(tmp_path, case):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    w = store.writer("a")
    w.write_episode(_obs(4), np.zeros((4, 2), np.float32))
    before = tree_hash(store.root)
    make, field, step = REFUSED[case]
    kwargs = {"observations": _obs(4), "actions": np.zeros((4, 2), np.float32), **make(4)}
    with pytest.raises(EpisodeValidationError) as err:
        w.write_episode(**kwargs)
    assert (err.value.field, err.value.step) == (field, step), str(err.value)
    assert tree_hash(store.root) == before
    assert w.write_episode(_obs(4), np.zeros((4, 2), np.float32)) == 1  # still usable


def test_extreme_accepted_values_read_back_exactly(tmp_path):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    obs = _obs(4, np.float64)
    obs["proprio"][1, 0] = float(np.finfo(np.float32).max)  # the largest float32, given as float64
    versions = [0, 2**53 - 1, 7, 0]
    with store.writer("a") as w:
        w.write_episode(obs, np.zeros((4, 2), np.float32), policy_versions=versions, success=np.bool_(True),
                        policy_version=2**53 - 1, start_time=1.5, rewards=np.full(4, 1e307), attrs={"k": [1, "x"]})
    (e,) = store.snapshot()
    got = store.snapshot().load(e)
    assert got["obs"]["proprio"][1, 0] == np.finfo(np.float32).max
    assert got["policy_version"].tolist() == versions
    assert (e.success, e.policy_version, e.start_time, e.ret, e.attrs) == (True, 2**53 - 1, 1.5, 4e307, {"k": [1, "x"]})


# --- 2. lost or damaged commit records: detected, refused, repairable ---------------------------
def _three_episodes(root):
    store = Store.create(root, SCHEMA)
    with store.writer("a") as w:
        for i, T in enumerate((5, 20, 9)):
            write(w, i, T)
    return store


def _keys_and_data(store):
    snap = store.snapshot()
    return [(e.key, e.attrs["i"], snap.load(e)["obs"]["proprio"].tolist()) for e in snap]


def test_a_deleted_commit_record_is_reported_refused_and_repaired(tmp_path, small_chunks):
    store = _three_episodes(str(tmp_path / "s"))
    expected = _keys_and_data(store)
    os.unlink(os.path.join(store.root, "shards", "a", "commit.bin"))
    before = tree_hash(store.root)
    with pytest.raises(ShardDamagedError, match="commit.bin is missing"):
        store.snapshot()
    with pytest.raises(ShardDamagedError, match="commit.bin is missing"):
        store.writer("a")  # refused before truncating the episode index
    assert tree_hash(store.root) == before
    checked, problems = validate_store(store.root)
    assert checked == 0 and len(problems) == 1 and "shard a: commit.bin is missing" in problems[0]
    r = _cli("store", "repair", store.root)
    assert r.returncode == 0 and "would rebuild commit.bin as 3 episodes (34 steps" in r.stdout, r.stdout + r.stderr
    assert tree_hash(store.root) == before  # a dry run changes nothing
    r = _cli("store", "repair", store.root, "--apply")
    assert r.returncode == 0 and "rebuilt commit.bin as 3 episodes" in r.stdout
    assert _keys_and_data(store) == expected and validate_store(store.root) == (3, [])
    assert repair_store(store.root) == []  # healthy now
    with store.writer("a") as w:
        assert write(w, 3, 4) == 3


def test_a_damaged_snapshot_record_is_set_aside_by_repair(tmp_path, small_chunks):
    """validate failed for good on it while repair said there was nothing to repair."""
    store = _three_episodes(str(tmp_path / "s"))
    snap = store.snapshot()
    record = os.path.join(store.root, "snapshots", f"{snap.id}.json")
    with open(record, "w") as f:
        f.write("{garbage")
    checked, problems = validate_store(store.root)
    assert checked == 3 and len(problems) == 1 and "damaged snapshot record" in problems[0]
    (line,) = repair_store(store.root)
    assert f"would set it aside as {snap.id}.json.damaged" in line and os.path.exists(record)
    (line,) = repair_store(store.root, apply=True)
    assert not os.path.exists(record) and open(record + ".damaged").read() == "{garbage"
    assert validate_store(store.root)[1] == [] and repair_store(store.root) == []


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_writer_refuses_a_damaged_episode_index_without_changing_it(tmp_path, small_chunks, damage):
    """A short index was padded with NUL bytes to its committed size before anything checked it."""
    store = _three_episodes(str(tmp_path / "s"))
    index = os.path.join(store.root, "shards", "a", "episodes.jsonl")
    data = open(index, "rb").read()
    first = data.index(b"\n") + 1
    damaged = data[:first + 10] if damage == "truncated" else data[:first] + b"x" * 10 + data[first + 10:]
    with open(index, "wb") as f:
        f.write(damaged)
    before = tree_hash(store.root)
    with pytest.raises(StoreIntegrityError, match=r"shard 'a': .*episodes.jsonl: .*nothing was changed"):
        store.writer("a")
    assert tree_hash(store.root) == before and open(index, "rb").read() == damaged
    (line,) = repair_store(store.root, apply=True)
    assert "rebuilt commit.bin as 1 episodes" in line, line
    with store.writer("a") as w:  # the shard takes new episodes after the repair
        assert write(w, 1, 4) == 1
    # a garbled record leaves the next one whole: its episode is kept, in shard a-salvaged
    assert validate_store(store.root) == (2 if damage == "truncated" else 3, [])


def test_a_damaged_newest_commit_slot_is_reported_and_repaired(tmp_path, small_chunks):
    store = _three_episodes(str(tmp_path / "s"))
    expected = _keys_and_data(store)
    shard = os.path.join(store.root, "shards", "a")
    # Seq 3 (the third commit) went to slot 1.
    with open(os.path.join(shard, "commit.bin"), "r+b") as f:
        f.seek(512 + 20)
        f.write(b"\xff")
    with pytest.warns(CommitDamageWarning, match="shard a: commit.bin slot 1 is damaged"):
        assert len(store.snapshot()) == 2  # readers fall back to the previous record, and say so
    r = _cli("store", "info", store.root)  # in robo-post's own words: one line, not Python's warning format
    assert r.returncode == 0 and r.stderr.startswith("warning: shard a: commit.bin slot 1 is damaged"), r.stderr
    assert "CommitDamageWarning" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    checked, problems = validate_store(store.root)
    assert len(problems) == 1 and "commit.bin slot 1 is damaged" in problems[0]
    assert "holds 1 complete records past it" in problems[0]
    with pytest.raises(ShardDamagedError, match="slot 1 is damaged"):
        store.writer("a")
    (line,) = repair_store(store.root, apply=True)
    assert "rebuilt commit.bin as 3 episodes" in line and "the record in use says 2" in line
    assert _keys_and_data(store) == expected and validate_store(store.root) == (3, [])


def test_repair_leaves_out_episodes_whose_data_does_not_verify(tmp_path, small_chunks):
    store = _three_episodes(str(tmp_path / "s"))
    os.unlink(os.path.join(store.root, "shards", "a", "commit.bin"))
    action = zarr.open_array(os.path.join(store.root, "shards", "a", "data", "action"), mode="r+")
    action[30, 0] = 0.5  # episode 2 (steps 25..33)
    (line,) = repair_store(store.root, apply=True)
    assert "as 2 episodes (25 steps" in line and "stops verifying at episode 2 (data of episode 2 fails its checksum)" in line
    assert [e.key for e in store.snapshot()] == ["a/0", "a/1"] and validate_store(store.root) == (2, [])


def _episodes_by_origin(store):
    """{(original shard/index, i): (length, proprio, action, step table)} of every episode."""
    snap = store.snapshot()
    out = {}
    for e in snap:
        d = snap.load(e)
        origin = e.attrs.get("salvaged_from", e.key)
        out[origin, e.attrs["i"]] = (e.length, e.success, e.role, d["obs"]["proprio"].tolist(),
                                     d["action"].tolist(), d["reward"].tolist())
    return out


def _five_episodes(root):
    store = Store.create(root, SCHEMA)
    with store.writer("a") as w:
        for i, T in enumerate((5, 20, 9, 16, 7)):
            write(w, i, T)
    return store


def test_repair_keeps_the_intact_episodes_past_a_damaged_record(tmp_path, small_chunks):
    """The commit record is a prefix: the episodes past a damaged record were dropped with it."""
    store = _five_episodes(str(tmp_path / "s"))
    expected = _episodes_by_origin(store)
    store.snapshot()  # a snapshot saw all five
    index = os.path.join(store.root, "shards", "a", "episodes.jsonl")
    with open(index, "rb") as f:
        lines = f.read().split(b"\n")
    lines[1] = lines[1].replace(b'"i": 1', b'"i": 7')  # episode 1's record fails its checksum
    with open(index, "wb") as f:
        f.write(b"\n".join(lines))
    before = tree_hash(store.root)
    (line,) = repair_store(store.root)
    assert "stops verifying at episode 1" in line and "would copy the 3 later episodes" in line, line
    assert "(2..4) into shard a-salvaged" in line and "1 episode record from episode 1 on is left out" in line, line
    assert tree_hash(store.root) == before  # a dry run changes nothing
    held = lock_shard(os.path.join(store.root, "shards", "a"), "a")  # as a client that has it open
    with pytest.raises(ShardLockedError, match="'a' is already open for writing"):
        repair_store(store.root, apply=True)
    os.close(held)
    assert tree_hash(store.root) == before
    (line,) = repair_store(store.root, apply=True)
    assert "rebuilt commit.bin as 1 episodes" in line and "copied the 3 later episodes" in line, line
    after = _episodes_by_origin(store)
    # every episode but the damaged one, bit for bit, the copies naming their origin
    assert after == {k: v for k, v in expected.items() if k != ("a/1", 1)}
    assert [e.key for e in store.snapshot()] == ["a/0", "a-salvaged/0", "a-salvaged/1", "a-salvaged/2"]
    assert validate_store(store.root) == (4, []) and repair_store(store.root) == []
    with store.writer("a") as w:  # the shard takes new episodes after the repair
        assert write(w, 5, 4) == 1


def test_a_repair_stopped_after_copying_copies_nothing_twice(tmp_path, small_chunks):
    store = _five_episodes(str(tmp_path / "s"))
    expected = _episodes_by_origin(store)
    index = os.path.join(store.root, "shards", "a", "episodes.jsonl")
    data = open(index, "rb").read()
    first = data.index(b"\n") + 1
    with open(index, "wb") as f:
        f.write(data[:first] + b"x" * 10 + data[first + 10:])  # episode 1's record garbled
    scan = integrity.scan_index(store, "a")
    # what a repair killed between its copy and its new commit record leaves behind
    assert integrity._salvage(store, "a", scan.later[:2], "a-salvaged") == 2
    (line,) = repair_store(store.root, apply=True)
    assert "copied the 3 later episodes" in line and "(2 of them were there from an earlier repair)" in line, line
    assert _episodes_by_origin(store) == {k: v for k, v in expected.items() if k != ("a/1", 1)}
    assert len(store.snapshot()) == 4 and validate_store(store.root) == (4, [])


def test_repair_cuts_out_damaged_data_under_a_healthy_commit_record(tmp_path, small_chunks):
    """validate reported the episode, every read of it failed, and repair had nothing to do."""
    store = _five_episodes(str(tmp_path / "s"))
    expected = _episodes_by_origin(store)
    action = zarr.open_array(os.path.join(store.root, "shards", "a", "data", "action"), mode="r+")
    action[30, 0] = 0.5  # episode 2 (steps 25..33)
    checked, problems = validate_store(store.root)
    assert checked == 4 and len(problems) == 1 and "a/2: checksum mismatch" in problems[0], problems
    with pytest.raises(StoreIntegrityError, match="a/2 fails its checksum"):
        snap = store.snapshot()
        [snap.load(e) for e in snap]
    (line,) = repair_store(store.root, apply=True)
    assert "shard a: the data of a committed episode does not verify" in line, line
    assert "as 2 episodes (25 steps" in line and "data of episode 2 fails its checksum" in line, line
    assert "copied the 2 later episodes that verify on their own (3..4)" in line, line
    assert _episodes_by_origin(store) == {k: v for k, v in expected.items() if k != ("a/2", 2)}
    assert validate_store(store.root) == (4, []) and repair_store(store.root) == []


@pytest.mark.parametrize("damage,names", [
    ("obs/proprio/zarr.json", "data/obs/proprio unreadable: its zarr.json is missing"),  # zarr raised a bare KeyError
    ("data", "shards/a/data"),  # zarr raised FileNotFoundError
    ("zarr.json", "shards/a/data"),  # zarr raised JSONDecodeError naming no file
    ("no zarr.json", "shards/a/data unreadable: its zarr.json is missing"),  # repair said "nothing to repair"
])
def test_damaged_array_metadata_is_a_store_error_naming_the_path(tmp_path, small_chunks, damage, names):
    store = _three_episodes(str(tmp_path / "s"))
    data = os.path.join(store.root, "shards", "a", "data")
    path = os.path.join(data, damage.removeprefix("no ")) if damage != "data" else data
    if damage == "zarr.json":
        with open(path, "w") as f:
            f.write("{")
    elif damage == "data":
        shutil.rmtree(path)
    else:
        os.unlink(path)
    snap = store.snapshot()
    for read in (lambda: snap.load_shard("a"), lambda: snap.load(snap.episodes()[1])):
        with pytest.raises(StoreIntegrityError, match=names):
            read()
    checked, problems = validate_store(store.root)
    assert checked == 0 and names in problems[0], problems
    if damage == "data":  # the rows went with the folder: repair leaves every episode out, and says why
        (line,) = repair_store(store.root, apply=True)  # it said "nothing to repair" while validate kept failing
        assert f"{data} is missing: the rows of obs/proprio, obs/image, action, step are gone" in line, line
        assert "as 0 episodes" in line and "3 episode records from episode 0 on are left out" in line, line
        assert validate_store(store.root) == (0, []) and repair_store(store.root) == []
        return
    # The rows are intact behind the damaged metadata, which holds only what the schema gives:
    # repair writes it again (it said "nothing to repair", and validate and train kept failing).
    lost = "data/obs/proprio" if damage.startswith("obs") else "data"
    assert repair_store(store.root) == [f"shard a: the zarr.json of {lost} is missing or damaged; would rewrite it "
                                        "from the store's schema"]
    assert repair_store(store.root, apply=True) == [f"shard a: the zarr.json of {lost} is missing or damaged; rewrote "
                                                    "it from the store's schema"]
    assert validate_store(store.root) == (3, []) and repair_store(store.root) == []
    assert [e.attrs["i"] for e in store.snapshot()] == [0, 1, 2]


def test_an_undecodable_chunk_is_a_store_error_naming_the_array(tmp_path, small_chunks):
    store = _three_episodes(str(tmp_path / "s"))  # closed: every chunk sealed and compressed
    directory = os.path.join(store.root, "shards", "a", "data", "action")
    (name,) = [f for f in os.listdir(directory) if f.startswith("c.")]
    with open(os.path.join(directory, name), "r+b") as f:
        offset = int(np.frombuffer(f.read(8), "<u8")[0])  # chunk 0's entry in the shard index
        f.seek(offset + 4)
        f.write(b"\xff" * 12)  # its Blosc header's sizes: the chunk no longer decodes
    with pytest.raises(StoreIntegrityError, match="data of action unreadable .*data/action"):
        store.snapshot().load_shard("a")
    _, problems = validate_store(store.root)
    assert "arrays unreadable: action: " in problems[0], problems
    # the chunk held episodes 0 and 1 (rows 0..24): repair keeps episode 2, which lies past it
    r = _cli("store", "repair", store.root, "--apply")
    assert r.returncode == 0 and "data of episode 0 unreadable" in r.stdout, r.stdout + r.stderr
    assert "copied the later episode that verifies on its own (2) into shard a-salvaged" in r.stdout, r.stdout
    assert "2 episode records from episode 0 on are left out" in r.stdout, r.stdout
    assert [(e.key, e.attrs) for e in store.snapshot()] == [("a-salvaged/0", {"i": 2, "salvaged_from": "a/2"})]
    assert validate_store(store.root) == (1, [])


@pytest.mark.parametrize("damage", ["shard", "commit_and_index"])
def test_validate_reports_a_shard_lost_whole_that_a_snapshot_saw(tmp_path, small_chunks, damage):
    store = _three_episodes(str(tmp_path / "s"))
    snapshot_id = store.snapshot().id  # e.g. `store info` or a training run
    shard = os.path.join(store.root, "shards", "a")
    if damage == "shard":
        shutil.rmtree(shard)
    else:  # without them the shard looks new and empty
        os.unlink(os.path.join(shard, "commit.bin"))
        os.unlink(os.path.join(shard, "episodes.jsonl"))
    checked, problems = validate_store(store.root)
    assert checked == 0 and len(problems) == 1, problems
    assert f"snapshot {snapshot_id} saw 3" in problems[0] and problems[0].startswith("shard a: "), problems
    # repair said "nothing to repair", and validate kept failing: it names the loss and sets the record aside
    record = os.path.join(store.root, "snapshots", f"{snapshot_id}.json")
    assert repair_store(store.root) == [f"{problems[0]}: they are gone from the store (a backup of the shard can "
                                        "bring them back); would set aside the snapshot record that saw them as "
                                        f"<id>.json{LOST_SUFFIX}, so that the store validates again"]
    assert os.path.exists(record)  # a dry run changes nothing
    (line,) = repair_store(store.root, apply=True)
    assert line.startswith(f"{problems[0]}: they are gone") and "; set aside the snapshot record" in line, line
    assert not os.path.exists(record) and os.path.exists(record + LOST_SUFFIX)
    assert validate_store(store.root) == (0, []) and repair_store(store.root) == []


@pytest.mark.parametrize("folder", ["snapshots", "policies", "shards/a", "shards"])
def test_a_file_where_the_store_keeps_a_folder_is_named_in_one_line(tmp_path, small_chunks, capsys, folder):
    """validate passed or died with a raw FileExistsError, repair said "nothing to repair", info and
    train died with a raw errno, and a file in place of a shard hid the shard from readers."""
    from robo_post.cli import main

    store = _three_episodes(str(tmp_path / "s"))
    snapshot_id = store.snapshot().id
    path = os.path.join(store.root, folder)
    shutil.rmtree(path)
    with open(path, "w") as f:
        f.write("mine")
    message = f"{path} is a file where the store keeps "
    with pytest.raises(StoreLayoutError, match=message):
        store.snapshot() if folder != "policies" else PolicyRegistry(store.root)
    if folder.startswith("shards"):
        with pytest.raises(StoreLayoutError, match=message):
            store.writer("a")  # was NotADirectoryError naming commit.bin
    assert main(["store", "info", store.root]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"robo-post store: StoreLayoutError: {message}") and err.count("\n") == 1, err
    checked, problems = validate_store(store.root)
    assert problems[0].startswith(message) and "move it " in problems[0], problems
    assert checked == (0 if folder.startswith("shards") else 3)
    before = tree_hash(store.root)
    lines = repair_store(store.root)
    assert tree_hash(store.root) == before  # a dry run changes nothing
    if folder == "snapshots":  # its records hold no episode: repair makes a new folder, keeping the file beside
        assert lines == [f"{path} is not the folder where the store keeps its snapshot records; would set it aside as "
                         "snapshots.damaged and make a new, empty folder (snapshots recorded before cannot be "
                         "reopened by id; no episode is lost)"]
        assert main(["store", "repair", store.root, "--apply"]) == 0
        assert open(path + ".damaged").read() == "mine" and validate_store(store.root) == (3, [])
        assert [e.attrs["i"] for e in store.snapshot()] == [0, 1, 2]
        return
    # What the folder held is not in the store: repair cannot make it up, and says so, never "nothing to repair".
    assert isinstance(lines[0], Unrepairable) and lines[0] == f"cannot repair: {problems[0]}", lines
    capsys.readouterr()
    assert main(["store", "repair", store.root, "--apply"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"cannot repair: {message}") and "nothing to repair" not in out, out
    if folder.startswith("shards"):  # the snapshot record that saw shard a is set aside: the loss is named
        assert f"shard a: its directory is gone, yet snapshot {snapshot_id} saw 3 committed episodes" in out, out
    assert open(path).read() == "mine" and validate_store(store.root)[1] == [problems[0]]


@pytest.mark.parametrize("damage", ["file", "missing"])
def test_an_array_folder_lost_whole_has_its_episodes_left_out_by_repair(tmp_path, small_chunks, capsys, damage):
    """validate blamed a missing zarr.json that repair would write again, and repair said every committed
    episode verifies: nothing to repair, for good."""
    from robo_post.cli import main

    store = _three_episodes(str(tmp_path / "s"))
    path = os.path.join(store.root, "shards", "a", "data", "action")
    shutil.rmtree(path)
    if damage == "file":
        with open(path, "w") as f:
            f.write("junk\n")
    what = "is a file, not a folder" if damage == "file" else "is missing"
    checked, problems = validate_store(store.root)
    assert checked == 0 and problems == [f"shard a: {path} {what}: the rows of action are gone, so none of its "
                                         "episodes reads whole (`robo-post store repair --apply` leaves them out)"]
    assert main(["store", "info", store.root, "--json"]) == 1  # info reads records only: it passed for whole
    assert f"warning: shard a: {path} {what}: the rows of action are gone" in capsys.readouterr().err
    assert main(["store", "repair", store.root, "--apply"]) == 0
    out = capsys.readouterr().out
    assert "nothing to repair" not in out and "rebuilt commit.bin as 0 episodes" in out, out
    assert f"the index stops verifying at episode 0 ({path} {what}: the rows of action are gone)" in out, out
    assert "3 episode records from episode 0 on are left out, for good once the shard's next writer" in out, out
    if damage == "file":  # kept, beside: the shard's next writer makes the array again
        assert f"set {path} aside as action.damaged" in out and open(path + ".damaged").read() == "junk\n"
    assert validate_store(store.root) == (0, []) and repair_store(store.root) == []
    with store.writer("a") as w:
        assert write(w, 3, 4) == 0
    assert validate_store(store.root) == (1, []) and [e.attrs["i"] for e in store.snapshot()] == [3]


@pytest.mark.parametrize("edit,names", [
    (lambda meta: [meta], "a schema must be a JSON object, not a list"),  # was: pop expected at most 1 argument
    (lambda meta: {k: v for k, v in meta.items() if k != "observations"}, "missing key 'observations'"),
    (lambda meta: {**meta, "attrs": [1]}, "'attrs' must be an object, not a list"),
    (lambda meta: {**meta, "action": [1]}, "'action' must be an object, not a list"),
    (lambda meta: {**meta, "observations": {"proprio": {"dtype": "float32"}}},
     "missing key 'observations.proprio.shape'"),
    (lambda meta: {**meta, "observations": {"proprio": {"dtype": "float32", "shape": ["3"]}}},
     r"'observations.proprio.shape' must be a list of sizes \(integers >= 0\), not \['3'\]"),
], ids=["list", "no_observations", "attrs_list", "action_list", "no_shape", "shape_of_strings"])
def test_a_store_json_of_the_wrong_shape_names_the_key(tmp_path, edit, names):
    """The message held Python's own words: `not a store schema: 'observations'`."""
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    path = os.path.join(store.root, "store.json")
    with open(path) as f:
        meta = json.load(f)
    del meta["crc32c"]
    with open(path, "w") as f:
        json.dump(edit(meta), f)
    with pytest.raises(StoreIntegrityError, match=f"{path}: damaged or not a store schema: {names} \\(it holds"):
        Store.open(store.root)


def test_an_edited_episode_record_is_named_not_miscounted(tmp_path, small_chunks):
    """An edited length read "1637 bytes in 2 complete records, commit says 1637 bytes in 3" of a file
    holding 3 complete records."""
    store = _three_episodes(str(tmp_path / "s"))
    index = os.path.join(store.root, "shards", "a", "episodes.jsonl")
    data = open(index, "rb").read()
    with open(index, "wb") as f:
        f.write(data.replace(b'"length": 5,', b'"length": 50,', 1))  # one byte longer
    with pytest.raises(StoreIntegrityError, match=r"record of episode a/0 is damaged: .*fails its checksum"):
        store.snapshot()
    with open(index, "wb") as f:
        f.write(data[:-30])
    with pytest.raises(StoreIntegrityError, match=f"{index}: holds {len(data) - 30} bytes, commit says {len(data)}: "
                                                  "it was cut short"):
        store.snapshot()


# --- 3. reads verify checksums by default ---------------------------------------------------------
def test_reads_verify_each_episode_unless_told_not_to(tmp_path, small_chunks):
    store = _three_episodes(str(tmp_path / "s"))
    action = zarr.open_array(os.path.join(store.root, "shards", "a", "data", "action"), mode="r+")
    action[10, 1] = 0.25  # episode 1
    snap = store.snapshot()
    snap.load(snap.episodes()[0])  # the others still read
    with pytest.raises(StoreIntegrityError, match="episode a/1 fails its checksum"):
        snap.load(snap.episodes()[1])
    with pytest.raises(StoreIntegrityError, match="episode a/1 fails its checksum"):
        WindowSampler.from_snapshot(snap, horizon=2)
    for trusted in (Store.open(store.root, verify=False).snapshot(), store.snapshot(verify=False)):
        assert trusted.load(trusted.episodes()[1])["action"][5, 1] == np.float32(0.25)
        assert len(WindowSampler.from_snapshot(trusted, horizon=2)) == 34


# --- 4. reading needs no write access ---------------------------------------------------------------
# Tests run as root, for whom chmod does not stop writes. An audit hook (sys.addaudithook:
# every open for writing, rename, unlink, mkdir, ... in this process passes through it)
# refuses any write under the roots listed here, as a read-only file system would.
_READ_ONLY_ROOTS: list[str] = []
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITE_EVENTS = {"os.rename", "os.remove", "os.mkdir", "os.rmdir", "os.truncate", "os.link", "os.symlink", "os.chmod"}


def _refuse_writes(event, args):
    if not _READ_ONLY_ROOTS or not (event == "open" or event in _WRITE_EVENTS):
        return
    if event == "open" and not (isinstance(args[2], int) and args[2] & _WRITE_FLAGS):
        return
    path = args[0]
    if isinstance(path, (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(path))
        if any(path == root or path.startswith(root + os.sep) for root in _READ_ONLY_ROOTS):
            raise PermissionError(errno.EROFS, "read-only store (simulated)", path)


sys.addaudithook(_refuse_writes)


def test_a_read_only_store_opens_snapshots_loads_and_samples(tmp_path, small_chunks):
    store = _three_episodes(str(tmp_path / "s"))
    old = store.snapshot()
    expected = _keys_and_data(store)
    with store.writer("a") as w:
        write(w, 3, 6)  # so a new snapshot would need a new record
    before = tree_hash(store.root)
    subprocess.run(["chmod", "-R", "a-w", store.root], check=True)  # real read-only for non-root runs
    _READ_ONLY_ROOTS.append(store.root)
    try:
        with pytest.raises(PermissionError):  # the simulation works
            open(os.path.join(store.root, "x"), "w")
        ro = Store.open(store.root)
        snap = ro.snapshot()
        assert len(snap) == 4 and not snap.recorded
        assert [snap.load(e)["obs"]["proprio"].tolist() for e in snap][:3] == [d for _, _, d in expected]
        assert len(WindowSampler.from_snapshot(snap, horizon=2)) == 40
        again = ro.snapshot(old.id)  # recorded while writable
        assert [(e.key, e.attrs["i"], again.load(e)["obs"]["proprio"].tolist()) for e in again] == expected
        assert validate_store(store.root) == (4, [])
    finally:
        _READ_ONLY_ROOTS.remove(store.root)
        subprocess.run(["chmod", "-R", "u+w", store.root], check=True)
    assert tree_hash(store.root) == before
    assert store.snapshot().recorded  # writable again: recorded


def test_training_on_a_read_only_store_fails_before_it_trains(tmp_path, small_chunks, capsys):
    from robo_post.cli import main

    store = _three_episodes(str(tmp_path / "s"))
    PolicyRegistry(store.root)  # its directory exists; nothing can be published into it below
    _READ_ONLY_ROOTS.append(store.root)
    try:
        with pytest.raises(RegistryNotWritableError, match="cannot publish policies to .*/s/policies"):
            PolicyRegistry(store.root).check_writable()
        run_dir = tmp_path / "run"
        assert main(["train", f"store={store.root}", "algo=bc_flow", "updates=20", "data.success=null",
                     f"run_dir={run_dir}"]) == 1
    finally:
        _READ_ONLY_ROOTS.remove(store.root)
    assert "RegistryNotWritableError: cannot publish policies" in capsys.readouterr().err
    assert not run_dir.exists()  # refused before the run started, not after training


# --- 5. messages ----------------------------------------------------------------------------------
def test_lost_data_of_a_synced_writer_is_not_blamed_on_fsync_false(tmp_path, small_chunks):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    with store.writer("a", fsync=True) as w:
        for i in range(5):
            write(w, i, 20)
    for chunk in (4, 5, 6):
        clear_chunk(os.path.join(store.root, "shards", "a", "data", "obs", "image"), chunk)
    _, problems = validate_store(store.root)
    assert problems == ["a/3: checksum mismatch; so do all the shard's last 2 episodes (3..4), "
                        "written with fsync=True: the data was damaged or truncated after commit; "
                        "`robo-post store repair --apply` drops them"]


def test_a_store_is_not_created_among_other_files(tmp_path):
    folder = tmp_path / "documents"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"documents is a folder of other files \(notes.txt\), not a robo-post store"):
        Store.create(str(folder), SCHEMA, exist_ok=True)
    assert sorted(os.listdir(folder)) == ["notes.txt"]
    (tmp_path / "new" / "fleet").mkdir(parents=True)  # a launcher's logs come before the store
    Store.create(str(tmp_path / "new"), SCHEMA)
    with pytest.raises(StoreError, match=r"notes.txt is a file, not a robo-post store"):
        Store.create(str(folder / "notes.txt"), SCHEMA, exist_ok=True)


def test_a_broken_store_json_is_named(tmp_path):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    path = os.path.join(store.root, "store.json")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(StoreIntegrityError, match=f"{path}: damaged"):
        Store.open(store.root)
    r = _cli("store", "validate", store.root)
    assert r.returncode == 1 and path in r.stderr and "the store.json of a store collected from the same env" in r.stderr
    # the hint holds: a store of the same schema gives the same file, and the store reads again
    shutil.copy(os.path.join(Store.create(str(tmp_path / "t"), SCHEMA).root, "store.json"), path)
    assert Store.open(store.root).schema == SCHEMA


# --- every file class flipped, truncated, deleted: no silent wrong read -----------------------------
def _read_everything(root, snapshot_id):
    """What a reader gets from the store at ``root``: schema, episodes and their data, of a
    new snapshot and of ``snapshot_id``; a sampler is built too."""
    store = Store.open(root)
    out = [store.schema.to_json()]
    for snap in (store.snapshot(record=False), store.snapshot(snapshot_id)):
        for e in snap:
            data = snap.load(e)
            out.append((e, {k: v for k, v in data.items() if k not in ("obs", "extras", "info")}, data["obs"]))
        WindowSampler.from_snapshot(snap, horizon=2)
    return out


def _same(a, b):
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return a == b


def test_no_damage_to_any_file_is_read_silently(tmp_path, small_chunks):
    root = str(tmp_path / "s")
    store = _three_episodes(root)  # shard a: closed, sealed chunks
    w = store.writer("b")  # shard b: left open, its partial chunks in regions
    for i, T in enumerate((18, 3)):
        write(w, 10 + i, T)
    snapshot_id = store.snapshot().id
    expected = _read_everything(root, snapshot_id)
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    classes = {os.path.basename(f) if not f.startswith("snapshots") else "snapshot" for f in files}
    assert {"store.json", "commit.bin", "episodes.jsonl", "zarr.json", "c.0.0", "c.0.0.0.0", "snapshot"} <= classes
    outcomes = {"refused": 0, "unchanged": 0, "reported": 0}
    silent = []
    for n, name in enumerate(files):
        size = os.path.getsize(os.path.join(root, name))
        positions = {1, size // 3, size // 2, size - 2} | ({20, 512 + 20} if name.endswith("commit.bin") else set())
        mutations = [("flip", p) for p in sorted(positions) if 0 <= p < size] + [("truncate", size // 2), ("delete", 0)]
        for kind, at in mutations:
            copy = str(tmp_path / f"c{n}-{kind}-{at}")
            shutil.copytree(root, copy)
            path = os.path.join(copy, name)
            if kind == "delete":
                os.unlink(path)
            else:
                with open(path, "r+b") as f:
                    if kind == "truncate":
                        f.truncate(at)
                    else:
                        f.seek(at)
                        byte = f.read(1)[0]
                        f.seek(at)
                        f.write(bytes([byte ^ 0x01]))
            try:
                got = _read_everything(copy, snapshot_id)
            except Exception:  # refused: a reader never gets wrong data
                outcomes["refused"] += 1
            else:
                if _same(got, expected):
                    outcomes["unchanged"] += 1
                elif validate_store(copy)[1]:
                    outcomes["reported"] += 1
                else:
                    silent.append((name, kind, at))
            shutil.rmtree(copy)
    w.close()
    assert silent == [], silent
    assert outcomes["refused"] > 50 and outcomes["reported"] >= 1, outcomes


def test_a_store_that_lost_its_schema_is_not_made_anew_over_its_shards(tmp_path):
    """With store.json deleted, a collect of another env wrote its own schema over 26 recorded
    episodes, and `store repair` then planned to drop them all as damaged."""
    root = str(tmp_path / "store")
    store = Store.create(root, SCHEMA)
    with store.writer("c0") as w:
        write(w, 0, 3), write(w, 1, 4)
    os.remove(os.path.join(root, "store.json"))
    other = type(SCHEMA).from_json({**SCHEMA.to_json(), "attrs": {"env": "another"}})
    for attempt in (lambda: Store.create(root, other, exist_ok=True), lambda: Store.open(root)):
        # (a collect of another env takes the first; every other command the second)
        with pytest.raises(StoreIntegrityError, match=r"store.json is missing, but the store still holds 1 shards "
                                                      r"of recorded episodes: put back a store.json"):
            attempt()
    assert not os.path.exists(os.path.join(root, "store.json"))
    shutil.copy(os.path.join(Store.create(str(tmp_path / "twin"), SCHEMA).root, "store.json"), root)
    assert len(Store.open(root).snapshot()) == 2  # nothing was lost


def test_a_shard_folder_deleted_whole_is_warned_about_by_info_train_and_collect(tmp_path, capsys):
    """`store info` exited 0 and `train` published a version trained on half the data, without a word."""
    from robo_post.store.integrity import lost_since_snapshots, warn_lost_shards

    store = Store.create(str(tmp_path / "store"), SCHEMA)
    for shard, n in (("c0", 2), ("c1", 3)):
        with store.writer(shard) as w:
            for i in range(n):
                write(w, i, 3)
    snap = store.snapshot()  # recorded: it saw 3 episodes in c1
    assert lost_since_snapshots(store) == []
    shutil.rmtree(os.path.join(store.root, "shards", "c1"))
    problem = f"shard c1: its directory is gone, yet snapshot {snap.id} saw 3 committed episodes in it"
    assert lost_since_snapshots(store) == [problem]
    warn_lost_shards(store.root, "training on the rest")
    assert capsys.readouterr().err == f"warning: {problem}: training on the rest (`robo-post store validate {store.root}`)\n"
    r = _cli("store", "info", store.root)
    assert r.returncode == 1 and f"warning: {problem}: the figures below leave them out" in r.stderr
    assert "episodes 2 " in r.stdout


def test_a_full_disk_is_named_and_leaves_a_readable_store(tmp_path):
    """On a full disk `collect` said its clients were still running ("client-0: running"), left a
    `.tmp-*` status file per restart, and `store info` failed with ENOSPC though it only reads."""
    cli = os.path.join(os.path.dirname(sys.executable), "robo-post")
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir(), out.mkdir()
    script = (f"mount -t tmpfs -o size=400k tmpfs {disk} || exit 77\n"
              f"{cli} collect env=CartPole-v1 policy=random episodes=2000 store={disk}/s show=false "
              f"2> {out}/collect.err; echo $? > {out}/collect.rc\n"
              f"ls -a {disk}/s/fleet > {out}/fleet.ls\n"
              f"{cli} store info {disk}/s > {out}/info.out 2>&1; echo $? > {out}/info.rc\n"
              f"{cli} store validate {disk}/s > {out}/validate.out 2>&1; echo $? > {out}/validate.rc\n")
    try:
        r = subprocess.run(["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        pytest.skip("needs unshare")
    if r.returncode != 0:
        pytest.skip(f"needs a private tmpfs (root): {r.stderr.strip()[-200:]}")
    err = (out / "collect.err").read_text()
    assert (out / "collect.rc").read_text().strip() == "1"
    assert f"client-0: OSError: no space left on the disk holding {disk}/s" in err and "running" not in err, err
    assert not [f for f in (out / "fleet.ls").read_text().split() if ".tmp-" in f]
    assert (out / "info.rc").read_text().strip() == "0", (out / "info.out").read_text()
    assert (out / "validate.rc").read_text().strip() == "0" and "0 problems" in (out / "validate.out").read_text()


def test_a_write_past_the_file_size_limit_names_its_path_and_the_rerun_finishes(tmp_path):
    """`train` under `ulimit -f` said only "OSError: [Errno 27] File too large": no file named."""
    cli = os.path.join(os.path.dirname(sys.executable), "robo-post")
    store, run = tmp_path / "s", tmp_path / "r"
    subprocess.run([cli, "collect", "env=CartPole-v1", "policy=random", "episodes=20", f"store={store}", "show=false"],
                   check=True, capture_output=True, timeout=300)
    train = f"{cli} train store={store} algo=categorical_bc run_dir={run} updates=200 data.success=null show=false"
    r = subprocess.run(["bash", "-c", f"ulimit -f 300; {train}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and f"OSError: [Errno 27] File too large: '{run}/checkpoint'" in r.stderr, r.stderr
    assert PolicyRegistry(str(store)).versions() == []
    assert subprocess.run(["bash", "-c", train], capture_output=True, timeout=300).returncode == 0
    assert PolicyRegistry(str(store)).versions() == [1]


def test_a_shard_repaired_past_a_cut_data_file_takes_new_episodes(tmp_path):
    """Repair cut the shard back to 0 episodes, validate found nothing wrong, yet every writer
    still refused the shard: its data file, cut to 10 bytes, was "shorter than its shard index"."""
    store = _three_episodes(str(tmp_path / "s"))
    action = os.path.join(store.root, "shards", "a", "data", "action")
    (name,) = [f for f in os.listdir(action) if f.startswith("c")]
    os.truncate(os.path.join(action, name), 10)
    (line,) = repair_store(store.root, apply=True)
    assert "rebuilt commit.bin as 0 episodes" in line, line
    with store.writer("a") as w:  # the file held no committed row: it is started anew
        for i, T in ((7, 6), (8, 11)):
            write(w, i, T)
    snap = Store.open(store.root).snapshot()
    assert [(e.attrs["i"], e.length) for e in snap] == [(7, 6), (8, 11)]
    assert snap.load(list(snap)[1])["action"].tolist() == episode(8, 11)[1].tolist()
    assert validate_store(store.root) == (2, [])


def test_store_paths_that_name_no_creatable_folder_are_typed_errors(tmp_path, monkeypatch):
    """An empty path (the working directory), a NUL byte, a path under a file and an unwritable
    place are StoreErrors naming the path; nothing is written."""
    schema = StoreSchema({"x": ArraySpec("float32", ())}, ArraySpec("float32", (1,), low=-1.0, high=1.0))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match="a store needs a path, got ''"):
        Store.create("", schema)
    with pytest.raises(StoreError, match="holds a NUL byte"):
        Store.create("a\0b", schema)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StoreError, match=f"cannot create a store at afile/sub: {tmp_path / 'afile'} is a file"):
        Store.create("afile/sub", schema)
    assert sorted(os.listdir(tmp_path)) == ["afile"]
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "makedirs", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(StoreError, match=f"cannot create a store at {locked / 's'}: Permission denied"):
        Store.create(str(locked / "s"), schema)
    assert os.listdir(locked) == []


def test_validate_names_a_deleted_snapshot_record_a_published_version_was_trained_on(tmp_path):
    """A deleted snapshot record passed `validate`; a later `snapshot(id)` failed with "unknown snapshot id"."""
    store = _three_episodes(str(tmp_path / "s"))
    snap = store.snapshot()
    PolicyRegistry(store.root).publish({}, {"kind": "random", "snapshot": snap.id})
    assert validate_store(store.root) == (3, [])
    record = os.path.join(store.root, "snapshots", f"{snap.id}.json")
    kept = open(record, "rb").read()
    os.remove(record)
    with pytest.raises(StoreError, match="unknown snapshot id"):
        store.snapshot(snap.id)
    checked, problems = validate_store(store.root)
    assert checked == 3 and problems == [
        f"policy v1 was trained on snapshot {snap.id}, whose record {record} is missing: that snapshot cannot be "
        "reopened by id (a resumed or repeated run on it fails); no episode is lost, and nothing can write the "
        "record again"]
    with open(record, "wb") as f:
        f.write(kept)
    assert validate_store(store.root) == (3, []) and store.snapshot(snap.id).id == snap.id
