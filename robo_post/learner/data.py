"""What an off-policy method trains on and is sized from.

The episodes of a snapshot a ``data`` filter selects, the ``DataSpec`` a method is built
for (features, normalisers, action bounds, value support), the published reference policy
a critic method starts from, and the windows a co-trained base imitates.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.algos.registry import DataSpec
from robo_post.models.features import infer_features, state_keys
from robo_post.models.flow import FlowPolicy
from robo_post.store import (EpisodeInfo, ImitationSampler, PolicyArtifactError, PolicyRegistry, Snapshot, Store,
                             StoreSchema, WindowSampler)

# Chunking for data of an env the environment registry does not know: a reactive
# controller that decides one action per step (an open-loop chunk cannot balance a
# pendulum, and predicting the later actions of a chunk slows BC several times).
GENERIC_HORIZON, GENERIC_EXECUTE = 1, 1
# Share of the value support's width added on each side of the data's return range.
VALUE_MARGIN = 0.1


class NoEpisodesError(ValueError):
    """The ``data`` filter selects no episode of the snapshot."""


def _listed(values: list[str], most: int = 8) -> str:
    return "[" + ", ".join(values[:most]) + (f", ... ({len(values)} in all)" if len(values) > most else "") + "]"


def select_episodes(snap: Snapshot, data: DictConfig) -> list[EpisodeInfo]:
    """Episodes of ``snap`` passing the ``data`` filter (tasks, success, roles, clients: a shard's
    exact id or the stem of several, ``demo`` for ``demo-0``, ``demo-1``, ...)."""
    roles = list(data.roles) if data.get("roles") else None
    episodes = snap.episodes(task=list(data.tasks) if data.tasks else None, success=data.success, role=roles)
    if data.get("clients"):
        episodes = [e for e in episodes if any(e.client_id == p or e.client_id.startswith(f"{p}-") for p in data.clients)]
    if not episodes:
        every = list(snap.episodes())
        unjudged = sum(e.success is None for e in every)
        labelled = {label: sum(e.success is label for e in every) for label in (True, False)}
        hint = (f"; {unjudged} episodes have no success label (their env or import rule defines none): "
                "data.success=null trains on them" if data.success is not None and unjudged
                else f"; none of its {labelled[False]} labelled episodes succeeded: data.success=null trains on "
                     "them all" if data.success is True and labelled[False] and not labelled[True] else "")
        held = {name: sorted({str(getattr(e, attr)) for e in every})
                for name, attr in (("tasks", "task_id"), ("roles", "role"), ("clients", "client_id"))}
        raise NoEpisodesError(f"no episodes in snapshot {snap.id} match the data filter "
                              f"{OmegaConf.to_container(data)}{hint}; it holds {len(every)} episodes of "
                              + ", ".join(f"{name} {_listed(values)}" for name, values in held.items()))
    return episodes


def _recorded_env(schema: StoreSchema):
    """The environment registry's entry for the env the store was recorded in, if it knows it."""
    from robo_post.envs.registry import UnknownEnvError, env_spec

    name = schema.attrs.get("env")
    try:
        return env_spec(name) if name else None
    except UnknownEnvError:
        return None


def chunk_defaults(schema: StoreSchema) -> tuple[int, int]:
    """(horizon, execute_steps) for data recorded in the env named by the store's schema."""
    spec = _recorded_env(schema)
    return (spec.horizon, spec.execute_steps) if spec is not None else (GENERIC_HORIZON, GENERIC_EXECUTE)


def return_bounds(returns_to_go: np.ndarray) -> tuple[float, float]:
    """Lowest and highest discounted return-to-go in the data, 0 (the value past an end) included."""
    return min(0.0, float(returns_to_go.min())), max(0.0, float(returns_to_go.max()))


def value_range(returns_to_go: np.ndarray) -> tuple[float, float]:
    """Support for a categorical value: the data's return bounds widened by ``VALUE_MARGIN``
    of their span on each side."""
    lo, hi = return_bounds(returns_to_go)
    pad = VALUE_MARGIN * max(hi - lo, 1e-6)
    return lo - pad, hi + pad


def measure(schema: StoreSchema, sampler: WindowSampler, model: DictConfig, gamma: float,
            reference: FlowPolicy | None) -> DataSpec:
    """The ``DataSpec`` a method is built for: from the reference policy when there is one
    (its features and normalisers), else from the store schema and the sampler's data."""
    action = schema.action
    discrete = np.dtype(action.dtype).kind in "iu"
    if not discrete and len(action.shape) != 1:  # the sampler and the policies carry actions as (A,) vectors
        raise ValueError(f"this store's actions are a Box of shape {tuple(action.shape)}; flow and Gaussian "
                         "policies act in a flat action vector, a Box of shape (A,)")
    # One integer per discrete dimension: 1 for Discrete, n for MultiDiscrete (shape (n,))
    shape = action.shape if not discrete else (int(np.prod(action.shape)),)
    low = np.broadcast_to(action.low if action.low is not None else -1.0, shape).astype(float)
    high = np.broadcast_to(action.high if action.high is not None else 1.0, shape).astype(float)
    if not discrete and not (np.isfinite(low).all() and np.isfinite(high).all()):
        # An unbounded Box (common in imported datasets): the policy's [-1, 1] maps onto the data's range.
        seen_low, seen_high = (np.broadcast_to(v, shape).astype(float) for v in sampler.action_range())
        flat = seen_high - seen_low < 1e-6
        low = np.where(np.isfinite(low), low, seen_low - flat)
        high = np.where(np.isfinite(high), high, seen_high + flat)
    low, high = list(low), list(high)
    returns = sampler.returns_to_go()
    v_range, (lo, hi) = value_range(returns), return_bounds(returns)
    if reference is not None:
        c = reference.config
        return DataSpec(c.features, c.action_dim, c.action_low, c.action_high, discrete, c.use_text, c.horizon,
                        c.execute_steps or c.horizon, reference.encoder.state_mean.cpu().numpy(),
                        reference.encoder.state_std.cpu().numpy(), v_range, hi - lo, gamma)
    env = _recorded_env(schema)
    overrides = {k: v for k, v in (env.features if env is not None else {}).items() if k in schema.observations}
    if model.get("features"):
        overrides |= OmegaConf.to_container(model.features, resolve=True)
    features = infer_features(schema.observations, overrides, use_images=model.use_images)
    keys = state_keys(features)
    if keys:
        stats = [sampler.obs_stats(k) for k in keys]
        mean = np.concatenate([m.reshape(-1) for m, _ in stats])
        std = np.concatenate([s.reshape(-1) for _, s in stats])
    else:
        mean = std = np.zeros(0)
    use_text = model.use_text
    if use_text == "auto":  # language helps only when the data has more than one instruction
        use_text = len({e.instruction for e in sampler.episodes if e.instruction}) > 1
    horizon, execute = sampler.horizon, model.execute_steps or chunk_defaults(schema)[1]
    return DataSpec(features, int(np.prod(shape)), low, high, discrete, bool(use_text), horizon, min(execute, horizon),
                    mean, std, v_range, hi - lo, gamma)


def load_reference(store: Store, version: int | None, device: torch.device) -> tuple[FlowPolicy, int]:
    """The published flow policy a method starts from (``version``; default the first flow
    version: a store may also hold Gaussian or SB3 versions)."""
    from robo_post.models.ranked import FLOW_KINDS, flow_of

    registry = PolicyRegistry(store.root)
    kinds = {}
    for v in [version] if version else registry.versions():
        try:
            weights, config = registry.load(v)
        except PolicyArtifactError as e:
            raise PolicyArtifactError(f"{e}; set algo.reference_version to an intact flow version") from None
        if config.get("kind") in FLOW_KINDS:
            # a newer version trained the same way (BC again) is what a user may have meant
            alike = ("kind", "algorithm")
            later = [] if version else [u for u in registry.versions() if u > v and [
                (registry.peek_config(u) or {}).get(k) for k in alike] == [config.get(k) for k in alike]]
            if later:
                print(f"starting from flow version {v}, the first {config.get('algorithm', 'flow')} version; later "
                      f"ones: {later} (reference_version={later[-1]} starts from the newest)", file=sys.stderr)
            return flow_of(weights, config).to(device), v
        kinds[v] = config.get("kind")
    if not kinds:
        raise ValueError(f"this method starts from a published (BC) policy, but the registry of {store.root} is empty; "
                         "train one first with `robo-post train algo=bc_flow`")
    found = ", ".join(f"version {v} is a {k!r} policy" for v, k in kinds.items())
    raise ValueError(f"this method starts from a published flow policy (algo=bc_flow), but in {store.root} {found}; "
                     "train one with `robo-post train algo=bc_flow` or set algo.reference_version to a flow version")


def imitation_sampler(config: Any, method: Any, samplers: list[WindowSampler], seed: int) -> ImitationSampler | None:
    """What a co-trained base imitates (``algo.imitation``): successful episodes of the
    demonstration roles and every intervention step, among the samplers' windows."""
    imitation = getattr(config, "imitation", None)
    if not imitation or not imitation.get("enabled"):
        return None
    if getattr(getattr(method, "actor", None), "bc", None) is None:
        raise ValueError("algo.imitation.enabled needs a co-trained base to imitate with: set algo.actor.base="
                         "ema_cotrained (lwd.actor.base=ema_cotrained in `robo-post run`)")
    roles = tuple(imitation.get("roles", ["demo"]))
    return ImitationSampler(samplers, lambda e: bool(e.success) and e.role in roles, seed=seed)


def add_imitation(batch: dict, imitation: ImitationSampler | None, batch_size: int) -> dict:
    return batch if imitation is None else {**batch, "imitation": imitation.sample(batch_size)}
