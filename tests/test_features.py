"""The observation contract and the method registry on data that is not the tabletop's:
any flat Dict of Box/Discrete observations, any reward scale, old artifacts."""

import json
import re

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from robo_post.algos.registry import (METHODS, ActionSpaceError, MethodSpec, UnknownMethodError, method_spec,
                                      register_method)
from robo_post.config import compose
from robo_post.learner.critic_report import warn_value_edges
from robo_post.learner.data import value_range
from robo_post.learner.train import train
from robo_post.models.features import Feature, FeatureSpecError, infer_features
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig
from robo_post.models.encoders import TextEncoder
from robo_post.models.ranked import RankedFlowPolicy
from robo_post.models.critic import CriticConfig, CriticNet
from robo_post.store import ArraySpec, PolicyRegistry, Store, StoreSchema

GAMMA, REWARD, T = 0.9, 5.0, 12

OBS = {"observation": ArraySpec("float32", (3,)), "mode": ArraySpec("int64", (), 0, 2),
       "camera": ArraySpec("uint8", (32, 40, 3)), "flags": ArraySpec("bool", (2,))}


def test_roles_are_inferred_from_the_schema_and_can_be_overridden():
    features = infer_features(OBS)
    assert {k: f.role for k, f in features.items()} == {"observation": "state", "mode": "discrete",
                                                         "camera": "image", "flags": "state"}
    assert (features["mode"].low, features["mode"].n) == (0, 3)
    assert "camera" not in infer_features(OBS, use_images=False)
    forced = infer_features(OBS, {"mode": "state", "flags": None})
    assert forced["mode"].role == "state" and "flags" not in forced
    with pytest.raises(FeatureSpecError, match="'nope'"):
        infer_features(OBS, {"nope": "state"})
    with pytest.raises(FeatureSpecError, match="cannot take role 'image'"):
        infer_features(OBS, {"observation": "image"})


def test_an_image_too_small_for_the_encoder_is_read_as_state_and_cannot_be_forced():
    tiny = {"cam": ArraySpec("uint8", (16, 16, 3))}  # the encoder's convolutions need 18 x 18
    assert infer_features(tiny)["cam"] == Feature("state", (16, 16, 3))
    with pytest.raises(FeatureSpecError, match=r"'cam' \(shape \(16, 16, 3\)\) is too small .* at least 18 x 18"):
        infer_features(tiny, {"cam": "image"})
    assert infer_features({"cam": ArraySpec("uint8", (18, 18, 3))})["cam"].role == "image"


def test_an_encoder_reads_every_role_and_each_key_matters():
    features = infer_features(OBS)
    policy = FlowPolicy(FlowPolicyConfig(features=features, action_dim=2, horizon=3, use_text=False, embed_dim=8,
                                         hidden_dim=16, flow_steps=2))
    g = torch.Generator().manual_seed(0)
    obs = {"observation": torch.randn(4, 3, generator=g), "mode": torch.tensor([0, 1, 2, 1]),
           "camera": torch.randint(0, 256, (4, 32, 40, 3), generator=g, dtype=torch.uint8),
           "flags": torch.tensor([[True, False]] * 4)}
    z = policy.encode(obs)
    for key, change in (("observation", lambda x: x + 1), ("mode", lambda x: (x + 1) % 3),
                        ("camera", lambda x: 255 - x), ("flags", lambda x: ~x)):
        assert not torch.allclose(policy.encode({**obs, key: change(obs[key])}), z), key
    noise = torch.randn(4, 3, 2, generator=g)
    loaded = FlowPolicy.from_artifact(*policy.artifact())
    torch.testing.assert_close(loaded.sample(obs, noise=noise), policy.sample(obs, noise=noise))


def _store(root, reward_scale=REWARD, episodes=8):
    """Dense-reward episodes with a Box observation and a discrete mode key (no tabletop keys)."""
    schema = StoreSchema(OBS | {}, ArraySpec("float32", (2,), -1.0, 1.0))
    store = Store.create(str(root), StoreSchema({k: OBS[k] for k in ("observation", "mode")}, schema.action))
    rng = np.random.default_rng(0)
    with store.writer("data") as w:
        for i in range(episodes):
            obs = rng.normal(size=(T + 1, 3)).astype(np.float32)
            w.write_episode({"observation": obs, "mode": np.full(T + 1, i % 3)},
                            rng.uniform(-1, 1, (T, 2)).astype(np.float32), rewards=np.full(T, reward_scale),
                            terminated=np.arange(T) == T - 1, success=None, role="imported")
    return str(root)


def _cfg(store, run_dir, method, updates=4, **extra):
    cfg = OmegaConf.merge(compose("train", [f"algo={method}"]), {
        "store": store, "run_dir": run_dir, "updates": updates, "batch_size": 8, "log_every": 2, "gamma": GAMMA,
        "checkpoint_every": 4, "show": False, "device": "cpu", "data": {"success": None},
        "model": {"hidden_dim": 16, "embed_dim": 8, "flow_steps": 2},
    })
    OmegaConf.set_struct(cfg, False)
    return OmegaConf.merge(cfg, extra)


def test_methods_train_on_any_keys_with_value_support_from_the_data(tmp_path):
    store = _store(tmp_path / "s")
    bc = train(_cfg(store, str(tmp_path / "bc"), "bc_flow"))
    weights, config = PolicyRegistry(store).load(bc["version"])
    assert set(config["model"]["features"]) == {"observation", "mode"}
    assert config["model"]["use_text"] is False  # no instructions in the data
    # No env in the schema: the reactive default (one action per step).
    assert (config["model"]["horizon"], config["model"]["execute_steps"], config["model"]["predicts"]) == (1, 1, "chunk")
    top = REWARD * (1 - GAMMA ** T) / (1 - GAMMA)  # return-to-go of an episode's first step
    assert bc["value_range"] == pytest.approx([-0.1 * top, 1.1 * top], rel=1e-5)

    divl = train(_cfg(store, str(tmp_path / "divl"), "divl_qam", algo={"critic_warmup": 0}))
    assert divl["value_range"] == pytest.approx(bc["value_range"])
    rows = [json.loads(x) for x in (tmp_path / "divl" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["td_target_mean"] > 5.0  # rewards of 5 per step: far past the old [-0.1, 1.1] support
    assert 0.0 < rows[-1]["v_next_mean"] < bc["value_range"][1]  # bootstrap values from the measured support
    # A user's support wins over the data's.
    pinned = train(_cfg(store, str(tmp_path / "pinned"), "divl_qam", algo={"value": {"v_min": -1.0, "v_max": 2.0}}))
    assert PolicyRegistry(store).load(pinned["version"])[1]["config"]["algo"]["value"] == {"v_min": -1.0, "v_max": 2.0}


def test_a_scalar_observation_is_one_state_column(tmp_path):
    """A Box of shape () (a user's env observing one number) failed in the encoder's flatten."""
    schema = StoreSchema({"x": ArraySpec("float32", ()), "v": ArraySpec("float32", (2,))}, ArraySpec("float32", (1,), -1.0, 1.0))
    store = Store.create(str(tmp_path / "s"), schema)
    rng = np.random.default_rng(0)
    with store.writer("data") as w:
        for _ in range(3):
            w.write_episode({"x": rng.normal(size=T + 1).astype(np.float32), "v": np.zeros((T + 1, 2), np.float32)},
                            rng.uniform(-1, 1, (T, 1)).astype(np.float32), success=None)
    summary = train(_cfg(store.root, str(tmp_path / "bc"), "bc_flow"))
    assert np.isfinite(summary["final"]["bc_loss"])
    policy = FlowPolicy.from_artifact(*PolicyRegistry(store.root).load(summary["version"]))
    assert policy.config.features["x"].shape == () and policy.encoder.state_mean.shape == (3,)
    obs = {"x": torch.tensor([0.0, 1.0]), "v": torch.zeros(2, 2)}
    z = policy.encode(obs)
    assert not torch.allclose(z[0], z[1])  # the scalar is read


def test_value_range_brackets_returns_and_zero():
    assert value_range(np.array([0.2, 0.8])) == pytest.approx((-0.08, 0.88))
    assert value_range(np.array([-3.0, -1.0])) == pytest.approx((-3.3, 0.3))


def test_a_value_piled_at_the_support_edges_is_reported(capsys):
    warn_value_edges([{"edge_mass": 0.1}], (0.0, 1.0))
    assert capsys.readouterr().err == ""
    warn_value_edges([{"edge_mass": 0.6}], (0.0, 1.0))
    assert "60% of the value distribution" in capsys.readouterr().err


def test_flow_policy_refuses_discrete_actions(tmp_path, capsys):
    schema = StoreSchema({"observation": ArraySpec("float32", (2,))}, ArraySpec("int64", (), 0, 1))
    store = Store.create(str(tmp_path / "d"), schema)
    with store.writer("x") as w:
        w.write_episode({"observation": np.zeros((4, 2), np.float32)}, np.array([0, 1, 1]), success=True)
    with pytest.raises(ActionSpaceError, match=r"actions are integers \(Discrete\): use algo=categorical_bc"):
        train(_cfg(str(tmp_path / "d"), str(tmp_path / "r"), "bc_flow"))
    # MultiDiscrete actions (one integer per dimension) are refused by the same message, not a broadcast error
    schema = StoreSchema({"observation": ArraySpec("float32", (2,))}, ArraySpec("int64", (2,), [0, 0], [2, 1]))
    store = Store.create(str(tmp_path / "md"), schema)
    with store.writer("x") as w:
        w.write_episode({"observation": np.zeros((4, 2), np.float32)}, np.array([[0, 1], [2, 0], [1, 1]]), success=True)
    for method in ("bc_flow", "gaussian_bc"):
        with pytest.raises(ActionSpaceError, match=f"algo={method} .* this store's actions are integers"):
            train(_cfg(str(tmp_path / "md"), str(tmp_path / method), method))
    # settings of a flow policy's chunks, accepted and ignored without a word by a policy that has none
    train(OmegaConf.merge(_cfg(str(tmp_path / "md"), str(tmp_path / "cat2"), "categorical_bc"),
                          {"model": {"horizon": 8, "flow_steps": 2}}))
    err = capsys.readouterr().err
    assert ("warning: algo=categorical_bc does not read model.horizon=8 (its policy has none); it is ignored" in err
            and "model.flow_steps=2" in err and "execute_steps" not in err)
    # the critic methods said to train a reference with algo=bc_flow, which is refused the same way
    train(_cfg(str(tmp_path / "md"), str(tmp_path / "cat"), "categorical_bc"))  # a published categorical version
    for method in ("divl_qam", "iql_qam", "fql"):
        with pytest.raises(ActionSpaceError, match=rf"algo={method} trains a flow policy over continuous \(Box\) "
                                                   r"actions; this store's actions are integers"):
            train(_cfg(str(tmp_path / "md"), str(tmp_path / method), method))


@pytest.mark.parametrize("shape", [(), (2, 3)])
def test_a_box_action_that_is_no_vector_is_refused_naming_its_shape(tmp_path, shape):
    """A scalar or a matrix Box action failed deep in training (list() of a 0-d array, a tensor size mismatch)."""
    schema = StoreSchema({"observation": ArraySpec("float32", (2,))}, ArraySpec("float32", shape, -1.0, 1.0))
    store = Store.create(str(tmp_path / "s"), schema)
    with store.writer("x") as w:
        w.write_episode({"observation": np.zeros((4, 2), np.float32)}, np.zeros((3, *shape), np.float32), success=None)
    for method in ("bc_flow", "gaussian_bc"):
        with pytest.raises(ValueError, match=re.escape(f"actions are a Box of shape {shape}; flow and Gaussian")):
            train(_cfg(store.root, str(tmp_path / method), method))


def test_the_registry_names_its_methods_and_takes_new_ones():
    with pytest.raises(UnknownMethodError, match="registered methods: .*bc_flow"):
        method_spec("nope")
    spec = method_spec("divl_qam")
    with pytest.raises(ValueError, match=r"unknown settings \['lr'\]"):
        spec.make_config({"lr": 1.0})
    # values are checked against the config's annotations (a plugin's keys have no YAML default to check)
    craft = method_spec("craft")
    for values, expected in (({"eps_clip": "0.2"}, "float"), ({"iterations": 2.5}, "int"), ({"oracle": 1}, "bool"),
                             ({"event_weights": [1, "x"]}, "list[float]"), ({"floor_margin": "big"}, "float | None"),
                             ({"env_kwargs": [1]}, "dict")):
        with pytest.raises(ValueError, match=re.escape(f"algo=craft: algo.{next(iter(values))}={next(iter(values.values()))!r} "
                                                       f"is not allowed; expected {expected}")):
            craft.make_config(values)
    assert craft.make_config({"dual_c": 3, "event_weights": [-1, 0.5, 0, 0, 0], "floor_margin": None,
                              "proxy_weight": "floor"}).dual_c == 3  # an int for a float
    mine = register_method(MethodSpec("my_bc", METHODS["bc_flow"].config, METHODS["bc_flow"].build))
    try:
        assert method_spec("my_bc") is mine
    finally:
        del METHODS["my_bc"]


def test_artifacts_published_before_feature_specs_still_load():
    """Policies in existing registries name ``proprio_dim``/``image_size`` and the old module names."""
    features = {"proprio": Feature("state", (5,)), "image": Feature("image", (32, 32, 3))}
    policy = FlowPolicy(FlowPolicyConfig(features=features, action_dim=2, horizon=2, use_text=False, embed_dim=8,
                                         hidden_dim=16, flow_steps=2))
    policy.set_state_stats(np.arange(5.0), np.full(5, 2.0))
    critic = CriticNet(CriticConfig.like(policy.config), 0)
    weights, config = RankedFlowPolicy(policy, critic, 3).artifact()

    def old(key: str) -> str:
        for new, was in (("encoder.state.", "encoder.proprio."), ("encoder.state_mean", "encoder.proprio_mean"),
                         ("encoder.state_std", "encoder.proprio_std"), ("encoder.images.image.", "encoder.image.")):
            key = key.replace(new, was)
        return key

    def old_config(model: dict) -> dict:
        model = {k: v for k, v in model.items() if k != "features"}
        return {**model, "proprio_dim": 5, "image_size": 32}

    old_weights = {old(k): v for k, v in weights.items()}
    old_artifact = {**config, "model": old_config(config["model"]), "critic": old_config(config["critic"])}
    loaded = RankedFlowPolicy.from_artifact(old_weights, old_artifact)
    obs = {"proprio": torch.randn(2, 5), "image": torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)}
    noise = torch.randn(2, 3, 2, 2)
    torch.testing.assert_close(loaded.sample(obs, noise=noise), RankedFlowPolicy(policy, critic, 3).sample(obs, noise=noise))
    assert torch.equal(loaded.policy.encoder.state_mean, torch.arange(5.0))


@pytest.mark.slow
def test_the_env_registry_sets_default_roles_and_the_user_overrides_them(tmp_path):
    """Tabletop data carries the task index; its instructions name the task, so models leave
    the index out unless asked (``model.features``)."""
    schema = StoreSchema({"proprio": ArraySpec("float32", (3,)), "task_id": ArraySpec("int64", (), 0, 4)},
                         ArraySpec("float32", (2,), -1.0, 1.0), attrs={"env": "tabletop"})
    store = Store.create(str(tmp_path / "s"), schema)
    rng = np.random.default_rng(0)
    with store.writer("demo-0") as w:
        for i in range(3):
            w.write_episode({"proprio": rng.normal(size=(6, 3)).astype(np.float32), "task_id": np.full(6, i)},
                            rng.uniform(-1, 1, (5, 2)).astype(np.float32), success=True, role="demo",
                            instruction=f"task {i}")
    default = train(_cfg(store.root, str(tmp_path / "a"), "bc_flow", updates=2))
    config = PolicyRegistry(store.root).load(default["version"])[1]["model"]
    assert set(config["features"]) == {"proprio"}
    assert (config["horizon"], config["execute_steps"]) == (8, 4)  # the tabletop entry's chunking
    forced = train(_cfg(store.root, str(tmp_path / "b"), "bc_flow", updates=2, model={"features": {"task_id": "discrete"}}))
    assert PolicyRegistry(store.root).load(forced["version"])[1]["model"]["features"]["task_id"]["n"] == 5


@pytest.mark.slow
def test_an_instruction_embeds_the_same_whatever_strings_come_with_it():
    """A batch of strings is padded to its longest: encoded together, the embeddings moved in
    their last bits with the company they kept, so a resumed run (an empty cache, other
    groups) drifted from the uninterrupted one and a deployed policy saw other inputs."""
    texts = ["reach the red target", "push the small blue block all the way to the left zone", "go"]
    together = TextEncoder(4).embed(texts)
    for i, text in enumerate(texts):
        assert torch.equal(TextEncoder(4).embed([text])[0], together[i]), text
