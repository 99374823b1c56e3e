"""Experiment tracking: TensorBoard event files hold every metric of every logged row (off_policy and
sb3 drivers), the flag turns them off, a resumed run hides the interrupted run's later points, and an
enabled tracker that is not installed stops the run before it trains."""

import json
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from robo_post.config import compose
from robo_post.learner.tracking import Tracker, TrackingError, scalars
from robo_post.learner.train import train
from robo_post.store import ArraySpec, Store, StoreSchema


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracking") / "store"
    schema = StoreSchema({"state": ArraySpec("float32", (3,))}, ArraySpec("float32", (2,), -1.0, 1.0))
    store = Store.create(str(root), schema)
    rng = np.random.default_rng(0)
    with store.writer("demo-0") as w:
        for i in range(4):
            T = 10
            w.write_episode({"state": rng.normal(size=(T + 1, 3)).astype(np.float32)},
                            rng.uniform(-1, 1, (T, 2)).astype(np.float32), rewards=np.eye(T)[-1],
                            terminated=np.arange(T) == T - 1, success=True, role="demo")
    return str(root)


def _cfg(store, run_dir, updates=4, **extra):
    cfg = OmegaConf.merge(compose("train", ["algo=bc_flow"]), {
        "store": store, "run_dir": run_dir, "updates": updates, "batch_size": 8, "log_every": 2,
        "checkpoint_every": 100, "show": False, "device": "cpu", "publish": False, "prefetch": 0,
        "model": {"hidden_dim": 16, "embed_dim": 8, "flow_steps": 2, "horizon": 3, "execute_steps": 1},
    })
    OmegaConf.set_struct(cfg, False)
    return OmegaConf.merge(cfg, extra)


def _events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_event_files_hold_every_metric_of_each_row(store, tmp_path):
    train(_cfg(store, str(tmp_path)))
    rows, acc = _rows(tmp_path), _events(tmp_path)
    assert [r["update"] for r in rows] == [2, 4]
    tags = set(acc.Tags()["scalars"])
    assert tags == set(scalars(rows[0])) and {"bc_loss", "updates_per_s", "data_wait"} <= tags
    assert not tags & {"update", "time"}
    for tag in tags:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [2, 4]
        assert [e.value for e in events] == pytest.approx([r[tag] for r in rows], rel=1e-6)
        assert [e.wall_time for e in events] == pytest.approx([r["time"] for r in rows])


def test_the_flag_turns_event_files_off(store, tmp_path):
    train(_cfg(store, str(tmp_path), tracking={"tensorboard": False}))
    assert len(_rows(tmp_path)) == 2
    assert not (tmp_path / "tensorboard").exists()


def test_a_resumed_tracker_hides_the_interrupted_runs_later_points(tmp_path):
    with Tracker(str(tmp_path)) as tracker:  # logged up to step 3, checkpointed at 2, then killed
        for step in (1, 2, 3):
            tracker.log({"update": step, "time": 100.0 + step, "loss": float(step)})
    with Tracker(str(tmp_path), start=2) as tracker:
        tracker.log({"update": 3, "time": 200.0, "loss": 30.0, "label": "not a number"})
    events = _events(tmp_path).Scalars("loss")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 30.0)]



def test_a_restarted_tracker_hides_the_points_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    with Tracker(str(tmp_path)) as tracker:  # logged steps 1-2, killed before any checkpoint
        for step in (1, 2):
            tracker.log({"update": step, "time": 100.0 + step, "loss": float(step)})
    with Tracker(str(tmp_path), start=0) as tracker:
        tracker.log({"update": 1, "time": 200.0, "loss": 10.0})
    assert [(e.step, e.value) for e in _events(tmp_path).Scalars("loss")] == [(1, 10.0)]

@pytest.mark.parametrize("name, options", [("wandb", {"project": "robo-post"}), ("mlflow", {"experiment": "x"})])
def test_an_enabled_tracker_that_is_not_installed_fails_before_training(store, tmp_path, monkeypatch, name, options):
    monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError, installed or not
    with pytest.raises(TrackingError, match=f"tracking.{name} is enabled but {name} is not installed"):
        train(_cfg(store, str(tmp_path / "run"), tracking={name: options}))
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_unknown_tracking_settings_are_named(store, tmp_path):
    with pytest.raises(TrackingError, match="tensorbord"):
        train(_cfg(store, str(tmp_path / "run"), tracking={"tensorbord": False}))
    with pytest.raises(TrackingError, match="experimnt"):
        Tracker(str(tmp_path), {"mlflow": {"experimnt": "x"}})


def test_the_sb3_drivers_rows_reach_tensorboard(tmp_path):
    cfg = OmegaConf.merge(compose("train", ["algo=sb3"]), {
        "store": str(tmp_path / "store"), "run_dir": str(tmp_path / "run"), "show": False, "device": "cpu",
        "publish": False})
    OmegaConf.set_struct(cfg, False)
    cfg = OmegaConf.merge(cfg, {"algo": {"env": "CartPole-v1", "timesteps": 256, "hyperparameters": {"n_steps": 128}}})
    train(cfg)
    rows, acc = _rows(tmp_path / "run"), _events(tmp_path / "run")
    assert [r["update"] for r in rows] == [128, 256]
    assert set(acc.Tags()["scalars"]) == set(scalars(rows[-1])) and "steps_per_s" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("steps_per_s")] == [128, 256]
