"""CRAFT with a proposal policy on the continuous driving env: sampled action chunks as the candidates."""

import json
import math
import os

import numpy as np
import pytest
import torch

from robo_post.algos.craft import (Craft, CraftBatchError, CraftConfig, CraftConfigError, EMATeacher, WindowValue,
                                   candidate_logits, chunk_bc_pretrain, group_advantages)
from robo_post.envs import driving, highway_meta
from robo_post.envs.driving import CandidateChunkError, DrivingEnv, chunk_scores
from robo_post.envs.registry import env_spec
from robo_post.fleet.client import store_schema
from robo_post.fleet.policies import build_policy
from robo_post.learner.checkpoint import load_checkpoint, save_checkpoint
from robo_post.learner.craft_driver import CraftDataError, on_policy_batch, policy_kind, proposal_action
from robo_post.models.features import state_features
from robo_post.models.proposal_policy import (ProposalConfigError, ProposalPolicy, ProposalPolicyConfig,
                                              ProposalPolicyRunner)
from robo_post.store.registry import PolicyRegistry
from robo_post.store.schema import ArraySpec, StoreSchema
from robo_post.store.store import Store
from tests.helpers import run_cli, summary_of

H, A, K = 3, 2, 4
LOW, HIGH = [-2.0, 0.0], [2.0, 2.0]  # not [-1, 1], so the normalisation is exercised


def small_policy(seed=0, dim=3, k=K, min_std=0.1):
    torch.manual_seed(seed)
    return ProposalPolicy(ProposalPolicyConfig(state_features(dim), A, H, k, LOW, HIGH, min_std=min_std,
                                               embed_dim=16, hidden_dim=32))


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --- (a) logits are the renormalised candidate likelihood ---------------------------------
def test_logits_are_the_gaussian_log_density_and_their_softmax_the_renormalised_likelihood():
    policy = small_policy(1)
    obs = {"state": torch.randn(5, 3, generator=gen(0))}
    with torch.no_grad():
        candidates = policy.sample(obs, K, gen(1))
        logits = policy.logits(obs, candidates)
        mean, log_std = policy.distribution(obs)
    assert candidates.shape == (5, K, H, A) and logits.shape == (5, K)
    low, high = torch.tensor(LOW), torch.tensor(HIGH)
    assert bool(((candidates >= low) & (candidates <= high)).all())  # clipped to the action bounds
    assert bool((log_std >= math.log(0.1) - 1e-6).all())  # the std floor
    # by hand: the normalised chunk's density, summed over H x A
    x = 2 * (candidates - low) / (high - low) - 1
    std = log_std.exp()[:, None]
    by_hand = (-0.5 * ((x - mean[:, None]) / std) ** 2 - std.log() - 0.5 * math.log(2 * math.pi)).sum((-2, -1))
    assert torch.allclose(logits, by_hand, atol=1e-4)
    # the env-unit density differs by the same Jacobian for all K: the group's softmax is
    # the likelihood renormalised over the group in either unit
    env_units = torch.distributions.Normal(low + (mean[:, None] + 1) * (high - low) / 2,
                                           std * (high - low) / 2).log_prob(candidates).sum((-2, -1))
    assert not torch.allclose(env_units, logits, atol=1e-2)
    density = (env_units - env_units.amax(-1, keepdim=True)).exp()
    assert torch.allclose(logits.softmax(-1), density / density.sum(-1, keepdim=True), atol=1e-5)
    assert torch.allclose((logits + 7.5).softmax(-1), logits.softmax(-1), atol=1e-6)
    with pytest.raises(ProposalConfigError, match="candidates must be"):
        policy.logits(obs, candidates[:, :, :2])


def test_proposal_config_errors_and_artifact_round_trip():
    with pytest.raises(ProposalConfigError, match="n_candidates"):
        ProposalPolicyConfig(state_features(3), A, H, 1)
    with pytest.raises(ProposalConfigError, match="min_std"):
        ProposalPolicyConfig(state_features(3), A, H, K, min_std=0.0)
    policy = small_policy(2)
    weights, config = policy.artifact(phase="x")
    assert config["kind"] == "proposal" and json.loads(json.dumps(config)) == config
    again = ProposalPolicy.from_artifact(weights, config)
    obs = {"state": torch.randn(2, 3, generator=gen(3))}
    with torch.no_grad():
        c = policy.sample(obs, K, gen(4))
        assert torch.equal(policy.logits(obs, c), again.logits(obs, c))
    assert isinstance(build_policy(weights, config), ProposalPolicyRunner)


@pytest.mark.slow
def test_chunk_bc_fits_a_state_dependent_chunk_and_reaches_the_std_floor():
    policy = small_policy(3, dim=2, min_std=0.05)
    states = torch.randn(256, 2, generator=gen(5))
    # a deterministic expert: chunk of actions linear in the state, inside the bounds
    target = torch.stack([states[:, 0].tanh() * 1.5, states[:, 1].tanh() + 1], -1)[:, None].expand(-1, H, -1)
    stats = chunk_bc_pretrain(policy, {"state": states}, target.contiguous(), 600, lr=3e-3, generator=gen(6))
    assert stats["mae"] < 0.08
    with torch.no_grad():
        _, log_std = policy.distribution({"state": states})
    assert float(log_std.exp().mean()) < 0.07  # driven to the floor by a deterministic expert, never below
    assert bool((log_std >= math.log(0.05) - 1e-6).all())


# --- (b) the fleet runner --------------------------------------------------------------------
class FakeEnv:
    """Stands in for an env with the candidate hook; records what it was asked to score."""

    def __init__(self):
        self.calls = []
        self.unwrapped = self

    def candidate_extras(self, candidates):
        self.calls.append(np.array(candidates))
        return {"proxy_scores": -np.abs(candidates).sum((1, 2)).astype(np.float32)}


def test_runner_executes_the_first_action_of_the_chosen_proposal_and_is_seeded():
    policy = small_policy(4)
    obs, env = {"state": np.full(3, 0.5, np.float32)}, FakeEnv()
    runner = ProposalPolicyRunner(policy, deterministic=False)

    def episode(seed, steps=20):
        runner.reset(env, seed)
        out = []
        for _ in range(steps):
            action = runner.act(obs, env)
            out.append((action, runner.extras()))
        return out

    first = episode(1)
    for action, ex in first:
        assert ex["candidates"].shape == (K, H, A) and ex["candidates"].dtype == np.float32
        assert ex["logits"].shape == (K,) and ex["chosen"].dtype == np.int64
        assert np.array_equal(action, ex["candidates"][int(ex["chosen"]), 0])
        with torch.no_grad():
            logits = policy.logits({"state": torch.as_tensor(obs["state"])[None]},
                                   torch.as_tensor(ex["candidates"])[None])[0]
        assert np.allclose(ex["logits"], logits.numpy(), atol=1e-5)  # the logits score the stored candidates
        assert np.array_equal(ex["proxy_scores"], -np.abs(ex["candidates"]).sum((1, 2)))  # the hook's entries
    again, other = episode(1), episode(2)
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(first, again))
    assert not all(np.array_equal(a, b) for (a, _), (b, _) in zip(first, other))
    assert len({int(ex["chosen"]) for _, ex in first}) >= 2  # a sample, not an argmax
    # deterministic: the mean chunk is candidate 0 and runs
    greedy, env = ProposalPolicyRunner(policy, deterministic=True, env_extras=False), FakeEnv()
    greedy.reset(env, 0)
    action = greedy.act(obs, env)
    with torch.no_grad():
        mean, _ = policy.distribution({"state": torch.as_tensor(obs["state"])[None]})
    expected = policy.unnormalize_actions(mean.clamp(-1, 1))[0]
    ex = greedy.extras()
    assert int(ex["chosen"]) == 0 and np.allclose(action, expected[0].numpy(), atol=1e-6)
    assert np.allclose(ex["candidates"][0], expected.numpy(), atol=1e-6) and env.calls == []


def test_exploring_proposal_runner_records_the_mixture_over_the_proposals_it_scored():
    policy, eps = small_policy(5), 0.4
    obs, env = {"state": np.full(3, 0.5, np.float32)}, FakeEnv()
    runner = ProposalPolicyRunner(policy, deterministic=False, explore_eps=eps)
    runner.reset(env, 3)
    hits = 0
    for _ in range(200):
        action = runner.act(obs, env)
        ex = runner.extras()
        with torch.no_grad():
            pi = policy.logits({"state": torch.as_tensor(obs["state"])[None]},
                               torch.as_tensor(ex["candidates"])[None])[0].softmax(-1).numpy()
        best = int(ex["proxy_scores"].argmax())
        mu = (1 - eps) * pi
        mu[best] += eps
        assert np.allclose(np.exp(ex["logits"]), mu, atol=1e-5)
        assert np.array_equal(env.calls[-1], ex["candidates"])  # scored the proposals it chose among
        assert np.array_equal(action, ex["candidates"][int(ex["chosen"]), 0])
        hits += int(ex["chosen"]) == best
    assert len(env.calls) == 200 and hits / 200 > eps


# --- (c) counterfactual chunk scores in the driving env ----------------------------------
def scene_state(env: DrivingEnv):
    core = env.core
    return (core.vehicle.position.copy(), core.vehicle.speed, [id(v) for v in core.road.vehicles],
            [v.position.copy() for v in core.road.vehicles], core.time, env._steps,
            json.dumps(core.np_random.bit_generator.state, default=str),
            json.dumps(env.np_random.bit_generator.state, default=str))


def test_chunk_scores_leave_the_live_env_untouched_and_are_deterministic():
    env = DrivingEnv("highway-fast", duration=60, oracle=True)
    env.reset(seed=0)
    floor, brake = np.array([1.0, 0.0], np.float32), np.array([-1.0, 0.0], np.float32)
    for _ in range(20):  # flooring it from the start crashes into the car ahead at step 24
        env.step(floor)
    before = scene_state(env)
    candidates = np.stack([np.tile(floor, (4, 1)), np.tile(brake, (4, 1)), np.tile(floor, (4, 1))])
    first = env.candidate_extras(candidates)
    second = env.candidate_extras(candidates)
    after = scene_state(env)
    assert np.array_equal(before[0], after[0]) and before[1] == after[1] and before[2] == after[2]
    assert all(np.array_equal(a, b) for a, b in zip(before[3], after[3])) and before[4:] == after[4:]
    assert np.array_equal(first["proxy_scores"], second["proxy_scores"])
    assert first["proxy_scores"].dtype == np.float32 and first["oracle_scores"].shape == (3,)
    assert first["proxy_scores"][0] == first["proxy_scores"][2]  # the same candidate twice, the same score
    # flooring it crashes within the chunk (collision -1), braking does not
    assert first["proxy_scores"][0] < first["proxy_scores"][1] - 0.5
    # the live env then crashes exactly as the clones predicted
    info = [env.step(floor)[4] for _ in range(4)][-1]
    assert info["collision"] and info["events"][0] == 1.0 and info["events"][1] == 1.0
    with pytest.raises(CandidateChunkError, match=r"\(K, H, 2\)"):
        env.candidate_extras(np.zeros((3, 4), np.float32))
    with pytest.raises(CandidateChunkError, match="non-finite"):
        chunk_scores(env, np.full((1, 2, 2), np.nan, np.float32))


def test_driving_events_and_step_extras_follow_highway_meta():
    env = DrivingEnv("highway-fast", duration=30)
    _, info = env.reset(seed=0)
    assert driving.TTC_THRESHOLD == highway_meta.TTC_THRESHOLD and len(highway_meta.EVENTS) == 5
    spec = env_spec("driving")
    events = spec.step_extras(info)["events"]  # what a store declaring the extra records
    assert events.dtype == np.float32 and events.shape == (5,) and tuple(events) == info["events"]
    assert info["events"][4] == 0.0  # a continuous ego brakes to a stop behind any car: never blocked
    assert info["events"][2] == pytest.approx(float(np.clip(info["reward_terms"]["high_speed_reward"], 0, 1)))
    for _ in range(30):  # full steering: off the road, which counts as the crash entry
        *_, terminated, _, info = env.step(np.array([0.0, 1.0], np.float32))
        if terminated:
            break
    assert info["off_road"] and not info["collision"] and info["events"][0] == 1.0
    assert spec.step_extra_specs["events"] == env_spec("highway_meta").step_extra_specs["events"]
    assert np.array_equal(spec.step_extras(info)["events"], info["events"])


# --- (d) the update on a proposal batch ------------------------------------------------------
def proposal_batch(policy, n=64, seed=0):
    obs = {"state": torch.randn(n, 3, generator=gen(seed))}
    with torch.no_grad():
        candidates = policy.sample(obs, K, gen(seed + 1))
        old_logits = policy.logits(obs, candidates)
    scores = candidates[..., 0].sum(-1)  # the proxy favours the proposal that accelerates most (one direction)
    return {"obs": obs, "candidates": candidates, "old_logits": old_logits, "proxy_adv": group_advantages(scores),
            "chosen": torch.zeros(n, dtype=torch.long), "delta": torch.zeros(n)}


def test_an_update_raises_the_renormalised_probability_of_the_favoured_proposal():
    craft = Craft(CraftConfig(lr=3e-3, ema_m=0.9), small_policy(5))
    batch = proposal_batch(craft.policy, seed=10)
    j = batch["proxy_adv"].argmax(-1, keepdim=True)  # the favoured proposal of each state
    teacher_before = [p.clone() for p in craft.teacher.parameters()]
    before = batch["old_logits"].softmax(-1).gather(-1, j)[:, 0]
    metrics = craft.update(batch)
    assert float(metrics["kl_teacher"]) == pytest.approx(0.0, abs=1e-6)  # student == teacher before the step
    with torch.no_grad():
        logits = candidate_logits(craft.policy, batch["obs"], batch["candidates"])
        after = logits.softmax(-1).gather(-1, j)[:, 0]
        teacher_logits = craft.teacher.logits(batch["obs"], batch["candidates"])
    # one step: pi(j|s), renormalised over each state's group, rose in (almost) every state
    assert float(after.mean()) > float(before.mean()) + 0.01 and float((after > before).float().mean()) > 0.9
    # the teacher took one EMA step towards the student, and the group KL now separates them
    for old, new, student in zip(teacher_before, craft.teacher.parameters(), craft.policy.parameters()):
        assert torch.allclose(new, 0.9 * old + 0.1 * student.detach(), atol=1e-6)
    assert float(craft.teacher_kl(logits, teacher_logits).mean()) > 1e-4
    with pytest.raises(CraftBatchError, match="candidates"):
        craft.update({k: v for k, v in batch.items() if k != "candidates"})


def test_evpo_critic_and_checkpoints_work_for_a_proposal_policy(tmp_path):
    policy = small_policy(6)
    critic = WindowValue.for_policy(policy)
    assert torch.equal(critic.encoder.state_mean, policy.encoder.state_mean)
    craft = Craft(CraftConfig(baseline="evpo", lr=1e-3), policy)
    batch = proposal_batch(craft.policy, n=16, seed=20) | {"event_return": torch.randn(16, generator=gen(21))}
    craft.update(batch)
    assert craft.values(batch["obs"]).shape == (16,)
    save_checkpoint(str(tmp_path / "ckpt"), craft.modules, craft.optimizers, {}, {"iteration": 1})
    resumed = Craft(CraftConfig(baseline="evpo", lr=1e-3), small_policy(7))
    load_checkpoint(str(tmp_path / "ckpt"), resumed.modules, resumed.optimizers, {})
    again, uninterrupted = resumed.update(batch), craft.update(batch)
    assert all(torch.equal(again[k], uninterrupted[k]) for k in uninterrupted)
    assert isinstance(EMATeacher(policy).policy, ProposalPolicy)


def test_on_policy_batch_carries_the_candidates():
    extras = {"proxy_scores": np.random.default_rng(0).normal(size=(4, K)).astype(np.float32),
              "chosen": np.array([0, 1, 2, 3]), "logits": np.zeros((4, K), np.float32),
              "events": np.zeros((4, 5), np.float32), "candidates": np.ones((4, K, H, A), np.float32)}
    batch, _ = on_policy_batch(CraftConfig(), {"state": np.zeros((4, 3), np.float32)}, extras, [4],
                               np.array([-1.0, -0.3, 0.0, 0.0, 0.0]))
    assert batch["candidates"].shape == (4, K, H, A) and batch["candidates"].dtype == torch.float32


def test_bad_proposal_settings_are_typed_errors():
    for bad, match in (({"n_proposals": 1}, "n_proposals"), ({"min_std": 0.0}, "min_std"),
                       ({"horizon": 0}, "horizon"), ({"candidates": "both"}, "candidates")):
        with pytest.raises(CraftConfigError, match=match):
            CraftConfig(**bad)
    assert policy_kind("highway_meta", CraftConfig()) == "candidate"
    assert policy_kind("driving", CraftConfig()) == "proposal"
    assert policy_kind("highway_meta", CraftConfig(candidates="proposals")) == "proposal"
    meta = store_schema({"name": "highway_meta"}, None)
    with pytest.raises(CraftDataError, match="discrete actions"):  # proposals asked of a discrete env
        proposal_action(meta, meta, "highway_meta")
    driving = store_schema({"name": "driving"}, None)
    assert proposal_action(driving, driving, "driving").shape == (2,)
    wrong = StoreSchema(driving.observations, ArraySpec("float32", (3,), low=-1.0, high=1.0))
    with pytest.raises(CraftDataError, match="do not match"):  # store actions that do not fit the env
        proposal_action(driving, wrong, "driving")


# --- (e) end to end through the CLI ----------------------------------------------------------
@pytest.fixture(scope="module")
def proposal_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("craft_proposals")
    store = str(root / "demos")
    run_cli("collect", "env=driving", "policy=expert", "episodes=2", f"store={store}", "fleet.n_clients=1",
            "+env.kwargs.duration=20", "show=false")
    summary = summary_of(run_cli("train", "algo=craft", f"store={store}", f"run_dir={root / 'run'}",
                                 "algo.iterations=1", "algo.episodes_per_iteration=2", "algo.n_clients=1",
                                 "algo.bc_updates=50", "algo.n_proposals=4", "algo.oracle=true", "show=false").stdout)
    return store, summary


@pytest.mark.slow
@pytest.mark.fleet
def test_craft_fine_tunes_a_proposal_policy_through_the_fleet(proposal_run):
    store, summary = proposal_run
    assert Store.open(store).schema.extras == {}  # a plain driving store records no extras
    registry = PolicyRegistry(store)
    assert registry.load(summary["pretrained_version"])[1]["kind"] == "proposal"
    weights, config = registry.load(2)  # the version the fleet sampled from
    assert config["kind"] == "proposal" and config["deterministic"] is False
    snap = Store.open(summary["online_store"]).snapshot(record=False)
    episodes = snap.episodes(policy_version=2)
    assert len(episodes) == 2 and all(e.task_id == "highway-fast" for e in episodes)
    data = snap.load(episodes[0])
    ex, T = data["extras"], len(data["action"])
    horizon = env_spec("driving").horizon
    assert {k: v.shape for k, v in ex.items()} == {
        "candidates": (T, 4, horizon, 2), "logits": (T, 4), "chosen": (T,), "proxy_scores": (T, 4),
        "oracle_scores": (T, 4), "events": (T, 5)}
    # the recorded action is the first action of the recorded choice among the recorded proposals...
    assert np.array_equal(data["action"], ex["candidates"][np.arange(T), ex["chosen"], 0])
    # ...and the recorded logits are the acting version's likelihoods of them (on-policy)
    policy = ProposalPolicy.from_artifact(weights, config)
    with torch.no_grad():
        logits = policy.logits({"state": torch.as_tensor(data["obs"]["state"][:-1])}, torch.as_tensor(ex["candidates"]))
    assert np.allclose(logits.numpy(), ex["logits"], atol=1e-4)
    assert np.isfinite(ex["proxy_scores"]).all() and set(np.unique(ex["events"][:, :2])) <= {0.0, 1.0}
    final = registry.load(summary["version"])[1]
    assert final["kind"] == "proposal" and final["phase"] == "final" and final["deterministic"] is True
    run_cli("eval", f"store={store}", f"version={summary['version']}", "tasks=[highway-fast]", "episodes_per_task=1",
            "n_clients=1", "show=false")
    result = json.load(open(os.path.join(f"{store}-eval", "evals", os.listdir(f"{store}-eval/evals")[0])))
    assert len(result["episodes"]) == 1 and result["env"]["name"] == "driving"
