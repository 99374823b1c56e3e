"""The steered policy: a frozen actor composed with a goal-conditioned prior.

Published as policy kind ``steered`` (weights: the actor's and a learned prior's,
prefixed ``actor/`` and ``prior/``; config: the rule, alpha, how alpha was chosen and
what the actor and prior are), so fleet clients and ``robo-post eval`` load it like
any other version. Each step, the runner exposes the actor's, the prior's and the
steered mean and std as store extras, so a steered deployment can be audited and
trained on later.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np
import torch

from robo_post.models.gaussian import Gaussian
from robo_post.steering.poe import check_rule, compose
from robo_post.steering.sources import (OwnActor, SB3Actor, ScriptedPrior, Source, SteeringSourceError,
                                        load_sb3_zip, prior_settings, sha256_file)
from robo_post.store.schema import ArraySpec
from robo_post.utils.io import absolute_root

ARTIFACT_KIND = "steered"
EXTRAS = ("actor_mean", "actor_std", "prior_mean", "prior_std", "steered_mean", "steered_std")


@dataclass
class SteeringConfig:
    """How the actor and the prior are combined (``robo_post.steering.poe``).

    Attributes:
        rule: ``frozen`` | ``poe`` | ``klreg`` | ``additive`` | ``prior``.
        alpha: weight of the prior (``klreg``: beta = alpha / (1 - alpha)).
        klreg_form: ``tilt`` (covariance factor 1 + beta) | ``geometric`` (the PoE covariance).
        additive_form: ``mix`` | ``residual`` (a prior that outputs an action delta).
        deterministic: act with the steered mean; else sample from the steered Gaussian.
    """

    rule: str = "poe"
    alpha: float = 0.5
    klreg_form: str = "tilt"
    additive_form: str = "mix"
    deterministic: bool = True

    def __post_init__(self):
        check_rule(self.rule, self.alpha, self.klreg_form, self.additive_form)


class SteeredPolicy:
    """Batch steering: observations (B, ...) -> actions (B, A), keeping the last distributions."""

    def __init__(self, actor: Source, prior: Source, config: SteeringConfig, low: np.ndarray, high: np.ndarray):
        self.actor, self.prior, self.config = actor, prior, config
        self.low, self.high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self.generator = torch.Generator()
        self.last: dict[str, Gaussian] = {}

    def reset(self, seed: int) -> None:
        self.actor.reset(seed)
        self.prior.reset(seed)
        self.generator.manual_seed(seed)

    def act(self, obs: Mapping[str, Any]) -> np.ndarray:
        c = self.config
        actor = self.actor.distribution(obs)
        prior = self.prior.distribution(obs) if c.rule != "frozen" else actor
        steered = compose(actor, prior, c.alpha, c.rule, c.klreg_form, c.additive_form)
        self.last = {"actor": actor, "prior": prior, "steered": steered}
        action = steered.mean if c.deterministic else (
            steered.mean + steered.std * torch.randn(steered.mean.shape, generator=self.generator))
        return np.clip(action.cpu().numpy(), self.low, self.high)

    def extras(self, row: int = 0) -> dict[str, np.ndarray]:
        """Means and stds of the last step (row ``row`` of the batch), the store extras ``EXTRAS``."""
        return {f"{name}_{part}": getattr(g, part)[row].detach().cpu().numpy().astype(np.float32)
                for name, g in self.last.items() for part in ("mean", "std")}


def extra_specs(action_dim: int) -> dict[str, ArraySpec]:
    """Store extras a steered deployment records per step (see ``EXTRAS``)."""
    return {name: ArraySpec("float32", (action_dim,)) for name in EXTRAS}


# --- actors and priors from configs and artifacts ---------------------------------------------
def _prefixed(weights: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def resolve_source(cfg: Mapping[str, Any], what: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The artifact part of an actor/prior config: ``{kind: registry, store, version}`` loads the
    published version (weights and config, embedded in the steered artifact); ``{kind: sb3, path,
    algo}`` records the zip's absolute path and sha256; ``{kind: scripted, ...}`` is kept as is.

    Raises:
        SteeringSourceError: a kind that is not one of those, or a registry version of a kind
            that is not a diagonal Gaussian.
    """
    from robo_post.store.registry import PolicyRegistry
    from robo_post.store.schema import StoreNotFoundError

    kind = cfg.get("kind")
    if kind == "registry":
        if not cfg.get("store"):
            raise SteeringSourceError(f"{what}: kind=registry needs a store (its policy registry)")
        if not os.path.isdir(os.path.join(cfg["store"], "policies")):  # a mistyped path: named, nothing created
            raise StoreNotFoundError(f"{what}: no policy registry at {cfg['store']} (no policies/ directory)")
        registry = PolicyRegistry(cfg["store"])
        version = cfg.get("version")
        version = registry.latest() if version in (None, "latest") else int(version)
        weights, config = registry.load(version)
        if config.get("kind") not in ("gaussian", "sb3_agent"):
            raise SteeringSourceError(f"{what}: registry version {version} is a {config.get('kind')!r} policy; "
                                      "steering composes diagonal Gaussians (algo=gaussian_bc or an SB3 agent)")
        return weights, {**config, "source": {"store": absolute_root(cfg["store"]), "version": version}}
    if kind == "sb3":
        missing = [k for k in ("path", "algo") if not cfg.get(k)]
        if missing:
            raise SteeringSourceError(f"{what}: kind=sb3 needs {sorted(missing)} (e.g. path=agent.zip algo=SAC)")
        path = os.path.abspath(cfg["path"])
        if not os.path.isfile(path):
            raise SteeringSourceError(f"{what}: SB3 zip not found: {path}")
        return {}, {"kind": "sb3", "path": path, "algo": cfg["algo"], "sha256": sha256_file(path)}
    if kind == "scripted":
        if what == "actor":
            raise SteeringSourceError("actor: a scripted controller is not a frozen Gaussian actor")
        return {}, {"kind": "scripted", "name": cfg.get("name"), "seed": int(cfg.get("seed") or 0), **prior_settings(cfg)}
    raise SteeringSourceError(f"{what}: unknown kind {kind!r}; one of registry, sb3"
                              + (", scripted" if what == "prior" else ""))


def build_source(weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], env: Any, device: str = "cpu"
                 ) -> Source:
    """A source from its artifact part (``resolve_source``); ``env`` supplies a scripted prior's
    controller (from the env's registry entry) and the action bounds."""
    kind = config["kind"]
    if kind == "gaussian":
        from robo_post.models.gaussian import GaussianPolicy

        return OwnActor(GaussianPolicy.from_artifact(dict(weights), dict(config), device=device))
    if kind == "sb3_agent":
        from robo_post.algos.sb3_agent import SB3Agent

        return SB3Actor(SB3Agent.from_artifact(dict(weights), dict(config), device=device).model)
    if kind == "sb3":
        return SB3Actor(load_sb3_zip(config["path"], config["algo"], config["sha256"], device=device))
    if kind == "scripted":
        from robo_post.envs.registry import make_prior, spec_for_env

        space = env.action_space
        return ScriptedPrior(make_prior(spec_for_env(env), config.get("name"), env), space.low, space.high,
                             std=config["std"], noise=config["noise"], random=config["random"], seed=config["seed"])
    raise SteeringSourceError(f"unknown source kind {kind!r}")


def steered_artifact(actor: tuple[dict, dict], prior: tuple[dict, dict], config: SteeringConfig, env: str,
                     **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights, config)`` of a steered policy for ``PolicyRegistry.publish``."""
    weights = {f"actor/{k}": v for k, v in actor[0].items()} | {f"prior/{k}": v for k, v in prior[0].items()}
    return weights, {"kind": ARTIFACT_KIND, "actor": actor[1], "prior": prior[1], "steering": asdict(config),
                     "env": env, **provenance}


class SteeredPolicyRunner:
    """Fleet ``Policy`` over a published steered policy; ``extras()`` gives the last step's store extras.

    The actor and a learned prior are built at load; a scripted prior at the first
    ``reset``, from the env the client runs (its controller and action bounds).
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], device: str = "cpu"):
        self.config = dict(config)
        self.device = device
        self.actor = build_source(_prefixed(weights, "actor/"), config["actor"], None, device)
        self.prior_weights = _prefixed(weights, "prior/")
        self.steering = SteeringConfig(**config["steering"])
        self.policy: SteeredPolicy | None = None

    def reset(self, env: Any, seed: int) -> None:
        if self.policy is None:
            prior = build_source(self.prior_weights, self.config["prior"], env, self.device)
            space = env.action_space
            self.policy = SteeredPolicy(self.actor, prior, self.steering, space.low, space.high)
        self.policy.reset(seed)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        batch: dict[str, Any] = {k: np.asarray(v)[None] for k, v in obs.items()}
        batch["instruction"] = [str(getattr(env.unwrapped, "instruction", ""))]
        return self.policy.act(batch)[0]

    def extras(self) -> dict[str, np.ndarray]:
        return self.policy.extras()
