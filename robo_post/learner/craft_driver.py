"""The on-policy driver of candidate-scoring methods (``algo=craft``): through the fleet and the store.

One ``robo-post train algo=craft store=S`` run:

The policy kind follows the env (``algo.candidates=auto``): an env whose registry entry
gives a candidate vocabulary gets a ``CandidatePolicy`` scoring it; an env with a
continuous (Box) action a ``ProposalPolicy`` whose K sampled action chunks are the
candidates (``algo.n_proposals``, ``algo.horizon``, ``algo.min_std``).

1. **Pretrain** (unless ``algo.reference_version``): behaviour-clone the policy on the
   store's episodes (e.g. a heuristic driver recorded by ``robo-post collect``). A
   ``CandidatePolicy``: the target of each step is the first vocabulary entry that
   starts with the executed action (kind ``candidate``). A ``ProposalPolicy``: maximum
   likelihood of the H-step action chunk that starts at each step, padded past the
   episode's end with its last action (kind ``proposal``).
2. **Iterate**: publish the student (sampling) -> the fleet's clients run
   ``episodes_per_iteration`` episodes pinned to that version into the online store
   (``<store>-online``), recording per step the logits it sampled from (with
   ``algo.explore_eps``, the mixture with the proxy's best candidate) and the chosen index (and a
   proposal policy's sampled ``candidates``), the env's candidate proxy scores and
   events as store extras -> the learner reads
   them from a snapshot, computes group advantages and grounded residuals over the
   whole batch (with ``algo.baseline=evpo``, against the critic's values at the batch's
   states before the update when its explained variance allows, else the batch mean) and
   runs ``epochs`` of minibatch updates -> next version.
3. **Publish** the final student acting greedily (argmax; a proposal policy: its mean
   chunk), for evaluation and deployment.

A killed run resumes after its last finished iteration (checkpoint: student, teacher,
optimisers, iteration, and the critic with ``baseline=evpo``); episodes already recorded
for the next version are reused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.algos.craft import (PROXY_NORMS, CraftConfig, CraftConfigError, ScoringPolicy, bc_pretrain,
                                   candidate_logits, chunk_bc_pretrain, event_mask, event_returns, fit_minibatches,
                                   grounded_advantage, group_advantages, guard_targets, residual_for_batch, take_rows,
                                   veto_targets)
from robo_post.algos.registry import MethodSpec
from robo_post.envs.registry import env_spec
from robo_post.eval.rollout import check_observations
from robo_post.fleet.client import ClientConfig, recorded_env_kwargs, store_schema
from robo_post.learner.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from robo_post.learner.data import select_episodes
from robo_post.learner.loop import truncate_log
from robo_post.learner.publish import publish_once
from robo_post.learner.runs import begin_run, check_resume, finished_run
from robo_post.models.candidate_policy import CandidatePolicy, CandidatePolicyConfig
from robo_post.models.features import infer_features, state_keys
from robo_post.models.proposal_policy import ProposalPolicy, ProposalPolicyConfig
from robo_post.store.integrity import warn_lost_shards
from robo_post.store.registry import PolicyArtifactError, PolicyRegistry
from robo_post.store.sampler import WindowSampler
from robo_post.store.schema import ArraySpec, StoreSchema
from robo_post.store.store import EpisodeInfo, Snapshot, Store
from robo_post.utils.device import resolve_device
from robo_post.utils.io import write_json_atomic

EXTRAS = ("logits", "chosen", "proxy_scores", "events")
CLIENT_PREFIX = "craft"  # the fleet clients' ids in the online store: craft-0, craft-1, ...
STATE_FILE = "craft_state.json"  # in the run dir: the pretrained version, the iteration, the acting version
POLICY_CLASSES = {"candidate": CandidatePolicy, "proposal": ProposalPolicy}  # artifact kind -> class


class CraftDataError(ValueError):
    """The store or env cannot train a candidate-scoring policy (no vocabulary and no continuous action,
    no events, no data, actions that do not fit the env)."""


def _vocabulary(env: str) -> list[list[int]]:
    spec = env_spec(env)
    if spec.candidates is None:
        raise CraftDataError(f"env {env!r} has no candidate vocabulary (its registry entry sets none); "
                             "algo=craft needs an env whose registry entry gives `candidates`")
    return [list(map(int, c)) for c in spec.candidates()]


def policy_kind(env: str, config: CraftConfig) -> str:
    """The artifact kind ``algo.candidates`` asks of ``env``: ``candidate`` (vocabulary) or ``proposal``."""
    has_vocabulary = env_spec(env).candidates is not None
    if config.candidates == "vocabulary" or (config.candidates == "auto" and has_vocabulary):
        return "candidate"
    return "proposal"


def proposal_action(env_schema: StoreSchema, data_schema: StoreSchema, env: str) -> ArraySpec:
    """The env's action spec, checked for proposals: continuous, finite bounds, as the store's actions.

    Raises:
        CraftDataError: discrete actions (proposals are continuous chunks), unbounded actions, or
            store actions of another dtype kind or shape than the env's.
    """
    action = env_schema.action
    if env_schema.action_is_discrete:
        raise CraftDataError(f"algo.candidates=proposals samples continuous action chunks, but env {env!r} has discrete "
                             "actions and no candidate vocabulary in its registry entry")
    if data_schema.action_is_discrete or tuple(data_schema.action.shape) != tuple(action.shape):
        raise CraftDataError(f"the store's actions ({data_schema.action.dtype}, shape {data_schema.action.shape}) do "
                             f"not match env {env!r}'s ({action.dtype}, shape {action.shape})")
    bounds = [np.broadcast_to(np.asarray(b if b is not None else np.inf, np.float64), action.shape)
              for b in (action.low, action.high)]
    if not all(np.isfinite(b).all() for b in bounds):
        raise CraftDataError(f"env {env!r}'s action bounds are not finite ({action.low}, {action.high}); a proposal "
                             "policy works in actions normalised by them")
    return action


def _event_weights(env: str, weights: list[float]) -> np.ndarray:
    """``algo.event_weights`` checked against the events the env reports per step."""
    spec = env_spec(env).step_extra_specs.get("events")
    if spec is None:
        raise CraftDataError(f"env {env!r} reports no per-step `events` (its registry entry's step_extras); "
                             "the grounded residual needs them")
    n = int(np.prod(spec.shape))
    if len(weights) != n:
        raise CraftDataError(f"algo.event_weights={list(weights)} has {len(weights)} weights; env {env!r} reports "
                             f"{n} events per step")
    return np.asarray(weights, dtype=np.float32)


def check_env(config: CraftConfig, env: str) -> None:
    """What ``algo=craft`` needs of the registry entry of ``env`` (or ``algo.env``): a candidate
    vocabulary when the policy scores one, and per-step events that ``algo.event_weights`` fits.

    Raises:
        CraftDataError: naming what the env lacks.
    """
    env = config.env or env
    if policy_kind(env, config) == "candidate":
        _vocabulary(env)
    _event_weights(env, config.event_weights)


def load_episodes(snap, episodes) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray], list[int]]:
    """Observations (without the final one), actions and extras of ``episodes``, concatenated, and their lengths."""
    loaded = [snap.load(e) for e in episodes]
    obs = {k: np.concatenate([d["obs"][k][:-1] for d in loaded]) for k in loaded[0]["obs"]}
    actions = np.concatenate([d["action"] for d in loaded])
    extras = {k: np.concatenate([d["extras"][k] for d in loaded]) for k in loaded[0]["extras"]}
    return obs, actions, extras, [len(d["action"]) for d in loaded]


def pretrain(snap: Snapshot, cfg: DictConfig, config: CraftConfig, vocabulary: list[list[int]]) -> CandidatePolicy:
    """Behaviour-clone candidate indices from a snapshot's episodes (``data.*`` filters apply)."""
    store = snap.store
    episodes = select_episodes(snap, cfg.data)
    obs, actions, _, _ = load_episodes(snap, episodes)
    first = {}
    for k, c in enumerate(vocabulary):
        first.setdefault(c[0], k)  # the first entry that starts with each action
    unknown = sorted(set(np.unique(actions).tolist()) - set(first))
    if unknown:
        raise CraftDataError(f"actions {unknown} in the data start no candidate of the vocabulary {vocabulary}")
    target = torch.as_tensor([first[int(a)] for a in actions.reshape(-1)])
    features = infer_features(store.schema.observations, OmegaConf.to_container(cfg.model.features, resolve=True)
                              if cfg.model.get("features") else None, use_images=cfg.model.use_images)
    policy = CandidatePolicy(CandidatePolicyConfig(features=features, n_candidates=len(vocabulary),
                                                   candidates=vocabulary, **config.model))
    keys = state_keys(features)
    if keys:
        states = np.concatenate([obs[k].reshape(len(target), -1) for k in keys], axis=1)
        policy.set_state_stats(states.mean(0), states.std(0))
    batch = {k: torch.as_tensor(obs[k]) for k in features}
    stats = bc_pretrain(policy, batch, target, config.bc_updates, config.bc_lr, config.bc_minibatch,
                        generator=torch.Generator().manual_seed(cfg.seed), label_smoothing=config.bc_label_smoothing)
    print(f"craft pretraining: {len(target)} steps from {len(episodes)} episodes, "
          f"accuracy {stats['accuracy']:.3f}", flush=True)
    return policy.eval()


def pretrain_proposals(snap: Snapshot, cfg: DictConfig, config: CraftConfig, horizon: int, action: ArraySpec
                       ) -> ProposalPolicy:
    """Behaviour-clone a proposal policy by maximum likelihood of a snapshot's H-step action chunks
    (``data.*`` filters apply; past an episode's end its last action is repeated)."""
    store = snap.store
    episodes = select_episodes(snap, cfg.data)
    features = infer_features(store.schema.observations, OmegaConf.to_container(cfg.model.features, resolve=True)
                              if cfg.model.get("features") else None, use_images=cfg.model.use_images)
    sampler = WindowSampler.from_snapshot(snap, episodes, horizon=horizon, obs_keys=list(features))
    windows = sampler.sample(len(sampler), starts=np.arange(len(sampler)))
    dim = int(np.prod(action.shape))
    chunks = windows["actions"].float().reshape(len(sampler), horizon, dim)
    low, high = (np.broadcast_to(np.asarray(b, np.float64), action.shape).reshape(-1).tolist()
                 for b in (action.low, action.high))
    policy = ProposalPolicy(ProposalPolicyConfig(features=features, action_dim=dim, horizon=horizon,
                                                 n_candidates=config.n_proposals, action_low=low, action_high=high,
                                                 min_std=config.min_std, **config.model))
    keys = state_keys(features)
    if keys:
        states = np.concatenate([windows["obs"][k].numpy().reshape(len(sampler), -1) for k in keys], axis=1)
        policy.set_state_stats(states.mean(0), states.std(0))
    batch = {k: windows["obs"][k] for k in features}
    stats = chunk_bc_pretrain(policy, batch, chunks, config.bc_updates, config.bc_lr, config.bc_minibatch,
                              generator=torch.Generator().manual_seed(cfg.seed))
    print(f"craft pretraining: {len(sampler)} chunks of {horizon} actions from {len(episodes)} episodes, "
          f"nll {stats['nll']:.3f}, mean-chunk error {stats['mae']:.3f}", flush=True)
    return policy.eval()


def load_policy(registry: PolicyRegistry, version: int, kind: str) -> ScoringPolicy:
    """Published version ``version`` as the policy class of artifact ``kind``.

    Raises:
        CraftDataError: the version is a policy of another kind.
    """
    weights, artifact = registry.load(version)
    if artifact.get("kind") != kind:
        raise CraftDataError(f"version {version} is a {artifact.get('kind')!r} policy; this env's algo=craft "
                             f"fine-tunes a {kind!r} policy")
    return POLICY_CLASSES[kind].from_artifact(weights, artifact)


def online_store(root: str, env: str, env_kwargs: dict[str, Any], k: int, oracle: bool = False,
                 candidate_shape: tuple[int, ...] | None = None, task: str | None = None) -> Store:
    """The store the fleet records on-policy episodes into, with the candidate extras
    (and the oracle's scores of every candidate with ``oracle``; a proposal policy's
    sampled ``candidates`` (K, *candidate_shape) with ``candidate_shape``)."""
    spec = env_spec(env)
    schema = store_schema({"name": env, **env_kwargs}, task)
    extras = {"logits": ArraySpec("float32", (k,)), "chosen": ArraySpec("int64", ()),
              "proxy_scores": ArraySpec("float32", (k,)), **spec.step_extra_specs}
    if oracle:
        extras["oracle_scores"] = ArraySpec("float32", (k,))
    if candidate_shape is not None:
        extras["candidates"] = ArraySpec("float32", (k, *candidate_shape))
    return Store.create(root, dataclasses.replace(schema, extras=extras), exist_ok=True)


def on_policy_batch(config: CraftConfig, obs: dict[str, np.ndarray], extras: dict[str, np.ndarray],
                    lengths: list[int], event_weights: np.ndarray,
                    critic: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The update batch of one iteration and its baseline statistics.

    Proxy advantages (``config.proxy_norm``), residuals over the whole batch; a proposal policy's recorded
    ``candidates`` extra travels in the batch as ``candidates``. With ``baseline=evpo``,
    ``critic`` maps the batch's observations to values (B,) before any update of this
    iteration (the values "at collection time"); the residual's baseline is then chosen
    by their explained variance, the batch carries the event returns as ``event_return``
    (the critic's target), and the statistics are ``evpo_ev`` (``None`` when undefined)
    and ``evpo_gate`` (1 critic, 0 batch mean). With ``floor_margin`` the batch carries
    ``floored`` (B,), the states the floor applies to, and the statistics their share (``floored``).

    Raises:
        CraftConfigError: ``baseline=evpo`` without a ``critic``.
    """
    if config.baseline == "evpo" and critic is None:
        raise CraftConfigError("craft baseline='evpo' needs the critic's values: pass on_policy_batch a critic")
    scores = torch.as_tensor(extras["proxy_scores"], dtype=torch.float32)
    proxy_adv = PROXY_NORMS[config.proxy_norm](scores, config.adv_eps)
    chosen = torch.as_tensor(extras["chosen"], dtype=torch.long)
    rewards = torch.as_tensor(extras["events"] @ event_weights, dtype=torch.float32)
    # negatively weighted entries are the interaction-critical events of mode `event`'s mask; a
    # positively weighted one (progress) is paid every step and would mark every window
    penalties = torch.as_tensor(extras["events"] @ np.minimum(event_weights, 0.0), dtype=torch.float32)
    returns, mask, start = [], [], 0
    for n in lengths:  # windows never cross an episode boundary
        returns.append(event_returns(rewards[start:start + n], config.gamma_event, config.window))
        mask.append(event_mask(penalties[start:start + n], config.window))
        start += n
    G = torch.cat(returns)
    batch_obs = {k: torch.as_tensor(v) for k, v in obs.items()}
    V = critic(batch_obs) if config.baseline == "evpo" else None
    advantage, ev, use_critic = grounded_advantage(G, V, config.evpo_threshold, config.adv_eps)
    # without the proxy term there is no proxy for the residual to correct: mode cv is then plain
    # REINFORCE on the grounded advantage (the residual-only ablation), not z(G) - A~[k*]
    corrected = proxy_adv if config.use_proxy else torch.zeros_like(proxy_adv)
    delta = residual_for_batch(advantage, corrected, chosen, config.residual_mode, torch.cat(mask))
    old_logits = torch.as_tensor(extras["logits"], dtype=torch.float32)
    batch = {"obs": batch_obs, "proxy_adv": proxy_adv, "chosen": chosen, "old_logits": old_logits, "delta": delta}
    if config.floor_margin is not None:  # the states where the policy heads into what the proxy sees coming
        first = scores.gather(-1, old_logits.argmax(-1, keepdim=True))[:, 0]
        batch["floored"] = scores.max(-1).values - first > config.floor_margin
    if "candidates" in extras:  # a proposal policy's sampled chunks, which its logits score
        batch["candidates"] = torch.as_tensor(extras["candidates"], dtype=torch.float32)
    stats = {"floored": float(batch["floored"].float().mean())} if "floored" in batch else {}
    if V is None:
        return batch, stats
    return batch | {"event_return": G}, stats | {"evpo_ev": None if math.isnan(ev) else ev, "evpo_gate": int(use_critic)}


def of_registry(episodes: list[EpisodeInfo], registry: PolicyRegistry) -> list[EpisodeInfo]:
    """Those of ``episodes`` recorded by versions of ``registry``: an online store shared by runs
    on several stores holds versions whose numbers mean other policies here. Episodes recorded
    before clients named their policy store count as this registry's."""
    root = os.path.realpath(os.path.dirname(registry.location))
    stores = {e.attrs.get("policy_store") for e in episodes} - {None}
    others = {s for s in stores if os.path.realpath(s) != root}
    return [e for e in episodes if e.attrs.get("policy_store") not in others]


def run_episodes(snap: Snapshot, registry: PolicyRegistry, run_dir: str) -> list[EpisodeInfo]:
    """The episodes of ``snap`` that this run's acting versions recorded (an online store may
    also hold other runs', on this store or another)."""
    episodes = of_registry(snap.episodes(), registry)
    configs = {v: registry.peek_config(v) or {} for v in {e.policy_version for e in episodes}}
    mine = {v for v, c in configs.items() if (c.get("phase"), c.get("run_dir")) == ("online", os.path.abspath(run_dir))}
    return [e for e in episodes if e.policy_version in mine]


def _states(obs: dict[str, np.ndarray], extras: dict[str, np.ndarray]) -> dict[str, Any]:
    """Recorded states as tensors: ``obs`` and, for a proposal policy, the ``candidates`` its logits score."""
    states: dict[str, Any] = {"obs": {k: torch.as_tensor(v) for k, v in obs.items()}}
    if "candidates" in extras:
        states["candidates"] = torch.as_tensor(extras["candidates"], dtype=torch.float32)
    return states


def veto_fit(policy: ScoringPolicy, config: CraftConfig, snap: Snapshot, registry: PolicyRegistry, run_dir: str,
             seed: int) -> dict[str, int]:
    """``config.veto_updates`` steps of cross-entropy of ``policy`` (in place) toward
    ``veto_targets`` of its own distribution on every state this run recorded; returns how many
    states and how many of them had a candidate vetoed."""
    episodes = run_episodes(snap, registry, run_dir)
    if not episodes:
        return {"veto_states": 0, "vetoed_states": 0}
    obs, _, extras, _ = load_episodes(snap, episodes)
    batch = _states(obs, extras)
    with torch.no_grad():
        logits = candidate_logits(policy, batch["obs"], batch.get("candidates"))
    vetoed, target = veto_targets(torch.as_tensor(extras["proxy_scores"], dtype=torch.float32), logits.float().cpu(),
                                  config.veto_danger, config.veto_margin)

    def cross_entropy(index: torch.Tensor) -> torch.Tensor:
        rows = take_rows(batch, index)
        log_pi = candidate_logits(policy, rows["obs"], rows.get("candidates")).log_softmax(-1)
        return -(target[index].to(log_pi.device) * log_pi).sum(-1).mean()

    fit_minibatches(policy, len(target), cross_entropy, config.veto_updates, config.bc_lr, config.bc_minibatch,
                    config.grad_clip, torch.Generator().manual_seed(seed))
    return {"veto_states": len(target), "vetoed_states": int(vetoed.any(-1).sum())}


def guard_batch(config: CraftConfig, snap: Snapshot, registry: PolicyRegistry, run_dir: str) -> dict[str, Any] | None:
    """The guard term's states (``obs``, ``target``, a proposal policy's ``candidates``) and how
    many are critical: every state (``guard_targets``) of the episodes this run's acting
    versions recorded so far, all iterations'. None when there is no critical one or the term is off."""
    if config.guard_weight <= 0:
        return None
    episodes = run_episodes(snap, registry, run_dir)
    if not episodes:
        return None
    obs, _, extras, _ = load_episodes(snap, episodes)
    critical, target = guard_targets(torch.as_tensor(extras["proxy_scores"], dtype=torch.float32),
                                     torch.as_tensor(extras["logits"], dtype=torch.float32),
                                     config.guard_tau, config.guard_margin, config.guard_danger)
    if not critical.any():
        return None
    return _states(obs, extras) | {"target": target, "critical": int(critical.sum())}


def proxy_oracle_correlation(extras: dict[str, np.ndarray], eps: float = 1e-5) -> float | None:
    """Mean per-state correlation of the proxy's and the oracle's group advantages.

    ``extras`` holds ``proxy_scores`` and ``oracle_scores`` (T, K); ``None`` when the
    oracle's scores were not recorded or every state has a constant group.
    """
    if "oracle_scores" not in extras:
        return None
    a = group_advantages(torch.as_tensor(np.asarray(extras["proxy_scores"])), eps)
    b = group_advantages(torch.as_tensor(np.asarray(extras["oracle_scores"])), eps)
    keep = (a.abs().sum(-1) > 0) & (b.abs().sum(-1) > 0)  # constant groups have no direction
    if not bool(keep.any()):
        return None
    return float(((a[keep] * b[keep]).mean(-1)).mean())  # both have unit population std


def _run_state(path: str) -> dict[str, Any]:
    """The run's progress file (pretrained version, iteration, acting version); a fresh run's when absent."""
    if not os.path.exists(path):
        return {"iteration": 0}
    try:
        with open(path) as f:
            state = json.load(f)
        if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
            raise ValueError("no integer 'iteration'")
        for key in ("pretrained_version", "acting_version", "updates"):
            if key in state and not isinstance(state[key], int):
                raise ValueError(f"{key} is {state[key]!r}, not an integer")
    except ValueError as e:
        raise CraftDataError(f"run state {path} is unreadable ({e}); remove the run directory to start over") from e
    return state


def _published_acting(registry: PolicyRegistry, run_dir: str, iteration: int) -> int | None:
    """The acting version this run published for ``iteration`` when a kill kept it out of the state
    file (it is then the registry's newest), so a resumed run does not publish it twice."""
    latest = registry.latest()
    if latest is None:
        return None
    try:
        config = registry.load(latest)[1]
    except PolicyArtifactError:  # damaged since; publish_once publishes after it
        return None
    ours = (config.get("phase"), config.get("iteration"), config.get("run_dir")) == (
        "online", iteration, os.path.abspath(run_dir))
    return latest if ours else None


def _check_pretraining_env(where: str, schema: StoreSchema, config: CraftConfig, env: str, scene: dict) -> None:
    """Pretraining learns from the store's episodes: the store must have been recorded in ``env``
    (a store that names none is taken as is), and the fleet's env must observe and act as they did."""
    recorded_in = schema.attrs.get("env")
    if recorded_in is None:
        return
    if env_spec(env).key != recorded_in:
        raise CraftDataError(f"store {where} was recorded in env {recorded_in!r}, and CRAFT pretrains on its "
                             f"episodes to act in algo.env={config.env!r}: leave algo.env unset, or use a store "
                             "recorded in that env")
    check_observations(schema, store_schema({"name": env, **scene}, None), {"name": env_spec(env).key, **scene}, {},
                       hint="give algo.env_kwargs the kwargs they were collected with")


def _acting_version(method: Any, config: CraftConfig, registry: PolicyRegistry, online: Store, run_dir: str,
                    parent: int, iteration: int, seed: int) -> int:
    """The version the fleet samples from in ``iteration``: the one a killed run already published
    for it, else the student published now (sampling; vetoed first with ``algo.veto_acting``)."""
    acting = _published_acting(registry, run_dir, iteration)
    if acting is not None:
        return acting
    policy, veto = method.policy, {}
    if config.veto_acting and iteration > 0:  # so the run records the states the vetoed policy visits
        policy = copy.deepcopy(method.policy)
        veto = veto_fit(policy, config, online.snapshot(), registry, run_dir, seed + iteration)
    return registry.publish(*method.artifact(
        policy=policy, phase="online", iteration=iteration, parent_version=parent, deterministic=False,
        env_extras=True, explore_eps=config.explore_eps, explore_margin=config.explore_margin,
        run_dir=os.path.abspath(run_dir), **veto))


def _collect_iteration(config: CraftConfig, online: Store, registry: PolicyRegistry, policy_store: str, version: int,
                       iteration: int, env: str, env_kwargs: dict[str, Any], tasks: list[str], seed: int,
                       show: bool) -> None:
    """Run the fleet's clients on ``version`` (of ``registry``, the one of ``policy_store``) until the
    online store holds exactly ``algo.episodes_per_iteration`` episodes of it (a resumed iteration
    records only the rest)."""
    from robo_post.fleet.launcher import LocalLauncher, raise_unfinished

    share, extra = divmod(config.episodes_per_iteration, config.n_clients)  # exactly the episodes asked for
    configs = [ClientConfig(store=online.root, client_id=f"{CLIENT_PREFIX}-{j}", episodes=0,
                            env={"name": env, **env_kwargs},
                            tasks=tasks, policy={"kind": "random"}, follow_registry=False,
                            seed=seed + 1000 * (iteration + 1),
                            policy_store=policy_store, policy_version=version, role="online")
               for j in range(config.n_clients)]
    for j, c in enumerate(configs):  # resume: count what this version already recorded
        done = sum(e.policy_version == version for e in of_registry(online.shard_episodes(c.client_id), registry))
        c.episodes = len(online.shard_episodes(c.client_id)) + max(share + (j < extra) - done, 0)
    statuses = LocalLauncher(configs).run(show=show)
    raise_unfinished(statuses, "craft clients", online.root)


def _episode_metrics(episodes: list[EpisodeInfo], lengths: Any, extras: dict[str, Any],
                     adv_eps: float) -> dict[str, Any]:
    """An iteration's episodes in a metrics row: count, steps, mean return, collision rate,
    mean speed, and how well the env's proxy scores rank candidates as its oracle does."""
    return {"episodes": len(episodes), "steps": int(sum(lengths)), "episode_return": float(np.mean([e.ret for e in episodes])),
            "collision": float(np.mean([bool((e.attrs.get("metrics") or {}).get("collision")) for e in episodes])),
            "mean_speed": float(np.mean([(e.attrs.get("metrics") or {}).get("mean_speed", np.nan) for e in episodes])),
            "proxy_oracle_corr": proxy_oracle_correlation(extras, adv_eps)}


def craft(cfg: DictConfig, spec: MethodSpec) -> dict[str, Any]:
    """`robo-post train algo=craft`: pretraining, on-policy iterations through the fleet, a greedy final version."""
    with contextlib.ExitStack() as held:  # the online store's client ids, from before pretraining publishes
        return _craft(cfg, spec, held)


def _craft(cfg: DictConfig, spec: MethodSpec, held: contextlib.ExitStack) -> dict[str, Any]:
    from robo_post.fleet.collect import lock_client_ids

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    device = resolve_device(cfg.device)
    values = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
    values.setdefault("model", {k: cfg.model[k] for k in spec.model_keys if cfg.model.get(k) is not None})
    config: CraftConfig = spec.make_config(values)
    if (done := finished_run(cfg.run_dir, "iteration", config.iterations, cfg)) is not None:
        return done  # re-running a finished run publishes nothing
    # the pretrained version it recorded is in the run's store: another store must not resume it
    check_resume(cfg.run_dir, cfg, "iteration", config.iterations, "algo.iterations", progress=(STATE_FILE,))
    store = Store.open(cfg.store)
    snap = store.snapshot(cfg.data.snapshot)  # what pretraining learns from (data.snapshot pins it)
    env = config.env or store.schema.attrs.get("env")
    if env is None:
        raise CraftDataError(f"store {cfg.store} names no env; set algo.env")
    kind = policy_kind(env, config)
    event_weights = _event_weights(env, config.event_weights)
    # the scene the store's episodes were all recorded in (as `robo-post eval` runs it), with the
    # kwargs given on top: `+algo.env_kwargs.continuation=3` dropped the recorded lane features
    scene = (recorded_env_kwargs(store.root, env_spec(env)) or {}) | dict(config.env_kwargs)
    env_kwargs = scene | ({"oracle": True} if config.oracle else {})
    tasks: list[str] = []
    if config.reference_version is None:
        _check_pretraining_env(cfg.store, store.schema, config, env, scene)
    if kind == "candidate":
        vocabulary = _vocabulary(env)
        k, candidate_shape = len(vocabulary), None
    else:
        if env_spec(env).task_kwarg is not None:  # the tasks (e.g. driving scenarios) the demonstrations ran
            tasks = sorted({e.task_id for e in snap.episodes()})
        action = proposal_action(store_schema({"name": env, **scene}, tasks[0] if tasks else None), store.schema, env)
        horizon = config.horizon or env_spec(env).horizon
    registry = PolicyRegistry(store.root)
    run_dir = cfg.run_dir
    ckpt, log_path = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "metrics.jsonl")
    state_path = os.path.join(run_dir, STATE_FILE)
    resumed = os.path.exists(state_path)
    state = _run_state(state_path)

    if config.reference_version is not None:
        reference, parent = load_policy(registry, config.reference_version, kind), config.reference_version
    elif "pretrained_version" in state:
        parent = state["pretrained_version"]
        reference = load_policy(registry, parent, kind)
    else:
        reference = None
    if isinstance(reference, ProposalPolicy):  # K and H are the policy's (a reference keeps its own)
        c = reference.config
        if c.action_dim != int(np.prod(action.shape)):
            raise CraftDataError(f"the proposal policy acts in {c.action_dim} dimensions; env {env!r}'s actions "
                                 f"have shape {action.shape}")
        k, candidate_shape = c.n_candidates, (c.horizon, c.action_dim)
    elif kind == "proposal":
        k, candidate_shape = config.n_proposals, (horizon, int(np.prod(action.shape)))
    if reference is None:  # pretraining needs episodes: none fails before the online store and run_dir are made
        select_episodes(snap, cfg.data)
    # before pretraining publishes anything: a damaged online store or one of another schema fails first
    online = online_store(config.online_store or f"{store.root.rstrip('/')}-online", env, env_kwargs, k,
                          config.oracle, candidate_shape, tasks[0] if tasks else None)
    # its clients' ids: another CRAFT run's clients would die on the shard locks, and this run train on its episodes
    held.callback(os.close, lock_client_ids(online.root, CLIENT_PREFIX, (
        f"another CRAFT run records into the online store {online.root} (clients {CLIENT_PREFIX}-*): nothing was "
        "trained or published; wait for it, or give this run its own algo.online_store=PATH")))
    # the update, the veto fit and the guard read the episodes recorded so far
    warn_lost_shards(online.root, "the run goes on without their episodes")
    begin_run(run_dir, cfg, "iteration", config.iterations)
    if reference is None:
        reference = (pretrain(snap, cfg, config, vocabulary) if kind == "candidate"
                     else pretrain_proposals(snap, cfg, config, horizon, action))
        parent = registry.publish(*reference.artifact(algorithm="craft", phase="pretrain", deterministic=True,
                                                      env_extras=False))
        state["pretrained_version"] = parent
        write_json_atomic(state_path, state)
    method = spec.build(config, None, device, reference)
    if has_checkpoint(ckpt):
        saved = load_checkpoint(ckpt, method.modules, method.optimizers, {}, ("iteration", "updates"))
        if saved["iteration"] > state["iteration"]:  # killed after an update's checkpoint, before the state file
            state = {k: v for k, v in state.items() if k != "acting_version"} | saved
    truncate_log(log_path, state.get("updates", 0))  # rows of an update the checkpoint does not hold
    if resumed and state["iteration"] < config.iterations:
        print(f"resuming {run_dir} at iteration {state['iteration']} of {config.iterations}", file=sys.stderr)

    t0 = time.perf_counter()
    while state["iteration"] < config.iterations:
        i = state["iteration"]
        if "acting_version" not in state:  # the version the fleet samples from in this iteration
            state["acting_version"] = _acting_version(method, config, registry, online, run_dir, parent, i, cfg.seed)
            write_json_atomic(state_path, state)
        version = state["acting_version"]
        _collect_iteration(config, online, registry, store.root, version, i, env, env_kwargs, tasks, cfg.seed,
                           cfg.show)
        snap = online.snapshot()
        episodes = of_registry(snap.episodes(policy_version=version), registry)
        obs, _, extras, lengths = load_episodes(snap, episodes)
        batch, baseline_stats = on_policy_batch(config, obs, extras, lengths, event_weights,
                                                method.values if config.baseline == "evpo" else None)
        if (guard := guard_batch(config, snap, registry, run_dir)) is not None:
            batch["guard"] = guard
            baseline_stats["guard_critical"] = guard.pop("critical")
        metrics = {k: float(v) for k, v in method.fit(batch, torch.Generator().manual_seed(cfg.seed + i)).items()}
        state["updates"] = state.get("updates", 0) + int(metrics.pop("updates"))
        row = {"update": state["updates"], "iteration": i + 1, "version": version, "time": time.time(),
               **_episode_metrics(episodes, lengths, extras, config.adv_eps), **metrics, **baseline_stats}
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if cfg.show:
            print(json.dumps(row), flush=True)
        counters = {"iteration": i + 1, "updates": state["updates"]}
        save_checkpoint(ckpt, method.modules, method.optimizers, {}, counters)
        state = {k: v for k, v in state.items() if k != "acting_version"} | counters
        write_json_atomic(state_path, state)
    save_checkpoint(ckpt, method.modules, method.optimizers, {}, {"iteration": state["iteration"],
                                                                  "updates": state.get("updates", 0)})
    provenance = dict(phase="final", parent_version=parent, iterations=config.iterations, deterministic=True,
                      env_extras=False, config=OmegaConf.to_container(cfg, resolve=True))
    student, veto = method.policy, {}
    if config.veto_updates > 0:  # on a copy: the checkpoint keeps the student, and a rerun repeats this exactly
        student = copy.deepcopy(method.policy)
        veto = veto_fit(student, config, online.snapshot(), registry, run_dir, cfg.seed)
    final = publish_once(registry, *method.artifact(policy=student, **provenance, **veto))
    rows = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
    summary = {"algo": spec.name, "version": final, "pretrained_version": state.get("pretrained_version", parent),
               "iterations": config.iterations, "online_store": online.root, "wall_s": time.perf_counter() - t0,
               "final": rows[-1] if rows else {}, **veto}
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary, indent=1)
    return summary

