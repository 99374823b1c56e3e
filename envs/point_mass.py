"""A 2-D point mass driven to a goal: the smallest goal-reaching env (steering experiments).

- State: position x and velocity v in the arena [-1, 1]^2; the goal g.
- Action: acceleration a in [-1, 1]^2.
- Dynamics (``DT`` = 0.1 s): v <- clip(v + a dt, -1, 1); x <- clip(x + v dt, -1, 1); a
  velocity component that drives the mass into a wall is zeroed there.
- Reset: x uniform in [-0.8, 0.8]^2, v = 0; g the constructor's fixed ``goal``, else
  uniform in [-0.8, 0.8]^2 every episode; all from the reset seed.
- Reward -||x' - g|| after each step; ``info["is_success"]`` = ||x - g|| < ``SUCCESS_RADIUS``
  at every step (so the last step says whether the episode ended at the goal) and
  ``info["distance"]`` = ||x - g||. Episodes last 100 steps (registered time limit).

Observation: flat Dict ``{"position", "velocity", "goal"}`` of float32 (2,) Boxes.

``goal_pd`` is the PD controller toward the observed goal, batched: the scripted
expert (plus noise) and the goal-conditioned prior of the env's registry entry.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

DT = 0.1  # s per step
ARENA = 1.0  # positions and velocities stay in [-ARENA, ARENA]^2
MAX_ACCEL = 1.0
START_BOX = 0.8  # starts and random goals: uniform in [-START_BOX, START_BOX]^2
SUCCESS_RADIUS = 0.1
MAX_EPISODE_STEPS = 100
KP, KD = 2.0, 1.5  # goal_pd gains (see goal_pd)
RENDER_SIZE = 64  # pixels


class PointMassError(ValueError):
    """A point-mass setting that cannot work (e.g. a goal outside the arena)."""


class PointMassEnv(gym.Env):
    """The point mass (see the module docstring).

    Args:
        goal: fixed goal (x, y) in the arena for every episode; ``None``: a random goal per episode.
        render_mode: ``"rgb_array"`` (a ``RENDER_SIZE`` square image) or ``None``.

    Raises:
        PointMassError: ``goal`` is not two finite numbers inside the arena, or an unknown render mode.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": int(round(1 / DT))}

    def __init__(self, goal: Sequence[float] | None = None, render_mode: str | None = None):
        if render_mode not in (None, "rgb_array"):
            raise PointMassError(f"point mass render_mode must be None or 'rgb_array', got {render_mode!r}")
        self.fixed_goal = None if goal is None else _checked_goal(goal)
        self.render_mode = render_mode
        box = spaces.Box(-ARENA, ARENA, (2,), np.float32)
        self.observation_space = spaces.Dict({"position": box, "velocity": box, "goal": box})
        self.action_space = spaces.Box(-MAX_ACCEL, MAX_ACCEL, (2,), np.float32)
        self.position = np.zeros(2)
        self.velocity = np.zeros(2)
        self.goal = np.zeros(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
        super().reset(seed=seed)
        self.position = self.np_random.uniform(-START_BOX, START_BOX, 2)
        self.velocity = np.zeros(2)
        # Drawn even for a fixed goal, so a seed gives the same start whatever the goal.
        random_goal = self.np_random.uniform(-START_BOX, START_BOX, 2)
        self.goal = random_goal if self.fixed_goal is None else self.fixed_goal.copy()
        return self._obs(), self._info()

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict]:
        accel = np.clip(np.asarray(action, np.float64).reshape(2), -MAX_ACCEL, MAX_ACCEL)
        self.velocity = np.clip(self.velocity + accel * DT, -ARENA, ARENA)
        moved = self.position + self.velocity * DT
        self.position = np.clip(moved, -ARENA, ARENA)
        # A wall stops the motion into it (the clipped components were moving outwards).
        self.velocity[moved != self.position] = 0.0
        info = self._info()
        return self._obs(), -info["distance"], False, False, info

    def _obs(self) -> dict[str, np.ndarray]:
        return {"position": self.position.astype(np.float32), "velocity": self.velocity.astype(np.float32),
                "goal": self.goal.astype(np.float32)}

    def _info(self) -> dict[str, Any]:
        dist = float(np.linalg.norm(self.position - self.goal))
        return {"distance": dist, "is_success": dist < SUCCESS_RADIUS}

    def render(self) -> np.ndarray | None:
        """An RGB image (``RENDER_SIZE`` square, y up): the goal as a green disc, the mass as a blue dot."""
        if self.render_mode != "rgb_array":
            return None
        frame = np.full((RENDER_SIZE, RENDER_SIZE, 3), 255, np.uint8)
        rows, cols = np.mgrid[0:RENDER_SIZE, 0:RENDER_SIZE]
        scale = (RENDER_SIZE - 1) / (2 * ARENA)
        for point, radius, colour in ((self.goal, SUCCESS_RADIUS, (40, 170, 60)), (self.position, 0.05, (30, 60, 200))):
            col, row = (point[0] + ARENA) * scale, (ARENA - point[1]) * scale
            frame[(rows - row) ** 2 + (cols - col) ** 2 <= max(radius * scale, 1.0) ** 2] = colour
        return frame


def _checked_goal(goal: Sequence[float]) -> np.ndarray:
    g = np.asarray(goal, np.float64)
    if g.shape != (2,) or not np.all(np.isfinite(g)) or np.any(np.abs(g) > ARENA):
        raise PointMassError(f"point mass goal must be two finite numbers in [-{ARENA}, {ARENA}], got {goal!r}")
    return g


def goal_pd(obs: Mapping[str, np.ndarray]) -> np.ndarray:
    """PD acceleration toward the observed goal for a batch of observations (each key (B, 2)):
    clip(KP (goal - position) - KD velocity, -1, 1), (B, 2) float32.

    With these gains the mass enters the success radius within ~20 of the episode's
    100 steps from any start and goal in [-0.8, 0.8]^2 and stays there.
    """
    position, velocity, goal = (np.asarray(obs[k], np.float64) for k in ("position", "velocity", "goal"))
    return np.clip(KP * (goal - position) - KD * velocity, -MAX_ACCEL, MAX_ACCEL).astype(np.float32)
