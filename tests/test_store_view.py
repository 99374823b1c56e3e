"""`robo-post store view`: an episode written as a Rerun recording, read back with rerun's own
reader and compared with the store; typed one-line errors on bad input."""

import os

import numpy as np
import pytest
from rerun.chunk import RrdReader
from test_lerobot import fill_store

from robo_post.cli import main
from robo_post.store import ArraySpec, EpisodeNotFoundError, Store, StoreSchema
from robo_post.store.view import find_episode

SCALARS = ["obs/state/x", "obs/state/y", "obs/state/z", "obs/state/gripper",  # the schema's LeRobot names
           "action/dx", "action/dy", "extras/logits/0", "extras/logits/1", "extras/logits/2",  # no names: indices
           "reward", "terminated", "truncated", "intervention", "policy_version"]


def read_recording(path):
    """Entity path -> {"step": the logged steps, column -> its values}, for the timeline's rows, and
    entity path -> {column: value} for static rows; from rerun's RrdReader over the file."""
    timed, static = {}, {}
    for chunk in RrdReader(path).stream():
        rows = chunk.to_record_batch().to_pydict()
        rows.pop("rerun.controls.RowId")
        if chunk.is_static:
            static.setdefault(chunk.entity_path, {}).update({k: v[0] for k, v in rows.items()})
            continue
        assert chunk.timeline_names == ["step"], chunk.entity_path  # the one timeline, no log time
        entity = timed.setdefault(chunk.entity_path, {})
        for column, values in rows.items():
            entity.setdefault(column, []).extend(values)
    return timed, static


@pytest.fixture
def store(tmp_path):
    return fill_store(tmp_path / "store", np.random.default_rng(0))


def test_recording_holds_the_episode(store, tmp_path, capsys):
    snap = store.snapshot()
    episode = snap.episodes(client="robot-b")[0]  # 12 steps, an instruction, no log-probabilities
    data = snap.load(episode)
    out = tmp_path / "ep.rrd"
    assert main(["store", "view", store.root, episode.key, "--out", str(out)]) == 0
    assert f"rerun {out}" in capsys.readouterr().out
    timed, static = read_recording(str(out))
    T = episode.length
    assert set(timed) == {"/obs/image", *(f"/{e}" for e in SCALARS)}  # behavior_logprob: not recorded
    assert {"/instruction", "/episode", "/obs/image"} <= set(static)
    for entity, rows in timed.items():
        steps = T + 1 if entity.startswith("/obs/") else T  # observations: the final one at step T
        assert rows["step"] == list(range(steps)), entity

    def scalars(entity):
        return np.array([v[0] for v in timed[entity]["Scalars:scalars"]])

    assert np.array_equal(scalars("/action/dy"), data["action"][:, 1].astype(np.float64))
    assert np.array_equal(scalars("/obs/state/gripper"), data["obs"]["state"][:, 3])
    assert np.array_equal(scalars("/extras/logits/2"), data["extras"]["logits"][:, 2].astype(np.float64))
    assert np.array_equal(scalars("/reward"), data["reward"])
    assert np.array_equal(scalars("/intervention"), data["intervention"].astype(np.float64))
    assert data["intervention"].any() and not data["intervention"].all()  # both values are compared
    fmt = static["/obs/image"]["Image:format"][0]
    assert (fmt["height"], fmt["width"]) == data["obs"]["image"].shape[1:3]
    frames = np.array([b[0] for b in timed["/obs/image"]["Image:buffer"]], dtype=np.uint8)
    assert np.array_equal(frames.reshape(data["obs"]["image"].shape), data["obs"]["image"])
    assert static["/instruction"]["TextDocument:text"] == [episode.instruction] == ["open the drawer"]
    assert episode.key in static["/episode"]["TextDocument:text"][0]


def test_default_is_the_newest_episode_written_here(store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    snap = store.snapshot()
    newest = max(snap.episodes(), key=lambda e: e.end_time)
    assert main(["store", "view", store.root]) == 0
    path = f"store-episode-{newest.client_id}-{newest.episode}.rrd"
    assert path in capsys.readouterr().out and os.path.exists(path)
    timed, _ = read_recording(path)
    assert np.array_equal([v[0] for v in timed["/reward"]["Scalars:scalars"]], snap.load(newest)["reward"])
    assert find_episode(snap, "-1") == snap.episodes()[-1] and find_episode(snap, "0") == snap.episodes()[0]
    assert [f for f in os.listdir(tmp_path) if ".tmp-" in f] == []


def test_logprobs_and_scalar_fields(tmp_path):
    """A scalar observation, a discrete action and recorded log-probabilities: one entity each."""
    schema = StoreSchema(observations={"speed": ArraySpec("float32", ())},
                         action=ArraySpec("int64", (), low=0, high=3))
    store = Store.create(str(tmp_path / "s"), schema)
    with store.writer("w") as w:
        w.write_episode({"speed": np.arange(4, dtype=np.float32)}, np.array([0, 3, 1, 2]),
                        behavior_logprobs=np.log([0.5, 0.25, 0.5, 1.0]))
    out = str(tmp_path / "s.rrd")
    assert main(["store", "view", store.root, "w/0", "--out", out]) == 0
    timed, static = read_recording(out)
    assert {"/obs/speed", "/action", "/behavior_logprob"} <= set(timed) and "/instruction" not in static
    assert [v[0] for v in timed["/action"]["Scalars:scalars"]] == [0, 3, 1, 2]
    assert [v[0] for v in timed["/obs/speed"]["Scalars:scalars"]] == [0, 1, 2, 3, 3]  # T rows given: the store repeats the last


@pytest.mark.parametrize("which", ["robot-a/7", "robot-c/0", "4", "-5", "last"])
def test_unknown_episode_is_a_typed_one_line_error(store, tmp_path, capsys, which):
    out = tmp_path / "x.rrd"
    assert main(["store", "view", store.root, which, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "EpisodeNotFoundError" in err and repr(which) in err
    assert "robot-a/0..1, robot-b/0..1" in err and "[-4, 3]" in err
    assert not out.exists()
    with pytest.raises(EpisodeNotFoundError):
        find_episode(store.snapshot(), which)


def test_missing_and_empty_stores(tmp_path, capsys):
    assert main(["store", "view", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "StoreNotFoundError" in err and "nowhere" in err
    empty = Store.create(str(tmp_path / "empty"), StoreSchema({"x": ArraySpec("float32", (2,))}, ArraySpec("float32", (1,))))
    assert main(["store", "view", empty.root]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "EpisodeNotFoundError" in err and "holds no committed episode" in err
    assert os.listdir(os.path.join(empty.root, "snapshots")) == []  # viewing wrote nothing into the store


def test_out_in_a_missing_folder(store, tmp_path, capsys):
    assert main(["store", "view", store.root, "--out", str(tmp_path / "no" / "x.rrd")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "FileNotFoundError" in err and str(tmp_path / "no") in err
