"""Actors and priors as diagonal Gaussians over env-unit actions, on batches of observations.

A *source* maps a batch of flat-dict observations (each key (B, ...)) to a
``Gaussian`` (B, A). Steering composes two of them: a frozen actor and a
goal-conditioned prior.

Actors:

- ``GaussianPolicy`` (``algo=gaussian_bc``): exact.
- Stable-Baselines3 PPO/A2C with Box actions: their Gaussian as it is (SB3 clips samples
  to the bounds).
- Stable-Baselines3 SAC: a tanh-squashed Gaussian. Steering treats it as a Gaussian in
  action space centred on its deterministic action tanh(mu) (so alpha = 0 acts exactly as
  the frozen actor), with the root-mean-square deviation of its squashed samples from that
  action as std (Gauss-Hermite quadrature, 16 nodes per dimension).

Priors:

- scripted: a goal-conditioned controller from the env's registry entry (its mean) with a
  chosen std; quality presets reproduce the degraded and random priors of the evaluation;
- learned: a ``GaussianPolicy`` trained on store data, whose std is fitted.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import torch
from gymnasium import spaces

from robo_post.models.gaussian import Gaussian


class SteeringSourceError(ValueError):
    """An actor or prior that cannot be used as a diagonal Gaussian, or a bad source setting."""


class Source(Protocol):
    """A diagonal-Gaussian action distribution at a batch of observations."""

    def reset(self, seed: int) -> None: ...

    def distribution(self, obs: Mapping[str, Any]) -> Gaussian: ...


def _shapes_text(shapes: Mapping[str, tuple]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(shapes.items())) + "}"


def _observation_mismatch(want: Mapping[str, tuple], got: Mapping[str, tuple], obs: Mapping[str, Any]) -> str | None:
    """Where the observation shapes a source reads (``want``) differ from those it would get (``got``)."""
    if dict(got) == dict(want):
        return None
    observed = {k: np.shape(v) for k, v in obs.items() if k != "instruction"}
    return f"reads observations {_shapes_text(want)}; the env observes {_shapes_text(observed)}"


def _action_mismatch(low: np.ndarray, high: np.ndarray, space: spaces.Box) -> str | None:
    """Where a source's action bounds differ from the env's: its means would be in other units,
    or clipped to another range. Unbounded env dimensions accept any range (a range measured
    from the data)."""
    low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
    env_low, env_high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
    if low.shape != env_low.shape:
        return f"acts in shape {low.shape}; the env's actions are {env_low.shape}"
    finite = np.isfinite(env_low) & np.isfinite(env_high)
    if not (np.allclose(low[finite], env_low[finite], rtol=1e-6, atol=0.0)
            and np.allclose(high[finite], env_high[finite], rtol=1e-6, atol=0.0)):
        return (f"acts in [{low.tolist()}, {high.tolist()}]; "
                f"the env's actions are in [{env_low.tolist()}, {env_high.tolist()}]")
    return None


class OwnActor:
    """A ``GaussianPolicy`` (ours) as a source."""

    def __init__(self, model: Any):
        self.model = model.eval()

    def reset(self, seed: int) -> None:
        pass

    def mismatch(self, obs: Mapping[str, Any], action_space: spaces.Box) -> str | None:
        """Why this actor cannot act on ``obs`` (one env observation) in ``action_space``, else None."""
        want = {k: tuple(f.shape) for k, f in self.model.config.features.items()}
        got = {k: np.shape(obs[k]) for k in want if k in obs}
        bounds = (self.model.action_low.cpu().numpy(), self.model.action_high.cpu().numpy())  # defaults filled in
        return _observation_mismatch(want, got, obs) or _action_mismatch(*bounds, action_space)

    @torch.no_grad()
    def distribution(self, obs: Mapping[str, Any]) -> Gaussian:
        return self.model.distribution(obs)  # its encoder reads its own keys and converts the arrays


# Probabilists' Gauss-Hermite rule: E[f(x)], x ~ N(0, 1) = sum_i w_i f(x_i) / sqrt(2 pi).
_GH_NODES, _GH_WEIGHTS = (torch.as_tensor(v, dtype=torch.float32) for v in np.polynomial.hermite_e.hermegauss(16))
_GH_WEIGHTS = _GH_WEIGHTS / math.sqrt(2 * math.pi)


def squashed_gaussian(mean_u: torch.Tensor, log_std_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh(u), u ~ N(mean_u, std_u^2) per dimension -> (tanh(mean_u), RMS deviation of tanh(u) from it)."""
    centre = torch.tanh(mean_u)
    u = mean_u[..., None] + log_std_u.exp()[..., None] * _GH_NODES.to(mean_u.device)
    second = ((torch.tanh(u) - centre[..., None]) ** 2 * _GH_WEIGHTS.to(mean_u.device)).sum(-1)
    return centre, second.clamp(min=1e-12).sqrt()


class SB3Actor:
    """A Stable-Baselines3 model's action distribution as a source (see the module docstring)."""

    def __init__(self, model: Any):
        self.model = model
        policy = model.policy
        if not isinstance(model.action_space, spaces.Box):
            raise SteeringSourceError(f"steering needs continuous (Box) actions; this SB3 model acts in {model.action_space}")
        self.squashed = hasattr(policy, "actor") and hasattr(policy.actor, "get_action_dist_params")
        if not self.squashed and not hasattr(policy, "get_distribution"):
            raise SteeringSourceError(f"{type(model).__name__} has no Gaussian action distribution to steer "
                                      "(deterministic actors such as TD3/DDPG cannot be composed); use SAC, PPO or A2C")
        if getattr(policy, "use_sde", False):
            raise SteeringSourceError("SB3 models trained with gSDE are not diagonal Gaussians per state; retrain with use_sde=False")
        self._dict_obs = isinstance(model.observation_space, spaces.Dict)
        low, high = model.action_space.low, model.action_space.high
        self.low = torch.as_tensor(low, dtype=torch.float32)
        self.half = torch.as_tensor(0.5 * (high - low), dtype=torch.float32)

    def reset(self, seed: int) -> None:
        pass

    def mismatch(self, obs: Mapping[str, Any], action_space: spaces.Box) -> str | None:
        """Why this agent cannot act on ``obs`` (one env observation) in ``action_space``, else None."""
        space = self.model.observation_space
        if self._dict_obs:
            want = {k: tuple(s.shape) for k, s in space.spaces.items()}
            got = {k: np.shape(obs[k]) for k in want if k in obs}
        else:
            keys = [k for k in obs if k != "instruction"]  # one array, whatever the env calls it
            want = {"observation": tuple(space.shape)}
            got = {"observation": np.shape(obs[keys[0]])} if len(keys) == 1 else {}
        return (_observation_mismatch(want, got, obs)
                or _action_mismatch(self.model.action_space.low, self.model.action_space.high, action_space))

    def _model_obs(self, obs: Mapping[str, Any]) -> Any:
        if self._dict_obs:
            return {k: np.asarray(obs[k]) for k in self.model.observation_space.spaces}
        keys = [k for k in obs if k != "instruction"]
        if len(keys) != 1:
            raise SteeringSourceError(f"the SB3 model expects one array; the observation has keys {sorted(keys)}")
        return np.asarray(obs[keys[0]])

    @torch.no_grad()
    def distribution(self, obs: Mapping[str, Any]) -> Gaussian:
        policy = self.model.policy
        obs_t, _ = policy.obs_to_tensor(self._model_obs(obs))
        if self.squashed:  # SAC: [-1, 1] actions rescaled to the bounds
            mean_u, log_std_u, _ = policy.actor.get_action_dist_params(obs_t)
            centre, std = squashed_gaussian(mean_u, log_std_u)
            return Gaussian(self.low + (centre + 1.0) * self.half, torch.log(std * self.half))
        dist = policy.get_distribution(obs_t).distribution  # PPO / A2C: torch Normal in action units
        return Gaussian(dist.mean.float().cpu(), dist.stddev.float().log().cpu())


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_sb3_zip(path: str, algo: str, sha256: str | None = None, device: str = "cpu") -> Any:
    """An SB3 model from its saved zip with SB3's own loader.

    Only load zips from a trusted source: SB3 zips may hold pickled objects, which run
    code when loaded. ``sha256``, when given, must match the file (a steered policy
    records it so that a replaced zip is refused rather than silently used).

    Raises:
        SteeringSourceError: unknown algorithm, missing file, checksum mismatch, or a file
            that is not a zip SB3 saved.
    """
    import os
    import zipfile

    from robo_post.algos.sb3_agent import agent_class

    try:
        cls = agent_class(algo)
    except ValueError as e:
        raise SteeringSourceError(str(e)) from None
    if not os.path.isfile(path):
        raise SteeringSourceError(f"SB3 zip not found: {path}")
    if sha256 is not None and (found := sha256_file(path)) != sha256:
        raise SteeringSourceError(f"SB3 zip {path} changed since the steered policy was built "
                                  f"(sha256 {found[:12]}..., recorded {sha256[:12]}...)")
    if not zipfile.is_zipfile(path):
        raise SteeringSourceError(f"{path} is not an SB3 zip (not a zip archive)")
    try:
        return cls.load(path, device=device)
    except (AssertionError, KeyError, ValueError, zipfile.BadZipFile) as e:  # a zip, but not one SB3 saved (SB3 asserts)
        raise SteeringSourceError(f"{path} is not an SB3 {algo} zip: {type(e).__name__}: {e}") from None


# --- priors ------------------------------------------------------------------------------
# Prior qualities of the evaluation grid: (std, noise std added to the mean, uniform-random mean).
QUALITIES: dict[str, dict[str, Any]] = {
    "good": {"std": 0.2, "noise": 0.0, "random": False},
    "degraded": {"std": 1.0, "noise": 0.5, "random": False},
    "random_honest": {"std": 3.0, "noise": 0.0, "random": True},
    "random_overconfident": {"std": 0.2, "noise": 0.0, "random": True},
}


@dataclass
class ScriptedPrior:
    """A goal-conditioned controller's mean with a fixed std (env action units).

    Attributes:
        controller: batch of observations -> mean actions (B, A) (the env's registry prior).
        low / high: action bounds (random means are uniform between them).
        std: the prior's std, every dimension.
        noise: std of Gaussian noise added to the controller's mean (a degraded prior).
        random: ignore the controller: uniform-random means (a random prior).
        seed: seed of the noise and random means; ``reset`` reseeds per episode.
    """

    controller: Callable[[Mapping[str, np.ndarray]], np.ndarray]
    low: np.ndarray
    high: np.ndarray
    std: float = 0.2
    noise: float = 0.0
    random: bool = False
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self):
        if not self.std > 0:
            raise SteeringSourceError(f"prior std must be > 0, got {self.std}")
        if self.noise < 0:
            raise SteeringSourceError(f"prior noise must be >= 0, got {self.noise}")
        self.rng = np.random.default_rng(self.seed)

    def reset(self, seed: int) -> None:
        self.rng = np.random.default_rng([self.seed, seed])

    def distribution(self, obs: Mapping[str, Any]) -> Gaussian:
        n = len(next(v for k, v in obs.items() if k != "instruction"))
        if self.random:
            mean = self.rng.uniform(self.low, self.high, size=(n, len(self.low)))
        else:
            mean = np.asarray(self.controller(obs), dtype=np.float64)
            if self.noise:
                mean = mean + self.rng.normal(0.0, self.noise, size=mean.shape)
        mean_t = torch.as_tensor(mean, dtype=torch.float32)
        return Gaussian(mean_t, torch.full_like(mean_t, math.log(self.std)))


def prior_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``{std, noise, random}`` of a scripted prior config: its ``quality`` preset, then explicit values.

    Raises:
        SteeringSourceError: unknown quality.
    """
    quality = cfg.get("quality") or "good"
    if quality not in QUALITIES:
        raise SteeringSourceError(f"unknown prior quality {quality!r}; one of {sorted(QUALITIES)}")
    return QUALITIES[quality] | {k: cfg[k] for k in ("std", "noise", "random") if cfg.get(k) is not None}
