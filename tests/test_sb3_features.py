"""Named SB3 feature extractors: ``spatial_conv`` keeps where things are, resolves from JSON
config, and a DReST agent trained with it publishes a plain policy that acts the same."""

import os

import gymnasium as gym
import numpy as np
import pytest
import torch

from robo_post.algos.drest import PRIVILEGED_KEY, DReSTAgent, DReSTConfig
from robo_post.algos.sb3_agent import SB3Agent
from robo_post.models.sb3_features import SpatialConv, resolve_policy_kwargs

ENV = "robo_post/ShutdownGrid-v0"


def test_spatial_conv_planes_and_shift_equivariance():
    torch.manual_seed(0)
    space = gym.spaces.Dict({"grid": gym.spaces.Box(0, 1, (2, 3, 5, 5)), "extra": gym.spaces.Box(0, 1, (4,))})
    conv = SpatialConv(space, channels=(6, 7))
    assert conv.features_dim == 7 * 25 + 4
    assert conv.branches["grid"][0].in_channels == 6  # (2, 3) leading axes -> 6 planes
    x = torch.zeros(2, 2, 3, 5, 5)
    x[0, 1, 2, 1, 1] = 1.0  # one mark on plane (1, 2) ...
    x[1, 1, 2, 2, 2] = 1.0  # ... and the same mark one cell down and right
    extra = torch.arange(8.0).reshape(2, 4)
    out = conv({"grid": x, "extra": extra})
    # Keys in the space's (sorted) order: "extra" first, then the grid's maps.
    assert torch.equal(out[:, :4], extra)
    maps = out[:, 4:].reshape(2, 7, 5, 5)
    # Two 3x3 layers with zero padding: interior cells (whose windows never read padding)
    # move with the mark; a reshape that mixed planes and cells would break this.
    torch.testing.assert_close(maps[1, :, 2:4, 2:4], maps[0, :, 1:3, 1:3])
    assert not torch.allclose(maps[1, :, 1:3, 1:3], maps[0, :, 1:3, 1:3])


def test_names_resolve_and_bad_settings_are_typed_errors():
    hyper = {"n_steps": 8, "policy_kwargs": {"features_extractor_class": "spatial_conv", "net_arch": [8]}}
    resolved = resolve_policy_kwargs(hyper)
    assert resolved["policy_kwargs"]["features_extractor_class"] is SpatialConv
    assert hyper["policy_kwargs"]["features_extractor_class"] == "spatial_conv"  # the config stays JSON
    with pytest.raises(ValueError, match="unknown features_extractor_class 'cnn'.*spatial_conv"):
        resolve_policy_kwargs({"policy_kwargs": {"features_extractor_class": "cnn"}})
    with pytest.raises(ValueError, match="kernel must be odd"):
        SpatialConv(gym.spaces.Box(0, 1, (1, 5, 5)), kernel=2)
    with pytest.raises(ValueError, match="3 or more axes"):
        SpatialConv(gym.spaces.Dict({"x": gym.spaces.Box(0, 1, (4,))}))


@pytest.mark.slow
@pytest.mark.parametrize("privileged", [True, False])
def test_drest_agent_with_spatial_conv_publishes_a_plain_policy_that_acts_the_same(privileged):
    config = DReSTConfig(schedule="constant",
                         agent="PPO", env=ENV, env_kwargs={"split": "train", "n_grids": 2}, n_envs=2, E=4, seed=0,
                         privileged_critic=privileged,
                         hyperparameters={"n_steps": 32, "batch_size": 32,
                                          "policy_kwargs": {"net_arch": [16], "features_extractor_class": "spatial_conv",
                                                            "features_extractor_kwargs": {"channels": [4, 4]}}})
    agent = DReSTAgent(config)
    before = {k: v.clone() for k, v in agent.model.policy.state_dict().items()}
    agent.model.learn(64)
    conv = "pi_features_extractor.inner.branches.observation.0.weight" if privileged else \
        "pi_features_extractor.branches.observation.0.weight"
    assert not torch.equal(before[conv], agent.model.policy.state_dict()[conv])  # the convolutions train
    obs = {k: torch.as_tensor(v) for k, v in agent.venv.reset().items()}
    weights, artifact = agent.artifact()
    assert artifact["hyperparameters"]["policy_kwargs"]["features_extractor_class"] == "spatial_conv"
    deployed = SB3Agent.from_artifact(weights, artifact)
    with torch.no_grad():
        probs = agent.model.policy.get_distribution(obs).distribution.probs
        plain = deployed.model.policy.get_distribution({"observation": obs["observation"]}).distribution.probs
    torch.testing.assert_close(plain, probs)
    assert (PRIVILEGED_KEY in obs) == privileged
    assert np.isfinite(agent.evaluate()["train/usefulness"])


@pytest.mark.slow
def test_cli_trains_checkpoints_and_publishes_an_agent_with_a_shared_conv_extractor(tmp_path):
    from safetensors.torch import load_file

    from robo_post.learner.checkpoint import load_checkpoint
    from robo_post.store import PolicyRegistry

    from helpers import run_cli

    store, run_dir = str(tmp_path / "store"), str(tmp_path / "run")
    common = ["algo=sb3", f"algo.env={ENV}", "+algo.hyperparameters.n_steps=64", "+algo.hyperparameters.batch_size=64",
              "+algo.hyperparameters.policy_kwargs.features_extractor_class=spatial_conv",
              "+algo.hyperparameters.policy_kwargs.features_extractor_kwargs.channels=[4]", "show=false"]
    run_cli("train", *common, "algo.timesteps=128", "checkpoint_every=64", f"store={store}", f"run_dir={run_dir}")
    weights, artifact = PolicyRegistry(store).load(1)
    assert artifact["hyperparameters"]["policy_kwargs"]["features_extractor_class"] == "spatial_conv"
    # The checkpoint holds the extractor SB3 registers under three names as three copies (safetensors
    # stores no aliases); restored into a fresh agent, it is one module again, equal to the published one.
    saved = load_file(os.path.join(run_dir, "checkpoint", "tensors.safetensors"))
    conv = "branches.observation.0.weight"
    assert all(f"module.policy.{p}features_extractor.{conv}" in saved for p in ("", "pi_", "vf_"))
    fresh = SB3Agent.from_artifact({k: torch.zeros_like(v) for k, v in weights.items()}, artifact)
    load_checkpoint(os.path.join(run_dir, "checkpoint"), fresh.modules, {}, {})
    policy = fresh.model.policy
    assert policy.pi_features_extractor is policy.vf_features_extractor
    torch.testing.assert_close(policy.features_extractor.branches.observation[0].weight,
                               weights[f"features_extractor.{conv}"])
    # A space without a grid is refused with the reason, before any training.
    r = run_cli("train", "algo=sb3", "algo.env=CartPole-v1", "algo.timesteps=64",
                "+algo.hyperparameters.policy_kwargs.features_extractor_class=spatial_conv", "show=false",
                f"store={tmp_path / 'cartpole'}", f"run_dir={tmp_path / 'cartpole_run'}", ok=False)
    assert r.returncode != 0 and "spatial_conv needs an observation key with 3 or more axes" in r.stderr
