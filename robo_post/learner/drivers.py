"""Drivers: the loops that run a registered method (``MethodSpec.driver``).

``off_policy`` trains on windows of a store snapshot: it selects the episodes,
builds the window sampler, measures what the method is sized from (``DataSpec``:
feature spec, normalisers, value range), builds the method through the registry,
runs ``train_loop`` (logging, checkpoint/resume) and publishes the result to the
store's policy registry with its provenance. Methods that need another loop
(on-policy rollouts, steering, an SB3 agent) name their own driver; the table of
drivers is ``robo_post.learner.train.DRIVERS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from robo_post.algos.actor_critic import backup_chunks
from robo_post.algos.divl import DIVL
from robo_post.algos.registry import DataSpec, MethodSpec, check_continuous, method_spec
from robo_post.algos.sb3_agent import check_budget
from robo_post.config import absolute_paths, changed_settings, check_dir_path, compose, describe_changes
from robo_post.learner.checkpoint import (CheckpointError, checkpoint_state, has_checkpoint, load_checkpoint,
                                         save_checkpoint)
from robo_post.learner.critic_report import critic_diagnostics, held_out
from robo_post.learner.critic_report import describe as describe_diagnostics
from robo_post.learner.loop import train_loop, truncate_log
from robo_post.learner.tracking import Tracker, tracking_settings
from robo_post.learner.value_report import write_value_report
from robo_post.models.features import infer_features, state_keys
from robo_post.models.flow import FlowPolicy
from robo_post.store import (EpisodeInfo, ImitationSampler, PolicyArtifactError, PolicyNotFoundError, PolicyRegistry,
                             Snapshot, Store, StoreSchema, WindowSampler)
from robo_post.store.store import remove_empty_store
from robo_post.utils.device import resolve_device
from robo_post.utils.io import read_metrics, try_lock, write_json_atomic

# Chunking for data of an env the environment registry does not know: a reactive
# controller that decides one action per step (an open-loop chunk cannot balance a
# pendulum, and predicting the later actions of a chunk slows BC several times).
GENERIC_HORIZON, GENERIC_EXECUTE = 1, 1
# Bounds of the update budget measured from the data (``updates=null``).
MIN_UPDATES, MAX_UPDATES = 3000, 100_000
# Share of the value support's width added on each side of the data's return range.
VALUE_MARGIN = 0.1
# End-atom probability mass above which the value support is reported as too narrow.
EDGE_MASS_WARN = 0.25
# A critic whose mean Q still moves by more than this share of the data's return span over
# the last quarter of its updates (or whose TD loss grows by more than TD_RISE_WARN) has not
# converged: its actor followed a moving target.
Q_DRIFT_WARN = 0.05
TD_RISE_WARN = 0.2

# --- data -----------------------------------------------------------------------------
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


# What makes two runs' training episodes the same selection (``data.*``).
SELECTION_KEYS = ("snapshot", "tasks", "success", "roles", "clients")
# Settings a reference BC run takes over from the critic run that needs it.
REFERENCE_SETTINGS = ("store", "device", "torch_threads", "seed", "epochs", "batch_size", "gamma", "prefetch", "amp",
                      "compile", "log_every", "checkpoint_every", "show", "tracking", "model", "data")


def matching_reference(registry: PolicyRegistry, data: dict[str, Any], episodes: int) -> int | None:
    """The newest flow BC version trained on ``episodes`` episodes of the selection ``data``."""
    for version in reversed(registry.versions()):
        config = registry.peek_config(version) or {}
        trained = (config.get("config") or {}).get("data") or {}
        if (config.get("kind") == "flow" and config.get("algorithm") == "bc_flow" and config.get("episodes") == episodes
                and all(trained.get(k) == data.get(k) for k in SELECTION_KEYS)):
            return version
    return None


def choose_reference(cfg: DictConfig, spec: MethodSpec, episodes: int) -> int:
    """The BC flow a critic method starts from when ``algo.reference_version`` is null: flow BC
    on the very episodes the critic learns from (its ``data`` selection, usually every episode),
    the behaviour policy its critic evaluates and the policy it is meant to improve on. The
    newest such published version, else one trained first (``RUN/reference``, published)."""
    registry = PolicyRegistry(cfg.store)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    selection = f"data.success={json.dumps(data.get('success'))}" + "".join(
        f", data.{k}={json.dumps(data[k])}" for k in ("tasks", "roles", "clients") if data.get(k) is not None)
    found = matching_reference(registry, data, episodes)
    if found is not None:
        print(f"algo={spec.name} starts from v{found}, flow BC on the same {episodes} episodes ({selection})",
              file=sys.stderr)
        return found
    run_dir = os.path.join(cfg.run_dir, "reference")
    print(f"algo={spec.name}: no flow BC published on its {episodes} episodes ({selection}); training one first in "
          f"{run_dir} (algo.reference_version=N starts from version N instead)", file=sys.stderr)
    reference = OmegaConf.merge(compose("train", ["algo=bc_flow"]), {k: cfg[k] for k in REFERENCE_SETTINGS if k in cfg},
                                {"run_dir": run_dir, "updates": None, "publish": True})
    return off_policy(reference, method_spec("bc_flow"))["version"]


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


def warn_value_edges(logged: list[dict[str, float]], value_range_: tuple[float, float]) -> None:
    """Say so when a categorical value piles up at its support's edges (support too narrow)."""
    if logged and logged[-1].get("edge_mass", 0.0) > EDGE_MASS_WARN:
        print(f"warning: {logged[-1]['edge_mass']:.0%} of the value distribution sits on the support's end atoms "
              f"[{value_range_[0]:.3g}, {value_range_[1]:.3g}]; widen it with +algo.value.v_min=... +algo.value.v_max=...",
              file=sys.stderr)


def critic_trend(logged: list[dict[str, float]], return_span: float) -> dict[str, Any] | None:
    """How the critic moved over the last quarter of the logged windows: mean Q's change
    (least-squares line, in return units and as a share of the data's return span) and the TD
    loss at that quarter's start and end; ``converged`` is False when Q still drifts by more
    than ``Q_DRIFT_WARN`` of the span or the TD loss grows by more than ``TD_RISE_WARN``.
    None for a method without a critic or fewer than 8 windows."""
    rows = [r for r in logged if "q_mean" in r and "loss_q" in r]
    if len(rows) < 8:
        return None
    tail = rows[-max(4, len(rows) // 4):]
    u = np.array([r["update"] for r in tail], dtype=float)
    q_change = float(np.polyfit(u, [r["q_mean"] for r in tail], 1)[0] * (u[-1] - u[0]))
    td_start, td_end = (float(np.mean([r["loss_q"] for r in part])) for part in (tail[:2], tail[-2:]))
    share = abs(q_change) / max(return_span, 1e-6)
    converged = share <= Q_DRIFT_WARN and td_end <= (1 + TD_RISE_WARN) * td_start
    return {"updates": [int(u[0]), int(u[-1])], "q_change": q_change, "q_change_share_of_span": share,
            "td_loss_start": td_start, "td_loss_end": td_end, "converged": bool(converged)}


def warn_unconverged(trend: dict[str, Any] | None) -> None:
    """Say so when the critic has not converged at the end of the budget (``critic_trend``)."""
    if trend is None or trend["converged"]:
        return
    a, b = trend["updates"]
    print(f"warning: the critic has not converged: over updates {a}-{b} its mean Q moved by {trend['q_change']:+.3g} "
          f"({trend['q_change_share_of_span']:.0%} of the data's return span) and its TD loss went from "
          f"{trend['td_loss_start']:.3g} to {trend['td_loss_end']:.3g}; the actor followed a moving target. More "
          "updates (a larger `updates=`, which resumes this run_dir) let it settle", file=sys.stderr)


def check_same_method(run_dir: str, cfg: DictConfig) -> None:
    """Refuse a ``run_dir`` whose recorded run is of another method than ``cfg.algo.name``
    (e.g. two ``train`` commands left at the default run_dir): neither resuming its
    checkpoint nor publishing its weights again under the new method means anything, and
    starting would overwrite its record. A damaged ``config.yaml`` tells no method: the later checks handle it.

    Raises:
        RunResumeError: naming both methods, the run's store and a way out.
    """
    config_path = os.path.join(run_dir, "config.yaml")
    recorded = _run_record(config_path, OmegaConf.load, warn=False)
    algo = (recorded or {}).get("algo")
    was = algo.get("name") if isinstance(algo, dict) else None
    if was is not None and was != cfg.algo.name:
        raise RunResumeError(f"{run_dir} holds a run of algo={was} (store {recorded.get('store')}), not of "
                             f"algo={cfg.algo.name}; nothing was changed. Give this run its own run_dir, e.g. "
                             f"run_dir=runs/{cfg.algo.name}")


def finished_run(run_dir: str, counter: str, target: int, cfg: DictConfig,
                 unread: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The summary of the run in ``run_dir`` when it has already finished with this config
    (``summary.json`` written, its checkpoint's ``counter`` at ``target`` or past it, the same
    settings but the display ones), else None: re-running a finished run would publish a duplicate
    version trained by 0 more updates. Changed settings (e.g. acting deterministically or
    not) publish the trained weights again under them, with a warning naming the changes:
    the weights are not trained again, whatever the changed settings would have trained.
    Top-level settings in ``unread`` (those the driver never reads) are not compared.
    A run of another method is refused first (``check_same_method``)."""
    check_same_method(run_dir, cfg)
    summary_path, ckpt = os.path.join(run_dir, "summary.json"), os.path.join(run_dir, "checkpoint")
    config_path = os.path.join(run_dir, "config.yaml")
    if not (os.path.exists(summary_path) and os.path.exists(config_path) and has_checkpoint(ckpt)):
        return None
    saved, summary = _run_record(config_path, OmegaConf.load), _run_record(summary_path, _load_json)
    if saved is None or summary is None:
        return None
    done = checkpoint_state(ckpt).get(counter, 0)
    if done < target:
        return None
    if changed := _read_changes(saved, cfg, unread):
        if moved := [k for k in changed if k == "store" or k.startswith("model.")]:
            # Its weights neither fit another model nor belong to another store's registry.
            what = describe_changes({k: changed[k] for k in moved})
            raise RunResumeError(f"{run_dir} finished a run with other settings ({what}) than these; nothing was "
                                 f"changed. Give this run its own run_dir, e.g. run_dir=runs/{cfg.algo.name}")
        print(f"warning: {run_dir} finished at {counter} {done} with other settings ({describe_changes(changed, None)}); "
              "its weights are published again under the new ones without training (the version records "
              "`same_weights_as`): settings that shape training take effect in a new run_dir", file=sys.stderr)
        return None
    version = summary.get("version")
    if isinstance(version, int) and not isinstance(version, bool):
        try:
            PolicyRegistry(cfg.store).load(version)
        except (PolicyArtifactError, PolicyNotFoundError) as e:  # what the fleet would load is gone
            print(f"warning: {run_dir} finished, but {e}: its final weights are published again", file=sys.stderr)
            return None
    print(f"{run_dir} is already done ({counter} {done} of {target}, published version {summary.get('version')}); "
          f"nothing trained or published. A larger target continues it; a new run_dir starts over.", file=sys.stderr)
    return summary


def _load_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _run_record(path: str, load: Callable[[str], Any], warn: bool = True) -> dict[str, Any] | None:
    """A run's ``config.yaml`` or ``summary.json`` as a dict; None when it is missing, or damaged
    (with a warning naming it, if ``warn``): the run is then not known to be finished."""
    if not os.path.exists(path):
        return None
    try:
        value = load(path)
        value = OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
        if not isinstance(value, dict):
            raise ValueError(f"a {type(value).__name__}, not a mapping")
        return value
    except (yaml.YAMLError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        if warn:
            print(f"warning: {path} is damaged ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                  "the run is taken as not finished", file=sys.stderr)
        return None


class RunResumeError(CheckpointError):
    """A run dir whose unfinished run cannot be resumed as asked: a smaller budget than it has
    trained, or other settings than it was started with."""


# Top-level train settings a resumed run may change: where (a moved run dir) and how fast it runs,
# how often it logs, checkpoints and evaluates, not what it trains on or how.
RESUMABLE_SETTINGS = ("run_dir", "device", "torch_threads", "prefetch", "compile", "log_every", "checkpoint_every",
                      "eval", "publish")


def check_resume(run_dir: str, cfg: DictConfig, counter: str, target: int, setting: str,
                 progress: tuple[str, ...] = (), unread: tuple[str, ...] = ()) -> None:
    """Refuse to resume the unfinished run in ``run_dir`` where its weights would be mislabelled:
    its checkpoint has trained past ``target`` (``setting``, the budget: fewer steps cannot be
    undone), or its ``config.yaml`` records other settings than ``cfg`` (another store, learning
    rate, ...: the run would go on under them while every record named only the new ones). The
    budget, ``RESUMABLE_SETTINGS`` and the ``unread`` top-level settings (those the driver never
    reads) may change. A run has started once it has a checkpoint or
    one of the ``progress`` files in ``run_dir``; a finished run is ``finished_run``'s to handle.

    Raises:
        RunResumeError: naming the budget or each changed setting with its recorded and new value.
    """
    ckpt = os.path.join(run_dir, "checkpoint")
    done = checkpoint_state(ckpt).get(counter) if has_checkpoint(ckpt) else None
    if isinstance(done, int) and done > target and _recorded_budget(run_dir, setting) != target:
        # (a run that stopped past its own budget, as SB3 does at a rollout's end, is finished, not shrunk)
        raise RunResumeError(f"{run_dir} has already trained {counter} {done}, more than {setting}={target}: "
                             f"set {setting}>={done} to continue it, or a new run_dir starts over")
    started = done is not None or any(os.path.exists(os.path.join(run_dir, f)) for f in progress)
    config_path = os.path.join(run_dir, TRAINED_RECORD)
    if not os.path.exists(config_path):
        config_path = os.path.join(run_dir, "config.yaml")
    if not started or (isinstance(done, int) and done >= target):
        return
    recorded = _run_record(config_path, OmegaConf.load, warn=False)
    if recorded is None:
        if done is None:  # nothing trained to carry over: it starts over under the new settings
            return
        # The weights' settings are unknown: they could go on under others unnoticed.
        state = "is damaged" if os.path.exists(config_path) else "is missing"
        raise RunResumeError(
            f"{run_dir} holds an unfinished run ({counter} {done or 0} of {target}), but {config_path}, the record "
            f"of the settings it started with, {state}: resuming could go on under other settings unnoticed. "
            "Restore it, or use a new run_dir")
    changed = {k: v for k, v in _read_changes(recorded, cfg, unread).items()
               if k != setting and k.split(".")[0] not in RESUMABLE_SETTINGS}
    if changed:
        budget = _dotted(recorded, setting)
        state = (f"a run finished at {counter} {done} (its {setting})" if isinstance(budget, int) and done == budget
                 else f"an unfinished run ({counter} {done or 0} of {target})")
        raise RunResumeError(
            f"{run_dir} holds {state}, started with other settings "
            f"({describe_changes(changed)}): resuming would go on training its weights under the "
            f"new ones. Rerun with the recorded settings to resume it ({setting} may grow), or use a new run_dir")


def _read_changes(recorded: Any, cfg: DictConfig, unread: tuple[str, ...]) -> dict[str, Any]:
    """``changed_settings`` between a run's record and ``cfg``, but for the ``unread`` top-level keys."""
    return {k: v for k, v in changed_settings(recorded, OmegaConf.to_container(cfg, resolve=True)).items()
            if k.split(".")[0] not in unread}


def _recorded_budget(run_dir: str, setting: str) -> Any:
    """The budget ``setting`` (a dotted key) a run in ``run_dir`` recorded, None if unknown."""
    path = os.path.join(run_dir, TRAINED_RECORD)
    return _dotted(_run_record(path if os.path.exists(path) else os.path.join(run_dir, "config.yaml"),
                               OmegaConf.load, warn=False), setting)


def _dotted(record: Any, key: str) -> Any:
    """``record``'s value at the dotted ``key`` (``algo.timesteps``), None where it has none."""
    for part in key.split("."):
        record = record.get(part) if isinstance(record, dict) else None
    return record


class NonFiniteWeightsError(ValueError):
    """A trained policy holds NaN or infinite weights (training diverged): it is not published."""


def publish_once(registry: PolicyRegistry, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> int:
    """Publish ``(weights, config)``, or return the version that already is exactly that: the
    newest (a run killed after publishing, before its ``summary.json``, resumes at its final
    checkpoint and would otherwise publish the same policy a second time), or one published
    earlier with the newest version's weights (a finished run rerun under its first settings
    after a publication under others). The newest version's weights under another config (a
    finished run published again under changed settings) are published with
    ``same_weights_as`` naming the version that first held them.

    Raises:
        NonFiniteWeightsError: a weight is NaN or infinite (a fleet following the registry would
            run it, every action non-finite).
    """
    bad = sorted(k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if bad:
        raise NonFiniteWeightsError(f"the trained policy has non-finite weights in {len(bad)} tensors ({bad[0]}, ...): "
                                    "training diverged (a lower algo.lr or grad_clip may help); nothing was published")
    latest = registry.latest()
    if latest is not None:
        try:
            published, published_config = registry.load(latest)
        except PolicyArtifactError as e:
            # A version damaged after publishing must not block every later one; validate lists it.
            print(f"warning: {e}; publishing version {latest + 1} after it", file=sys.stderr)
            return registry.publish(weights, config)
        if (published.keys() == weights.keys()
                and all(torch.equal(published[k], v.detach().cpu()) for k, v in weights.items())):
            origin = published_config.get("same_weights_as", latest)
            wanted = json.loads(json.dumps(config))
            for version in reversed(registry.versions()):  # the newest first; the family ends at its origin
                try:
                    version_config = published_config if version == latest else registry.load(version)[1]
                except PolicyArtifactError:
                    continue
                if version != origin and version_config.get("same_weights_as") != origin:
                    continue
                if {k: v for k, v in version_config.items() if k not in ("version", "same_weights_as")} == wanted:
                    return version
                if version == origin:
                    break
            config = {**config, "same_weights_as": origin}
    return registry.publish(weights, config)


class RunLockedError(RuntimeError):
    """Another process is training in this run dir."""


@contextlib.contextmanager
def run_lock(run_dir: str) -> Iterator[None]:
    """Hold ``run_dir`` for this process while it trains: two runs in one directory would write
    one checkpoint and one metrics log over each other. A run dir this creates is removed again
    if the run leaves it empty (settings refused before anything was written).

    Raises:
        RunLockedError: another process is training there.
        ValueError: ``run_dir`` is a file, or the root of a trajectory store.
    """
    check_dir_path("run_dir", run_dir)
    if os.path.exists(os.path.join(run_dir, "store.json")):  # its checkpoint and log would sit among the shards
        raise ValueError(f"run_dir={run_dir} is a trajectory store: give the run a directory of its own")
    created = not os.path.isdir(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    fd = try_lock(run_dir, lambda: RunLockedError(f"run_dir={run_dir} is in use by another training process: wait "
                                                   "for it to finish, or give this run its own run_dir"))
    try:
        yield
    finally:
        os.close(fd)
        if created:
            with contextlib.suppress(OSError):  # only an empty directory is removed
                os.rmdir(run_dir)


# The settings a run's weights were trained with, once a publication under other settings
# (a finished run rerun with them) has rewritten its config.yaml.
TRAINED_RECORD = "trained_config.yaml"


def begin_run(run_dir: str, cfg: DictConfig, counter: str, target: int) -> None:
    """Create ``run_dir`` and record ``cfg`` in its ``config.yaml`` as a run starts or resumes.

    A ``summary.json`` an earlier run left there is removed first: with the new config beside
    it, a run that stops before writing its own summary would otherwise pass ``finished_run``
    on the next call and hand back the earlier run's results. A run whose checkpoint has
    already reached ``target`` (its ``counter``) only publishes its weights again under changed
    settings (``finished_run``): the settings they were trained with are then kept in
    ``TRAINED_RECORD``, which ``check_resume`` compares a larger budget with, or the changed
    settings would go on training them as if they had been trained with them.
    """
    os.makedirs(run_dir, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(run_dir, "summary.json"))
    path, trained = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, TRAINED_RECORD)
    ckpt = os.path.join(run_dir, "checkpoint")
    if has_checkpoint(ckpt) and checkpoint_state(ckpt).get(counter, 0) >= target:
        if not os.path.exists(trained) and _run_record(path, OmegaConf.load, warn=False) is not None:
            shutil.copyfile(path, f"{trained}.tmp")
            os.replace(f"{trained}.tmp", trained)
    else:  # it trains under these settings: config.yaml is again their record
        with contextlib.suppress(FileNotFoundError):
            os.remove(trained)
    with open(f"{path}.tmp", "w") as f:  # renamed into place: a kill never leaves half a record
        f.write(OmegaConf.to_yaml(absolute_paths(OmegaConf.to_container(cfg, resolve=True))))
    os.replace(f"{path}.tmp", path)


# --- the off-policy driver ----------------------------------------------------------------
SNAPSHOT_FILE = "snapshot.json"


def _resumed_snapshot(run_dir: str) -> str | None:
    """The snapshot a run resuming from its checkpoint started on (None for a fresh run): the
    windows it trains on, and so its resumed weights and published version, stay those of an
    uninterrupted run, however many episodes the store gained meanwhile."""
    if not has_checkpoint(os.path.join(run_dir, "checkpoint")):
        return None
    try:
        with open(os.path.join(run_dir, SNAPSHOT_FILE)) as f:
            return json.load(f)["snapshot"]
    except FileNotFoundError:  # a store that could not record its snapshot: the newest one
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{os.path.join(run_dir, SNAPSHOT_FILE)} is damaged ({e!r}); pin data.snapshot, "
                         f"or a new run_dir starts over") from None


def _warn_unread_model_settings(cfg: DictConfig, spec: MethodSpec) -> None:
    """Name the flow-policy settings under ``model`` this method does not read (they were
    accepted, recorded in config.yaml and ignored): a policy that acts one action at a time
    has no chunks or flow steps, and a method that starts from a reference keeps its chunks."""
    flow = "flow_steps" in spec.model_keys
    unread = (([] if flow and not spec.needs_reference else ["horizon", "execute_steps", "deterministic", "mode_draws", "predicts"])
              + ([] if flow else ["flow_steps"]))
    default = compose("train", []).model  # the model group is train's own (a plugin has no algo/ config file)
    for key in unread:
        if cfg.model.get(key) != default.get(key):
            why = "it keeps its reference policy's" if spec.needs_reference else "its policy has none"
            print(f"warning: algo={spec.name} does not read model.{key}={cfg.model.get(key)} ({why}); it is ignored",
                  file=sys.stderr)


def training_episodes(snap: Snapshot, cfg: DictConfig, spec: MethodSpec) -> tuple[list[EpisodeInfo], list[EpisodeInfo]]:
    """(episodes the method trains on, episodes held out): ``cfg.data``'s selection, less the
    share a critic method keeps out for its diagnostics (``data.holdout``)."""
    episodes = select_episodes(snap, cfg.data)
    holdout = held_out(episodes, cfg.data.get("holdout", 0.0), cfg.seed) if spec.needs_reference else []
    keys = {h.key for h in holdout}
    return [e for e in episodes if e.key not in keys], holdout


def resolve_updates(cfg: DictConfig, spec: MethodSpec) -> Snapshot | None:
    """``updates=null``: ``epochs`` passes over the training steps at ``batch_size``, within
    [MIN_UPDATES, MAX_UPDATES], written into ``cfg`` (so the run records the number); returns
    the snapshot it measured, for the run to train on (None when ``updates`` is set). A budget
    fixed in updates under-trains large datasets and over-trains small ones: flow BC of 20
    expert episodes (20,000 steps) kept 14% of their return at 3000 updates of 64 windows
    (10 passes) and all of it at 77 passes (docs/notes/offline-learning.md)."""
    if cfg.updates is not None:
        return None
    snap = Store.open(cfg.store).snapshot(cfg.data.snapshot or _resumed_snapshot(cfg.run_dir))
    steps = sum(e.length for e in training_episodes(snap, cfg, spec)[0])
    updates = int(np.clip(round(cfg.epochs * steps / cfg.batch_size), MIN_UPDATES, MAX_UPDATES))
    print(f"updates={updates}: {cfg.epochs} passes over {steps} steps at batch_size={cfg.batch_size}, within "
          f"[{MIN_UPDATES}, {MAX_UPDATES}] (set updates=N to fix the budget)", file=sys.stderr)
    with open_dict(cfg):
        cfg.updates = updates
    return snap


def off_policy(cfg: DictConfig, spec: MethodSpec) -> dict[str, Any]:
    """`robo-post train` for a method trained on snapshot windows; publishes the result
    (a run that already finished returns its summary instead)."""
    measured = resolve_updates(cfg, spec)
    if (done := finished_run(cfg.run_dir, "update", cfg.updates, cfg)) is not None:
        return done
    check_resume(cfg.run_dir, cfg, "update", cfg.updates, "updates")
    tracking_settings(cfg.get("tracking"))  # an enabled tracker that is not installed fails before any work
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    device = resolve_device(cfg.device)
    store = Store.open(cfg.store)
    snap = measured or store.snapshot(cfg.data.snapshot or _resumed_snapshot(cfg.run_dir))
    episodes, holdout = training_episodes(snap, cfg, spec)
    values = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
    if "model" in spec.config.__dataclass_fields__:
        values.setdefault("model", {k: cfg.model[k] for k in spec.model_keys if cfg.model.get(k) is not None})
    _warn_unread_model_settings(cfg, spec)
    config = spec.make_config(values)
    if hasattr(config, "critic_warmup") and config.critic_warmup is None:
        config.critic_warmup = cfg.updates // 2  # the critic's half of the budget, then both
    if cfg.updates <= getattr(config, "critic_warmup", 0):
        print(f"warning: updates={cfg.updates} <= algo.critic_warmup={config.critic_warmup}: only the critic "
              "trains, and the published actor is the reference policy unchanged", file=sys.stderr)
    if spec.needs_reference:  # it starts from a flow policy, which integer actions cannot have
        check_continuous(spec.name, np.dtype(store.schema.action.dtype).kind in "iu")
        if config.reference_version is None:
            config.reference_version = choose_reference(cfg, spec, len(episodes) + len(holdout))
    reference, parent = (load_reference(store, config.reference_version, device) if spec.needs_reference
                         else (None, None))
    horizon = reference.config.horizon if reference is not None else cfg.model.horizon or chunk_defaults(store.schema)[0]
    if getattr(config, "n_step", 1) is None:
        config.n_step = backup_chunks(spec.name, config, [e.length for e in episodes], horizon, cfg.gamma, cfg.updates)
        print(f"n_step={config.n_step}: {config.n_step * horizon}-step backups (algo.n_step=N fixes it)", file=sys.stderr)
    sampler = WindowSampler.from_snapshot(  # with prefetch, the prefetcher moves batches to the device
        snap, episodes, horizon=horizon, n_step=getattr(config, "n_step", 1), gamma=cfg.gamma,
        device="cpu" if cfg.prefetch else device, seed=cfg.seed,
        bootstrap_truncated=getattr(config, "bootstrap_truncated", True),
    )
    data = measure(store.schema, sampler, cfg.model, cfg.gamma, reference)
    method = spec.build(config, data, device, reference)
    imitation = imitation_sampler(config, method, [sampler], cfg.seed + 3)
    rngs = {"sampler": sampler.rng} | ({"imitation": imitation.rng} if imitation is not None else {})

    run_dir = cfg.run_dir
    begin_run(run_dir, cfg, "update", cfg.updates)
    if snap.recorded:
        write_json_atomic(os.path.join(run_dir, SNAPSHOT_FILE), {"snapshot": snap.id})
    evaluate = None
    if cfg.eval.every:
        from robo_post.envs.registry import env_spec
        from robo_post.eval.rollout import in_process_success
        from robo_post.fleet.client import recorded_env_kwargs

        tasks = sorted({e.task_id for e in episodes})
        env = store.schema.attrs.get("env")
        kwargs = None
        if env is not None:
            entry = env_spec(env)
            kwargs = recorded_env_kwargs(store.root, entry)  # the dataset's step limit, as `robo-post eval` runs it
            if entry.task_kwarg is None:  # an env without tasks: imported episodes name their dataset instead
                tasks = [entry.id]
        evaluate = lambda update: in_process_success(method.policy, tasks, cfg.eval.episodes_per_task,  # noqa: E731
                                                     env=env, env_kwargs=kwargs)
    t0 = time.perf_counter()
    logged = train_loop(method, lambda: add_imitation(sampler.sample(cfg.batch_size), imitation, cfg.batch_size),
                        run_dir, cfg.updates, rngs, log_every=cfg.log_every, checkpoint_every=cfg.checkpoint_every,
                        eval_every=cfg.eval.every, evaluate=evaluate, show=cfg.show, prefetch=cfg.prefetch,
                        amp=cfg.amp, compile=cfg.get("compile", False), tracking=cfg.get("tracking"))
    wall = time.perf_counter() - t0
    warn_value_edges(logged, data.value_range)
    trend = critic_trend(logged or read_metrics(os.path.join(run_dir, "metrics.jsonl")), data.return_span)
    warn_unconverged(trend)
    diagnostics = critic_diagnostics(method, snap, holdout or episodes, cfg.gamma, held=bool(holdout), seed=cfg.seed)
    if diagnostics is not None:
        print(describe_diagnostics(diagnostics), file=sys.stderr)
    if isinstance(getattr(method, "value", None), DIVL):
        write_value_report(run_dir, "offline", method.value, snap, episodes)
    weights, artifact_config = method.artifact(
        algorithm=spec.name, phase="offline", parent_version=parent, snapshot=snap.id, episodes=len(episodes), updates=cfg.updates,
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    version = publish_once(PolicyRegistry(store.root), weights, artifact_config) if cfg.publish else None
    # no update this time (published again, or killed after its last checkpoint): the training's last row
    final = (logged or read_metrics(os.path.join(run_dir, "metrics.jsonl")) or [{}])[-1]
    summary = {"algo": spec.name, "version": version, "parent_version": parent, "snapshot": snap.id,
               "episodes": len(episodes), "steps": len(sampler), "value_range": list(data.value_range),
               "wall_s": wall, "final": final}
    if hasattr(config, "n_step"):  # as measured (n_step: null) or set
        summary["backup"] = {"n_step": config.n_step, "steps": config.n_step * sampler.horizon,
                             "critic_warmup": config.critic_warmup}
    if trend is not None:
        summary["critic_trend"] = trend
    if diagnostics is not None:
        summary["critic_diagnostics"] = diagnostics
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary, indent=1)
    return summary


# --- the SB3 driver ----------------------------------------------------------------------
def _open_or_create_store(root: str, config: Any) -> Store:
    """The store whose registry receives the agent; created from the env's spaces when absent.
    An unset ``config.env`` becomes the env the store was recorded in, and unset
    ``config.env_kwargs`` the kwargs its episodes agree on: eval and the fleet run a store's
    agents in that env, so the agent trains in it. An existing store must have been recorded
    in the agent's env (the same schema, as ``collect`` checks)."""
    from robo_post.envs.registry import env_spec
    from robo_post.fleet.client import recorded_env_kwargs
    from robo_post.store import StoreNotFoundError

    store = None
    try:
        store = Store.open(root)
    except StoreNotFoundError:
        if config.env is None:
            raise
    else:
        config.env = config.env or store.schema.attrs.get("env")
        if config.env is None:
            return store  # the agent names the missing algo.env
        if not config.env_kwargs:
            config.env_kwargs = recorded_env_kwargs(root, env_spec(config.env)) or {}
    spec = env_spec(config.env)
    probe = spec.make(config.task, **config.env_kwargs)
    try:
        schema = StoreSchema.from_spaces(probe.observation_space, probe.action_space, env=spec.key)
    finally:
        probe.close()
    if store is None:
        return Store.create(root, schema)
    # The spaces and the env must match; the store's other metadata (an import's success rule, ...) is its own.
    recorded = store.schema.attrs.get("env")
    attrs = {**store.schema.attrs, "env": recorded if recorded in (spec.key, spec.id) else spec.key}
    return Store.create(root, dataclasses.replace(schema, attrs=attrs, extras=store.schema.extras), exist_ok=True)


# The learner's settings an SB3 run never reads (SB3 has its own batch size, discount and network):
# a run recorded before one of them was added or changed resumes and republishes as before.
SB3_UNREAD = ("updates", "epochs", "batch_size", "gamma", "amp", "model", "data")


def sb3(cfg: DictConfig, spec: MethodSpec) -> dict[str, Any]:
    """`robo-post train` for an SB3 agent: SB3's ``learn`` in the env, metrics and checkpoints
    at rollout boundaries, the agent published to the store's registry (safetensors + JSON).

    A killed run resumes from its last checkpoint (weights, optimiser, step count); the
    rollout that was in flight is collected again; a finished run returns its summary.
    """
    from stable_baselines3.common.callbacks import BaseCallback

    if (done := finished_run(cfg.run_dir, "timesteps", cfg.algo.timesteps, cfg, SB3_UNREAD)) is not None:
        return done
    check_resume(cfg.run_dir, cfg, "timesteps", cfg.algo.timesteps, "algo.timesteps", unread=SB3_UNREAD)
    tracking_settings(cfg.get("tracking"))
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.torch_threads)
    values = {k: v for k, v in OmegaConf.to_container(cfg.algo, resolve=True).items() if k != "name"}
    config = spec.make_config(values)
    existed = os.path.exists(cfg.store)
    created = not os.path.exists(os.path.join(cfg.store, "store.json"))
    store = _open_or_create_store(cfg.store, config)
    if config.seed is None:
        config.seed = cfg.seed
    try:
        agent = spec.build(config, None, resolve_device(cfg.device), None)
        check_budget(config.timesteps, agent.model)
    except BaseException:
        if created:  # refused settings leave no store behind
            remove_empty_store(store.root, existed)
        raise
    run_dir = cfg.run_dir
    begin_run(run_dir, cfg, "timesteps", cfg.algo.timesteps)
    ckpt, log_path = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "metrics.jsonl")
    if has_checkpoint(ckpt):
        agent.model.num_timesteps = load_checkpoint(ckpt, agent.modules, agent.optimizers, {}, ("timesteps",))["timesteps"]
    truncate_log(log_path, agent.model.num_timesteps)  # also the rows of a run killed before its first checkpoint

    class Log(BaseCallback):
        """A metrics row and, every ``checkpoint_every`` steps, a checkpoint per rollout."""

        def __init__(self):
            super().__init__()
            self.train_metrics: dict[str, float] = {}
            self.saved = agent.model.num_timesteps
            self.t = time.perf_counter()

        def _on_rollout_start(self) -> None:  # SB3 has just trained on the previous rollout
            self.train_metrics = {k: float(v) for k, v in self.model.logger.name_to_value.items()
                                  if isinstance(v, (int, float, np.floating))}

        def _on_rollout_end(self) -> None:
            episodes = list(self.model.ep_info_buffer)
            row = {"update": self.num_timesteps, "time": time.time(), **self.train_metrics,
                   "steps_per_s": self.model.n_envs * self.locals.get("n_rollout_steps", 0) / max(time.perf_counter() - self.t, 1e-9)}
            if episodes:
                row.update(episode_return=float(np.mean([e["r"] for e in episodes])),
                           episode_length=float(np.mean([e["l"] for e in episodes])))
            extra = getattr(agent, "rollout_metrics", None)  # a method's own metrics (e.g. exact evaluations)
            if extra is not None:
                row.update(extra(self.num_timesteps))
            with open(log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            tracker.log(row)
            self.t = time.perf_counter()
            if self.num_timesteps - self.saved >= cfg.checkpoint_every:
                save_checkpoint(ckpt, agent.modules, agent.optimizers, {}, {"timesteps": self.num_timesteps})
                self.saved = self.num_timesteps

        def _on_step(self) -> bool:
            return True

    t0 = time.perf_counter()
    remaining = config.timesteps - agent.model.num_timesteps
    if remaining > 0:
        with Tracker(run_dir, cfg.get("tracking"), agent.model.num_timesteps) as tracker:
            agent.model.learn(total_timesteps=remaining, callback=Log(), reset_num_timesteps=False,
                              progress_bar=False)
    save_checkpoint(ckpt, agent.modules, agent.optimizers, {}, {"timesteps": agent.model.num_timesteps})
    weights, artifact_config = agent.artifact(phase="online", parent_version=None, timesteps=agent.model.num_timesteps,
                                              config=OmegaConf.to_container(cfg, resolve=True))
    version = publish_once(PolicyRegistry(store.root), weights, artifact_config) if cfg.publish else None
    rows = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
    summary = {"algo": spec.name, "version": version, "timesteps": agent.model.num_timesteps, "env": config.env,
               "wall_s": time.perf_counter() - t0, "final": rows[-1] if rows else {}}
    # the last metrics row was written before SB3's last update; a method's own evaluation of the published agent
    evaluate = getattr(agent, "final_metrics", None)
    if evaluate is not None:
        summary["evaluation"] = evaluate()
    write_json_atomic(os.path.join(run_dir, "summary.json"), summary, indent=1)
    return summary

