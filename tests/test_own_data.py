"""A user's own data: a Minari dataset recorded on a standard gymnasium MuJoCo env with no
robo-post code, imported with an explicit success rule, trained on (BC and a critic-based
method, no special flags) and evaluated by gymnasium id, all through the CLI."""

import json
import os

import gymnasium as gym
import minari
import numpy as np
import pytest

from robo_post.store import Store

from helpers import run_cli

ENV_ID = "InvertedPendulum-v5"


_cli = run_cli


def _record(minari_root: str) -> None:
    """What a user of Minari writes: a proportional controller with noise, plain DataCollector."""
    os.environ["MINARI_DATASETS_PATH"] = minari_root
    env = minari.DataCollector(gym.make(ENV_ID, max_episode_steps=60))
    rng = np.random.default_rng(0)
    for episode in range(8):
        obs, _ = env.reset(seed=episode)
        noise = 0.2 if episode % 2 else 2.0  # half good, half poor
        done = False
        while not done:
            action = np.clip(3.0 * obs[1] + 0.5 * obs[3] + noise * rng.normal(), -3.0, 3.0).astype(np.float32)
            obs, _, terminated, truncated, _ = env.step(action[None])
            done = terminated or truncated
    env.create_dataset("pendulum/mixed-v0", algorithm_name="p-controller", author="user")


@pytest.mark.slow
def test_minari_dataset_to_trained_policies_evaluated_by_gymnasium_id(tmp_path, monkeypatch):
    minari_root = str(tmp_path / "minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", minari_root)
    _record(minari_root)
    store = str(tmp_path / "store")

    # Foreign data: the success rule must be given; guessing is refused.
    r = _cli("store", "import-minari", "pendulum/mixed-v0", store, "--minari-root", minari_root, ok=False)
    assert r.returncode != 0 and "--success-from" in r.stderr and "Traceback" not in r.stderr
    _cli("store", "import-minari", "pendulum/mixed-v0", store, "--minari-root", minari_root,
         "--success-from", "truncation")  # the pendulum falls = termination; surviving to the limit = success
    assert Store.open(store).schema.attrs["env"] == ENV_ID  # the dataset's env, found by id at eval
    info = json.loads(_cli("store", "info", store, "--json").stdout)
    assert info["episodes"] == 8 and 0 < info["success_rate"] < 1

    common = ["show=false", "batch_size=16", "log_every=5", "updates=10", "model.hidden_dim=32", "model.embed_dim=16"]
    _cli("train", f"store={store}", "algo=bc_flow", f"run_dir={tmp_path / 'bc'}", *common)
    bc = json.load(open(tmp_path / "bc" / "summary.json"))
    assert bc["episodes"] == info["tasks"][next(iter(info["tasks"]))]["episodes"] * info["success_rate"]
    _cli("train", f"store={store}", "algo=divl_qam", f"run_dir={tmp_path / 'divl'}", *common)
    divl = json.load(open(tmp_path / "divl" / "summary.json"))
    # failures teach the critic too; it starts from BC on those same 8 episodes, trained first (v2)
    assert divl["episodes"] == 8 and (divl["parent_version"], divl["version"]) == (2, 3)
    reference = json.load(open(tmp_path / "divl" / "reference" / "summary.json"))
    assert (reference["algo"], reference["version"], reference["episodes"]) == ("bc_flow", 2, 8)
    # Rewards of 1 per step: the value support comes from the data, not the [0, 1] success default.
    assert divl["value_range"][1] > 5.0

    for version in (1, 3):
        _cli("eval", f"store={store}", f"version={version}", "episodes_per_task=2", "n_clients=1",
             "show=false", "+env_kwargs.max_episode_steps=60")
    results = [json.load(open(os.path.join(store + "-eval", "evals", f)))
               for f in sorted(os.listdir(os.path.join(store + "-eval", "evals")))]
    assert sorted(r["policy"]["version"] for r in results) == [1, 3]
    for r in results:
        stats = r["tasks"][ENV_ID]
        assert stats["episodes"] == 2 and stats["mean_return"] > 0 and len(stats["return_ci95"]) == 2


@pytest.mark.parametrize("rule, expected", [("termination", 4), ("return>=59", 4), ("none", None)])
def test_the_success_rule_decides_what_bc_trains_on(tmp_path, monkeypatch, rule, expected):
    minari_root = str(tmp_path / "minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", minari_root)
    _record(minari_root)
    store = str(tmp_path / "store")
    _cli("store", "import-minari", "pendulum/mixed-v0", store, "--minari-root", minari_root, "--success-from", rule)
    episodes = Store.open(store).snapshot().episodes()
    successes = [e.success for e in episodes]
    if expected is None:
        assert successes == [None] * 8
    else:
        assert all(e.attrs["success_rule"] == rule for e in episodes)
        assert sum(bool(s) for s in successes) + sum(s is False for s in successes) == 8
