"""Store round trips, snapshots, sampler targets, registry, and typed errors on bad input."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

from robo_post.store import (
    ArraySpec,
    EpisodeValidationError,
    ImitationSampler,
    InvalidNameError,
    MixedSampler,
    PolicyArtifactError,
    PolicyRegistry,
    PolicyVersionExistsError,
    SchemaVersionError,
    ShardLockedError,
    Store,
    StoreSchema,
    WindowSampler,
)
from robo_post.store.integrity import validate_store
from robo_post.utils.io import is_object_url

SCHEMA = StoreSchema(
    observations={"proprio": ArraySpec("float32", (5,)), "image": ArraySpec("uint8", (8, 8, 3))},
    action=ArraySpec("float32", (2,), low=-1.0, high=1.0),
)


def make_episode(rng, T, terminated=True):
    return {
        "obs": [
            {"proprio": rng.normal(size=5).astype(np.float32), "image": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)}
            for _ in range(T + 1)
        ],
        "actions": rng.uniform(-1, 1, (T, 2)).astype(np.float32),
        "rewards": rng.normal(size=T).astype(np.float32),
        "terminated": terminated,
    }


def commit(writer, ep, **meta):
    T = len(ep["actions"])
    for t in range(T):
        last = t == T - 1
        writer.add(
            ep["obs"][t], ep["actions"][t], float(ep["rewards"][t]),
            terminated=last and ep["terminated"], truncated=last and not ep["terminated"],
            policy_version=meta.get("policy_version", 0), timestamp=1000.0 + t, behavior_logprob=-0.5 * t,
        )
    return writer.commit(final_obs=ep["obs"][T], **meta)


def tree_hash(root):
    """Hash of every file's path and bytes under root (to prove nothing changed)."""
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            h.update(p.encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def store_hash(store):
    """Hash of every file (local) or object (object storage) of a store, to prove nothing changed."""
    if not is_object_url(store.root):
        return tree_hash(store.root)
    h = hashlib.sha256()
    for meta in sorted(store.objects.list(""), key=lambda m: m["path"]):
        h.update(meta["path"].encode())
        h.update(store.objects.get(meta["path"]))
    return h.hexdigest()


@pytest.fixture
def store(request, tmp_path):
    """A new store on a local disk, or on each backend in tests marked ``BOTH``."""
    if getattr(request, "param", "local") == "s3":
        return Store.create(f"s3://{request.getfixturevalue('s3_server').bucket()}/store", SCHEMA)
    return Store.create(str(tmp_path / "store"), SCHEMA)


BOTH = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)  # the same test on a local disk and on S3


@BOTH
def test_round_trip_mixed_observations(store):
    rng = np.random.default_rng(0)
    eps = [make_episode(rng, T, terminated=T % 2 == 0) for T in (3, 7, 4)]
    with store.writer("robot-a") as w:
        for i, ep in enumerate(eps):
            assert commit(w, ep, task_id="pick", instruction=f"pick {i}", seed=i, success=i == 1, attrs={"k": i}) == i
    snap = store.snapshot()
    assert len(snap) == 3 and snap.num_steps == 14
    for info, ep in zip(snap.episodes(), eps):
        got = snap.load(info)
        for k in ("proprio", "image"):
            np.testing.assert_array_equal(got["obs"][k], np.stack([o[k] for o in ep["obs"]]))
        assert got["obs"]["image"].dtype == np.uint8
        np.testing.assert_array_equal(got["action"], ep["actions"])
        np.testing.assert_array_equal(got["reward"], ep["rewards"])
        np.testing.assert_array_equal(got["timestamp"], 1000.0 + np.arange(len(ep["actions"])))
        np.testing.assert_array_equal(got["behavior_logprob"], -0.5 * np.arange(len(ep["actions"])))
        assert got["terminated"][-1] == ep["terminated"] and got["truncated"][-1] != ep["terminated"]
        assert not got["terminated"][:-1].any()
    assert [e.instruction for e in snap.episodes(success=True)] == ["pick 1"]
    assert snap.episodes()[2].attrs == {"k": 2}


@BOTH
def test_snapshot_is_reproducible_and_incremental(store):
    rng = np.random.default_rng(1)
    wa, wb = store.writer("a"), store.writer("b")
    commit(wa, make_episode(rng, 4), task_id="reach", policy_version=1)
    commit(wb, make_episode(rng, 5), task_id="push", policy_version=1)
    first = store.snapshot()
    before = [store.snapshot(first.id).load(e)["obs"]["image"] for e in first]
    commit(wa, make_episode(rng, 6), task_id="reach", policy_version=2)
    commit(wb, make_episode(rng, 2), task_id="push", policy_version=2)
    reopened = store.snapshot(first.id)
    assert len(reopened) == 2 and reopened.id == first.id
    for e, img in zip(reopened, before):
        np.testing.assert_array_equal(reopened.load(e)["obs"]["image"], img)
    second = store.snapshot()
    assert second.id != first.id and len(second) == 4
    new = second.new_since(first)
    assert sorted(e.key for e in new) == ["a/1", "b/1"]
    assert second.new_since(second) == []
    assert [e.key for e in second.episodes(task="push", min_policy_version=2)] == ["b/1"]
    assert [e.key for e in second.episodes(client="a", policy_version=1)] == ["a/0"]


def _scalar_store(tmp_path, episodes):
    """Store with 1-d observations equal to the global step counter, for hand-checked targets."""
    schema = StoreSchema({"x": ArraySpec("float32", ())}, ArraySpec("float32", (1,), low=-100.0, high=100.0))
    store = Store.create(str(tmp_path / "s"), schema)
    with store.writer("w") as w:
        for rewards, terminated in episodes:
            T = len(rewards)
            w.write_episode(
                {"x": np.arange(T + 1, dtype=np.float32) * 10},
                np.arange(T, dtype=np.float32)[:, None],
                rewards=rewards,
                terminated=np.arange(T) == T - 1 if terminated else np.zeros(T),
                truncated=np.zeros(T) if terminated else np.arange(T) == T - 1,
            )
    return store.snapshot()


def test_sampler_chunk_targets_by_hand(tmp_path):
    # Episode 0: 5 steps, terminated, reward 1 at the end. Episode 1: 6 steps, truncated.
    snap = _scalar_store(tmp_path, [([0, 0, 0, 0, 1], True), ([1, 2, 3, 4, 5, 6], False)])
    g = 0.5
    s = WindowSampler.from_snapshot(snap, horizon=2, n_step=1, gamma=g)
    b = s.sample(0, starts=np.array([0, 3, 4, 5, 9, 10]))
    # obs rows: episode 0 has 6 rows (x = 0..50), episode 1 starts at global step 5
    assert b["obs"]["x"].tolist() == [0, 30, 40, 0, 40, 50]
    assert b["actions"].shape == (6, 2, 1)
    assert b["actions"][:, :, 0].tolist() == [[0, 1], [3, 4], [4, 4], [0, 1], [4, 5], [5, 5]]
    assert b["action_mask"].tolist() == [[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 0]]
    # rewards: sum_i g^i r_{t+i} within the episode
    assert b["rewards"].tolist() == pytest.approx([0, 0 + g * 1, 1, 1 + g * 2, 5 + g * 6, 6])
    # interior: bootstrap at t+2 with g^2; terminated overrun: 0; truncated overrun: final obs with g^(T-t)
    assert b["discounts"].tolist() == pytest.approx([g**2, 0, 0, g**2, g**2, g**1])
    assert b["next_obs"]["x"].tolist() == [20, 50, 50, 20, 60, 60]
    # Time-outs as failures: the truncated overrun stops bootstrapping; nothing else changes.
    s0 = WindowSampler.from_snapshot(snap, horizon=2, n_step=1, gamma=g, bootstrap_truncated=False)
    b0 = s0.sample(0, starts=np.array([0, 3, 4, 5, 9, 10]))
    assert b0["discounts"].tolist() == pytest.approx([g**2, 0, 0, g**2, 0, 0])  # windows reaching T
    assert torch.equal(b0["rewards"], b["rewards"]) and torch.equal(b0["next_obs"]["x"], b["next_obs"]["x"])
    # n-step: K = n*H = 4 steps
    s4 = WindowSampler.from_snapshot(snap, horizon=2, n_step=2, gamma=g)
    b4 = s4.sample(0, starts=np.array([0, 5, 7]))
    assert b4["rewards"].tolist() == pytest.approx([g**4 * 0 + 0, 1 + g * 2 + g**2 * 3 + g**3 * 4, 3 + g * 4 + g**2 * 5 + g**3 * 6])
    assert b4["discounts"].tolist() == pytest.approx([g**4, g**4, g**4])
    assert b4["next_obs"]["x"].tolist() == [40, 40, 60]
    # n=1 targets equal the generic formula bit-exactly
    s1 = WindowSampler.from_snapshot(snap, horizon=4, n_step=1, gamma=g)
    assert torch.equal(s1.sample(0, starts=np.array([0, 5]))["rewards"], b4["rewards"][:2])


def test_sampler_reads_time_out_bootstrap_from_success_labels(tmp_path):
    """bootstrap_truncated=None: a truncated episode labelled a failure ends there, a truncated
    success (or an unlabelled one: dense-reward control cut by its time limit) bootstraps."""
    schema = StoreSchema({"x": ArraySpec("float32", ())}, ArraySpec("float32", (1,), low=-100.0, high=100.0))
    store = Store.create(str(tmp_path / "s"), schema)
    with store.writer("w") as w:
        for success in (False, True, None):
            w.write_episode({"x": np.arange(4, dtype=np.float32)}, np.zeros((3, 1), np.float32), rewards=np.ones(3),
                            terminated=np.zeros(3), truncated=np.arange(3) == 2, success=success)
        w.write_episode({"x": np.arange(4, dtype=np.float32)}, np.zeros((3, 1), np.float32), rewards=np.ones(3),
                        terminated=np.arange(3) == 2, truncated=np.zeros(3), success=True)
    g = 0.5
    last = np.array([2, 5, 8, 11])  # the last step of each episode
    auto = WindowSampler.from_snapshot(store.snapshot(), horizon=1, gamma=g, bootstrap_truncated=None)
    assert auto.sample(0, starts=last)["discounts"].tolist() == pytest.approx([0, g, g, 0])
    never = WindowSampler.from_snapshot(store.snapshot(), horizon=1, gamma=g, bootstrap_truncated=False)
    assert never.sample(0, starts=last)["discounts"].tolist() == pytest.approx([0, 0, 0, 0])
    always = WindowSampler.from_snapshot(store.snapshot(), horizon=1, gamma=g, bootstrap_truncated=True)
    assert always.sample(0, starts=last)["discounts"].tolist() == pytest.approx([g, g, g, 0])


def test_imitation_sampler_draws_demonstrations_and_interventions_only(tmp_path):
    schema = StoreSchema({"x": ArraySpec("float32", ())}, ArraySpec("float32", (1,), low=-100.0, high=100.0))
    store = Store.create(str(tmp_path / "s"), schema)
    x = iter(range(1000))  # every step gets its own observation value

    def episode(writer, T, success, interventions=()):
        flags = np.isin(np.arange(T), interventions)
        writer.write_episode({"x": np.array([next(x) for _ in range(T + 1)], np.float32)}, np.zeros((T, 1), np.float32),
                             rewards=np.arange(T) == T - 1 if success else np.zeros(T),
                             terminated=np.arange(T) == T - 1 if success else np.zeros(T),
                             truncated=np.zeros(T) if success else np.arange(T) == T - 1,
                             interventions=flags, success=success)

    with store.writer("demo-0") as w:
        episode(w, 3, True)      # x 0..2 imitated
        episode(w, 2, False)     # x 4, 5: a failed demo is not imitated
    with store.writer("deploy-0") as w:
        episode(w, 5, True, interventions=(3, 4))  # x 7..11: the overseer's steps 3, 4 -> x 10, 11
    snap = store.snapshot()
    sampler = WindowSampler.from_snapshot(snap, horizon=2)
    imitation = ImitationSampler([sampler], lambda e: e.success and e.client_id.startswith("demo-"), seed=0)
    assert sorted(sampler.sample(0, starts=imitation.starts[0])["obs"]["x"].tolist()) == [0, 1, 2, 10, 11]
    assert set(imitation.sample(200)["obs"]["x"].tolist()) == {0, 1, 2, 10, 11}
    # Episodes reaching a second sampler later (online) are indexed on refresh().
    online = WindowSampler(horizon=2)
    imitation = ImitationSampler([sampler, online], imitation.is_demo, seed=0)
    with store.writer("deploy-1") as w:
        episode(w, 3, False, interventions=(0,))  # x 13..15: step 0 -> x 13
    new = store.snapshot()
    online.add_episodes(new, new.episodes(client="deploy-1"))
    assert len(imitation) == 5
    imitation.refresh()
    assert len(imitation) == 6 and 13 in imitation.sample(200)["obs"]["x"].tolist()
    with pytest.raises(ValueError, match="imitate"):
        ImitationSampler([WindowSampler(horizon=2)], imitation.is_demo).sample(4)


@BOTH
def test_sampler_batch_shapes_and_staleness(store):
    rng = np.random.default_rng(2)
    with store.writer("a") as w:
        for v in (1, 2, 3):
            commit(w, make_episode(rng, 6), policy_version=v)
    snap = store.snapshot()
    s = WindowSampler.from_snapshot(snap, horizon=4, seed=0)
    b = s.sample(32)
    assert b["obs"]["image"].shape == (32, 8, 8, 3) and b["obs"]["image"].dtype == torch.uint8
    assert b["obs"]["proprio"].shape == (32, 5) and b["next_obs"]["proprio"].shape == (32, 5)
    assert b["actions"].shape == (32, 4, 2) and b["actions"].dtype == torch.float32
    assert b["action_mask"].shape == (32, 4) and b["rewards"].shape == (32,) and b["discounts"].shape == (32,)
    assert set(s.sample(200, min_policy_version=3)["policy_version"].tolist()) == {3}
    with pytest.raises(ValueError, match="policy_version >= 9"):
        s.sample(4, min_policy_version=9)


def test_mixed_sampler_ratio(tmp_path):
    off = _scalar_store(tmp_path / "off", [([0] * 10, True)])
    on = _scalar_store(tmp_path / "on", [([1] * 10, True)])
    mixed = MixedSampler(WindowSampler.from_snapshot(off), WindowSampler.from_snapshot(on), online_fraction=0.25)
    b = mixed.sample(64)
    assert b["source"].sum().item() == 16
    assert (b["rewards"][b["source"] == 1] > 0).all() and (b["rewards"][b["source"] == 0] == 0).all()


# --- bad input: typed errors, nothing written --------------------------------------
def _good(rng, T=4):
    return {"proprio": rng.normal(size=(T + 1, 5)).astype(np.float32), "image": np.zeros((T + 1, 8, 8, 3), np.uint8)}


BAD_EPISODES = {
    "nan_obs": (lambda o, a: (o["proprio"].__setitem__((2, 1), np.nan), a)[1], "obs/proprio", 2),
    "inf_action": (lambda o, a: (a.__setitem__((3, 0), np.inf), a)[1], "action", 3),
    "action_out_of_bounds": (lambda o, a: (a.__setitem__((1, 1), 1.5), a)[1], "action", 1),
    "image_wrong_dtype": (lambda o, a: (o.__setitem__("image", o["image"].astype(np.float32)), a)[1], "obs/image", None),
    "wrong_shape": (lambda o, a: (o.__setitem__("proprio", o["proprio"][:, :4]), a)[1], "obs/proprio", None),
    "missing_key": (lambda o, a: (o.pop("image"), a)[1], "obs", None),
    "unknown_key": (lambda o, a: (o.__setitem__("lidar", o["proprio"]), a)[1], "obs", None),
    "mismatched_lengths": (lambda o, a: (o.__setitem__("proprio", o["proprio"][:3]), a)[1], "obs/proprio", None),
    "empty": (lambda o, a: a[:0], "action", None),
}


@BOTH
@pytest.mark.parametrize("case", sorted(BAD_EPISODES))
def test_bad_episode_raises_and_writes_nothing(store, case):
    rng = np.random.default_rng(3)
    w = store.writer("a")
    w.write_episode(_good(rng), rng.uniform(-1, 1, (4, 2)), task_id="ok")
    before = store_hash(store)
    mutate, field, step = BAD_EPISODES[case]
    obs, act = _good(rng), rng.uniform(-1, 1, (4, 2)).astype(np.float32)
    act = mutate(obs, act)
    with pytest.raises(EpisodeValidationError) as err:
        w.write_episode(obs, act, task_id="bad")
    assert err.value.field == field and err.value.step == step, str(err.value)
    assert store_hash(store) == before
    assert len(store.snapshot()) == 1  # nothing became visible either


BAD_COLUMNS = {  # write_episode keyword -> (T=4 values, field named, step named)
    "terminated_not_0_or_1": ("terminated", [0, 0, 2, 0], "terminated", 2),
    "truncated_before_end": ("truncated", [0, 1, 0, 0], "terminated", 1),
    "negative_policy_version": ("policy_versions", [0, 0, 0, -1], "policy_version", 3),
    "fractional_policy_version": ("policy_versions", [0, 1.5, 0, 0], "policy_version", 1),
    "logprob_missing_on_some_steps": ("behavior_logprobs", [-1.0, np.nan, -1.0, -1.0], "behavior_logprob", 1),
    "logprob_inf": ("behavior_logprobs", [-1.0, -1.0, -np.inf, -1.0], "behavior_logprob", 2),
    "timestamp_nan": ("timestamps", [1.0, 2.0, np.nan, 4.0], "timestamp", 2),
}


@BOTH
@pytest.mark.parametrize("case", sorted(BAD_COLUMNS))
def test_bad_step_column_raises_and_writes_nothing(store, case):
    rng = np.random.default_rng(4)
    w = store.writer("a")
    w.write_episode(_good(rng), rng.uniform(-1, 1, (4, 2)), behavior_logprobs=[-1.0] * 4)
    before = store_hash(store)
    keyword, values, field, step = BAD_COLUMNS[case]
    with pytest.raises(EpisodeValidationError) as err:
        w.write_episode(_good(rng), rng.uniform(-1, 1, (4, 2)), **{keyword: np.asarray(values, np.float64)})
    assert (err.value.field, err.value.step) == (field, step), str(err.value)
    assert store_hash(store) == before


@BOTH
def test_bad_steps_through_add_commit(store):
    w = store.writer("a")
    before = store_hash(store)
    good = {"proprio": np.zeros(5, np.float32), "image": np.zeros((8, 8, 3), np.uint8)}
    w.add(good, [0.0, 0.0], 0.0)
    w.add({"proprio": np.zeros(6, np.float32), "image": good["image"]}, [0.0, 0.0], 0.0)
    with pytest.raises(EpisodeValidationError, match="step 1") as err:
        w.commit()
    assert err.value.field == "obs/proprio"
    w.add(good, [0.0, 0.0], float("nan"))
    with pytest.raises(EpisodeValidationError) as err:
        w.commit()
    assert (err.value.field, err.value.step) == ("reward", 0)
    with pytest.raises(EpisodeValidationError, match="empty"):
        w.commit()
    w.add(good, [0.0, 0.0], 0.0, terminated=True)
    w.add(good, [0.0, 0.0], 0.0)
    with pytest.raises(EpisodeValidationError, match="ends before its last step"):
        w.commit()
    w.add(good, [0.0, 0.0], 0.0)
    with pytest.raises(EpisodeValidationError) as err:
        w.commit(attrs={"x": object()})
    assert err.value.field == "attrs"
    assert store_hash(store) == before
    w.add(good, [0.0, 0.0], 1.0, terminated=True)
    assert w.commit(task_id="fine") == 0  # the writer is still usable after rejections


@BOTH
@pytest.mark.parametrize("bad_id", ["../x", "/abs", "", "a/b", ".hidden", "x" * 200])
def test_unsafe_client_id(store, bad_id):
    before = store_hash(store)
    with pytest.raises(InvalidNameError):
        store.writer(bad_id)
    assert store_hash(store) == before


def test_newer_schema_version_is_refused(store):
    path = os.path.join(store.root, "store.json")
    with open(path) as f:
        meta = json.load(f)
    meta["schema_version"] = 99
    with open(path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(SchemaVersionError, match="schema_version 99"):
        Store.open(store.root)


@BOTH
def test_one_writer_per_shard(store):
    w = store.writer("a")
    with pytest.raises(ShardLockedError):
        store.writer("a")
    w.close()
    store.writer("a").close()  # released on close (and by the OS when a process dies)


def test_policy_registry(store):
    reg = PolicyRegistry(store.root)
    assert reg.latest() is None
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    assert reg.publish(weights, {"arch": "mlp"}) == 1
    assert reg.publish({"w": weights["w"] * 2}, {"arch": "mlp"}) == 2
    with pytest.raises(PolicyVersionExistsError):
        reg.publish(weights, {}, version=2)
    os.makedirs(os.path.join(reg.location, ".tmp-halfwritten"))  # a publisher killed mid-write
    assert reg.versions() == [1, 2] and reg.latest() == 2
    w, cfg = reg.load(1)
    assert torch.equal(w["w"], weights["w"]) and cfg == {"arch": "mlp", "version": 1}
    assert torch.equal(reg.load()[0]["w"], weights["w"] * 2)
    # the weights are as readable as the config (safetensors' own writer made them 0600)
    version_dir = os.path.join(reg.location, "v000002")
    modes = {name: os.stat(os.path.join(version_dir, name)).st_mode & 0o777 for name in os.listdir(version_dir)}
    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes


def flip_last_byte(path):
    """Damage a file so that it still parses: one byte of a safetensors file's tensor data."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


@pytest.mark.slow  # spawns the CLI
def test_a_damaged_policy_version_is_an_error_naming_it(store):
    reg = PolicyRegistry(store.root)
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    for _ in range(4):
        reg.publish(weights, {"arch": "mlp"})
    path = lambda v, name: os.path.join(reg.location, f"v{v:06d}", name)  # noqa: E731
    flip_last_byte(path(1, "model.safetensors"))  # one byte of tensor data: the file still parses
    with pytest.raises(PolicyArtifactError, match=r"policy version 1: .*model.safetensors does not match"):
        reg.load(1)
    with open(path(2, "config.json"), "w") as f:
        f.write('{"arch": "mlp", "version": 2, "extra": 1}')  # valid JSON, edited after publishing
    with pytest.raises(PolicyArtifactError, match=r"policy version 2: .*config.json does not match"):
        reg.load(2)
    os.remove(path(3, "checksums.json"))  # a version published before checksums: still parsed with care
    with open(path(3, "model.safetensors"), "r+b") as f:
        f.truncate(20)
    with pytest.raises(PolicyArtifactError, match=r"policy version 3: .*model.safetensors is unreadable"):
        reg.load(3)
    os.remove(path(4, "model.safetensors"))
    with pytest.raises(PolicyArtifactError, match=r"policy version 4: cannot read"):
        reg.load(4)
    assert torch.equal(reg.load(reg.publish(weights, {}))[0]["w"], weights["w"])  # an intact version loads
    problems = validate_store(store.root)[1]
    assert [p.split(":")[0] for p in problems] == [f"policy version {v}" for v in (1, 2, 3, 4)], problems
    r = _cli("eval", f"store={store.root}", "env=point_mass", "version=[1]", "episodes_per_task=1", "show=false")
    assert r.returncode == 1 and "PolicyArtifactError: policy version 1" in r.stderr and "Traceback" not in r.stderr


def test_a_version_without_its_checksums_or_in_another_folder_is_refused(store):
    import shutil

    reg = PolicyRegistry(store.root)
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    for _ in range(2):
        reg.publish(weights, {"arch": "mlp"})
    v1, v2 = (os.path.join(reg.location, f"v{v:06d}") for v in (1, 2))
    os.remove(os.path.join(v1, "checksums.json"))  # deleted, then a byte of tensor data changed
    flip_last_byte(os.path.join(v1, "model.safetensors"))
    with pytest.raises(PolicyArtifactError, match=r"policy version 1: .*v000001/checksums.json is missing"):
        reg.load(1)
    shutil.copytree(v2, os.path.join(reg.location, "v000003"))  # a version folder copied by hand
    with pytest.raises(PolicyArtifactError, match=r"policy version 3: .*v000003/config.json is version 2's"):
        reg.load(3)
    shutil.copytree(v2, os.path.join(reg.location, "v0000002"))  # another spelling of version 2
    open(os.path.join(reg.location, "v000009"), "w").close()  # a file, not a version
    assert reg.versions() == [1, 2, 3] and reg.latest() == 3
    w, cfg = reg.load(2)  # the config reads back as published
    assert torch.equal(w["w"], weights["w"]) and cfg == {"arch": "mlp", "version": 2}
    problems = validate_store(store.root)[1]
    assert [p.split(":")[0] for p in problems] == ["policy version 1", "policy version 3"], problems

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "robo_post.cli", *args], capture_output=True, text=True)


@pytest.mark.slow  # spawns the CLI
def test_cli_info_and_validate_detect_corruption(store):
    rng = np.random.default_rng(5)
    with store.writer("a") as w:
        for i in range(3):
            commit(w, make_episode(rng, 5), task_id="reach" if i else "push", success=i > 0)
    r = _cli("store", "info", store.root, "--json")
    info = json.loads(r.stdout)
    assert (info["episodes"], info["steps"], info["shards"]) == (3, 15, 1)
    assert info["tasks"]["reach"] == {"episodes": 2, "success_rate": 1.0}
    assert info["success_rate"] == pytest.approx(2 / 3)
    assert _cli("store", "validate", store.root).returncode == 0
    # Data silently changed after commit: caught by the per-episode checksum.
    action = zarr.open_array(os.path.join(store.root, "shards", "a", "data", "action"), mode="r+")
    action[6, 0] = 0.123
    r = _cli("store", "validate", store.root)
    assert r.returncode == 1 and "a/1: checksum mismatch" in r.stderr
    # A torn shard file (cut short, as by a power cut): zarr reads the lost chunks as
    # never written, and the checksum catches it.
    image_dir = os.path.join(store.root, "shards", "a", "data", "obs", "image")
    shard = os.path.join(image_dir, next(f for f in os.listdir(image_dir) if f.startswith("c.")))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    r = _cli("store", "validate", store.root)
    assert r.returncode == 1 and "a/0: checksum mismatch" in r.stderr
    # Garbage over a chunk's bytes: caught as unreadable data.
    action_shard = os.path.join(store.root, "shards", "a", "data", "action", "c.0.0")
    with open(action_shard, "r+b") as f:
        offset = int(np.frombuffer(f.read(8), "<u8")[0])  # chunk 0's entry in the shard index
        f.seek(offset)
        f.write(b"\xff" * 16)
    r = _cli("store", "validate", store.root)
    assert r.returncode == 1 and "a/0: arrays unreadable" in r.stderr
    assert _cli("store", "info", "/nonexistent/store").returncode == 1
