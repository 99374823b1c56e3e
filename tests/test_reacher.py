"""Sparse Reacher (demonstration E3): observation layout, reward/termination semantics, scripted controllers."""

import numpy as np
import pytest

import robo_post.envs  # noqa: F401  (registers robo_post/SparseReacher-v0)
from robo_post.envs.reacher import (
    LINK0,
    LINK1,
    MAX_EPISODE_STEPS,
    SUCCESS_RADIUS,
    fingertip_jacobian,
    make_controller,
    make_env,
    rollout,
)

N_SEEDS = 20


def fingertip_xy(obs: np.ndarray) -> np.ndarray:
    """Forward kinematics from the cos/sin entries of the observation."""
    c0, c1, s0, s1 = obs[..., 0], obs[..., 1], obs[..., 2], obs[..., 3]
    return np.stack([LINK0 * c0 + LINK1 * (c0 * c1 - s0 * s1), LINK0 * s0 + LINK1 * (s0 * c1 + c0 * s1)], -1)


def test_observation_layout_matches_mujoco():
    env = make_env()
    obs, _ = env.reset(seed=0)
    assert obs.shape == (10,) and obs.dtype == np.float32
    for _ in range(5):
        obs, *_ = env.step(env.action_space.sample())
    raw = env.unwrapped
    tip, target = raw.get_body_com("fingertip")[:2], raw.get_body_com("target")[:2]
    np.testing.assert_allclose(obs[8:10], tip - target, atol=1e-5)  # float32 observations
    np.testing.assert_allclose(obs[4:6], target, atol=1e-5)
    np.testing.assert_allclose(fingertip_xy(obs), tip, atol=1e-5)


def test_jacobian_matches_finite_differences():
    rng = np.random.default_rng(0)
    q = rng.uniform(-np.pi, np.pi, (8, 2))

    def obs_of(q):
        o = np.zeros((len(q), 10))
        o[:, 0:2], o[:, 2:4] = np.cos(q), np.sin(q)
        return o

    eps = 1e-6
    numeric = np.stack([(fingertip_xy(obs_of(q + eps * np.eye(2)[j])) - fingertip_xy(obs_of(q - eps * np.eye(2)[j])))
                        / (2 * eps) for j in range(2)], -1)
    np.testing.assert_allclose(fingertip_jacobian(obs_of(q)), numeric, atol=1e-6)


def test_reward_and_termination_on_success():
    env = make_env()
    env.reset(seed=1)
    raw = env.unwrapped
    qpos, qvel = raw.data.qpos.copy(), np.zeros(raw.model.nv)
    qpos[2:4] = raw.get_body_com("fingertip")[:2]  # put the target under the fingertip
    raw.set_state(qpos, qvel)
    obs, reward, terminated, truncated, info = env.step(np.zeros(2, np.float32))
    assert np.linalg.norm(obs[8:10]) < SUCCESS_RADIUS
    assert (reward, terminated, truncated, info["is_success"]) == (1.0, True, False, True)


def test_zero_reward_and_truncation_when_far():
    env = make_env()
    obs, _ = env.reset(seed=0)
    assert np.linalg.norm(obs[8:10]) > 0.1
    rewards = []
    for t in range(MAX_EPISODE_STEPS):
        obs, reward, terminated, truncated, _ = env.step(np.zeros(2, np.float32))  # the arm barely moves
        rewards.append(reward)
        assert not terminated
        assert truncated == (t == MAX_EPISODE_STEPS - 1)
    assert set(rewards) == {0.0}


@pytest.mark.parametrize("kind,low,high", [("expert", 0.8, 1.0), ("biased", 0.0, 0.3), ("random", 0.0, 0.45)])
def test_controller_success_rates(kind, low, high):
    envs = [make_env() for _ in range(N_SEEDS)]
    controller = make_controller(kind, seed=0)
    episodes = rollout(envs, controller, list(range(N_SEEDS)), reset=controller.reset)
    rate = np.mean([e.success for e in episodes])
    assert low <= rate <= high, f"{kind}: success {rate}"
    for e in episodes:
        assert e.obs.shape == (e.length + 1, 10) and e.actions.shape == (e.length, 2)
        assert np.all(np.abs(e.actions) <= 1.0)
        assert e.length <= MAX_EPISODE_STEPS and (e.success or e.length == MAX_EPISODE_STEPS)
        assert e.rewards.sum() == float(e.success) and (not e.success or e.rewards[-1] == 1.0)


def test_rollout_executes_chunks_open_loop():
    envs = [make_env() for _ in range(3)]
    calls = []

    def act(obs):
        calls.append(len(obs))
        return np.zeros((len(obs), 5, 2), np.float32)

    episodes = rollout(envs, act, [0, 1, 2])
    assert len(calls) == MAX_EPISODE_STEPS // 5 and all(n == 3 for n in calls)
    assert [e.seed for e in episodes] == [0, 1, 2]
