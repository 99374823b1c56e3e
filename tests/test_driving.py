"""Tests for the highway-env driving scenarios (robo_post.envs.driving)."""

from __future__ import annotations

import math
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import robo_post.envs  # noqa: F401  (registers robo_post/Driving-v0)
from robo_post.envs.driving import SCENARIOS, DrivingEnv, make_driving_expert

INFO_KEYS = {
    "collision",
    "ttc_front",
    "off_road",
    "speed",
    "success",
    "task_id",
    "instruction",
    "reward_terms",
}


def rollout(env: DrivingEnv, actions: np.ndarray) -> list[tuple]:
    """Step ``env`` through ``actions`` (stopping at episode end) and record everything."""
    records = []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        records.append((obs["state"].copy(), reward, terminated, truncated, info))
        if terminated or truncated:
            break
    return records


def random_actions(n: int, seed: int = 0) -> np.ndarray:
    # Mild steering keeps the ego on the road for a while.
    actions = np.random.default_rng(seed).uniform(-1.0, 1.0, size=(n, 2))
    actions[:, 1] *= 0.01
    return actions.astype(np.float32)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_passes_gymnasium_env_checker(scenario: str) -> None:
    env = gym.make("robo_post/Driving-v0", scenario=scenario, duration=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any checker warning fails the test
        check_env(env.unwrapped)
    env.close()


def test_spaces_and_info() -> None:
    env = DrivingEnv("highway-fast", duration=15, observed_vehicles=4)
    assert env.action_space == gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    assert env.observation_space["state"].shape == (4 * 9,)

    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    assert INFO_KEYS <= info.keys()
    assert info["task_id"] == "driving/highway-fast"
    assert info["instruction"] == "drive safely on the highway"

    for obs, reward, terminated, truncated, info in rollout(env, random_actions(15)):
        assert env.observation_space.contains({"state": obs})
        assert np.isfinite(reward)
        assert INFO_KEYS <= info.keys()
        assert isinstance(info["collision"], bool) and isinstance(info["off_road"], bool)
        assert info["ttc_front"] >= 0.0
        assert 0.0 <= info["speed"] <= 40.0
        assert set(info["reward_terms"]) >= {"collision_reward", "high_speed_reward"}


def test_intentions_add_each_vehicles_route_direction() -> None:
    plain = DrivingEnv("roundabout", duration=10, observed_vehicles=5)
    env = DrivingEnv("roundabout", duration=10, observed_vehicles=5, intentions=True)
    assert env.observation_space["state"].shape == (5 * 11,)
    obs, _ = env.reset(seed=4)
    table = obs["state"].reshape(5, 11)
    np.testing.assert_array_equal(table[:, :9], plain.reset(seed=4)[0]["state"].reshape(5, 9))  # same columns first
    ego = env.core.vehicle
    seen = 0
    for row in table[1:][table[1:, 0] == 1]:
        # the vehicle at this row's relative position (x, y are normalized by the scenario's ranges)
        offset = row[1:3] * env._feature_scale[1:3]
        other = min(env.core.road.vehicles, key=lambda v: np.linalg.norm(v.position - ego.position - offset))
        np.testing.assert_allclose(row[9:], other.destination_direction, atol=1e-5)
        seen += bool(np.abs(row[9:]).sum() > 0)
    assert seen >= 2  # other vehicles' routes are visible
    plain.close()
    env.close()


def test_unknown_scenario_and_config_overrides_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown driving scenario"):
        DrivingEnv("moon-rover")
    with pytest.raises(ValueError, match="observation and action"):
        DrivingEnv(config={"action": {"type": "DiscreteMetaAction"}})


@pytest.mark.parametrize("scenario", ["highway-fast", "roundabout"])
def test_same_seed_and_actions_replay_exactly(scenario: str) -> None:
    actions = random_actions(12, seed=1)
    runs = []
    for _ in range(2):
        env = DrivingEnv(scenario, duration=12)
        obs, _ = env.reset(seed=7)
        runs.append((obs["state"], rollout(env, actions)))
    (obs_a, steps_a), (obs_b, steps_b) = runs
    np.testing.assert_array_equal(obs_a, obs_b)
    assert len(steps_a) == len(steps_b)
    for (o_a, r_a, te_a, tr_a, i_a), (o_b, r_b, te_b, tr_b, i_b) in zip(steps_a, steps_b):
        np.testing.assert_array_equal(o_a, o_b)
        assert (r_a, te_a, tr_a, i_a) == (r_b, te_b, tr_b, i_b)

    other, _ = DrivingEnv(scenario).reset(seed=8)
    assert not np.array_equal(other["state"], obs_a)


def test_clone_is_exact_and_independent() -> None:
    env = DrivingEnv("highway-fast", duration=40)
    env.reset(seed=11)
    rollout(env, random_actions(5, seed=2))
    ego = env.core.vehicle
    before = (ego.position.copy(), ego.speed, env.core.time, env.core.np_random.bit_generator.state)

    twin = env.clone()
    assert twin.core is not env.core and twin.core.vehicle is not ego
    actions = random_actions(10, seed=3)
    from_twin = rollout(twin, actions)

    # Stepping the clone left the original untouched ...
    np.testing.assert_array_equal(ego.position, before[0])
    assert (ego.speed, env.core.time, env.core.np_random.bit_generator.state) == before[1:]
    # ... and the original then replays the clone's future exactly.
    from_env = rollout(env, actions)
    assert len(from_env) == len(from_twin) == 10
    for (o_a, r_a, te_a, tr_a, i_a), (o_b, r_b, te_b, tr_b, i_b) in zip(from_env, from_twin):
        np.testing.assert_array_equal(o_a, o_b)
        assert (r_a, te_a, tr_a, i_a) == (r_b, te_b, tr_b, i_b)


def test_non_reactive_clone_holds_other_speeds() -> None:
    env = DrivingEnv("highway-fast")
    env.reset(seed=5)
    twin = env.clone(reactive=False)
    others = [v for v in twin.core.road.vehicles if v is not twin.core.vehicle]
    speeds = [v.speed for v in others]
    rollout(twin, np.zeros((5, 2), np.float32))
    assert [v.speed for v in others] == pytest.approx(speeds)
    # The original's traffic stays reactive (IDM changes some speeds).
    originals = [v for v in env.core.road.vehicles if v is not env.core.vehicle]
    rollout(env, np.zeros((5, 2), np.float32))
    assert [v.speed for v in originals] != pytest.approx(speeds)


def test_flooring_it_closes_in_and_crashes() -> None:
    env = DrivingEnv("highway-fast", duration=60)
    env.reset(seed=0)
    steps = rollout(env, np.tile(np.array([1.0, 0.0], np.float32), (60, 1)))
    *_, (_, reward, terminated, truncated, info) = steps
    assert info["collision"] and terminated and not truncated and not info["success"]
    assert any(math.isfinite(step[4]["ttc_front"]) for step in steps[:-1])
    assert min(step[4]["ttc_front"] for step in steps) < 2.0


def test_steering_off_the_road_terminates() -> None:
    env = DrivingEnv("highway-fast", duration=30)
    env.reset(seed=0)
    *_, (_, _, terminated, _, info) = rollout(env, np.tile(np.array([0.0, 1.0], np.float32), (30, 1)))
    assert terminated and info["off_road"] and not info["success"]


def test_truncates_at_duration_with_success() -> None:
    env = DrivingEnv("highway-fast", duration=20)
    env.reset(seed=1)
    expert = make_driving_expert()
    steps = []
    while not steps or not (steps[-1][2] or steps[-1][3]):
        steps += rollout(env, [expert(env)])
    assert len(steps) == 20
    _, _, terminated, truncated, info = steps[-1]
    assert truncated and not terminated and info["success"]
    assert not any(step[4]["success"] for step in steps[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_expert_completes_episodes(scenario: str) -> None:
    env = gym.make("robo_post/Driving-v0", scenario=scenario, duration=40)
    expert = make_driving_expert(noise=0.05, seed=0)
    for seed in (0, 1):
        env.reset(seed=seed)
        done = False
        while not done:
            action = expert(env)
            assert env.action_space.contains(action)
            obs, _, terminated, truncated, info = env.step(action)
            assert env.observation_space.contains(obs)
            done = terminated or truncated
        assert info["success"], (scenario, seed, info)
