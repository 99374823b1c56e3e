"""Driving environments: highway-env scenarios behind robo-post's env conventions.

:class:`DrivingEnv` wraps a highway-env scene with

- a fixed-size dict observation ``{"state": Box(float32)}`` (flattened, normalized
  Kinematics features of the ego and its nearest vehicles),
- a continuous ``(acceleration, steering)`` action in ``[-1, 1]^2``,
- per-step event info (collision, time-to-collision, off-road, speed) and
  per-episode task metadata (``task_id``, ``instruction``, ``success``),
- :meth:`DrivingEnv.clone` for exact (or non-reactive) counterfactual rollouts, and
  :meth:`DrivingEnv.candidate_extras`, which scores candidate action chunks in such
  clones (the counterfactual proxy of ``algo=craft`` with a proposal policy).

:func:`make_driving_expert` returns a scripted lane-keeping controller that reads
privileged simulator state, so driving data can be collected before any policy
has been trained.
"""

from __future__ import annotations

import copy
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from highway_env.envs.common.abstract import AbstractEnv
from highway_env.envs.highway_env import HighwayEnvFast
from highway_env.envs.merge_env import ConnectedLaneMergeEnv
from highway_env.envs.roundabout_env import ConnectedLaneRoundaboutEnv
from highway_env.road.road import LaneIndex, Road
from highway_env.utils import wrap_to_pi
from highway_env.vehicle.controller import ControlledVehicle
from highway_env.vehicle.kinematics import Vehicle

if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
    # No display: highway-env's pygame draws its frames offscreen (SDL would probe Wayland and
    # print an XDG_RUNTIME_DIR error at every report). Read when the first frame is drawn.
    os.environ.setdefault("SDL_VIDEODRIVER", "offscreen")

__all__ = [
    "MAX_ACCELERATION",
    "MAX_STEERING",
    "PROXY_WEIGHTS",
    "SCENARIOS",
    "TTC_THRESHOLD",
    "CandidateChunkError",
    "DrivingEnv",
    "DrivingExpert",
    "chunk_scores",
    "make_driving_expert",
]


class _ContinuousMergeEnv(ConnectedLaneMergeEnv):
    """highway-env's merge scene, usable with a continuous action.

    Its reward tests ``action in [0, 2]`` (discrete lane-change meta-actions), which
    is ambiguous for an array. A continuous action has no discrete lane change, so
    the lane-change term is evaluated as "no lane change"; all other terms are kept.
    """

    def _rewards(self, action: Any) -> dict[str, float]:
        return super()._rewards(None)


class _ContinuousRoundaboutEnv(ConnectedLaneRoundaboutEnv):
    """highway-env's roundabout scene, usable with a continuous action (see merge)."""

    def _rewards(self, action: Any) -> dict[str, float]:
        return super()._rewards(None)


@dataclass(frozen=True)
class _Scenario:
    """Static description of one driving scenario."""

    env_cls: type[AbstractEnv]
    seconds: float  # default episode length [s]
    instruction: str
    route: tuple[str, str]  # (start node, goal node) the expert drives along
    cruise_speed: float  # expert's desired speed [m/s]
    xy_range: tuple[float, float]  # normalization half-ranges for x and y [m]


_SCENARIO_SPECS: dict[str, _Scenario] = {
    "highway-fast": _Scenario(
        env_cls=HighwayEnvFast,
        seconds=30.0,
        instruction="drive safely on the highway",
        route=("0", "1"),
        cruise_speed=25.0,
        xy_range=(100.0, 12.0),
    ),
    "merge": _Scenario(
        env_cls=_ContinuousMergeEnv,
        seconds=20.0,  # the scene itself ends once the ego has passed the ramp (~12 s)
        instruction="drive past the on-ramp and let merging traffic in",
        route=("a", "d"),
        cruise_speed=25.0,
        xy_range=(100.0, 16.0),
    ),
    "roundabout": _Scenario(
        env_cls=_ContinuousRoundaboutEnv,
        seconds=11.0,
        instruction="drive through the roundabout and take the north exit",
        route=("ser", "nxr"),
        cruise_speed=8.0,
        xy_range=(100.0, 100.0),
    ),
}

SCENARIOS: tuple[str, ...] = tuple(_SCENARIO_SPECS)
"""Names accepted by ``DrivingEnv(scenario=...)``."""

_FEATURES = ("presence", "x", "y", "vx", "vy", "cos_h", "sin_h", "lat_off", "ang_off")
# Lane offsets (lat_off [m], ang_off [rad]) make lane keeping learnable with a
# continuous steering action, also on curved roads.
_INTENTIONS = ("cos_d", "sin_d")
# highway-env's intentions: the unit vector from each vehicle to the end of its route, the
# part of a turn signal a driver reads (which exit a roundabout vehicle takes).
_LANE_WIDTH = 4.0  # highway-env's default lane width [m]

MAX_ACCELERATION = 5.0
"""Acceleration [m/s^2] at action[0] = +-1 (highway-env's default range)."""
MAX_STEERING = np.pi / 8
"""Front-wheel angle [rad] at action[1] = +-1. Half of highway-env's default, which at
highway speeds makes small policy errors throw the car off the road; still enough
for the roundabout's tightest curves."""


PROXY_WEIGHTS: dict[str, float] = {"speed": 0.4, "collision": -1.0, "ttc": -0.3}
"""Default per-step weights of a candidate chunk's counterfactual score (see :func:`chunk_scores`)."""

TTC_THRESHOLD = 1.5
"""Time-to-collision [s] with the car ahead below which a step is a TTC breach (an event of algo=craft)."""


class CandidateChunkError(ValueError):
    """Candidate action chunks, score weights, discount or continuation that chunk scoring cannot use."""


def _gap_and_closing_speed(ego: Vehicle, front: Vehicle) -> tuple[float, float]:
    """Bumper-to-bumper gap [m] and the rate it shrinks at [m/s].

    Measured along the line between the two vehicles rather than in lane
    coordinates, so it stays valid across lane segments and on curves.
    """
    offset = front.position - ego.position
    distance = float(np.linalg.norm(offset))
    gap = distance - (ego.LENGTH + front.LENGTH) / 2
    if distance == 0.0:
        return gap, 0.0
    return gap, float(np.dot(ego.velocity - front.velocity, offset / distance))


def _time_to_collision(road: Road, ego: Vehicle) -> float:
    """Seconds until the ego reaches the nearest vehicle ahead in its lane at current speeds.

    ``inf`` if there is no such vehicle or the gap is not closing.
    """
    front, _ = road.neighbour_vehicles(ego, ego.lane_index)
    if front is None:
        return float("inf")
    return _closing_time(*_gap_and_closing_speed(ego, front))


def off_right(road: Road, lane_index: LaneIndex) -> float:
    """How far a lane lies from the rightmost lane of its road segment, as a share of the
    lanes that could lie between: 0 in the rightmost lane or on a one-lane segment, 1 in
    the leftmost (the keep-right rule's violation, the ``off_right`` event)."""
    start, end, lane = lane_index
    lanes = len(road.network.graph[start][end])
    return 0.0 if lanes < 2 else float(lanes - 1 - lane) / (lanes - 1)


def _closing_time(gap: float, closing: float) -> float:
    """Seconds until a gap [m] closing at ``closing`` [m/s] is gone; ``inf`` if it is not closing."""
    return max(gap, 0.0) / closing if closing > 0.0 else float("inf")


def _coast(vehicle: Vehicle, action: dict | str | None = None) -> None:
    """Non-reactive behaviour: hold speed and follow the road, ignoring everyone else."""
    steering = 0.0
    if isinstance(vehicle, ControlledVehicle):
        vehicle.follow_road()
        steering = vehicle.steering_control(vehicle.target_lane_index)
    Vehicle.act(vehicle, {"steering": steering, "acceleration": 0.0})


def make_non_reactive(core: AbstractEnv) -> None:
    """Every vehicle of the scene but the controlled ones ignores the others from now on:
    it keeps its lane and speed (a cheap world model for counterfactual scoring)."""
    for vehicle in core.road.vehicles:
        if vehicle not in core.controlled_vehicles:
            vehicle.act = types.MethodType(_coast, vehicle)


class DrivingEnv(gym.Env[dict[str, np.ndarray], np.ndarray]):
    """A highway-env driving scenario with a continuous action and event info.

    Observation: ``{"state": Box(-1, 1, (observed_vehicles * 9,), float32)}``, the
    row-major flattening of a Kinematics table with one row per vehicle (ego first,
    then the nearest vehicles, zero rows when absent) and columns
    ``presence, x, y, vx, vy, cos_h, sin_h, lat_off, ang_off`` (with ``intentions``,
    11 columns: ``cos_d, sin_d`` follow). The ego row holds absolute x/y/vx/vy, other
    rows are relative to the ego; everything is normalized and clipped to ``[-1, 1]``.

    Action: ``Box(-1, 1, (2,), float32)`` = (acceleration, steering), mapped by
    highway-env's ``ContinuousAction`` to +-:data:`MAX_ACCELERATION` m/s^2 and
    +-:data:`MAX_STEERING` rad; the ego brakes to a stop but never reverses.

    Reward is highway-env's scenario reward. ``terminated`` on collision, off-road,
    or when the scene itself ends (merge: ramp passed); ``truncated`` after
    ``duration`` steps.

    Info keys (every step): ``collision``, ``ttc_front`` [s], ``off_road``,
    ``speed`` [m/s], ``success`` (True only on the last step of an episode that
    ended without collision or leaving the road), ``task_id``, ``instruction``,
    ``reward_terms`` (highway-env's per-term rewards), ``events`` (five floats:
    collision or off-road, TTC breach, progress, off the rightmost lane, blocked (always 0);
    the order and meaning of ``highway_meta.EVENTS``, with leaving the road counted as a crash).

    Args:
        scenario: one of :data:`SCENARIOS`.
        duration: episode length in policy steps; ``None`` uses the scenario's
            default length in seconds times ``policy_frequency``.
        policy_frequency: decisions per simulated second. Continuous steering needs
            more than highway-env's default 1 Hz to keep a lane.
        observed_vehicles: rows of the Kinematics table (ego included).
        intentions: add highway-env's intention columns (direction to the end of each
            vehicle's route), the information of turn signals. The scripted expert
            predicts other vehicles along their routes; without these columns a policy
            cannot tell a roundabout vehicle that exits before the ego's entry from one
            that passes it.
        oracle: :meth:`candidate_extras` also scores candidates in exact clones
            (``oracle_scores``), to measure the non-reactive proxy's bias.
        continuation: steps scored after each candidate chunk in :meth:`candidate_extras`,
            holding the chunk's last action (see :func:`chunk_scores`).
        config: extra highway-env config entries (e.g. ``{"vehicles_count": 10}``).
        render_mode: ``None`` or ``"rgb_array"``.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 5}

    def __init__(
        self,
        scenario: str = "highway-fast",
        duration: int | None = None,
        policy_frequency: int = 5,
        observed_vehicles: int = 5,
        intentions: bool = False,
        oracle: bool = False,
        continuation: int = 0,
        config: dict[str, Any] | None = None,
        render_mode: str | None = None,
    ) -> None:
        if continuation < 0:
            raise CandidateChunkError(f"continuation must be >= 0 steps, got {continuation}")
        if scenario not in _SCENARIO_SPECS:
            raise ValueError(f"unknown driving scenario {scenario!r}; choose from {SCENARIOS}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"unsupported render_mode {render_mode!r}")
        self.scenario = scenario
        self._spec = _SCENARIO_SPECS[scenario]
        if duration is None:
            duration = round(self._spec.seconds * policy_frequency)
        if duration < 1:
            raise ValueError(f"duration must be at least one step, got {duration}")
        self.duration = duration
        self.oracle = bool(oracle)
        self.continuation = int(continuation)
        self.task_id = f"driving/{scenario}"
        self.instruction = self._spec.instruction
        self.render_mode = render_mode
        self.metadata = {**self.metadata, "render_fps": policy_frequency}

        if config and {"observation", "action"} & config.keys():
            raise ValueError("DrivingEnv fixes the observation and action types; do not override them")
        # Symmetric half-ranges, one per feature, so normalizing is a division.
        # (Normalizing here in numpy rather than in highway-env's pandas code makes a
        # step about twice as fast.)
        x_range, y_range = self._spec.xy_range
        speed = Vehicle.MAX_SPEED
        features = _FEATURES + (_INTENTIONS if intentions else ())
        self._feature_scale = np.array(
            [1.0, x_range, y_range, speed, speed, 1.0, 1.0, _LANE_WIDTH, np.pi] + [1.0] * intentions * len(_INTENTIONS),
            dtype=np.float32,
        )
        core_config = {
            "observation": {
                "type": "Kinematics",
                "vehicles_count": observed_vehicles,
                "features": list(features),
                "observe_intentions": intentions,
                "absolute": False,
                "normalize": False,
                "order": "sorted",
            },
            "action": {
                "type": "ContinuousAction",
                "longitudinal": True,
                "lateral": True,
                "speed_range": [0.0, Vehicle.MAX_SPEED],  # brake to a stop, never reverse
                "acceleration_range": [-MAX_ACCELERATION, MAX_ACCELERATION],
                "steering_range": [-MAX_STEERING, MAX_STEERING],
            },
            "policy_frequency": policy_frequency,
            # Keep at least one simulation frame per decision.
            "simulation_frequency": max(
                policy_frequency, self._spec.env_cls.default_config()["simulation_frequency"]
            ),
            "duration": self.duration / policy_frequency,
            **(config or {}),
        }
        self._core = self._spec.env_cls(config=core_config, render_mode=render_mode)

        self.observation_space = spaces.Dict(
            {"state": spaces.Box(-1.0, 1.0, (observed_vehicles * len(features),), np.float32)}
        )
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._steps = 0

    @property
    def core(self) -> AbstractEnv:
        """The wrapped highway-env scene (privileged state: road, vehicles, lanes)."""
        return self._core

    @property
    def route(self) -> tuple[str, str]:
        """(start node, goal node) of the ego's intended path in the road network."""
        return self._spec.route

    @property
    def cruise_speed(self) -> float:
        """A safe desired speed for this scenario [m/s]."""
        return self._spec.cruise_speed

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        # highway-env draws every random scene element from its own np_random, so
        # seeding it is enough for exact replays.
        raw, core_info = self._core.reset(seed=seed)
        self._steps = 0
        return self._observation(raw), self._info(core_info, done=False)

    def step(
        self, action: np.ndarray
    ) -> tuple[dict[str, np.ndarray], SupportsFloat, bool, bool, dict[str, Any]]:
        action = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
        raw, reward, core_terminated, _, core_info = self._core.step(action)
        self._steps += 1
        ego = self._core.vehicle
        terminated = bool(core_terminated or ego.crashed or not ego.on_road)
        truncated = not terminated and self._steps >= self.duration
        info = self._info(core_info, done=terminated or truncated)
        return self._observation(raw), float(reward), terminated, truncated, info

    def render(self) -> np.ndarray | None:
        return self._core.render() if self.render_mode is not None else None

    def close(self) -> None:
        self._core.close()

    def clone(self, reactive: bool = True) -> DrivingEnv:
        """Return an independent copy of this env in its current state.

        With ``reactive=True`` the copy is exact: the same actions give the same
        observations, rewards and info as the original (RNG state is copied too).
        With ``reactive=False`` the other vehicles of the copy ignore the ego and
        just hold their speed and lane, a cheap non-reactive world model for
        counterfactual scoring. Rendering state is not copied.
        """
        twin = copy.deepcopy(self)
        if not reactive:
            make_non_reactive(twin.core)
        return twin

    def candidate_extras(self, candidates: np.ndarray) -> dict[str, np.ndarray]:
        """Per-candidate scores of the current state, for a proposal policy runner.

        ``candidates`` (K, H, 2) are action chunks. Returns ``{"proxy_scores": (K,) float32}``
        from non-reactive clones and, for an env made with ``oracle=True``, also
        ``"oracle_scores"`` from exact clones (see :func:`chunk_scores`). The env itself
        is left untouched.

        Raises:
            CandidateChunkError: ``candidates`` is not a finite (K, H, 2) array.
        """
        out = {"proxy_scores": chunk_scores(self, candidates, reactive=False,
                                            continuation=self.continuation).astype(np.float32)}
        if self.oracle:
            out["oracle_scores"] = chunk_scores(self, candidates, reactive=True,
                                                continuation=self.continuation).astype(np.float32)
        return out

    def _observation(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        # Static road obstacles (merge ramp end) have no lane-offset features; highway-env
        # leaves those cells NaN.
        table = np.nan_to_num(np.asarray(raw, dtype=np.float32), nan=0.0)
        state = np.clip(table / self._feature_scale, -1.0, 1.0).reshape(-1)
        return {"state": state}

    def _info(self, core_info: dict[str, Any], done: bool) -> dict[str, Any]:
        ego = self._core.vehicle
        collision = bool(ego.crashed)
        off_road = not ego.on_road
        rewards = core_info["rewards"]
        return {
            # a tuple, so infos still compare with ==; the registry's step_extras records it as float32 (5,)
            "events": tuple(float(e) for e in _events(self._core, rewards)),
            "collision": collision,
            "ttc_front": _time_to_collision(self._core.road, ego),
            "off_road": off_road,
            "speed": float(ego.speed),
            "success": done and not collision and not off_road,
            "task_id": self.task_id,
            "instruction": self.instruction,
            "reward_terms": {name: float(value) for name, value in rewards.items()},
        }


def _events(core: AbstractEnv, rewards: dict[str, float]) -> np.ndarray:
    """The step's events, float32 (5,): collision or off-road, TTC breach, progress (the scene's
    ``high_speed_reward`` clipped to [0, 1]; 0 where a scene lacks it), off the rightmost lane
    (:func:`off_right` of the lane the ego is in) and blocked, as ``highway_meta.EVENTS``;
    blocked is always 0 here: a continuous ego can brake to a stop behind any car."""
    ego = core.vehicle
    ttc = _time_to_collision(core.road, ego)
    progress = float(np.clip(rewards.get("high_speed_reward", 0.0), 0.0, 1.0))
    return np.array([float(ego.crashed or not ego.on_road), float(ttc < TTC_THRESHOLD), progress,
                     off_right(core.road, ego.lane_index), 0.0], dtype=np.float32)


class _Unobserved:
    """Stands in for a scoring clone's observation type: scoring reads the step info only,
    and building the Kinematics table is about half the cost of a clone's step."""

    def observe(self) -> None:
        return None


def chunk_scores(
    env: DrivingEnv,
    candidates: np.ndarray,
    reactive: bool = False,
    gamma: float = 0.98,
    weights: dict[str, float] = PROXY_WEIGHTS,
    continuation: int = 0,
) -> np.ndarray:
    """Discounted score of each candidate action chunk, rolled out in a clone of the env.

    For candidate ``k`` the env is cloned (:meth:`DrivingEnv.clone`) and the clone's scene
    steps through the chunk's H actions (clipped to [-1, 1]), then ``continuation`` more
    steps holding its last action, stopping after a collision, leaving the road or at
    the episode's end. The score is ``sum_h gamma^h (w_speed progress_h + w_collision
    1[collision or off-road]_h + w_ttc 1[ttc_front_h < TTC_THRESHOLD])`` over the entries
    of the step's ``events`` (progress: the scene's ``high_speed_reward`` clipped to [0, 1];
    a scene that lacks the term, or reports it constant as the roundabout does for a
    continuous action, adds nothing).

    With ``reactive=False`` the other vehicles of the clone hold their speed and lane (the
    cheap, biased proxy world model); with ``reactive=True`` the clone is exact (oracle).
    ``env`` is never modified and its random generators are never drawn from.

    Args:
        env: the driving env in its decision state.
        candidates: (K, H, 2) action chunks.
        reactive: exact clones instead of non-reactive ones.
        gamma: per-step discount in (0, 1].
        weights: ``speed``, ``collision`` and ``ttc`` (:data:`PROXY_WEIGHTS`).
        continuation: steps scored after the chunk, holding its last action.

    Returns:
        float64 (K,) scores.

    Raises:
        CandidateChunkError: candidates not a finite (K, H, 2) array with K, H >= 1, a
            discount outside (0, 1], weights with other names, or a negative continuation.
    """
    chunks = np.asarray(candidates, dtype=np.float32)
    shape = env.action_space.shape
    if chunks.ndim != 3 or chunks.shape[0] < 1 or chunks.shape[1] < 1 or chunks.shape[2:] != shape:
        raise CandidateChunkError(f"candidates must be action chunks of shape (K, H, {shape[0]}) with K, H >= 1, "
                                  f"got {np.shape(candidates)}")
    if not np.isfinite(chunks).all():
        raise CandidateChunkError("candidates hold non-finite actions")
    if not 0.0 < gamma <= 1.0:
        raise CandidateChunkError(f"gamma must lie in (0, 1], got {gamma}")
    if set(weights) != set(PROXY_WEIGHTS):
        raise CandidateChunkError(f"weights must name exactly {sorted(PROXY_WEIGHTS)}, got {sorted(weights)}")
    if continuation < 0:
        raise CandidateChunkError(f"continuation must be >= 0 steps, got {continuation}")
    # the order of the events vector; the continuous proxy scores no lane rule (and nothing is ever blocked)
    w = np.array([weights["collision"], weights["ttc"], weights["speed"], 0.0, 0.0])
    scores = np.zeros(len(chunks))
    for k, chunk in enumerate(np.clip(chunks, -1.0, 1.0)):
        twin = env.clone(reactive).core
        twin.observation_type = _Unobserved()
        for h, action in enumerate([*chunk, *[chunk[-1]] * continuation]):
            _, _, terminated, truncated, info = twin.step(action)
            events = _events(twin, info["rewards"])
            scores[k] += gamma**h * float(events @ w)
            if terminated or truncated or events[0]:
                break
    return scores


class DrivingExpert:
    """Scripted driver: IDM car-following, yielding, and pure-pursuit lane keeping.

    It follows the centre of its current lane along the scenario's route and never
    changes lanes. Longitudinally it runs the Intelligent Driver Model behind its
    leader, and also behind any predicted conflict point where another vehicle
    (at constant speed along its own route) would cut into its path within a few
    seconds, which makes it yield at merges and roundabout entries.

    Reads privileged state from ``env.unwrapped.core`` and never modifies it; build
    it with :func:`make_driving_expert`.
    """

    MAX_ACCEL = 3.0  # IDM maximum acceleration [m/s^2]
    COMFORT_DECEL = 4.0  # IDM comfortable deceleration [m/s^2]
    MIN_GAP = 6.0  # IDM jam distance, bumper to bumper [m]
    TIME_HEADWAY = 1.5  # IDM desired time gap [s]
    WHEELBASE = Vehicle.LENGTH  # highway-env's kinematic model turns like a bicycle of this base
    LOOKAHEAD = (5.0, 0.5)  # pure-pursuit look-ahead: (minimum [m], time [s] at current speed)
    HORIZON = np.arange(0.25, 3.01, 0.25)  # conflict prediction times [s]
    CONFLICT_BOX = (Vehicle.LENGTH + 1.0, Vehicle.WIDTH + 1.0)  # (longitudinal, lateral) [m]

    def __init__(self, noise: float = 0.0, seed: int | None = None) -> None:
        self.noise = noise
        self._rng = np.random.default_rng(seed)

    def __call__(self, env: gym.Env) -> np.ndarray:
        """Return the (acceleration, steering) action in [-1, 1] for the env's current state."""
        driving = env.unwrapped
        if not isinstance(driving, DrivingEnv):
            raise TypeError(f"DrivingExpert drives a DrivingEnv, got {type(driving).__name__}")
        road, ego = driving.core.road, driving.core.vehicle
        start, goal = driving.route
        lane_index = self._route_lane(road, ego, start, goal)

        accel = self._longitudinal(road, ego, lane_index, goal, driving.cruise_speed)
        steering = self._pure_pursuit(road, ego, lane_index, goal)
        action = np.array([accel / MAX_ACCELERATION, steering / MAX_STEERING])
        if self.noise > 0.0:
            action = action + self.noise * self._rng.standard_normal(2)
        return np.clip(action, -1.0, 1.0).astype(np.float32)

    @staticmethod
    def _route_lane(road: Road, ego: Vehicle, start: str, goal: str) -> LaneIndex:
        """The route lane nearest to the ego (its own lane index may snap to side roads)."""
        nodes = road.network.shortest_path(start, goal)
        candidates = [
            (origin, end, lane_id)
            for origin, end in zip(nodes[:-1], nodes[1:])
            for lane_id in range(len(road.network.graph[origin][end]))
        ]
        return min(candidates, key=lambda index: road.network.get_lane(index).distance(ego.position))

    def _longitudinal(
        self, road: Road, ego: Vehicle, lane_index: LaneIndex, goal: str, cruise: float
    ) -> float:
        """IDM acceleration [m/s^2] behind the lane leader and the nearest conflict point."""
        speed = max(ego.speed, 0.0)
        free = 1.0 - (speed / cruise) ** 4
        interaction = 0.0
        front, _ = road.neighbour_vehicles(ego, lane_index)
        if front is not None:
            gap, closing = _gap_and_closing_speed(ego, front)
            interaction = max(interaction, self._idm_interaction(speed, gap, closing))
        conflict = self._conflict_distance(road, ego, front, lane_index, goal, cruise)
        if conflict is not None:  # behave as if a stopped car sat at the conflict point
            interaction = max(interaction, self._idm_interaction(speed, conflict, speed))
        return self.MAX_ACCEL * (free - interaction)

    def _idm_interaction(self, speed: float, gap: float, closing: float) -> float:
        """IDM's ``(s*/s)^2`` braking term for a gap [m] shrinking at ``closing`` [m/s]."""
        brake = speed * closing / (2.0 * np.sqrt(self.MAX_ACCEL * self.COMFORT_DECEL))
        desired = max(self.MIN_GAP + speed * self.TIME_HEADWAY + brake, 0.0)
        return (desired / max(gap, 0.1)) ** 2

    def _conflict_distance(
        self,
        road: Road,
        ego: Vehicle,
        leader: Vehicle | None,
        lane_index: LaneIndex,
        goal: str,
        cruise: float,
    ) -> float | None:
        """Route distance [m] to the first predicted clash with a vehicle ahead or beside, if any."""
        # Probe at least at half cruise speed, so a waiting ego only pulls out into a free gap.
        probe_speed = max(ego.speed, 0.5 * cruise)
        ego_path = [
            self._point_ahead(road, lane_index, ego.position, probe_speed * t, goal)
            for t in self.HORIZON
        ]
        nearest = None
        for other in road.vehicles:
            if other is ego or other is leader:
                continue
            offset = other.position - ego.position
            reach = (probe_speed + abs(other.speed)) * self.HORIZON[-1] + self.CONFLICT_BOX[0]
            if np.linalg.norm(offset) > reach:
                continue  # too far apart to meet within the horizon
            if np.dot(offset, ego.direction) < 0.0:
                continue  # behind the ego: it is the follower's job to yield
            other_path = self._predict(other)
            for t, (position, heading), other_position in zip(self.HORIZON, ego_path, other_path):
                if self._overlaps(position, heading, other_position):
                    distance = probe_speed * t
                    nearest = distance if nearest is None else min(nearest, distance)
                    break
        return nearest

    def _predict(self, vehicle: Vehicle) -> list[np.ndarray]:
        """Positions of ``vehicle`` at :attr:`HORIZON` at constant speed, along its route if it has one."""
        if isinstance(vehicle, ControlledVehicle):
            try:
                return list(vehicle.predict_trajectory_constant_speed(self.HORIZON)[0])
            except IndexError:
                # highway-env keeps the current lane id along the route, which fails when
                # the next road has fewer lanes (roundabout exits); fall back to a straight line.
                pass
        return [vehicle.position + vehicle.velocity * t for t in self.HORIZON]

    def _overlaps(self, position: np.ndarray, heading: float, other: np.ndarray) -> bool:
        """Whether ``other`` lies within the padded footprint of a car at ``position``."""
        offset = other - position
        cos, sin = np.cos(heading), np.sin(heading)
        longitudinal = offset[0] * cos + offset[1] * sin
        lateral = -offset[0] * sin + offset[1] * cos
        return abs(longitudinal) < self.CONFLICT_BOX[0] and abs(lateral) < self.CONFLICT_BOX[1]

    def _pure_pursuit(self, road: Road, ego: Vehicle, lane_index: LaneIndex, goal: str) -> float:
        """Steering angle [rad] towards a look-ahead point on the centre of the route lane."""
        lookahead = max(self.LOOKAHEAD[0], self.LOOKAHEAD[1] * ego.speed)
        target, _ = self._point_ahead(road, lane_index, ego.position, lookahead, goal)
        offset = target - ego.position
        alpha = wrap_to_pi(np.arctan2(offset[1], offset[0]) - ego.heading)
        return float(np.arctan(2.0 * self.WHEELBASE * np.sin(alpha) / np.linalg.norm(offset)))

    @staticmethod
    def _point_ahead(
        road: Road, lane_index: LaneIndex, position: np.ndarray, distance: float, goal: str
    ) -> tuple[np.ndarray, float]:
        """Lane-centre point and heading ``distance`` metres ahead, continuing along the route."""
        network = road.network
        lane = network.get_lane(lane_index)
        s = lane.local_coordinates(position)[0] + distance
        while s > lane.length:
            _, end, lane_id = lane_index
            path = network.shortest_path(end, goal) if end != goal else []
            if len(path) < 2:
                break  # the last lane is extrapolated past its end
            successors = network.graph[end][path[1]]
            s -= lane.length
            lane_index = (end, path[1], min(lane_id, len(successors) - 1))
            lane = network.get_lane(lane_index)
        return lane.position(s, 0.0), lane.heading_at(s)


def make_driving_expert(noise: float = 0.0, seed: int | None = None) -> DrivingExpert:
    """Scripted driving policy ``expert(env) -> action`` for collecting demonstrations.

    Args:
        noise: std of Gaussian noise added to the [-1, 1] action (then clipped).
        seed: seed of the noise generator.
    """
    return DrivingExpert(noise=noise, seed=seed)
