"""The on-policy driver of candidate-scoring methods (``algo=craft``): through the fleet and the store.

One ``robo-post train algo=craft store=S`` run:

1. **Pretrain** (unless ``algo.reference_version``): behaviour-clone a ``CandidatePolicy``
   on the store's episodes (e.g. a heuristic driver recorded by ``robo-post collect``):
   the target of each step is the first vocabulary entry that starts with the executed
   action. Published as a version of kind ``candidate``.
2. **Iterate**: publish the student (sampling) -> the fleet's clients run
   ``episodes_per_iteration`` episodes pinned to that version into the online store
   (``<store>-online``), recording per step the policy's logits and chosen index and
   the env's candidate proxy scores and events as store extras -> the learner reads
   them from a snapshot, computes group advantages and grounded residuals over the
   whole batch (with ``algo.baseline=evpo``, against the critic's values at the batch's
   states before the update when its explained variance allows, else the batch mean) and
   runs ``epochs`` of minibatch updates -> next version.
3. **Publish** the final student acting greedily (argmax), for evaluation and deployment.

A killed run resumes after its last finished iteration (checkpoint: student, teacher,
optimisers, iteration, and the critic with ``baseline=evpo``); episodes already recorded
for the next version are reused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robo_post.algos.craft import (CraftConfig, CraftConfigError, bc_pretrain, event_mask, event_returns,
                                   grounded_advantage, group_advantages, residual_for_batch)
from robo_post.algos.registry import MethodSpec
from robo_post.envs.registry import env_spec
from robo_post.eval.rollout import recorded_env_kwargs
from robo_post.learner.drivers import finished_run, register_driver, resolve_device, select_episodes
from robo_post.models.candidate_policy import CandidatePolicy, CandidatePolicyConfig
from robo_post.models.features import infer_features, state_keys
from robo_post.store.registry import PolicyRegistry
from robo_post.store.schema import ArraySpec
from robo_post.store.store import Store

EXTRAS = ("logits", "chosen", "proxy_scores", "events")


class CraftDataError(ValueError):
    """The store cannot train a candidate-scoring policy (no vocabulary, no events, no data)."""


def _vocabulary(env: str) -> list[list[int]]:
    spec = env_spec(env)
    if spec.candidates is None:
        raise CraftDataError(f"env {env!r} has no candidate vocabulary (its registry entry sets none); "
                             "algo=craft needs an env whose registry entry gives `candidates`")
    return [list(map(int, c)) for c in spec.candidates()]


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


def _load(snap, episodes) -> tuple[dict[str, np.ndarray], np.ndarray, dict[str, np.ndarray], list[int]]:
    """Observations (without the final one), actions and extras of ``episodes``, concatenated, and their lengths."""
    loaded = [snap.load(e) for e in episodes]
    obs = {k: np.concatenate([d["obs"][k][:-1] for d in loaded]) for k in loaded[0]["obs"]}
    actions = np.concatenate([d["action"] for d in loaded])
    extras = {k: np.concatenate([d["extras"][k] for d in loaded]) for k in loaded[0]["extras"]}
    return obs, actions, extras, [len(d["action"]) for d in loaded]


def pretrain(store: Store, cfg: DictConfig, config: CraftConfig, vocabulary: list[list[int]]) -> CandidatePolicy:
    """Behaviour-clone candidate indices from the store's episodes (``data.*`` filters apply)."""
    snap = store.snapshot()
    episodes = select_episodes(snap, cfg.data)
    obs, actions, _, _ = _load(snap, episodes)
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


def online_store(root: str, env: str, env_kwargs: dict[str, Any], k: int, oracle: bool = False) -> Store:
    """The store the fleet records on-policy episodes into, with the candidate extras
    (and the oracle's scores of every candidate with ``oracle``)."""
    from robo_post.fleet.client import store_schema

    spec = env_spec(env)
    schema = store_schema({"name": env, **env_kwargs}, None)
    extras = {"logits": ArraySpec("float32", (k,)), "chosen": ArraySpec("int64", ()),
              "proxy_scores": ArraySpec("float32", (k,)), **spec.step_extra_specs}
    if oracle:
        extras["oracle_scores"] = ArraySpec("float32", (k,))
    return Store.create(root, dataclasses.replace(schema, extras=extras), exist_ok=True)


def on_policy_batch(config: CraftConfig, obs: dict[str, np.ndarray], extras: dict[str, np.ndarray],
                    lengths: list[int], event_weights: np.ndarray,
                    critic: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The update batch of one iteration and its baseline statistics.

    Group advantages per state, residuals over the whole batch. With ``baseline=evpo``,
    ``critic`` maps the batch's observations to values (B,) before any update of this
    iteration (the values "at collection time"); the residual's baseline is then chosen
    by their explained variance, the batch carries the event returns as ``event_return``
    (the critic's target), and the statistics are ``evpo_ev`` (``None`` when undefined)
    and ``evpo_gate`` (1 critic, 0 batch mean). With ``baseline=batch`` they are empty.

    Raises:
        CraftConfigError: ``baseline=evpo`` without a ``critic``.
    """
    if config.baseline == "evpo" and critic is None:
        raise CraftConfigError("craft baseline='evpo' needs the critic's values: pass on_policy_batch a critic")
    scores = torch.as_tensor(extras["proxy_scores"], dtype=torch.float32)
    proxy_adv = group_advantages(scores, config.adv_eps)
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
    delta = residual_for_batch(advantage, proxy_adv, chosen, config.residual_mode, torch.cat(mask))
    batch = {"obs": batch_obs, "proxy_adv": proxy_adv, "chosen": chosen,
             "old_logits": torch.as_tensor(extras["logits"], dtype=torch.float32), "delta": delta}
    if V is None:
        return batch, {}
    return batch | {"event_return": G}, {"evpo_ev": None if math.isnan(ev) else ev, "evpo_gate": int(use_critic)}


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


def craft(cfg: DictConfig, spec: MethodSpec) -> dict[str, Any]:
    """`robo-post train algo=craft`: pretraining, on-policy iterations through the fleet, a greedy final version."""
    from robo_post.fleet.client import ClientConfig
    from robo_post.fleet.collect import FleetError
    from robo_post.fleet.launcher import LocalLauncher
    from robo_post.learner.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    device = resolve_device(cfg.device)
    values = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
    values.setdefault("model", {k: cfg.model[k] for k in spec.model_keys if cfg.model.get(k) is not None})
    config: CraftConfig = spec.make_config(values)
    if (done := finished_run(cfg.run_dir, "iteration", config.iterations, cfg)) is not None:
        return done  # re-running a finished run publishes nothing
    store = Store.open(cfg.store)
    env = config.env or store.schema.attrs.get("env")
    if env is None:
        raise CraftDataError(f"store {cfg.store} names no env; set algo.env")
    vocabulary = _vocabulary(env)
    event_weights = _event_weights(env, config.event_weights)
    registry = PolicyRegistry(store.root)
    run_dir = cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(cfg, resolve=True))
    ckpt, log_path = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "metrics.jsonl")
    state_path = os.path.join(run_dir, "craft_state.json")
    state = json.load(open(state_path)) if os.path.exists(state_path) else {"iteration": 0}

    if config.reference_version is not None:
        weights, artifact = registry.load(config.reference_version)
        reference, parent = CandidatePolicy.from_artifact(weights, artifact), config.reference_version
    elif "pretrained_version" in state:
        parent = state["pretrained_version"]
        reference = CandidatePolicy.from_artifact(*registry.load(parent))
    else:
        reference = pretrain(store, cfg, config, vocabulary)
        parent = registry.publish(*reference.artifact(algorithm="craft", phase="pretrain", deterministic=True,
                                                      env_extras=False))
        state["pretrained_version"] = parent
        json.dump(state, open(state_path, "w"))
    method = spec.build(config, None, device, reference)
    if has_checkpoint(ckpt):
        load_checkpoint(ckpt, method.modules, method.optimizers, {})

    # no kwargs given: the scene the store's episodes were all recorded in (as `robo-post eval` does)
    scene = dict(config.env_kwargs) or (recorded_env_kwargs(store.root, env_spec(env)) or {})
    env_kwargs = scene | ({"oracle": True} if config.oracle else {})
    online = online_store(config.online_store or f"{store.root.rstrip('/')}-online", env, env_kwargs, len(vocabulary),
                          config.oracle)
    t0 = time.perf_counter()
    while state["iteration"] < config.iterations:
        i = state["iteration"]
        if "acting_version" not in state:  # the version the fleet samples from in this iteration
            state["acting_version"] = registry.publish(*method.artifact(
                phase="online", iteration=i, parent_version=parent, deterministic=False, env_extras=True))
            json.dump(state, open(state_path, "w"))
        version = state["acting_version"]
        per_client = -(-config.episodes_per_iteration // config.n_clients)
        configs = [ClientConfig(store=online.root, client_id=f"craft-{j}", episodes=0, env={"name": env, **env_kwargs},
                                policy={"kind": "random"}, follow_registry=False, seed=cfg.seed + 1000 * (i + 1),
                                policy_store=store.root, policy_version=version, role="online")
                   for j in range(config.n_clients)]
        for c in configs:  # resume: count what this version already recorded
            done = sum(e.policy_version == version for e in online.shard_episodes(c.client_id))
            c.episodes = len(online.shard_episodes(c.client_id)) + max(per_client - done, 0)
        statuses = LocalLauncher(configs).run(show=cfg.show)
        failed = {s["client_id"]: s.get("last_error") or s.get("state") for s in statuses if s.get("state") != "done"}
        if failed:
            raise FleetError(f"craft clients did not finish (logs in {online.root}/fleet/): {failed}")
        snap = online.snapshot()
        episodes = snap.episodes(policy_version=version)
        obs, _, extras, lengths = _load(snap, episodes)
        batch, baseline_stats = on_policy_batch(config, obs, extras, lengths, event_weights,
                                                method.values if config.baseline == "evpo" else None)
        metrics = {k: float(v) for k, v in method.fit(batch, torch.Generator().manual_seed(cfg.seed + i)).items()}
        state["updates"] = state.get("updates", 0) + config.epochs * -(-len(batch["chosen"]) // config.minibatch)
        row = {"update": state["updates"], "iteration": i + 1, "version": version, "time": time.time(), "episodes": len(episodes),
               "steps": int(sum(lengths)), "episode_return": float(np.mean([e.ret for e in episodes])),
               "collision": float(np.mean([bool((e.attrs.get("metrics") or {}).get("collision")) for e in episodes])),
               "mean_speed": float(np.mean([(e.attrs.get("metrics") or {}).get("mean_speed", np.nan) for e in episodes])),
               "proxy_oracle_corr": proxy_oracle_correlation(extras, config.adv_eps), **metrics, **baseline_stats}
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if cfg.show:
            print(json.dumps(row), flush=True)
        save_checkpoint(ckpt, method.modules, method.optimizers, {}, {"iteration": i + 1})
        state = {k: v for k, v in state.items() if k != "acting_version"} | {"iteration": i + 1}
        json.dump(state, open(state_path, "w"))
    save_checkpoint(ckpt, method.modules, method.optimizers, {}, {"iteration": state["iteration"]})
    final = registry.publish(*method.artifact(phase="final", parent_version=parent, iterations=config.iterations,
                                              deterministic=True, env_extras=False,
                                              config=OmegaConf.to_container(cfg, resolve=True)))
    rows = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
    summary = {"algo": spec.name, "version": final, "pretrained_version": state.get("pretrained_version", parent),
               "iterations": config.iterations, "online_store": online.root, "wall_s": time.perf_counter() - t0,
               "final": rows[-1] if rows else {}}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


register_driver("craft", craft)
