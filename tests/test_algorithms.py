"""`algo=` selection: DIVL+QAM, IQL+QAM and FQL train from a BC reference through
`robo-post train`, publish loadable policies with provenance, and resume exactly."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from robo_post.algos.fql import FQLCritic
from robo_post.algos.actor_critic import PAIRS, ActorCritic, ActorCriticConfig, backup_chunks
from robo_post.config import compose
from robo_post.fleet.policies import build_policy
from robo_post.learner.data import load_reference
from robo_post.learner.train import train
from robo_post.models.critic import CriticConfig
from robo_post.models.features import Feature
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig
from robo_post.pipelines import lwd
from robo_post.models.ranked import flow_of
from robo_post.store import (FreshPERConfig, MixedSampler, PolicyArtifactError, PolicyRegistry, PrioritizedSampler,
                             Store, WindowSampler)


@pytest.fixture(scope="module")
def bc_store(tmp_path_factory):
    """Expert reach demos + near-miss play (state-only) and a tiny BC policy as v1."""
    root = tmp_path_factory.mktemp("algos")
    store = str(root / "store")
    for args in (["episodes=5", "fleet.client_prefix=demo"],
                 ["episodes=3", "fleet.client_prefix=play", "policy.mode=near_miss"]):
        r = subprocess.run([sys.executable, "-m", "robo_post.cli", "collect", f"store={store}", "env.tasks=[reach]",
                            "env.kwargs.render_images=false", "fleet.n_clients=1", "show=false", *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        Store.open(store).snapshot()  # persisted by id: the demos-only one is the offline data below
    train(_cfg(store, str(root / "bc"), "bc_flow", 10))
    return store


def _obs(config, n):
    """Random observations (n, ...) for every feature a policy reads."""
    return {k: torch.randn(n, *f.shape) if f.role == "state" else torch.randint(0, 256, (n, *f.shape), dtype=torch.uint8)
            for k, f in config.features.items()}


def _cfg(store, run_dir, algo, updates, warmup=2):
    return OmegaConf.merge(compose("train", [f"algo={algo}"]), {
        "store": store, "run_dir": run_dir, "updates": updates, "batch_size": 8, "log_every": 2,
        "checkpoint_every": 4, "show": False, "device": "cpu",
        "model": {"use_images": False, "use_text": False, "hidden_dim": 32, "embed_dim": 16, "flow_steps": 4,
                  "horizon": 8, "execute_steps": 4},
    }, {"algo": {"critic_warmup": warmup, "reference_version": 1}} if algo != "bc_flow" else {})


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(PAIRS))
def test_train_publishes_the_extracted_policy_with_provenance(bc_store, tmp_path, algo):
    summary = train(_cfg(bc_store, str(tmp_path / algo), algo, 6))
    weights, config = PolicyRegistry(bc_store).load(summary["version"])
    assert (config["algorithm"], config["parent_version"], config["phase"]) == (algo, 1, "offline")
    assert summary["episodes"] == 8  # successes and near-miss failures alike
    policy = FlowPolicy.from_artifact(weights, config)
    assert policy.config.flow_steps == (1 if algo == "fql" else 4)
    rows = [json.loads(x) for x in (tmp_path / algo / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [2, 4, 6]
    actor_key = "distill_loss" if algo == "fql" else "loss_am"
    assert actor_key not in rows[0] and np.isfinite(rows[-1][actor_key])  # the actor waits for the critic warm-up
    assert ("tau_mean" in rows[-1]) == (algo == "divl_qam")


@pytest.mark.slow
def test_the_critic_trains_alone_for_half_the_budget_by_default(bc_store, tmp_path):
    """With 200 critic-only updates the actor followed a critic far from its values: on expert-only
    pendulum data DIVL+QAM fell from its reference's 8435 to 5145 (one seed); with half the budget, 8502."""
    summary = train(_cfg(bc_store, str(tmp_path / "half"), "divl_qam", 8, warmup=None))
    rows = [json.loads(x) for x in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    assert [("loss_am" in r) for r in rows] == [False, False, True, True]  # updates 2, 4 | 6, 8
    # 4 warm-up updates complete no target backup, so one backup spans the whole horizon (or episode)
    backup = summary["backup"]
    assert backup["critic_warmup"] == 4 and backup["n_step"] > 1 and 8 * (backup["n_step"] - 1) < 300


def test_backups_are_sized_so_the_value_travels_within_the_critic_budget():
    """One-step backups on 1000-step locomotion left DIVL's critic at a fifth of the data's returns
    after 4649 warm-up updates; backups sized to carry 95% of the discounted return (three
    horizons) in the target's lags span 13 steps there."""
    config = ActorCriticConfig(critic_warmup=4649)
    lengths = [1000] * 7 + [150] * 23  # mean 348 steps, so D = 3 / (1 - 0.99) = 300
    assert backup_chunks("divl_qam", config, lengths, 1, 0.99, 9298) == 13  # 4649 * 0.005 = 23 lags: 300 / 23 -> 13
    assert backup_chunks("divl_qam", config, lengths, 4, 0.99, 9298) == 4  # counted in chunks of 4
    assert backup_chunks("divl_qam", config, [20] * 5, 1, 0.99, 9298) == 1  # short episodes: D = 20 < 23
    slow = ActorCriticConfig(critic_warmup=4649, value={"ema_rate": 0.001})  # a slower target: 4.6 lags
    assert backup_chunks("divl_qam", slow, lengths, 1, 0.99, 9298) == 65
    assert backup_chunks("iql_qam", ActorCriticConfig(critic_warmup=10), lengths, 1, 0.99, 20) == 300  # at most D
    assert backup_chunks("fql", ActorCriticConfig(critic_warmup=10), lengths, 1, 0.99, 20) == 1  # it values its own actions
    assert backup_chunks("iql_qam", ActorCriticConfig(critic_warmup=0), lengths, 1, 1.0, 9298) == 8  # no warm-up: the run; D = 348


@pytest.mark.slow
def test_a_budget_within_the_critic_warmup_is_warned_about(bc_store, tmp_path, capsys):
    """The published actor was the reference unchanged, with nothing said."""
    train(_cfg(bc_store, str(tmp_path / "short"), "divl_qam", 4, warmup=4))
    assert ("warning: updates=4 <= algo.critic_warmup=4: only the critic trains, and the published actor is the "
            "reference policy unchanged") in capsys.readouterr().err
    train(_cfg(bc_store, str(tmp_path / "long"), "divl_qam", 4, warmup=2))
    assert "critic_warmup" not in capsys.readouterr().err


@pytest.mark.slow
def test_the_reference_is_the_first_flow_version_and_another_kind_is_named(bc_store, tmp_path, capsys):
    store = Store.create(str(tmp_path / "store"), Store.open(bc_store).schema)
    registry = PolicyRegistry(store.root)
    registry.publish({"w": torch.zeros(2)}, {"kind": "gaussian", "model": {}})  # a gaussian_bc version first
    with pytest.raises(ValueError, match=r"starts from a published flow policy \(algo=bc_flow\), but in .* version 1 "
                                         r"is a 'gaussian' policy; train one with .* or set algo.reference_version"):
        load_reference(store, None, torch.device("cpu"))
    flow_weights, flow_config = PolicyRegistry(bc_store).load(1)
    registry.publish(flow_weights, flow_config)
    policy, version = load_reference(store, None, torch.device("cpu"))  # the first flow version
    assert version == 2 and all(torch.equal(policy.state_dict()[k], v) for k, v in flow_weights.items())
    assert capsys.readouterr().err == ""
    registry.publish({"w": torch.zeros(2)}, {"kind": "gaussian", "model": {}})
    registry.publish(flow_weights, flow_config)  # a newer BC: still the first, and the newer one named
    assert load_reference(store, None, torch.device("cpu"))[1] == 2
    assert capsys.readouterr().err == (f"starting from flow version 2, the first {flow_config['algorithm']} version; "
                                       "later ones: [4] (reference_version=4 starts from the newest)\n")
    assert load_reference(store, 4, torch.device("cpu"))[1] == 4 and capsys.readouterr().err == ""
    shutil.copytree(bc_store, tmp_path / "data")  # a pinned version of another kind, from the CLI's train
    pinned = PolicyRegistry(str(tmp_path / "data")).publish({"w": torch.zeros(2)}, {"kind": "gaussian", "model": {}})
    cfg = OmegaConf.merge(_cfg(str(tmp_path / "data"), str(tmp_path / "run"), "divl_qam", 2),
                          {"algo": {"reference_version": pinned}})
    with pytest.raises(ValueError, match=rf"version {pinned} is a 'gaussian' policy"):
        train(cfg)
    config_file = tmp_path / "data" / "policies" / "v000001" / "config.json"
    config_file.write_text(config_file.read_text() + " ")
    with pytest.raises(PolicyArtifactError, match=r"policy version 1: .* does not match the checksum .*; set "
                                                  "algo.reference_version to an intact flow version"):
        load_reference(Store.open(str(tmp_path / "data")), None, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(PAIRS))
def test_resume_matches_uninterrupted_run(bc_store, tmp_path, algo):
    train(_cfg(bc_store, str(tmp_path / "full"), algo, 8))
    train(_cfg(bc_store, str(tmp_path / "split"), algo, 4))  # "killed" at update 4
    train(_cfg(bc_store, str(tmp_path / "split"), algo, 8))  # resumes from its checkpoint
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    full, split = read("full"), read("split")
    assert [r["update"] for r in split] == [2, 4, 6, 8]
    for a, b in zip(full, split):
        for k in ("loss_q", "q_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["divl_qam", "fql"])
def test_resume_with_an_imitating_base_matches_uninterrupted_run(bc_store, tmp_path, algo):
    """The co-trained base and the imitation sampler's RNG travel with the checkpoint."""
    imitate = {"algo": {"actor": {"base": "ema_cotrained"}, "imitation": {"enabled": True}}}
    for run_dir, updates in (("full", 8), ("split", 4), ("split", 8)):
        cfg = _cfg(bc_store, str(tmp_path / run_dir), algo, updates)
        OmegaConf.set_struct(cfg, False)  # actor overrides are open keys, as `+algo.actor.base=...` on the CLI
        train(OmegaConf.merge(cfg, imitate))
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    full, split = read("full"), read("split")
    assert [r["update"] for r in split] == [2, 4, 6, 8]
    assert all("bc_loss_base" in r for r in split[1:])  # the actor (and its base) moves after the warm-up
    for a, b in zip(full, split):
        assert a.keys() == b.keys()
        for k in {"loss_q", "bc_loss_base"} & a.keys():
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_fql_published_policy_acts_like_the_one_step_policy(bc_store):
    registry = PolicyRegistry(bc_store)
    reference = FlowPolicy.from_artifact(*registry.load(1))
    algo = ActorCritic("fql", reference)
    with torch.no_grad():  # move the one-step policy away from the reference so the check means something
        for p in algo.actor.one_step.velocity_net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    published = FlowPolicy.from_artifact(*algo.artifact())
    obs = _obs(reference.config, 5)
    noise = torch.randn(5, reference.config.horizon, reference.config.action_dim)
    torch.testing.assert_close(published.sample(obs, noise=noise), algo.actor.act(obs, noise=noise))
    torch.testing.assert_close(algo.policy.sample(obs, noise=noise), algo.actor.act(obs, noise=noise))
    assert algo.actor.reference.config.flow_steps == reference.config.flow_steps == 4  # the reference stays multi-step


@pytest.mark.slow
def test_published_artifacts_are_copies_of_the_live_weights(bc_store):
    reference = FlowPolicy.from_artifact(*PolicyRegistry(bc_store).load(1))
    weights, _ = reference.artifact()
    before = {k: v.clone() for k, v in weights.items()}
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(1.0)
    assert all(torch.equal(before[k], weights[k]) for k in weights)


@pytest.mark.slow
def test_fql_critic_bootstraps_from_the_actor_chunk(bc_store):
    store = Store.open(bc_store)
    reference = FlowPolicy.from_artifact(*PolicyRegistry(bc_store).load(1))
    sampler = WindowSampler.from_snapshot(store.snapshot(), horizon=reference.config.horizon, seed=0)
    batch = sampler.sample(16)
    critic = FQLCritic(CriticConfig.like(reference.config))
    chunk = torch.rand(16, reference.config.horizon, reference.config.action_dim) * 2 - 1
    with torch.no_grad():
        want = batch["rewards"] + batch["discounts"] * critic.target.q(critic.target.encode(batch["next_obs"]), chunk).mean(0)
    metrics = critic.update(batch, lambda obs: chunk)
    assert metrics["td_target_mean"] == pytest.approx(want.mean().item(), rel=1e-5)


@pytest.mark.slow
def test_unknown_algo_is_a_clear_error(bc_store, tmp_path):
    cfg = _cfg(bc_store, str(tmp_path / "x"), "fql", 2)
    cfg.algo.name = "sac"
    with pytest.raises(ValueError, match="unknown algo 'sac'"):
        train(cfg)


@pytest.mark.slow
def test_online_phase_with_fresh_prioritized_replay(bc_store, tmp_path):
    """Offline on the demos-only snapshot, then the online phase on the play episodes (the
    "fleet" has finished) with FreshPER: ages start when the episodes reached the learner,
    a version is published every ``publish_every`` updates with its lineage."""
    store = Store.open(bc_store)
    demos = min((store.snapshot(f[:-5]) for f in os.listdir(os.path.join(bc_store, "snapshots"))), key=len)
    assert len(demos) == 5
    cfg = compose("run", ["recipe=none"]).lwd  # QAM's frozen BC reference
    OmegaConf.set_struct(cfg, False)
    cfg = OmegaConf.merge(cfg, {
        "algo": "divl_qam", "device": "cpu", "show": False, "batch_size": 8, "log_every": 2, "checkpoint_every": 4,
        "critic_warmup": 2, "offline": {"updates": 4}, "actor": {"inv_temp": 1.0},
        "online": {"updates": 4, "publish_every": 2, "client_prefix": "play", "replay": {"enabled": True, "tau": 2.0}},
    })
    run_dir = str(tmp_path / "lwd")
    offline_version = lwd.offline(bc_store, run_dir, cfg, snapshot=demos.id)["version"]
    summary = lwd.online(bc_store, run_dir, cfg, demos.id, fleet_running=lambda: False)
    assert summary["online_episodes"] == 3 and summary["versions"] == [offline_version + 1, offline_version + 2]
    registry = PolicyRegistry(bc_store)
    for v, phase in zip(summary["versions"], ("online-6", "online-8")):
        config = registry.load(v)[1]
        assert (config["parent_version"], config["phase"], config["algorithm"]) == (v - 1, phase, "divl_qam")
    stored = json.loads((tmp_path / "lwd" / "replay_stored_at.json").read_text())
    assert sorted(stored.values()) == [4, 4, 4] and all(k.startswith("play") for k in stored)
    rows = [json.loads(x) for x in (tmp_path / "lwd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [2, 4, 6, 8] and np.isfinite(rows[-1]["loss_q"])
    # The value report traces p(. | s_t) at every observation of the episodes it shows.
    traces = json.loads((tmp_path / "lwd" / "value_distributions-online.json").read_text())
    play = {e.key: e for e in store.snapshot().episodes()}
    assert traces and all(len(t["mode"]) == play[t["episode"]].length + 1 and not t["success"] for t in traces)
    assert (tmp_path / "lwd" / "value_distributions-online.png").stat().st_size > 0


@pytest.mark.slow
def test_imitation_feeds_a_cotrained_base_and_needs_one(bc_store, tmp_path):
    """``lwd.imitation``: a co-trained base learns from the demos (and interventions) beside the
    batch, offline and online, and resumes with the rest; without a co-trained base it is a
    configuration error, raised before any training."""
    cfg = compose("run", []).lwd
    OmegaConf.set_struct(cfg, False)
    cfg = OmegaConf.merge(cfg, {
        "algo": "fql", "device": "cpu", "show": False, "batch_size": 8, "log_every": 2, "checkpoint_every": 4,
        "critic_warmup": 0, "offline": {"updates": 4}, "actor": {"base": "ema_cotrained"},
        "imitation": {"enabled": True}, "online": {"updates": 2, "publish_every": 2, "client_prefix": "play"},
    })
    store = Store.open(bc_store)
    demos = min((store.snapshot(f[:-5]) for f in os.listdir(os.path.join(bc_store, "snapshots"))), key=len)
    lwd.offline(bc_store, str(tmp_path / "on"), cfg, snapshot=demos.id)
    lwd.online(bc_store, str(tmp_path / "on"), cfg, demos.id, fleet_running=lambda: False)
    rows = [json.loads(x) for x in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [2, 4, 6] and all(np.isfinite(r["bc_loss_base"]) for r in rows)
    checkpoint = str(tmp_path / "on" / "checkpoint" / "tensors.safetensors")
    assert any(k.startswith("module.base_bc.") for k in safe_open(checkpoint, "pt").keys())
    cfg.actor.base = "frozen"
    with pytest.raises(ValueError, match="base=ema_cotrained"):
        lwd.offline(bc_store, str(tmp_path / "off"), cfg, snapshot=demos.id)
    assert not (tmp_path / "off" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_prioritized_sampler_weights_and_ages(bc_store):
    snap = Store.open(bc_store).snapshot()
    eps = snap.episodes()
    sampler = WindowSampler.from_snapshot(snap, eps, horizon=4, seed=0)
    demo = np.repeat([e.client_id.startswith("demo") for e in eps], [e.length for e in eps])
    replay = PrioritizedSampler(sampler, FreshPERConfig(tau=5.0, alpha=0.5), seed=0)
    replay.add_windows(np.where(demo, 0, 10))
    replay.step = 10
    replay.per.refresh(10)
    p = replay.per.probabilities()
    is_demo = demo[replay.window[:len(replay)]]
    # Equal base priorities: P ∝ exp(-alpha * age / tau); demo windows are 10 steps older.
    assert p[is_demo].max() / p[~is_demo].min() == pytest.approx(np.exp(-0.5 * 10 / 5.0), rel=1e-9)
    batch = MixedSampler(sampler, replay, 0.5).sample(8)
    assert torch.equal(batch["weights"][:4], torch.ones(4)) and torch.equal(batch["replay_ids"][:4], torch.full((4,), -1))
    w = batch["weights"][4:]
    assert (batch["replay_ids"][4:] >= 0).all() and w.max().item() == 1.0 and (w > 0).all()
    ids = batch["replay_ids"][4:].numpy()
    replay.update_priorities(batch, torch.zeros(8))
    assert np.allclose(replay.per.base_priority(ids), FreshPERConfig().eps)


@pytest.mark.slow
def test_prioritized_sampler_keeps_priorities_when_episodes_arrive(bc_store):
    snap = Store.open(bc_store).snapshot()
    eps = snap.episodes()
    sampler = WindowSampler.from_snapshot(snap, eps[:4], horizon=4, seed=0)
    replay = PrioritizedSampler(sampler, FreshPERConfig())
    replay.add_windows(np.zeros(len(sampler), dtype=np.int64))
    n_old = len(sampler)
    replay.per.update_priorities(np.arange(n_old), np.linspace(0.1, 0.9, n_old), 0)
    before = dict(zip(replay.window[:n_old], replay.per.base_priority(np.arange(n_old))))
    sampler.add_episodes(snap, eps[4:])
    replay.add_windows(np.full(len(sampler) - n_old, 5))  # more than the buffer held: it grows
    assert len(replay) == len(sampler) and replay.per.capacity >= len(sampler)
    id_of_window = np.empty(len(sampler), dtype=np.int64)
    id_of_window[replay.window[:len(sampler)]] = np.arange(len(sampler))
    old_windows = np.array(sorted(before))
    np.testing.assert_allclose(replay.per.base_priority(id_of_window[old_windows]),
                               [before[w] for w in old_windows], rtol=1e-12)
    np.testing.assert_array_equal(replay.per.stored_at(id_of_window[old_windows]), 0)
    new_ids = id_of_window[np.arange(n_old, len(sampler))]
    np.testing.assert_allclose(replay.per.base_priority(new_ids), 1.0 + FreshPERConfig().eps)
    np.testing.assert_array_equal(replay.per.stored_at(new_ids), 5)


@pytest.mark.slow
def test_zero_importance_weights_leave_the_q_heads_unchanged(bc_store):
    reference = FlowPolicy.from_artifact(*PolicyRegistry(bc_store).load(1))
    algo = ActorCritic("iql_qam", reference)
    batch = WindowSampler.from_snapshot(Store.open(bc_store).snapshot(), horizon=reference.config.horizon).sample(8)
    before = [p.clone() for p in algo.value.net.q_heads.parameters()]
    algo.value.update(batch | {"weights": torch.zeros(8)})
    assert all(torch.equal(a, b) for a, b in zip(before, algo.value.net.q_heads.parameters()))
    algo.value.update(batch)
    assert not all(torch.equal(a, b) for a, b in zip(before, algo.value.net.q_heads.parameters()))
    assert algo.value.td_error.shape == (8,)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["divl_qam", "fql"])
def test_best_of_n_executes_the_candidate_the_critic_rates_highest(bc_store, algo):
    reference = FlowPolicy.from_artifact(*PolicyRegistry(bc_store).load(1))
    agent = ActorCritic(algo, reference, best_of_n=6)
    with torch.no_grad():  # an untrained critic with zero-ish heads would rate every chunk alike
        for p in agent.value.target.q_heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    c = reference.config
    obs = _obs(c, 4)
    noise = torch.randn(4, 6, c.horizon, c.action_dim)
    chosen = agent.acting_policy.sample(obs, noise=noise)

    policy, critic = agent.policy, agent.value.target
    candidates = torch.stack([policy.sample(obs, noise=noise[:, i]) for i in range(6)], 1)  # (B, N, H, A)
    with torch.no_grad():
        q = torch.stack([critic.q(critic.encode(obs), policy.normalize_actions(candidates[:, i])).mean(0)
                         for i in range(6)], 1)
    assert (q.argmax(1) != 0).any()  # so the check below is not passed by always taking the first candidate
    torch.testing.assert_close(chosen, candidates[torch.arange(4), q.argmax(1)])
    ranked = agent.acting_policy  # its parts, as benchmarks/critic_sensitivity.py uses them
    proposals = ranked.propose(obs, noise=noise)
    torch.testing.assert_close(policy.unnormalize_actions(proposals), candidates)
    torch.testing.assert_close(ranked.rate(obs, proposals), q)

    weights, config = agent.artifact(phase="offline")
    assert (config["kind"], config["best_of_n"], config["algorithm"], config["phase"]) == ("flow_ranked", 6, algo, "offline")
    runner = build_policy(weights, config)  # what fleet clients and the evaluator load
    torch.testing.assert_close(runner.model.sample(obs, noise=noise), chosen)
    torch.testing.assert_close(flow_of(weights, config).sample(obs, noise=noise[:, 0]), candidates[:, 0])
    assert type(flow_of(*reference.artifact())) is FlowPolicy


@pytest.mark.slow
def test_critic_overrides_shape_the_critic_and_travel_with_the_artifact():
    """``critic={"use_images": False}``: a camera-free critic beside a camera policy, loadable by the fleet."""
    torch.manual_seed(0)
    features = {"proprio": Feature("state", (5,)), "image": Feature("image", (32, 32, 3))}
    reference = FlowPolicy(FlowPolicyConfig(features=features, action_dim=2, horizon=4, use_text=False,
                                            embed_dim=8, hidden_dim=16, flow_steps=2))
    agent = ActorCritic("divl_qam", reference, critic={"use_images": False, "hidden_dim": 24}, best_of_n=4)
    assert len(agent.value.net.encoder.images) == 0 and "image" in agent.policy.encoder.images
    assert agent.value.net.q_heads[0].in_features == 24 + 4 * 2
    with torch.no_grad():
        for p in agent.value.target.q_heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    obs = {"proprio": torch.randn(3, 5), "image": torch.randint(0, 256, (3, 32, 32, 3), dtype=torch.uint8)}
    noise = torch.randn(3, 4, 4, 2)
    weights, config = agent.artifact()
    assert "image" not in config["critic"]["features"] and config["model"]["features"]["image"]["shape"] == [32, 32, 3]
    torch.testing.assert_close(build_policy(weights, config).model.sample(obs, noise=noise),
                               agent.acting_policy.sample(obs, noise=noise))
    with pytest.raises(TypeError, match="camera"):
        ActorCritic("divl_qam", reference, critic={"camera": False})


@pytest.mark.slow
def test_best_of_one_publishes_the_plain_flow_and_bad_n_is_an_error(bc_store):
    reference = FlowPolicy.from_artifact(*PolicyRegistry(bc_store).load(1))
    assert ActorCritic("divl_qam", reference, best_of_n=1).artifact()[1]["kind"] == "flow"
    with pytest.raises(ValueError, match="best_of_n must be >= 1"):
        ActorCritic("divl_qam", reference, best_of_n=0)
    with pytest.raises(ValueError, match="critic_warmup=None means half of the update budget"):
        ActorCritic("divl_qam", reference, critic_warmup=None)  # the config's default, unresolved outside a run


def test_critic_trend_flags_a_critic_still_moving_at_the_end_of_its_budget():
    from robo_post.learner.critic_report import critic_trend

    def rows(q, td):
        return [{"update": 100 * (i + 1), "q_mean": q(i), "loss_q": td(i)} for i in range(40)]

    settled = critic_trend(rows(lambda i: 50 - 40 * 0.8 ** i, lambda i: 1 + 0.9 ** i), return_span=100)
    assert settled["converged"] and abs(settled["q_change"]) < 0.1
    rising = critic_trend(rows(lambda i: 2.0 * i, lambda i: 1.0), return_span=100)  # +20 over the last 10 windows
    assert not rising["converged"] and rising["updates"] == [3100, 4000]
    assert rising["q_change"] == pytest.approx(18.0) and rising["q_change_share_of_span"] == pytest.approx(0.18)
    diverging = critic_trend(rows(lambda i: 10.0, lambda i: 1.05 ** i), return_span=100)  # TD loss +50%
    assert not diverging["converged"] and diverging["td_loss_end"] > diverging["td_loss_start"]
    assert critic_trend(rows(lambda i: 1.0, lambda i: 1.0)[:7], 100) is None
    assert critic_trend([{"update": i, "bc_loss": 1.0} for i in range(40)], 100) is None


def test_critic_diagnostics_read_values_ranking_and_drift(tmp_path):
    """A critic whose Q is exactly the discounted return-to-go ranks perfectly with zero bias; a
    policy equal to its reference has drifted 0, another one has not; held-out episodes are the
    same for the same seed."""
    from types import SimpleNamespace

    from robo_post.learner.critic_report import critic_diagnostics, describe, held_out
    from robo_post.models.features import state_features
    from robo_post.models.flow import FlowPolicy, FlowPolicyConfig
    from robo_post.store import ArraySpec, Store, StoreSchema

    g = 0.9
    schema = StoreSchema({"state": ArraySpec("float32", (1,))}, ArraySpec("float32", (1,), low=-1.0, high=1.0))
    store = Store.create(str(tmp_path / "s"), schema)
    with store.writer("w") as w:
        for k in range(12):
            T = 5 + k
            rewards = np.full(T, 1.0 + k)
            rtg = np.array([sum(rewards[t:] * g ** np.arange(T - t)) for t in range(T)] + [0.0], np.float32)
            w.write_episode({"state": rtg[:, None]}, np.zeros((T, 1), np.float32), rewards=rewards,
                            terminated=np.arange(T) == T - 1, truncated=np.zeros(T))
    snap = store.snapshot()
    episodes = snap.episodes()
    torch.manual_seed(0)
    config = FlowPolicyConfig(features=state_features(1), action_dim=1, horizon=2, use_text=False)
    reference = FlowPolicy(config)
    exact = SimpleNamespace(critic_fn=lambda: lambda obs, chunk: obs["state"][:, 0].float().expand(2, -1))
    method = SimpleNamespace(value=exact, actor=SimpleNamespace(reference=reference), policy=reference)
    d = critic_diagnostics(method, snap, episodes, g, held=False)
    assert d["episodes"] == 12 and d["steps"] == sum(5 + k for k in range(12))
    assert d["q_minus_return"] == pytest.approx(0.0, abs=1e-4)
    assert d["spearman_steps"] == pytest.approx(1.0) and d["spearman_episodes"] == pytest.approx(1.0)
    assert d["drift_rms"] == 0.0
    # that critic ignores the action: no contrast, below its heads' disagreement (0: identical heads)
    assert d["q_contrast_draws"] == d["q_contrast_random"] == d["q_heads_spread"] == 0.0
    assert d["q_states_spread"] > 1.0
    # one that adds the chunk's sum tells chunks apart: uniform chunks on [-1, 1]^2 spread by sqrt(2/3)
    contrast = SimpleNamespace(critic_fn=lambda: lambda obs, chunk: (obs["state"][:, 0] + chunk.sum((1, 2))).expand(2, -1))
    method.value = contrast
    d = critic_diagnostics(method, snap, episodes, g, held=False)
    assert d["q_contrast_random"] == pytest.approx((2 / 3) ** 0.5, rel=0.15) and d["q_contrast_draws"] > 0
    assert "warning" not in describe(d) and "cannot tell the policy's choices apart" in describe(
        {**d, "q_heads_spread": 10.0})
    method.value = exact
    method.policy = FlowPolicy(config)  # other weights: its chunks differ from the reference's
    assert critic_diagnostics(method, snap, episodes, g, held=False)["drift_rms"] > 0.05
    held = held_out(episodes, 0.1, seed=3)
    assert len(held) == 1 and [e.key for e in held] == [e.key for e in held_out(list(reversed(episodes)), 0.1, 3)]
    assert held_out(episodes[:9], 0.1, 3) == [] and len(held_out(episodes, 0.25, 3)) == 3


@pytest.mark.slow
def test_updates_null_measures_the_budget_in_passes_over_the_training_steps(bc_store, tmp_path, monkeypatch, capsys):
    from robo_post.algos.registry import method_spec
    from robo_post.learner import drivers

    monkeypatch.setattr(drivers, "MIN_UPDATES", 1)
    steps = sum(e.length for e in Store.open(bc_store).snapshot().episodes())
    for algo, trained in (("bc_flow", steps), ("divl_qam", steps)):
        cfg = OmegaConf.merge(_cfg(bc_store, str(tmp_path / algo), algo, None), {"epochs": 3, "data": {"success": None}})
        drivers.resolve_updates(cfg, method_spec(algo))
        assert cfg.updates == round(3 * trained / 8)  # batch_size 8
        assert f"updates={cfg.updates}: 3 passes over {trained} steps" in capsys.readouterr().err
    fixed = _cfg(bc_store, str(tmp_path / "fixed"), "bc_flow", 17)
    drivers.resolve_updates(fixed, method_spec("bc_flow"))
    assert fixed.updates == 17
    monkeypatch.setattr(drivers, "MAX_UPDATES", 5)
    capped = OmegaConf.merge(_cfg(bc_store, str(tmp_path / "capped"), "bc_flow", None), {"data": {"success": None}})
    drivers.resolve_updates(capped, method_spec("bc_flow"))
    assert capped.updates == 5


@pytest.mark.slow
def test_a_critic_without_reference_version_starts_from_bc_on_its_own_episodes(bc_store, tmp_path, monkeypatch):
    """v1 is BC on the successes only; a critic learning from every episode trains BC on those
    first (published), and the next critic on the same episodes starts from that version."""
    from robo_post.learner import drivers

    monkeypatch.setattr(drivers, "MIN_UPDATES", 1)
    store = str(tmp_path / "store")
    shutil.copytree(bc_store, store)
    registry = PolicyRegistry(store)
    first = len(registry.versions())

    def critic(name):
        cfg = OmegaConf.merge(_cfg(store, str(tmp_path / name), name, 4), {"epochs": 0.1, "algo": {"reference_version": None}})
        return train(cfg)

    divl = critic("divl_qam")
    reference = first + 1
    assert divl["parent_version"] == reference and divl["version"] == reference + 1
    config = registry.load(reference)[1]
    assert (config["algorithm"], config["episodes"], config["config"]["data"]["success"]) == ("bc_flow", 8, None)
    assert os.path.exists(tmp_path / "divl_qam" / "reference" / "summary.json")
    fql = critic("fql")
    assert fql["parent_version"] == reference and not os.path.exists(tmp_path / "fql" / "reference")
