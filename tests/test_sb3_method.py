"""`algo=sb3`: an SB3 agent trained from the CLI in a discrete-action env, published without
pickle, run by the fleet from the registry, stored with integer actions, validated, and
round-tripped through Minari."""

import json
import os

import gymnasium as gym
import numpy as np
import pytest
from omegaconf import OmegaConf

from robo_post.algos.sb3_agent import SB3Agent, SB3AgentConfig
from robo_post.config import compose
from robo_post.envs.registry import UnsupportedSpaceError
from robo_post.fleet.policies import build_policy
from robo_post.learner.runs import RunResumeError
from robo_post.learner.train import train
from robo_post.store import PolicyRegistry, Store, StoreError
from robo_post.store.schema import StoreSchema
from robo_post.store.integrity import validate_store

from helpers import run_cli


def _cli(*args: str) -> str:
    return run_cli(*args).stdout


@pytest.mark.slow
@pytest.mark.fleet
def test_sb3_agent_trains_publishes_and_is_collected_with_discrete_actions(tmp_path):
    store, run_dir = str(tmp_path / "store"), str(tmp_path / "ppo")
    _cli("train", "algo=sb3", "algo.env=CartPole-v1", "algo.timesteps=512", "+algo.hyperparameters.n_steps=128",
         "+algo.hyperparameters.batch_size=64", f"store={store}", f"run_dir={run_dir}", "show=false",
         "checkpoint_every=256")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["version"] == 1 and summary["timesteps"] == 512
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["update"] for r in rows] == [128, 256, 384, 512] and "episode_return" in rows[-1]
    registry = PolicyRegistry(store)
    assert registry.load(1)[1]["kind"] == "sb3_agent"
    assert not any(f.endswith((".zip", ".pkl")) for f in os.listdir(os.path.join(store, "policies", "v000001")))

    # Re-running the finished run trains and publishes nothing; with another acting setting
    # it publishes the same weights again under it.
    args = ["train", "algo=sb3", "algo.env=CartPole-v1", "algo.timesteps=512", "+algo.hyperparameters.n_steps=128",
            "+algo.hyperparameters.batch_size=64", f"store={store}", f"run_dir={run_dir}", "show=false",
            "checkpoint_every=256"]
    assert json.loads(_cli(*args))["version"] == 1 and registry.versions() == [1]
    r = run_cli(*args, "algo.deterministic=false")
    assert "(algo.deterministic: True -> False); its weights are published again under the new ones without " \
           "training" in r.stderr
    (w1, c1), (w2, c2) = registry.load(1), registry.load(2)
    assert all(np.array_equal(w1[k].numpy(), w2[k].numpy()) for k in w1)
    assert (c1["deterministic"], c2["deterministic"]) == (True, False)
    assert "same_weights_as" not in c1 and c2["same_weights_as"] == 1  # marked as v1's weights, not retrained
    # back to v1's settings: v1 is that policy (a third copy of it was published)
    assert json.loads(_cli(*args, "algo.deterministic=true"))["version"] == 1 and registry.versions() == [1, 2]

    # The fleet runs the pinned version: every action is the published agent's greedy action.
    _cli("collect", "env=CartPole-v1", f"store={store}", "policy=random", "episodes=3", "fleet.n_clients=1",
         "fleet.client_prefix=deploy", "fleet.policy_version=1", "show=false")
    snap = Store.open(store).snapshot()
    agent = build_policy(*registry.load(1))
    for ep in snap.episodes():
        data = snap.load(ep)
        assert ep.role == "deploy" and ep.policy_version == 1 and data["action"].dtype == np.int64
        greedy = [int(agent.act({"observation": o}, None)) for o in data["obs"]["observation"][:-1]]
        assert data["action"].tolist() == greedy
    assert validate_store(store)[1] == []

    # Minari round trip of the integer actions.
    minari_root = str(tmp_path / "minari")
    _cli("store", "export-minari", store, "cartpole/ppo-v0", "--minari-root", minari_root)
    back = str(tmp_path / "back")
    _cli("store", "import-minari", "cartpole/ppo-v0", back, "--minari-root", minari_root)
    original = {e.seed: snap.load(e)["action"] for e in snap.episodes()}
    imported = Store.open(back).snapshot()
    assert Store.open(back).schema.action.dtype == "int64"
    for e in imported.episodes():
        np.testing.assert_array_equal(imported.load(e)["action"], original[e.seed])

    # Offline BC of the imported integer actions clones the agent, and eval runs the clone.
    _cli("train", f"store={back}", "algo=categorical_bc", "updates=400", "data.success=null", "show=false",
         f"run_dir={tmp_path / 'clone'}")
    clone = build_policy(*PolicyRegistry(back).load(1))
    env = gym.make("CartPole-v1")
    obs = np.concatenate([imported.load(e)["obs"]["observation"][:-1] for e in imported.episodes()])
    agree = np.mean([clone.act({"observation": o}, env) == agent.act({"observation": o}, None) for o in obs])
    assert agree > 0.9, agree
    _cli("eval", f"store={back}", "version=1", "episodes_per_task=2", "show=false", "device=auto")  # clients got 'auto'
    rollouts = Store.open(back + "-eval").snapshot()
    assert len(rollouts) == 2
    for e in rollouts.episodes():  # every evaluated action is the clone's greedy one
        data = rollouts.load(e)
        greedy = [int(clone.act({"observation": o}, env)) for o in data["obs"]["observation"][:-1]]
        assert data["action"].tolist() == greedy


@pytest.mark.slow
def test_a_finished_run_past_its_budget_publishes_again_under_other_settings(tmp_path):
    """PPO stops at the end of a rollout, past a budget that is no multiple of it (512 of 500):
    rerun with another acting setting it publishes its weights again; a smaller budget is refused."""
    store, run_dir = str(tmp_path / "store"), str(tmp_path / "ppo")
    args = ["train", "algo=sb3", "algo.env=CartPole-v1", "+algo.hyperparameters.n_steps=128",
            "+algo.hyperparameters.batch_size=64", f"store={store}", f"run_dir={run_dir}", "show=false"]
    assert json.loads(_cli(*args, "algo.timesteps=500"))["timesteps"] == 512
    assert json.loads(_cli(*args, "algo.timesteps=500", "algo.deterministic=false"))["version"] == 2
    r = run_cli(*args, "algo.timesteps=256", ok=False)
    assert r.returncode != 0 and "has already trained timesteps 512, more than algo.timesteps=256" in r.stderr


@pytest.mark.slow
def test_an_sb3_run_killed_after_publishing_does_not_publish_again(tmp_path):
    store, run_dir = str(tmp_path / "store"), str(tmp_path / "ppo")
    args = ["train", "algo=sb3", "algo.env=CartPole-v1", "algo.timesteps=128", "+algo.hyperparameters.n_steps=128",
            "+algo.hyperparameters.batch_size=64", f"store={store}", f"run_dir={run_dir}", "show=false"]
    assert json.loads(_cli(*args))["version"] == 1
    os.remove(os.path.join(run_dir, "summary.json"))  # killed after publishing (e.g. in a final evaluation)
    assert json.loads(_cli(*args))["version"] == 1 and PolicyRegistry(store).versions() == [1]


def test_an_sb3_run_recorded_under_older_learner_settings_grows_and_republishes(tmp_path):
    """The learner's settings (batch size, update budget, flow model, data selection) are not
    SB3's: a run recorded before one of them existed or changed still resumes to a larger
    budget, and its finished run still republishes under a changed acting setting."""
    store, run_dir = str(tmp_path / "store"), str(tmp_path / "ppo")

    def cfg(timesteps: int, **algo):
        return OmegaConf.merge(compose("train", ["algo=sb3", "+algo.hyperparameters.n_steps=64",
                                                 "+algo.hyperparameters.batch_size=64"]), {
            "store": store, "run_dir": run_dir, "show": False, "device": "cpu",
            "algo": {"env": "CartPole-v1", "timesteps": timesteps, **algo}})

    def edit_records(change) -> None:  # the run's settings records, as an older version would have written them
        for name in ("config.yaml", "trained_config.yaml"):
            path = os.path.join(run_dir, name)
            if os.path.exists(path):
                record = OmegaConf.load(path)
                change(record)
                OmegaConf.save(record, path)

    def older(record) -> None:
        del record["epochs"], record["model"]["deterministic"]
        record.batch_size, record.updates = 64, 3000

    assert train(cfg(64))["version"] == 1
    edit_records(older)
    grown = train(cfg(128))
    assert (grown["version"], grown["timesteps"]) == (2, 128)
    edit_records(older)
    again = train(cfg(128, deterministic=False))  # the same weights, now sampling
    assert again["version"] == 3 and PolicyRegistry(store).load(3)[1]["deterministic"] is False

    def other_sb3(record) -> None:  # an SB3 setting is still compared
        record.algo.hyperparameters.n_steps = 32

    edit_records(other_sb3)
    with pytest.raises(RunResumeError, match=r"other settings \(algo.hyperparameters.n_steps: 32 -> 64\)"):
        train(cfg(192))


def test_an_agent_of_another_env_is_refused_by_a_recorded_store(tmp_path):
    """Eval and the fleet run a store's agents in the store's env: a Pendulum agent published
    into a CartPole store crash-looped every eval client."""
    store = str(tmp_path / "store")
    cartpole = gym.make("CartPole-v1")
    Store.create(store, StoreSchema.from_spaces(cartpole.observation_space, cartpole.action_space, env="CartPole-v1"))
    cfg = OmegaConf.merge(compose("train", ["algo=sb3"]), {
        "store": store, "run_dir": str(tmp_path / "run"), "show": False, "device": "cpu",
        "algo": {"env": "Pendulum-v1", "timesteps": 64}})
    with pytest.raises(StoreError, match=r"different schema.*attrs\['env'\]: 'CartPole-v1' != 'Pendulum-v1'"):
        train(cfg)
    assert PolicyRegistry(store).versions() == []


class _ShiftedDiscrete(gym.Env):
    """A Discrete observation from -2 and a Discrete action from 1 (gymnasium's ``start``)."""

    observation_space = gym.spaces.Discrete(5, start=-2)
    action_space = gym.spaces.Discrete(3, start=1)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return -2, {}

    def step(self, action):
        assert self.action_space.contains(action)
        return -2, 0.0, False, True, {}


gym.register("robo_post_test/ShiftedDiscrete-v0", entry_point=_ShiftedDiscrete)


def test_discrete_spaces_that_do_not_start_at_zero_are_refused_for_sb3():
    """SB3 one-hot encodes 0..n-1 and acts with indices: DQN crashed on the observation, PPO
    sent action 0 to a space starting at 1."""
    for agent in ("PPO", "DQN"):
        with pytest.raises(UnsupportedSpaceError, match=r"start at 0; observation 'observation' Discrete\(5, "
                           r"start=-2\), action Discrete\(3, start=1\) start elsewhere"):
            SB3Agent(SB3AgentConfig(agent=agent, env="robo_post_test/ShiftedDiscrete-v0"))


class _SmallCamera(gym.Env):
    """A 24 x 24 RGB camera: an image to SB3, too small for its default CNN."""

    observation_space = gym.spaces.Box(0, 255, (24, 24, 3), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros((24, 24, 3), np.uint8), {}

    def step(self, action):
        return np.zeros((24, 24, 3), np.uint8), 0.0, False, True, {}


gym.register("robo_post_test/SmallCamera-v0", entry_point=_SmallCamera)


def test_an_image_too_small_for_sb3s_cnn_is_refused_naming_it():
    """It failed in the first forward pass with torch's 'Kernel size can't be greater than actual input size'."""
    with pytest.raises(UnsupportedSpaceError, match=r"at least 36 x 36 pixels; observation 'observation' "
                       r"\(24, 24, 3\) is smaller"):
        SB3Agent(SB3AgentConfig(env="robo_post_test/SmallCamera-v0"))


def test_the_agent_trains_in_the_env_the_store_was_recorded_in_with_its_kwargs(tmp_path):
    """Eval and the fleet rebuild a store's env with the kwargs its episodes recorded; the agent
    trained at the env's defaults (Pendulum's g=10 for data recorded at g=5)."""
    from robo_post.learner.sb3_driver import _open_or_create_store

    pendulum = gym.make("Pendulum-v1")
    schema = StoreSchema.from_spaces(pendulum.observation_space, pendulum.action_space, env="Pendulum-v1")
    store = Store.create(str(tmp_path / "store"), schema)
    with store.writer("c") as w:
        w.write_episode({"observation": np.zeros((3, 3), np.float32)}, np.zeros((2, 1), np.float32),
                        attrs={"env_kwargs": {"g": 5.0}})
    config = SB3AgentConfig()
    _open_or_create_store(store.root, config)
    assert (config.env, config.env_kwargs) == ("Pendulum-v1", {"g": 5.0})
    given = SB3AgentConfig(env="Pendulum-v1", env_kwargs={"g": 9.0})  # the user's own kwargs win
    _open_or_create_store(store.root, given)
    assert given.env_kwargs == {"g": 9.0}


@pytest.mark.slow
@pytest.mark.parametrize("algo, args, rollout", [
    ("sb3", ["algo.env=CartPole-v1", "algo.timesteps=100", "algo.n_envs=2", "+algo.hyperparameters.n_steps=64"], "2 x n_steps=64 = 128"),
    ("drest", ["algo.timesteps=256", "algo.E=2"], "32 x n_steps=64 = 2048")])
def test_a_budget_below_one_on_policy_rollout_is_refused_before_training(tmp_path, algo, args, rollout):
    """SB3 trains whole rollouts: DReST's 32 envs ran 2048 steps when 256 were asked."""
    r = run_cli("train", f"algo={algo}", *args, f"store={tmp_path / 'store'}", f"run_dir={tmp_path / 'run'}",
                "show=false", ok=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # no deprecation banner of the old gym ahead of it
    assert f"is less than one on-policy rollout (algo.n_envs={rollout} steps)" in r.stderr
    assert "or +algo.hyperparameters.n_steps=N" in r.stderr  # a key to add: without the + hydra refuses it
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    assert not os.path.exists(tmp_path / "store")  # the store created for it is removed again


@pytest.mark.slow
@pytest.mark.parametrize("algo, args, said", [
    ("sb3", ["algo.env=CartPole-v1", "algo.agent=SAC"], "SB3SettingsError: stable-baselines3 SAC refuses env "
                                                        "'CartPole-v1' with algo.hyperparameters={}: The algorithm "
                                                        "only supports"),
    ("sb3", ["algo.env=CartPole-v1", "+algo.hyperparameters.foo=1"], "unexpected keyword argument 'foo'"),
    ("drest", ["algo.E=2", "+algo.hyperparameters.foo=1"], "unexpected keyword argument 'foo'"),
    ("drest", ["algo.E=2", "+algo.hyperparameters.n_steps=0"], "SB3SettingsError: stable-baselines3 PPO refuses"),
])
def test_settings_sb3_refuses_are_one_line_errors(tmp_path, algo, args, said):
    """SB3's asserts and keyword errors came out as tracebacks from deep inside it."""
    r = run_cli("train", f"algo={algo}", *args, "algo.timesteps=4096", f"store={tmp_path / 'store'}",
                f"run_dir={tmp_path / 'run'}", "show=false", ok=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr and said in r.stderr, r.stderr[-2000:]
    assert not os.path.exists(tmp_path / "run")
