"""`robo-post train algo=craft` end to end: heuristic demos -> pretraining -> on-policy iteration through the fleet."""

import json

import numpy as np
import pytest
import torch

from robo_post.algos.craft import CraftConfig, group_advantages
from robo_post.learner.craft_driver import on_policy_batch, proxy_oracle_correlation
from robo_post.models.candidate_policy import CandidatePolicy
from robo_post.store.registry import PolicyRegistry
from robo_post.store.store import Store
from tests.helpers import run_cli


def summary_of(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{\n"):])  # after the progress lines


@pytest.fixture(scope="module")
def craft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("craft")
    store = str(root / "demos")
    run_cli("collect", "env=highway_meta", "policy=expert", "episodes=2", f"store={store}", "fleet.n_clients=1",
            "+env.kwargs.vehicles_count=8", "+env.kwargs.duration=12", "show=false")
    args = ["train", "algo=craft", f"store={store}", f"run_dir={root / 'run'}", "algo.iterations=1",
            "algo.episodes_per_iteration=2", "algo.n_clients=1", "algo.bc_updates=100", "algo.oracle=true",
            "+algo.env_kwargs.vehicles_count=8", "+algo.env_kwargs.duration=12", "show=false"]
    summary = summary_of(run_cli(*args).stdout)
    return store, summary, args


def test_the_fleet_records_what_the_update_needs_and_acts_on_policy(craft_run):
    store, summary, _ = craft_run
    registry = PolicyRegistry(store)
    assert registry.load(summary["pretrained_version"])[1]["kind"] == "candidate"
    weights, config = registry.load(2)  # the version the fleet sampled from in iteration 1
    assert config["phase"] == "online" and config["deterministic"] is False
    snap = Store.open(summary["online_store"]).snapshot(record=False)
    episodes = snap.episodes(policy_version=2)
    assert len(episodes) == 2 and all(e.role == "online" for e in episodes)
    data = snap.load(episodes[0])
    ex = data["extras"]
    assert set(ex) == {"logits", "chosen", "proxy_scores", "oracle_scores", "events"}
    vocabulary = config["model"]["candidates"]
    # the executed action is the first meta-action of the recorded choice...
    assert all(int(a) == vocabulary[int(k)][0] for a, k in zip(data["action"], ex["chosen"]))
    # ...and the recorded logits are the acting version's, at the recorded observations (on-policy)
    policy = CandidatePolicy.from_artifact(weights, config)
    with torch.no_grad():
        logits = policy.logits({k: torch.as_tensor(v[:-1]) for k, v in data["obs"].items()})
    assert np.allclose(logits.numpy(), ex["logits"], atol=1e-5)
    assert ex["events"].shape == (len(data["action"]), 3) and set(np.unique(ex["events"][:, :2])) <= {0.0, 1.0}
    assert np.isfinite(ex["proxy_scores"]).all() and np.isfinite(ex["oracle_scores"]).all()
    final = registry.load(summary["version"])[1]
    assert final["phase"] == "final" and final["deterministic"] is True and final["env_extras"] is False


def test_a_finished_run_is_not_trained_again(craft_run):
    store, summary, args = craft_run
    again = summary_of(run_cli(*args).stdout)
    snap = Store.open(summary["online_store"]).snapshot(record=False)
    assert len(list(snap.episodes())) == 2  # no new on-policy episodes
    assert again == summary and PolicyRegistry(store).versions() == [1, 2, 3]  # nothing published again


def test_on_policy_batch_windows_stop_at_episode_ends():
    config = CraftConfig(window=3, gamma_event=0.5, residual_mode="event")
    k = 4
    extras = {"proxy_scores": np.tile(np.arange(k, dtype=np.float32), (5, 1)), "chosen": np.zeros(5, np.int64),
              "logits": np.zeros((5, k), np.float32),
              # a crash ends episode 1; progress is paid on every step
              "events": np.array([[0, 0, 1], [0, 0, 1], [1, 0, 0], [0, 0, 1], [0, 0, 0.5]], np.float32)}
    obs = {"state": np.zeros((5, 3), np.float32)}
    batch = on_policy_batch(config, obs, extras, [3, 2], np.array([-1.0, -0.3, 0.0]))
    assert torch.allclose(batch["proxy_adv"], group_advantages(torch.as_tensor(extras["proxy_scores"])))
    # event mode: only the steps whose window (inside their own episode) saw the crash carry a residual
    assert (batch["delta"][:3] != 0).all() and (batch["delta"][3:] == 0).all()
    # a weighted progress entry changes the returns but marks no window: still only the crash's
    paid = on_policy_batch(config, obs, extras, [3, 2], np.array([-1.0, -0.3, 0.4]))
    assert (paid["delta"][:3] != 0).all() and (paid["delta"][3:] == 0).all()
    assert not torch.allclose(paid["delta"][:3], batch["delta"][:3])
    # cv mode: z(G) over the batch, with G = sum_{j<3} 0.5^j r_{t+j} inside each episode
    cv = on_policy_batch(CraftConfig(window=3, gamma_event=0.5), obs, extras, [3, 2], np.array([-1.0, -0.3, 0.4]))
    G = torch.tensor([0.4 + 0.2 - 0.25, 0.4 - 0.5, -1.0, 0.4 + 0.1, 0.2])
    z = (G - G.mean()) / G.std(unbiased=False)
    assert torch.allclose(cv["delta"], z - batch["proxy_adv"][:, 0], atol=1e-4)


def test_proxy_oracle_correlation_of_group_advantages():
    proxy = np.array([[0.0, 1.0, 3.0], [2.0, 2.0, 2.0], [1.0, 0.0, 0.0]], np.float32)
    # an affine map per state keeps the direction (1); a reversed ranking flips it (-1); the
    # constant second state has no direction and is left out of the mean
    same = {"proxy_scores": proxy, "oracle_scores": 2.0 * proxy + 5.0}
    assert proxy_oracle_correlation(same) == pytest.approx(1.0, abs=1e-4)
    assert proxy_oracle_correlation({"proxy_scores": proxy, "oracle_scores": -proxy}) == pytest.approx(-1.0, abs=1e-4)
    half = {"proxy_scores": proxy, "oracle_scores": np.stack([proxy[0], proxy[1], -proxy[2]])}
    assert proxy_oracle_correlation(half) == pytest.approx(0.0, abs=1e-4)
    assert proxy_oracle_correlation({"proxy_scores": proxy}) is None
    assert proxy_oracle_correlation({"proxy_scores": proxy[1:2], "oracle_scores": proxy[1:2]}) is None


def test_run_recipe_craft_on_highway(tmp_path):
    out = tmp_path / "run"
    summary = summary_of(run_cli("run", "env=highway_meta", "recipe=craft", f"run_dir={out}", "demos.episodes=2",
                                 "bc.algo.iterations=1", "bc.algo.episodes_per_iteration=2", "bc.algo.bc_updates=50",
                                 "bc.algo.n_clients=1", "eval.episodes_per_task=2", "fleet.n_clients=1",
                                 "show=false", timeout=600).stdout)
    # pretrained, the sampled version of the one iteration, the greedy final one: each evaluated
    assert [r["version"] for r in summary["results"]] == [1, 2, 3]
    assert (out / "report" / "index.html").exists() and (out / "bc" / "metrics.jsonl").exists()
    assert json.loads((out / "bc" / "metrics.jsonl").read_text().splitlines()[-1])["update"] > 0


def test_bad_craft_settings_are_one_line_errors_before_any_work(craft_run, tmp_path):
    store, _, _ = craft_run
    bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "algo.event_weights=[1]",
                  "show=false", ok=False)
    assert bad.returncode == 1 and "has 1 weights; env 'highway_meta' reports 3 events" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "r").exists()
    assert len(PolicyRegistry(store).versions()) == 3  # nothing published
