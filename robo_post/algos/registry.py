"""The method registry: every training method, selectable by name (``algo=``).

A method is a registration, not a fork of the learner. Each entry gives

- ``config``: a dataclass of its hyperparameters (hydra's ``algo.*`` keys fill it);
- ``build(config, data, device, reference) -> Method``: its networks and optimisers,
  sized from ``DataSpec`` (feature spec, action spec, statistics measured from the
  training data) and, when ``needs_reference``, a published policy to start from;
- ``driver``: the loop that runs it (``robo_post.learner.drivers``): ``off_policy``
  (updates on snapshot windows: BC, DIVL+QAM, IQL+QAM, FQL), or a driver a method
  registers for itself (on-policy rollouts through the fleet, steering of a frozen
  actor, an SB3 agent's ``learn``).

A built method follows the ``Method`` protocol: ``modules`` and ``optimizers`` (what
a checkpoint holds), ``update(batch) -> metrics`` (0-d tensors left on the method's
device: the loop reads them once per log window, so an update never waits on the
device), ``policy`` (the module that acts)
and ``artifact(**provenance)`` (what the policy registry publishes).
``docs/adding_a_method.md`` walks through a registration.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from robo_post.algos.actor_critic import PAIRS, ActorCritic, ActorCriticConfig
from robo_post.algos.bc_flow import BCFlow, BCFlowConfig
from robo_post.algos.categorical_bc import CategoricalBC, CategoricalBCConfig
from robo_post.algos.craft import Craft, CraftConfig
from robo_post.algos.drest import DReSTAgent, DReSTConfig
from robo_post.algos.gaussian_bc import GaussianBC, GaussianBCConfig
from robo_post.algos.sb3_agent import SB3Agent, SB3AgentConfig
from robo_post.models.features import Feature
from robo_post.models.candidate_policy import CandidatePolicy
from robo_post.models.categorical import CategoricalPolicyConfig
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig
from robo_post.models.gaussian import GaussianPolicyConfig
from robo_post.models.proposal_policy import ProposalPolicy


class UnknownMethodError(ValueError):
    """``algo=`` names no registered method."""


@dataclass
class DataSpec:
    """What a method is built for, read from the store schema and measured on the training data.

    Attributes:
        features: observation key -> ``Feature`` the model reads.
        action_dim / action_low / action_high: one action's size and bounds (env units).
        discrete_actions: the store's actions are integers (a Discrete space).
        use_text: the model reads the episode instruction.
        horizon / execute_steps: action-chunk length and actions executed open-loop.
        state_mean / state_std: statistics of the concatenated state keys.
        value_range: (low, high) of the discounted returns-to-go in the data, with a margin.
        return_span: high - low of those returns-to-go without the margin (0 included).
        gamma: per-step discount.
    """

    features: dict[str, Feature]
    action_dim: int
    action_low: list[float]
    action_high: list[float]
    discrete_actions: bool
    use_text: bool
    horizon: int
    execute_steps: int
    state_mean: np.ndarray
    state_std: np.ndarray
    value_range: tuple[float, float]
    return_span: float
    gamma: float


class Method(Protocol):
    """What every built method provides to its driver."""

    modules: dict[str, torch.nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    policy: torch.nn.Module

    def update(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]: ...

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...


Builder = Callable[[Any, DataSpec, torch.device, "FlowPolicy | None"], Method]


@dataclass(frozen=True)
class MethodSpec:
    """A registered method (see the module docstring)."""

    name: str
    config: type
    build: Builder
    driver: str = "off_policy"
    needs_reference: bool = False
    description: str = ""
    model_keys: tuple[str, ...] = ("embed_dim", "hidden_dim", "flow_steps", "deterministic", "mode_draws", "predicts")  # train's model.* keys it takes

    def make_config(self, values: dict[str, Any]) -> Any:
        """The typed config from ``algo.*`` values; unknown keys, and values of another type than
        a field's annotation (``float``, ``int``, ``bool``, ``str``, lists, dicts, ``X | None``),
        are an error naming them. A plugin's keys have no YAML default for the command line to
        check them against, so a string rate failed deep in training."""
        names = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"algo={self.name}: unknown settings {unknown}; known: {sorted(names)}")
        hints = typing.get_type_hints(self.config)
        for key, value in values.items():
            if not _has_type(value, hints[key]):
                raise ValueError(f"algo={self.name}: algo.{key}={value!r} is not allowed; expected "
                                 f"{_type_name(hints[key])}")
        return self.config(**values)


_SCALARS = {float: (int, float), int: (int,), bool: (bool,), str: (str,)}


def _has_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` (from YAML) fits ``hint``; annotations other than scalars, lists, tuples,
    dicts and their unions (``Any``, dataclasses) accept anything."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint in _SCALARS:  # a bool is an int to Python, not to a config
        return isinstance(value, _SCALARS[hint]) and (hint is bool or not isinstance(value, bool))
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length, a type per place
            return len(value) == len(args) and all(_has_type(v, a) for v, a in zip(value, args))
        return all(_has_type(v, args[0] if args else Any) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("NoneType", "None").replace("<class '", "").replace("'>", "")


METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Add a method to the registry (a later registration under the same name replaces it)."""
    METHODS[spec.name] = spec
    return spec


# Packages register methods by naming a module in this entry-point group; it is imported
# the first time an unknown name is looked up.
ENTRY_POINT_GROUP = "robo_post.methods"


def method_spec(name: str) -> MethodSpec:
    """The registered method ``name`` (installed plugins included)."""
    if name not in METHODS:
        from importlib.metadata import entry_points

        for entry in entry_points(group=ENTRY_POINT_GROUP):
            entry.load()
    if name not in METHODS:
        raise UnknownMethodError(f"unknown algo {name!r}; registered methods: {sorted(METHODS)}")
    return METHODS[name]


# --- built-in methods ----------------------------------------------------------------
class ActionSpaceError(ValueError):
    """The method cannot act in the store's kind of action (continuous vs integer)."""


def check_continuous(name: str, discrete_actions: bool, policy: str = "a flow policy") -> None:
    """Refuse integer actions for a method that acts over a Box, naming the methods that can."""
    if discrete_actions:
        raise ActionSpaceError(f"algo={name} trains {policy} over continuous (Box) actions; this store's actions "
                               "are integers (Discrete): use algo=categorical_bc (offline) or algo=sb3 (online, in "
                               "the env)")


def _build_bc_flow(config: BCFlowConfig, data: DataSpec, device: torch.device, reference: FlowPolicy | None) -> BCFlow:
    check_continuous("bc_flow", data.discrete_actions)
    model = FlowPolicyConfig(
        features=data.features, action_dim=data.action_dim, horizon=data.horizon, use_text=data.use_text,
        execute_steps=data.execute_steps, action_low=data.action_low, action_high=data.action_high, **config.model,
    )
    method = BCFlow(config, model, device)
    method.policy.set_state_stats(data.state_mean, data.state_std)
    return method


def _build_gaussian_bc(config: GaussianBCConfig, data: DataSpec, device: torch.device,
                       reference: FlowPolicy | None) -> GaussianBC:
    check_continuous("gaussian_bc", data.discrete_actions, "a Gaussian")
    model = GaussianPolicyConfig(features=data.features, action_dim=data.action_dim, use_text=data.use_text,
                                 action_low=data.action_low, action_high=data.action_high, **config.model)
    method = GaussianBC(config, model, device)
    method.policy.set_state_stats(data.state_mean, data.state_std)
    return method


def _build_categorical_bc(config: CategoricalBCConfig, data: DataSpec, device: torch.device,
                          reference: FlowPolicy | None) -> CategoricalBC:
    if not data.discrete_actions:
        raise ActionSpaceError("algo=categorical_bc clones integer (Discrete) actions; this store's actions are "
                               "continuous (Box): use algo=bc_flow or algo=gaussian_bc")
    model = CategoricalPolicyConfig(features=data.features, action_low=data.action_low, action_high=data.action_high,
                                    use_text=data.use_text, **config.model)
    method = CategoricalBC(config, model, device)
    method.policy.set_state_stats(data.state_mean, data.state_std)
    return method


def _actor_critic_builder(name: str) -> Builder:
    value_learner = PAIRS[name][0]

    def build(config: ActorCriticConfig, data: DataSpec, device: torch.device, reference: FlowPolicy | None) -> ActorCritic:
        check_continuous(name, data.discrete_actions)
        value = dict(config.value)
        if "v_min" in {f.name for f in dataclasses.fields(PAIRS[name][1])}:  # a categorical value's support
            value.setdefault("v_min", data.value_range[0])
            value.setdefault("v_max", data.value_range[1])
        return ActorCritic(name, reference, value, config.actor, config.critic_warmup, config.best_of_n, device,
                           config.critic)

    build.__doc__ = f"{value_learner.__name__} critic + actor from a published BC reference."
    return build


register_method(MethodSpec("bc_flow", BCFlowConfig, _build_bc_flow,
                           description="flow-matching behaviour cloning of action chunks"))
register_method(MethodSpec("gaussian_bc", GaussianBCConfig, _build_gaussian_bc,
                           description="maximum-likelihood BC of a diagonal-Gaussian actor (steerable; a learned prior)",
                           model_keys=("embed_dim", "hidden_dim")))
register_method(MethodSpec("categorical_bc", CategoricalBCConfig, _build_categorical_bc,
                           description="cross-entropy BC of a categorical actor over integer (Discrete) actions",
                           model_keys=("embed_dim", "hidden_dim")))
for _name, _description in (("divl_qam", "DIVL categorical value + QAM adjoint matching"),
                            ("iql_qam", "IQL expectile value + QAM adjoint matching"),
                            ("fql", "FQL's TD critic + one-step policy distilled from the BC flow")):
    register_method(MethodSpec(_name, ActorCriticConfig, _actor_critic_builder(_name), needs_reference=True,
                               description=_description))


def _build_sb3(config: SB3AgentConfig, data: DataSpec | None, device: torch.device, reference: FlowPolicy | None) -> SB3Agent:
    return SB3Agent(config, device=device)


register_method(MethodSpec("sb3", SB3AgentConfig, _build_sb3, driver="sb3",
                           description="a Stable-Baselines3 agent (PPO, A2C, SAC, ...) trained online in an env"))


def _build_drest(config: DReSTConfig, data: DataSpec | None, device: torch.device, reference: FlowPolicy | None
                 ) -> DReSTAgent:
    return DReSTAgent(config, device=device)


register_method(MethodSpec("drest", DReSTConfig, _build_drest, driver="sb3",
                           description="DReST: an SB3 agent on meta-episodes rewarded for choosing lengths evenly"))


def _build_craft(config: CraftConfig, data: DataSpec | None, device: torch.device,
                 reference: CandidatePolicy | ProposalPolicy | None) -> Craft:
    if not isinstance(reference, (CandidatePolicy, ProposalPolicy)):
        raise ValueError("algo=craft fine-tunes a candidate-scoring policy (artifact kind 'candidate' or 'proposal'): "
                         "a published one (algo.reference_version) or one its driver pre-trains from the store")
    return Craft(config, reference, device)


register_method(MethodSpec("craft", CraftConfig, _build_craft, driver="craft",
                           description="CRAFT: on-policy fine-tuning of a candidate-scoring policy (counterfactual "
                                       "proxy + grounded residual + EMA-teacher KL) through the fleet",
                           model_keys=("embed_dim", "hidden_dim")))
