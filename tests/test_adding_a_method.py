"""docs/adding_a_method.md: its example registers a working method (the page cannot drift from the code)."""

import os
import re

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from robo_post.algos.registry import METHODS
from robo_post.config import compose
from robo_post.learner.train import train
from robo_post.models.flow import FlowPolicy
from robo_post.store import ArraySpec, PolicyRegistry, Store, StoreSchema

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "adding_a_method.md")


@pytest.mark.slow
def test_the_documented_method_registers_trains_and_publishes_its_ema(tmp_path):
    code = re.findall(r"```python\n(.*?)```", open(DOC).read(), re.S)[0]
    exec(compile(code, DOC, "exec"), {})
    try:
        store = Store.create(str(tmp_path / "s"), StoreSchema({"observation": ArraySpec("float32", (2,))},
                                                              ArraySpec("float32", (1,), -1.0, 1.0)))
        rng = np.random.default_rng(0)
        with store.writer("data") as w:
            for _ in range(4):
                obs = rng.normal(size=(9, 2)).astype(np.float32)
                w.write_episode({"observation": obs}, np.tanh(obs[:8, :1]), success=True, role="demo")
        cfg = OmegaConf.merge(compose("train", ["algo=bc_flow", "algo.name=ema_bc", "+algo.ema_rate=0.5"]), {
            "store": store.root, "run_dir": str(tmp_path / "r"), "updates": 6, "batch_size": 8, "log_every": 3,
            "show": False, "device": "cpu", "model": {"hidden_dim": 16, "embed_dim": 8, "flow_steps": 2}})
        summary = train(cfg)
        weights, config = PolicyRegistry(store.root).load(summary["version"])
        published = FlowPolicy.from_artifact(weights, config)
        assert config["algorithm"] == "ema_bc" and np.isfinite(summary["final"]["bc_loss"])
        # The published weights are the EMA, not the trained weights: they differ after training.
        ckpt = load_file(os.path.join(tmp_path, "r", "checkpoint", "tensors.safetensors"))
        ema = {k[len("module.ema."):]: v for k, v in ckpt.items() if k.startswith("module.ema.")}
        raw = {k[len("module.trained."):]: v for k, v in ckpt.items() if k.startswith("module.trained.")}
        key = "velocity_net.0.weight"
        assert torch.equal(published.state_dict()[key], ema[key]) and not torch.equal(ema[key], raw[key])
        # a value of another type than the plugin's annotation: named before the run starts (it failed
        # deep in training, `_foreach_lerp_` on a string, after writing the run's config.yaml)
        bad = OmegaConf.merge(cfg, {"algo": {"ema_rate": "abc"}, "run_dir": str(tmp_path / "bad")})
        with pytest.raises(ValueError, match=r"algo=ema_bc: algo.ema_rate='abc' is not allowed; expected float"):
            train(bad)
        assert not (tmp_path / "bad").exists()
    finally:
        METHODS.pop("ema_bc", None)


ALGO_CONFIGS = os.path.join(os.path.dirname(DOC), "..", "configs", "algo")


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(ALGO_CONFIGS) if n.endswith(".yaml")))
def test_each_methods_yaml_states_its_config_defaults(name):
    """The CLI and the Python API train the same method: `configs/algo/drest.yaml` said 3M steps, 32
    envs, privileged critic, linear schedule while `DReSTConfig()` said 50k, 1, off, constant."""
    import dataclasses

    import robo_post.learner.train  # noqa: F401 (registers every method)
    from robo_post.algos.registry import method_spec

    yaml = OmegaConf.to_container(OmegaConf.load(os.path.join(ALGO_CONFIGS, name)))
    algo = yaml.get("algo", yaml)  # `@package _global_` files nest it under algo
    defaults = method_spec(algo.pop("name")).config()
    assert set(algo) <= {f.name for f in dataclasses.fields(defaults)}, name
    differ = {k: (v, getattr(defaults, k)) for k, v in algo.items()
              if v != (dataclasses.asdict(d) if dataclasses.is_dataclass(d := getattr(defaults, k)) else d)}
    assert not differ, differ
