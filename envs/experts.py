"""Scripted experts for the tabletop tasks.

Each expert is a small closed-loop controller over privileged simulator state
(block, zone and gripper positions read from the env), so it recovers from its own
noise. ``mode="near_miss"`` keeps the same motions but aims slightly wrong (a point
just outside the zone, too shallow a lift, a grasp closed in the air), which yields
plausible failed rollouts for play data and for training critics.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from robo_post.envs.tabletop import (
    BLOCK_HALF,
    LAYOUT_HALF_EXTENT,
    LIFT_HEIGHT,
    MAX_DELTA,
    REACH_HEIGHT,
    SUCCESS_RADIUS,
    TASKS,
    TabletopEnv,
)

Mode = Literal["expert", "near_miss"]

OPEN, CLOSE = -1.0, 1.0
HOVER_CLEARANCE = 0.08  # height above a block's centre from which to descend onto it
CARRY_HEIGHT = 0.12  # grasp-point height while carrying a block
PUSH_STANDOFF = 0.05  # distance behind the block's centre where a push starts
PUSH_CONTACT = 0.03  # distance behind the block's centre while in contact
PUSH_HEIGHT = 0.02  # grasp-point height while pushing
CLEAR_HEIGHT = 0.07  # grasp-point height at which the fingers clear every block
MISS_OFFSET = 0.085  # near-miss aim point distance from the zone centre


def _toward(env: TabletopEnv, target: np.ndarray, grip: float) -> np.ndarray:
    """Action that moves the gripper straight at ``target`` as fast as allowed."""
    delta = (np.asarray(target) - env.ee_position) / MAX_DELTA
    delta /= max(1.0, float(np.max(np.abs(delta))))  # keep the direction when saturating
    return np.array([*delta, grip])


def _miss_point(center: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A point ``MISS_OFFSET`` from ``center`` in a random direction, kept on the table."""
    for _ in range(16):
        angle = rng.uniform(0.0, 2.0 * np.pi)
        point = center[:2] + MISS_OFFSET * np.array([np.cos(angle), np.sin(angle)])
        if np.all(np.abs(point) < LAYOUT_HALF_EXTENT + 0.04):
            break
    return np.array([*point, 0.0])


class ScriptedExpert:
    """Base class: per-task ``_act`` plus Gaussian action noise.

    Args:
        noise: standard deviation of Gaussian noise added to every action dimension.
        mode: ``"expert"`` to solve the task, ``"near_miss"`` to fail plausibly.
        seed: seeds the noise and the near-miss choices.
    """

    def __init__(self, noise: float = 0.0, mode: Mode = "expert", seed: int | None = None) -> None:
        if mode not in ("expert", "near_miss"):
            raise ValueError(f"unknown mode {mode!r}; expected 'expert' or 'near_miss'")
        self.noise = noise
        self.mode = mode
        self.rng = np.random.default_rng(seed)

    @property
    def near_miss(self) -> bool:
        return self.mode == "near_miss"

    def reset(self, env: Any) -> None:
        """Prepare for a new episode; call right after ``env.reset``."""

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        """Next action (float32, in [-1, 1]) for the current state of ``env``."""
        action = self._act(env.unwrapped)
        if self.noise > 0:
            action = action + self.rng.normal(0.0, self.noise, size=action.shape)
        return np.clip(action, -1.0, 1.0).astype(np.float32)

    def _act(self, env: TabletopEnv) -> np.ndarray:
        raise NotImplementedError


class ReachExpert(ScriptedExpert):
    """Fly to just above the zone centre.

    Near miss: travel at the start height to a point beside the zone, then descend
    there (a straight diagonal path could graze the zone on the way).
    """

    def reset(self, env: Any) -> None:
        zone = env.unwrapped.zone_position(env.unwrapped.stages[0].zone)
        self._goal = _miss_point(zone, self.rng) if self.near_miss else zone
        self._goal[2] = REACH_HEIGHT - 0.025

    def _act(self, env: TabletopEnv) -> np.ndarray:
        ee = env.ee_position
        if self.near_miss and np.linalg.norm(ee[:2] - self._goal[:2]) > 0.01:
            return _toward(env, np.array([*self._goal[:2], ee[2]]), OPEN)
        return _toward(env, self._goal, OPEN)


class PushExpert(ScriptedExpert):
    """Stand behind the block on the block-zone line, then push it along that line.

    The line is recomputed every step from the block's current position, so a block
    that turns or drifts is re-approached. Near miss: pushes toward a point beside
    the zone whose straight path never enters it.
    """

    def reset(self, env: Any) -> None:
        env = env.unwrapped
        stage = env.stages[0]
        self._block = stage.block
        zone = env.zone_position(stage.zone)
        self._goal = zone[:2]
        self._arrived = False
        if self.near_miss:
            start = env.block_position(stage.block)[:2]
            u = (zone[:2] - start) / np.linalg.norm(zone[:2] - start)
            side = np.array([-u[1], u[0]]) * self.rng.choice([-1.0, 1.0])
            if np.any(np.abs(zone[:2] + MISS_OFFSET * side) > LAYOUT_HALF_EXTENT + 0.04):
                side = -side
            self._goal = zone[:2] + MISS_OFFSET * side

    def _act(self, env: TabletopEnv) -> np.ndarray:
        block = env.block_position(self._block)[:2]
        ee = env.ee_position
        to_goal = self._goal - block
        remaining = float(np.linalg.norm(to_goal))
        # Once there, back off for good rather than nudging the block around.
        self._arrived = self._arrived or remaining < 0.015
        if self._arrived:
            return _toward(env, np.array([*ee[:2], CLEAR_HEIGHT]), CLOSE)
        u = to_goal / remaining
        rel = ee[:2] - block
        along = float(rel @ u)
        lateral = float(np.linalg.norm(rel - along * u))
        low = ee[2] < PUSH_HEIGHT + 0.015
        if low and along < -0.02 and lateral < 0.015:
            # In contact position: advance along the line, slowing down near the goal.
            step = min(MAX_DELTA, remaining)
            xy = block + u * (step - PUSH_CONTACT)
            return _toward(env, np.array([*xy, PUSH_HEIGHT]), CLOSE)
        standoff = block - u * PUSH_STANDOFF
        if float(np.linalg.norm(ee[:2] - standoff)) < 0.012:
            return _toward(env, np.array([*standoff, PUSH_HEIGHT]), CLOSE)
        if ee[2] < CLEAR_HEIGHT - 0.015:
            # Rise before moving sideways so the fingers never sweep the block.
            return _toward(env, np.array([*ee[:2], CLEAR_HEIGHT]), CLOSE)
        return _toward(env, np.array([*standoff, CLEAR_HEIGHT]), CLOSE)


class _PickPlace:
    """Grasp ``block`` from above, then either lift it or set it down at ``goal_xy``.

    Reactive: whether the block is held is re-read every step, so a dropped block is
    simply picked up again. ``grasp_offset`` raises the height at which the fingers
    close (a near miss grasps thin air); ``lift_height`` is where a pick stops.
    """

    def __init__(
        self,
        block: str,
        goal_xy: np.ndarray | None,
        lift_height: float = CARRY_HEIGHT + 0.03,
        grasp_offset: float = 0.0,
    ) -> None:
        self.block = block
        self.goal_xy = goal_xy
        self.lift_height = lift_height
        self.grasp_offset = grasp_offset
        self._released = False

    def act(self, env: TabletopEnv) -> np.ndarray:
        block = env.block_position(self.block)
        ee = env.ee_position
        gap = env.gripper_gap
        near_block = np.linalg.norm(ee[:2] - block[:2]) < 0.02 and abs(ee[2] - block[2]) < 0.02
        holding = near_block and gap < 2 * BLOCK_HALF + 0.004

        if self.goal_xy is not None:
            at_goal = np.linalg.norm(block[:2] - self.goal_xy) < SUCCESS_RADIUS - 0.01
            if self._released and at_goal:
                return _toward(env, np.array([*ee[:2], CARRY_HEIGHT]), OPEN)
            self._released = False
            if holding:
                return self._carry(env, ee)
        elif holding:
            return _toward(env, np.array([*ee[:2], self.lift_height]), CLOSE)
        return self._grasp(env, ee, block, gap)

    def _grasp(self, env: TabletopEnv, ee: np.ndarray, block: np.ndarray, gap: float) -> np.ndarray:
        grasp_z = block[2] + self.grasp_offset
        hover = np.array([*block[:2], block[2] + HOVER_CLEARANCE])
        xy_error = float(np.linalg.norm(ee[:2] - block[:2]))
        # Looser alignment once descending, so action noise does not bounce it back up.
        tolerance = 0.012 if ee[2] > block[2] + 0.05 else 0.02
        if xy_error > tolerance:
            if ee[2] < block[2] + 0.05 and xy_error > 0.03:
                return _toward(env, np.array([*ee[:2], hover[2]]), OPEN)  # climb clear first
            return _toward(env, hover, OPEN)
        if gap < 2 * BLOCK_HALF - 0.01:
            # Closed on nothing: open and back off to try again.
            return _toward(env, np.array([*block[:2], grasp_z + 0.03]), OPEN)
        if ee[2] > grasp_z + 0.008:
            return _toward(env, np.array([*block[:2], grasp_z]), OPEN)
        return _toward(env, np.array([*block[:2], grasp_z]), CLOSE)

    def _carry(self, env: TabletopEnv, ee: np.ndarray) -> np.ndarray:
        xy_error = float(np.linalg.norm(ee[:2] - self.goal_xy))
        if xy_error > 0.03:
            if ee[2] < CARRY_HEIGHT - 0.03:
                return _toward(env, np.array([*ee[:2], CARRY_HEIGHT]), CLOSE)  # climb clear first
            return _toward(env, np.array([*self.goal_xy, CARRY_HEIGHT]), CLOSE)
        set_down = BLOCK_HALF + 0.004
        if xy_error > 0.015 or ee[2] > set_down + 0.006:
            return _toward(env, np.array([*self.goal_xy, set_down]), CLOSE)
        self._released = True
        return _toward(env, np.array([*self.goal_xy, set_down]), OPEN)


class PickExpert(ScriptedExpert):
    """Grasp the block and lift it well above ``LIFT_HEIGHT``.

    Near miss: either lifts only half way, or closes the fingers above the block.
    """

    def reset(self, env: Any) -> None:
        block = env.unwrapped.stages[0].block
        if not self.near_miss:
            self._controller = _PickPlace(block, None)
        elif self.rng.random() < 0.5:
            self._controller = _PickPlace(block, None, lift_height=LIFT_HEIGHT - 0.045)
        else:
            self._controller = _PickPlace(block, None, grasp_offset=0.045)

    def _act(self, env: TabletopEnv) -> np.ndarray:
        return self._controller.act(env)


class PlaceExpert(ScriptedExpert):
    """Pick the block, carry it over the zone, set it down and open.

    Used for ``place`` and, stage by stage, for ``sort``. Near miss: the last stage
    is set down just outside its zone.
    """

    def reset(self, env: Any) -> None:
        env = env.unwrapped
        self._controllers = []
        for k, stage in enumerate(env.stages):
            goal = env.zone_position(stage.zone)
            if self.near_miss and k == len(env.stages) - 1:
                goal = _miss_point(goal, self.rng)
            self._controllers.append(_PickPlace(stage.block, goal[:2]))

    def _act(self, env: TabletopEnv) -> np.ndarray:
        return self._controllers[min(env.stage, len(self._controllers) - 1)].act(env)


_EXPERTS: dict[str, type[ScriptedExpert]] = {
    "reach": ReachExpert,
    "push": PushExpert,
    "pick": PickExpert,
    "place": PlaceExpert,
    "sort": PlaceExpert,
}


def make_expert(task: str, noise: float = 0.0, mode: Mode = "expert", seed: int | None = None) -> ScriptedExpert:
    """Scripted expert for ``task``; call ``reset(env)`` after every ``env.reset``.

    Args:
        task: one of ``TASKS``.
        noise: Gaussian action-noise standard deviation.
        mode: ``"expert"`` or ``"near_miss"`` (plausible but failing behaviour).
        seed: seeds the noise and near-miss randomness.
    """
    if task not in _EXPERTS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return _EXPERTS[task](noise=noise, mode=mode, seed=seed)
