"""Behaviour cloning over integer actions (algo=categorical_bc): it learns a rule from store data,
publishes an artifact the fleet acts with, and refuses what it cannot clone."""

import numpy as np
import pytest
import torch

from robo_post.fleet.policies import build_policy
from robo_post.algos.categorical_bc import CategoricalBCConfig, CategoricalBCConfigError
from robo_post.algos.registry import ActionSpaceError
from robo_post.learner.train import train
from robo_post.models.categorical import CategoricalActionError, CategoricalPolicy, CategoricalPolicyConfig
from robo_post.models.features import state_features
from robo_post.store import ArraySpec, PolicyRegistry, Store, StoreSchema
from test_features import _cfg


class _Space:
    def __init__(self, shape):
        self.shape = shape


class _Env:
    """What a runner reads of an env: its action space's shape."""

    def __init__(self, shape):
        self.action_space = _Space(shape)


def _rule(obs: np.ndarray, multi: bool) -> np.ndarray:
    """Discrete(3, start=1): which third of [-1, 1] obs[0] lies in; MultiDiscrete adds the sign of obs[1]."""
    first = 1 + np.digitize(obs[:, 0], [-1 / 3, 1 / 3])
    return np.stack([first, (obs[:, 1] > 0).astype(np.int64)], -1) if multi else first


@pytest.mark.slow
@pytest.mark.fleet
@pytest.mark.parametrize("multi", [False, True], ids=["discrete", "multidiscrete"])
def test_categorical_bc_clones_an_integer_rule_and_the_fleet_acts_with_it(tmp_path, multi):
    action = ArraySpec("int64", (2,), [1, 0], [3, 1]) if multi else ArraySpec("int64", (), 1, 3)
    store = Store.create(str(tmp_path / "s"), StoreSchema({"observation": ArraySpec("float32", (2,))}, action))
    rng = np.random.default_rng(0)
    with store.writer("demo") as w:
        for _ in range(20):
            obs = rng.uniform(-1, 1, (31, 2)).astype(np.float32)
            w.write_episode({"observation": obs}, _rule(obs[:-1], multi), success=True)
    summary = train(_cfg(store.root, str(tmp_path / "bc"), "categorical_bc", updates=600, batch_size=64))
    weights, config = PolicyRegistry(store.root).load(summary["version"])
    assert config["kind"] == "categorical" and config["algorithm"] == "categorical_bc"
    assert config["model"]["action_low"] == ([1, 0] if multi else [1])
    runner = build_policy(weights, config)
    env = _Env((2,) if multi else ())
    test = np.random.default_rng(1).uniform(-1, 1, (300, 2)).astype(np.float32)
    acted = np.stack([runner.act({"observation": o}, env) for o in test])
    assert acted.dtype == np.int64 and acted.shape == ((300, 2) if multi else (300,))
    right = (acted == _rule(test, multi)).reshape(300, -1).all(axis=1)
    assert right.mean() > 0.9, right.mean()


def test_sampled_actions_cover_each_value_and_repeat_per_seed():
    torch.manual_seed(0)
    model = CategoricalPolicy(CategoricalPolicyConfig(state_features(2, "observation"), [-2], [2], hidden_dim=8)).eval()
    obs = {"observation": torch.zeros(2000, 2)}
    picks = [model.act(obs, torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    assert set(picks[0][:, 0].tolist()) == {-2, -1, 0, 1, 2}  # start -2: values -2 .. 2, every one reachable
    assert torch.equal(model.act(obs), model.act(obs))


def test_what_categorical_bc_cannot_clone_is_refused(tmp_path):
    store = Store.create(str(tmp_path / "box"), StoreSchema({"observation": ArraySpec("float32", (2,))},
                                                             ArraySpec("float32", (1,), -1.0, 1.0)))
    with store.writer("x") as w:
        w.write_episode({"observation": np.zeros((4, 2), np.float32)}, np.zeros((3, 1), np.float32), success=True)
    with pytest.raises(ActionSpaceError, match="actions are continuous \\(Box\\): use algo=bc_flow or algo=gaussian_bc"):
        train(_cfg(store.root, str(tmp_path / "r"), "categorical_bc"))
    assert PolicyRegistry(store.root).versions() == []
    with pytest.raises(CategoricalBCConfigError, match="label_smoothing must be in"):
        CategoricalBCConfig(label_smoothing=1.0)
    for low, high in (([], []), ([0], [1, 2]), ([2], [1]), ([0.5], [2])):
        with pytest.raises(CategoricalActionError, match="integer action bounds"):
            CategoricalPolicyConfig(state_features(2), low, high)
