"""A proposal policy: observation features -> a diagonal Gaussian over an action chunk, whose samples are candidates.

The generative policy kind CRAFT fine-tunes on a continuous-action env
(``robo_post.algos.craft``). At every decision state it samples K action chunks of
H actions (the candidate futures), scores them by their own log-likelihood, picks
one from the softmax over those scores and executes its *first* action (receding
horizon). The log-likelihood of a stored candidate is its *logit*: the softmax over a
state's K logits is the candidate log-likelihood renormalised over the group, the
spec's ``pi(k|s)`` of a generative policy, so every piece of CRAFT's math that works
on "logits over K candidates" works on these unchanged.

The network works in actions mapped to [-1, 1] by the bounds (saved with the
weights); candidates are stored and executed in env units. A logit is the density of
the normalised chunk, which differs from the env-unit density by the same constant for
every candidate: the group's softmax is the same either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from robo_post.models.candidate_policy import CandidatePolicyRunner
from robo_post.models.encoders import BoundedActions, ObservationEncoder, PublishedModel, mlp, obs_batch
from robo_post.models.features import Feature, FeatureConfigJSON

ARTIFACT_KIND = "proposal"


class ProposalConfigError(ValueError):
    """A proposal policy setting outside its allowed values, or candidates of the wrong shape."""


@dataclass
class ProposalPolicyConfig(FeatureConfigJSON):
    """Architecture of a proposal policy; saved as JSON beside its weights.

    Attributes:
        features: observation key -> ``Feature`` the model reads.
        action_dim: A, the size of one action.
        horizon: H, actions per chunk (a candidate is an (H, A) chunk).
        n_candidates: K, proposals sampled per decision.
        action_low / action_high: env action bounds (the network's [-1, 1]; empty: [-1, 1]).
        min_std: floor of the std in normalised units. Behaviour cloning of a deterministic
            expert drives the std towards 0; the floor keeps the K proposals distinct.
        log_std_max: ceiling of the log std in normalised units.
        use_text: encode ``obs["instruction"]`` with the frozen MiniLM encoder.
        embed_dim / hidden_dim: widths of the modality embeddings and the MLP.
    """

    features: dict[str, Feature]
    action_dim: int
    horizon: int
    n_candidates: int = 8
    action_low: list[float] = field(default_factory=list)
    action_high: list[float] = field(default_factory=list)
    min_std: float = 0.1
    log_std_max: float = 0.0
    use_text: bool = False
    embed_dim: int = 64
    hidden_dim: int = 256

    def __post_init__(self):
        self.action_low = [float(v) for v in self.action_low]  # JSON-clean floats
        self.action_high = [float(v) for v in self.action_high]
        if self.action_dim < 1 or self.horizon < 1:
            raise ProposalConfigError(f"action_dim and horizon must be >= 1, got {self.action_dim} and {self.horizon}")
        if self.n_candidates < 2:
            raise ProposalConfigError(f"n_candidates must be >= 2 (a group to choose from), got {self.n_candidates}")
        if not self.min_std > 0:
            raise ProposalConfigError(f"min_std must be > 0, got {self.min_std}")
        if math.log(self.min_std) > self.log_std_max:
            raise ProposalConfigError(f"log(min_std)={math.log(self.min_std):.3f} exceeds log_std_max={self.log_std_max}")
        for name in ("action_low", "action_high"):
            if getattr(self, name) and len(getattr(self, name)) != self.action_dim:
                raise ProposalConfigError(f"{name} has {len(getattr(self, name))} entries; action_dim is {self.action_dim}")


class ProposalPolicy(PublishedModel, BoundedActions, nn.Module):
    """Observation encoder + MLP head to a state-dependent mean and log std of every action of a chunk."""

    artifact_kind, config_class = ARTIFACT_KIND, ProposalPolicyConfig

    def __init__(self, config: ProposalPolicyConfig):
        super().__init__()
        self.config = c = config
        self.encoder = ObservationEncoder(c.features, c.use_text, c.embed_dim, c.hidden_dim)
        self.head = mlp([c.hidden_dim, c.hidden_dim, 2 * c.horizon * c.action_dim])
        self.register_action_bounds(c.action_low, c.action_high, c.action_dim)

    def set_state_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        """Standardise the state vector with data statistics (saved with the weights)."""
        self.encoder.set_state_stats(mean, std)

    def distribution(self, obs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log std (B, H, A) of the chunk in normalised units; the log std clamped to
        ``[log(min_std), log_std_max]``."""
        c = self.config
        mean, log_std = self.head(self.encoder(obs)).view(-1, 2, c.horizon, c.action_dim).unbind(1)
        return mean, log_std.clamp(math.log(c.min_std), c.log_std_max)

    def _check(self, candidates: torch.Tensor, batch: int) -> None:
        c = self.config
        if candidates.ndim != 4 or candidates.shape[0] != batch or tuple(candidates.shape[2:]) != (c.horizon, c.action_dim):
            raise ProposalConfigError(f"candidates must be (B={batch}, K, H={c.horizon}, A={c.action_dim}) chunks, "
                                      f"got {tuple(candidates.shape)}")

    def log_likelihood(self, mean: torch.Tensor, log_std: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Gaussian log-density (B, K) of env-unit chunks (B, K, H, A) under ``distribution``'s
        ``mean`` and ``log_std`` (B, H, A), summed over H x A in normalised units."""
        self._check(candidates, mean.shape[0])
        x = self.normalize_actions(candidates.to(self.device).float())
        z = (x - mean[:, None]) * torch.exp(-log_std[:, None])
        return -(0.5 * z.pow(2) + log_std[:, None] + 0.5 * math.log(2 * math.pi)).sum((-2, -1))

    def logits(self, obs: dict[str, Any], candidates: torch.Tensor) -> torch.Tensor:
        """Candidate logits (B, K): the log-likelihood of each stored chunk ``candidates`` (B, K, H, A), env units.

        Raises:
            ProposalConfigError: ``candidates`` is not (B, K, H, A).
        """
        mean, log_std = self.distribution(obs)
        return self.log_likelihood(mean, log_std, candidates)

    def sample(self, obs: dict[str, Any], n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` proposals per observation (B, n, H, A) in env units, clipped to the action bounds."""
        return self.draw(*self.distribution(obs), n, generator)

    def draw(self, mean: torch.Tensor, log_std: torch.Tensor, n: int, generator: torch.Generator | None = None
             ) -> torch.Tensor:
        """``n`` samples (B, n, H, A) of ``distribution``'s ``mean`` and ``log_std`` (B, H, A), in env
        units, clipped to the action bounds."""
        noise = torch.randn((mean.shape[0], n, *mean.shape[1:]), generator=generator, device=mean.device)
        return self.unnormalize_actions((mean[:, None] + torch.exp(log_std)[:, None] * noise).clamp(-1.0, 1.0))

    def nll(self, obs: dict[str, Any], chunks: torch.Tensor) -> torch.Tensor:
        """Mean negative log-likelihood per action entry of env-unit chunks (B, H, A): the behaviour-cloning loss."""
        c = self.config
        return -self.logits(obs, chunks[:, None]).mean() / (c.horizon * c.action_dim)


class ProposalPolicyRunner(CandidatePolicyRunner):
    """Fleet ``Policy`` over a proposal policy; executes the chosen proposal's first action.

    At each ``act`` the runner samples K proposals (seeded per episode in ``reset``) and
    computes their logits. Sampling (``deterministic=False``): ``k* ~ softmax(logits)``
    and the chunk ``candidates[k*]`` starts. Deterministic (evaluation, deployment): the
    mean chunk is candidate 0 in place of a sample and is chosen, so the mean's first action
    runs and the recorded choice still indexes the executed chunk. ``extras()`` gives the
    last decision's ``candidates`` (K, H, A) float32, ``logits`` (K,) float32 and
    ``chosen`` () int64, merged with the env hook's entries: with ``env_extras`` on, if
    ``env.unwrapped`` has ``candidate_extras(candidates: np.ndarray) -> dict``, it is called
    with the candidates (the contract of ``CandidatePolicyRunner``; the fleet asks for
    extras before stepping, and only when its store records them).

    Args:
        model: the policy.
        deterministic: execute the mean (``True``) or a sampled proposal.
        device: where the model runs.
        env_extras: call the env's ``candidate_extras`` hook when it has one.
        explore_eps / explore_margin: exploration toward the proxy's best proposal (see
            ``CandidatePolicyRunner``).
    """

    RESERVED = ("candidates", "logits", "chosen")

    @torch.no_grad()
    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        c = self.model.config
        batch = obs_batch(obs, c.features, c.use_text, env)
        mean, log_std = self.model.distribution(batch)
        candidates = self.model.draw(mean, log_std, c.n_candidates, self.generator)
        if self.deterministic:
            candidates[:, 0] = self.model.unnormalize_actions(mean.clamp(-1.0, 1.0))
        logits = self.model.log_likelihood(mean, log_std, candidates)[0]
        chunks = candidates[0].float().cpu().numpy()
        if self.deterministic:
            k, self.given = 0, None
        else:
            k, logits = self._sample(logits, env, chunks)
        self.last = {"candidates": chunks, "logits": logits.float().cpu().numpy(), "chosen": np.asarray(k, np.int64)}
        self.env = env
        return chunks[k, 0].copy()

    def scored_candidates(self) -> np.ndarray:
        """What the env hook scores: the K proposals sampled at the last decision (K, H, A)."""
        return self.last["candidates"]
