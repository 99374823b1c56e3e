"""LeRobot v3.0 export/import: the layout, exact round trips (camera video within a PSNR bound),
foreign datasets, appending to a store, typed errors on bad input, and the CLI."""

import io
import json
import os
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli
from PIL import Image

from robo_post.store import ArraySpec, Store, StoreError, StoreSchema
from robo_post.store.convert import SuccessRuleError
from robo_post.store.lerobot_format import (FeatureMismatchError, LeRobotFileError, LeRobotVersionError,
                                            NotLeRobotDatasetError)
from robo_post.store.lerobot_io import export_lerobot, import_lerobot
from robo_post.store.lerobot_video import VideoDecodeError

SCHEMA = StoreSchema(
    observations={
        "state": ArraySpec("float64", (4,), low=-5.0, high=5.0, unit="m"),
        "image": ArraySpec("uint8", (48, 64, 3)),
    },
    action=ArraySpec("float32", (2,), low=-1.0, high=1.0),
    extras={"logits": ArraySpec("float32", (3,))},
    attrs={"robot": "arm", "lerobot": {"names": {"observation.state": ["x", "y", "z", "gripper"],
                                                 "action": ["dx", "dy"]}}},
)
LENGTHS = (5, 12, 3, 9)
STEP_KEYS = ("reward", "terminated", "truncated", "policy_version", "intervention", "timestamp", "behavior_logprob")
# The lowest PSNR the video round trip may give: H.264 measured 32.55 to 33.76 dB per episode here
# (yuv420p halves the colour resolution, which alone costs about that much on these frames).
MIN_PSNR_DB = 30.0


def camera_frames(T, rng, H=48, W=64):
    """Camera-like frames: a lit gradient with a red disk moving across it, and sensor noise."""
    yy, xx = np.mgrid[0:H, 0:W]
    start = rng.uniform(10, W - 10)
    frames = np.empty((T, H, W, 3), np.float64)
    for t in range(T):
        frames[t, ..., 0], frames[t, ..., 1], frames[t, ..., 2] = 40 + 150 * xx / W, 60 + 120 * yy / H, 90
        disk = (xx - (start + 3 * t) % W) ** 2 + (yy - H / 2 - 8 * np.sin(t / 3)) ** 2 < 36
        frames[t][disk] = (230, 40, 30)
    return np.clip(frames + rng.normal(0, 2, frames.shape), 0, 255).astype(np.uint8)


def fill_store(root, rng):
    """Two shards, episodes of different lengths, terminated and truncated, with and without logprobs."""
    store = Store.create(str(root), SCHEMA)
    writers = {c: store.writer(c) for c in ("robot-a", "robot-b")}
    for i, T in enumerate(LENGTHS):
        done, terminated = np.arange(T) == T - 1, i % 2 == 0
        writers[("robot-a", "robot-b")[i % 2]].write_episode(
            {"state": rng.uniform(-5, 5, (T + 1, 4)), "image": camera_frames(T + 1, rng)},
            rng.uniform(-1, 1, (T, 2)).astype(np.float32),
            rewards=rng.normal(size=T),
            terminated=done & terminated,
            truncated=done & (not terminated),
            policy_versions=np.full(T, 3 + i),
            interventions=rng.integers(0, 2, T).astype(bool),
            timestamps=1.7e9 + np.arange(T) * 0.1 + rng.uniform(0, 1e-3, T),
            behavior_logprobs=rng.normal(size=T) if i != 1 else None,
            task_id=f"task-{i % 2}",
            instruction=["pick the cube", "open the drawer", "pick the cube", ""][i],
            seed=[100, None, 102, 2**70][i],
            success=[True, None, False, True][i],
            attrs={"operator": "ann", "nested": {"k": [1, 2.5, None]}} if i != 2 else {},
            role=["demo", "other", "deploy", "online"][i],
            extras={"logits": rng.normal(size=(T, 3)).astype(np.float32)},
        )
    for w in writers.values():
        w.close()
    return store


@pytest.fixture
def store(tmp_path):
    return fill_store(tmp_path / "store", np.random.default_rng(0))


def psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0 ** 2 / mse)


def pairs(original, imported):
    """(original, imported) episodes, matched by the order of export."""
    a, b = original.snapshot(), imported.snapshot()
    back = sorted(b.episodes(), key=lambda e: e.attrs["imported_from"]["episode"])
    return [(a, e, b, f) for e, f in zip(a.episodes(), back, strict=True)]


def assert_exact_except_cameras(original, imported):
    """Every array but the camera frames bit-exact, and every episode's metadata equal."""
    for a, e, b, f in pairs(original, imported):
        x, y = a.load(e), b.load(f)
        assert np.array_equal(x["obs"]["state"], y["obs"]["state"]) and y["obs"]["state"].dtype == np.float64
        assert np.array_equal(x["obs"]["image"][-1], y["obs"]["image"][-1])  # the final one is kept raw
        assert np.array_equal(x["action"], y["action"]) and y["action"].dtype == np.float32
        assert np.array_equal(x["extras"]["logits"], y["extras"]["logits"])
        for key in STEP_KEYS:
            assert np.array_equal(x[key], y[key], equal_nan=key == "behavior_logprob"), key
        for name in ("task_id", "instruction", "seed", "success", "role", "length", "policy_version",
                     "start_time", "end_time", "terminated"):
            assert getattr(e, name) == getattr(f, name), name
        assert {k: v for k, v in f.attrs.items() if k != "imported_from"} == e.attrs


def test_export_writes_the_v3_layout(store, tmp_path):
    root = tmp_path / "ds"
    # Tiny file limits: the data and video of these episodes span several files.
    export_lerobot(store.snapshot(), root, fps=10, data_files_size_in_mb=0.001, video_files_size_in_mb=0.001)
    info = json.loads((root / "meta/info.json").read_text())
    snap = store.snapshot()
    lengths = [e.length for e in snap.episodes()]  # exported in the snapshot's order: by shard
    frames = sum(lengths)
    assert (info["codebase_version"], info["fps"], info["total_episodes"], info["total_frames"], info["total_tasks"]) \
        == ("v3.0", 10, 4, frames, 3)
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["splits"] == {"train": "0:4"} and info["chunks_size"] == 1000
    features = info["features"]
    assert features["observation.state"] == {"dtype": "float64", "shape": [4], "names": ["x", "y", "z", "gripper"]}
    assert features["action"] == {"dtype": "float32", "shape": [2], "names": ["dx", "dy"]}
    assert features["logits"] == {"dtype": "float32", "shape": [3], "names": None}
    camera = features["observation.image"]
    assert (camera["dtype"], camera["shape"], camera["names"]) == ("video", [48, 64, 3], ["height", "width", "channels"])
    assert camera["info"]["video.codec"] == "h264" and camera["info"]["video.pix_fmt"] == "yuv420p"
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index", "next.reward", "next.done"):
        assert features[key]["shape"] == [1], key

    tasks = pd.read_parquet(root / "meta/tasks.parquet")  # as LeRobot reads it: the index is the task
    assert tasks.index.name == "task"
    assert {t: int(tasks.loc[t].task_index) for t in tasks.index} == {"pick the cube": 0, "open the drawer": 1, "task-1": 2}
    assert [e.instruction or e.task_id for e in snap.episodes()] == ["pick the cube", "pick the cube", "open the drawer",
                                                                     "task-1"]

    metas = sorted((root / "meta/episodes").glob("chunk-*/file-*.parquet"))
    assert len(metas) > 1  # past the size limit too
    episodes = [e for path in metas for e in pq.read_table(path).to_pylist()]
    assert [e["episode_index"] for e in episodes] == [0, 1, 2, 3]
    assert [(e["meta/episodes/chunk_index"], e["meta/episodes/file_index"]) for e in episodes] == [
        (0, int(p.stem[-3:])) for p in metas for _ in pq.read_table(p).column("episode_index")]
    assert [e["length"] for e in episodes] == lengths
    assert [e["tasks"] for e in episodes] == [["pick the cube"], ["pick the cube"], ["open the drawer"], ["task-1"]]
    ends = np.cumsum(lengths)
    assert [(e["dataset_from_index"], e["dataset_to_index"]) for e in episodes] == list(zip([0, *ends[:-1]], ends))
    assert len({(e["data/chunk_index"], e["data/file_index"]) for e in episodes}) > 1  # several data files
    videos = {(e["videos/observation.image/chunk_index"], e["videos/observation.image/file_index"]) for e in episodes}
    assert len(videos) > 1
    for e in episodes:
        assert e["videos/observation.image/to_timestamp"] - e["videos/observation.image/from_timestamp"] == \
            pytest.approx(e["length"] / 10)
        assert (root / info["data_path"].format(chunk_index=e["data/chunk_index"], file_index=e["data/file_index"])).is_file()
    for chunk, file in videos:
        assert (root / info["video_path"].format(video_key="observation.image", chunk_index=chunk,
                                                 file_index=file)).is_file()

    data = pa.concat_tables(pq.read_table(p) for p in sorted((root / "data").glob("chunk-*/file-*.parquet")))
    assert "observation.image" not in data.column_names  # in the videos
    assert data.column("index").to_pylist() == list(range(frames))
    assert data.column("frame_index").to_pylist() == [i for T in lengths for i in range(T)]
    rewards = np.concatenate([snap.load(e)["reward"] for e in snap.episodes()])
    assert np.array_equal(data.column("next.reward").to_numpy(), rewards)
    assert np.allclose(data.column("timestamp").to_numpy(), data.column("frame_index").to_numpy() / 10)

    stats = json.loads((root / "meta/stats.json").read_text())
    actions = np.concatenate([snap.load(e)["action"] for e in snap.episodes()]).astype(np.float64)
    assert np.allclose(stats["action"]["mean"], actions.mean(0)) and np.allclose(stats["action"]["std"], actions.std(0))
    assert stats["action"]["min"] == actions.min(0).tolist() and stats["action"]["count"] == [frames]
    assert np.array(stats["observation.image"]["mean"]).shape == (3, 1, 1)
    assert 0 < np.min(stats["observation.image"]["mean"]) < np.max(stats["observation.image"]["mean"]) < 1


def test_round_trip_is_exact_and_video_within_psnr(store, tmp_path):
    root = export_lerobot(store.snapshot(), tmp_path / "ds", data_files_size_in_mb=0.001, video_files_size_in_mb=0.001)
    done = import_lerobot(root, tmp_path / "back", client_id=None)
    assert (done.imported, done.skipped, done.invalid, done.ignored) == (4, 0, (), ())
    back = Store.open(str(tmp_path / "back"))
    assert back.schema == store.schema  # bounds, units, attrs: the exported schema
    assert sorted(back.shards()) == ["robot-a", "robot-b"]
    assert_exact_except_cameras(store, back)
    measured = []
    for a, e, b, f in pairs(store, back):
        original, decoded = a.load(e)["obs"]["image"][:-1], b.load(f)["obs"]["image"][:-1]
        assert decoded.shape == original.shape and decoded.dtype == np.uint8
        measured.append(psnr(original, decoded))
    print(f"H.264 round trip PSNR per episode (dB): {[round(float(p), 2) for p in measured]}")
    assert min(measured) >= MIN_PSNR_DB
    # Frames off by one are below it: the bound tells frames apart.
    x = b.load(f)["obs"]["image"]
    assert psnr(x[1:-1], a.load(e)["obs"]["image"][:-2]) < MIN_PSNR_DB - 2


def test_av1_video_reads_back_within_psnr(store, tmp_path):
    """LeRobot's own default codec (AV1) decodes too."""
    root = export_lerobot(store.snapshot(), tmp_path / "ds", codec="libsvtav1")
    assert json.loads((tmp_path / "ds/meta/info.json").read_text())["features"]["observation.image"]["info"][
        "video.codec"] == "av1"
    import_lerobot(root, tmp_path / "back")
    back = Store.open(str(tmp_path / "back"))
    assert_exact_except_cameras(store, back)
    measured = [psnr(a.load(e)["obs"]["image"][:-1], b.load(f)["obs"]["image"][:-1]) for a, e, b, f in pairs(store, back)]
    print(f"AV1 round trip PSNR per episode (dB): {[round(float(p), 2) for p in measured]}")
    assert min(measured) >= MIN_PSNR_DB


def test_embedded_images_round_trip_exactly(store, tmp_path):
    root = export_lerobot(store.snapshot(), tmp_path / "ds", images=True)
    info = json.loads((tmp_path / "ds/meta/info.json").read_text())
    assert info["features"]["observation.image"]["dtype"] == "image" and info["video_path"] is None
    assert not (tmp_path / "ds/videos").exists()
    column = pq.read_table(tmp_path / "ds/data/chunk-000/file-000.parquet").column("observation.image")
    assert column.type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert column[0]["bytes"].as_py()[:8] == b"\x89PNG\r\n\x1a\n"
    import_lerobot(root, tmp_path / "back")
    back = Store.open(str(tmp_path / "back"))
    assert_exact_except_cameras(store, back)
    for a, e, b, f in pairs(store, back):
        assert np.array_equal(a.load(e)["obs"]["image"], b.load(f)["obs"]["image"])


def test_import_appends_to_a_store_and_skips_what_it_holds(store, tmp_path):
    root = export_lerobot(store.snapshot(), tmp_path / "ds")
    before = {e.key: e for e in store.snapshot().episodes()}
    done = import_lerobot(root, store.root)  # into the store it came from: appended, shard "lerobot"
    assert (done.imported, done.skipped) == (4, 0)
    snap = Store.open(store.root).snapshot()
    assert len(snap) == 8 and {e.key: e for e in snap.episodes() if e.client_id != "lerobot"} == before
    assert import_lerobot(root, store.root).skipped == 4  # again: nothing added
    assert len(Store.open(store.root).snapshot()) == 8

    other = Store.create(str(tmp_path / "other"), StoreSchema({"state": ArraySpec("float32", (3,))},
                                                             ArraySpec("float32", (2,))))
    with pytest.raises(StoreError, match="another layout.*observations\\['image'\\]"):
        import_lerobot(root, other.root)
    assert len(Store.open(other.root).snapshot()) == 0


def foreign_dataset(root):
    """A LeRobot v3.0 dataset as LeRobot writes one, built here with pyarrow and pandas: two
    episodes, channels-first embedded camera, names, a string feature, next.success and no reward."""
    rng = np.random.default_rng(1)
    lengths, fps = (3, 4), 15
    state = rng.normal(size=(7, 3)).astype(np.float32)
    action = rng.normal(size=(7, 2)).astype(np.float32)
    images = [rng.integers(0, 256, (T, 8, 6, 3), dtype=np.uint8) for T in lengths]

    def png(image):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": "frame.png"}

    features = {
        "observation.state": {"dtype": "float32", "shape": [3], "names": ["x", "y", "z"]},
        "observation.images.wrist": {"dtype": "image", "shape": [3, 8, 6], "names": ["channels", "height", "width"]},
        "action": {"dtype": "float32", "shape": [2], "names": {"motors": ["a", "b"]}},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
        "language_note": {"dtype": "string", "shape": [1], "names": None},
        **{k: {"dtype": d, "shape": [1], "names": None} for k, d in
           (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"), ("index", "int64"),
            ("task_index", "int64"))},
    }
    os.makedirs(root / "meta/episodes/chunk-000")
    os.makedirs(root / "data/chunk-000")
    (root / "meta/info.json").write_text(json.dumps({
        "codebase_version": "v3.0", "robot_type": "so100", "total_episodes": 2, "total_frames": 7, "total_tasks": 2,
        "chunks_size": 1000, "data_files_size_in_mb": 100, "video_files_size_in_mb": 200, "fps": fps,
        "splits": {"train": "0:2"}, "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": None, "features": features}))
    pd.DataFrame({"task_index": [0, 1]}, index=pd.Index(["stack", "wipe"], name="task")).to_parquet(
        root / "meta/tasks.parquet")
    frame = [i for T in lengths for i in range(T)]
    pq.write_table(pa.table({
        "observation.state": pa.array(list(state), pa.list_(pa.float32(), 3)),
        "observation.images.wrist": pa.array([png(im) for ep in images for im in ep],
                                             pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "action": pa.array(list(action), pa.list_(pa.float32(), 2)),
        "next.done": [False, False, True, False, False, False, False],
        "next.success": [False, False, False, False, False, False, True],
        "language_note": ["n"] * 7,
        "timestamp": pa.array(np.array(frame) / fps, pa.float32()), "frame_index": frame,
        "episode_index": [0, 0, 0, 1, 1, 1, 1], "index": list(range(7)), "task_index": [0, 0, 0, 1, 1, 0, 1],
    }), root / "data/chunk-000/file-000.parquet")
    pq.write_table(pa.table({
        "episode_index": [0, 1], "tasks": [["stack"], ["wipe", "stack"]], "length": list(lengths),
        "data/chunk_index": [0, 0], "data/file_index": [0, 0], "dataset_from_index": [0, 3],
        "dataset_to_index": [3, 7], "meta/episodes/chunk_index": [0, 0], "meta/episodes/file_index": [0, 0],
    }), root / "meta/episodes/chunk-000/file-000.parquet")
    return state, action, images


def test_foreign_dataset_maps_features_tasks_and_success(tmp_path):
    state, action, images = foreign_dataset(tmp_path / "so100_stack")
    with pytest.raises(SuccessRuleError, match="--success-from"):
        import_lerobot(tmp_path / "so100_stack", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    with pytest.raises(SuccessRuleError, match="no numeric feature 'next.succes'"):
        import_lerobot(tmp_path / "so100_stack", tmp_path / "s", success_from="feature:next.succes")
    done = import_lerobot(tmp_path / "so100_stack", tmp_path / "s", success_from="feature:next.success")
    assert (done.imported, done.ignored) == (2, ("language_note",))
    store = Store.open(str(tmp_path / "s"))
    schema = store.schema
    assert schema.observations == {"state": ArraySpec("float32", (3,)), "images.wrist": ArraySpec("uint8", (8, 6, 3))}
    assert schema.action == ArraySpec("float32", (2,)) and schema.extras == {"next.success": ArraySpec("bool", (1,))}
    assert schema.attrs["lerobot"] == {"fps": 15, "robot_type": "so100", "names": {
        "observation.state": ["x", "y", "z"], "action": {"motors": ["a", "b"]}}}
    snap = store.snapshot()
    first, second = snap.episodes()
    assert (first.success, second.success) == (False, True)
    assert (first.terminated, second.terminated) == (True, False)
    assert (first.instruction, second.instruction, second.attrs["lerobot_tasks"]) == ("stack", "wipe", ["wipe", "stack"])
    assert first.task_id == "so100_stack" and first.role == "imported" and first.attrs["success_rule"] == \
        "feature:next.success"
    x, y = snap.load(first), snap.load(second)
    assert np.array_equal(x["obs"]["state"], np.concatenate([state[:3], state[2:3]]))  # last frame repeated
    assert np.array_equal(y["action"], action[3:])
    assert np.array_equal(x["obs"]["images.wrist"][:3], images[0])  # PNG: exact
    assert np.array_equal(y["reward"], np.zeros(4)) and list(y["truncated"]) == [False, False, False, True]
    assert list(y["extras"]["next.success"][:, 0]) == [False, False, False, True]

    # Exported again, the names come back on the features.
    export_lerobot(snap, tmp_path / "again")
    features = json.loads((tmp_path / "again/meta/info.json").read_text())["features"]
    assert json.loads((tmp_path / "again/meta/info.json").read_text())["fps"] == 15
    assert features["action"]["names"] == {"motors": ["a", "b"]}
    assert features["observation.images.wrist"]["shape"] == [8, 6, 3]


def test_bad_input_gets_typed_errors(store, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotLeRobotDatasetError, match="no meta/info.json"):
        import_lerobot(tmp_path / "empty", tmp_path / "s")
    with pytest.raises(NotLeRobotDatasetError, match="not a folder"):
        import_lerobot(tmp_path / "nowhere", tmp_path / "s")
    (tmp_path / "v21/meta").mkdir(parents=True)
    (tmp_path / "v21/meta/info.json").write_text(json.dumps({"codebase_version": "v2.1", "fps": 30, "features": {}}))
    with pytest.raises(LeRobotVersionError, match="'v2.1'.*convert_dataset_v21_to_v30"):
        import_lerobot(tmp_path / "v21", tmp_path / "s")
    assert not (tmp_path / "s").exists()

    root = tmp_path / "ds"
    export_lerobot(store.snapshot(), root)
    data = root / "data/chunk-000/file-000.parquet"
    good = data.read_bytes()
    data.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(LeRobotFileError, match="data file .*file-000.parquet is unreadable"):
        import_lerobot(root, tmp_path / "s")
    assert not (tmp_path / "s").exists()  # a store this import created and left empty is removed
    data.unlink()
    with pytest.raises(LeRobotFileError, match="data file .* is missing"):
        import_lerobot(root, tmp_path / "s")
    data.write_bytes(good)

    meta = root / "meta/episodes/chunk-000/file-000.parquet"
    meta_bytes = meta.read_bytes()
    meta.write_bytes(meta_bytes[:100])
    with pytest.raises(LeRobotFileError, match="episode metadata .* unreadable"):
        import_lerobot(root, tmp_path / "s")
    meta.write_bytes(meta_bytes)

    video = root / "videos/observation.image/chunk-000/file-000.mp4"
    video_bytes = video.read_bytes()
    video.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    with pytest.raises(VideoDecodeError, match="file-000.mp4"):
        import_lerobot(root, tmp_path / "s")
    video.unlink()
    with pytest.raises(VideoDecodeError, match="is missing"):
        import_lerobot(root, tmp_path / "s")
    video.write_bytes(video_bytes)

    info_path = root / "meta/info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.state"]["shape"] = [5]
    info_path.write_text(json.dumps(info))
    with pytest.raises(FeatureMismatchError, match="observation.state.*float64 \\[4\\]"):  # against the store schema
        import_lerobot(root, tmp_path / "s")
    shutil.rmtree(root / "meta/robo_post")  # a foreign dataset: the data itself disagrees
    with pytest.raises(FeatureMismatchError, match="'observation.state' of episode 0: a value of length 4.*\\[5\\]"):
        import_lerobot(root, tmp_path / "s", success_from="none")
    assert not (tmp_path / "s").exists()


def test_export_refuses_what_it_cannot_write(store, tmp_path):
    (tmp_path / "there").mkdir()
    with pytest.raises(StoreError, match="already exists"):
        export_lerobot(store.snapshot(), tmp_path / "there")
    with pytest.raises(StoreError, match="no episodes"):
        export_lerobot(store.snapshot(), tmp_path / "ds", episodes=[])
    odd = Store.create(str(tmp_path / "odd"), StoreSchema({"cam": ArraySpec("uint8", (5, 6, 3))},
                                                          ArraySpec("float32", (1,))))
    with odd.writer("w") as w:
        w.write_episode({"cam": np.zeros((3, 5, 6, 3), np.uint8)}, np.zeros((2, 1), np.float32))
    with pytest.raises(StoreError, match="even height and width.*--images"):
        export_lerobot(odd.snapshot(), tmp_path / "ds")
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob("ds.export-*"))
    export_lerobot(odd.snapshot(), tmp_path / "ds", images=True)  # PNG takes any size


@pytest.mark.slow
def test_cli_export_and_import(store, tmp_path):
    out = run_cli("store", "export-lerobot", store.root, str(tmp_path / "ds"), "--role", "demo", "--fps", "20")
    assert "exported 1 episodes (5 steps)" in out.stdout
    assert json.loads((tmp_path / "ds/meta/info.json").read_text())["fps"] == 20
    out = run_cli("store", "import-lerobot", str(tmp_path / "ds"), str(tmp_path / "back"))
    assert "imported 1 episode from" in out.stdout and "success: as exported" in out.stdout
    bad = run_cli("store", "import-lerobot", str(tmp_path), str(tmp_path / "s"), ok=False)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        f"robo-post store: NotLeRobotDatasetError: {tmp_path} is not a LeRobot v3.0 dataset: it has no meta/info.json"]
