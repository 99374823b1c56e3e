"""A vocabulary-scoring policy: observation features -> K logits over K candidate futures.

The policy kind CRAFT fine-tunes (``robo_post.algos.craft``). A fixed vocabulary of K
candidates, each a short sequence of discrete meta-actions, is scored at every
decision state; the chosen candidate's *first* meta-action is executed and the
policy decides again at the next state (receding horizon). The vocabulary is saved
with the weights, so a published policy knows what each logit means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from robo_post.models.encoders import ObservationEncoder, PublishedModel, mlp, obs_batch
from robo_post.models.features import Feature, FeatureConfigJSON

ARTIFACT_KIND = "candidate"


class CandidateConfigError(ValueError):
    """A candidate policy's vocabulary does not match its size, or a candidate is empty."""


@dataclass
class CandidatePolicyConfig(FeatureConfigJSON):
    """Architecture and vocabulary of a candidate-scoring policy; saved as JSON beside its weights.

    Attributes:
        features: observation key -> ``Feature`` the model reads.
        n_candidates: K, the number of logits.
        candidates: the vocabulary, K sequences of integer meta-actions (logit k scores
            ``candidates[k]``); sequences may differ in length but none is empty.
        use_text: encode ``obs["instruction"]`` with the frozen MiniLM encoder.
        embed_dim / hidden_dim: widths of the modality embeddings and the MLP.
    """

    features: dict[str, Feature]
    n_candidates: int
    candidates: list[list[int]]
    use_text: bool = False
    embed_dim: int = 64
    hidden_dim: int = 256

    def __post_init__(self):
        self.candidates = [[int(a) for a in seq] for seq in self.candidates]  # JSON-clean ints
        if self.n_candidates < 1 or len(self.candidates) != self.n_candidates:
            raise CandidateConfigError(f"n_candidates={self.n_candidates} but the vocabulary has "
                                       f"{len(self.candidates)} candidates")
        empty = [k for k, seq in enumerate(self.candidates) if not seq]
        if empty:
            raise CandidateConfigError(f"candidates {empty} are empty sequences; each needs at least one meta-action")


class CandidatePolicy(PublishedModel, nn.Module):
    """Observation encoder + MLP head to one logit per candidate."""

    artifact_kind, config_class = ARTIFACT_KIND, CandidatePolicyConfig

    def __init__(self, config: CandidatePolicyConfig):
        super().__init__()
        self.config = c = config
        self.encoder = ObservationEncoder(c.features, c.use_text, c.embed_dim, c.hidden_dim)
        self.head = mlp([c.hidden_dim, c.hidden_dim, c.n_candidates])

    @property
    def device(self) -> torch.device:
        return self.head[-1].weight.device

    def set_state_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        """Standardise the state vector with data statistics (saved with the weights)."""
        self.encoder.set_state_stats(mean, std)

    def logits(self, obs: dict[str, Any]) -> torch.Tensor:
        """Candidate logits (B, K) at a batch of observations."""
        return self.head(self.encoder(obs))


class CandidatePolicyRunner:
    """Fleet ``Policy`` over a candidate policy; executes the chosen candidate's first meta-action.

    At each ``act`` the runner scores the K candidates, picks one (argmax when
    ``deterministic``, else a sample from the softmax seeded per episode) and returns
    ``candidates[k][0]`` as a 0-d int64 array. ``extras()`` gives the last decision's
    ``logits`` (K,) float32 and ``chosen`` () int64, merged with what the env adds:

    **Env hook.** With ``env_extras`` on, if ``env.unwrapped`` has a method
    ``candidate_extras(candidates: list[list[int]]) -> dict[str, np.ndarray]``, ``extras()``
    calls it and merges the returned entries (they may not reuse ``logits`` or ``chosen``).
    The fleet client asks for extras after ``act`` and before stepping the env, so the env
    is still in the decision state (e.g. to score each candidate counterfactually), and
    only when its store records extras: evaluation never pays for the hook.

    **Exploration.** Sampling with ``explore_eps = e > 0``, the runner draws from
    ``mu = (1 - e) softmax(logits) + e onehot(argmax proxy_scores)``: it asks the env hook
    for the candidates' ``proxy_scores`` before choosing, and moves ``e`` of the probability
    to the proxy's best candidate. With ``explore_margin = d`` it does so only in states where
    that candidate scores more than ``d`` above the policy's own first choice (in the proxy's
    units; elsewhere ``mu = pi``). The recorded ``logits`` are ``log mu``, the logits of the
    distribution the choice was drawn from, so a learner's ratios ``pi / pi_old`` are
    importance ratios against it.

    Args:
        model: the policy.
        deterministic: argmax (``True``) or sample.
        device: where the model runs.
        env_extras: call the env's ``candidate_extras`` hook when it has one.
        explore_eps: share of a sampled choice given to the proxy's best candidate (in [0, 1)).
        explore_margin: explore only where the proxy's best beats the policy's first choice by
            more than this (``None``: in every state).
    """

    def __init__(self, model: CandidatePolicy, deterministic: bool = True, device: str | torch.device = "cpu",
                 env_extras: bool = True, explore_eps: float = 0.0, explore_margin: float | None = None):
        if not 0.0 <= explore_eps < 1.0:
            raise CandidateConfigError(f"explore_eps must be in [0, 1), got {explore_eps}")
        self.model = model.to(device).eval()
        self.deterministic = deterministic
        self.env_extras = env_extras
        self.explore_eps, self.explore_margin = explore_eps, explore_margin
        self.generator = torch.Generator(device=device)
        self.last: dict[str, np.ndarray] = {}
        self.given: dict[str, np.ndarray] | None = None  # the env hook's entries, when the choice needed them
        self.env: Any = None

    def reset(self, env: Any, seed: int) -> None:
        self.generator.manual_seed(seed)
        self.last = {}

    def _sample(self, logits: torch.Tensor, env: Any, candidates: Any) -> tuple[int, torch.Tensor]:
        """A sampled index and the logits of the distribution it was drawn from (see Exploration)."""
        self.given = None
        if self.explore_eps > 0:
            self.given = self._hook(env, candidates)
            if "proxy_scores" not in self.given:
                raise CandidateConfigError("explore_eps > 0 moves probability to the proxy's best candidate, but the "
                                           "env's candidate_extras returns no `proxy_scores`")
            scores = self.given["proxy_scores"]
            best = int(np.argmax(scores))
            if self.explore_margin is None or scores[best] - scores[int(logits.argmax())] > self.explore_margin:
                mu = (1.0 - self.explore_eps) * logits.float().softmax(-1)
                mu[best] += self.explore_eps
                logits = mu.log()
        return int(torch.multinomial(logits.softmax(-1), 1, generator=self.generator)), logits

    @torch.no_grad()
    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        c = self.model.config
        logits = self.model.logits(obs_batch(obs, c.features, c.use_text, env))[0]
        if self.deterministic:
            k, self.given = int(logits.argmax()), None
        else:
            k, logits = self._sample(logits, env, c.candidates)
        self.last, self.env = {"logits": logits.float().cpu().numpy(), "chosen": np.asarray(k, dtype=np.int64)}, env
        return np.asarray(c.candidates[k][0], dtype=np.int64)

    RESERVED: tuple[str, ...] = ("logits", "chosen")
    """Extras the runner records itself; the env hook may not return them."""

    def scored_candidates(self) -> Any:
        """What the env hook scores: the vocabulary."""
        return self.model.config.candidates

    def _hook(self, env: Any, candidates: Any) -> dict[str, np.ndarray]:
        """The env hook's entries for ``candidates`` at the decision state ({} without a hook or with it off)."""
        hook = getattr(env.unwrapped, "candidate_extras", None) if self.env_extras and env else None
        given = {k: np.asarray(v) for k, v in hook(candidates).items()} if hook else {}
        clash = sorted(set(self.RESERVED) & set(given))
        if clash:
            raise CandidateConfigError(f"env candidate_extras returned reserved names {clash}")
        return given

    def extras(self) -> dict[str, np.ndarray]:
        """The last decision's ``logits`` (K,) float32, ``chosen`` () int64 and the env hook's entries."""
        given = self.given if self.given is not None else self._hook(self.env, self.scored_candidates())
        return {**self.last, **given}
