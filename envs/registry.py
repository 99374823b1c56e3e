"""Environments by id: what robo-post knows about each env it can run.

``env_spec(name_or_id)`` returns an :class:`EnvSpec` for

- robo-post's own envs, by alias (``tabletop``, ``driving``, ``highway_meta``,
  ``point_mass``, ``reacher``, ``shutdown_grid``) or gymnasium id (``robo_post/Tabletop-v0``, ...): they
  come with scripted experts, an overseer, a success rule, for driving per-episode
  metrics and, for the goal-reaching envs, goal-conditioned priors (``make_prior``);
- any other id ``gymnasium.make`` accepts (``Hopper-v5``, ``CartPole-v1``,
  ``module:Env-v0``): a generic spec with no expert, no tasks (the single task is
  the id) and the generic success rule (see :func:`generic_success`).

Every env made through a spec has a flat ``Dict`` observation space of ``Box`` and
``Discrete`` entries: a bare ``Box``/``Discrete`` observation becomes
``{"observation": ...}`` (the store's key for bare observations), a flat ``Dict``
keeps its keys, anything nested raises :class:`UnsupportedSpaceError`.

Register another env with ``register_env(EnvSpec(...))``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from robo_post.store.schema import BARE_OBS_KEY, ArraySpec

# (env, noise, mode, seed) -> act(obs) -> action; built at every episode start.
ExpertFactory = Callable[[gym.Env, float, str, "int | None"], Callable[[Mapping[str, Any]], np.ndarray]]
# env -> prior(batch of flat-dict observations, each key (B, ...)) -> mean actions (B, A), clipped
# to the action bounds: a deterministic goal-conditioned controller (see EnvSpec.priors).
PriorFactory = Callable[[gym.Env], Callable[[Mapping[str, np.ndarray]], np.ndarray]]
# A scalar per-episode metric: bools are rates (Wilson intervals in eval), floats are means.
Metric = bool | float

GENERIC_SUCCESS_RULE = (
    "the last step's info['is_success'], else info['success'], when the env reports one; "
    "otherwise undefined (None)"
)


class EnvRegistryError(ValueError):
    """Base class of the env registry's errors."""


class UnknownEnvError(EnvRegistryError):
    """Neither one of robo-post's envs nor a registered gymnasium id."""


class UnsupportedSpaceError(EnvRegistryError):
    """An env's observation space is not a Box, a Discrete or a flat Dict of those."""


class EnvMakeError(EnvRegistryError):
    """``gymnasium.make`` could not make a registered env: its constructor refused the keyword
    arguments (unknown, missing, wrong type) or a dependency of the env is not installed."""


class NoExpertError(EnvRegistryError):
    """The env has no scripted expert (so no ``expert`` policy and no overseer)."""


class UnknownTaskError(EnvRegistryError):
    """A task the env does not have."""


class NoPriorError(EnvRegistryError):
    """The env has no goal-conditioned prior of that name (or none at all)."""


class UnknownExpertModeError(EnvRegistryError):
    """An expert mode the env's scripted expert does not have."""


def generic_success(info: Mapping[str, Any]) -> bool | None:
    """Success of an episode from its last step's info: ``info["is_success"]`` (the
    gymnasium-robotics / SB3 convention), else ``info["success"]``, else ``None``
    (the env does not define success)."""
    for key in ("is_success", "success"):
        if key in info:
            return bool(info[key])
    return None


def _time_limit(env: gym.Env) -> int | None:
    """The step limit gymnasium's ``TimeLimit`` enforces, if any."""
    return env.spec.max_episode_steps if env.spec is not None else None


@dataclass(frozen=True)
class EnvSpec:
    """One environment and everything robo-post attaches to it.

    Attributes:
        id: gymnasium id (what ``gymnasium.make`` takes).
        name: short alias (``tabletop``); ``None`` for plain gymnasium ids.
        tasks: tasks run when none are given, or a zero-argument callable returning
            them (so listing them need not import the env). Empty: the env has no
            tasks and its single task id is ``id``.
        task_kwarg: constructor keyword the task is passed as (``None``: no tasks).
        make_kwargs: extra ``gymnasium.make`` keywords (e.g. ``disable_env_checker``).
        expert: factory ``(env, noise, mode, seed) -> act(obs)`` of a scripted expert
            for the episode just reset; ``None``: the env has none.
        expert_modes: the ``mode`` values ``expert`` takes (``near_miss``: plausible failures).
        overseer_key: observation key whose stalls the overseer watches; ``None``:
            no overseer (it also needs ``expert``).
        step_limit: ``env -> int | None``, the episode step limit (overseer deadline).
        success: ``last info -> bool | None``; ``None`` means undefined.
        success_rule: the success rule in words (docs, reports).
        metrics: ``step infos -> {name: bool | float}``, per-episode env metrics
            (bools are rates, floats means); ``None``: none.
        metric_ids: names among ``metrics`` that identify the episode (a world index, a
            seed): recorded with each episode, not averaged by eval.
        bounds: ``name -> (low, high)`` (``None``: unbounded) of per-episode quantities that
            cannot leave a range: ``"return"`` or a metric. Eval clips their 95% intervals
            to it, which a few skewed episodes otherwise overshoot.
        horizon: default action-chunk length for chunked policies; 1 (the default) for
            reactive control, whose later actions depend on states the policy sees anyway:
            predicting them spends the network on what it cannot know (flow BC on Hopper's
            SAC data: 1672 with chunks of 4, 3279 with 1).
        execute_steps: default actions executed open-loop per chunk (1 for reactive
            control: locomotion, balancing).
        language: the env provides an instruction (``env.unwrapped.instruction``).
        split_kwarg: constructor keyword taking an instruction split (``train`` /
            ``heldout``); ``None``: only ``train`` exists.
        policy_env_kwargs: ``policy config -> env kwargs`` the policy needs (e.g.
            camera images at its resolution); used when eval is given none.
        render_kwargs: keywords that make ``env.render()`` return RGB frames.
        features: default observation-role overrides for models trained on this env's
            data (key -> role, or ``None`` to leave a key out), under the user's
            ``model.features``.
        candidates: zero-argument callable returning the vocabulary of candidate futures
            (sequences of discrete actions) that candidate-scoring policies choose from;
            ``None``: the env has none.
        step_extras: ``info -> {name: array}``, per-step values the env reports (e.g.
            events) that a store declaring them records beside the action; ``None``: none.
        step_extra_specs: name -> ``ArraySpec`` of those values.
        priors: goal-conditioned prior controllers by name, each a factory
            ``env -> prior(obs) -> actions``: given one made env, a deterministic,
            vectorised function from a batch of flat-dict observations (every key of
            the env's observation space, each (B, ...)) to the prior's mean actions
            (B, A) in env units, clipped to the action bounds, toward the goal the
            observation shows. The first is the default (see :func:`make_prior`).
    """

    id: str
    name: str | None = None
    tasks: Sequence[str] | Callable[[], Sequence[str]] = ()
    task_kwarg: str | None = None
    make_kwargs: Mapping[str, Any] = field(default_factory=dict)
    expert: ExpertFactory | None = None
    expert_modes: tuple[str, ...] = ("expert",)
    overseer_key: str | None = None
    step_limit: Callable[[gym.Env], int | None] = _time_limit
    success: Callable[[Mapping[str, Any]], bool | None] = generic_success
    success_rule: str = GENERIC_SUCCESS_RULE
    metrics: Callable[[list[Mapping[str, Any]]], dict[str, Metric]] | None = None
    metric_ids: tuple[str, ...] = ()
    bounds: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)
    horizon: int = 1
    execute_steps: int = 1
    language: bool = False
    split_kwarg: str | None = None
    policy_env_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    render_kwargs: Mapping[str, Any] = field(default_factory=lambda: {"render_mode": "rgb_array"})
    features: Mapping[str, str | None] = field(default_factory=dict)
    candidates: Callable[[], Sequence[Sequence[int]]] | None = None
    step_extras: Callable[[Mapping[str, Any]], dict[str, np.ndarray]] | None = None
    step_extra_specs: Mapping[str, Any] = field(default_factory=dict)
    priors: Mapping[str, PriorFactory] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """The name configs and stores use: the alias, else the id."""
        return self.name or self.id

    def default_tasks(self) -> tuple[str, ...]:
        """Tasks run when none are given; ``(id,)`` for an env without tasks."""
        tasks = self.tasks() if callable(self.tasks) else self.tasks
        return tuple(tasks) or (self.id,)

    @property
    def supports_overseer(self) -> bool:
        return self.expert is not None and self.overseer_key is not None

    def make(self, task: str | None = None, **kwargs: Any) -> gym.Env:
        """Make the env for ``task`` (``None``: the first default task) with a flat Dict observation.

        Raises:
            UnknownTaskError: a task other than the id for an env without tasks.
            UnsupportedSpaceError: the observation space is nested.
            EnvMakeError: the env's constructor refused the kwargs (e.g. a misspelt ``+env.kwargs.X``),
                or a dependency of the env is not installed.
        """
        if self.task_kwarg is not None:
            kwargs[self.task_kwarg] = task if task is not None else self.default_tasks()[0]
        elif task not in (None, self.id):
            raise UnknownTaskError(f"env {self.key!r} has no tasks; its only task id is {self.id!r}, got {task!r}")
        try:
            env = gym.make(self.id, **{**self.make_kwargs, **kwargs})
        except TypeError as e:  # gymnasium re-raises the constructor's own message, naming the kwarg
            raise EnvMakeError(f"env {self.key!r} cannot be made with kwargs {kwargs}: {e}") from None
        except gym.error.DependencyNotInstalled as e:  # raised when make imports the env's module
            raise EnvMakeError(f"env {self.key!r} cannot be made: {e}") from None
        try:
            return flat_dict_observation(env)
        except UnsupportedSpaceError:
            env.close()
            raise

    def make_expert(self, env: gym.Env, noise: float = 0.0, mode: str = "expert", seed: int | None = None
                    ) -> Callable[[Mapping[str, Any]], np.ndarray]:
        """The scripted expert for the episode ``env`` was just reset to: ``act(obs) -> action``."""
        if self.expert is None:
            raise NoExpertError(f"env {self.key!r} has no scripted expert; use another policy kind")
        return self.expert(env, noise, mode, seed)

    def instruction(self, env: gym.Env) -> str:
        """The episode's instruction; ``""`` for envs without language."""
        return str(env.unwrapped.instruction) if self.language else ""

    def episode_metrics(self, infos: list[Mapping[str, Any]]) -> dict[str, Metric]:
        """Per-episode env metrics from the step infos (``{}`` if the env has none)."""
        return self.metrics(infos) if self.metrics is not None and infos else {}


class _DictObservation(gym.ObservationWrapper):
    """A bare observation ``o`` becomes ``{BARE_OBS_KEY: o}``."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = spaces.Dict({BARE_OBS_KEY: env.observation_space})

    def observation(self, observation: Any) -> dict[str, Any]:
        return {BARE_OBS_KEY: observation}


_LEAF_SPACES = (spaces.Box, spaces.Discrete)


def flat_dict_observation(env: gym.Env) -> gym.Env:
    """``env`` with a flat Dict observation space (see the module docstring).

    Raises:
        UnsupportedSpaceError: a nested or otherwise unsupported space, naming it.
    """
    space = env.observation_space
    if isinstance(space, _LEAF_SPACES):
        return _DictObservation(env)
    if isinstance(space, spaces.Dict):
        bad = {k: s for k, s in space.spaces.items() if not isinstance(s, _LEAF_SPACES)}
        if not bad:
            return env
        detail = ", ".join(f"{k!r}: {s}" for k, s in bad.items())
        raise UnsupportedSpaceError(
            f"env {_env_id(env)!r}: Dict observation entries must be Box or Discrete; nested or unsupported: {detail}")
    raise UnsupportedSpaceError(
        f"env {_env_id(env)!r}: observation space {space} is not a Box, a Discrete or a flat Dict of those")


def _env_id(env: gym.Env) -> str:
    return env.spec.id if env.spec is not None else type(env.unwrapped).__name__


# --- the registry -----------------------------------------------------------------
_SPECS: dict[str, EnvSpec] = {}  # by id and by alias
_GENERIC: dict[str, EnvSpec] = {}


def register_env(spec: EnvSpec) -> EnvSpec:
    """Add (or replace) an env; it is then found by its id and its alias."""
    _SPECS[spec.id] = spec
    if spec.name:
        _SPECS[spec.name] = spec
    return spec


def registered_names() -> list[str]:
    """Aliases and ids of robo-post's own envs."""
    return sorted(_SPECS)


def registered_specs() -> list[EnvSpec]:
    """robo-post's own env specs (each once), in registration order."""
    return list({id(s): s for s in _SPECS.values()}.values())


def env_spec(name_or_id: str) -> EnvSpec:
    """The spec of one of our envs (alias or id), else a generic spec for a gymnasium id.

    Raises:
        UnknownEnvError: neither ours nor a registered gymnasium id.
    """
    if name_or_id in _SPECS:
        return _SPECS[name_or_id]
    if name_or_id not in _GENERIC:
        module, _, env_id = name_or_id.rpartition(":")
        try:
            if module:  # gymnasium's "module:Env-v0": importing the module registers the id
                importlib.import_module(module)
            gym.spec(env_id)
        except (gym.error.Error, ImportError) as e:
            # an id registered by the user's own module (Minari records it without the module)
            own = "" if module else "; an env your own module registers is env=MODULE:ID"
            raise UnknownEnvError(
                f"unknown env {name_or_id!r}: not one of robo-post's envs ({', '.join(registered_names())}) "
                f"and not a registered gymnasium id ({e}){own}"
            ) from None
        _GENERIC[name_or_id] = EnvSpec(id=name_or_id)
    return _GENERIC[name_or_id]


def make_prior(spec_or_name: EnvSpec | str, name: str | None, env: gym.Env
               ) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    """The env's goal-conditioned prior ``name`` (``None``: its first) built for ``env``
    (see :attr:`EnvSpec.priors`).

    Raises:
        NoPriorError: the env has no priors, or none called ``name``; names the known ones.
        UnknownEnvError: ``spec_or_name`` is no env.
    """
    spec = env_spec(spec_or_name) if isinstance(spec_or_name, str) else spec_or_name
    if not spec.priors:
        raise NoPriorError(f"env {spec.key!r} has no goal-conditioned priors")
    if name is None:
        name = next(iter(spec.priors))
    if name not in spec.priors:
        raise NoPriorError(f"env {spec.key!r} has no prior {name!r}; its priors: {', '.join(spec.priors)}")
    return spec.priors[name](env)


def spec_for_env(env: gym.Env) -> EnvSpec:
    """The spec of a live env: by its gymnasium id when made by ``gymnasium.make``, else by
    matching its class against the entry points of our registered ids."""
    if env.spec is not None:
        return env_spec(env.spec.id)
    cls = type(env.unwrapped)
    entry = f"{cls.__module__}:{cls.__qualname__}"
    for spec in _SPECS.values():
        registered = gym.registry.get(spec.id)
        if registered is not None and registered.entry_point == entry:
            return spec
    raise UnknownEnvError(f"env {cls.__name__} was not made by gymnasium.make and is none of robo-post's envs")


def expand_env_override(overrides: Iterable[str], config_names: Iterable[str]) -> list[str]:
    """Hydra overrides with ``env=ID`` for an env that has no ``configs/env/ID.yaml``
    rewritten to ``env=gym env.name=ID`` (any gymnasium id, from the generic group)."""
    known = set(config_names)
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key == "env" and value not in known:
            out += ["env=gym", f"env.name={value}"]
        else:
            out.append(item)
    return out


# --- robo-post's envs (the only place below the CLI that names them) -------------
def _tabletop_expert(env: gym.Env, noise: float, mode: str, seed: int | None) -> Callable:
    from robo_post.envs.experts import make_expert

    unwrapped = env.unwrapped
    expert = make_expert(unwrapped.task, noise=noise, mode=mode, seed=seed)
    expert.reset(unwrapped)
    return lambda obs: expert.act(obs, unwrapped)


def _tabletop_policy_env_kwargs(policy_config: Mapping[str, Any]) -> dict[str, Any]:
    """Camera images at the model's resolution iff it reads the ``image`` observation."""
    image = policy_config.get("model", {}).get("features", {}).get("image")
    if image is not None:
        return {"render_images": True, "image_size": int(image["shape"][0])}
    return {"render_images": False}  # state-only policies (and the expert) skip rendering: much faster


register_env(EnvSpec(
    id="robo_post/Tabletop-v0",
    name="tabletop",
    tasks=("reach", "push", "pick", "place"),  # "sort" (long-horizon) is opt-in
    task_kwarg="task",
    make_kwargs={"disable_env_checker": True},
    expert=_tabletop_expert,
    expert_modes=("expert", "near_miss"),
    overseer_key="proprio",
    step_limit=lambda env: env.unwrapped.max_steps,
    success=lambda info: bool(info["success"]),
    success_rule="info['success'] of the last step: the task's goal state was reached (which ends the episode)",
    bounds={"return": (0.0, 1.0)},  # reward 1 on the step that succeeds, else 0
    horizon=8,
    execute_steps=4,
    language=True,
    split_kwarg="instruction_split",
    policy_env_kwargs=_tabletop_policy_env_kwargs,
    # Observation images never affect physics: skip rendering them when only frames are wanted.
    render_kwargs={"render_mode": "rgb_array", "render_images": False},
    # The instruction names the task; a policy given the task index would not need to read it
    # (and held-out phrasings would test nothing).
    features={"task_id": None},
))


def _driving_tasks() -> tuple[str, ...]:
    from robo_post.envs.driving import SCENARIOS

    return SCENARIOS


def _driving_expert(env: gym.Env, noise: float, mode: str, seed: int | None) -> Callable:
    from robo_post.envs.driving import make_driving_expert

    if mode != "expert":
        raise ValueError(f"the driving expert has no mode {mode!r}; only 'expert'")
    expert = make_driving_expert(noise=noise, seed=seed)
    unwrapped = env.unwrapped
    return lambda obs: expert(unwrapped)


def _driving_metrics(infos: list[Mapping[str, Any]]) -> dict[str, Metric]:
    return {
        "collision": any(bool(i["collision"]) for i in infos),
        "off_road": any(bool(i["off_road"]) for i in infos),
        "mean_speed": float(np.mean([i["speed"] for i in infos])),
    }


register_env(EnvSpec(
    id="robo_post/Driving-v0",
    name="driving",
    tasks=_driving_tasks,
    task_kwarg="scenario",
    make_kwargs={"disable_env_checker": True},
    expert=_driving_expert,
    overseer_key="state",
    step_limit=lambda env: env.unwrapped.duration,
    success=lambda info: bool(info["success"]),
    success_rule="info['success'] of the last step: the episode ran to its end without a collision or leaving the road",
    metrics=_driving_metrics,
    bounds={"mean_speed": (0.0, None)},
    # 5 decisions per second by default: a 4-step chunk covers 0.8 s, re-planned every step
    # (executing 2 open-loop left the road in 64% of roundabout episodes, 1 in 12%).
    horizon=4,
    execute_steps=1,
    language=True,  # one fixed instruction per scenario
    # recorded only into stores that declare extras (algo=craft's online store); plain driving stores are unchanged
    step_extras=lambda info: {"events": np.asarray(info["events"], dtype=np.float32)},
    # collision or off-road, TTC breach, progress, off the rightmost lane, blocked (never, with continuous
    # speed): highway_meta.EVENTS' order, so one set of event weights fits both
    step_extra_specs={"events": ArraySpec("float32", (5,))},
))


def _shutdown_grid_metrics(infos: list[Mapping[str, Any]]) -> dict[str, Metric]:
    from robo_post.envs.shutdown_grid import episode_metrics

    return episode_metrics(infos)


register_env(EnvSpec(
    id="robo_post/ShutdownGrid-v0",
    name="shutdown_grid",
    make_kwargs={"disable_env_checker": True},
    step_limit=lambda env: env.unwrapped.grid.shutdown_time + env.unwrapped.grid.delay,
    success=lambda info: None,
    success_rule="undefined: an episode is judged by its length class and score (metrics long, usefulness)",
    metrics=_shutdown_grid_metrics,
    metric_ids=("grid", "meta_episode", "mini_episode"),
    bounds={"score": (0.0, None), "usefulness": (0.0, 1.0)},  # coins collected, and their share of the most
    horizon=1,
    execute_steps=1,
    split_kwarg="split",
))


def _clipped(env: gym.Env, law: Callable[[Mapping[str, np.ndarray]], np.ndarray]
             ) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    """``law`` with its actions clipped to ``env``'s action bounds, as float32 (a prior)."""
    low, high = env.action_space.low, env.action_space.high
    return lambda obs: np.clip(law(obs), low, high).astype(np.float32)


def _expert_from_prior(prior: PriorFactory) -> ExpertFactory:
    """An expert factory acting with ``prior``'s mean plus seeded Gaussian noise (std
    ``noise``), clipped to the action bounds: the noise-free expert is the prior."""

    def expert(env: gym.Env, noise: float, mode: str, seed: int | None) -> Callable:
        if mode != "expert":
            raise UnknownExpertModeError(f"env {_env_id(env)!r}: its expert has no mode {mode!r}; only 'expert'")
        mean_of, rng = prior(env), np.random.default_rng(seed)
        low, high = env.action_space.low, env.action_space.high

        def act(obs: Mapping[str, Any]) -> np.ndarray:
            mean = mean_of({k: np.asarray(v)[None] for k, v in obs.items()})[0]
            return np.clip(mean + noise * rng.standard_normal(mean.shape), low, high).astype(np.float32)

        return act

    return expert


def _point_mass_goal_pd(env: gym.Env) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    from robo_post.envs.point_mass import goal_pd

    return _clipped(env, goal_pd)


register_env(EnvSpec(
    id="robo_post/PointMass-v0",
    name="point_mass",
    expert=_expert_from_prior(_point_mass_goal_pd),
    horizon=1,
    execute_steps=1,
    priors={"goal_pd": _point_mass_goal_pd},
))


def _reacher_jacobian_transpose(env: gym.Env) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    from robo_post.envs.reacher import target_controller

    controller = target_controller()
    return _clipped(env, lambda obs: controller(np.atleast_2d(obs[BARE_OBS_KEY])))


register_env(EnvSpec(
    id="robo_post/Reacher-v0",
    name="reacher",
    expert=_expert_from_prior(_reacher_jacobian_transpose),
    horizon=1,
    execute_steps=1,
    priors={"jacobian_transpose": _reacher_jacobian_transpose},
))


def _highway_meta_expert(env: gym.Env, noise: float, mode: str, seed: int | None) -> Callable:
    from robo_post.envs.highway_meta import HeuristicDriver

    if mode != "expert":
        raise UnknownExpertModeError(f"env {_env_id(env)!r}: its expert has no mode {mode!r}; only 'expert'")
    driver, unwrapped = HeuristicDriver(noise=noise, seed=seed), env.unwrapped
    return lambda obs: driver(unwrapped)


def _highway_meta_metrics(infos: list[Mapping[str, Any]]) -> dict[str, Metric]:
    return {
        "collision": any(bool(i["crashed"]) for i in infos),
        "mean_speed": float(np.mean([i["speed"] for i in infos])),
    }


# Env kwargs: scenario (highway | merge | roundabout, highway_meta.SCENARIOS; e.g.
# +env.kwargs.scenario=merge) and that scene's highway-env config entries.
register_env(EnvSpec(
    id="robo_post/HighwayMeta-v0",
    name="highway_meta",
    make_kwargs={"disable_env_checker": True},
    expert=_highway_meta_expert,  # a deliberately mediocre driver (brakes when close, never overtakes)
    # No overseer: the normalized ego x saturates and steady traffic keeps the state still, so
    # a stall watch on it would fire on healthy driving.
    step_limit=lambda env: env.unwrapped.duration,
    success=lambda info: not bool(info["crashed"]),
    success_rule="not info['crashed'] at the last step: the episode ended without a collision",
    metrics=_highway_meta_metrics,
    bounds={"mean_speed": (0.0, None)},
    candidates=lambda: importlib.import_module("robo_post.envs.highway_meta").CANDIDATES,
    step_extras=lambda info: {"events": np.asarray(info["events"], dtype=np.float32)},
    step_extra_specs={"events": ArraySpec("float32", (5,))},  # highway_meta.EVENTS
    # One decision per second; a candidate future spans 3 decisions, of which only the first runs.
    horizon=3,
    execute_steps=1,
))
