"""Steering envs: the point mass and the dense Reacher with a fixed target, their scripted
experts and goal-conditioned priors (EnvSpec.priors, make_prior), and collection from the CLI."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede importing mujoco

import numpy as np
import pytest
from helpers import run_cli

from robo_post.envs import NoPriorError, UnknownExpertModeError, env_spec, make_prior
from robo_post.envs.point_mass import DT, PointMassError
from robo_post.envs.reacher import ReacherTargetError
from robo_post.store import Store


def batch(*observations):
    """A batch of flat-dict observations, each key stacked to (B, ...)."""
    return {k: np.stack([o[k] for o in observations]) for k in observations[0]}


def success_rate(name, n_episodes, **kwargs):
    """Fraction of episodes of the noise-free expert whose last step reports success."""
    spec = env_spec(name)
    env = spec.make(None, **kwargs)
    successes = []
    for seed in range(n_episodes):
        obs, _ = env.reset(seed=seed)
        act = spec.make_expert(env, 0.0, "expert", seed)
        done = False
        while not done:
            obs, _, terminated, truncated, info = env.step(act(obs))
            done = terminated or truncated
        successes.append(spec.success(info))
    env.close()
    return float(np.mean(successes))


# --- point mass --------------------------------------------------------------------
def test_point_mass_step_matches_the_hand_computed_dynamics():
    env = env_spec("point_mass").make(None, goal=[0.5, 0.5])
    env.reset(seed=0)
    raw = env.unwrapped
    raw.position, raw.velocity = np.array([0.2, -0.3]), np.array([0.5, 0.95])
    obs, reward, terminated, truncated, info = env.step(np.array([1.0, 1.0], np.float32))
    # v = clip((0.5, 0.95) + 0.1 * (1, 1), -1, 1) = (0.6, 1.0); x = (0.2, -0.3) + 0.1 * v = (0.26, -0.2)
    np.testing.assert_allclose(obs["velocity"], [0.6, 1.0], atol=1e-6)
    np.testing.assert_allclose(obs["position"], [0.26, -0.2], atol=1e-6)
    expected = np.hypot(0.5 - 0.26, 0.5 + 0.2)
    assert reward == pytest.approx(-expected) and info["distance"] == pytest.approx(expected)
    assert (terminated, truncated, info["is_success"]) == (False, False, False)


def test_point_mass_wall_clips_the_position_and_stops_the_motion_into_it():
    env = env_spec("point_mass").make(None)
    env.reset(seed=0)
    raw = env.unwrapped
    raw.position, raw.velocity = np.array([0.98, -0.5]), np.array([0.5, -0.2])
    obs, *_ = env.step(np.zeros(2, np.float32))
    np.testing.assert_allclose(obs["position"], [1.0, -0.52], atol=1e-6)
    np.testing.assert_allclose(obs["velocity"], [0.0, -0.2], atol=1e-6)  # only the component into the wall


def test_point_mass_success_within_the_radius():
    env = env_spec("point_mass").make(None, goal=[0.0, 0.0])
    env.reset(seed=0)
    env.unwrapped.position, env.unwrapped.velocity = np.array([0.05, 0.05]), np.zeros(2)
    *_, info = env.step(np.zeros(2, np.float32))
    assert info["is_success"] and info["distance"] == pytest.approx(np.hypot(0.05, 0.05))


def test_point_mass_fixed_goal_and_reset_determinism():
    fixed = env_spec("point_mass").make(None, goal=[0.3, -0.7])
    free = env_spec("point_mass").make(None)
    starts, goals = [], []
    for seed in (1, 2):
        obs, _ = fixed.reset(seed=seed)
        np.testing.assert_array_equal(obs["goal"], np.float32([0.3, -0.7]))
        np.testing.assert_array_equal(obs["velocity"], [0.0, 0.0])
        again, _ = free.reset(seed=seed)
        np.testing.assert_array_equal(again["position"], obs["position"])  # the goal kwarg leaves the start alone
        repeat, _ = free.reset(seed=seed)
        np.testing.assert_array_equal(repeat["goal"], again["goal"])
        np.testing.assert_array_equal(repeat["position"], again["position"])
        starts.append(obs["position"])
        goals.append(again["goal"])
        assert np.all(np.abs(obs["position"]) <= 0.8) and np.all(np.abs(again["goal"]) <= 0.8)
    assert not np.array_equal(starts[0], starts[1]) and not np.array_equal(goals[0], goals[1])


def test_point_mass_observations_are_in_their_declared_spaces():
    env = env_spec("point_mass").make(None)
    obs, _ = env.reset(seed=4)
    rng = np.random.default_rng(0)
    for _ in range(100):  # random accelerations hit walls and the velocity limit
        assert env.observation_space.contains(obs)
        assert all(v.dtype == np.float32 and v.shape == (2,) for v in obs.values())
        obs, *_ = env.step(rng.uniform(-1, 1, 2).astype(np.float32))


def test_point_mass_renders_the_goal_and_the_mass():
    env = env_spec("point_mass").make(None, goal=[-0.5, 0.5], render_mode="rgb_array")
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (64, 64, 3) and frame.dtype == np.uint8
    assert tuple(frame[16, 16]) == (40, 170, 60)  # the goal (-0.5, 0.5) is in the top-left quarter


def test_point_mass_rejects_a_goal_outside_the_arena():
    with pytest.raises(PointMassError, match=r"\[1.5, 0.0\]"):
        env_spec("point_mass").make(None, goal=[1.5, 0.0])


def test_point_mass_expert_reaches_random_goals():
    assert success_rate("point_mass", 40) >= 0.95


def test_point_mass_prior_is_the_noise_free_expert_and_the_pd_law():
    spec = env_spec("point_mass")
    env = spec.make(None)
    observations = [env.reset(seed=s)[0] for s in range(6)]
    prior = make_prior("point_mass", None, env)
    means = prior(batch(*observations))
    assert means.shape == (6, 2) and means.dtype == np.float32
    assert np.all(np.abs(means) <= 1.0)
    expert = spec.make_expert(env, 0.0, "expert", 0)
    np.testing.assert_array_equal(means, np.stack([expert(o) for o in observations]))
    # Unsaturated, the law is kp (g - x) - kd v with kp = 2, kd = 1.5.
    near = {"position": np.float32([[0.1, 0.1]]), "velocity": np.float32([[0.2, -0.2]]), "goal": np.float32([[0.2, 0.0]])}
    np.testing.assert_allclose(prior(near), [[2 * 0.1 - 1.5 * 0.2, 2 * -0.1 + 1.5 * 0.2]], atol=1e-6)


def test_point_mass_expert_noise_is_seeded():
    spec = env_spec("point_mass")
    env = spec.make(None)
    obs, _ = env.reset(seed=0)
    a, b, c = (spec.make_expert(env, 0.3, "expert", s)(obs) for s in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    with pytest.raises(UnknownExpertModeError, match="near_miss"):
        spec.make_expert(env, 0.0, "near_miss", 0)


# --- reacher -----------------------------------------------------------------------
def test_reacher_fixed_target_shows_in_the_observation():
    env = env_spec("reacher").make(None, target=[0.12, -0.08])
    for seed in (0, 1):
        obs, info = env.reset(seed=seed)
        o = obs["observation"]
        assert o.shape == (10,) and o.dtype == np.float32
        np.testing.assert_allclose(o[4:6], [0.12, -0.08], atol=1e-6)
        raw = env.unwrapped
        tip_to_target = raw.get_body_com("fingertip") - raw.get_body_com("target")
        np.testing.assert_allclose(o[8:10], tip_to_target[:2], atol=1e-5)
        assert info["distance"] == pytest.approx(np.linalg.norm(o[8:10]), rel=1e-5)


def test_reacher_success_is_the_distance_within_the_radius():
    env = env_spec("reacher").make(None, success_radius=0.1)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    flags = []
    for _ in range(30):
        obs, reward, terminated, _, info = env.step(rng.uniform(-1, 1, 2).astype(np.float32))
        dist = np.linalg.norm(obs["observation"][8:10])
        assert info["distance"] == pytest.approx(dist, rel=1e-5) and info["is_success"] == (dist < 0.1)
        assert not terminated and reward < 0.0  # Reacher-v5's dense reward, no termination
        flags.append(info["is_success"])
    # Put the target under the fingertip: the next step is a success.
    raw = env.unwrapped
    qpos = raw.data.qpos.copy()
    qpos[2:4] = raw.get_body_com("fingertip")[:2]
    raw.set_state(qpos, np.zeros(raw.model.nv))
    *_, info = env.step(np.zeros(2, np.float32))
    assert info["is_success"] and info["distance"] < 0.1


def test_reacher_rejects_a_target_out_of_reach():
    with pytest.raises(ReacherTargetError, match="0.3"):
        env_spec("reacher").make(None, target=[0.3, 0.0])


def test_reacher_expert_reaches_random_targets():
    assert success_rate("reacher", 20) >= 0.9


def test_reacher_expert_reaches_a_fixed_target():
    assert success_rate("reacher", 5, target=[-0.05, 0.15]) == 1.0


def test_reacher_prior_batches_within_the_bounds():
    spec = env_spec("reacher")
    env = spec.make(None)
    observations = [env.reset(seed=s)[0] for s in range(5)]
    prior = make_prior("reacher", "jacobian_transpose", env)
    means = prior(batch(*observations))
    assert means.shape == (5, 2) and means.dtype == np.float32
    assert np.all(means >= -1.0) and np.all(means <= 1.0) and np.any(np.abs(means) > 0.1)
    expert = spec.make_expert(env, 0.0, "expert", 0)
    np.testing.assert_array_equal(means, np.stack([expert(o) for o in observations]))
    np.testing.assert_array_equal(prior(batch(observations[2])), means[2:3])  # rows are independent


# --- make_prior ----------------------------------------------------------------------
def test_make_prior_errors_name_the_env_and_its_priors():
    env = env_spec("point_mass").make(None)
    with pytest.raises(NoPriorError, match=r"'point_mass' has no prior 'straight'; its priors: goal_pd"):
        make_prior("point_mass", "straight", env)
    assert callable(make_prior(env_spec("point_mass"), "goal_pd", env))
    with pytest.raises(NoPriorError, match="'shutdown_grid' has no goal-conditioned priors"):
        make_prior("shutdown_grid", None, env)


# --- collection ------------------------------------------------------------------------
def test_collect_point_mass_from_the_cli(tmp_path):
    root = str(tmp_path / "store")
    run_cli("collect", "env=point_mass", "episodes=4", f"store={root}", "fleet.n_clients=1", "show=false", timeout=120)
    store = Store.open(root)
    assert store.schema.attrs["env"] == "point_mass"
    assert sorted(store.schema.observations) == ["goal", "position", "velocity"]
    episodes = store.snapshot().episodes()
    assert len(episodes) == 4 and {e.length for e in episodes} == {100} and all(e.success for e in episodes)
