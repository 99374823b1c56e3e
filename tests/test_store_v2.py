"""Schema version 2: integer (discrete) actions, per-step extras, episode roles, and
stores written before them (version 1) that must keep opening."""

import json
import os
import shutil
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
import zarr

from robo_post.store import (
    ROLES,
    ArraySpec,
    EpisodeValidationError,
    Store,
    StoreError,
    StoreSchema,
    WindowSampler,
    infer_role,
)
from robo_post.store.integrity import validate_store
from test_store import tree_hash

DISCRETE = StoreSchema({"pos": ArraySpec("int64", (), 0, 9)}, ArraySpec("int64", (), low=1, high=4))
EXTRAS = StoreSchema(
    {"x": ArraySpec("float32", (2,))},
    ArraySpec("float32", (1,), low=-1.0, high=1.0),
    extras={"logits": ArraySpec("float32", (3,)), "mode": ArraySpec("int32", (), low=0, high=2)},
)
FIXTURE = os.path.join(os.path.dirname(__file__), "data", "store_v1")


# --- discrete actions ------------------------------------------------------------------
def test_from_spaces_maps_discrete_actions_and_bare_observations():
    box = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    schema = StoreSchema.from_spaces(gym.spaces.Dict({"s": box}), gym.spaces.Discrete(4, start=1), env="toy")
    assert schema.action == ArraySpec("int64", (), 1, 4) and schema.action_is_discrete
    assert schema.attrs == {"env": "toy"}
    multi = StoreSchema.from_spaces(box, gym.spaces.MultiDiscrete([3, 5], start=[1, 0]))
    assert multi.action == ArraySpec("int64", (2,), [1, 0], [3, 4])
    # A bare observation space is the single key "observation", marked for Minari export.
    assert multi.observations == {"observation": ArraySpec("float32", (2,), [-1.0, -1.0], [1.0, 1.0])}
    assert multi.attrs == {"minari_bare_observation": "observation"}
    bare_discrete = StoreSchema.from_spaces(gym.spaces.Discrete(6), box)
    assert bare_discrete.observations == {"observation": ArraySpec("int64", (), 0, 5)}
    # Float Box actions map exactly as before.
    assert bare_discrete.action == ArraySpec("float32", (2,), [-1.0, -1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="action space"):
        StoreSchema.from_spaces(box, gym.spaces.Tuple((box, box)))


def _discrete_store(tmp_path, episodes):
    store = Store.create(str(tmp_path / "d"), DISCRETE)
    with store.writer("play-0") as w:
        for actions in episodes:
            T = len(actions)
            w.write_episode({"pos": np.arange(T + 1) % 10}, np.asarray(actions, np.int64), rewards=np.ones(T),
                            terminated=np.arange(T) == T - 1)
    return store


def test_discrete_actions_round_trip_and_sample_as_int64(tmp_path):
    store = _discrete_store(tmp_path, [[1, 2, 3], [4, 4, 1, 2, 3]])
    with store.writer("play-1") as w:  # the step-wise API takes plain ints
        for t, a in enumerate((3, 1)):
            w.add({"pos": t}, a, 0.0, terminated=t == 1)
        w.commit()
    snap = store.snapshot()
    got = [snap.load(e)["action"] for e in snap]
    assert [a.tolist() for a in got] == [[1, 2, 3], [4, 4, 1, 2, 3], [3, 1]]
    assert all(a.dtype == np.int64 for a in got)
    b = WindowSampler.from_snapshot(snap, horizon=2).sample(0, starts=np.array([0, 2, 3, 7, 9]))
    assert b["actions"].dtype == torch.int64
    assert b["actions"].tolist() == [[1, 2], [3, 3], [4, 4], [3, 3], [1, 1]]  # padded with the last action
    assert b["action_mask"].tolist() == [[1, 1], [1, 0], [1, 1], [1, 0], [1, 0]]
    assert "extras" not in b  # the schema declares none
    assert validate_store(store.root) == (3, [])


@pytest.mark.parametrize(
    "actions, step, message",
    [
        (np.array([1.0, 2.0, 3.0]), None, "dtype float64"),  # no float -> int
        (np.array([1, 2, 3], np.int32), None, "dtype int32"),  # integer dtype must match exactly
        (np.array([1, 5, 3]), 1, "above upper bound 4"),
        (np.array([1, 2, 0]), 2, "below lower bound 1"),
    ],
)
def test_discrete_action_validation(tmp_path, actions, step, message):
    store = _discrete_store(tmp_path, [[1, 2, 3]])
    before = tree_hash(store.root)
    with store.writer("play-0") as w, pytest.raises(EpisodeValidationError, match=message) as err:
        w.write_episode({"pos": np.arange(4)}, actions)
    assert (err.value.field, err.value.step) == ("action", step)
    assert tree_hash(store.root) == before


def test_schema_checks_action_dtype_and_version():
    with pytest.raises(ValueError, match="floating point or integer"):
        StoreSchema({"x": ArraySpec("float32", ())}, ArraySpec("bool", ()))
    with pytest.raises(ValueError, match="schema_version >= 2"):
        StoreSchema({"x": ArraySpec("float32", ())}, ArraySpec("int64", ()), schema_version=1)
    assert StoreSchema.from_json(json.loads(json.dumps(EXTRAS.to_json()))) == EXTRAS


# --- extras ----------------------------------------------------------------------------
def _extras_episode(i, T):
    t = np.arange(T)
    return (
        {"x": np.stack([i * 100 + np.arange(T + 1)] * 2, 1).astype(np.float32)},
        np.full((T, 1), i / 10, np.float32),
        {"logits": np.stack([i * 100 + t, -t, t * 0.5], 1).astype(np.float32), "mode": (t % 3).astype(np.int32)},
    )


def test_extras_round_trip_through_both_apis_and_the_sampler(tmp_path):
    store = Store.create(str(tmp_path / "e"), EXTRAS)
    with store.writer("online-0") as w:
        obs, actions, extras = _extras_episode(0, 4)
        w.write_episode(obs, actions, extras=extras, truncated=np.arange(4) == 3)
        obs, actions, extras = _extras_episode(1, 3)
        for t in range(3):
            w.add({"x": obs["x"][t]}, actions[t], 0.0, truncated=t == 2,
                  extras={"logits": extras["logits"][t], "mode": extras["mode"][t]})
        w.commit(final_obs={"x": obs["x"][3]})
    snap = store.snapshot()
    for e, i in zip(snap, (0, 1)):
        want = _extras_episode(i, e.length)[2]
        got = snap.load(e)["extras"]
        assert set(got) == {"logits", "mode"} and got["mode"].dtype == np.int32
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    shard = snap.load_shard("online-0")["extras"]
    np.testing.assert_array_equal(shard["logits"][:, 0], [0, 1, 2, 3, 100, 101, 102])
    b = WindowSampler.from_snapshot(snap, horizon=2).sample(0, starts=np.array([0, 3, 4, 6]))
    assert b["extras"]["logits"].shape == (4, 3) and b["extras"]["logits"].dtype == torch.float32
    assert b["extras"]["logits"][:, 0].tolist() == [0, 3, 100, 102]  # at each window's start step
    assert b["extras"]["mode"].tolist() == [0, 0, 0, 2] and b["extras"]["mode"].dtype == torch.int32
    assert b["actions"].dtype == torch.float32
    assert validate_store(store.root) == (2, [])
    # The checksum covers the extras: a changed value is caught.
    logits = zarr.open_array(os.path.join(store.root, "shards", "online-0", "data", "extras", "logits"), mode="r+")
    logits[5, 1] = 7.0
    checked, problems = validate_store(store.root)
    assert checked == 1 and problems[0].startswith("online-0/1: checksum mismatch")


def _bad_extras(name, change):
    def mutate(extras):
        extras = dict(extras)
        change(extras) if name is None else extras.__setitem__(name, change(extras[name]))
        return extras

    return mutate


def _set(arr, index, value):
    arr = arr.copy()
    arr[index] = value
    return arr


BAD_EXTRAS = {
    "missing": (_bad_extras(None, lambda e: e.pop("mode")), "extras/mode", None, "missing"),
    "unknown": (_bad_extras(None, lambda e: e.__setitem__("value", e["mode"])), "extras/value", None, "not declared"),
    "nan": (_bad_extras("logits", lambda a: _set(a, (2, 1), np.nan)), "extras/logits", 2, "NaN"),
    "out_of_bounds": (_bad_extras("mode", lambda a: _set(a, 1, 3)), "extras/mode", 1, "above upper"),
    "float_into_int": (_bad_extras("mode", lambda a: a.astype(np.float32)), "extras/mode", None, "dtype float32"),
    "wrong_shape": (_bad_extras("logits", lambda a: a[:, :2]), "extras/logits", None, "shape"),
    "wrong_length": (_bad_extras("logits", lambda a: a[:3]), "extras/logits", None, "rows"),
}


@pytest.mark.parametrize("case", sorted(BAD_EXTRAS))
def test_bad_extras_raise_and_write_nothing(tmp_path, case):
    store = Store.create(str(tmp_path / "e"), EXTRAS)
    w = store.writer("a")
    w.write_episode(*_extras_episode(0, 4)[:2], extras=_extras_episode(0, 4)[2])
    before = tree_hash(store.root)
    mutate, field, step, message = BAD_EXTRAS[case]
    obs, actions, extras = _extras_episode(1, 4)
    with pytest.raises(EpisodeValidationError, match=message) as err:
        w.write_episode(obs, actions, extras=mutate(extras))
    assert (err.value.field, err.value.step) == (field, step)
    assert tree_hash(store.root) == before
    w.close()


def test_extras_checked_per_step_in_add_commit(tmp_path):
    store = Store.create(str(tmp_path / "e"), EXTRAS)
    w = store.writer("a")
    before = tree_hash(store.root)
    good = {"logits": np.zeros(3, np.float32), "mode": np.int32(1)}
    w.add({"x": np.zeros(2, np.float32)}, [0.0], 0.0, extras=good)
    w.add({"x": np.zeros(2, np.float32)}, [0.0], 0.0, extras={"logits": good["logits"]})
    with pytest.raises(EpisodeValidationError) as err:
        w.commit()
    assert (err.value.field, err.value.step) == ("extras/mode", 1)
    w.add({"x": np.zeros(2, np.float32)}, [0.0], 0.0)  # no extras at all
    with pytest.raises(EpisodeValidationError) as err:
        w.commit()
    assert (err.value.field, err.value.step) == ("extras/logits", 0)
    w.add({"x": np.zeros(2, np.float32)}, [0.0], 0.0, extras=good)
    w.add({"x": np.zeros(2, np.float32)}, [0.0], 0.0, extras={**good, "logits": np.zeros(4, np.float32)})
    with pytest.raises(EpisodeValidationError, match="shape") as err:
        w.commit()
    assert (err.value.field, err.value.step) == ("extras/logits", 1)
    assert tree_hash(store.root) == before
    w.close()


# --- roles -----------------------------------------------------------------------------
def test_roles_at_commit_filters_and_info(tmp_path):
    store = _discrete_store(tmp_path, [])
    with store.writer("lab") as w:
        w.write_episode({"pos": np.arange(3)}, [1, 2], role="demo")
        for role in ("deploy", None):
            w.add({"pos": 0}, 1, 0.0)
            w.commit(**({} if role is None else {"role": role}))
        before = tree_hash(store.root)
        with pytest.raises(EpisodeValidationError, match="unknown role 'teleop'") as err:
            w.write_episode({"pos": np.arange(3)}, [1, 2], role="teleop")
        assert err.value.field == "role"
        w.add({"pos": 0}, 1, 0.0)
        with pytest.raises(EpisodeValidationError) as err:
            w.commit(role="expert")
        assert err.value.field == "role" and tree_hash(store.root) == before
    snap = store.snapshot()
    assert [e.role for e in snap] == ["demo", "deploy", "other"]  # the default is "other"
    assert [e.episode for e in snap.episodes(role="deploy")] == [1]
    assert [e.episode for e in snap.episodes(role=["demo", "other"])] == [0, 2]
    assert snap.episodes(role="eval") == []
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", "store", "info", store.root, "--json"],
                       capture_output=True, text=True)
    assert json.loads(r.stdout)["roles"] == {"demo": 1, "deploy": 1, "other": 1}


@pytest.mark.parametrize(
    "client, role",
    [("demo-3", "demo"), ("play-0", "play"), ("deploy-12", "deploy"), ("online-1", "online"), ("eval-v3-c0", "eval"),
     ("minari", "imported"), ("lab", "other"), ("demo", "other"), ("demos-1", "other")],
)
def test_role_inferred_from_the_shard_name(client, role):
    assert infer_role(client) == role and role in ROLES


# --- version 1 stores --------------------------------------------------------------------
def test_store_written_by_the_previous_release_opens_validates_and_samples(tmp_path):
    """tests/data/store_v1 was written by robo-post 102143a (schema version 1: no extras,
    no roles), one shard per role prefix plus "lab", which was never closed (its last
    chunks are still in regions). Every value encodes its episode i and step t."""
    root = str(tmp_path / "store_v1")
    shutil.copytree(FIXTURE, root)
    with open(os.path.join(root, "store.json")) as f:
        assert "extras" not in json.load(f)
    store = Store.open(root)
    assert store.schema.schema_version == 1 and store.schema.extras == {}
    assert validate_store(root) == (14, [])
    snap = store.snapshot()
    roles = {e.client_id: e.role for e in snap}
    assert roles == {"demo-0": "demo", "play-0": "play", "deploy-0": "deploy", "online-1": "online",
                     "eval-0": "eval", "minari": "imported", "lab": "other"}
    assert [e.attrs["i"] for e in snap.episodes(role="demo")] == [0, 1]
    for e in snap:
        i, T = e.attrs["i"], e.length
        data = snap.load(e)
        assert T == 3 + i % 4 and data["extras"] == {}
        np.testing.assert_array_equal(data["obs"]["proprio"][:, 0], i * 100 + np.arange(T + 1))
        np.testing.assert_array_equal(data["action"][:, 1], np.full(T, i / 100, np.float32))
    batch = WindowSampler.from_snapshot(snap, horizon=3, seed=0).sample(64)
    assert batch["actions"].shape == (64, 3, 2) and batch["actions"].dtype == torch.float32
    assert "extras" not in batch
    # It takes new episodes (with roles) and stays a version 1 store that validates.
    same = Store.create(root, StoreSchema(store.schema.observations, store.schema.action, attrs=store.schema.attrs),
                        exist_ok=True)
    with same.writer("lab") as w:
        w.write_episode({"proprio": np.zeros((3, 3), np.float32), "image": np.zeros((3, 4, 4, 3), np.uint8)},
                        np.zeros((2, 2), np.float32), role="deploy")
    assert Store.open(root).schema.schema_version == 1
    assert [e.role for e in store.snapshot().episodes(client="lab")] == ["other", "other", "deploy"]
    assert validate_store(root) == (15, [])


def test_reopening_with_another_layout_names_each_difference_and_changes_nothing(tmp_path):
    root = str(tmp_path / "s")
    store = Store.create(root, EXTRAS)
    with store.writer("c") as w:
        w.write_episode({"x": np.zeros((3, 2), np.float32)}, np.zeros((2, 1), np.float32),
                        extras={"logits": np.zeros((2, 3), np.float32), "mode": np.zeros(2, np.int32)})
    before = tree_hash(root)
    wider = StoreSchema(EXTRAS.observations, EXTRAS.action,
                        extras={"logits": ArraySpec("float32", (4,)), "events": ArraySpec("float32", (4,))})
    with pytest.raises(StoreError) as err:
        Store.create(root, wider, exist_ok=True)
    message = str(err.value)
    assert "extras['events']: absent != float32 (4,)" in message
    assert "extras['logits']: float32 (3,) != float32 (4,)" in message
    assert "extras['mode']: int32 () in [0, 2] != absent" in message
    assert "observations" not in message and "action" not in message
    assert EXTRAS.layout_differences(StoreSchema(EXTRAS.observations, EXTRAS.action, extras=dict(EXTRAS.extras))) == []
    # long bounds are shortened (a driving observation's 88 made a line of 1,650 characters)
    bounded = StoreSchema({"s": ArraySpec("float32", (6,), [-1.0] * 6, [float(i) for i in range(6)])}, EXTRAS.action)
    assert bounded.layout_differences(StoreSchema({"s": ArraySpec("float32", (6,))}, EXTRAS.action)) == [
        "observations['s']: float32 (6,) in [[-1.0, -1.0, -1.0, ..., -1.0] (6 values), [0.0, 1.0, 2.0, ..., 5.0] "
        "(6 values)] != float32 (6,)"]
    assert tree_hash(root) == before and len(Store.open(root).snapshot()) == 1
