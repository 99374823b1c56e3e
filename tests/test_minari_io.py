"""Minari export/import: exact round trips both ways, typed errors, and the CLI."""

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

import gymnasium as gym
import minari
import numpy as np
import pytest
import torch
from minari.data_collector import EpisodeBuffer

from robo_post.cli import main
from robo_post.envs.registry import env_spec
from robo_post.fleet.client import recorded_env_kwargs
from robo_post.store import ArraySpec, EpisodeValidationError, PolicyRegistry, Store, StoreError, StoreSchema
from robo_post.store.integrity import validate_store
from robo_post.store.minari_io import (SuccessRuleError, UnsupportedSpaceError, export_minari, import_minari,
                                       imported_rule, stored_success)

SCHEMA = StoreSchema(
    observations={
        "state": ArraySpec("float64", (4,), low=-5.0, high=5.0, unit="m"),
        "image": ArraySpec("uint8", (16, 16, 3)),
    },
    action=ArraySpec("float32", (2,), low=-1.0, high=1.0),
    attrs={"robot": "arm"},
)
STEP_KEYS = ("reward", "terminated", "truncated", "policy_version", "intervention", "timestamp", "behavior_logprob")


def fill_store(root, rng):
    """Two shards, terminated and truncated episodes, with and without logprobs."""
    store = Store.create(str(root), SCHEMA)
    specs = [  # client, T, terminated (else truncated), has behavior_logprob
        ("robot-a", 5, True, True),
        ("robot-a", 3, False, False),
        ("robot-b", 7, False, True),
        ("robot-b", 1, True, False),
    ]
    writers = {c: store.writer(c) for c in ("robot-a", "robot-b")}
    for i, (client, T, terminated, logprobs) in enumerate(specs):
        done = np.arange(T) == T - 1
        writers[client].write_episode(
            {
                "state": rng.uniform(-5, 5, (T + 1, 4)),
                "image": rng.integers(0, 256, (T + 1, 16, 16, 3), dtype=np.uint8),
            },
            rng.uniform(-1, 1, (T, 2)).astype(np.float32),
            rewards=rng.normal(size=T),  # float64: must not pass through float32
            terminated=done & terminated,
            truncated=done & (not terminated),
            policy_versions=np.full(T, 3 + i),
            interventions=rng.integers(0, 2, T).astype(bool),
            timestamps=1.7e9 + np.arange(T) * 0.1 + rng.uniform(0, 1e-3, T),
            behavior_logprobs=rng.normal(size=T) if logprobs else None,
            task_id=f"task-{i % 2}",
            instruction=f"pick the cube {i}",
            seed=[100, None, 102, 2**70][i],  # 2**70 does not fit Minari's int64 seed attribute
            success=[True, None, False, True][i],
            policy_version=3 + i,
            attrs={"operator": "ann", "nested": {"k": [1, 2.5, None]}} if i != 2 else {},
            role=["demo", "other", "deploy", "online"][i],
        )
    for w in writers.values():
        w.close()
    return store


def native_seeds(ds):
    """The seeds a plain Minari user sees."""
    return [m.get("seed") for m in ds.storage.get_episode_metadata(ds.episode_indices)]


def imported(info, dataset_id):
    """An imported episode's record without its source, which the import adds; checks the source."""
    attrs = dict(info.attrs)
    assert attrs.pop("imported_from")["dataset"] == dataset_id
    return dataclasses.replace(info, attrs=attrs)


def assert_same_episodes(snap_a, snap_b, dataset_id):
    assert len(snap_a) == len(snap_b)
    for i, (ea, eb) in enumerate(zip(snap_a.episodes(), snap_b.episodes())):
        assert eb.attrs["imported_from"] == {"dataset": dataset_id, "episode": i}
        assert imported(eb, dataset_id) == ea  # every other field, incl. role and the checksum over all arrays
        a, b = snap_a.load(ea), snap_b.load(eb)
        for k in snap_a.store.schema.observations:
            assert a["obs"][k].dtype == b["obs"][k].dtype
            np.testing.assert_array_equal(a["obs"][k], b["obs"][k])
        assert a["action"].dtype == b["action"].dtype
        np.testing.assert_array_equal(a["action"], b["action"])
        assert a["extras"].keys() == b["extras"].keys()
        for k in a["extras"]:
            assert a["extras"][k].dtype == b["extras"][k].dtype
            np.testing.assert_array_equal(a["extras"][k], b["extras"][k])
        for k in STEP_KEYS:
            np.testing.assert_array_equal(a[k], b[k])  # NaN == NaN here


def test_store_to_minari_to_store_is_exact(tmp_path, monkeypatch):
    monkeypatch.delenv("MINARI_DATASETS_PATH", raising=False)
    src = fill_store(tmp_path / "src", np.random.default_rng(0))
    snap = src.snapshot()
    path = export_minari(snap, "robo/pick-v0", minari_root=tmp_path / "minari")
    assert path == str(tmp_path / "minari" / "robo" / "pick-v0")
    assert "MINARI_DATASETS_PATH" not in os.environ  # restored

    # What a plain Minari user sees: raw (not JPEG) images, T + 1 observations, our extras.
    ds = minari.MinariDataset(os.path.join(path, "data"))
    assert ds.storage.jpeg_encoding is False
    assert ds.observation_space["image"] == gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)
    ep = ds[0]
    first = snap.load(snap.episodes()[0])
    np.testing.assert_array_equal(ep.observations["image"], first["obs"]["image"])
    assert set(ep.infos["robo_post"]) == {"policy_version", "intervention", "timestamp", "behavior_logprob"}
    assert len(ep.infos["robo_post"]["timestamp"]) == len(ep) + 1
    assert native_seeds(ds) == [100, None, 102, None]

    done = import_minari("robo/pick-v0", tmp_path / "dst", client_id=None, minari_root=tmp_path / "minari")
    assert (done.imported, done.skipped) == (4, 0)
    dst = Store.open(str(tmp_path / "dst"))
    assert dst.schema == src.schema
    assert_same_episodes(snap, dst.snapshot(), "robo/pick-v0")

    # Default: everything lands in one shard, metadata otherwise unchanged.
    import_minari("robo/pick-v0", tmp_path / "one", minari_root=tmp_path / "minari")
    one = Store.open(str(tmp_path / "one")).snapshot().episodes()
    assert {e.client_id for e in one} == {"minari"}
    for a, b in zip(snap.episodes(), one):
        moved = {k: getattr(a, k) for k in ("client_id", "episode", "step_start", "obs_start")}
        assert dataclasses.replace(imported(b, "robo/pick-v0"), **moved) == a


def collect_pendulum(dataset_id, n_episodes=3):
    """Random Pendulum episodes via DataCollector, under $MINARI_DATASETS_PATH."""
    env = minari.DataCollector(gym.make("Pendulum-v1", max_episode_steps=12), record_infos=True)
    for seed in range(n_episodes):
        env.reset(seed=seed)
        env.action_space.seed(seed)
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            done = terminated or truncated
    env.create_dataset(
        dataset_id, eval_env="Pendulum-v1", algorithm_name="random",
        author="t", author_email="t", code_permalink="t", description="t",
    )
    env.close()


@pytest.mark.slow
@pytest.mark.fleet
def test_the_fleet_adds_episodes_to_an_imported_store(tmp_path, monkeypatch, capfd):
    """The import's marker of a bare observation space made every collect into the store a schema
    mismatch, and the message blamed the step limit, which changes no observation."""
    root, store = tmp_path / "minari", str(tmp_path / "store")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    collect_pendulum("pendulum/random-v0")
    import_minari("pendulum/random-v0", store, minari_root=root, success_from="none")
    args = ["collect", "env=Pendulum-v1", "policy=random", "fleet.n_clients=1", f"store={store}", "show=false"]
    assert main([*args, "episodes=1"]) == 0  # without the recorded step limit: recorded, with a warning
    assert "was recorded with env kwargs {'max_episode_steps': 12}, these episodes with {}" in capfd.readouterr().err
    assert main([*args, "episodes=2", "+env.kwargs.max_episode_steps=12"]) == 0
    collected = [e for e in Store.open(store).snapshot().episodes() if e.role != "imported"]
    assert [e.length for e in collected] == [200, 12, 12] and validate_store(store)[1] == []
    # in-training eval of the imported data: its task ids name the dataset, which no Pendulum has
    run = tmp_path / "run"
    assert main(["train", f"store={store}", "algo=bc_flow", "updates=4", "eval.every=2", "eval.episodes_per_task=2",
                 "log_every=2", "data.success=null", f"run_dir={run}", "show=false"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows if "eval/return/Pendulum-v1" in r] == [2, 4]


@pytest.mark.slow
@pytest.mark.fleet
def test_a_fleet_recorded_gym_store_exports_an_env_minari_can_recover(tmp_path, monkeypatch):
    """Exports recorded no env spec: ``recover_environment()`` failed for Minari users."""
    root, store = tmp_path / "minari", str(tmp_path / "store")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    assert main(["collect", "env=Pendulum-v1", "policy=random", "fleet.n_clients=1", f"store={store}", "show=false",
                 "episodes=2", "+env.kwargs.max_episode_steps=12"]) == 0
    assert main(["store", "export-minari", store, "lab/pendulum-v0", "--minari-root", str(root)]) == 0
    dataset = minari.load_dataset("lab/pendulum-v0")
    env = dataset.recover_environment()
    assert (env.spec.id, env.spec.max_episode_steps) == ("Pendulum-v1", 12)
    assert dataset.observation_space == env.observation_space  # the env's bare Box, not the fleet's Dict
    assert main(["store", "import-minari", "lab/pendulum-v0", str(tmp_path / "back"), "--minari-root", str(root),
                 "--client", "client-0"]) == 0
    assert_same_episodes(Store.open(store).snapshot(), Store.open(str(tmp_path / "back")).snapshot(), "lab/pendulum-v0")


def test_minari_to_store_to_minari_is_exact(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))  # DataCollector caches episodes under it
    collect_pendulum("pendulum/random-v0")
    assert import_minari("pendulum/random-v0", tmp_path / "store", minari_root=root,
                         success_from="termination").imported == 3

    snap = Store.open(str(tmp_path / "store")).snapshot()
    infos = snap.episodes()
    assert [e.task_id for e in infos] == ["pendulum/random-v0"] * 3
    assert [e.seed for e in infos] == [0, 1, 2]
    assert [e.success for e in infos] == [False] * 3  # truncated, never terminated
    # The env as recorded: eval rebuilds it with the dataset's step limit, not the id's default of 200.
    recorded = {"max_episode_steps": 12, **minari.MinariDataset(str(root / "pendulum" / "random-v0" / "data")
                                                                 ).spec.env_spec.kwargs}
    assert [(e.role, e.attrs) for e in infos] == [
        ("imported", {"success_rule": "termination", "imported_from": {"dataset": "pendulum/random-v0", "episode": i},
                      "env_kwargs": recorded})
        for i in range(3)
    ]
    spec = env_spec("Pendulum-v1")
    assert recorded_env_kwargs(str(tmp_path / "store"), spec) == recorded
    # the same id named with the module that registers it (`env=MODULE:ID`, for an env of the user's own
    # module, which Minari records without it): its recorded kwargs were dropped without a word
    moduled = env_spec("gymnasium.envs.classic_control.pendulum:Pendulum-v1")
    assert recorded_env_kwargs(str(tmp_path / "store"), moduled) == recorded
    assert spec.make(**recorded).spec.max_episode_steps == 12

    export_minari(snap, "pendulum/again-v0", minari_root=root)
    a = minari.MinariDataset(str(root / "pendulum" / "random-v0" / "data"))
    b = minari.MinariDataset(str(root / "pendulum" / "again-v0" / "data"))
    assert a.observation_space == b.observation_space and a.action_space == b.action_space
    assert len(a) == len(b) == 3
    for ea, eb in zip(a.iterate_episodes(), b.iterate_episodes()):
        for field in ("observations", "actions", "rewards", "terminations", "truncations"):
            x, y = getattr(ea, field), getattr(eb, field)
            assert x.dtype == y.dtype and x.shape == y.shape, field
            np.testing.assert_array_equal(x, y)
    assert native_seeds(a) == native_seeds(b) == [0, 1, 2]


def test_unsupported_spaces_raise_typed_errors(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    nested = gym.spaces.Dict({"arm": gym.spaces.Dict({"q": gym.spaces.Box(-1, 1, (2,), np.float32)})})
    buf = EpisodeBuffer(
        observations={"arm": {"q": np.zeros((3, 2), np.float32)}},
        actions=np.zeros((2, 1), np.float32),
        rewards=[0.0, 0.0],
        terminations=[False, True],
        truncations=[False, False],
    )
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    with pytest.warns(UserWarning):  # Minari's missing-metadata nags
        minari.create_dataset_from_buffers(
            "nested-v0", [buf], observation_space=nested, action_space=gym.spaces.Box(-1, 1, (1,), np.float32)
        )
        buf = dataclasses.replace(buf, observations=np.zeros((3, 2), np.float32), actions=(np.array([0, 1]), np.array([0.5, -0.5], np.float32)))
        tuple_actions = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Box(-1, 1, (), np.float32)))
        minari.create_dataset_from_buffers(
            "tuple-v0", [buf], observation_space=nested["arm"]["q"], action_space=tuple_actions
        )
    with pytest.raises(UnsupportedSpaceError, match="'arm'.*nested Dict"):
        import_minari("nested-v0", tmp_path / "store", minari_root=root, success_from="termination")
    with pytest.raises(UnsupportedSpaceError, match=r"action space Tuple\(Discrete\(2\)"):
        import_minari("tuple-v0", tmp_path / "store", minari_root=root, success_from="termination")
    assert not (tmp_path / "store").exists()  # refused before anything was created

    with pytest.raises(StoreError, match="no Minari dataset"):
        import_minari("missing-v0", tmp_path / "store", minari_root=root)
    with pytest.raises(StoreError, match="bad Minari dataset id"):
        import_minari("no-version", tmp_path / "store", minari_root=root)


@pytest.mark.slow
def test_cli_export_and_import(tmp_path, capsys):
    fill_store(tmp_path / "src", np.random.default_rng(1))
    mroot = str(tmp_path / "minari")
    out = subprocess.run(
        [sys.executable, "-m", "robo_post.cli", "store", "export-minari", str(tmp_path / "src"), "robo/failures-v0",
         "--minari-root", mroot, "--no-success"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert out.startswith("exported 1 episodes (7 steps) to ")

    assert main(["store", "import-minari", "robo/failures-v0", str(tmp_path / "dst"), "--minari-root", mroot,
                 "--client", "lab", "--task", "relabelled"]) == 0
    assert "imported 1 episode from" in capsys.readouterr().out
    (ep,) = Store.open(str(tmp_path / "dst")).snapshot().episodes()
    assert (ep.client_id, ep.task_id, ep.success, ep.length) == ("lab", "relabelled", False, 7)

    # Exporting onto an existing id is a clean error, not a traceback.
    assert main(["store", "export-minari", str(tmp_path / "src"), "robo/failures-v0", "--minari-root", mroot]) == 1
    assert "already exists" in capsys.readouterr().err
    assert minari.MinariDataset(os.path.join(mroot, "robo", "failures-v0", "data")).total_episodes == 1
    assert main(["store", "export-minari", str(tmp_path / "src"), "robo/deploy-v0", "--minari-root", mroot,
                 "--role", "deploy"]) == 0
    assert capsys.readouterr().out.startswith("exported 1 episodes (7 steps) to ")


def foreign_dataset(root, monkeypatch, dataset_id="lab/foreign-v0"):
    """Four episodes of a plain Minari dataset (not exported by robo-post): returns
    [2, 1, 0, 3]; ends terminated / truncated / terminated / truncated; info "is_success"
    set on the last step of episodes 1 and 2 only."""
    buffers = []
    for i, (terminated, success) in enumerate([(True, False), (False, True), (True, True), (False, False)]):
        T = 3
        ends = np.arange(T) == T - 1
        buffers.append(EpisodeBuffer(
            observations=np.arange(T + 1, dtype=np.float32)[:, None] + i,
            actions=np.zeros((T, 1), np.float32),
            rewards=np.full(T, [2, 1, 0, 3][i] / T),
            terminations=ends & terminated,
            truncations=ends & (not terminated),
            infos={"is_success": np.arange(T + 1) == T if success else np.zeros(T + 1, bool)},
        ))
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    with pytest.warns(UserWarning):  # Minari's missing-metadata nags
        minari.create_dataset_from_buffers(
            dataset_id, buffers, observation_space=gym.spaces.Box(-10, 10, (1,), np.float32),
            action_space=gym.spaces.Box(-1, 1, (1,), np.float32),
        )
    return dataset_id


@pytest.mark.parametrize(
    "rule, successes",
    [
        ("termination", [True, False, True, False]),
        ("truncation", [False, True, False, True]),
        ("info:is_success", [False, True, True, False]),
        ("return>=1", [True, True, False, True]),
        ("return>=2.5", [False, False, False, True]),
        ("none", [None, None, None, None]),
    ],
)
def test_foreign_import_takes_its_success_rule(tmp_path, monkeypatch, rule, successes):
    root = tmp_path / "minari"
    dataset_id = foreign_dataset(root, monkeypatch)
    assert import_minari(dataset_id, tmp_path / "store", minari_root=root, success_from=rule).imported == 4
    eps = Store.open(str(tmp_path / "store")).snapshot().episodes()
    assert [e.success for e in eps] == successes
    assert {(e.role, e.attrs["success_rule"], e.client_id) for e in eps} == {("imported", rule, "minari")}
    # The same rule on the stored episodes (what eval applies to its own): a store keeps no infos.
    assert imported_rule(eps) == rule
    assert [stored_success(rule, e) for e in eps] == ([None] * 4 if rule.startswith("info:") else successes)


def test_eval_judges_an_env_without_success_by_the_rule_the_data_was_imported_with(tmp_path, monkeypatch):
    """A store imported with --success-from truncation: eval reported success '–' for every version."""
    from robo_post.eval.rollout import load_results

    root, store = tmp_path / "minari", str(tmp_path / "store")
    buffers = [EpisodeBuffer(observations=np.zeros((4, 3), np.float32), actions=np.zeros((3, 1), np.float32),
                             rewards=np.zeros(3), terminations=np.zeros(3, bool), truncations=np.arange(3) == 2)]
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    with pytest.warns(UserWarning):  # Minari's missing-metadata nags
        minari.create_dataset_from_buffers("lab/pendulum-v0", buffers, env=gym.make("Pendulum-v1"))
    import_minari("lab/pendulum-v0", store, minari_root=root, success_from="truncation")
    assert PolicyRegistry(store).publish({}, {"kind": "random"}) == 1
    assert main(["eval", f"store={store}", "version=1", "env=Pendulum-v1", "episodes_per_task=2", "n_clients=1",
                 "show=false"]) == 0
    result = load_results(store + "-eval")[-1]
    assert result["mean_success_rate"] == 1.0  # Pendulum never terminates: every episode ran to its limit
    assert result["success_rule"].startswith("truncation: the rule the policy store's episodes were imported with")


def test_foreign_import_without_or_with_a_bad_rule_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    dataset_id = foreign_dataset(root, monkeypatch)
    with pytest.raises(SuccessRuleError, match="success_from.*--success-from") as err:
        import_minari(dataset_id, tmp_path / "store", minari_root=root)
    for rule in ("termination", "truncation", "info:KEY", "return>=X", "none"):
        assert repr(rule) in str(err.value)  # the message lists every rule
    for bad in ("terminated", "info:", "return>=abc", "return>=nan", "return>", ""):
        with pytest.raises(SuccessRuleError, match=f"bad success rule {bad!r}"):
            import_minari(dataset_id, tmp_path / "store", minari_root=root, success_from=bad)
    assert not (tmp_path / "store").exists()  # refused before anything was created
    with pytest.raises(SuccessRuleError, match="has no info 'success'"):
        import_minari(dataset_id, tmp_path / "store", minari_root=root, success_from="info:success")


def test_exported_success_needs_no_rule_and_an_explicit_rule_overrides_it(tmp_path):
    src = fill_store(tmp_path / "src", np.random.default_rng(2))
    export_minari(src.snapshot(), "robo/own-v0", minari_root=tmp_path / "minari")
    import_minari("robo/own-v0", tmp_path / "a", minari_root=tmp_path / "minari")
    a = Store.open(str(tmp_path / "a")).snapshot().episodes()
    assert [e.success for e in a] == [True, None, False, True]  # as exported
    assert ["success_rule" in e.attrs for e in a] == [False] * 4
    assert [e.role for e in a] == ["demo", "other", "deploy", "online"]  # kept
    import_minari("robo/own-v0", tmp_path / "b", minari_root=tmp_path / "minari", success_from="truncation")
    b = Store.open(str(tmp_path / "b")).snapshot().episodes()
    assert [e.success for e in b] == [False, True, True, False]
    assert [e.attrs["success_rule"] for e in b] == ["truncation"] * 4


DISCRETE = StoreSchema(
    observations={"cell": ArraySpec("int64", (), low=0, high=15), "image": ArraySpec("uint8", (4, 4, 1))},
    action=ArraySpec("int64", (), low=0, high=3),
    extras={"logits": ArraySpec("float32", (4,)), "option": ArraySpec("int32", (), low=0, high=2),
            "contact": ArraySpec("bool", (2,))},
)


def test_discrete_actions_and_extras_round_trip_through_minari_exactly(tmp_path):
    rng = np.random.default_rng(3)
    src = Store.create(str(tmp_path / "src"), DISCRETE)
    with src.writer("play-0") as w:
        for i, T in enumerate((4, 1, 6)):
            ends = np.arange(T) == T - 1
            w.write_episode(
                {"cell": rng.integers(0, 16, T + 1), "image": rng.integers(0, 256, (T + 1, 4, 4, 1), dtype=np.uint8)},
                rng.integers(0, 4, T),
                rewards=rng.normal(size=T), terminated=ends & (i != 1), truncated=ends & (i == 1),
                extras={"logits": rng.normal(size=(T, 4)).astype(np.float32),
                        "option": rng.integers(0, 3, T).astype(np.int32), "contact": rng.integers(0, 2, (T, 2)) > 0},
                success=i == 0, role=["play", "eval", "demo"][i],
            )
    snap = src.snapshot()
    path = export_minari(snap, "robo/grid-v0", minari_root=tmp_path / "minari")
    ds = minari.MinariDataset(os.path.join(path, "data"))
    assert ds.action_space == gym.spaces.Discrete(4)  # what a plain Minari user sees
    assert ds[0].actions.dtype == np.int64
    import_minari("robo/grid-v0", tmp_path / "dst", client_id=None, minari_root=tmp_path / "minari")
    dst = Store.open(str(tmp_path / "dst"))
    assert dst.schema == DISCRETE
    assert [e.role for e in dst.snapshot()] == ["play", "eval", "demo"]
    assert_same_episodes(snap, dst.snapshot(), "robo/grid-v0")


def test_cli_import_with_success_rule_and_info_shows_it(tmp_path, monkeypatch, capsys):
    root = tmp_path / "minari"
    dataset_id = foreign_dataset(root, monkeypatch)
    store = str(tmp_path / "store")
    assert main(["store", "import-minari", dataset_id, store, "--minari-root", str(root)]) == 1
    assert "--success-from" in capsys.readouterr().err
    assert main(["store", "import-minari", dataset_id, store, "--minari-root", str(root),
                 "--success-from", "info:is_success"]) == 0
    assert "success: info:is_success" in capsys.readouterr().out
    assert main(["store", "info", store, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["roles"] == {"imported": 4} and info["success_rules"] == {"info:is_success": 4}
    assert info["success_rate"] == 0.5
    assert main(["store", "info", store]) == 0
    out = capsys.readouterr().out
    assert "imported 4" in out and "info:is_success (4)" in out


def _buffers(n, bad=None):
    """``n`` 3-step episodes; episode ``bad`` has a NaN observation at step 1."""
    out = []
    for i in range(n):
        obs = np.zeros((4, 2), np.float32)
        if i == bad:
            obs[1, 0] = np.nan
        out.append(EpisodeBuffer(observations=obs, actions=np.zeros((3, 1), np.float32), rewards=np.zeros(3),
                                 terminations=np.arange(3) == 2, truncations=np.zeros(3, bool)))
    return out


def _dataset(root, monkeypatch, dataset_id, buffers, action_space=gym.spaces.Box(-1, 1, (1,), np.float32)):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    with pytest.warns(UserWarning):  # Minari's missing-metadata nags
        minari.create_dataset_from_buffers(
            dataset_id, buffers, observation_space=gym.spaces.Box(-1, 1, (2,), np.float32), action_space=action_space,
        )


def test_a_failed_import_names_the_episode_and_what_it_left_imported(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    _dataset(root, monkeypatch, "nan/obs-v0", _buffers(3, bad=2))
    with pytest.raises(EpisodeValidationError, match=r"'nan/obs-v0', episode 2: .*contains NaN.*2 earlier episode\(s\) stay imported"):
        import_minari("nan/obs-v0", tmp_path / "store", minari_root=root, success_from="termination")
    assert len(Store.open(str(tmp_path / "store")).snapshot()) == 2


def test_an_import_refused_at_its_first_episode_leaves_no_store(tmp_path, monkeypatch):
    """A store created for an import and left empty would keep the refused dataset's schema."""
    root = tmp_path / "minari"
    _dataset(root, monkeypatch, "nan/first-v0", _buffers(2, bad=0))
    with pytest.raises(EpisodeValidationError, match=r"'nan/first-v0', episode 0: .*contains NaN.*nothing was imported"):
        import_minari("nan/first-v0", tmp_path / "store", minari_root=root, success_from="none")
    assert not (tmp_path / "store").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made for it stays, empty
    with pytest.raises(EpisodeValidationError):
        import_minari("nan/first-v0", tmp_path / "mine", minari_root=root, success_from="none")
    assert os.listdir(tmp_path / "mine") == []
    # text is not a reward: refused, not parsed ("1.0" -> 1.0) or a bare ValueError
    texts = [dataclasses.replace(b, rewards=np.array([b"1.0", b"0", b"x"])) for b in _buffers(2)]
    _dataset(root, monkeypatch, "text/reward-v0", texts)
    with pytest.raises(EpisodeValidationError, match=r"'text/reward-v0', episode 0: .*field 'reward': dtype \|S3, "
                                                     "expected numbers; nothing was imported"):
        import_minari("text/reward-v0", tmp_path / "store", minari_root=root, success_from="none")
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_two_imports_at_once_import_each_episode_once(tmp_path, monkeypatch):
    """Two imports of one dataset into different shards each found its episodes missing."""
    root, store = tmp_path / "minari", str(tmp_path / "store")
    _dataset(root, monkeypatch, "race/first-v0", _buffers(1))
    import_minari("race/first-v0", store, minari_root=root, success_from="none")
    _dataset(root, monkeypatch, "race/ep-v0", _buffers(6))
    held = os.open(store, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # both start while a third import holds the store
    procs, logs = [], []
    for client in ("a", "b"):
        logs.append(tmp_path / f"{client}.err")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "robo_post.cli", "store", "import-minari", "race/ep-v0", store, "--minari-root",
             str(root), "--client", client, "--success-from", "none"], stdout=subprocess.DEVNULL,
            stderr=open(logs[-1], "w"), env={**os.environ, "MINARI_DATASETS_PATH": str(root)}))
    deadline = time.monotonic() + 120
    while not all("waiting for another import" in log.read_text() for log in logs) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.close(held)
    assert [p.wait(timeout=120) for p in procs] == [0, 0], [log.read_text() for log in logs]
    sources = sorted(e.attrs["imported_from"]["episode"] for e in Store.open(store).snapshot()
                     if e.attrs["imported_from"]["dataset"] == "race/ep-v0")
    assert sources == list(range(6))


def test_skip_invalid_imports_the_other_episodes_and_names_the_skipped(tmp_path, monkeypatch, capsys):
    """An invalid episode in the dataset stopped every import at it, and the message promised a
    rerun would add the rest."""
    root, store = tmp_path / "minari", str(tmp_path / "store")
    _dataset(root, monkeypatch, "skip/ep-v0", _buffers(4, bad=1))
    args = ["store", "import-minari", "skip/ep-v0", store, "--minari-root", str(root), "--success-from", "none"]
    assert main(args) == 1
    assert "--skip-invalid to import the others" in capsys.readouterr().err
    assert main([*args, "--skip-invalid"]) == 0
    out, err = capsys.readouterr()
    assert "skipped invalid episode 1: invalid episode: field 'obs/observation' at step 1: contains NaN" in err
    assert "imported 2 episodes from skip/ep-v0" in out and "1 the store already held" in out and "1 invalid" in out
    assert sorted(e.attrs["imported_from"]["episode"] for e in Store.open(store).snapshot()) == [0, 2, 3]
    again = import_minari("skip/ep-v0", store, minari_root=root, success_from="none", skip_invalid=True)
    assert (again.imported, again.skipped, [i for i, _ in again.invalid]) == (0, 3, [1])


def test_importing_again_adds_only_the_episodes_the_store_lacks(tmp_path, monkeypatch, capsys):
    root, store = tmp_path / "minari", str(tmp_path / "store")
    _dataset(root, monkeypatch, "part/ep-v0", _buffers(4, bad=2))
    with pytest.raises(EpisodeValidationError, match="2 earlier episode\\(s\\) stay imported .* fix it and import again "
                                                     "\\(only the rest is added\\), or pass --skip-invalid"):
        import_minari("part/ep-v0", store, minari_root=root, success_from="none")
    shutil.rmtree(root / "part")  # the user repairs the dataset and imports it again
    _dataset(root, monkeypatch, "part/ep-v0", _buffers(4))
    done = import_minari("part/ep-v0", store, minari_root=root, success_from="none")
    assert (done.imported, done.skipped) == (2, 2)
    # Again, into another shard: the store holds all of it already.
    assert main(["store", "import-minari", "part/ep-v0", store, "--minari-root", str(root), "--client", "other",
                 "--success-from", "none"]) == 0
    assert "imported 0 episodes" in capsys.readouterr().out
    sources = [e.attrs["imported_from"]["episode"] for e in Store.open(store).snapshot()]
    assert sources == [0, 1, 2, 3]
    # under another success rule: the held episodes keep their labels, and the import says so
    assert main(["store", "import-minari", "part/ep-v0", store, "--minari-root", str(root),
                 "--success-from", "termination"]) == 0
    assert ("warning: 4 episodes of 'part/ep-v0' already in " in capsys.readouterr().err
            and {e.attrs["success_rule"] for e in Store.open(store).snapshot()} == {"none"})

    # The same id, other data: refused, not merged or skipped.
    shutil.rmtree(root / "part")
    changed = _buffers(4)
    changed[1].rewards[:] = 1.0
    _dataset(root, monkeypatch, "part/ep-v0", changed)
    with pytest.raises(StoreError, match=r"^Minari dataset 'part/ep-v0', episode 1: imported before as minari/1 with 3 "
                                         "steps and return 0, but .* return 3: the dataset changed"):
        import_minari("part/ep-v0", store, minari_root=root, success_from="none")
    assert len(Store.open(store).snapshot()) == 4


@pytest.mark.slow
def test_an_import_killed_part_way_completes_when_run_again(tmp_path, monkeypatch):
    root, store = tmp_path / "minari", str(tmp_path / "store")
    _dataset(root, monkeypatch, "kill/ep-v0", _buffers(6))
    # SIGKILL the importer right after its third episode is committed.
    script = (
        "import os, signal\n"
        "from robo_post.store.writer import ShardWriter\n"
        "from robo_post.cli import main\n"
        "write, n = ShardWriter.write_episode, [0]\n"
        "def killing(self, *a, **k):\n"
        "    out = write(self, *a, **k); n[0] += 1\n"
        "    if n[0] == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return out\n"
        "ShardWriter.write_episode = killing\n"
        f"main(['store', 'import-minari', 'kill/ep-v0', {store!r}, '--minari-root', {str(root)!r}, "
        "'--success-from', 'none'])\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    assert len(Store.open(store).snapshot()) == 3
    done = import_minari("kill/ep-v0", store, minari_root=root, success_from="none")
    assert (done.imported, done.skipped) == (3, 3)
    assert [e.attrs["imported_from"]["episode"] for e in Store.open(store).snapshot()] == list(range(6))
    assert main(["store", "validate", store]) == 0


@pytest.mark.slow
def test_an_export_killed_part_way_leaves_no_dataset(tmp_path, monkeypatch):
    """Minari writes in place: a killed export left a partial dataset that read as complete (221
    of 400 episodes imported without a word) and blocked the rerun as existing."""
    root, store = tmp_path / "minari", str(tmp_path / "store")
    _dataset(root, monkeypatch, "src/ep-v0", _buffers(6))
    import_minari("src/ep-v0", store, minari_root=root, success_from="none")
    script = (
        "import os, signal\n"
        "from minari.dataset.minari_dataset import MinariDataset\n"
        "from robo_post.cli import main\n"
        "update, n = MinariDataset.update_dataset_from_buffer, [0]\n"
        "def killing(self, *a, **k):\n"
        "    out = update(self, *a, **k); n[0] += 1\n"
        "    if n[0] == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return out\n"
        "MinariDataset.update_dataset_from_buffer = killing\n"
        f"main(['store', 'export-minari', {store!r}, 'out/ep-v0', '--minari-root', {str(root)!r}])\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    assert not (root / "out").exists()
    (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith("minari.export-")]  # the killed one's
    running = tmp_path / "minari.export-running"  # a live export's, held by its process
    running.mkdir()
    fd = os.open(running, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert main(["store", "export-minari", store, "out/ep-v0", "--minari-root", str(root)]) == 0
    finally:
        os.close(fd)
    assert len(minari.MinariDataset(str(root / "out" / "ep-v0" / "data"))) == 6
    assert sorted(os.listdir(root)) == ["out", "src"]
    assert not staging.exists() and running.exists()  # the rerun removed only the dead export's folder


def test_an_empty_or_damaged_dataset_is_refused_before_a_store_is_created(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    _dataset(root, monkeypatch, "empty/none-v0", [])
    with pytest.raises(StoreError, match="'empty/none-v0' at .* holds no episodes"):
        import_minari("empty/none-v0", tmp_path / "store", minari_root=root, success_from="none")
    _dataset(root, monkeypatch, "cut/short-v0", _buffers(2))
    (data,) = [f for f in (root / "cut" / "short-v0" / "data").iterdir() if f.name != "metadata.json"]
    os.truncate(data, 100)  # HDF5 raised a bare OSError
    with pytest.raises(StoreError, match="'cut/short-v0' at .* is unreadable"):
        import_minari("cut/short-v0", tmp_path / "store", minari_root=root, success_from="none")
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_cli_os_errors_are_one_line(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    _dataset(root, monkeypatch, "ok/two-v0", _buffers(2))
    (tmp_path / "file").write_text("not a directory")
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", "store", "import-minari", "ok/two-v0",
                        str(tmp_path / "file"), "--minari-root", str(root), "--success-from", "none"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"robo-post store: StoreError: {tmp_path / 'file'} is a file, not a robo-post store; "
                                "give a new or empty path")


def test_unbounded_actions_train_on_the_data_range_and_scalar_actions_are_refused(tmp_path, monkeypatch):
    root, rng = tmp_path / "minari", np.random.default_rng(0)
    buffers = [EpisodeBuffer(observations=rng.uniform(-1, 1, (9, 2)).astype(np.float32),
                             actions=np.stack([rng.uniform(-3, 5, 8), np.full(8, 2.0)], 1).astype(np.float32),
                             rewards=np.zeros(8), terminations=np.arange(8) == 7, truncations=np.zeros(8, bool))
               for _ in range(4)]
    _dataset(root, monkeypatch, "free/act-v0", buffers, gym.spaces.Box(-np.inf, np.inf, (2,), np.float32))
    store = str(tmp_path / "store")
    import_minari("free/act-v0", store, minari_root=root, success_from="termination")
    assert main(["train", f"store={store}", "algo=bc_flow", "updates=20", f"run_dir={tmp_path / 'run'}"]) == 0
    weights, config = PolicyRegistry(store).load(1)
    actions = np.concatenate([b.actions for b in buffers])
    # [-1, 1] maps onto the data's range; a constant dimension gets one unit either side
    assert np.allclose(config["model"]["action_low"], [actions[:, 0].min(), 1.0])
    assert np.allclose(config["model"]["action_high"], [actions[:, 0].max(), 3.0])
    assert all(torch.isfinite(w).all() for w in weights.values())

    scalar = EpisodeBuffer(observations=np.zeros((4, 2), np.float32), actions=np.zeros(3, np.float32),
                           rewards=np.zeros(3), terminations=np.arange(3) == 2, truncations=np.zeros(3, bool))
    _dataset(root, monkeypatch, "scalar/act-v0", [scalar], gym.spaces.Box(-1, 1, (), np.float32))
    with pytest.raises(UnsupportedSpaceError, match="'scalar/act-v0': .* is a scalar Box"):
        import_minari("scalar/act-v0", tmp_path / "other", minari_root=root, success_from="none")
    assert not (tmp_path / "other").exists()
