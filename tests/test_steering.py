"""Steering end to end from the CLI: a Gaussian actor trained for an old goal, steered to new goals."""

import json
import os
import zipfile

import gymnasium as gym
import numpy as np
import pytest
import torch

from robo_post.envs.registry import env_spec
from robo_post.fleet.policies import MissingExtrasError, build_policy, policy_extras, recorded_extras
from robo_post.models.gaussian import Gaussian
from robo_post.steering.poe import compose, select_alpha
from robo_post.steering.policy import SteeredPolicy, SteeringConfig, build_source, resolve_source
from robo_post.steering.sources import SB3Actor, SteeringSourceError
from robo_post.store.schema import StoreNotFoundError
from robo_post.store.registry import PolicyRegistry
from robo_post.store.store import Store
from tests.helpers import run_cli

OLD_GOAL = [0.5, 0.5]


@pytest.fixture(scope="module")
def actor_store(tmp_path_factory):
    """Noisy old-goal demonstrations and a Gaussian BC actor that ignores the goal it observes."""
    root = str(tmp_path_factory.mktemp("steer") / "old")
    run_cli("collect", "env=point_mass", f"+env.kwargs.goal=[{OLD_GOAL[0]},{OLD_GOAL[1]}]", "policy.noise=0.3",
             "episodes=40", f"store={root}", "show=false")
    run_cli("train", "algo=gaussian_bc", f"store={root}", f"run_dir={root}-bc", "updates=1500",
             "model.features={goal: null}", "data.success=null", "batch_size=64", "show=false")
    return root


def frozen_episodes(actor_store, n=6):
    env = env_spec("point_mass").make(None)
    policy = build_policy(*PolicyRegistry(actor_store).load(1))
    finals = []
    for seed in range(n):
        obs, _ = env.reset(seed=seed)
        policy.reset(env, seed)
        for _ in range(100):
            obs, *_ = env.step(policy.act(obs, env))
        finals.append((obs["position"], obs["goal"]))
    return finals


def test_gaussian_bc_learns_the_old_goal_and_an_honest_std(actor_store):
    finals = frozen_episodes(actor_store)
    assert np.mean([np.linalg.norm(p - OLD_GOAL) for p, _ in finals]) < 0.15  # goes to the old goal...
    assert np.mean([np.linalg.norm(p - g) for p, g in finals]) > 0.3  # ...wherever the new one is
    actor = build_source(*resolve_source({"kind": "registry", "store": actor_store}, "actor"), None)
    obs = {"position": np.zeros((4, 2), np.float32), "velocity": np.zeros((4, 2), np.float32),
           "goal": np.zeros((4, 2), np.float32)}
    std = actor.distribution(obs).std.numpy()
    assert 0.15 < std.mean() < 0.5  # the demonstrations' action noise is 0.3 (before clipping)


def test_steer_cli_selects_alpha_publishes_and_records_auditable_extras(actor_store, tmp_path):
    out = str(tmp_path / "deploy")
    summary = json.loads(run_cli("steer", "actor.kind=registry", f"actor.store={actor_store}",
                                  "selector.kl_budget=2.0", "selector.episodes=4", "episodes=4",
                                  f"store={out}", "show=false", "fleet.n_clients=1").stdout)
    kls = summary["selection"]["kl_curve"]
    grid = summary["selection"]["alpha_grid"]
    expected = max([a for a, k in zip(grid, kls) if k <= 2.0], default=0.0)
    assert summary["steering"]["alpha"] == expected and 0 < expected < 0.9
    weights, config = PolicyRegistry(out).load(summary["version"])
    assert config["kind"] == "steered" and config["steering"]["alpha"] == expected
    assert config["actor"]["source"]["version"] == 1 and any(k.startswith("actor/") for k in weights)
    snap = Store.open(out).snapshot(record=False)
    episodes = list(snap.episodes())
    assert len(episodes) == 4 and all(e.policy_version == summary["version"] and e.role == "deploy" for e in episodes)
    data = snap.load(episodes[0])
    ex = {k: torch.as_tensor(v) for k, v in data["extras"].items()}
    # The audit: the steered distribution is the PoE of the recorded actor and prior, and is what was executed.
    steered = compose(Gaussian(ex["actor_mean"], ex["actor_std"].log()), Gaussian(ex["prior_mean"], ex["prior_std"].log()),
                      expected, "poe")
    assert torch.allclose(steered.mean, ex["steered_mean"], atol=1e-5)
    assert np.allclose(data["action"], np.clip(data["extras"]["steered_mean"], -1, 1), atol=1e-6)
    assert np.allclose(data["extras"]["prior_std"], 0.2)
    # what the steered policy moved on its own states, by hand from every deployed step's extras
    rows = [snap.load(e)["extras"] for e in episodes]
    mu_s, sd_s, mu_a, sd_a = (np.concatenate([r[k] for r in rows]).astype(np.float64)
                              for k in ("steered_mean", "steered_std", "actor_mean", "actor_std"))
    by_hand = (np.log(sd_a / sd_s) + (sd_s ** 2 + (mu_s - mu_a) ** 2) / (2 * sd_a ** 2) - 0.5).sum(-1).mean()
    assert summary["deployed_kl"] == pytest.approx(by_hand, rel=1e-6)
    # robo-post eval loads the steered version like any other.
    run_cli("eval", f"store={out}", f"version={summary['version']}", "episodes_per_task=2", "n_clients=1",
             "show=false")
    results = [f for f in os.listdir(out + "-eval/evals") if f.endswith(".json")]
    assert results
    # The same command again deploys the same steered version; it publishes no copy of it.
    again = json.loads(run_cli("steer", "actor.kind=registry", f"actor.store={actor_store}",
                                "selector.kl_budget=2.0", "selector.episodes=4", "episodes=2",
                                f"store={out}", "show=false", "fleet.n_clients=1").stdout)
    assert again["version"] == summary["version"] == PolicyRegistry(out).latest() and again["episodes"] == 2
    assert json.loads(open(os.path.join(out, "steer", f"v{summary['version']}.json")).read()) == again
    # Fleet clients pinned to it record the same audit extras (the store's schema was refused before).
    run_cli("collect", "env=point_mass", f"store={out}", f"fleet.policy_version={summary['version']}", "episodes=2",
            "fleet.n_clients=1", "fleet.client_prefix=fleet", "show=false")
    snap = Store.open(out).snapshot(record=False)
    fleet = [e for e in snap.episodes() if e.client_id.startswith("fleet")]
    assert len(fleet) == 2 and all(e.policy_version == summary["version"] for e in fleet)
    data = snap.load(fleet[0])
    assert np.allclose(data["action"], np.clip(data["extras"]["steered_mean"], -1, 1), atol=1e-6)
    assert np.allclose(data["extras"]["prior_std"], 0.2)
    # what the steered policy moved on its own states, by hand from every deployed step's extras
    rows = [snap.load(e)["extras"] for e in episodes]
    mu_s, sd_s, mu_a, sd_a = (np.concatenate([r[k] for r in rows]).astype(np.float64)
                              for k in ("steered_mean", "steered_std", "actor_mean", "actor_std"))
    by_hand = (np.log(sd_a / sd_s) + (sd_s ** 2 + (mu_s - mu_a) ** 2) / (2 * sd_a ** 2) - 0.5).sum(-1).mean()
    assert summary["deployed_kl"] == pytest.approx(by_hand, rel=1e-6)


def test_steer_eval_grid_and_report(actor_store, tmp_path):
    out = str(tmp_path / "grid")
    run_cli("steer-eval", "actor.kind=registry", f"actor.store={actor_store}", "episodes=16",
             "qualities=[good,random_honest]", "calibration_episodes=4", "bandit_episodes=[18]", "stochastic=false",
             f"out_dir={out}", "show=false")
    results = json.load(open(os.path.join(out, "steering.json")))["results"]
    good = {(c["arm"], c["alpha"]): c for c in results["good"]["cells"]}
    assert good[("poe", 0.9)]["label"] == "HELP" and good[("prior", 1.0)]["label"] == "HELP"
    honest = {(c["arm"], c["alpha"]): c for c in results["random_honest"]["cells"]}
    # Anchoring: the honest random prior moves PoE far less than it moves the additive mix.
    assert abs(honest[("poe", 0.9)]["diff"]) < 0.25 * abs(honest[("additive", 0.9)]["diff"])
    for res in results.values():
        assert res["deterministic_poe_klreg_gap"] < 1e-4
        assert [s["selector"] for s in res["selectors"]] == ["KL budget 0.5", "KL budget 2", "bandit 18 episodes"]
        assert res["selectors"][2]["episodes_spent"] == 16  # 6 arms x 1, 4 x 1, 3 x 2 episodes
    # the bandit reaches the new goals with a good prior and keeps the frozen actor with an honest random one
    bandit = {q: res["selectors"][2] for q, res in results.items()}
    assert bandit["good"]["alpha"] > 0 and bandit["good"]["label"] == "HELP" and bandit["good"]["success"] >= 0.9
    assert results["good"]["cells"][0]["success"] <= 0.1  # the frozen actor misses the new goals
    assert {res["auto_selector"] for res in results.values()} == {"bandit"}  # the point mass reports success
    assert bandit["random_honest"]["alpha"] == 0.0 and bandit["random_honest"]["label"] == "FROZEN"
    page = open(os.path.join(out, "steering.html")).read()
    assert page.count("data:image/png;base64") == 3 and "Selector vs oracle" in page


def test_sb3_zip_actor_is_checked_by_its_checksum(tmp_path):
    from stable_baselines3 import PPO

    env = env_spec("point_mass").make(None)
    model = PPO("MultiInputPolicy", env, n_steps=64, batch_size=32, seed=0, verbose=0)
    model.learn(64)
    path = str(tmp_path / "ppo.zip")
    model.save(path)
    weights, config = resolve_source({"kind": "sb3", "path": path, "algo": "PPO"}, "actor")
    actor = build_source(weights, config, None)
    assert isinstance(actor, SB3Actor)
    obs, _ = env.reset(seed=0)
    batch = {k: v[None] for k, v in obs.items()}
    mean = actor.distribution(batch).mean.numpy()[0]
    assert np.allclose(mean, model.predict(obs, deterministic=True)[0], atol=1e-5)  # PPO's mode = its mean
    with open(path, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(SteeringSourceError, match="changed"):
        build_source(weights, config, None)


def test_bad_sources_are_typed_errors(actor_store, tmp_path):
    with pytest.raises(SteeringSourceError, match="scripted controller is not a frozen Gaussian actor"):
        resolve_source({"kind": "scripted"}, "actor")
    with pytest.raises(SteeringSourceError, match="needs"):
        resolve_source({"kind": "sb3", "path": None, "algo": "SAC"}, "actor")
    not_zip, bad_zip = tmp_path / "agent.txt", tmp_path / "other.zip"
    not_zip.write_text("not an agent")
    with zipfile.ZipFile(bad_zip, "w") as z:  # a zip, but not one SB3 saved
        z.writestr("readme.txt", "hello")
    with pytest.raises(SteeringSourceError, match=r"agent.txt is not an SB3 zip \(not a zip archive\)"):
        build_source(*resolve_source({"kind": "sb3", "path": str(not_zip), "algo": "TD3"}, "actor"), None)
    with pytest.raises(SteeringSourceError, match=r"other.zip is not an SB3 SAC zip"):
        build_source(*resolve_source({"kind": "sb3", "path": str(bad_zip), "algo": "SAC"}, "actor"), None)
    result = run_cli("steer", "actor.kind=registry", f"actor.store={actor_store}", "prior.quality=perfect",
                      f"store={tmp_path / 'x'}", ok=False)
    assert result.returncode == 2 and "prior.quality" in result.stderr
    assert not os.path.exists(tmp_path / "x")
    wrong_env = run_cli("steer", "actor.kind=registry", f"actor.store={actor_store}", "env=reacher",
                        f"store={tmp_path / 'y'}", "show=false", ok=False)
    assert wrong_env.returncode == 1 and "actor reads observations {position" in wrong_env.stderr
    assert "Traceback" not in wrong_env.stderr and not os.path.exists(tmp_path / "y")
    # a mistyped source store is named and nothing is created there (it left an empty policies/ behind)
    with pytest.raises(StoreNotFoundError, match="actor: no policy registry at .*typo"):
        resolve_source({"kind": "registry", "store": str(tmp_path / "typo")}, "actor")
    assert not os.path.exists(tmp_path / "typo")


def test_a_store_that_records_extras_refuses_a_policy_without_them():
    class Plain:
        pass

    assert policy_extras(Plain(), {"actor_mean": None}) == {} and recorded_extras({}, {}) is None
    with pytest.raises(MissingExtrasError, match="actor_mean"):
        recorded_extras({"actor_mean": None, "events": None}, policy_extras(Plain(), {"actor_mean": None}),
                        {"events": np.zeros(2)})


def test_selector_reads_only_states_and_caps_alpha(actor_store):
    env = env_spec("point_mass").make(None)
    actor = build_source(*resolve_source({"kind": "registry", "store": actor_store}, "actor"), None)
    prior = build_source(*resolve_source({"kind": "scripted", "quality": "random_overconfident"}, "prior"), env)
    policy = SteeredPolicy(actor, actor, SteeringConfig("frozen", 0.0), env.action_space.low, env.action_space.high)
    obs, _ = env.reset(seed=3)
    states = {k: np.repeat(v[None], 32, 0) for k, v in obs.items()}
    policy.act(states)
    a, kls = select_alpha(actor.distribution(states), prior.distribution(states), (0.1, 0.3, 0.5, 0.7, 0.9), 1e9,
                          alpha_max=0.3)
    assert a == 0.3 and len(kls) == 5


def test_a_prior_learned_from_store_data_steers_with_its_fitted_std(actor_store, tmp_path):
    demos = str(tmp_path / "goal_demos")
    run_cli("collect", "env=point_mass", "policy.noise=0.3", "episodes=30", f"store={demos}", "show=false")
    run_cli("train", "algo=gaussian_bc", f"store={demos}", f"run_dir={demos}-bc", "updates=1500",
            "data.success=null", "show=false")
    out = str(tmp_path / "grid")
    run_cli("steer-eval", "actor.kind=registry", f"actor.store={actor_store}", "prior.kind=registry",
            f"prior.store={demos}", "episodes=12", "rules=[poe]", "calibration_episodes=2", "stochastic=false",
            f"out_dir={out}", "show=false")
    cells = json.load(open(os.path.join(out, "steering.json")))["results"]["registry"]["cells"]
    poe = {c["alpha"]: c for c in cells if c["arm"] == "poe"}
    assert poe[0.9]["label"] == "HELP" and poe[0.9]["diff"] > poe[0.1]["diff"] > 0
    env = env_spec("point_mass").make(None)
    prior = build_source(*resolve_source({"kind": "registry", "store": demos}, "prior"), env)
    obs, _ = env.reset(seed=0)
    std = prior.distribution({k: v[None] for k, v in obs.items()}).std.numpy()
    assert 0.15 < std.mean() < 0.5  # fitted to the demonstrations' noise, not a chosen constant


class _HalfTorquePendulum(gym.Env):
    """Observes like Pendulum-v1 (float32 (3,)) but takes torques in [-1, 1], not [-2, 2]."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, False, True, {}


gym.register("robo_post_test/SteerHalfTorque-v0", entry_point=_HalfTorquePendulum)


def _pendulum_actor(root):
    """A (untrained) Gaussian actor for Pendulum-v1's observations and [-2, 2] torques, published in ``root``."""
    from robo_post.models.features import state_features
    from robo_post.models.gaussian import GaussianPolicy, GaussianPolicyConfig

    model = GaussianPolicy(GaussianPolicyConfig(features=state_features(3, "observation"), action_dim=1,
                                                embed_dim=8, hidden_dim=16, action_low=[-2.0], action_high=[2.0]))
    PolicyRegistry(root).publish(*model.artifact(algorithm="untrained"))
    return root


@pytest.mark.parametrize("env, message", [
    # same observations, half the torque range: the actor's means were clipped to [-1, 1]
    ("robo_post_test/SteerHalfTorque-v0",
     r"actor acts in \[\[-2.0\], \[2.0\]\]; the env's actions are in \[\[-1.0\], \[1.0\]\]"),
    # 4 observed values, not 3: a bare torch shape error from inside the network
    ("InvertedPendulum-v5", r"actor reads observations \{observation: \(3,\)\}; the env observes \{observation: \(4,\)\}"),
])
def test_steer_refuses_an_actor_built_for_other_observations_or_action_bounds(tmp_path, env, message):
    from robo_post.config import compose as compose_config
    from robo_post.pipelines.steer import steer

    actor = _pendulum_actor(str(tmp_path / "actor"))
    out = str(tmp_path / "deploy")
    cfg = compose_config("steer", ["env=gym", f"env.name={env}", "actor.kind=registry", f"actor.store={actor}",
                                   "prior.kind=registry", f"prior.store={actor}", f"store={out}", "show=false"])
    with pytest.raises(SteeringSourceError, match=message):
        steer(cfg)
    assert not os.path.exists(out)


def test_steer_refuses_an_sb3_actor_built_for_other_action_bounds(tmp_path):
    from stable_baselines3 import PPO

    from robo_post.config import compose as compose_config
    from robo_post.pipelines.steer import steer

    path = str(tmp_path / "ppo.zip")
    PPO("MlpPolicy", "Pendulum-v1", n_steps=64, batch_size=32, device="cpu", seed=0).save(path)
    prior = _pendulum_actor(str(tmp_path / "prior"))
    out = str(tmp_path / "deploy")
    cfg = compose_config("steer", ["env=gym", "env.name=robo_post_test/SteerHalfTorque-v0", "actor.kind=sb3",
                                   f"actor.path={path}", "actor.algo=PPO", "prior.kind=registry",
                                   f"prior.store={prior}", f"store={out}", "show=false"])
    with pytest.raises(SteeringSourceError, match=r"actor acts in \[\[-2.0\], \[2.0\]\]; the env's actions are in "
                                                  r"\[\[-1.0\], \[1.0\]\]"):
        steer(cfg)
    assert not os.path.exists(out)


def test_selector_store_of_another_env_is_refused_by_its_observations(tmp_path):
    """States recorded in InvertedPendulum (4 values) for an actor and an env observing 3."""
    from robo_post.config import compose as compose_config
    from robo_post.pipelines.steer import steer

    other = str(tmp_path / "other")
    run_cli("collect", "env=InvertedPendulum-v5", "policy=random", "episodes=1", "fleet.n_clients=1",
            f"store={other}", "show=false")
    actor = _pendulum_actor(str(tmp_path / "actor"))
    out = str(tmp_path / "deploy")
    cfg = compose_config("steer", ["env=gym", "env.name=Pendulum-v1", "actor.kind=registry", f"actor.store={actor}",
                                   "prior.kind=registry", f"prior.store={actor}", "selector.kl_budget=1",
                                   f"selector.store={other}", f"store={out}", "show=false"])
    with pytest.raises(SteeringSourceError, match=r"selector.store .* records observations \{'observation': \(4,\)\}; "
                                                  r"env 'Pendulum-v1' observes \{'observation': \(3,\)\}"):
        steer(cfg)
    assert not os.path.exists(out)
