"""highway-env driving scenes with discrete meta-actions, a candidate vocabulary and
counterfactual scoring of candidate futures.

:class:`HighwayMetaEnv` is one of three highway-env scenes (:data:`SCENARIOS`) behind
robo-post's env conventions:

- ``highway``: ``HighwayEnvFast`` (3 lanes, 20 vehicles, 30 s episodes, simulation at
  5 Hz), ego target speeds 20, 25, 30 m/s;
- ``merge``: ``MergeEnv`` (2 lanes, 3 vehicles and one merging from the on-ramp,
  simulation at 15 Hz; the episode ends once the ego has passed the ramp, or after 20 s),
  target speeds 20, 25, 30 m/s;
- ``roundabout``: ``RoundaboutEnv`` (4 vehicles on routes, 11 s episodes, simulation at
  15 Hz), target speeds 0, 8, 16 m/s.

Decisions are at each scene's policy frequency, 1 Hz in all three.

Every scene has the same interface, so one policy architecture reads all three:

- action ``Discrete(5)``: ``0 LANE_LEFT, 1 IDLE, 2 LANE_RIGHT, 3 FASTER, 4 SLOWER``
  (FASTER / SLOWER step through the scene's own target speeds, above);
- observation ``{"state": Box(-1, 1, (25,), float32)}``, highway-env's normalized 5x5
  Kinematics table (``presence, x, y, vx, vy`` of the ego and its 4 nearest vehicles,
  others relative to the ego; ``observed_vehicles`` rows instead of 5 on request) flattened row by row, with highway-fast's normalization
  ranges in every scene (x +-200 m, y +-12 m, vx and vy +-80 m/s);
- the scene's highway-env reward, unchanged (its terms differ per scene: merge adds
  ``lane_change_reward`` and ``merging_speed_reward``, has no ``on_road_reward``, does not
  clip ``high_speed_reward`` and reports the lane id as ``right_lane_reward`` (2 on the
  ramp's merge lane); the roundabout has no ``right_lane_reward`` and its
  ``high_speed_reward`` is the ego's target-speed index over 2);
- info: highway-env's ``crashed``, ``speed`` and ``rewards`` plus ``ttc_front`` [s] and
  the step's ``events`` vector (:data:`EVENTS`).

Candidate futures are short meta-action sequences (:data:`CANDIDATES`).
:func:`counterfactual_scores` rolls each one out in a copy of the scene: with
``reactive=False`` the other vehicles of the copy ignore the ego (the cheap,
deliberately biased proxy world model); with ``reactive=True`` the copy is exact (an
oracle that measures the proxy's bias). The live scene is never touched: the copy has
its own vehicles and its own random generator.

Scoring costs a few clone steps per candidate, so it runs in the process that owns
the env. Parallelism comes from the fleet (one env per client process); envs are not
shipped to process pools, which would pickle them.

:class:`HeuristicDriver` is a deliberately mediocre lane-keeping driver (brake when
the car ahead is close, never change lanes), the scripted expert of the registry entry.
"""

from __future__ import annotations

import copy
import types
from typing import Any, Mapping, Sequence, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from highway_env import utils
from highway_env.envs.common.abstract import AbstractEnv
from highway_env.envs.highway_env import HighwayEnvFast
from highway_env.envs.merge_env import MergeEnv
from highway_env.envs.roundabout_env import RoundaboutEnv
from highway_env.road.lane import AbstractLane
from highway_env.road.road import Road
from highway_env.vehicle.controller import MDPVehicle
from highway_env.vehicle.kinematics import Vehicle

from robo_post.envs.driving import (TTC_THRESHOLD, _closing_time, _gap_and_closing_speed, _time_to_collision, _Unobserved,
                                    make_non_reactive, off_right)

__all__ = [
    "FASTER",
    "IDLE",
    "LANE_LEFT",
    "LANE_RIGHT",
    "SLOWER",
    "ACTIONS",
    "BLOCKED_HORIZON",
    "CANDIDATES",
    "CONTINUATION",
    "EVENTS",
    "EVENT_WEIGHTS",
    "PROXY_WEIGHTS",
    "SCENARIOS",
    "TTC_THRESHOLD",
    "HeuristicDriver",
    "HighwayMetaEnv",
    "InvalidCandidatesError",
    "InvalidHighwayConfigError",
    "InvalidMetaActionError",
    "LANE_FEATURES",
    "blocked",
    "counterfactual_scores",
    "event_reward",
    "lane_table",
    "step_events",
]

LANE_LEFT, IDLE, LANE_RIGHT, FASTER, SLOWER = range(5)
ACTIONS: tuple[str, ...] = ("LANE_LEFT", "IDLE", "LANE_RIGHT", "FASTER", "SLOWER")
"""Names of the meta-actions, by index (highway-env's ``DiscreteMetaAction``)."""

CANDIDATES: list[list[int]] = [
    *([a, IDLE, IDLE] for a in range(len(ACTIONS))),
    [LANE_LEFT, FASTER, IDLE],
    [LANE_RIGHT, FASTER, IDLE],
    [SLOWER, SLOWER, IDLE],
]
"""The candidate vocabulary: K = 8 macro-futures of H = 3 meta-actions (each action
then idling, overtaking left or right, braking twice)."""

CONTINUATION = 0
"""Default IDLE steps scored after each candidate in :meth:`HighwayMetaEnv.candidate_extras`."""

EVENTS: tuple[str, ...] = ("crash", "ttc_breach", "progress", "off_right", "blocked")
"""Entries of the per-step ``info["events"]`` vector: ``crash`` and ``ttc_breach`` are 1.0 if
they happened, else 0.0; ``progress`` is the scene's ``high_speed_reward`` term of the step
clipped to [0, 1] (highway and merge: 0 at or below 20 m/s, 1 at 30 m/s; roundabout: the
ego's target-speed index over 2), the optional progress signal of the grounded residual.
For a scene that reports no such term it is highway-env's definition of it: the ego's
forward speed mapped from the scene's ``reward_speed_range`` to [0, 1], clipped.
``off_right`` is the keep-right rule's violation: how far the lane the ego drives in, or
is changing to, lies from the rightmost lane of its road segment (0 there, 1 in the
leftmost; highway-env numbers lanes from left to right; ``1 - right_lane_reward`` on the
highway). ``blocked`` is 1.0 when braking can no longer keep the ego off the car ahead (see
:func:`blocked`): only a lane change gets out."""

EVENT_WEIGHTS: tuple[float, ...] = (-1.0, -0.3, 0.0, 0.0, 0.0)
"""Default reward of each entry of :data:`EVENTS` (see :func:`event_reward`): progress, the
lane rule and being blocked are off by default, so the residual sees the spec's
interaction-critical events (crash, TTC breach) only."""

BLOCKED_HORIZON = 10.0
"""Seconds within which the ego, held at its lowest target speed, would reach the slower car
ahead: a step like that is ``blocked`` (see :func:`blocked`)."""

PROXY_WEIGHTS: Mapping[str, float] = types.MappingProxyType(
    {"high_speed": 0.4, "right_lane": 0.1, "collision": -1.0, "ttc": -0.3}
)
"""Default per-step weights of the counterfactual score (see :func:`counterfactual_scores`)."""

SCENARIOS: tuple[str, ...] = ("highway", "merge", "roundabout")
"""Scenes accepted by ``HighwayMetaEnv(scenario=...)`` (see the module docstring)."""

# Proxy weight name -> highway-env reward term it weighs ("ttc" is computed here).
_REWARD_TERMS = {"high_speed": "high_speed_reward", "right_lane": "right_lane_reward",
                 "collision": "collision_reward"}


class InvalidHighwayConfigError(ValueError):
    """A scenario, config entry or render mode this env does not accept: unknown, or fixed by the env."""


class InvalidMetaActionError(ValueError):
    """An action that is not one of the five meta-action indices."""


class InvalidCandidatesError(ValueError):
    """A candidate set, score weight or discount that counterfactual scoring cannot use."""


class _MergeEnv(MergeEnv):
    """highway-env's merge with a time limit (``duration`` [s]): the scene itself ends only
    once the ego has passed the ramp, which at the lowest target speed takes about 17 s."""

    @classmethod
    def default_config(cls) -> dict:
        return {**super().default_config(), "duration": 20}

    def _is_truncated(self) -> bool:
        return self.time >= self.config["duration"]


# highway-fast's observation, spelled out for the scenes whose defaults differ (the roundabout's
# is absolute with its own ranges; merge's y range would follow its 2 lanes): the ranges
# highway-env derives on highway-fast's 3-lane road, so one policy reads every scene.
_KINEMATICS = {
    "type": "Kinematics",
    "vehicles_count": 5,
    "features": ["presence", "x", "y", "vx", "vy"],
    "features_range": {
        "x": [-5.0 * Vehicle.MAX_SPEED, 5.0 * Vehicle.MAX_SPEED],
        "y": [-AbstractLane.DEFAULT_WIDTH * 3, AbstractLane.DEFAULT_WIDTH * 3],
        "vx": [-2.0 * Vehicle.MAX_SPEED, 2.0 * Vehicle.MAX_SPEED],
        "vy": [-2.0 * Vehicle.MAX_SPEED, 2.0 * Vehicle.MAX_SPEED],
    },
    "absolute": False,
    "normalize": True,
    "clip": True,
    "order": "sorted",
}

# scenario -> (highway-env scene class, observation config it needs; None: its default).
# Every scene's default action is DiscreteMetaAction with its own target speeds.
_SCENES: dict[str, tuple[type[AbstractEnv], dict | None]] = {
    "highway": (HighwayEnvFast, None),
    "merge": (_MergeEnv, _KINEMATICS),
    "roundabout": (RoundaboutEnv, _KINEMATICS),
}


def _progress(core: AbstractEnv, rewards: Mapping[str, float]) -> float:
    """The ``progress`` entry of :data:`EVENTS`."""
    if "high_speed_reward" in rewards:
        return float(np.clip(rewards["high_speed_reward"], 0.0, 1.0))  # merge's term is not clipped
    if "reward_speed_range" not in core.config:
        raise InvalidHighwayConfigError(
            f"{type(core).__name__} reports no high_speed_reward and has no reward_speed_range to derive progress from")
    ego = core.vehicle
    scaled = utils.lmap(ego.speed * np.cos(ego.heading), core.config["reward_speed_range"], [0.0, 1.0])
    return float(np.clip(scaled, 0.0, 1.0))


def blocked(road: Road, ego: MDPVehicle) -> float:
    """1.0 if the ego is blocked: it already holds the lowest of its target speeds and, at that
    speed, would still reach the car ahead in its lane within :data:`BLOCKED_HORIZON` s, because
    that car is slower still; else 0.0.

    SLOWER cannot take the ego below its lowest target speed (20 m/s on the highway), so behind
    a car slower than that the gap keeps closing whatever it does in its lane, seconds before
    the time-to-collision breach (under 1.5 s) and the rear-end crash that follow.
    """
    lowest = float(ego.target_speeds[0])
    front, _ = road.neighbour_vehicles(ego, ego.lane_index)
    if front is None or ego.target_speed > lowest:
        return 0.0
    gap, _ = _gap_and_closing_speed(ego, front)
    return float(_closing_time(gap, lowest - front.speed) < BLOCKED_HORIZON)


def step_events(core: AbstractEnv, rewards: Mapping[str, float]) -> np.ndarray:
    """The :data:`EVENTS` vector of a highway-env scene's current state, float32 (5,);
    ``rewards`` are the step's reward terms (``info["rewards"]``).

    Raises:
        InvalidHighwayConfigError: ``rewards`` has no ``high_speed_reward`` and the scene's
            config no ``reward_speed_range``.
    """
    ego = core.vehicle
    ttc = _time_to_collision(core.road, ego)
    # the lane the ego is changing to, as highway-env's right_lane_reward reads it
    return np.array([float(ego.crashed), float(ttc < TTC_THRESHOLD), _progress(core, rewards),
                     off_right(core.road, ego.target_lane_index), blocked(core.road, ego)], dtype=np.float32)


def event_reward(events: np.ndarray | Sequence[float], weights: Sequence[float] = EVENT_WEIGHTS
                 ) -> float | np.ndarray:
    """Event reward: ``events @ weights`` for one (E,) vector (a float) or a (T, E) batch (T,),
    E the number of weights (4 for :data:`EVENTS`).

    Raises:
        InvalidCandidatesError: the last axis of ``events`` does not match ``weights``.
    """
    events = np.asarray(events, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if events.ndim not in (1, 2) or events.shape[-1] != weights.shape[0]:
        raise InvalidCandidatesError(
            f"events must have shape ({weights.shape[0]},) or (T, {weights.shape[0]}), got {events.shape}")
    reward = events @ weights
    return float(reward) if reward.ndim == 0 else reward


class HighwayMetaEnv(gym.Env[dict[str, np.ndarray], np.int64]):
    """A highway-env scene with discrete meta-actions (see the module docstring).

    ``terminated`` on a crash (merge: also once the ego has passed the ramp),
    ``truncated`` when the episode time (``duration`` s) is up. Info keys on every
    step: ``crashed``, ``speed`` [m/s], ``rewards`` (the scene's highway-env reward
    terms), ``ttc_front`` [s] (``inf``: nobody ahead in the lane, or not closing in),
    ``events`` (float32 (5,), :data:`EVENTS`).

    Args:
        scenario: one of :data:`SCENARIOS`.
        oracle: :meth:`candidate_extras` also scores candidates in exact clones
            (``oracle_scores``); an exact clone steps about 3.5x slower than a
            non-reactive one (its traffic runs IDM and lane-change decisions).
        continuation: IDLE steps scored after each candidate's own actions in
            :meth:`candidate_extras` (see :func:`counterfactual_scores`).
        observed_vehicles: rows of the Kinematics table (the ego's first, then the nearest
            vehicles); the observation has ``5 * observed_vehicles`` entries.
        ego_targets: append the ego controller's targets to the observation: its target
            speed over highway-env's ``Vehicle.MAX_SPEED`` and the direction of a lane change
            in progress (-1 left, 0 none, 1 right); two more entries.
        lane_features: append what the nearest cars ahead and behind do in the ego's lane and
            the lanes either side (:data:`LANE_FEATURES` per lane, lanes left, own, right) and
            the ego's speed over ``Vehicle.MAX_SPEED``; 19 more entries. The Kinematics table
            lists the nearest cars in distance order, so the car that matters (the one ahead
            in a lane) moves between rows; here it has a fixed place.
        render_mode: ``None`` or ``"rgb_array"``.
        **config: config entries of the scenario's highway-env scene (highway:
            ``vehicles_count``, ``lanes_count``, ``duration`` [s], ...); the
            observation and action types are fixed.

    Raises:
        InvalidHighwayConfigError: an unknown scenario, a config key the scenario's
            scene does not know, ``observation`` / ``action``, or ``observed_vehicles < 1``.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 1}

    def __init__(self, scenario: str = "highway", oracle: bool = False, continuation: int = CONTINUATION,
                 observed_vehicles: int = 5, ego_targets: bool = False, lane_features: bool = False,
                 render_mode: str | None = None,
                 **config: Any) -> None:
        if scenario not in _SCENES:
            raise InvalidHighwayConfigError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise InvalidHighwayConfigError(f"unsupported render_mode {render_mode!r}")
        scene, observation = _SCENES[scenario]
        known = scene.default_config()
        fixed = {"observation", "action"} & config.keys()
        if fixed:
            raise InvalidHighwayConfigError(f"HighwayMetaEnv fixes the observation and action types; got {sorted(fixed)}")
        unknown = sorted(config.keys() - known.keys())
        if unknown:
            raise InvalidHighwayConfigError(
                f"unknown highway-env config keys {unknown} for scenario {scenario!r}; known: {sorted(known)}")
        for key in ("duration", "policy_frequency", "simulation_frequency"):
            if key in config and not (isinstance(config[key], (int, float)) and config[key] > 0):
                raise InvalidHighwayConfigError(f"{key} must be a number > 0, got {config[key]!r}")
        if continuation < 0:
            raise InvalidCandidatesError(f"continuation must be >= 0 steps, got {continuation}")
        if observed_vehicles < 1:
            raise InvalidHighwayConfigError(f"observed_vehicles must be >= 1 (the ego's row), got {observed_vehicles}")
        if observed_vehicles != _KINEMATICS["vehicles_count"]:
            observation = {**(observation or _KINEMATICS), "vehicles_count": int(observed_vehicles)}
        if observation is not None:
            config = {**config, "observation": copy.deepcopy(observation)}
        self._core = scene(config=config, render_mode=render_mode)
        self.scenario = scenario
        self.oracle = oracle
        self.continuation = int(continuation)
        self.render_mode = render_mode
        policy_frequency = self._core.config["policy_frequency"]
        self.metadata = {**self.metadata, "render_fps": policy_frequency}
        self.duration = round(self._core.config["duration"] * policy_frequency)  # in decisions
        if self.duration < 1:
            raise InvalidHighwayConfigError(f"duration {self._core.config['duration']} s at policy_frequency "
                                            f"{policy_frequency} is no decision; it must be at least one step")
        self.ego_targets = bool(ego_targets)
        self.lane_features = bool(lane_features)
        size = (int(np.prod(self._core.observation_space.shape)) + 2 * self.ego_targets
                + (3 * len(LANE_FEATURES) + 1) * self.lane_features)
        self.observation_space = spaces.Dict({"state": spaces.Box(-1.0, 1.0, (size,), np.float32)})
        self.action_space = spaces.Discrete(len(ACTIONS))

    @property
    def core(self) -> AbstractEnv:
        """The wrapped highway-env scene (privileged state: road, vehicles, lanes)."""
        return self._core

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        super().reset(seed=seed)
        # highway-env draws every random scene element from its own np_random.
        raw, core_info = self._core.reset(seed=seed)
        return self._observation(raw), self._info(core_info)

    def step(self, action: int | np.integer) -> tuple[dict[str, np.ndarray], SupportsFloat, bool, bool, dict[str, Any]]:
        if np.asarray(action).dtype.kind not in "iu" or not self.action_space.contains(np.int64(action)):
            raise InvalidMetaActionError(f"meta-action must be an integer in [0, {len(ACTIONS)}), got {action!r}")
        raw, reward, terminated, truncated, core_info = self._core.step(int(action))
        return self._observation(raw), float(reward), bool(terminated), bool(truncated), self._info(core_info)

    def render(self) -> np.ndarray | None:
        return self._core.render() if self.render_mode is not None else None

    def close(self) -> None:
        self._core.close()

    def candidate_extras(self, candidates: Sequence[Sequence[int]] = CANDIDATES) -> dict[str, np.ndarray]:
        """Per-candidate scores of the current state, for a candidate-scoring policy runner.

        Returns ``{"proxy_scores": (K,) float32}`` from non-reactive clones and, for an
        env made with ``oracle=True``, also ``"oracle_scores"`` from exact clones. The
        env itself is left untouched (see :func:`counterfactual_scores`).
        """
        out = {"proxy_scores": counterfactual_scores(self, candidates, reactive=False,
                                                     continuation=self.continuation).astype(np.float32)}
        if self.oracle:
            out["oracle_scores"] = counterfactual_scores(self, candidates, reactive=True,
                                                         continuation=self.continuation).astype(np.float32)
        return out

    def _observation(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        state = np.asarray(raw, dtype=np.float32).reshape(-1)
        if self.ego_targets:
            # the meta-action controller's state, which the table does not show: the speed FASTER /
            # SLOWER last set and the lane a change is heading to (-1 left, 0 none, 1 right)
            ego = self._core.vehicle
            targets = [ego.target_speed / Vehicle.MAX_SPEED,
                       float(np.clip(ego.target_lane_index[2] - ego.lane_index[2], -1, 1))]
            state = np.concatenate([state, np.asarray(targets, np.float32)])
        if self.lane_features:
            state = np.concatenate([state, lane_table(self._core)])
        return {"state": state}

    def _info(self, core_info: Mapping[str, Any]) -> dict[str, Any]:
        ego = self._core.vehicle
        rewards = {name: float(value) for name, value in core_info["rewards"].items()}
        return {
            "crashed": bool(ego.crashed),
            "speed": float(ego.speed),
            "rewards": rewards,
            "ttc_front": _time_to_collision(self._core.road, ego),
            "events": step_events(self._core, rewards),
        }


LANE_FEATURES: tuple[str, ...] = ("exists", "front_gap", "front_closing", "front_ttc", "rear_gap", "rear_closing")
"""Per-lane entries of ``lane_features`` (:func:`lane_table`): whether the lane exists; the gap to
the nearest car ahead over 100 m, the speed it closes at over 20 m/s and the time to reach it over
10 s; the same gap and closing speed for the nearest car behind. No car: gaps and time 1, speeds 0."""

_GAP_SCALE, _SPEED_SCALE, _TTC_SCALE = 100.0, 20.0, 10.0


def lane_table(core: AbstractEnv) -> np.ndarray:
    """The ``lane_features`` entries of a scene's current state, float32 (19,) in [-1, 1]:
    :data:`LANE_FEATURES` for the lanes left of the ego, its own and right of it, then the ego's
    speed over ``Vehicle.MAX_SPEED``."""
    ego, road = core.vehicle, core.road
    start, end, own = ego.lane_index
    n_lanes = len(road.network.graph[start][end])
    rows = []
    for offset in (-1, 0, 1):
        lane = own + offset
        if not 0 <= lane < n_lanes:
            rows.append([0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
            continue
        front, rear = road.neighbour_vehicles(ego, (start, end, lane))
        row = [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
        if front is not None:
            gap, closing = _gap_and_closing_speed(ego, front)
            row[1:4] = [gap / _GAP_SCALE, closing / _SPEED_SCALE, _closing_time(gap, closing) / _TTC_SCALE]
        if rear is not None:
            gap, closing = _gap_and_closing_speed(rear, ego)
            row[4:6] = [gap / _GAP_SCALE, closing / _SPEED_SCALE]
        rows.append(row)
    table = np.clip(np.asarray(rows, np.float64), -1.0, 1.0).reshape(-1)
    return np.append(table, np.clip(ego.speed / Vehicle.MAX_SPEED, -1.0, 1.0)).astype(np.float32)


def _scene(env: gym.Env | AbstractEnv) -> AbstractEnv:
    """The highway-env scene of ``env`` (a made env, a :class:`HighwayMetaEnv` or a scene)."""
    unwrapped = env.unwrapped
    if isinstance(unwrapped, HighwayMetaEnv):
        return unwrapped.core
    if isinstance(unwrapped, AbstractEnv):
        return unwrapped
    raise TypeError(f"counterfactual scoring needs a highway-env scene, got {type(unwrapped).__name__}")


def _clone(core: AbstractEnv, reactive: bool) -> AbstractEnv:
    """A copy of ``core`` for scoring: exact, or with every other vehicle coasting."""
    twin = copy.deepcopy(core)
    twin.observation_type = _Unobserved()
    if not reactive:
        make_non_reactive(twin)
    return twin


def counterfactual_scores(
    env: gym.Env | AbstractEnv,
    candidates: Sequence[Sequence[int]] = CANDIDATES,
    reactive: bool = False,
    gamma: float = 0.98,
    weights: Mapping[str, float] = PROXY_WEIGHTS,
    continuation: int = 0,
) -> np.ndarray:
    """Discounted score of each candidate future, rolled out in a copy of the scene.

    For candidate ``k`` the scene is deep-copied and the copy steps through the
    candidate's meta-actions, stopping after a crash or at the episode's end; the
    score is ``sum_h gamma^h (w_high_speed high_speed_h + w_right_lane right_lane_h +
    w_collision collision_h + w_ttc 1[ttc_front_h < TTC_THRESHOLD])`` with the
    first three terms from the copy's ``info["rewards"]`` as the scene reports them; a
    term the scene does not report counts 0, whatever its weight (the roundabout has
    no ``right_lane_reward``).

    With ``reactive=False`` the other vehicles of the copy hold their speed and lane
    (zero acceleration, lane-keeping steering; in the roundabout they keep following
    their routes): a world model that ignores how traffic reacts to the ego. With
    ``reactive=True`` the copy is exact (its random generator is a copy too), so the
    score is the candidate's true outcome.

    ``env`` is never modified and its random generator is never drawn from.

    Args:
        env: a made ``robo_post/HighwayMeta-v0`` env, a :class:`HighwayMetaEnv`, or a
            highway-env scene with discrete meta-actions.
        candidates: K sequences of meta-action indices (:data:`CANDIDATES`).
        reactive: exact copies (oracle) instead of non-reactive ones (proxy).
        gamma: per-decision discount in (0, 1].
        weights: the four weights by name (:data:`PROXY_WEIGHTS`).
        continuation: IDLE steps the copy keeps driving after the candidate's own
            actions, scored like them (same discount, same terms). A candidate that
            ends closing in on a slower car at speed then shows the collision that
            follows, which the candidate's own few steps hide; only the scores change,
            never the executed actions.

    Returns:
        float64 (K,) scores.

    Raises:
        InvalidCandidatesError: empty candidates, an action outside ``[0, 5)``, a
            discount outside (0, 1], weights whose names differ from
            :data:`PROXY_WEIGHTS`', or a negative continuation.
    """
    core = _scene(env)
    n_actions = core.action_space.n
    if not candidates or any(len(c) == 0 for c in candidates):
        raise InvalidCandidatesError("candidates must be a non-empty list of non-empty action sequences")
    bad = [a for c in candidates for a in c if not (isinstance(a, (int, np.integer)) and 0 <= a < n_actions)]
    if bad:
        raise InvalidCandidatesError(f"candidate actions must be integers in [0, {n_actions}), got {bad[:5]}")
    if not 0.0 < gamma <= 1.0:
        raise InvalidCandidatesError(f"gamma must lie in (0, 1], got {gamma}")
    if set(weights) != set(PROXY_WEIGHTS):
        raise InvalidCandidatesError(f"weights must name exactly {sorted(PROXY_WEIGHTS)}, got {sorted(weights)}")
    if continuation < 0:
        raise InvalidCandidatesError(f"continuation must be >= 0 steps, got {continuation}")

    scores = np.zeros(len(candidates))
    for k, candidate in enumerate(candidates):
        twin = _clone(core, reactive)
        for h, action in enumerate([*candidate, *[IDLE] * continuation]):
            _, _, terminated, truncated, info = twin.step(int(action))
            # A term the scene does not report (roundabout: right_lane) contributes 0.
            step = sum(weights[name] * info["rewards"].get(term, 0.0) for name, term in _REWARD_TERMS.items())
            step += weights["ttc"] * float(_time_to_collision(twin.road, twin.vehicle) < TTC_THRESHOLD)
            scores[k] += gamma**h * step
            if terminated or truncated:
                break
    return scores


class HeuristicDriver:
    """A mediocre scripted driver: SLOWER when the car ahead in the ego's lane is less
    than :attr:`MIN_GAP` m away (bumper to bumper), else IDLE; it never changes lanes
    unless ``keep_right``.

    With ``keep_right`` it first moves one lane right whenever that lane exists and is
    free (the nearest car ahead in it at least :attr:`RIGHT_FRONT_GAP` m away, the nearest
    behind at least :attr:`RIGHT_REAR_GAP` m): a fixed reference for what keeping right,
    which highway-env pays for, adds to the braking driver. It is not the driver the
    policies are cloned from.

    With probability ``noise`` it instead takes a uniformly random meta-action (lane
    changes included), drawn from its own seeded generator. Reads privileged state
    from ``env.unwrapped.core`` and never modifies it.

    "Ahead in the ego's lane" is highway-env's ``road.neighbour_vehicles``: the ego's
    current lane segment only, unless the scene is configured with
    ``neighbour_vehicles_connected_lanes=True`` (then the next and previous segments
    too). That matters off the highway: merge's road has three segments and the
    roundabout's ring is made of arcs about 15-20 m long.
    """

    MIN_GAP = 20.0  # [m]
    RIGHT_FRONT_GAP = 25.0  # [m]
    RIGHT_REAR_GAP = 15.0  # [m]

    def __init__(self, noise: float = 0.0, seed: int | None = None, keep_right: bool = False) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise is a probability in [0, 1], got {noise}")
        self.noise, self.keep_right = noise, keep_right
        self._rng = np.random.default_rng(seed)

    def __call__(self, env: gym.Env) -> np.int64:
        """The meta-action for the env's current state."""
        if self.noise > 0.0 and self._rng.random() < self.noise:
            return np.int64(self._rng.integers(len(ACTIONS)))
        core = _scene(env)
        ego = core.vehicle
        if self.keep_right and self._right_lane_free(core):
            return np.int64(LANE_RIGHT)
        front, _ = core.road.neighbour_vehicles(ego)
        if front is not None and _gap_and_closing_speed(ego, front)[0] < self.MIN_GAP:
            return np.int64(SLOWER)
        return np.int64(IDLE)

    def _right_lane_free(self, core: AbstractEnv) -> bool:
        ego = core.vehicle
        start, end, own = ego.lane_index
        if own + 1 >= len(core.road.network.graph[start][end]):
            return False
        front, rear = core.road.neighbour_vehicles(ego, (start, end, own + 1))
        return ((front is None or _gap_and_closing_speed(ego, front)[0] >= self.RIGHT_FRONT_GAP)
                and (rear is None or _gap_and_closing_speed(rear, ego)[0] >= self.RIGHT_REAR_GAP))
