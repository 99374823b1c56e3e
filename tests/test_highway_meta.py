"""Tests for the discrete meta-action driving scenes (robo_post.envs.highway_meta): spaces
and info on highway, merge and roundabout, the candidate vocabulary, events,
counterfactual scoring (the live env stays untouched; reactive copies are exact,
non-reactive ones are not; reward terms a scene lacks count 0), the heuristic driver,
and collecting with the CLI."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from helpers import run_cli
from highway_env.vehicle.behavior import IDMVehicle

from robo_post.envs import env_spec
from robo_post.envs.highway_meta import (
    BLOCKED_HORIZON,
    CANDIDATES,
    EVENT_WEIGHTS,
    EVENTS,
    FASTER,
    IDLE,
    LANE_LEFT,
    LANE_RIGHT,
    PROXY_WEIGHTS,
    SCENARIOS,
    SLOWER,
    TTC_THRESHOLD,
    HeuristicDriver,
    HighwayMetaEnv,
    InvalidCandidatesError,
    InvalidHighwayConfigError,
    InvalidMetaActionError,
    blocked,
    counterfactual_scores,
    event_reward,
    step_events,
)
from robo_post.store import Store

INFO_KEYS = {"crashed", "speed", "rewards", "ttc_front", "events"}


def make(seed: int = 0, **kwargs) -> gym.Env:
    env = env_spec("highway_meta").make(**kwargs)
    env.reset(seed=seed)
    return env


def stage(env: gym.Env, others: list[tuple[float, float]], ego_speed: float = 25.0, at: float | None = None
          ) -> None:
    """Replace the traffic by IDM cars in the ego's lane at (offset ahead [m, centre to
    centre, along the lane], speed [m/s]); the ego drives at ``ego_speed`` with that target
    speed, moved to ``at`` m along its lane unless ``at`` is None."""
    core = env.unwrapped.core
    ego = core.vehicle
    lane = core.road.network.get_lane(ego.lane_index)
    s = lane.local_coordinates(ego.position)[0] if at is None else at
    ego.position, ego.heading = lane.position(s, 0.0), lane.heading_at(s)
    ego.speed = ego_speed
    ego.speed_index = ego.speed_to_index(ego_speed)
    ego.target_speed = ego.index_to_speed(ego.speed_index)
    core.road.vehicles = [ego]
    for offset, speed in others:
        car = IDMVehicle(core.road, lane.position(s + offset, 0.0), heading=lane.heading_at(s + offset), speed=speed)
        car.check_collisions = False  # as highway-fast: only the ego checks
        core.road.vehicles.append(car)


def snapshot(env: gym.Env) -> dict:
    core = env.unwrapped.core
    return {
        "ego": (core.vehicle.position.copy(), core.vehicle.speed, core.vehicle.heading),
        "vehicles": [(id(v), v.position.copy(), v.speed, v.heading, v.lane_index) for v in core.road.vehicles],
        "clock": (core.time, core.steps),
        "rng": core.np_random.bit_generator.state,
        "road_rng": core.road.np_random.bit_generator.state,
    }


def assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def test_spaces_info_and_config() -> None:
    env = gym.make("robo_post/HighwayMeta-v0", vehicles_count=5)
    assert env.action_space == gym.spaces.Discrete(5)
    assert env.observation_space == gym.spaces.Dict({"state": gym.spaces.Box(-1.0, 1.0, (25,), np.float32)})
    obs, info = env.reset(seed=1)
    core = env.unwrapped.core
    assert len(core.road.vehicles) == 6 and core.config["lanes_count"] == 3  # passed through; default kept
    assert env.unwrapped.duration == 30
    assert env.observation_space.contains(obs) and INFO_KEYS <= info.keys()
    # The ego's row: present, in a lane, driving forward at 25 m/s (normalized by 80 m/s).
    assert obs["state"][0] == 1.0 and obs["state"][3] == pytest.approx(25.0 / 80.0)
    for action in (FASTER, IDLE, LANE_LEFT):
        obs, reward, terminated, truncated, info = env.step(np.int64(action))
        assert env.observation_space.contains(obs) and 0.0 <= reward <= 1.0
        assert INFO_KEYS <= info.keys() and info["events"].dtype == np.float32 and info["events"].shape == (len(EVENTS),)
        assert set(info["rewards"]) == {"collision_reward", "right_lane_reward", "high_speed_reward",
                                        "on_road_reward"}
        np.testing.assert_array_equal(info["events"], step_events(core, info["rewards"]))
        # progress is the step's high-speed term: highway-env maps [20, 30] m/s to [0, 1]
        assert info["events"][2] == pytest.approx(np.clip((info["speed"] - 20.0) / 10.0, 0.0, 1.0), abs=0.05)
        assert info["ttc_front"] > 0.0 and info["speed"] == core.vehicle.speed
    with pytest.raises(InvalidMetaActionError):
        env.step(5)
    with pytest.raises(InvalidMetaActionError):
        env.step(1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any checker warning fails the test
        check_env(env.unwrapped)
    with pytest.raises(InvalidHighwayConfigError, match="vehicle_count"):
        HighwayMetaEnv(vehicle_count=5)
    with pytest.raises(InvalidHighwayConfigError, match="observation"):
        HighwayMetaEnv(observation={"type": "GrayscaleObservation"})
    # a duration of no decision made every episode one step long, a crash-free success
    for bad, name in (({"duration": -5}, "duration"), ({"duration": 0}, "duration"), ({"duration": 0.2}, "duration"),
                      ({"policy_frequency": 0}, "policy_frequency"), ({"duration": "10"}, "duration")):
        with pytest.raises(InvalidHighwayConfigError, match=name):
            HighwayMetaEnv(**bad)


# scenario -> ego target speeds [m/s] and the ego's reset row of the Kinematics table, normalized
# by highway-fast's ranges (x +-200 m, y +-12 m, vx and vy +-80 m/s; the ego row is absolute).
SCENE_FACTS = {
    "merge": ([20.0, 25.0, 30.0], [1.0, 30.0 / 200.0, 4.0 / 12.0, 30.0 / 80.0, 0.0]),  # (30, 4) m, east at 30 m/s
    "roundabout": ([0.0, 8.0, 16.0], [1.0, 2.0 / 200.0, 1.0, 0.0, -8.0 / 80.0]),  # (2, 45) m, towards -y at 8 m/s
}


@pytest.mark.parametrize("scenario", sorted(SCENE_FACTS))
def test_other_scenes_share_the_interface(scenario: str) -> None:
    env = gym.make("robo_post/HighwayMeta-v0", scenario=scenario)
    highway = gym.make("robo_post/HighwayMeta-v0", vehicles_count=5)
    assert env.action_space == highway.action_space and env.observation_space == highway.observation_space
    obs, info = env.reset(seed=0)
    core = env.unwrapped.core
    speeds, ego_row = SCENE_FACTS[scenario]
    assert env.unwrapped.scenario == scenario and core.config["policy_frequency"] == 1
    np.testing.assert_array_equal(core.action_type.target_speeds, speeds)
    np.testing.assert_allclose(obs["state"][:5], ego_row, atol=1e-6)
    assert env.observation_space.contains(obs) and INFO_KEYS <= info.keys()
    for action in (LANE_LEFT, IDLE, LANE_RIGHT, FASTER, SLOWER):
        obs, reward, terminated, truncated, info = env.step(np.int64(action))
        assert env.observation_space.contains(obs) and obs["state"].shape == (25,)
        assert INFO_KEYS <= info.keys() and info["events"].dtype == np.float32 and info["events"].shape == (len(EVENTS),)
        assert 0.0 <= info["events"][2] <= 1.0
        assert info["events"][2] == pytest.approx(np.clip(info["rewards"]["high_speed_reward"], 0.0, 1.0))
        assert info["speed"] == core.vehicle.speed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


def test_scenario_and_config_validation() -> None:
    assert SCENARIOS == ("highway", "merge", "roundabout")
    with pytest.raises(InvalidHighwayConfigError, match="highway.*merge.*roundabout"):
        HighwayMetaEnv(scenario="intersection")
    # Config keys are checked against the chosen scene: the roundabout and merge have no lanes_count.
    assert HighwayMetaEnv(lanes_count=2).core.config["lanes_count"] == 2
    with pytest.raises(InvalidHighwayConfigError, match="lanes_count.*roundabout"):
        HighwayMetaEnv(scenario="roundabout", lanes_count=2)
    with pytest.raises(InvalidHighwayConfigError, match="vehicles_count.*merge"):
        HighwayMetaEnv(scenario="merge", vehicles_count=3)
    with pytest.raises(InvalidHighwayConfigError, match="action"):
        HighwayMetaEnv(scenario="roundabout", action={"type": "ContinuousAction"})
    # merge gains a time limit [s]; the scene alone ends only once the ramp is passed.
    assert HighwayMetaEnv(scenario="merge").duration == 20
    assert HighwayMetaEnv(scenario="merge", duration=3).duration == 3
    assert HighwayMetaEnv(scenario="roundabout").duration == 11


def test_a_short_merge_is_truncated_at_its_time_limit() -> None:
    env = make(scenario="merge", duration=2)
    _, _, terminated, truncated, _ = env.step(SLOWER)
    assert not (terminated or truncated)
    _, _, terminated, truncated, _ = env.step(SLOWER)
    assert truncated and not terminated


def test_progress_without_a_high_speed_term_is_derived_from_the_speed() -> None:
    core = make(scenario="merge").unwrapped.core
    ego = core.vehicle
    for speed, progress in ((25.0, 0.5), (35.0, 1.0), (10.0, 0.0)):  # merge's reward_speed_range is [20, 30]
        ego.speed = speed
        assert step_events(core, {"collision_reward": 0.0})[2] == pytest.approx(progress)
    ego.heading = np.pi / 3  # only the forward component counts: 25 cos 60deg = 12.5 m/s
    ego.speed = 25.0
    assert step_events(core, {})[2] == 0.0
    assert step_events(core, {"high_speed_reward": 1.4})[2] == 1.0  # a reported term is clipped to [0, 1]
    with pytest.raises(InvalidHighwayConfigError, match="reward_speed_range"):
        step_events(make(scenario="roundabout").unwrapped.core, {})


def test_vocabulary() -> None:
    assert np.asarray(CANDIDATES).shape == (8, 3)
    assert all(a in range(5) for c in CANDIDATES for a in c)
    assert CANDIDATES[:5] == [[a, IDLE, IDLE] for a in range(5)]
    assert CANDIDATES[5:] == [[LANE_LEFT, FASTER, IDLE], [LANE_RIGHT, FASTER, IDLE], [SLOWER, SLOWER, IDLE]]
    assert len({tuple(c) for c in CANDIDATES}) == 8


def test_events_from_constructed_scenes() -> None:
    env = make(vehicles_count=1)
    core = env.unwrapped.core
    progress = {"high_speed_reward": 0.5}
    stage(env, [(60.0, 25.0)])  # same speed far ahead: no breach
    np.testing.assert_array_equal(step_events(core, progress)[:3], [0.0, 0.0, 0.5])
    stage(env, [(15.0, 10.0)])  # gap 10 m closing at 15 m/s: TTC 0.67 s
    np.testing.assert_array_equal(step_events(core, progress)[:3], [0.0, 1.0, 0.5])
    stage(env, [(-10.0, 40.0)])  # fast car behind: only the car ahead counts
    np.testing.assert_array_equal(step_events(core, progress)[:3], [0.0, 0.0, 0.5])
    stage(env, [(6.0, 0.0)])  # parked car 1 m ahead: the next step hits it
    _, _, terminated, _, info = env.step(IDLE)
    assert terminated and info["crashed"] and info["events"][0] == 1.0
    assert info["events"][2] == pytest.approx(info["rewards"]["high_speed_reward"])
    # progress, the lane rule and being blocked weigh 0 by default
    assert event_reward(info["events"]) == pytest.approx(-1.0 - 0.3 * info["events"][1])
    assert event_reward([1.0, 1.0, 1.0, 1.0, 1.0]) == pytest.approx(-1.3)
    assert event_reward([0, 1, 0.5], (-2.0, -0.5, 0.4)) == pytest.approx(-0.3)
    np.testing.assert_allclose(event_reward(np.array([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [1, 0, 0, 0.5, 0]])), [0.0, -0.3, -1.0])
    with pytest.raises(InvalidCandidatesError):
        event_reward([1.0, 0.0])
    assert EVENT_WEIGHTS == (-1.0, -0.3, 0.0, 0.0, 0.0) and TTC_THRESHOLD == 1.5


def test_off_right_counts_the_lanes_to_the_right_of_the_one_the_ego_heads_for() -> None:
    env = make(vehicles_count=1)
    core = env.unwrapped.core
    ego = core.vehicle
    start, end, _ = ego.lane_index
    stage(env, [])
    for lane, share in ((0, 1.0), (1, 0.5), (2, 0.0)):  # highway-fast: 3 lanes, numbered from the left
        ego.lane_index = ego.target_lane_index = (start, end, lane)
        assert step_events(core, {})[3] == share
    ego.lane_index = ego.target_lane_index = (start, end, 0)
    ego.position = core.road.network.get_lane(ego.lane_index).position(
        core.road.network.get_lane(ego.lane_index).local_coordinates(ego.position)[0], 0.0)
    _, _, _, _, info = env.step(LANE_RIGHT)  # changing lane: the lane it heads for counts, as for right_lane_reward
    assert info["events"][3] == 0.5 == 1.0 - info["rewards"]["right_lane_reward"]
    assert event_reward([0, 0, 0, 0.5], (-1.0, -0.3, 0.0, -0.4)) == pytest.approx(-0.2)


def test_blocked_only_behind_a_car_slower_than_the_lowest_target_speed_once_the_ego_holds_it() -> None:
    env = make(vehicles_count=1)
    core = env.unwrapped.core
    ego = core.vehicle
    assert ego.target_speeds[0] == 20.0 and BLOCKED_HORIZON == 10.0
    # 25 m bumper to bumper (30 m centre to centre) behind a car at 18 m/s: at 20 m/s the ego
    # reaches it in 12.5 s, beyond the horizon; at 15 m, in 7.5 s: blocked.
    for offset, ego_speed, front_speed, expected in ((30.0, 20.0, 18.0, 0.0), (20.0, 20.0, 18.0, 1.0),
                                                     (20.0, 25.0, 18.0, 0.0),  # it can still brake
                                                     (20.0, 20.0, 20.0, 0.0),  # not closing at 20 m/s
                                                     (-20.0, 20.0, 18.0, 0.0)):  # behind it: nobody ahead
        stage(env, [(offset, front_speed)], ego_speed=ego_speed)
        assert blocked(core.road, ego) == expected == step_events(core, {"high_speed_reward": 0.0})[4]
    stage(env, [(20.0, 18.0)], ego_speed=25.0)
    _, _, _, _, info = env.step(SLOWER)  # braking to its lowest target speed does not get it out
    assert ego.target_speed == 20.0 and info["events"][4] == 1.0
    _, _, _, _, info = env.step(LANE_LEFT)  # a lane change does
    assert info["events"][4] == 0.0 and event_reward(info["events"], (0, 0, 0, 0, -0.3)) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "seed"), [("highway", 3), ("merge", 3), ("roundabout", 6)])
def test_counterfactual_scoring_leaves_the_live_env_untouched(scenario: str, seed: int) -> None:
    env, twin = make(seed=seed, oracle=True, scenario=scenario), make(seed=seed, scenario=scenario)
    for action in (IDLE, FASTER):
        env.step(action), twin.step(action)
    assert not env.unwrapped.core.vehicle.crashed  # a live scene to score (these seeds do not crash early)
    before = snapshot(env)
    proxy = counterfactual_scores(env, CANDIDATES)
    oracle = counterfactual_scores(env, CANDIDATES, reactive=True)
    extras = env.unwrapped.candidate_extras(CANDIDATES)
    assert_same(snapshot(env), before)
    # Same state, same candidates: same scores (the copies carry copies of the RNG).
    np.testing.assert_array_equal(counterfactual_scores(env, CANDIDATES), proxy)
    assert set(extras) == {"proxy_scores", "oracle_scores"}
    assert extras["proxy_scores"].dtype == np.float32 and extras["proxy_scores"].shape == (8,)
    np.testing.assert_array_equal(extras["proxy_scores"], proxy.astype(np.float32))
    np.testing.assert_array_equal(extras["oracle_scores"], oracle.astype(np.float32))
    # The scores tell the candidates apart, and are bounded by the weights over 3 steps.
    assert proxy.std() > 0.0 and np.all(np.abs(proxy) <= 1.3 * 3)
    # The next real step is the one an env that never scored anything takes.
    for action in (SLOWER, LANE_LEFT, IDLE):
        a, b = env.step(action), twin.step(action)
        np.testing.assert_array_equal(a[0]["state"], b[0]["state"])
        assert a[1:4] == b[1:4]
        assert_same(a[4], b[4])
    assert set(make(seed=3).unwrapped.candidate_extras()) == {"proxy_scores"}  # no oracle unless asked


@pytest.mark.slow
def test_a_weight_on_a_term_the_scene_lacks_counts_zero() -> None:
    only_right_lane = {**{name: 0.0 for name in PROXY_WEIGHTS}, "right_lane": 1.0}
    # The roundabout reports no right_lane_reward: all-zero scores, not a KeyError.
    roundabout = make(seed=0, scenario="roundabout")
    assert "right_lane_reward" not in roundabout.step(IDLE)[4]["rewards"]
    np.testing.assert_array_equal(counterfactual_scores(roundabout, CANDIDATES, weights=only_right_lane), 0.0)
    np.testing.assert_array_equal(counterfactual_scores(roundabout, CANDIDATES, reactive=True, weights=only_right_lane),
                                  0.0)
    # The same weight counts where the term exists: merge's ego starts in the right lane (term 1).
    merge = make(seed=0, scenario="merge")
    assert counterfactual_scores(merge, [[IDLE]], weights=only_right_lane)[0] == 1.0


def test_an_exact_copy_scores_the_real_outcome() -> None:
    env = make(seed=5)
    for action in (IDLE, LANE_LEFT, FASTER):
        oracle = counterfactual_scores(env, [[action]], reactive=True)[0]
        _, _, _, _, info = env.step(action)
        w, r = PROXY_WEIGHTS, info["rewards"]
        real = (w["high_speed"] * r["high_speed_reward"] + w["right_lane"] * r["right_lane_reward"]
                + w["collision"] * r["collision_reward"] + w["ttc"] * float(info["events"][1]))
        assert oracle == pytest.approx(real, abs=1e-12)


def test_non_reactive_copies_ignore_how_traffic_reacts() -> None:
    env = make(vehicles_count=1)
    stage(env, [(-25.0, 30.0)])  # a faster car 20 m behind; the ego brakes twice
    brake = [CANDIDATES[-1]]
    proxy = counterfactual_scores(env, brake)[0]
    oracle = counterfactual_scores(env, brake, reactive=True)[0]
    # Coasting at 30 m/s, the follower rear-ends the braking ego; the real (IDM) one brakes too.
    assert proxy < -0.5 < 0.0 < oracle
    gamma = 0.9
    assert counterfactual_scores(env, brake, gamma=gamma)[0] != pytest.approx(proxy)
    with pytest.raises(InvalidCandidatesError, match="integers"):
        counterfactual_scores(env, [[IDLE, 7]])
    with pytest.raises(InvalidCandidatesError, match="gamma"):
        counterfactual_scores(env, brake, gamma=0.0)
    with pytest.raises(InvalidCandidatesError, match="weights"):
        counterfactual_scores(env, brake, weights={"speed": 1.0})


def test_an_idle_continuation_shows_the_collision_after_the_candidate() -> None:
    env = make(vehicles_count=1, continuation=3)
    stage(env, [(50.0, 20.0)], ego_speed=30.0)  # a slower car 45 m ahead: 4.5 s to reach it at 30 m/s
    cruise, brake = [IDLE, IDLE, IDLE], CANDIDATES[-1]
    short = counterfactual_scores(env, [cruise, brake])
    longer = counterfactual_scores(env, [cruise, brake], continuation=3)
    # Within its own 3 steps cruising is faster and still safe; 3 more idle steps reach the car.
    assert short[0] > short[1]
    assert longer[0] < longer[1] and longer[0] < short[0] - 0.5
    np.testing.assert_array_equal(counterfactual_scores(env, [cruise, brake], continuation=0), short)
    np.testing.assert_array_equal(env.unwrapped.candidate_extras([cruise, brake])["proxy_scores"],
                                  longer.astype(np.float32))
    with pytest.raises(InvalidCandidatesError, match="continuation"):
        counterfactual_scores(env, [brake], continuation=-1)
    with pytest.raises(InvalidCandidatesError, match="continuation"):
        make(continuation=-2)


def test_heuristic_driver() -> None:
    env = make(vehicles_count=1)
    driver = HeuristicDriver()
    for offset, expected in ((15.0, SLOWER), (30.0, IDLE), (-10.0, IDLE)):  # gaps 10 m, 25 m, nobody ahead
        stage(env, [(offset, 25.0)])
        assert driver(env) == expected
    # Over a whole episode in traffic it only idles or brakes, and keeps its lane.
    env = env_spec("highway_meta").make()
    obs, _ = env.reset(seed=7)
    act = env_spec("highway_meta").make_expert(env, noise=0.0, seed=0)
    lane, actions, done = env.unwrapped.core.vehicle.lane_index, [], False
    while not done:
        actions.append(int(act(obs)))
        obs, _, terminated, truncated, _ = env.step(actions[-1])
        done = terminated or truncated
        assert env.unwrapped.core.vehicle.target_lane_index == lane
    assert set(actions) <= {IDLE, SLOWER} and SLOWER in actions
    # Noise: that share of uniformly random actions, reproducible by seed.
    noisy = [HeuristicDriver(noise=1.0, seed=s) for s in (0, 0, 1)]
    runs = [[int(d(env)) for _ in range(40)] for d in noisy]
    assert runs[0] == runs[1] != runs[2] and set(runs[0]) == set(range(5))


def test_keep_right_driver_moves_right_only_into_a_free_lane() -> None:
    env = make(vehicles_count=1)
    core = env.unwrapped.core
    start, end, _ = core.vehicle.lane_index
    n_lanes = len(core.road.network.graph[start][end])
    keep_right, plain = HeuristicDriver(keep_right=True), HeuristicDriver()

    def place(lane_id: int, right_lane_car: float | None) -> None:
        """The ego alone at 25 m/s in ``lane_id``, one car at that offset [m] in the lane to its right."""
        lane = core.road.network.get_lane((start, end, lane_id))
        ego = core.vehicle
        ego.position, ego.heading, ego.speed = lane.position(100.0, 0.0), lane.heading_at(100.0), 25.0
        ego.lane_index = ego.target_lane_index = (start, end, lane_id)
        core.road.vehicles = [ego]
        if right_lane_car is not None:
            right = core.road.network.get_lane((start, end, lane_id + 1))
            car = IDMVehicle(core.road, right.position(100.0 + right_lane_car, 0.0), heading=right.heading_at(100.0),
                             speed=25.0)
            car.check_collisions = False
            core.road.vehicles.append(car)

    place(0, None)
    assert keep_right(env) == LANE_RIGHT and plain(env) == IDLE
    for offset in (15.0, -10.0):  # centre to centre: gaps of 10 m ahead, 5 m behind: not free
        place(0, offset)
        assert keep_right(env) == IDLE
    place(0, 40.0)
    assert keep_right(env) == LANE_RIGHT
    place(n_lanes - 1, None)  # already in the rightmost lane
    assert keep_right(env) == IDLE


# scenario -> (kwargs, where the ego is staged along its lane [m], its speed [m/s]): straight
# stretches of the main road (merge) and of the south entry (roundabout).
STAGES = {"merge": ({"scenario": "merge"}, 60.0, 25.0), "roundabout": ({"scenario": "roundabout"}, 60.0, 8.0)}


@pytest.mark.parametrize("scenario", sorted(STAGES))
def test_heuristic_driver_in_other_scenes(scenario: str) -> None:
    kwargs, at, speed = STAGES[scenario]
    env, driver = make(**kwargs), HeuristicDriver()
    for offset, others, expected in ((15.0, 2.0, SLOWER), (30.0, 2.0, IDLE), (-10.0, 20.0, IDLE)):
        stage(env, [(offset, others)], ego_speed=speed, at=at)  # gaps 10 m, 25 m, nobody ahead
        assert driver(env) == expected
    # A whole episode: only idling or braking, never a lane-change action.
    env = env_spec("highway_meta").make(**kwargs)
    obs, _ = env.reset(seed=4)
    act = env_spec("highway_meta").make_expert(env, noise=0.0, seed=0)
    lane, actions, done = env.unwrapped.core.vehicle.lane_index[2], [], False
    while not done:
        actions.append(int(act(obs)))
        obs, _, terminated, truncated, info = env.step(actions[-1])
        done = terminated or truncated
        assert 0.0 <= info["events"][2] <= 1.0
    assert set(actions) <= {IDLE, SLOWER} and 2 <= len(actions) <= env.unwrapped.duration
    if scenario == "merge":  # the main road keeps its lane ids across segments
        assert env.unwrapped.core.vehicle.lane_index[2] == lane


@pytest.mark.slow
@pytest.mark.fleet
def test_collect_with_the_cli(tmp_path) -> None:
    root = str(tmp_path / "store")
    run_cli("collect", "env=highway_meta", "episodes=2", f"store={root}", "fleet.n_clients=1", "show=false",
            timeout=180)
    store = Store.open(root)
    assert store.schema.attrs["env"] == "highway_meta" and list(store.schema.observations) == ["state"]
    episodes = store.snapshot().episodes()
    assert len(episodes) == 2
    for e in episodes:
        assert e.task_id == "robo_post/HighwayMeta-v0" and e.success is not None
        assert set(e.attrs["metrics"]) == {"collision", "mean_speed"}
        assert e.success == (not e.attrs["metrics"]["collision"])
        assert 15.0 < e.attrs["metrics"]["mean_speed"] < 35.0


@pytest.mark.slow
@pytest.mark.fleet
def test_collect_a_roundabout_with_the_cli(tmp_path) -> None:
    root = str(tmp_path / "store")
    run_cli("collect", "env=highway_meta", "+env.kwargs.scenario=roundabout", "policy=expert", "episodes=2",
            f"store={root}", "fleet.n_clients=1", "show=false", timeout=180)
    episodes = Store.open(root).snapshot().episodes()
    assert len(episodes) == 2
    for e in episodes:
        assert e.attrs["env_kwargs"] == {"scenario": "roundabout"} and 1 <= e.length <= 11
        assert 0.0 < e.attrs["metrics"]["mean_speed"] <= 17.0  # target speeds 0, 8, 16 m/s


@pytest.mark.parametrize("scenario", ["highway", "merge"])
def test_more_observed_vehicles_extend_the_table_nearest_first(scenario) -> None:
    base, wide = make(scenario=scenario), make(scenario=scenario, observed_vehicles=8)
    obs, _ = base.reset(seed=4)
    more, _ = wide.reset(seed=4)
    assert more["state"].shape == (40,) and wide.observation_space["state"].shape == (40,)
    # the same scene: the first five rows are the default table, the extra rows the next-nearest vehicles
    np.testing.assert_array_equal(more["state"][:25], obs["state"])
    if scenario == "highway":  # 20 cars on the road: more of them are in view
        assert more["state"][25:].reshape(3, 5)[:, 0].sum() > 0
    for action in (FASTER, LANE_LEFT):
        obs, *_ = base.step(np.int64(action))
        more, *_ = wide.step(np.int64(action))
        np.testing.assert_array_equal(more["state"][:25], obs["state"])
    with pytest.raises(InvalidHighwayConfigError, match="observed_vehicles"):
        HighwayMetaEnv(observed_vehicles=0)


def test_ego_targets_append_the_controllers_target_speed_and_lane_change() -> None:
    base, env = make(), make(ego_targets=True)
    obs, _ = base.reset(seed=2)
    seen, _ = env.reset(seed=2)
    assert seen["state"].shape == (27,) and env.observation_space.contains(seen)
    np.testing.assert_array_equal(seen["state"][:25], obs["state"])  # the table itself is unchanged
    ego = env.unwrapped.core.vehicle
    assert seen["state"][25] == pytest.approx(ego.target_speed / 40.0) and seen["state"][26] == 0.0
    seen, *_ = env.step(np.int64(FASTER))  # FASTER raises the target at once; the speed follows
    assert seen["state"][25] == pytest.approx(ego.target_speed / 40.0) and ego.target_speed > ego.speed - 1e-6
    # a lane change in progress: the target lane differs from the current one
    ego.target_lane_index = (*ego.lane_index[:2], ego.lane_index[2] + 1)
    assert env.unwrapped._observation(np.zeros(25))["state"][26] == 1.0


def test_lane_features_place_the_cars_ahead_and_behind_per_lane() -> None:
    base, env = make(vehicles_count=1), make(vehicles_count=1, lane_features=True)
    assert env.observation_space["state"].shape == (25 + 19,)
    core = env.unwrapped.core
    ego = core.vehicle
    start, end, _ = ego.lane_index
    lanes = [core.road.network.get_lane((start, end, i)) for i in range(3)]
    s = 200.0
    ego.position, ego.heading, ego.lane_index = lanes[1].position(s, 0.0), lanes[1].heading_at(s), (start, end, 1)
    ego.speed = 25.0
    core.road.vehicles = [ego]
    for lane, offset, speed in ((1, 35.0, 20.0), (0, -25.0, 30.0)):  # slower car ahead; faster car behind, left
        car = IDMVehicle(core.road, lanes[lane].position(s + offset, 0.0), heading=lanes[lane].heading_at(s), speed=speed)
        core.road.vehicles.append(car)
    table = env.unwrapped._observation(np.zeros(25))["state"][25:]
    diagonal = np.hypot(25.0, lanes[0].width_at(s))  # the left car is a lane width to the side
    expected = [
        [1.0, 1.0, 0.0, 1.0, (diagonal - 5.0) / 100, 5.0 * 25.0 / diagonal / 20],  # left: only a car behind
        [1.0, 30.0 / 100, 5.0 / 20, 6.0 / 10, 1.0, 0.0],  # own: 30 m bumper to bumper, closing 5 m/s, 6 s
        [1.0, 1.0, 0.0, 1.0, 1.0, 0.0],  # right: empty
    ]
    np.testing.assert_allclose(table, [*np.ravel(expected), 25.0 / 40.0], atol=1e-5)
    ego.position, ego.lane_index = lanes[0].position(s, 0.0), (start, end, 0)  # the leftmost lane has no left
    table = env.unwrapped._observation(np.zeros(25))["state"][25:]
    np.testing.assert_array_equal(table[:6], np.zeros(6))
    obs, _ = env.reset(seed=2)  # the Kinematics table in front is unchanged
    np.testing.assert_array_equal(obs["state"][:25], base.reset(seed=2)[0]["state"])
    assert env.observation_space.contains(obs)
