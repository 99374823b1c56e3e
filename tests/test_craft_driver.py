"""`robo-post train algo=craft` end to end: heuristic demos -> pretraining -> on-policy iteration through the fleet."""

import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from robo_post.algos.craft import CraftConfig, CraftConfigError, group_advantages
from robo_post.learner.craft_driver import on_policy_batch, proxy_oracle_correlation
from robo_post.models.candidate_policy import CandidatePolicy
from robo_post.store.registry import PolicyRegistry
from robo_post.store.store import Store
from tests.helpers import run_cli, summary_of


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


@pytest.mark.slow
@pytest.mark.fleet
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
    assert ex["events"].shape == (len(data["action"]), 5) and set(np.unique(ex["events"][:, :2])) <= {0.0, 1.0}
    assert np.isfinite(ex["proxy_scores"]).all() and np.isfinite(ex["oracle_scores"]).all()
    final = registry.load(summary["version"])[1]
    assert final["phase"] == "final" and final["deterministic"] is True and final["env_extras"] is False


@pytest.mark.slow
@pytest.mark.fleet
def test_a_finished_run_is_not_trained_again(craft_run):
    store, summary, args = craft_run
    again = summary_of(run_cli(*args).stdout)
    snap = Store.open(summary["online_store"]).snapshot(record=False)
    assert len(list(snap.episodes())) == 2  # no new on-policy episodes
    assert again == summary and PolicyRegistry(store).versions() == [1, 2, 3]  # nothing published again


@pytest.mark.slow
@pytest.mark.fleet
def test_a_run_is_resumed_only_under_its_own_settings_and_budget(craft_run, tmp_path):
    """Resumed with another store=, a run went on training the first store's policy and published
    into the second store's registry as the child of an unrelated version."""
    from omegaconf import OmegaConf

    from robo_post.learner.runs import RunResumeError, check_resume

    run_dir = craft_run[2][3].split("=", 1)[1]
    cfg = OmegaConf.load(os.path.join(run_dir, "config.yaml"))
    check_resume(run_dir, cfg, "iteration", 1, "algo.iterations")
    with pytest.raises(RunResumeError, match="has already trained iteration 1, more than algo.iterations=0"):
        check_resume(run_dir, cfg, "iteration", 0, "algo.iterations")
    cfg.algo.iterations = 2  # unfinished now: a larger budget, where and how fast it runs may change
    cfg.device, cfg.torch_threads = "cpu", 2
    check_resume(run_dir, cfg, "iteration", 2, "algo.iterations")
    for key, value in (("store", str(tmp_path / "other")), ("algo.lr", 0.5)):
        changed = cfg.copy()
        OmegaConf.update(changed, key, value)
        with pytest.raises(RunResumeError, match=rf"holds a run finished at iteration 1 \(its algo.iterations\), started "
                                                 rf"with other settings "
                                                 rf"\({key}: .* -> {value!r}\)"):
            check_resume(run_dir, changed, "iteration", 2, "algo.iterations")
    # through the CLI: refused before anything is trained or published
    store = craft_run[0]
    versions = PolicyRegistry(store).versions()
    args = [a for a in craft_run[2] if not a.startswith("algo.iterations=")] + ["algo.iterations=2", "algo.lr=0.5"]
    r = run_cli(*args, ok=False)
    assert r.returncode != 0 and "started with other settings (algo.lr: 0.0003 -> 0.5)" in r.stderr, r.stderr
    assert PolicyRegistry(store).versions() == versions


@pytest.mark.slow
@pytest.mark.fleet
def test_a_run_that_stopped_early_is_not_taken_for_finished(craft_run, tmp_path):
    store, summary, args = craft_run
    run_dir = tmp_path / "run"
    shutil.copytree(args[3].split("=", 1)[1], run_dir)  # a finished run, summary.json included
    # the same run re-pointed at a store of another schema fails before it writes anything (it failed after
    # writing its config.yaml, which beside the old summary.json then read as a finished run)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    failing = [*args[:3], f"run_dir={run_dir}", *args[4:], f"algo.online_store={store}"]
    for _ in range(2):  # and fails again
        r = run_cli(*failing, ok=False)
        assert r.returncode != 0 and "different schema" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    assert PolicyRegistry(store).versions()[-1] == summary["version"]  # nothing published


@pytest.mark.slow
@pytest.mark.fleet
def test_a_kill_between_checkpoint_and_state_file_resumes_without_a_second_update(craft_run, tmp_path):
    store, summary, args = craft_run
    root = os.path.dirname(store)
    for name in ("demos", "demos-online", "run"):
        shutil.copytree(os.path.join(root, name), tmp_path / name)
    run_dir, own = tmp_path / "run", str(tmp_path / "demos")
    moved = [a.replace(f"store={store}", f"store={own}").replace(f"run_dir={root}/run", f"run_dir={run_dir}")
             for a in args]
    # the state the driver wrote before the iteration: the update's checkpoint landed, the state file did not
    (run_dir / "summary.json").unlink()
    (run_dir / "craft_state.json").write_text(json.dumps(
        {"iteration": 0, "pretrained_version": summary["pretrained_version"], "acting_version": 2}))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"update": 99, "iter')  # a row the kill cut short
    again = summary_of(run_cli(*moved).stdout)
    assert len(list(Store.open(f"{own}-online").snapshot(record=False).episodes())) == 2  # no new episodes
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["iteration"] == 1
    registry = PolicyRegistry(own)
    assert again["version"] == 4 and registry.versions() == [1, 2, 3, 4]
    before, after = registry.load(summary["version"])[0], registry.load(again["version"])[0]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)  # not updated twice

    (run_dir / "summary.json").unlink()
    (run_dir / "craft_state.json").write_text('{"iteration": ')  # a file truncated by hand
    bad = run_cli(*moved, ok=False)
    assert bad.returncode == 1 and "craft_state.json is unreadable" in bad.stderr and "Traceback" not in bad.stderr
    (run_dir / "craft_state.json").write_text('{"iteration": 1, "pretrained_version": "1"}')  # edited by hand
    bad = run_cli(*moved, ok=False)
    assert bad.returncode == 1 and "pretrained_version is '1', not an integer" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and registry.versions() == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.fleet
def test_a_kill_right_after_publishing_the_acting_version_does_not_publish_it_again(craft_run, tmp_path):
    store, summary, args = craft_run
    own, run_dir = tmp_path / "demos", tmp_path / "run"
    shutil.copytree(store, own)
    for v in PolicyRegistry(str(own)).versions()[1:]:  # keep the pretrained version only
        shutil.rmtree(own / "policies" / f"v{v:06d}")
    run_dir.mkdir()
    (run_dir / "craft_state.json").write_text(json.dumps({"iteration": 0, "pretrained_version": 1}))
    moved = [a.replace(f"store={store}", f"store={own}").replace(f"run_dir={os.path.dirname(store)}/run",
                                                                   f"run_dir={run_dir}") for a in args]
    # the driver dies by SIGKILL at the write that would record the version it has just published
    kill_at_record = (
        "import os, signal, sys\n"
        "import robo_post.learner.craft_driver as d\n"
        "write = d.write_json_atomic\n"
        "def dying(path, obj, **kw):\n"
        "    if 'acting_version' in obj:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    write(path, obj, **kw)\n"
        "d.write_json_atomic = dying\n"
        "from robo_post.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    killed = subprocess.run([sys.executable, "-c", kill_at_record, *moved], capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    registry = PolicyRegistry(str(own))
    assert registry.versions() == [1, 2] and json.loads((run_dir / "craft_state.json").read_text()) == {
        "iteration": 0, "pretrained_version": 1}
    r = run_cli(*moved)
    again = summary_of(r.stdout)
    assert f"resuming {run_dir} at iteration 0 of 1" in r.stderr
    assert registry.versions() == [1, 2, 3] and again["version"] == 3  # version 2 acted, not a copy of it
    snap = Store.open(f"{own}-online").snapshot(record=False)
    assert [e.policy_version for e in snap.episodes()] == [2, 2]


def test_on_policy_batch_windows_stop_at_episode_ends():
    config = CraftConfig(window=3, gamma_event=0.5, residual_mode="event")
    k = 4
    extras = {"proxy_scores": np.tile(np.arange(k, dtype=np.float32), (5, 1)), "chosen": np.zeros(5, np.int64),
              "logits": np.zeros((5, k), np.float32),
              # a crash ends episode 1; progress is paid on every step
              "events": np.array([[0, 0, 1], [0, 0, 1], [1, 0, 0], [0, 0, 1], [0, 0, 0.5]], np.float32)}
    obs = {"state": np.zeros((5, 3), np.float32)}
    batch, stats = on_policy_batch(config, obs, extras, [3, 2], np.array([-1.0, -0.3, 0.0]))
    assert stats == {} and "event_return" not in batch  # the default batch-mean baseline: no critic
    assert torch.allclose(batch["proxy_adv"], group_advantages(torch.as_tensor(extras["proxy_scores"])))
    # event mode: only the steps whose window (inside their own episode) saw the crash carry a residual
    assert (batch["delta"][:3] != 0).all() and (batch["delta"][3:] == 0).all()
    # a weighted progress entry changes the returns but marks no window: still only the crash's
    paid, _ = on_policy_batch(config, obs, extras, [3, 2], np.array([-1.0, -0.3, 0.4]))
    assert (paid["delta"][:3] != 0).all() and (paid["delta"][3:] == 0).all()
    assert not torch.allclose(paid["delta"][:3], batch["delta"][:3])
    # cv mode: z(G) over the batch, with G = sum_{j<3} 0.5^j r_{t+j} inside each episode
    cv, _ = on_policy_batch(CraftConfig(window=3, gamma_event=0.5), obs, extras, [3, 2], np.array([-1.0, -0.3, 0.4]))
    G = torch.tensor([0.4 + 0.2 - 0.25, 0.4 - 0.5, -1.0, 0.4 + 0.1, 0.2])
    z = (G - G.mean()) / G.std(unbiased=False)
    assert torch.allclose(cv["delta"], z - batch["proxy_adv"][:, 0], atol=1e-4)
    # residual only (no proxy term): nothing to correct, the residual is z(G) itself
    alone, _ = on_policy_batch(CraftConfig(window=3, gamma_event=0.5, use_proxy=False), obs, extras, [3, 2],
                               np.array([-1.0, -0.3, 0.4]))
    assert torch.allclose(alone["delta"], z, atol=1e-4)


def test_the_floor_margin_marks_the_states_where_the_proxy_sees_trouble_ahead():
    """``floor_margin``: the floor applies where the proxy's best candidate beats the acting
    policy's first choice by more than the margin (proxy units), not where it is only faster."""
    extras = {"proxy_scores": np.array([[0.0, 2.0, 0.5], [0.0, 0.5, 0.2], [-3.0, 0.0, 0.1]], np.float32),
              "logits": np.array([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0], [5.0, 0.0, 0.0]], np.float32),
              "chosen": np.zeros(3, np.int64), "events": np.zeros((3, 3), np.float32)}
    obs, weights = {"state": np.zeros((3, 2), np.float32)}, np.array([-1.0, -0.3, 0.0])
    config = CraftConfig(proxy_weight="floor", floor_margin=1.3)
    batch, stats = on_policy_batch(config, obs, extras, [3], weights)
    assert batch["floored"].tolist() == [True, False, True] and stats == {"floored": pytest.approx(2 / 3)}
    plain, stats = on_policy_batch(CraftConfig(proxy_weight="floor"), obs, extras, [3], weights)
    assert "floored" not in plain and stats == {}


def test_evpo_on_policy_batch_gates_on_the_critic_values_at_the_batch_states():
    k, weights = 4, np.array([-1.0, -0.3, 0.4])
    extras = {"proxy_scores": np.random.default_rng(0).normal(size=(5, k)).astype(np.float32),
              "chosen": np.array([0, 1, 2, 3, 0]), "logits": np.zeros((5, k), np.float32),
              "events": np.array([[0, 0, 1], [0, 0, 1], [1, 0, 0], [0, 0, 1], [0, 0, 0.5]], np.float32)}
    obs = {"state": np.arange(15, dtype=np.float32).reshape(5, 3)}
    G = torch.tensor([0.4 + 0.2 - 0.25, 0.4 - 0.5, -1.0, 0.4 + 0.1, 0.2])  # window 3, gamma 0.5 (see above)
    noise = torch.tensor([0.1, -0.1, 0.1, -0.1, 0.0])
    seen = []

    def critic(values):
        def value_fn(batch_obs):
            seen.append(batch_obs["state"])
            return values
        return value_fn

    evpo = CraftConfig(window=3, gamma_event=0.5, baseline="evpo")
    default, _ = on_policy_batch(CraftConfig(window=3, gamma_event=0.5), obs, extras, [3, 2], weights)
    executed = default["proxy_adv"].gather(-1, default["chosen"][:, None])[:, 0]
    # a good critic (EV = 1 - Var(noise) / Var(G)): G - V, scaled by its std, replaces z(G)
    good, stats = on_policy_batch(evpo, obs, extras, [3, 2], weights, critic(G + noise))
    ev = 1 - float(noise.var(unbiased=False) / G.var(unbiased=False))
    assert stats["evpo_gate"] == 1 and stats["evpo_ev"] == pytest.approx(ev, abs=1e-5) and ev > 0.9
    assert torch.equal(seen[0], torch.as_tensor(obs["state"]))  # the critic saw the batch's states
    assert torch.allclose(good["event_return"], G, atol=1e-6)
    assert torch.allclose(good["delta"], -noise / (noise.std(unbiased=False) + 1e-5) - executed, atol=1e-4)
    # a critic worse than the batch mean (EV = 1 - Var(2G) / Var(G) = -3): the default residual, bit for bit
    bad, stats = on_policy_batch(evpo, obs, extras, [3, 2], weights, critic(-G))
    assert stats["evpo_gate"] == 0 and stats["evpo_ev"] == pytest.approx(-3.0, abs=1e-4)
    assert torch.equal(bad["delta"], default["delta"])
    # all event returns equal: EV undefined (null in the metrics), the batch mean, zero residuals in event mode
    quiet = dict(extras, events=np.zeros((5, 3), np.float32))
    flat, stats = on_policy_batch(CraftConfig(baseline="evpo", residual_mode="event"), obs, quiet, [3, 2], weights,
                                  critic(torch.randn(5)))
    assert stats == {"evpo_ev": None, "evpo_gate": 0} and torch.equal(flat["delta"], torch.zeros(5))
    with pytest.raises(CraftConfigError, match="critic"):
        on_policy_batch(evpo, obs, extras, [3, 2], weights)


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


@pytest.mark.slow
@pytest.mark.fleet
def test_run_recipe_craft_on_highway_finishes_after_a_kill(tmp_path):
    out = tmp_path / "run"
    args = ["run", "env=highway_meta", "recipe=craft", f"run_dir={out}", "demos.episodes=2", "bc.algo.iterations=2",
            "bc.algo.episodes_per_iteration=2", "bc.algo.bc_updates=50", "bc.algo.n_clients=1",
            "eval.episodes_per_task=2", "fleet.n_clients=1", "show=false"]
    metrics = out / "bc" / "metrics.jsonl"
    first = subprocess.Popen([sys.executable, "-m", "robo_post.cli", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # only turns a hang into a failure
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and first.poll() is None:
        assert time.monotonic() < deadline, "no CRAFT iteration finished"
        time.sleep(0.05)
    first.kill()  # mid-run: after iteration 1, before the final version
    assert first.wait() != 0, "the run finished before it could be killed"
    summary = summary_of(run_cli(*args, timeout=600).stdout)
    # the rerun finished the CRAFT stage instead of taking its published versions for a finished stage:
    # pretrained, the sampled versions of the two iterations, the greedy final one, each evaluated
    assert [r["version"] for r in summary["results"]] == [1, 2, 3, 4]
    assert json.loads((out / "bc" / "summary.json").read_text())["version"] == 4
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2] and rows[-1]["update"] > rows[0]["update"] > 0
    assert (out / "report" / "index.html").exists()
    # CRAFT's learning rate, not the flow-BC one run.yaml gives its first stage
    assert "lr: 0.0003" in (out / "bc" / "config.yaml").read_text()


@pytest.mark.slow
def test_bad_craft_settings_are_one_line_errors_before_any_work(craft_run, tmp_path):
    store, _, _ = craft_run
    bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "algo.event_weights=[1]",
                  "show=false", ok=False)
    assert bad.returncode == 1 and "has 1 weights; env 'highway_meta' reports 5 events" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "r").exists()
    bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "algo.baseline=foo",
                  "show=false", ok=False)
    assert bad.returncode == 1 and "baseline='foo'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr and not (tmp_path / "r").exists()
    # kwargs that change what the env observes: named up front (the clients failed after pretraining published)
    bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "+algo.env_kwargs.lane_features=true",
                  f"algo.online_store={tmp_path / 'online'}", "show=false", ok=False)
    # the recorded kwargs with the given one on top
    assert bad.returncode == 1 and ("EnvMismatchError: env 'highway_meta' with kwargs {'duration': 12, 'vehicles_count': "
                                    "8, 'lane_features': True}") in bad.stderr
    assert "give algo.env_kwargs the kwargs they were collected with" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "online").exists()
    # another env than the store's: it failed deep in pretraining, after creating an online store of the
    # other env's schema that then blocked every correct run on this store
    bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "algo.env=driving",
                  f"algo.online_store={tmp_path / 'online'}", "show=false", ok=False)
    assert bad.returncode == 1 and "was recorded in env 'highway_meta'" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "r").exists() and not (tmp_path / "online").exists()
    # a pinned snapshot is the one pretraining learns from: an unknown one is refused
    bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "data.snapshot=snap-nope",
                  "show=false", ok=False)
    assert bad.returncode == 1 and "snap-nope" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    # another CRAFT run recording into the same online store: its clients died on the shard locks and
    # this one failed with an IndexError after pretraining had published
    online = tmp_path / "busy-online"
    (online / "fleet").mkdir(parents=True)
    fd = os.open(online / "fleet" / ".collect-craft.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", f"algo.online_store={online}",
                      "show=false", ok=False)
    finally:
        os.close(fd)
    assert bad.returncode == 1 and "ShardLockedError: another CRAFT run records into the online store" in bad.stderr
    assert "give this run its own algo.online_store=PATH" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "r").exists()
    assert len(PolicyRegistry(store).versions()) == 3  # nothing published


@pytest.mark.slow
@pytest.mark.fleet
def test_evpo_run_logs_the_gate_and_checkpoints_the_critic(craft_run, tmp_path):
    store, summary, _ = craft_run
    own = str(tmp_path / "demos")
    shutil.copytree(store, own)  # the fixture's store keeps its three versions
    out = summary_of(run_cli("train", "algo=craft", f"store={own}", f"run_dir={tmp_path / 'run'}",
                             f"algo.reference_version={summary['pretrained_version']}", "algo.baseline=evpo",
                             "algo.iterations=1", "algo.episodes_per_iteration=3", "algo.n_clients=2",
                             f"algo.online_store={tmp_path / 'online'}", "+algo.env_kwargs.vehicles_count=8",
                             "+algo.env_kwargs.duration=12", "show=false",
                             # the guard on every state whose choice is not the proxy's best
                             "algo.guard_weight=1", "algo.guard_margin=0", "algo.guard_danger=100",
                             "algo.veto_updates=5", "algo.veto_danger=100", "algo.veto_margin=0").stdout)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and out["final"] == rows[0]
    snap = Store.open(str(tmp_path / "online")).snapshot(record=False)
    extras = [snap.load(e)["extras"] for e in snap.episodes()]
    scores, logits = (np.concatenate([x[k] for x in extras]) for k in ("proxy_scores", "logits"))
    first = np.take_along_axis(scores, logits.argmax(-1)[:, None], -1)[:, 0]
    assert rows[0]["guard_critical"] == int((scores.max(-1) > first).sum()) > 0
    assert rows[0]["guard_loss"] > 0
    # the last fit: every state recorded, those with a candidate below the best vetoed; the final
    # version is the fitted copy, the checkpoint keeps the student
    assert (out["veto_states"], out["vetoed_states"]) == (len(scores), int((scores < scores.max(-1)[:, None]).any(-1).sum()))
    final, final_config = PolicyRegistry(own).load(out["version"])
    assert (final_config["veto_states"], final_config["vetoed_states"]) == (out["veto_states"], out["vetoed_states"])
    student = load_file(str(tmp_path / "run" / "checkpoint" / "tensors.safetensors"))
    assert any(not torch.equal(v, student[f"module.policy.{k}"]) for k, v in final.items())
    assert rows[0]["episodes"] == 3  # as asked: two clients share them 2 + 1 (each recorded 2)
    row = rows[0]
    assert row["evpo_gate"] in (0, 1) and isinstance(row["evpo_gate"], int)
    assert row["evpo_ev"] is None or (isinstance(row["evpo_ev"], float) and row["evpo_ev"] <= 1.0)
    assert math.isfinite(row["value_loss"]) and row["value_loss"] >= 0
    tensors = load_file(str(tmp_path / "run" / "checkpoint" / "tensors.safetensors"))
    assert any(k.startswith("module.critic.") for k in tensors) and any(k.startswith("optim.critic.") for k in tensors)


@pytest.mark.slow
@pytest.mark.fleet
def test_veto_acting_fits_each_later_acting_version_on_the_states_recorded_before_it(craft_run, tmp_path):
    store, summary, _ = craft_run
    own = str(tmp_path / "demos")
    shutil.copytree(store, own)
    out = summary_of(run_cli("train", "algo=craft", f"store={own}", f"run_dir={tmp_path / 'run'}",
                             f"algo.reference_version={summary['pretrained_version']}", "algo.iterations=2",
                             "algo.episodes_per_iteration=2", "algo.n_clients=1", f"algo.online_store={tmp_path / 'online'}",
                             "+algo.env_kwargs.vehicles_count=8", "+algo.env_kwargs.duration=12", "show=false",
                             "algo.veto_updates=5", "algo.veto_danger=100", "algo.veto_margin=0",
                             "algo.veto_acting=true").stdout)
    registry = PolicyRegistry(own)
    acting = sorted(v for v in registry.versions() if registry.load(v)[1].get("run_dir") == str(tmp_path / "run"))
    first, second = (registry.load(v)[1] for v in acting)
    snap = Store.open(str(tmp_path / "online")).snapshot(record=False)
    scores = np.concatenate([snap.load(e)["extras"]["proxy_scores"] for e in snap.episodes(policy_version=acting[0])])
    # the first acting version is the student as it starts; the second is fitted on the first one's states
    assert "veto_states" not in first
    assert (second["veto_states"], second["vetoed_states"]) == (
        len(scores), int((scores < scores.max(-1)[:, None]).any(-1).sum())) and second["vetoed_states"] > 0
    # and the update's ratios are against the logits the vetoed version acted with
    logged = snap.load(snap.episodes(policy_version=acting[1])[0])
    policy = CandidatePolicy.from_artifact(*registry.load(acting[1]))
    with torch.no_grad():
        logits = policy.logits({"state": torch.as_tensor(logged["obs"]["state"][:len(logged["extras"]["logits"])])})
    assert np.allclose(logged["extras"]["logits"], logits.numpy(), atol=1e-5)
    # the final fit is on both iterations' states
    assert out["veto_states"] == sum(len(snap.load(e)["extras"]["proxy_scores"]) for e in snap.episodes()) > len(scores)


@pytest.mark.slow
@pytest.mark.fleet
def test_runs_on_two_stores_sharing_an_online_store_each_learn_from_their_own_episodes(craft_run, tmp_path):
    """The second store's run found the first's episodes under its own version numbers: it
    trained on them and its own acting versions never drove."""
    store, summary, _ = craft_run
    online = str(tmp_path / "online")
    out = {}
    for name in ("a", "b"):  # copies of one store: their registries give the same version numbers
        shutil.copytree(store, str(tmp_path / name))
        out[name] = summary_of(run_cli("train", "algo=craft", f"store={tmp_path / name}", f"run_dir={tmp_path / name}-run",
                                       f"algo.reference_version={summary['pretrained_version']}", "algo.iterations=1",
                                       "algo.episodes_per_iteration=2", "algo.n_clients=1", f"algo.online_store={online}",
                                       "+algo.env_kwargs.vehicles_count=8", "+algo.env_kwargs.duration=12",
                                       "show=false").stdout)
    assert out["a"]["final"]["version"] == out["b"]["final"]["version"]
    episodes = Store.open(online).snapshot(record=False).episodes()
    for name in ("a", "b"):
        own = [e for e in episodes if e.attrs["policy_store"] == str(tmp_path / name)]
        assert len(own) == 2 and out[name]["final"]["steps"] == sum(e.length for e in own)


@pytest.mark.slow
@pytest.mark.fleet
def test_a_resumed_run_warns_of_the_online_episodes_it_lost(craft_run, tmp_path):
    """A deleted online shard went unnoticed: the rerun collected the next iteration and the
    veto fit and the guard lost the earlier iterations' states without a word."""
    store, summary, _ = craft_run
    own, online = str(tmp_path / "demos"), tmp_path / "online"
    shutil.copytree(store, own)
    args = ["train", "algo=craft", f"store={own}", f"run_dir={tmp_path / 'run'}", f"algo.online_store={online}",
            f"algo.reference_version={summary['pretrained_version']}", "algo.episodes_per_iteration=2",
            "algo.n_clients=1", "+algo.env_kwargs.vehicles_count=8", "+algo.env_kwargs.duration=12", "show=false"]
    run_cli(*args, "algo.iterations=1")
    shutil.rmtree(online / "shards" / "craft-0")
    r = run_cli(*args, "algo.iterations=2")
    assert ("warning: shard craft-0: its directory is gone, yet snapshot" in r.stderr
            and "saw 2 committed episodes in it: the run goes on without their episodes" in r.stderr), r.stderr


@pytest.mark.slow
def test_no_episodes_to_pretrain_on_fails_before_the_online_store_and_run_dir_are_made(craft_run, tmp_path):
    store, _, _ = craft_run
    r = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "data.tasks=[nowhere]",
                f"algo.online_store={tmp_path / 'online'}", "show=false", ok=False)
    assert r.returncode == 1 and "NoEpisodesError: no episodes in snapshot" in r.stderr, r.stderr
    assert not (tmp_path / "online").exists() and not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.fleet
def test_craft_runs_the_scene_its_demonstrations_were_recorded_in(tmp_path):
    store = str(tmp_path / "demos")
    run_cli("collect", "env=highway_meta", "+env.kwargs.scenario=roundabout", "policy=expert", "episodes=2",
            f"store={store}", "fleet.n_clients=1", "show=false")
    summary = summary_of(run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'run'}",
                                 "algo.iterations=1", "algo.episodes_per_iteration=1", "algo.n_clients=1",
                                 "algo.bc_updates=20", "data.success=null", "show=false").stdout)
    # no algo.env_kwargs: the on-policy clients drove the roundabout, not the default highway
    episodes = Store.open(summary["online_store"]).snapshot(record=False).episodes()
    assert len(episodes) == 1 and episodes[0].attrs["env_kwargs"] == {"scenario": "roundabout"}


@pytest.mark.slow
def test_an_online_store_of_another_schema_fails_before_pretraining_publishes(craft_run, tmp_path):
    store, _, args = craft_run
    before = PolicyRegistry(store).versions()
    bad = run_cli("train", "algo=craft", f"store={store}", f"run_dir={tmp_path / 'r'}", "algo.bc_updates=5",
                  f"algo.online_store={store}", "show=false", ok=False)  # the demos: no candidate extras
    assert bad.returncode == 1 and "different schema" in bad.stderr and "Traceback" not in bad.stderr
    assert PolicyRegistry(store).versions() == before  # no orphan pretrained version
    assert not (tmp_path / "r" / "craft_state.json").exists()


@pytest.mark.slow
@pytest.mark.fleet
def test_explore_eps_runs_the_fleet_on_the_mixture_with_the_proxys_best_and_records_its_logits(craft_run, tmp_path):
    store, summary, _ = craft_run
    own = str(tmp_path / "demos")
    shutil.copytree(store, own)
    eps = 0.5
    run_cli("train", "algo=craft", f"store={own}", f"run_dir={tmp_path / 'run'}",
            f"algo.reference_version={summary['pretrained_version']}", f"algo.explore_eps={eps}",
            "algo.iterations=1", "algo.episodes_per_iteration=2", "algo.n_clients=1",
            f"algo.online_store={tmp_path / 'online'}", "+algo.env_kwargs.vehicles_count=8",
            "+algo.env_kwargs.duration=12", "show=false")
    registry = PolicyRegistry(own)
    acting = max(v for v in registry.versions() if registry.load(v)[1].get("phase") == "online")
    weights, config = registry.load(acting)
    assert config["explore_eps"] == eps
    snap = Store.open(str(tmp_path / "online")).snapshot(record=False)
    data = [snap.load(e) for e in snap.episodes(policy_version=acting)]
    obs = {k: torch.as_tensor(np.concatenate([d["obs"][k][:-1] for d in data])) for k in data[0]["obs"]}
    ex = {k: np.concatenate([d["extras"][k] for d in data]) for k in ("logits", "chosen", "proxy_scores")}
    with torch.no_grad():
        pi = CandidatePolicy.from_artifact(weights, config).logits(obs).softmax(-1).numpy()
    best = ex["proxy_scores"].argmax(-1)
    mu = (1 - eps) * pi
    mu[np.arange(len(mu)), best] += eps
    # the recorded logits are those of the mixture the clients sampled from, so the ratios are pi / mu
    assert np.allclose(np.exp(ex["logits"]), mu, atol=1e-5)
    # the proxy's best is executed far more often than the policy alone would choose it
    assert (ex["chosen"] == best).mean() > pi[np.arange(len(pi)), best].mean() + 0.2
