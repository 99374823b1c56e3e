"""Tabletop env and scripted experts: API conformance, determinism, task logic."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede importing mujoco

import re
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import robo_post.envs  # noqa: F401  (registers robo_post/Tabletop-v0)
from robo_post.envs.experts import make_expert
from robo_post.envs.tabletop import BLOCKS, PROPRIO_DIM, TASKS, ZONES, TabletopEnv, instructions

N_SEEDS = 20


def rollout(env: TabletopEnv, expert, seed: int) -> tuple[dict, list[float], list[bool]]:
    """Run one episode; returns the final info, the rewards and the terminated flags."""
    obs, info = env.reset(seed=seed)
    expert.reset(env)
    rewards, terminals = [], []
    done = False
    while not done:
        obs, reward, terminated, truncated, info = env.step(expert.act(obs, env))
        rewards.append(reward)
        terminals.append(terminated)
        done = terminated or truncated
    return info, rewards, terminals


def mentioned(text: str, names: tuple[str, ...]) -> set[str]:
    return {n for n in names if re.search(rf"\b{n}\b", text)}


@pytest.mark.parametrize("render_images", [False, True])
@pytest.mark.parametrize("task", ["reach", "sort"])
def test_check_env(task: str, render_images: bool) -> None:
    env = TabletopEnv(task, render_images=render_images, render_mode="rgb_array")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*infinity.*")  # proprio is unbounded by design
        warnings.filterwarnings("ignore", message=".*alternative render modes.*")
        check_env(env.unwrapped)
    env.close()


def test_registered_id_and_spaces() -> None:
    env = gym.make("robo_post/Tabletop-v0", task="place", render_images=False)
    obs, info = env.reset(seed=0)
    assert set(obs) == {"proprio", "task_id"}
    assert obs["proprio"].shape == (PROPRIO_DIM,) and obs["proprio"].dtype == np.float32
    assert obs["task_id"] == TASKS.index("place")
    assert env.action_space.shape == (4,)
    assert info["instruction"] == env.unwrapped.instruction and not info["success"]
    env.close()


def test_seeded_determinism() -> None:
    actions = np.random.default_rng(0).uniform(-1, 1, size=(25, 4)).astype(np.float32)

    def run(seed: int) -> list[dict]:
        env = TabletopEnv("place", render_images=True)
        observations = [env.reset(seed=seed)[0]]
        observations += [env.step(a)[0] for a in actions]
        env.close()
        return observations

    first, second, other = run(7), run(7), run(8)
    for a, b in zip(first, second):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(first[0]["proprio"], other[0]["proprio"])


@pytest.mark.parametrize("task", TASKS)
def test_expert_succeeds_and_reward_fires_once(task: str) -> None:
    env = TabletopEnv(task, render_images=False)
    expert = make_expert(task, seed=0)
    successes = 0
    for seed in range(N_SEEDS):
        info, rewards, terminals = rollout(env, expert, seed)
        successes += info["success"]
        # Sparse reward: exactly one 1.0, on the final (terminating) step, iff success.
        assert sum(rewards) == float(info["success"])
        assert terminals == [False] * (len(terminals) - 1) + [info["success"]]
        assert rewards[-1] == float(info["success"])
        if info["success"]:
            assert info["progress"] == 1.0
    assert successes / N_SEEDS >= 0.9


@pytest.mark.parametrize("task", TASKS)
def test_near_miss_mostly_fails(task: str) -> None:
    env = TabletopEnv(task, render_images=False)
    expert = make_expert(task, mode="near_miss", seed=0)
    infos = [rollout(env, expert, seed)[0] for seed in range(N_SEEDS)]
    assert np.mean([i["success"] for i in infos]) <= 0.3
    if task == "sort":
        # The first stage is done properly, so partial progress shows up.
        assert np.mean([i["progress"] for i in infos]) >= 0.4


@pytest.mark.parametrize("task", TASKS)
def test_instruction_splits(task: str) -> None:
    train, heldout = instructions(task, "train"), instructions(task, "heldout")
    assert len(train) + len(heldout) >= 4 and heldout
    assert not set(train) & set(heldout)
    assert instructions(task, "all") == train + heldout
    assert all(not mentioned(t, BLOCKS + ZONES) for t in train + heldout)  # colours come from the episode

    env = TabletopEnv(task, render_images=False, instruction_split="heldout")
    for seed in range(8):
        env.reset(seed=seed)
        text = env.instruction
        blocks = {s.block for s in env.stages if s.block is not None}
        zones = {s.zone for s in env.stages if s.zone is not None}
        assert mentioned(text, BLOCKS) == blocks and mentioned(text, ZONES) == zones
        first, last = env.stages[0], env.stages[-1]
        fill = dict(block=first.block, zone=first.zone, block2=last.block, zone2=last.zone)
        assert text in {t.format(**fill) for t in heldout}
        assert text not in {t.format(**fill) for t in train}


def test_image_observation_tracks_gripper() -> None:
    env = TabletopEnv("reach", render_images=True, image_size=48, render_every=3, render_mode="rgb_array")
    obs, _ = env.reset(seed=0)
    assert obs["image"].dtype == np.uint8 and obs["image"].shape == (48, 48, 3)
    assert obs["image"].std() > 0
    move = np.array([1.0, 0.0, 0.0, -1.0], dtype=np.float32)
    frames = [obs["image"]] + [env.step(move)[0]["image"] for _ in range(3)]
    # Re-rendered only every third step; the frames in between repeat the last one.
    np.testing.assert_array_equal(frames[0], frames[1])
    np.testing.assert_array_equal(frames[0], frames[2])
    assert np.abs(frames[3].astype(int) - frames[0].astype(int)).sum() > 0
    assert env.render().shape == (256, 256, 3)
    env.close()


def test_push_fails_when_the_block_is_carried() -> None:
    """Carrying the block into the zone and setting it down is a place, not a push."""
    env = TabletopEnv("push", render_images=False)
    pushed = [rollout(env, make_expert("push", seed=0), seed)[0]["success"] for seed in range(N_SEEDS)]
    carried = [rollout(env, make_expert("place", seed=0), seed)[0]["success"] for seed in range(N_SEEDS)]
    assert np.mean(pushed) >= 0.9
    assert not any(carried)
    # The same carry succeeds at the place task, so the push rule is what fails it.
    place = TabletopEnv("place", render_images=False)
    assert np.mean([rollout(place, make_expert("place", seed=0), seed)[0]["success"] for seed in range(N_SEEDS)]) >= 0.9
