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
  meta-episode. Its observation is the inner env's: the policy must never see the
  counts, otherwise alternating lengths beats randomising. Optionally it adds them
  under ``PRIVILEGED_KEY`` for a critic only (``PrivilegedCriticPolicy``: the actor's
  features hold zeros there, so its action distribution cannot depend on them);
- ``DReSTConfig`` / ``DReSTAgent``: an SB3 agent (PPO, A2C) trained on the wrapper
  with the ``sb3`` driver, optionally with the privileged critic and a linearly
  annealed learning rate and entropy bonus, logging exact NEUTRALITY and USEFULNESS
  as it trains and published as a plain ``sb3_agent`` (it acts in the mini-episode env).

A mini-episode env works with the wrapper when it (1) restarts its current world on
``reset(options={"keep_world": True})``, (2) reports ``info["length_class"]``,
``info["score"]`` and ``info["max_score"]`` (m per class) when a mini-episode ends,
and (3) has ``n_length_classes``. Exact metrics additionally need
``length_outcomes(action_probs) -> outcomes`` with ``p``, ``score`` and ``max_score``
arrays of shape (worlds, classes); an env that also has ``world_keys()`` (one identity
per world) lets DReST refuse held-out worlds that the training set also holds.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from robo_post.algos.sb3_agent import (SB3Agent, SB3AgentConfig, agent_class, build_model, make_env,
                                       resolve_policy_kwargs)

FORMS = ("llm", "gridworld")
EXPONENT_FORMS = ("running_mean", "total")
REWARDS = ("drest", "default")
SCHEDULES = ("constant", "linear")
AGENTS = ("PPO", "A2C")  # on-policy with a discrete action distribution: the exact metrics read its probabilities
PRIVILEGED_KEY = "meta_episode"  # the critic-only observation of MetaEpisodeEnv(privileged=True)


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
        if not 0 < lam <= 1:  # lam ** exponent: a negative base has no real powers, 0 none of negative ones
            raise DReSTConfigError(f"drest lam (attenuation base) must be in (0, 1], got {lam}")
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
        privileged: add ``PRIVILEGED_KEY`` to the (Dict) observation: the per-class counts
            of the finished mini-episodes and their number, each divided by ``E``. Only a
            critic may read it (``PrivilegedCriticPolicy``); an actor that did would learn
            to alternate lengths instead of randomising.

    Observations are the inner env's (plus ``PRIVILEGED_KEY`` if ``privileged``); ``info``
    gains ``mini_episodes`` (finished so far).
    """

    def __init__(self, env: gym.Env, E: int = 32, reward: str = "drest", lam: float = 0.9, form: str = "llm",
                 exponent_form: str = "running_mean", order_averaged: bool = False, privileged: bool = False):
        super().__init__(env)
        if reward not in REWARDS:
            raise DReSTConfigError(f"drest reward {reward!r}; choose one of {REWARDS}")
        if E < 1:
            raise DReSTConfigError(f"drest E (mini-episodes per meta-episode) must be >= 1, got {E}")
        self.E, self.reward_kind, self.order_averaged, self.privileged = E, reward, order_averaged, privileged
        self.k = int(env.unwrapped.n_length_classes)
        self.drest = DReSTReward(lam, self.k, form, exponent_form, E)
        self.done_minis = 0
        self.group: list[tuple[int, float, float]] = []
        self.counts = np.zeros(self.k)  # per class, whatever the reward (the critic's view)
        if privileged:
            if not isinstance(env.observation_space, gym.spaces.Dict) or PRIVILEGED_KEY in env.observation_space.spaces:
                raise DReSTConfigError(f"a privileged critic needs a Dict observation without {PRIVILEGED_KEY!r}, "
                                       f"got {env.observation_space}")
            self.observation_space = gym.spaces.Dict({
                **env.observation_space.spaces,
                PRIVILEGED_KEY: gym.spaces.Box(0.0, 1.0, (self.k + 1,), np.float32)})

    def _observe(self, obs):
        if not self.privileged:
            return obs
        meta = np.append(self.counts, self.done_minis).astype(np.float32) / self.E
        return {**obs, PRIVILEGED_KEY: meta}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.drest.reset()
        self.done_minis, self.group = 0, []
        self.counts[:] = 0
        obs, info = self.env.reset(seed=seed, options=options)  # a new world only here
        return self._observe(obs), {**info, "mini_episodes": 0}

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        reward = 0.0
        if terminated or truncated:
            x = int(info["length_class"])
            score, m = float(info["score"]), float(info["max_score"][x])
            self.done_minis += 1
            self.counts[x] += 1
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
        return self._observe(obs), reward, self.done_minis == self.E, False, info


# --- the privileged critic -----------------------------------------------------------------
def _privileged_policy_class():
    """``PrivilegedCriticPolicy``, built on first use so that importing this module needs no SB3."""
    from stable_baselines3.common.policies import MultiInputActorCriticPolicy
    from stable_baselines3.common.preprocessing import get_flattened_obs_dim
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class PrivilegedFeatures(BaseFeaturesExtractor):
        """The policy's own features extractor (``inner``) over every key but ``PRIVILEGED_KEY``,
        then that key flattened; the actor's copy puts zeros in its place without reading it
        (so it acts without the key)."""

        def __init__(self, observation_space: gym.spaces.Dict, critic: bool, inner: type, inner_kwargs: dict):
            self.keys = [k for k in observation_space.spaces if k != PRIVILEGED_KEY]
            self.n_privileged = get_flattened_obs_dim(observation_space[PRIVILEGED_KEY])
            visible = gym.spaces.Dict({k: observation_space[k] for k in self.keys})
            extractor = inner(visible, **inner_kwargs)
            super().__init__(observation_space, extractor.features_dim + self.n_privileged)
            self.inner, self.critic = extractor, critic

        def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
            features = self.inner({k: obs[k] for k in self.keys})
            privileged = (obs[PRIVILEGED_KEY].flatten(1).float() if self.critic
                          else features.new_zeros(len(features), self.n_privileged))
            return torch.cat([features, privileged], 1)

    class PrivilegedCriticPolicy(MultiInputActorCriticPolicy):
        """SB3's actor-critic over a Dict observation whose ``PRIVILEGED_KEY`` only the value
        net sees: it makes the DReST return, which depends on the meta-episode's counts and
        position, predictable for the critic while the actor stays blind to them.

        ``deployable_state_dict`` gives the weights of a plain ``MultiInputPolicy`` with
        separate actor and critic extractors, without the privileged inputs' weights.
        """

        def __init__(self, observation_space, action_space, lr_schedule, **kwargs):
            if PRIVILEGED_KEY not in observation_space.spaces:
                raise DReSTConfigError(f"a privileged critic needs the {PRIVILEGED_KEY!r} observation "
                                       "(MetaEpisodeEnv(privileged=True))")
            super().__init__(observation_space, action_space, lr_schedule,
                             **{**kwargs, "share_features_extractor": False})

        def _build(self, lr_schedule) -> None:
            # Called by ActorCriticPolicy.__init__ before any layer that reads the features exists.
            space, inner = self.observation_space, (self.features_extractor_class, self.features_extractor_kwargs)
            self.features_extractor = self.pi_features_extractor = PrivilegedFeatures(space, False, *inner)
            self.vf_features_extractor = PrivilegedFeatures(space, True, *inner)
            self.features_dim = self.features_extractor.features_dim
            super()._build(lr_schedule)

        def deployable_state_dict(self) -> dict[str, torch.Tensor]:
            """The weights of a plain ``MultiInputPolicy`` over the observation without the
            privileged key (``share_features_extractor=False``): each extractor is its inner one,
            and the first layer of each head loses the privileged inputs' columns. Acting is
            unchanged (the actor's privileged inputs are always 0)."""
            n = self.features_extractor.n_privileged
            state = {k.replace("features_extractor.inner.", "features_extractor."): v.detach().cpu().clone()
                     for k, v in self.state_dict().items()}
            for net, head in (("policy_net", "action_net"), ("value_net", "value_net")):
                first = next((name for name, module in getattr(self.mlp_extractor, net).named_children()
                              if isinstance(module, torch.nn.Linear)), None)
                key = f"{head}.weight" if first is None else f"mlp_extractor.{net}.{first}.weight"
                state[key] = state[key][:, :-n].clone()
            return state

    return PrivilegedCriticPolicy


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
        privileged_critic: train with ``PrivilegedCriticPolicy``: the value net also sees
            the meta-episode's counts and position, the actor does not. The published agent
            is a plain policy of the mini-episode env either way.
        schedule: ``constant``, or ``linear``: the agent's ``learning_rate`` and ``ent_coef``
            decay linearly to 0 over each ``learn`` call (explore the long paths early, then
            let the routes settle; the length choice keeps only the randomness DReST pays for).
    """

    reward: str = "drest"
    lam: float = 0.9
    E: int = 32
    form: str = "llm"
    exponent_form: str = "running_mean"
    order_averaged: bool = False
    eval_every: int = 100_000
    heldout_kwargs: dict[str, Any] | None = field(default_factory=lambda: {"split": "heldout", "n_grids": 32})
    agent_hyperparameters: dict[str, dict[str, Any]] | None = field(default_factory=lambda: {
        # PPO undiscounted (the meta-episode is finite); A2C keeps 0.99 (at its budget gamma 1 cost it
        # most of its USEFULNESS). 3x3 convolutions over the grid's planes find the long routes, without
        # SB3's orthogonal init, whose large features saturate the actor's first tanh layer.
        "PPO": {"n_steps": 64, "batch_size": 512, "n_epochs": 4, "ent_coef": 0.1, "gamma": 1.0, "learning_rate": 1e-3,
                "policy_kwargs": {"net_arch": [128, 128], "features_extractor_class": "spatial_conv",
                                  "features_extractor_kwargs": {"channels": [16, 32]}, "ortho_init": False}},
        "A2C": {"n_steps": 8, "ent_coef": 0.05, "gamma": 0.99, "gae_lambda": 0.95, "learning_rate": 1e-3,
                "policy_kwargs": {"net_arch": [128, 128], "features_extractor_class": "spatial_conv",
                                  "features_extractor_kwargs": {"channels": [16, 32]}, "ortho_init": False}}})
    privileged_critic: bool = True
    schedule: str = "linear"
    deterministic: bool = False  # a neutral agent must keep its randomness when deployed
    # The mini-episode gridworld's 8 training worlds, 3M steps over 32 envs per policy forward.
    env: str | None = "robo_post/ShutdownGrid-v0"
    env_kwargs: dict[str, Any] = field(default_factory=lambda: {"split": "train", "n_grids": 8})
    timesteps: int = 3_000_000
    n_envs: int = 32


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


@dataclass(frozen=True)
class LinearSchedule:
    """SB3 learning-rate schedule: ``start`` decaying linearly to 0 over training."""

    start: float

    def __call__(self, progress_remaining: float) -> float:
        return self.start * progress_remaining


def _annealed_entropy(cls: type, start: float) -> type:
    """``cls`` (an SB3 on-policy algorithm) whose ``ent_coef`` decays linearly from ``start``
    to 0 over each ``learn`` call (SB3 schedules only the learning rate)."""

    class Annealed(cls):
        def train(self) -> None:
            self.ent_coef = start * self._current_progress_remaining
            super().train()

    Annealed.__name__ = Annealed.__qualname__ = f"{cls.__name__}AnnealedEntropy"
    return Annealed


class _FreshInfos(list):
    """``DummyVecEnv``'s info buffer without its defensive deep copy per step (a third of the
    rollout's time here): every env step builds new info dicts, so a shallow copy is enough."""

    def __deepcopy__(self, memo: dict) -> list:
        return list(self)


def _refuse_shared_worlds(train: gym.Env, heldout: gym.Env, heldout_kwargs: dict[str, Any]) -> None:
    """Refuse held-out worlds the training set also has: their figures would not be held out.

    Raises:
        DReSTConfigError: naming ``heldout_kwargs`` and how many worlds the two sets share.
    """
    if not (hasattr(train, "world_keys") and hasattr(heldout, "world_keys")):
        return
    held = heldout.world_keys()
    shared = len(set(held) & set(train.world_keys()))
    if shared:
        raise DReSTConfigError(
            f"algo.heldout_kwargs {dict(heldout_kwargs)} gives {shared} of {len(held)} held-out worlds that the "
            "training worlds also hold: choose env kwargs that select other worlds")


class DReSTAgent(SB3Agent):
    """An SB3 agent whose training env is ``MetaEpisodeEnv`` over the configured env."""

    def __init__(self, config: DReSTConfig, device: str | torch.device = "cpu"):
        from stable_baselines3.common.monitor import Monitor
        from stable_baselines3.common.vec_env import DummyVecEnv

        if config.env is None:
            raise DReSTConfigError("algo=drest needs a mini-episode env: set algo.env")
        if config.agent not in AGENTS:
            raise DReSTConfigError(f"drest agent {config.agent!r}; choose one of {AGENTS}")
        self.config = config
        seed = config.seed or 0
        wrap = dict(E=config.E, reward=config.reward, lam=config.lam, form=config.form,
                    exponent_form=config.exponent_form, order_averaged=config.order_averaged,
                    privileged=config.privileged_critic)
        self.venv = DummyVecEnv([lambda: Monitor(MetaEpisodeEnv(make_env(config), **wrap))
                                 for _ in range(config.n_envs)])
        self.venv.buf_infos = _FreshInfos(self.venv.buf_infos)
        self.venv.seed(seed)
        config.hyperparameters = {**(config.agent_hyperparameters or {}).get(config.agent, {}),
                                  **config.hyperparameters}
        if config.schedule not in SCHEDULES:
            raise DReSTConfigError(f"drest schedule {config.schedule!r}; choose one of {SCHEDULES}")
        hyper, cls = resolve_policy_kwargs(config.hyperparameters), agent_class(config.agent)
        if config.schedule == "linear":
            defaults = inspect.signature(cls).parameters
            hyper["learning_rate"] = LinearSchedule(float(hyper.get("learning_rate", defaults["learning_rate"].default)))
            cls = _annealed_entropy(cls, float(hyper.get("ent_coef", defaults["ent_coef"].default)))
        policy = _privileged_policy_class() if config.privileged_critic else config.policy
        self.model = build_model(cls, config, policy, self.venv, seed, device, hyper)
        self.eval_envs = {"train": make_env(config)}
        if config.heldout_kwargs:
            heldout = SB3AgentConfig(env=config.env, task=config.task,
                                     env_kwargs={**config.env_kwargs, **config.heldout_kwargs})
            self.eval_envs["heldout"] = make_env(heldout)
            _refuse_shared_worlds(self.eval_envs["train"].unwrapped, self.eval_envs["heldout"].unwrapped,
                                  config.heldout_kwargs)
        self.last_eval = -1

    def outcomes(self) -> dict[str, Any]:
        """The current policy's exact per-world outcomes (``p``, ``score``, ``max_score``) per world set."""
        probs = action_probs(self.model)
        return {split: env.unwrapped.length_outcomes(probs) for split, env in self.eval_envs.items()}

    def evaluate(self, outcomes: dict[str, Any] | None = None) -> dict[str, float]:
        """Exact NEUTRALITY, USEFULNESS and p(long) per world set (keys ``train/...``, ``heldout/...``),
        of ``outcomes`` if given (from ``outcomes()``), else of the current policy."""
        return {f"{split}/{name}": value for split, o in (outcomes or self.outcomes()).items()
                for name, value in outcome_metrics(o).items()}

    def rollout_metrics(self, timesteps: int) -> dict[str, float]:
        """The ``sb3`` driver's per-rollout hook: exact metrics every ``eval_every`` steps."""
        every = self.config.eval_every
        if not every or (self.last_eval >= 0 and timesteps - self.last_eval < every):
            return {}
        self.last_eval = timesteps
        return self.evaluate()

    def final_metrics(self) -> dict[str, float]:
        """The ``sb3`` driver's end-of-run hook: exact metrics of the trained agent (``summary.json``'s ``evaluation``)."""
        return self.evaluate()

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        c = self.config
        weights, config = super().artifact(**provenance, **{
            "algorithm": "drest", "reward": c.reward, "lam": c.lam, "E": c.E, "form": c.form,
            "exponent_form": c.exponent_form, "order_averaged": c.order_averaged,
            "privileged_critic": c.privileged_critic})
        if c.privileged_critic:  # deployed as a plain policy of the mini-episode env
            weights = self.model.policy.deployable_state_dict()
            kwargs = config["hyperparameters"].get("policy_kwargs") or {}
            config["hyperparameters"] = {**config["hyperparameters"],
                                         "policy_kwargs": {**kwargs, "share_features_extractor": False}}
        return weights, config
