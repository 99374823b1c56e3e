"""Stable-Baselines3 agents as robo-post methods (``algo=sb3``).

SB3 trains the agent online in an env made through the environment registry
(any of ours or any gymnasium id; observations are the flat Dicts the fleet
records, so the agent uses SB3's ``MultiInputPolicy``). What is published is not
SB3's zip (it may hold pickled objects): the policy's ``state_dict`` goes to
safetensors and its construction (agent class, env, hyperparameters) to JSON;
``SB3Agent.from_artifact`` rebuilds the agent from the env's spaces and loads the
weights, so fleet clients and ``robo-post eval`` run it like any other version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

ARTIFACT_KIND = "sb3_agent"


@dataclass
class SB3AgentConfig:
    """An SB3 agent and its training budget.

    Attributes:
        agent: SB3 algorithm class name (``PPO``, ``A2C``, ``SAC``, ``TD3``, ``DQN``, ...).
        env: env name or gymnasium id to train in; ``None`` = the env the store was recorded in.
        task: the env's task (``None``: its first; envs without tasks take none).
        env_kwargs: constructor keywords of the env.
        timesteps: environment steps to train for.
        n_envs: parallel envs in SB3's vectorised env.
        policy: SB3 policy name.
        hyperparameters: keywords of the SB3 algorithm (``learning_rate``, ``n_steps``, ``policy_kwargs``, ...);
            ``policy_kwargs.features_extractor_class`` may name one of ours (``spatial_conv``).
        deterministic: act with the distribution's mode when deployed.
        seed: seed of the agent and its envs (``None``: the job's ``seed``).
    """

    agent: str = "PPO"
    env: str | None = None
    task: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    timesteps: int = 50_000
    n_envs: int = 1
    policy: str = "MultiInputPolicy"
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    deterministic: bool = True
    seed: int | None = None


class SB3SettingsError(ValueError):
    """Stable-Baselines3 refused to build the agent: a hyperparameter it does not take or accept,
    or an env whose spaces the algorithm does not support."""


def build_model(cls: type, config: SB3AgentConfig, policy: Any, venv: Any, seed: int, device: str | torch.device,
                hyperparameters: dict[str, Any]) -> Any:
    """``cls(policy, venv, ...)``, SB3's refusal (an assert on the spaces, an unknown keyword, a bad
    value) as ``SB3SettingsError`` naming the agent, env and hyperparameters; ``venv`` is closed then."""
    try:
        return cls(policy, venv, seed=seed, device=str(device), verbose=0, **hyperparameters)
    except (AssertionError, TypeError, ValueError) as e:
        venv.close()
        raise SB3SettingsError(f"stable-baselines3 {config.agent} refuses env {config.env!r} with "
                               f"algo.hyperparameters={dict(config.hyperparameters)}: {e}") from None


def agent_class(name: str) -> type:
    """The Stable-Baselines3 algorithm class ``name`` (``PPO``, ``SAC``, ...); ``ValueError`` if there is none."""
    import stable_baselines3

    cls = getattr(stable_baselines3, name, None)
    if not (isinstance(cls, type) and hasattr(cls, "load")):
        raise ValueError(f"unknown stable-baselines3 agent {name!r}; e.g. PPO, A2C, SAC, TD3, DQN")
    return cls


def resolve_policy_kwargs(hyperparameters: dict[str, Any]) -> dict[str, Any]:
    """SB3 keywords with a feature extractor named in ``policy_kwargs`` replaced by its class
    (``robo_post.models.sb3_features``; imported here so that this module needs no SB3 to load)."""
    from robo_post.models.sb3_features import resolve_policy_kwargs as resolve

    return resolve(hyperparameters)


def make_env(config: SB3AgentConfig, seed: int | None = None):
    """One env of the agent's training or deployment (through the environment registry)."""
    from robo_post.envs.registry import env_spec

    env = env_spec(config.env).make(config.task, **config.env_kwargs)
    if seed is not None:
        env.reset(seed=seed)
    return env


# SB3's default image CNN (NatureCNN: 8x8 stride 4, 4x4 stride 2, 3x3) needs this many pixels a side.
SB3_MIN_IMAGE_SIDE = 36


def _check_spaces(env: str, observation_space: Any, action_space: Any, hyperparameters: dict[str, Any]) -> None:
    """Refuse, naming them, spaces SB3 would crash on or misuse: discrete spaces not starting
    at 0 (SB3 one-hot encodes observations and acts with indices 0..n-1), and images smaller
    than its default CNN takes (unless the policy names its own features extractor).

    Raises:
        UnsupportedSpaceError: naming each such observation key or the action.
    """
    from gymnasium import spaces
    from stable_baselines3.common.preprocessing import is_image_space, is_image_space_channels_first

    from robo_post.envs.registry import UnsupportedSpaceError

    named = {f"observation {k!r}": s for k, s in observation_space.spaces.items()} | {"action": action_space}
    shifted = [f"{name} {s}" for name, s in named.items()
               if isinstance(s, (spaces.Discrete, spaces.MultiDiscrete)) and np.any(s.start != 0)]
    if shifted:
        raise UnsupportedSpaceError(f"env {env!r}: stable-baselines3 needs discrete spaces that start at 0; "
                                    f"{', '.join(shifted)} start elsewhere")
    if (hyperparameters.get("policy_kwargs") or {}).get("features_extractor_class") is None:
        small = [f"observation {k!r} {s.shape}" for k, s in observation_space.spaces.items()
                 if is_image_space(s, check_channels=True)
                 and min(s.shape[1:] if is_image_space_channels_first(s) else s.shape[:2]) < SB3_MIN_IMAGE_SIDE]
        if small:
            raise UnsupportedSpaceError(f"env {env!r}: stable-baselines3's image CNN needs images of at least "
                                        f"{SB3_MIN_IMAGE_SIDE} x {SB3_MIN_IMAGE_SIDE} pixels; {', '.join(small)} "
                                        "is smaller (give policy_kwargs.features_extractor_class)")


def check_budget(timesteps: int, model: Any) -> None:
    """Refuse a budget below one rollout of an on-policy agent: SB3 collects and trains on
    whole rollouts of ``n_envs x n_steps``, so it would run that many steps whatever was asked.

    Raises:
        ValueError: naming ``timesteps``, ``n_envs``, ``n_steps`` and the steps SB3 would take.
    """
    from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm

    if isinstance(model, OnPolicyAlgorithm) and timesteps < model.n_envs * model.n_steps:
        raise ValueError(f"algo.timesteps={timesteps} is less than one on-policy rollout (algo.n_envs={model.n_envs} "
                         f"x n_steps={model.n_steps} = {model.n_envs * model.n_steps} steps), which SB3 would train "
                         "anyway; raise algo.timesteps or lower algo.n_envs or +algo.hyperparameters.n_steps=N")


class SB3Agent:
    """An SB3 algorithm wrapped in the method protocol (``policy``, ``artifact``).

    Training is SB3's own ``learn`` (the ``sb3`` driver calls it); ``modules`` and
    ``optimizers`` expose the policy and its optimiser for checkpoints.
    """

    def __init__(self, config: SB3AgentConfig, device: str | torch.device = "cpu", n_envs: int | None = None):
        from stable_baselines3.common.monitor import Monitor
        from stable_baselines3.common.vec_env import DummyVecEnv

        if config.env is None:
            raise ValueError("algo=sb3 needs an env to train in: set algo.env (an env name or gymnasium id)")
        self.config = config
        seed = config.seed or 0
        n = config.n_envs if n_envs is None else n_envs
        self.venv = DummyVecEnv([lambda: Monitor(make_env(config)) for _ in range(n)])  # Monitor: episode returns
        try:
            _check_spaces(config.env, self.venv.observation_space, self.venv.action_space, config.hyperparameters)
        except ValueError:
            self.venv.close()
            raise
        self.venv.seed(seed)
        self.model = build_model(agent_class(config.agent), config, config.policy, self.venv, seed, device,
                                 resolve_policy_kwargs(config.hyperparameters))

    @property
    def policy(self) -> torch.nn.Module:
        return self.model.policy

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.model.policy}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """On-policy agents keep one optimiser on the policy; off-policy ones (SAC, TD3) one per
        actor and critic, and SAC another for its entropy coefficient."""
        policy = self.model.policy
        found = {"policy": policy.optimizer} if hasattr(policy, "optimizer") else {}
        found |= {name: child.optimizer for name, child in policy.named_children() if hasattr(child, "optimizer")}
        if getattr(self.model, "ent_coef_optimizer", None) is not None:
            found["ent_coef"] = self.model.ent_coef_optimizer
        return found

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        weights = {k: v.detach().cpu().clone() for k, v in self.model.policy.state_dict().items()}
        c = self.config
        return weights, {"kind": ARTIFACT_KIND, "algorithm": "sb3", "agent": c.agent, "policy": c.policy, "env": c.env,
                         "task": c.task, "env_kwargs": c.env_kwargs, "deterministic": c.deterministic,
                         "hyperparameters": {k: v for k, v in c.hyperparameters.items() if k == "policy_kwargs"},
                         **provenance}

    @classmethod
    def from_artifact(cls, weights: dict[str, torch.Tensor], config: dict[str, Any], device: str = "cpu") -> "SB3Agent":
        agent_config = SB3AgentConfig(agent=config["agent"], env=config["env"], task=config["task"],
                                      env_kwargs=config["env_kwargs"], policy=config["policy"],
                                      hyperparameters=config["hyperparameters"], deterministic=config["deterministic"])
        agent = cls(agent_config, device=device, n_envs=1)
        agent.model.policy.load_state_dict(weights)
        agent.model.policy.set_training_mode(False)
        return agent

    def act(self, obs: dict[str, Any]) -> np.ndarray:
        """One action for one flat-Dict observation."""
        action, _ = self.model.predict({k: np.asarray(v) for k, v in obs.items()}, deterministic=self.config.deterministic)
        return action


class SB3AgentRunner:
    """Fleet ``Policy`` over a published SB3 agent (stochastic acting is seeded per episode)."""

    def __init__(self, agent: SB3Agent):
        self.agent = agent

    def reset(self, env: Any, seed: int) -> None:
        torch.manual_seed(seed)  # SB3 samples non-deterministic actions from torch's global RNG

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        return self.agent.act(obs)
