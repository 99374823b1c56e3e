"""Environments by id: registry lookups, observation flattening, and the fleet and
eval on plain gymnasium envs (InvertedPendulum-v5 with a random policy, CartPole-v1
with a stable-baselines3 PPO agent) and on driving (per-scenario metrics).

Episodes are capped at a few dozen steps so every test stays well under 20 s.
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede importing mujoco

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from robo_post.envs import (
    EnvMakeError,
    NoExpertError,
    UnknownEnvError,
    UnknownTaskError,
    UnsupportedSpaceError,
    env_spec,
)
from robo_post.envs.registry import expand_env_override, generic_success
from robo_post.eval import evaluate, write_report
from robo_post.eval.rollout import mean_interval, wilson_interval
from robo_post.fleet.client import (
    ClientConfig,
    InvalidActionError,
    OverseerUnsupportedError,
    executable_action,
    run_client,
    store_schema,
)
from robo_post.fleet.policies import ExpertPolicy, build_policy
from robo_post.store import Store
from robo_post.store.integrity import validate_store

PENDULUM = {"name": "InvertedPendulum-v5", "max_episode_steps": 15}


def test_alias_and_id_find_the_same_spec():
    for alias, env_id in (("tabletop", "robo_post/Tabletop-v0"), ("driving", "robo_post/Driving-v0")):
        spec = env_spec(alias)
        assert env_spec(env_id) is spec and spec.key == alias and spec.id == env_id
    assert env_spec("tabletop").default_tasks() == ("reach", "push", "pick", "place")
    assert env_spec("driving").default_tasks() == ("highway-fast", "merge", "roundabout")
    assert (env_spec("tabletop").execute_steps, env_spec("tabletop").horizon) == (4, 8)
    assert env_spec("tabletop").language and env_spec("tabletop").supports_overseer


def test_a_plain_gymnasium_id_gets_a_generic_spec():
    spec = env_spec("CartPole-v1")
    assert spec.key == "CartPole-v1" and spec.default_tasks() == ("CartPole-v1",)
    assert spec.execute_steps == 1 and not spec.language and not spec.supports_overseer
    env = spec.make()
    try:
        assert list(env.observation_space.spaces) == ["observation"]  # the store's key for bare observations
        obs, _ = env.reset(seed=0)
        assert obs["observation"].shape == (4,) and isinstance(env.action_space, spaces.Discrete)
    finally:
        env.close()
    with pytest.raises(UnknownTaskError, match="CartPole-v1"):
        spec.make("balance")
    with pytest.raises(NoExpertError, match="CartPole-v1"):
        spec.make_expert(env)


def test_unknown_id_names_our_envs_and_gymnasium():
    with pytest.raises(UnknownEnvError) as err:
        env_spec("NoSuchEnv-v0")
    message = str(err.value)
    assert "tabletop" in message and "driving" in message and "not a registered gymnasium id" in message
    assert message.endswith("; an env your own module registers is env=MODULE:ID")  # Minari records ids without it
    assert isinstance(err.value, ValueError)


class _NestedObsEnv(gym.Env):
    observation_space = spaces.Dict({"arm": spaces.Dict({"q": spaces.Box(-1, 1, (2,))}), "t": spaces.Discrete(3)})
    action_space = spaces.Box(-1, 1, (1,))


class _TupleObsEnv(_NestedObsEnv):
    observation_space = spaces.Tuple((spaces.Discrete(2), spaces.Discrete(2)))


@pytest.mark.parametrize("cls, what", [(_NestedObsEnv, "'arm'"), (_TupleObsEnv, "Tuple")])
def test_nested_observation_spaces_are_refused(cls, what):
    env_id = f"test_registry/{cls.__name__}-v0"
    gym.register(env_id, entry_point=cls)
    try:
        with pytest.raises(UnsupportedSpaceError, match=what):
            env_spec(env_id).make()
    finally:
        del gym.registry[env_id]


def test_generic_success_rule():
    assert generic_success({"is_success": 1.0, "success": False}) is True  # is_success first
    assert generic_success({"success": False}) is False
    assert generic_success({"x_position": 3.0}) is None  # undefined, not a failure


def test_kwargs_the_env_refuses_or_a_missing_dependency_are_a_typed_error(monkeypatch):
    """A misspelt or missing ``+env.kwargs.X``, or an env whose module needs an uninstalled
    package (Box2D's), was a traceback from gymnasium."""
    with pytest.raises(EnvMakeError, match=r"'Pendulum-v1' cannot be made with kwargs \{'gravity': 5.0\}: "
                       r".*unexpected keyword argument 'gravity'"):
        env_spec("Pendulum-v1").make(gravity=5.0)
    env = env_spec("Pendulum-v1").make(g=5.0)  # the env's own name for it
    assert env.unwrapped.g == 5.0
    env.close()

    def missing(*_, **__):
        raise gym.error.DependencyNotInstalled("Box2D is not installed")

    monkeypatch.setattr(gym, "make", missing)  # as gymnasium.make does when importing the env's module fails
    with pytest.raises(EnvMakeError, match="'Pendulum-v1' cannot be made: Box2D is not installed"):
        env_spec("Pendulum-v1").make()


def test_env_override_for_an_id_without_a_config_file():
    assert expand_env_override(["env=Hopper-v5", "episodes=3"], ["tabletop", "driving", "gym"]) == [
        "env=gym", "env.name=Hopper-v5", "episodes=3"]
    assert expand_env_override(["env=driving", "env.kwargs.x=1"], ["driving"]) == ["env=driving", "env.kwargs.x=1"]


def test_integer_actions_are_checked_not_clipped_or_cast():
    discrete = spaces.Discrete(3, start=1)
    action = executable_action(np.int64(3), discrete)
    assert action.dtype == np.int64 and int(action) == 3
    assert {action: "hashable"}[3] == "hashable"  # envs index dicts with it (FrozenLake, Taxi)
    with pytest.raises(InvalidActionError, match="outside"):
        executable_action(4, discrete)
    with pytest.raises(InvalidActionError, match="dtype"):
        executable_action(1.7, discrete)
    box = spaces.Box(-1.0, 1.0, (2,), np.float32)
    np.testing.assert_array_equal(executable_action([2.0, -0.5], box), np.array([1.0, -0.5], np.float32))
    with pytest.raises(InvalidActionError, match="non-finite"):
        executable_action([np.nan, 0.0], box)


def test_expert_and_overseer_need_an_env_that_has_them(tmp_path):
    env = env_spec("InvertedPendulum-v5").make()
    with pytest.raises(NoExpertError):
        ExpertPolicy().reset(env, 0)
    env.close()
    store = Store.create(str(tmp_path / "s"), store_schema(PENDULUM, None))
    with pytest.raises(OverseerUnsupportedError, match="InvertedPendulum-v5"):
        run_client(ClientConfig(store=store.root, client_id="c", episodes=1, env=PENDULUM,
                                policy={"kind": "random"}, overseer={"enabled": True}))


@pytest.mark.slow
@pytest.mark.fleet
def test_collect_and_eval_a_gymnasium_env_with_a_random_policy(tmp_path):
    root = str(tmp_path / "store")
    cli = os.path.join(os.path.dirname(sys.executable), "robo-post")
    proc = subprocess.run(
        [cli, "collect", f"store={root}", "env=gym", "env.name=InvertedPendulum-v5", "+env.kwargs.max_episode_steps=15",
         "policy=random", "episodes=3", "fleet.n_clients=1", "fleet.client_prefix=play", "show=false"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert validate_store(root)[1] == []
    store = Store.open(root)
    assert store.schema.attrs["env"] == "InvertedPendulum-v5" and list(store.schema.observations) == ["observation"]
    played = store.snapshot().episodes()
    assert len(played) == 3 and {(e.role, e.task_id, e.success, e.instruction) for e in played} == {
        ("play", "InvertedPendulum-v5", None, "")}

    # The env comes from the store's schema; version 0 runs the given policy.
    r = evaluate(root, None, None, 4, n_clients=1, env_kwargs={"max_episode_steps": 15},
                 out_store=str(tmp_path / "eval"), policy={"kind": "random"})
    assert r["policy"]["label"] == "random" and r["env"]["name"] == "InvertedPendulum-v5"
    episodes = Store.open(r["eval_store"]).snapshot().episodes(client=r["shards"])
    assert {e.role for e in episodes} == {"eval"}
    s = r["tasks"]["InvertedPendulum-v5"]
    assert (s["episodes"], s["judged"], s["success_rate"], s["ci95"]) == (4, 0, None, None)
    assert r["mean_success_rate"] is None and "undefined" in r["success_rule"]
    returns, lengths = [e.ret for e in episodes], [e.length for e in episodes]
    assert len(set(lengths)) > 1  # random episodes differ, so the intervals have width
    assert s["mean_return"] == pytest.approx(np.mean(returns)) and s["mean_length"] == pytest.approx(np.mean(lengths))
    lo, hi = s["return_ci95"]
    half = 3.182446305284263 * np.std(returns, ddof=1) / 2  # t(0.975, df=3) * s / sqrt(4)
    assert (lo, hi) == pytest.approx((np.mean(returns) - half, np.mean(returns) + half))
    assert s["length_ci95"] == pytest.approx(mean_interval(lengths, low=0))

    md = open(write_report(str(tmp_path / "report"), [r])).read()
    assert "| InvertedPendulum-v5 | 4 | – | – |" in md and "## Success rates" not in md
    assert "rollouts_random-train_InvertedPendulum-v5.png" in md
    assert os.path.getsize(tmp_path / "report" / "rollouts_random-train_InvertedPendulum-v5.png") > 10_000


@pytest.mark.slow
@pytest.mark.fleet
def test_driving_eval_reports_metrics_per_scenario(tmp_path):
    env = {"name": "driving", "duration": 8}
    store = Store.create(str(tmp_path / "store"), store_schema(env, "highway-fast"))
    scenarios = ["highway-fast", "merge"]
    r = evaluate(store.root, None, scenarios, 2, n_clients=1, env_kwargs={"duration": 8},
                 out_store=str(tmp_path / "eval"))
    episodes = Store.open(r["eval_store"]).snapshot().episodes(client=r["shards"])
    for scenario in scenarios:
        s = r["tasks"][scenario]
        mine = [e for e in episodes if e.task_id == scenario]
        assert s["episodes"] == len(mine) == 2 and s["success_rate"] == 1.0  # the expert drives safely
        assert set(s["metrics"]) == {"collision", "off_road", "mean_speed"}
        for rate in ("collision", "off_road"):
            assert s["metrics"][rate]["rate"] == 0.0
            assert s["metrics"][rate]["ci95"] == pytest.approx(list(wilson_interval(0, 2)))
        speeds = [e.attrs["metrics"]["mean_speed"] for e in mine]
        assert all(15.0 < v < 35.0 for v in speeds)
        assert s["metrics"]["mean_speed"]["mean"] == pytest.approx(np.mean(speeds))
        assert s["metrics"]["mean_speed"]["ci95"] == pytest.approx(mean_interval(speeds))


@pytest.mark.slow
def test_eval_refuses_an_env_that_observes_other_shapes_than_the_policy_was_trained_on(tmp_path):
    from robo_post.eval.rollout import EnvMismatchError
    from robo_post.models.features import state_features
    from robo_post.models.flow import FlowPolicy, FlowPolicyConfig
    from robo_post.store import PolicyRegistry

    collected = {"name": "driving", "duration": 4, "observed_vehicles": 3}  # the training data's env kwargs
    store = Store.create(str(tmp_path / "store"), store_schema(collected, "highway-fast"))
    model = FlowPolicy(FlowPolicyConfig(features=state_features(27, "state"), action_dim=2, horizon=2, use_text=False,
                                        embed_dim=8, hidden_dim=16, flow_steps=2))
    version = PolicyRegistry(store.root).publish(*model.artifact(algorithm="untrained"))
    out = str(tmp_path / "eval")
    with pytest.raises(EnvMismatchError, match=r"\(45,\).*\(27,\)"):  # default 5 vehicles x 9 columns vs 3 x 9
        evaluate(store.root, version, ["highway-fast"], 1, n_clients=1, env_kwargs={"duration": 4}, out_store=out)
    assert not os.path.exists(out)  # refused before any client or store was made
    r = evaluate(store.root, version, ["highway-fast"], 1, n_clients=1, out_store=out,
                 env_kwargs={"duration": 4, "observed_vehicles": 3})
    assert r["tasks"]["highway-fast"]["episodes"] == 1

    # Once the store holds episodes, each records its env kwargs and eval rebuilds that env by default.
    run_client(ClientConfig(store=store.root, client_id="demo", episodes=1, env=collected, tasks=["highway-fast"],
                            follow_registry=False))
    recorded = store.snapshot().episodes()[0].attrs
    assert recorded["env_kwargs"] == {"duration": 4, "observed_vehicles": 3}
    assert recorded["step_limit"] == 4  # bounds eval's length interval (the kwargs name no max_episode_steps)
    r = evaluate(store.root, version, ["highway-fast"], 2, n_clients=1, out_store=out)
    assert r["env"] == collected and r["tasks"]["highway-fast"]["episodes"] == 2
    # given kwargs go on top of the recorded ones one key at a time (they replaced them all: the recorded
    # observed_vehicles was dropped, and the env observed other shapes than the policy's data)
    r = evaluate(store.root, version, ["highway-fast"], 1, n_clients=1, out_store=out, env_kwargs={"duration": 3})
    assert r["env"] == {"name": "driving", "duration": 3, "observed_vehicles": 3}


class _HalfTorquePendulum(gym.Env):
    """Observes like Pendulum-v1 (float32 (3,)) but takes torques in [-1, 1], not [-2, 2]."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, False, True, {}


gym.register("robo_post_test/HalfTorquePendulum-v0", entry_point=_HalfTorquePendulum)


@pytest.mark.slow
def test_collect_without_the_recorded_env_kwargs_names_them(tmp_path):
    """It was one 1,650-character line listing every bound of both observation layouts."""
    cli = os.path.join(os.path.dirname(sys.executable), "robo-post")
    args = [cli, "collect", "env=driving", "+env.kwargs.duration=2", "policy=expert", "episodes=1",
            f"store={tmp_path / 's'}", "fleet.n_clients=1", "show=false"]
    first = subprocess.run([*args, "+env.kwargs.observed_vehicles=3"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ("was recorded in env 'driving' with kwargs {'duration': 2, 'observed_vehicles': 3}" in r.stderr
            and r.stderr.strip().endswith("collect with them: +env.kwargs.duration=2 +env.kwargs.observed_vehicles=3"))


def _pendulum_flow(tmp_path) -> tuple[Store, int]:
    """A Pendulum-v1 store and an untrained flow policy of its observation published in it."""
    from robo_post.models.features import state_features
    from robo_post.models.flow import FlowPolicy, FlowPolicyConfig
    from robo_post.store import PolicyRegistry

    store = Store.create(str(tmp_path / "store"), store_schema({"name": "Pendulum-v1"}, None))
    model = FlowPolicy(FlowPolicyConfig(features=state_features(3, "observation"), action_dim=1, horizon=1,
                                        use_text=False, embed_dim=8, hidden_dim=16, flow_steps=2,
                                        action_low=[-2.0], action_high=[2.0]))
    return store, PolicyRegistry(store.root).publish(*model.artifact(algorithm="untrained"))


def test_eval_refuses_an_env_whose_actions_differ_from_the_training_data(tmp_path):
    """``env=`` another env observing alike: the policy's [-2, 2] torques were silently clipped to [-1, 1]."""
    from robo_post.eval.rollout import EnvMismatchError

    store, version = _pendulum_flow(tmp_path)
    out = str(tmp_path / "eval")
    with pytest.raises(EnvMismatchError, match=r"takes actions float32 \(1,\) in \[\[-1.0\], \[1.0\]\], but the "
                       r"policy was trained on actions float32 \(1,\) in \[\[-2.0\], \[2.0\]\]: the policy's data "
                       r"was recorded in env 'Pendulum-v1'"):
        evaluate(store.root, version, None, 1, n_clients=1, env="robo_post_test/HalfTorquePendulum-v0", out_store=out)
    assert not os.path.exists(out)


@pytest.mark.fleet
def test_fleet_records_a_cartpole_sb3_agent_with_integer_actions(tmp_path):
    from stable_baselines3 import PPO

    agent = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=1, seed=0, device="cpu")
    agent.learn(total_timesteps=256)
    path = str(tmp_path / "agent.zip")
    agent.save(path)
    env = {"name": "CartPole-v1", "max_episode_steps": 30}
    store = Store.create(str(tmp_path / "store"), store_schema(env, None))
    assert store.schema.action.dtype == "int64"
    policy = {"kind": "sb3", "path": path, "algo": "PPO", "deterministic": True}
    status = run_client(ClientConfig(store=store.root, client_id="deploy-0", episodes=3, env=env, policy=policy,
                                     role="deploy"))
    assert status["state"] == "done" and status["judged"] == 0
    assert validate_store(store.root)[1] == []
    snap = store.snapshot()
    loaded = build_policy({}, policy)
    for ep in snap.episodes():
        data = snap.load(ep)
        assert ep.role == "deploy" and data["action"].dtype == np.int64 and set(data["action"]) <= {0, 1}
        expected = [int(loaded.act({"observation": o}, None)) for o in data["obs"]["observation"][:-1]]
        assert data["action"].tolist() == expected  # the agent's own greedy actions, unchanged
    with pytest.raises(ValueError, match="stable-baselines3"):
        build_policy({}, {**policy, "algo": "NotAnAlgo"})


def test_an_env_observing_other_keys_is_named_with_what_it_observes(tmp_path):
    """The error said the env 'observes {}': it listed only the keys the policy reads."""
    from robo_post.eval.rollout import EnvMismatchError

    store, version = _pendulum_flow(tmp_path)
    with pytest.raises(EnvMismatchError, match=r"env 'tabletop' with kwargs \{.*\} observes \{'proprio': \('float32', "
                       r"\(\d+,\)\), 'task_id': \('int64', \(\)\)\}, but the policy was trained on \{'observation': \('float32', \(3,\)\)\}"):
        evaluate(store.root, version, ["reach"], 1, n_clients=1, env="tabletop", out_store=str(tmp_path / "eval"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["highway_meta", "driving"])
def test_driving_frames_render_without_a_display_and_without_sdl_errors(name):
    """Every report on a driving env printed SDL's "error: XDG_RUNTIME_DIR is invalid or not set"."""
    code = (f"from robo_post.envs import env_spec; env = env_spec({name!r}).make(render_mode='rgb_array'); "
            "env.reset(seed=0); frame = env.render(); print(frame.shape, float(frame.mean()))")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "XDG_RUNTIME_DIR",
                                                             "SDL_VIDEODRIVER")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    shape, mean = r.stdout.rsplit(" ", 1)
    assert float(mean) > 10  # a drawn road, not a black frame
