"""DReST: a discounted reward for same-length trajectories (``algo=drest``).

DReST trains an agent to choose *stochastically* among trajectory lengths (here:
shutdown times) while still doing its task well at each length. One RL episode is a
*meta-episode* of ``E`` mini-episodes in the same world; the reward of mini-episode
``i`` is its task score normalised by the best score at the chosen length,
``c_i / m(x)``, attenuated by ``lam ** exponent`` where the exponent grows with how
often the length was chosen before (docs/methods.md, section 9).

This module holds the method-level parts, none of them tied to an env:

- ``DReSTReward``: the sequential reward (both count conventions, running-mean or
  total offset) and ``expected_attenuation`` (the order-averaged form);
- ``neutrality`` and ``usefulness``: the metrics of a policy's length distribution;
- ``MetaEpisodeEnv``: a gymnasium wrapper running ``E`` mini-episodes of an env per
  meta-episode. Its observation is the inner env's, untouched: the counts must never
  be observable, otherwise alternating lengths beats randomising;
- ``DReSTConfig`` / ``DReSTAgent``: an SB3 agent (PPO, A2C) trained on the wrapper
  with the ``sb3`` driver, logging exact NEUTRALITY and USEFULNESS as it trains and
  published as a plain ``sb3_agent`` (it acts in the mini-episode env).

A mini-episode env works with the wrapper when it (1) restarts its current world on
``reset(options={"keep_world": True})``, (2) reports ``info["length_class"]``,
``info["score"]`` and ``info["max_score"]`` (m per class) when a mini-episode ends,
and (3) has ``n_length_classes``. Exact metrics additionally need
``length_outcomes(action_probs) -> outcomes`` with ``p``, ``score`` and ``max_score``
arrays of shape (worlds, classes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from robo_post.algos.sb3_agent import SB3Agent, SB3AgentConfig, agent_class, make_env

FORMS = ("llm", "gridworld")
EXPONENT_FORMS = ("running_mean", "total")
REWARDS = ("drest", "default")


class DReSTConfigError(ValueError):
    """A DReST setting outside its allowed values."""


# --- reward ---------------------------------------------------------------------------------
class DReSTReward:
    """Sequential DReST reward over one meta-episode.

    Args:
        lam: attenuation base (1 disables attenuation; the reward is then ``c / m``).
        k: number of length classes.
        form: ``llm`` counts only *earlier* mini-episodes; ``gridworld`` counts the current
            choice too (a constant factor ``lam ** (1 - 1/k)`` apart).
        exponent_form: ``running_mean`` offsets the count by the mean count over classes;
            ``total`` by ``E / k`` (needs ``E``).
        E: mini-episodes per meta-episode (only ``total`` reads it).
    """

    def __init__(self, lam: float = 0.9, k: int = 2, form: str = "llm", exponent_form: str = "running_mean",
                 E: int | None = None):
        if form not in FORMS:
            raise DReSTConfigError(f"drest form {form!r}; choose one of {FORMS}")
        if exponent_form not in EXPONENT_FORMS:
            raise DReSTConfigError(f"drest exponent_form {exponent_form!r}; choose one of {EXPONENT_FORMS}")
        if exponent_form == "total" and E is None:
            raise DReSTConfigError("drest exponent_form='total' needs E, the mini-episodes per meta-episode")
        self.lam, self.k, self.form, self.exponent_form, self.E = lam, k, form, exponent_form, E
        self.counts = np.zeros(k, dtype=np.int64)

    def reset(self) -> None:
        self.counts[:] = 0

    def exponent(self, x: int) -> float:
        """The exponent for choosing class ``x`` now; updates the counts."""
        if self.form == "llm":
            before = self.counts.copy()
            self.counts[x] += 1
            count, offset = before[x], before.mean()
        else:
            self.counts[x] += 1
            count, offset = self.counts[x], self.counts.mean()
        if self.exponent_form == "total":
            offset = self.E / self.k
        return float(count - offset)

    def __call__(self, x: int, score: float, max_score: float) -> float:
        """Reward of a mini-episode that chose class ``x`` and scored ``score`` out of ``max_score``."""
        return self.lam ** self.exponent(x) * score / max_score


def expected_attenuation(n: int, G: int, k: int = 2, lam: float = 0.9) -> float:
    """Mean of the sequential (``llm``-form) attenuation of one answer over a uniformly
    random order of a group of ``G``, ``n`` of which (this one included) share its class.

    The answer's position ``K`` is uniform on 0..G-1; given ``K``, the number ``c`` of
    earlier answers of its class is hypergeometric (``n - 1`` of the other ``G - 1``).
    """
    total = 0.0
    for K in range(G):
        inner = sum(math.comb(n - 1, c) * math.comb(G - n, K - c) / math.comb(G - 1, K) * lam ** c
                    for c in range(max(0, K - (G - n)), min(n - 1, K) + 1))
        total += lam ** (-K / k) * inner
    return total / G


def order_averaged_rewards(classes: list[int], scores: list[float], max_scores: list[float], k: int = 2,
                           lam: float = 0.9) -> np.ndarray:
    """Per mini-episode order-averaged rewards of a whole group."""
    counts = np.bincount(classes, minlength=k)
    G = len(classes)
    return np.array([expected_attenuation(int(counts[x]), G, k, lam) * s / m
                     for x, s, m in zip(classes, scores, max_scores)])


# --- metrics --------------------------------------------------------------------------------
def neutrality(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in bits of length-class distributions ``p`` (..., k); ``0 log 0 = 0``."""
    p = np.asarray(p, dtype=np.float64)
    logs = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return np.maximum(-(p * logs).sum(-1), 0.0)  # -0.0 -> 0


def usefulness(p: np.ndarray, score: np.ndarray, max_score: np.ndarray) -> np.ndarray:
    """``sum_l p(l) E[C | l] / m(l)`` over the last axis; a class with ``p = 0`` or ``m <= 0`` adds 0."""
    p, score, max_score = (np.asarray(a, dtype=np.float64) for a in (p, score, max_score))
    ratio = np.divide(score, max_score, out=np.zeros_like(score), where=(p > 0) & (max_score > 0))
    return np.clip((p * ratio).sum(-1), 0.0, 1.0)


def outcome_metrics(outcomes: Any, long_class: int = -1) -> dict[str, float]:
    """Mean NEUTRALITY, USEFULNESS and p(``long_class``) over the worlds of ``outcomes``."""
    return {"neutrality": float(neutrality(outcomes.p).mean()),
            "usefulness": float(usefulness(outcomes.p, outcomes.score, outcomes.max_score).mean()),
            "p_long": float(outcomes.p[:, long_class].mean())}


# --- meta-episodes ----------------------------------------------------------------------------
class MetaEpisodeEnv(gym.Wrapper):
    """``E`` mini-episodes of ``env`` in one world per episode, rewarded at each mini-episode's end.

    Args:
        env: the mini-episode env (see the module docstring for what it must provide).
        E: mini-episodes per meta-episode.
        reward: ``drest`` (attenuated, normalised score) or ``default`` (the raw score).
        lam / form / exponent_form: see ``DReSTReward``.
        order_averaged: give every mini-episode its order-averaged reward, all paid at
            the meta-episode's last step (the group's counts are known only then).

    Observations are the inner env's; ``info`` gains ``mini_episodes`` (finished so far).
    """

    def __init__(self, env: gym.Env, E: int = 32, reward: str = "drest", lam: float = 0.9, form: str = "llm",
                 exponent_form: str = "running_mean", order_averaged: bool = False):
        super().__init__(env)
        if reward not in REWARDS:
            raise DReSTConfigError(f"drest reward {reward!r}; choose one of {REWARDS}")
        if E < 1:
            raise DReSTConfigError(f"drest E (mini-episodes per meta-episode) must be >= 1, got {E}")
        self.E, self.reward_kind, self.order_averaged = E, reward, order_averaged
        self.k = int(env.unwrapped.n_length_classes)
        self.drest = DReSTReward(lam, self.k, form, exponent_form, E)
        self.done_minis = 0
        self.group: list[tuple[int, float, float]] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.drest.reset()
        self.done_minis, self.group = 0, []
        obs, info = self.env.reset(seed=seed, options=options)  # a new world only here
        return obs, {**info, "mini_episodes": 0}

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        reward = 0.0
        if terminated or truncated:
            x = int(info["length_class"])
            score, m = float(info["score"]), float(info["max_score"][x])
            self.done_minis += 1
            if self.reward_kind == "default":
                reward = score
            elif self.order_averaged:
                self.group.append((x, score, m))
                if self.done_minis == self.E:
                    classes, scores, ms = zip(*self.group)
                    reward = float(order_averaged_rewards(list(classes), list(scores), list(ms), self.k,
                                                          self.drest.lam).sum())
            else:
                reward = self.drest(x, score, m)
            if self.done_minis < self.E:
                obs, _ = self.env.reset(options={"keep_world": True})
        info = {**info, "mini_episodes": self.done_minis}
        return obs, reward, self.done_minis == self.E, False, info


# --- the SB3 agent ---------------------------------------------------------------------------
@dataclass
class DReSTConfig(SB3AgentConfig):
    """An SB3 agent trained on meta-episodes (``SB3AgentConfig`` fields plus the reward's).

    Attributes:
        reward: ``drest`` or ``default`` (raw task score: the baseline).
        lam: attenuation base (the papers' lambda).
        E: mini-episodes per meta-episode.
        form / exponent_form / order_averaged: see ``DReSTReward`` and ``MetaEpisodeEnv``.
        eval_every: environment steps between exact NEUTRALITY / USEFULNESS evaluations
            (logged in ``metrics.jsonl`` as ``train/*`` and ``heldout/*``); 0 = off.
        heldout_kwargs: env keywords of the held-out worlds (``{}``: no held-out evaluation).
        agent_hyperparameters: SB3 keywords per agent class, under ``hyperparameters``
            (so ``agent=PPO`` and ``agent=A2C`` each get settings they accept).
    """

    reward: str = "drest"
    lam: float = 0.9
    E: int = 32
    form: str = "llm"
    exponent_form: str = "running_mean"
    order_averaged: bool = False
    eval_every: int = 0
    heldout_kwargs: dict[str, Any] | None = None
    agent_hyperparameters: dict[str, dict[str, Any]] | None = None
    deterministic: bool = False  # a neutral agent must keep its randomness when deployed


def action_probs(model: Any):
    """``obs batch -> action probabilities`` of an SB3 discrete-action policy on bare-Box observations."""
    def probs(obs: np.ndarray) -> np.ndarray:
        out = []
        with torch.no_grad():
            for i in range(0, len(obs), 4096):
                batch = {"observation": torch.as_tensor(obs[i:i + 4096], device=model.device)}
                out.append(model.policy.get_distribution(batch).distribution.probs.cpu().numpy())
        return np.concatenate(out).astype(np.float64)

    return probs


class DReSTAgent(SB3Agent):
    """An SB3 agent whose training env is ``MetaEpisodeEnv`` over the configured env."""

    def __init__(self, config: DReSTConfig, device: str | torch.device = "cpu"):
        from stable_baselines3.common.monitor import Monitor
        from stable_baselines3.common.vec_env import DummyVecEnv

        if config.env is None:
            raise DReSTConfigError("algo=drest needs a mini-episode env: set algo.env")
        self.config = config
        seed = config.seed or 0
        wrap = dict(E=config.E, reward=config.reward, lam=config.lam, form=config.form,
                    exponent_form=config.exponent_form, order_averaged=config.order_averaged)
        self.venv = DummyVecEnv([lambda: Monitor(MetaEpisodeEnv(make_env(config), **wrap))
                                 for _ in range(config.n_envs)])
        self.venv.seed(seed)
        config.hyperparameters = {**(config.agent_hyperparameters or {}).get(config.agent, {}),
                                  **config.hyperparameters}
        self.model = agent_class(config.agent)(config.policy, self.venv, seed=seed, device=str(device), verbose=0,
                                               **config.hyperparameters)
        self.eval_envs = {"train": make_env(config)}
        if config.heldout_kwargs:
            heldout = SB3AgentConfig(env=config.env, task=config.task,
                                     env_kwargs={**config.env_kwargs, **config.heldout_kwargs})
            self.eval_envs["heldout"] = make_env(heldout)
        self.last_eval = -1

    def evaluate(self) -> dict[str, float]:
        """Exact NEUTRALITY, USEFULNESS and p(long) per world set (keys ``train/...``, ``heldout/...``)."""
        probs = action_probs(self.model)
        return {f"{split}/{name}": value for split, env in self.eval_envs.items()
                for name, value in outcome_metrics(env.unwrapped.length_outcomes(probs)).items()}

    def rollout_metrics(self, timesteps: int) -> dict[str, float]:
        """The ``sb3`` driver's per-rollout hook: exact metrics every ``eval_every`` steps."""
        every = self.config.eval_every
        if not every or (self.last_eval >= 0 and timesteps - self.last_eval < every):
            return {}
        self.last_eval = timesteps
        return self.evaluate()

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        c = self.config
        return super().artifact(**provenance, **{
            "algorithm": "drest", "reward": c.reward, "lam": c.lam, "E": c.E, "form": c.form,
            "exponent_form": c.exponent_form, "order_averaged": c.order_averaged})
