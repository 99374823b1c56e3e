"""Policies a fleet client can run, and how registry artifacts become policies.

A policy artifact in the registry is ``(weights, config)``; ``config["kind"]``
picks the builder. Scripted and random policies are artifacts too (with no
weights), so the fleet runs, records and hot-swaps before any learning exists; so
are stable-baselines3 agents (``sb3``: a zip path in the config).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Protocol

import numpy as np
import torch
from gymnasium import spaces


class Policy(Protocol):
    """What a client needs from a policy. ``env`` is passed for scripted experts,
    which read privileged simulator state; learned policies use ``obs`` only."""

    def reset(self, env: Any, seed: int) -> None: ...

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray: ...


class MissingExtrasError(ValueError):
    """The store records per-step extras the running policy does not provide."""


def policy_extras(policy: Policy, names: Any) -> dict[str, np.ndarray]:
    """What the policy reports about its last decision (``policy.extras()``, e.g. a steered
    policy's actor and prior distributions), when the store records extras at all."""
    return policy.extras() if names and hasattr(policy, "extras") else {}


def recorded_extras(names: Any, *sources: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """The store's per-step extras ``names`` from the policy's and the env's reports; ``None``
    when the store declares none.

    Raises:
        MissingExtrasError: the store declares extras nobody reported.
    """
    if not names:
        return None
    given = {k: v for source in sources for k, v in source.items()}
    missing = sorted(set(names) - set(given))
    if missing:
        raise MissingExtrasError(f"the store records extras {missing} per step; neither the policy nor the env "
                                 "reports them (record into a store without those extras)")
    return {k: given[k] for k in names}


class RandomPolicy:
    """Random actions from the env's action space (any space), seeded per episode.

    Samples from a private copy of the space, so the env's own space RNG is untouched.
    """

    def __init__(self, **_: Any):
        self.space: Any = None

    def reset(self, env: Any, seed: int) -> None:
        self.space = copy.deepcopy(env.action_space)
        self.space.seed(seed)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        return np.asarray(self.space.sample())


class ExpertPolicy:
    """The env's scripted expert (from its registry entry) for the episode's task.

    Args:
        noise: Gaussian action-noise std.
        mode: ``"expert"`` or ``"near_miss"`` (plausible failures), where the env's expert has it.

    Raises (at ``reset``):
        NoExpertError: the env's registry entry has no expert.
    """

    def __init__(self, noise: float = 0.0, mode: str = "expert", **_: Any):
        self.noise, self.mode = noise, mode
        self._act: Callable[[dict[str, Any]], np.ndarray] | None = None

    def reset(self, env: Any, seed: int) -> None:
        from robo_post.envs.registry import spec_for_env

        self._act = spec_for_env(env).make_expert(env, noise=self.noise, mode=self.mode, seed=seed)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        action = np.asarray(self._act(obs))
        return action if action.dtype.kind in "iub" else action.astype(np.float32)  # Discrete actions stay integer


class SB3Policy:
    """A stable-baselines3 agent loaded with SB3's own ``load``.

    Config: ``{"kind": "sb3", "path": "agent.zip", "algo": "PPO", "deterministic": true}``;
    ``algo`` is the SB3 class name (``PPO``, ``SAC``, ``A2C``, ``DQN``, ...).

    Only load zips from a trusted source: SB3 zips may contain pickled Python objects,
    which run code when loaded. (Nothing robo-post writes is pickled.)

    Our flat dict observation is mapped back to what the model expects: a model with a
    Dict observation space gets the dict; any other model gets the dict's single entry
    (``{"observation": o}`` -> ``o``, as the env registry wraps bare observations).
    """

    def __init__(self, path: str, algo: str, deterministic: bool = True, device: str = "cpu", **_: Any):
        from robo_post.algos.sb3_agent import agent_class

        self.model = agent_class(algo).load(path, device=device)
        self.deterministic = deterministic
        self._dict_obs = isinstance(self.model.observation_space, spaces.Dict)

    def reset(self, env: Any, seed: int) -> None:
        if not self.deterministic:  # SB3 samples from torch's global RNG
            self.model.set_random_seed(seed)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        if self._dict_obs:
            model_obs: Any = obs
        elif len(obs) == 1:
            model_obs = next(iter(obs.values()))
        else:
            raise ValueError(f"SB3 model expects one array; the env observes several keys {sorted(obs)}")
        action, _ = self.model.predict(model_obs, deterministic=self.deterministic)
        return np.asarray(action)


def _flow_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    from robo_post.models.flow import FlowPolicy, FlowPolicyRunner

    return FlowPolicyRunner(FlowPolicy.from_artifact(weights, config), device=device)


def _ranked_flow_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    from robo_post.models.flow import FlowPolicyRunner
    from robo_post.models.ranked import RankedFlowPolicy

    return FlowPolicyRunner(RankedFlowPolicy.from_artifact(weights, config), device=device)


def _sb3_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    missing = {"path", "algo"} - config.keys()
    if missing:
        raise ValueError(f"sb3 policy config lacks {sorted(missing)}; e.g. {{kind: sb3, path: agent.zip, algo: PPO}}")
    return SB3Policy(**{k: v for k, v in config.items() if k in ("path", "algo", "deterministic")}, device=device)


def _sb3_agent(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    """An agent published by ``algo=sb3`` (safetensors + JSON, no pickle)."""
    from robo_post.algos.sb3_agent import SB3Agent, SB3AgentRunner

    return SB3AgentRunner(SB3Agent.from_artifact(weights, config, device=device))


def _gaussian_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    from robo_post.models.gaussian import GaussianPolicy, GaussianPolicyRunner

    return GaussianPolicyRunner(GaussianPolicy.from_artifact(weights, config), config.get("deterministic", True),
                                device=device)


def _categorical_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    """A categorical actor over integer actions (``algo=categorical_bc``)."""
    from robo_post.models.categorical import CategoricalPolicy, CategoricalPolicyRunner

    return CategoricalPolicyRunner(CategoricalPolicy.from_artifact(weights, config), config.get("deterministic", True),
                                   device=device)


def _steered_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    """A frozen actor steered by a goal-conditioned prior (``robo-post steer``)."""
    from robo_post.steering.policy import SteeredPolicyRunner

    return SteeredPolicyRunner(weights, config, device=device)


def _candidate_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    """A candidate-scoring policy (``algo=craft``); ``env_extras`` asks the env for counterfactual scores."""
    from robo_post.models.candidate_policy import CandidatePolicy, CandidatePolicyRunner

    return CandidatePolicyRunner(CandidatePolicy.from_artifact(weights, config), config.get("deterministic", True),
                                 device=device, env_extras=config.get("env_extras", True),
                                 explore_eps=config.get("explore_eps", 0.0),
                                 explore_margin=config.get("explore_margin"))


def _proposal_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str) -> Policy:
    """A proposal policy (``algo=craft`` on a continuous action); ``env_extras`` asks the env to score the proposals."""
    from robo_post.models.proposal_policy import ProposalPolicy, ProposalPolicyRunner

    return ProposalPolicyRunner(ProposalPolicy.from_artifact(weights, config), config.get("deterministic", True),
                                device=device, env_extras=config.get("env_extras", True),
                                explore_eps=config.get("explore_eps", 0.0), explore_margin=config.get("explore_margin"))


# (weights, config, device) -> policy
Builder = Callable[[dict[str, torch.Tensor], dict[str, Any], str], Policy]
POLICY_KINDS: dict[str, Builder] = {
    "random": lambda weights, config, device: RandomPolicy(**config),
    "expert": lambda weights, config, device: ExpertPolicy(
        **{k: v for k, v in config.items() if k in ("noise", "mode")}),
    "flow": _flow_policy,
    "flow_ranked": _ranked_flow_policy,
    "sb3": _sb3_policy,
    "sb3_agent": _sb3_agent,
    "gaussian": _gaussian_policy,
    "categorical": _categorical_policy,
    "steered": _steered_policy,
    "candidate": _candidate_policy,
    "proposal": _proposal_policy,
}


def register_policy_kind(kind: str, builder: Builder) -> None:
    """Teach clients a new artifact kind (learned models register themselves here);
    ``builder(weights, config, device)`` returns the policy."""
    POLICY_KINDS[kind] = builder


def build_policy(weights: dict[str, torch.Tensor], config: dict[str, Any], device: str = "cpu") -> Policy:
    """Turn a registry artifact into a runnable policy on ``device``."""
    kind = config.get("kind")
    if kind not in POLICY_KINDS:
        raise ValueError(f"unknown policy kind {kind!r}; known: {sorted(POLICY_KINDS)}")
    return POLICY_KINDS[kind](weights, config, device)
