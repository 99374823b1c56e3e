"""`algo=` selection: DIVL+QAM, IQL+QAM and FQL train from a BC reference through
`robo-post train`, publish loadable policies with provenance, and resume exactly."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from robo_post.algos.fql import FQLCritic
from robo_post.cli import compose
from robo_post.learner.algorithms import ALGORITHMS, ActorCritic
from robo_post.learner.train import train
from robo_post.models.critic import CriticConfig
from robo_post.models.flow import FlowPolicy
from robo_post.store import PolicyRegistry, Store, WindowSampler


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
    train(_cfg(store, str(root / "bc"), "bc_flow", 10))
    return store


def _cfg(store, run_dir, algo, updates, warmup=2):
    return OmegaConf.merge(compose("train", [f"algo={algo}"]), {
        "store": store, "run_dir": run_dir, "updates": updates, "batch_size": 8, "log_every": 2,
        "checkpoint_every": 4, "show": False, "device": "cpu",
        "model": {"use_images": False, "use_text": False, "hidden_dim": 32, "embed_dim": 16, "flow_steps": 4},
    }, {"algo": {"critic_warmup": warmup}} if algo != "bc_flow" else {})


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
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


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
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


def test_fql_published_policy_acts_like_the_one_step_policy(bc_store):
    registry = PolicyRegistry(bc_store)
    reference = FlowPolicy.from_artifact(*registry.load(1))
    algo = ActorCritic("fql", reference)
    with torch.no_grad():  # move the one-step policy away from the reference so the check means something
        for p in algo.actor.one_step.velocity_net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    published = FlowPolicy.from_artifact(*algo.artifact())
    obs = {"proprio": torch.randn(5, reference.config.proprio_dim)}
    noise = torch.randn(5, reference.config.horizon, reference.config.action_dim)
    torch.testing.assert_close(published.sample(obs, noise=noise), algo.actor.act(obs, noise=noise))


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


def test_unknown_algo_is_a_clear_error(bc_store, tmp_path):
    cfg = _cfg(bc_store, str(tmp_path / "x"), "fql", 2)
    cfg.algo.name = "sac"
    with pytest.raises(ValueError, match="unknown algo 'sac'"):
        train(cfg)
