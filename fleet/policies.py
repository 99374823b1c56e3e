"""Policies a fleet client can run, and how registry artifacts become policies.

A policy artifact in the registry is ``(weights, config)``; ``config["kind"]``
picks the builder. Scripted and random policies are artifacts too (with no
weights), so the fleet runs, records and hot-swaps before any learning exists.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np
import torch


class Policy(Protocol):
    """What a client needs from a policy. ``env`` is passed for scripted experts,
    which read privileged simulator state; learned policies use ``obs`` only."""

    def reset(self, env: Any, seed: int) -> None: ...

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray: ...


class RandomPolicy:
    """Uniform random actions from the env's action space (seeded per episode)."""

    def __init__(self, **_: Any):
        self.rng = np.random.default_rng(0)

    def reset(self, env: Any, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        space = env.action_space
        return self.rng.uniform(space.low, space.high).astype(space.dtype)


class ExpertPolicy:
    """The env's scripted expert for the episode's task.

    Args:
        noise: Gaussian action-noise std.
        mode: ``"expert"`` or ``"near_miss"`` (plausible failures).
    """

    def __init__(self, noise: float = 0.0, mode: str = "expert", **_: Any):
        self.noise, self.mode = noise, mode
        self._act: Callable[[dict[str, Any]], np.ndarray] | None = None

    def reset(self, env: Any, seed: int) -> None:
        unwrapped = env.unwrapped
        if hasattr(unwrapped, "task"):  # tabletop: one expert per task, fed obs + privileged state
            from robo_post.envs.experts import make_expert

            expert = make_expert(unwrapped.task, noise=self.noise, mode=self.mode, seed=seed)
            expert.reset(unwrapped)
            self._act = lambda obs: expert.act(obs, unwrapped)
        else:  # driving: the expert reads the simulator directly
            from robo_post.envs.driving import make_driving_expert

            expert = make_driving_expert(noise=self.noise, seed=seed)
            self._act = lambda obs: expert(unwrapped)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        return np.asarray(self._act(obs), dtype=np.float32)


def _flow_policy(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> Policy:
    from robo_post.models.flow import FlowPolicy, FlowPolicyRunner

    return FlowPolicyRunner(FlowPolicy.from_artifact(weights, config))


def _ranked_flow_policy(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> Policy:
    from robo_post.models.flow import FlowPolicyRunner
    from robo_post.models.ranked import RankedFlowPolicy

    return FlowPolicyRunner(RankedFlowPolicy.from_artifact(weights, config))


Builder = Callable[[dict[str, torch.Tensor], dict[str, Any]], Policy]
POLICY_KINDS: dict[str, Builder] = {
    "random": lambda weights, config: RandomPolicy(**config),
    "expert": lambda weights, config: ExpertPolicy(**{k: v for k, v in config.items() if k in ("noise", "mode")}),
    "flow": _flow_policy,
    "flow_ranked": _ranked_flow_policy,
}


def register_policy_kind(kind: str, builder: Builder) -> None:
    """Teach clients a new artifact kind (learned models register themselves here)."""
    POLICY_KINDS[kind] = builder


def build_policy(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> Policy:
    """Turn a registry artifact into a runnable policy."""
    kind = config.get("kind")
    if kind not in POLICY_KINDS:
        raise ValueError(f"unknown policy kind {kind!r}; known: {sorted(POLICY_KINDS)}")
    return POLICY_KINDS[kind](weights, config)
