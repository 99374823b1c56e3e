"""Sparse-reward Reacher and its scripted controllers (docs/methods.md, "Demonstrations: E3").

``SparseReacherEnv`` wraps gymnasium's ``Reacher-v5`` (MuJoCo, 2-link planar arm,
torque control in [-1, 1]^2):

- reward 1 and ``terminated`` on the first step with ||fingertip - target|| < 0.02 m,
  else reward 0;
- 50-step episodes (``truncated`` at the time limit, registered as
  ``robo_post/SparseReacher-v0``);
- observations as in Reacher-v5 (gymnasium 1.4), cast to float32, 10 entries:
  cos q (0:2), sin q (2:4), target xy (4:6), joint velocities (6:8),
  fingertip - target xy (8:10). The success test reads 8:10.

``DenseReacherEnv`` (``robo_post/Reacher-v0``, for steering) keeps Reacher-v5's dense
reward and never terminates (50-step limit), reports ``info["is_success"]`` (within
``success_radius``, default 5 cm, at every step) and can place the target at a fixed
point at every reset; same observations.

Scripted controllers for the offline data mix, all vectorised over a batch of
observations (N, 10) -> actions (N, 2):

- ``ReachController``: Jacobian-transpose PD, tau = J^T (kp e - kd J qdot) - kj qdot
  plus Gaussian action noise, clipped to [-1, 1]. The noisy expert aims at the
  target; the "biased" controller aims ``aim_offset`` (3 cm) short of it, on the
  line from the fingertip's start to the target, so it stops in a near miss.
  ``target_controller`` is the one with ``TARGET_GAINS`` (DenseReacherEnv's expert and prior).
- ``RandomController``: uniform actions.

``rollout`` steps N envs in lockstep with one batched controller/policy call per
chunk and returns the episodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium.envs.mujoco.reacher_v5 import ReacherEnv

OBS_DIM = 10
ACTION_DIM = 2
SUCCESS_RADIUS = 0.02  # m
DENSE_SUCCESS_RADIUS = 0.05  # m, DenseReacherEnv's default
MAX_EPISODE_STEPS = 50
LINK0, LINK1 = 0.1, 0.11  # reacher.xml: elbow 0.1 m from the base, fingertip 0.11 m from the elbow


class SparseReacherEnv(gym.Wrapper):
    """Reacher-v5 with a sparse success reward and termination on success.

    Args:
        success_radius: fingertip-target distance (m) that counts as success.
        **reacher_kwargs: passed to gymnasium's ``ReacherEnv`` (e.g. ``render_mode``).
    """

    def __init__(self, success_radius: float = SUCCESS_RADIUS, **reacher_kwargs: Any):
        super().__init__(ReacherEnv(**reacher_kwargs))
        self.success_radius = success_radius
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        return obs.astype(np.float32), {**info, "distance": distance(obs), "is_success": False}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, _, _, truncated, info = self.env.step(action)
        dist = distance(obs)
        success = bool(dist < self.success_radius)
        info = {**info, "distance": dist, "is_success": success}
        return obs.astype(np.float32), float(success), success, truncated, info


class ReacherTargetError(ValueError):
    """A fixed Reacher target that cannot work (not two finite numbers, or out of the arm's reach)."""


class DenseReacherEnv(gym.Wrapper):
    """Reacher-v5 with its dense reward, a success flag and an optional fixed target.

    Args:
        target: (x, y) the target is placed at on every reset (m, within the arm's reach
            ``LINK0 + LINK1``); ``None``: Reacher-v5's random target.
        success_radius: fingertip-target distance (m) below which a step reports success.
        **reacher_kwargs: passed to gymnasium's ``ReacherEnv`` (e.g. ``render_mode``).

    Raises:
        ReacherTargetError: a bad ``target``.
    """

    def __init__(self, target: list[float] | None = None, success_radius: float = DENSE_SUCCESS_RADIUS,
                 **reacher_kwargs: Any):
        super().__init__(ReacherEnv(**reacher_kwargs))
        self.target = None if target is None else _checked_target(target)
        self.success_radius = success_radius
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        if self.target is not None:
            raw = self.env.unwrapped
            qpos = raw.data.qpos.copy()
            qpos[2:4] = raw.goal = self.target.copy()  # the target's slide joints; set_state forwards the model
            raw.set_state(qpos, raw.data.qvel.copy())
            obs = raw._get_obs()
        return obs.astype(np.float32), self._info(info, obs)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs.astype(np.float32), float(reward), terminated, truncated, self._info(info, obs)

    def _info(self, info: dict, obs: np.ndarray) -> dict:
        dist = float(distance(obs))
        return {**info, "distance": dist, "is_success": dist < self.success_radius}


def _checked_target(target: list[float]) -> np.ndarray:
    t = np.asarray(target, np.float64)
    if t.shape != (2,) or not np.all(np.isfinite(t)) or np.linalg.norm(t) > LINK0 + LINK1:
        raise ReacherTargetError(
            f"Reacher target must be two finite numbers within {LINK0 + LINK1} m of the base, got {target!r}")
    return t


def distance(obs: np.ndarray) -> float | np.ndarray:
    """||fingertip - target|| from observation(s) (..., 10)."""
    return np.linalg.norm(np.asarray(obs)[..., 8:10], axis=-1)


def make_env() -> gym.Env:
    """A registered ``robo_post/SparseReacher-v0`` (50-step time limit)."""
    return gym.make("robo_post/SparseReacher-v0")


def fingertip_jacobian(obs: np.ndarray) -> np.ndarray:
    """d(fingertip xy)/d(q) (N, 2, 2) from the cos/sin of the joint angles in obs (N, 10)."""
    c0, c1, s0, s1 = obs[:, 0], obs[:, 1], obs[:, 2], obs[:, 3]
    c01, s01 = c0 * c1 - s0 * s1, s0 * c1 + c0 * s1
    return np.stack([
        np.stack([-LINK0 * s0 - LINK1 * s01, -LINK1 * s01], -1),
        np.stack([LINK0 * c0 + LINK1 * c01, LINK1 * c01], -1),
    ], -2)


@dataclass
class ReachController:
    """Jacobian-transpose PD reaching controller with Gaussian action noise.

    The Cartesian damping ``kd`` damps the stiff (tangential) direction and the joint
    damping ``kj`` the soft (radial) one, where J^T alone leaves the arm ringing.

    Attributes:
        noise_std: std of the Gaussian noise added to each action before clipping.
        aim_offset: aim this many metres short of the target (0 = the expert).
        kp, kd, kj: Cartesian stiffness, Cartesian damping, joint damping.
        seed: seed of the noise generator.
    """

    noise_std: float = 0.3
    aim_offset: float = 0.0
    kp: float = 100.0
    kd: float = 5.0
    kj: float = 0.1
    seed: int | None = None
    rng: np.random.Generator = field(init=False, repr=False)
    offset: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        self.offset = np.zeros((1, 2))

    def reset(self, obs: np.ndarray) -> None:
        """Fix the per-episode aim point from the first observations (N, 10)."""
        obs = np.atleast_2d(obs)
        start = obs[:, 8:10]  # fingertip - target: points from the target back to the start
        self.offset = self.aim_offset * start / np.maximum(np.linalg.norm(start, axis=-1, keepdims=True), 1e-6)

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        """Actions (N, 2) for observations (N, 10) (or (2,) for (10,))."""
        batch = np.atleast_2d(obs).astype(np.float64)
        J = fingertip_jacobian(batch)
        qdot = batch[:, 6:8]
        err = -batch[:, 8:10] + self.offset  # aim point - fingertip
        force = self.kp * err - self.kd * np.einsum("nij,nj->ni", J, qdot)
        action = np.einsum("nji,nj->ni", J, force) - self.kj * qdot
        action = action + self.noise_std * self.rng.standard_normal(action.shape)
        action = np.clip(action, -1.0, 1.0).astype(np.float32)
        return action if np.ndim(obs) == 2 else action[0]


# Gains of DenseReacherEnv's expert and prior: stiffer than the E3 defaults, which leave the
# arm (stretched at reset) stuck short of targets along it: ~92% vs 99.6% of random targets
# within 5 cm at the 50th step.
TARGET_GAINS = {"kp": 300.0, "kd": 10.0, "kj": 0.05}


def target_controller(noise_std: float = 0.0, seed: int | None = None) -> ReachController:
    """The ``ReachController`` toward the observed target with ``TARGET_GAINS`` (noise-free by default)."""
    return ReachController(noise_std=noise_std, seed=seed, **TARGET_GAINS)


@dataclass
class RandomController:
    """Uniform random actions in [-1, 1]^2 ("play" data)."""

    seed: int | None = None
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def reset(self, obs: np.ndarray) -> None:
        pass

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        shape = (len(obs), ACTION_DIM) if np.ndim(obs) == 2 else (ACTION_DIM,)
        return self.rng.uniform(-1.0, 1.0, shape).astype(np.float32)


def make_controller(kind: str, seed: int | None = None) -> ReachController | RandomController:
    """The E3 data sources: ``expert`` (noise 0.3), ``biased`` (3 cm short, noise 0.1) or ``random``."""
    if kind == "expert":
        return ReachController(noise_std=0.3, seed=seed)
    if kind == "biased":
        return ReachController(noise_std=0.1, aim_offset=0.03, seed=seed)
    if kind == "random":
        return RandomController(seed=seed)
    raise ValueError(f"unknown controller {kind!r}; choose expert, biased or random")


@dataclass
class Episode:
    """One recorded episode: T steps, T + 1 observations (the last is the final one)."""

    seed: int
    obs: np.ndarray  # (T + 1, 10) float32
    actions: np.ndarray  # (T, 2) float32
    rewards: np.ndarray  # (T,) float32
    success: bool  # the episode terminated (it only terminates on success)

    @property
    def length(self) -> int:
        return len(self.actions)


def rollout(envs: list[gym.Env], act: Callable[[np.ndarray], np.ndarray], seeds: list[int],
            reset: Callable[[np.ndarray], None] | None = None) -> list[Episode]:
    """Run one episode per env in lockstep; returns them in the order of ``seeds``.

    ``act(obs (N, 10)) -> (N, h, 2)`` chunks (or (N, 2) single actions) is called once
    per chunk for every env, finished or not, so its randomness is consumed the same
    way whatever the outcomes; a chunk is executed open-loop. ``reset(first_obs)``
    is called once after the resets (e.g. ``ReachController.reset``).
    """
    assert len(envs) >= len(seeds)
    n = len(seeds)
    obs = np.stack([env.reset(seed=s)[0] for env, s in zip(envs, seeds)])
    if reset is not None:
        reset(obs)
    traj_obs, traj_act, traj_rew = [[o.copy()] for o in obs], [[] for _ in range(n)], [[] for _ in range(n)]
    done, success = np.zeros(n, bool), np.zeros(n, bool)
    while not done.all():
        chunk = np.asarray(act(obs))
        chunk = chunk[:, None] if chunk.ndim == 2 else chunk
        for j in range(chunk.shape[1]):
            for i in np.flatnonzero(~done):
                o, r, term, trunc, _ = envs[i].step(chunk[i, j])
                obs[i] = o
                traj_obs[i].append(o)
                traj_act[i].append(chunk[i, j])
                traj_rew[i].append(r)
                done[i], success[i] = term or trunc, term
            if done.all():
                break
    return [Episode(s, np.stack(traj_obs[i]), np.stack(traj_act[i]).astype(np.float32),
                    np.asarray(traj_rew[i], np.float32), bool(success[i]))
            for i, s in enumerate(seeds)]
