"""Evaluate one policy version on any env's tasks with a fleet of pinned-version clients.

Eval episodes go to their own store (``out_store``), never the training store, so
evaluation cannot leak into training data. Each evaluation writes its own shards,
named after a digest of everything that determines the episodes (policy weights,
tasks, split, counts, env, seed): re-running an identical evaluation resumes or
reuses those shards instead of recording again, and any change records afresh.

Per task the results hold the success rate with a 95% Wilson interval where the env
defines success (its registry entry's success rule; ``None`` otherwise), mean return
and mean length with 95% intervals, and the env's per-episode metrics (recorded by the
fleet in each episode's ``attrs["metrics"]``): rates (boolean metrics, e.g. driving's
collision) with Wilson intervals, means (e.g. mean speed) with t intervals.

Results are a JSON-ready dict (see ``evaluate``), saved to
``OUT_STORE/evals/<tag>.json``; ``load_results`` reads them back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from typing import Any, Iterable, Literal, Mapping

import numpy as np
import safetensors.torch

from robo_post.envs.registry import EnvSpec, NoExpertError, env_spec
from robo_post.fleet.client import ClientConfig, recorded_env_kwargs, store_schema
from robo_post.fleet.launcher import LocalLauncher, raise_unfinished
from robo_post.store import EpisodeInfo, PolicyNotFoundError, PolicyRegistry, Store
from robo_post.utils.device import resolve_device
from robo_post.utils.io import absolute_root, is_object_url, write_json_atomic

Split = Literal["train", "heldout"]

# Base seed of eval episodes. Training fleets default to seed 0; a distinct base
# seed (and distinct client ids) gives eval episodes layouts the learner never saw.
EVAL_SEED = 1_000_003
RESULTS_DIR = "evals"
_RESULT_KEYS = ("created", "policy", "split", "tasks", "overall", "mean_success_rate", "episodes_per_task")
EXPERT = {"kind": "expert"}


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (default: 95%; ``scipy.stats.binomtest``).

    Unlike the normal approximation it stays inside [0, 1] and is sensible at
    0/n and n/n, which is where small eval sets usually land. ``n = 0`` gives (0, 1).
    """
    from scipy.stats import binomtest

    if n == 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    ci = binomtest(successes, n).proportion_ci(confidence, method="wilson")
    # At 0/n and n/n the bound is exactly 0 or 1 (the formula leaves rounding noise there).
    return (0.0 if successes == 0 else float(ci.low)), (1.0 if successes == n else float(ci.high))


def mean_interval(values: Iterable[float], confidence: float = 0.95, low: float | None = None,
                  high: float | None = None) -> list[float] | None:
    """Two-sided Student-t interval of a mean (default: 95%); ``None`` for fewer than two values.

    t rather than the normal quantile, since eval sets are often a handful of episodes
    per task; it still assumes the mean is roughly normal (many episodes, or mild spread).
    ``low`` / ``high``: bounds the values cannot leave (0 for a count, 0 and 1 for a
    fraction), where known; the interval is clipped to them, since a few skewed values
    otherwise give bounds the mean cannot take (a negative length).
    """
    from scipy.stats import t

    x = np.asarray(list(values), dtype=np.float64)
    if len(x) < 2:
        return None
    half = float(t.ppf(0.5 + confidence / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    lo, hi = float(x.mean()) - half, float(x.mean()) + half
    return [lo if low is None else max(lo, low), hi if high is None else min(hi, high)]


def pct(x: float | None) -> str:
    """A rate as a whole percentage, ``–`` when undefined."""
    return "–" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def format_rate(stats: dict[str, Any]) -> str:
    """``80% [49%–94%]``: success rate and 95% interval of one task's stats (``–`` if undefined)."""
    if stats.get("success_rate") is None:
        return "–"
    lo, hi = stats["ci95"]
    return f"{pct(stats['success_rate'])} [{pct(lo)}–{pct(hi)}]"


def format_mean(value: float | None, ci: list[float] | None, digits: int = 2) -> str:
    """``12.30 [10.10–14.50]``; ``–`` when undefined, no interval below two episodes (or
    where a saved result holds ``null`` for a non-finite bound)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}" + (f" [{ci[0]:.{digits}f}–{ci[1]:.{digits}f}]" if ci and None not in ci else "")


def report_console() -> Any:
    """A rich console for result tables: a terminal's own width, and no width limit when the output
    goes to a pipe or a file (rich's 80 columns there cut intervals short: "[935.31–214…")."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=10_000)


def format_metric(stats: dict[str, Any]) -> str:
    """One env metric's stats (a rate or a mean) with its interval."""
    if "rate" in stats:
        lo, hi = stats["ci95"]
        return f"{pct(stats['rate'])} [{pct(lo)}–{pct(hi)}]"
    return format_mean(stats["mean"], stats["ci95"])


def policy_label(version: int | None, kind: str = "expert") -> str:
    """Display name of an evaluated policy: ``v3``, or the policy kind (``expert``) for version 0/None."""
    return f"v{version}" if version else kind


def evaluate(
    policy_store: str,
    version: int | None,
    tasks: Iterable[str] | None,
    episodes_per_task: int,
    split: Split = "train",
    n_clients: int = 2,
    env_kwargs: dict[str, Any] | None = None,
    out_store: str | None = None,
    seed: int = EVAL_SEED,
    show: bool = False,
    *,
    env: str | None = None,
    policy: dict[str, Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run one policy version on every task and return its stats with 95% CIs.

    Args:
        policy_store: store whose registry holds the policy (also the training store).
        version: registry version to evaluate, pinned (no hot-swap). ``0`` or ``None``
            runs ``policy`` instead.
        tasks: the env's tasks; ``None``/empty: its default tasks (an env without tasks
            has one, its id).
        episodes_per_task: episodes per task, spread over the clients.
        split: instruction phrasings: ``train`` or ``heldout`` (unseen wording), for
            envs with instruction splits; others only have ``train``.
        n_clients: parallel client processes.
        env_kwargs: env constructor kwargs, each on top of those every episode of the
            policy store was collected with (recorded per episode) and of what the env's
            registry entry infers from the policy (tabletop: camera images at the policy's
            ``image_size`` if it reads images, else state-only).
        out_store: eval store (created if missing); default ``<policy_store>-eval``.
        seed: base seed of eval episodes; keep it apart from training seeds.
        show: live per-client progress table.
        env: env alias or gymnasium id; ``None``: the env the policy store was recorded in.
        policy: artifact config run for version 0/None (default: the env's scripted
            expert), e.g. ``{"kind": "random"}`` or an ``sb3`` agent.
        device: torch device the policy runs on.

    Returns:
        A JSON-ready dict (non-finite numbers as ``None``), also saved at its ``results_path``:

        - ``policy``: ``version`` (0 = ``policy``), ``label``, ``store``, ``config`` (provenance).
        - ``tasks``: task -> ``episodes``, ``successes``, ``judged`` (episodes with a
          defined success), ``success_rate`` and ``ci95`` (Wilson ``[low, high]``; both
          ``None`` when the env defines no success), ``mean_return``, ``return_ci95``,
          ``mean_length``, ``length_ci95`` (t intervals, ``None`` below two episodes),
          ``metrics`` (name -> ``{"rate", "ci95"}`` or ``{"mean", "ci95"}``, plus ``episodes``).
        - ``mean_success_rate``: unweighted mean over tasks (``None`` if undefined);
          ``overall``: the same stats over all episodes pooled.
        - ``episodes``: one row per episode (key, task, seed, success, length, return, metrics, ...).
        - ``train_seed_overlap``: eval episodes whose seed also occurs in the policy store.
        - ``success_rule``, ``split``, ``env``, ``seed``, ``eval_store``, ``shards``, ``tag``, ``wall_s``, ``created``.
    """
    if episodes_per_task < 1 or n_clients < 1:
        raise ValueError("need at least one episode per task and one client")
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'heldout'")
    policy_store = absolute_root(policy_store)
    out_store = absolute_root(out_store or policy_store.rstrip("/") + "-eval")
    if out_store == policy_store:
        raise ValueError("out_store must differ from policy_store so eval episodes never become training data")
    spec = env_spec(env or _recorded_env(policy_store))
    tasks = list(tasks or spec.default_tasks())
    version = version or None
    baseline = dict(policy or EXPERT)
    _check_baseline(spec, version, baseline)
    policy_config, weights_digest = _policy_identity(policy_store, version, baseline)
    recorded = recorded_env_kwargs(policy_store, spec)
    env_cfg = {"name": spec.key, **_env_kwargs(spec, policy_config, env_kwargs, split, recorded)}

    identity = {"policy_store": policy_store, "version": version, "weights": weights_digest, "tasks": tasks,
                "episodes_per_task": episodes_per_task, "n_clients": n_clients, "env": env_cfg, "seed": seed}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    label = policy_label(version, baseline.get("kind", "expert"))
    tag = f"{label}-{split}-{digest}"
    schema = store_schema(env_cfg, tasks[0])
    if version:
        check_observations(Store.open(policy_store).schema, schema, env_cfg, policy_config)
    store = Store.create(out_store, schema, exist_ok=True)
    configs = [
        ClientConfig(
            store=store.root, client_id=f"eval-{tag}-c{i}", episodes=k * len(tasks), env=env_cfg, tasks=tasks,
            policy=baseline, follow_registry=False, seed=seed, seed_key=f"eval-c{i}",  # same layouts for every version
            policy_store=policy_store if version else None, policy_version=version, role="eval", device=device,
        )
        for i, k in enumerate(_episodes_per_client(episodes_per_task, n_clients))
        if k > 0
    ]
    t0 = time.perf_counter()
    # Shards already holding their episodes (an identical earlier eval) need no client.
    pending = [c for c in configs if store.read_commit(c.client_id)["episodes"] < c.episodes]
    statuses = LocalLauncher(pending).run(show=show) if pending else []
    raise_unfinished(statuses, "eval clients", store.root)

    snap = store.snapshot()
    episodes = [e for c in configs for e in snap.episodes(client=c.client_id)[: c.episodes]]
    episodes, success_rule = _judged(episodes, spec, policy_store)
    limit = _step_limit(env_cfg, episodes)
    bounds = {**spec.bounds, "length": (0, limit)} if limit is not None else spec.bounds
    result = _summarise(episodes, tasks, spec.metric_ids, bounds)
    result.update(
        policy={"version": version or 0, "label": label, "store": policy_store,
                "config": _provenance(policy_config)},
        success_rule=success_rule, split=split, env=env_cfg, seed=seed, n_clients=n_clients,
        episodes_per_task=episodes_per_task, eval_store=store.root, snapshot=snap.id,
        shards=[c.client_id for c in configs], tag=tag,
        train_seed_overlap=_seed_overlap(policy_store, episodes), wall_s=time.perf_counter() - t0,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        results_path=f"{store.root}/{RESULTS_DIR}/{tag}.json",
    )
    return _save_result(result)


def _episodes_per_client(episodes_per_task: int, n_clients: int) -> list[int]:
    """Client i runs k_i episodes of every task (tasks cycle episode by episode), so each task
    gets exactly ``episodes_per_task`` episodes and the work is balanced."""
    return [episodes_per_task // n_clients + (i < episodes_per_task % n_clients) for i in range(n_clients)]


def _judged(episodes: list[EpisodeInfo], spec: EnvSpec, policy_store: str) -> tuple[list[EpisodeInfo], str]:
    """(``episodes`` with a success label where the env gives none, the rule they are judged by):
    the env's success rule; where it says nothing, the rule the policy store's episodes were
    imported with (a dataset's own success), so eval judges as the data was judged."""
    if all(e.success is not None for e in episodes):
        return episodes, spec.success_rule
    from robo_post.store.minari_io import imported_rule, stored_success

    rule = imported_rule(Store.open(policy_store).snapshot().episodes())
    if rule is None:
        return episodes, spec.success_rule
    return ([e if e.success is not None else dataclasses.replace(e, success=stored_success(rule, e)) for e in episodes],
            f"{rule}: the rule the policy store's episodes were imported with (the env defines none)")


def _save_result(result: dict[str, Any]) -> dict[str, Any]:
    """Write ``result`` to its ``results_path`` and return it as written: non-finite floats
    (a NaN return, an infinite interval) become ``None``, since JSON has no NaN or Infinity
    and strict parsers reject the bare ``NaN`` that ``json.dump`` writes by default."""
    result = _finite(result)
    path = result["results_path"]
    if is_object_url(path):
        from robo_post.store.bucket import write_object

        write_object(path, json.dumps(result).encode())
        return result
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path, result, fsync=False)
    return result


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth of dicts and lists, as ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def in_process_success(model: Any, tasks: Iterable[str], episodes_per_task: int, seed: int = EVAL_SEED,
                       outcomes: list[bool] | None = None, env: str | None = None,
                       env_kwargs: dict[str, Any] | None = None) -> dict[str, float]:
    """Success rate per task of a flow policy rolled out in this process (no store).

    Cheap periodic evaluation during training; the fleet-based ``evaluate`` is the
    reported number. Episodes use ``episode_seed(seed, task, i)`` layouts. If given,
    ``outcomes`` gets each episode's success appended, task by task, as it ends.

    Returns ``success/<task>`` and ``success/mean``; for an env that defines no success,
    ``return/<task>`` and ``return/mean`` (mean episode return) instead.

    Args:
        env: env alias or gymnasium id; ``None``: the one of robo-post's envs whose
            default tasks include every task.
        env_kwargs: env constructor kwargs (those the data was recorded with), under what the
            env's entry infers from the policy.
    """
    from robo_post.fleet.client import episode_seed
    from robo_post.models.flow import FlowPolicyRunner

    spec = env_spec(env) if env is not None else _env_of_tasks(list(tasks))
    config = {"model": model.config.to_json()}  # as in the policy's artifact
    env_kwargs = {**(env_kwargs or {}), **(spec.policy_env_kwargs(config) if spec.policy_env_kwargs else {})}
    was_training = model.training
    runner = FlowPolicyRunner(model, device=str(model.device))
    out: dict[str, float] = {}
    for task in tasks:
        instance = spec.make(task, **env_kwargs)
        successes, returns = [], []
        for i in range(episodes_per_task):
            s = episode_seed(seed, task, i)
            obs, info = instance.reset(seed=s)
            runner.reset(instance, s)
            done, ret = False, 0.0
            while not done:
                obs, reward, terminated, truncated, info = instance.step(runner.act(obs, instance))
                ret += float(reward)
                done = terminated or truncated
            returns.append(ret)
            success = spec.success(info)
            if success is not None:
                successes.append(success)
                if outcomes is not None:
                    outcomes.append(success)
        instance.close()
        if successes:
            out[f"success/{task}"] = float(np.mean(successes))
        else:
            out[f"return/{task}"] = float(np.mean(returns))
    for kind in ("success", "return"):
        values = [v for k, v in out.items() if k.startswith(f"{kind}/")]
        if values:
            out[f"{kind}/mean"] = float(np.mean(values))
    model.train(was_training)
    return out


def _check_baseline(spec: EnvSpec, version: int | None, baseline: dict[str, Any]) -> None:
    """Version 0/None runs ``baseline``; the default, the scripted expert, needs an env that has one."""
    if not version and baseline.get("kind") == "expert" and spec.expert is None:
        raise NoExpertError(f"env {spec.key!r} has no scripted expert: evaluate a registry version, or pass "
                            "a policy for version 0 (e.g. {'kind': 'random'})")


def eval_from_config(cfg: Any) -> list[dict[str, Any]]:
    """`robo-post eval`: evaluate every ``cfg.version`` x ``cfg.split`` and print a table.

    ``version`` is a registry version, ``latest``, or 0/null for ``cfg.policy`` (the
    env's scripted expert when null); ``version`` and ``split`` may be lists. The env
    is ``cfg.env.name``, else the one the store was recorded in; tasks are ``cfg.tasks``, else ``cfg.env.tasks``, else the env's.
    """
    from omegaconf import OmegaConf
    from rich.table import Table

    versions = cfg.version if OmegaConf.is_list(cfg.version) else [cfg.version]
    splits = cfg.split if OmegaConf.is_list(cfg.split) else [cfg.split]
    store = Store.open(cfg.store)
    registry = PolicyRegistry(store.root)
    env_name = cfg.env.name or store.schema.attrs.get("env")
    if env_name is None:
        raise ValueError(f"the store at {store.root} does not say which env it was recorded in; pass env=NAME or a gymnasium id")
    if cfg.env_kwargs is not None and not OmegaConf.is_dict(cfg.env_kwargs):
        raise ValueError(f"env_kwargs={cfg.env_kwargs!r}: a mapping of env kwargs, e.g. 'env_kwargs={{duration: 20}}'")
    env_kwargs = None if cfg.env_kwargs is None else OmegaConf.to_container(cfg.env_kwargs, resolve=True)
    policy = None if cfg.policy is None else OmegaConf.to_container(cfg.policy, resolve=True)
    tasks = list(cfg.tasks or cfg.env.tasks or env_spec(env_name).default_tasks())
    # None (cfg.policy) for `latest` while nothing is published
    versions = [registry.latest() if v == "latest" else v for v in versions]
    # every version up front: a missing one in a list failed only after the others' evals had run
    published = registry.versions()
    if missing := [v for v in versions if v not in (None, 0) and v not in published]:
        raise PolicyNotFoundError(f"policy version(s) {missing} not found in {registry.location}; published: "
                                  f"{published or 'none'}")
    for version in versions:
        _check_baseline(env_spec(env_name), version, dict(policy or EXPERT))
    results = []
    for version in versions:
        for split in splits:
            results.append(evaluate(
                cfg.store, version, tasks, cfg.episodes_per_task, split=split, n_clients=cfg.n_clients,
                env_kwargs=env_kwargs, out_store=cfg.out_store, seed=cfg.seed, show=cfg.show,
                env=env_name, policy=policy, device=str(resolve_device(cfg.device)),
            ))
    console = report_console()
    table = Table("policy", "split", *tasks, "mean", title="success rate [95% Wilson CI]")
    for r in results:
        table.add_row(r["policy"]["label"], r["split"], *(format_rate(r["tasks"][t]) for t in tasks),
                      format_rate({**r["overall"], "success_rate": r["mean_success_rate"]}))
    console.print(table)
    table = Table("policy", "split", "task", "return [95% CI]", "length [95% CI]", "env metrics [95% CI]",
                  title="return, length and env metrics")
    for r in results:
        for t in tasks:
            s = r["tasks"][t]
            metrics = ", ".join(f"{k} {format_metric(v)}" for k, v in s["metrics"].items()) or "–"
            table.add_row(r["policy"]["label"], r["split"], t, format_mean(s["mean_return"], s["return_ci95"]),
                          format_mean(s["mean_length"], s["length_ci95"], 1), metrics)
    console.print(table)
    for r in results:
        console.print(f"results: {r['results_path']}")
    return results


def load_results(eval_store: str) -> list[dict[str, Any]]:
    """Every result saved in ``EVAL_STORE/evals/``, oldest first."""
    if is_object_url(eval_store):
        from robo_post.store.bucket import object_names

        directory = f"{eval_store.rstrip('/')}/{RESULTS_DIR}"
        names = object_names(directory)
    else:
        directory = os.path.join(eval_store, RESULTS_DIR)
        names = os.listdir(directory) if os.path.isdir(directory) else []
    results = [read_result(f"{directory}/{name}") for name in sorted(names) if name.endswith(".json")]
    return sorted(results, key=lambda r: r["created"])


def read_json_object(path: str, what: str, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON object holding ``keys``; anything else is a ``ValueError`` naming the file as not ``what``."""
    try:
        if is_object_url(path):
            from robo_post.store.bucket import read_object

            if (data := read_object(path)) is None:
                raise FileNotFoundError(f"no object {path}")
            value = json.loads(data)
        else:
            with open(path) as f:
                value = json.load(f)
        if not isinstance(value, dict):
            raise ValueError(f"a JSON {type(value).__name__}, not an object")
        if missing := [k for k in keys if k not in value]:
            raise ValueError(f"no {', '.join(missing)}")
    except ValueError as e:
        raise ValueError(f"{path} is not {what} ({e})") from e
    return value


def read_result(path: str) -> dict[str, Any]:
    """One saved eval result; a file that is not one is a ``ValueError`` naming it."""
    return read_json_object(path, "an eval result", _RESULT_KEYS)


def _recorded_env(policy_store: str) -> str:
    """The env a store's episodes were recorded in (its schema's ``env`` attr)."""
    name = Store.open(policy_store).schema.attrs.get("env")
    if not name:
        raise ValueError(f"store {policy_store} does not record its env; pass env=")
    return name


def _env_of_tasks(tasks: list[str]) -> EnvSpec:
    from robo_post.envs.registry import registered_specs

    for spec in registered_specs():
        if set(tasks) <= set(spec.default_tasks()):
            return spec
    raise ValueError(f"no registered env has the tasks {tasks}; pass env=")


class EnvMismatchError(ValueError):
    """The eval env's observations or actions differ from those of the data the policy was trained on."""


def check_observations(trained: Any, evaluated: Any, env_cfg: dict[str, Any], policy_config: dict[str, Any],
                       hint: str | None = None) -> None:
    """Fail before any client starts when the env built for the eval observes the keys the
    policy reads (its feature spec; else every key both have) with other shapes than the
    policy store recorded (an env kwarg of the training data that was not repeated), or
    takes other actions (dtype, shape, bounds: the policy's actions would be clipped to
    another range, e.g. on another env given as ``env=``). ``hint``: the fix the error
    names (default: the eval's own ``env_kwargs``)."""
    features = (policy_config.get("model") or {}).get("features")
    keys = list(features) if isinstance(features, dict) else [k for k in trained.observations if k in evaluated.observations]
    want = {k: (s.dtype, tuple(s.shape)) for k, s in trained.observations.items() if k in keys}
    got = {k: (s.dtype, tuple(s.shape)) for k, s in evaluated.observations.items() if k in keys}
    kwargs = {k: v for k, v in env_cfg.items() if k != "name"}
    recorded_in = trained.attrs.get("env")
    hint = (f"the policy's data was recorded in env {recorded_in!r}"
            if recorded_in is not None and recorded_in.rpartition(":")[2] != env_cfg["name"].rpartition(":")[2]
            else hint or "pass the env kwargs its data was collected with (env_kwargs={...})")
    if want != got:
        observed = {k: (s.dtype, tuple(s.shape)) for k, s in evaluated.observations.items()}  # all it observes
        raise EnvMismatchError(
            f"env {env_cfg['name']!r} with kwargs {kwargs} observes {observed}, but the policy was trained on {want}: "
            f"{hint}")
    if not _same_action(trained.action, evaluated.action):
        raise EnvMismatchError(
            f"env {env_cfg['name']!r} with kwargs {kwargs} takes actions {_action_text(evaluated.action)}, but the "
            f"policy was trained on actions {_action_text(trained.action)}: {hint}")


def _same_action(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bounds (to float32 precision: a dataset may store its bounds rounded)."""
    def close(x: Any, y: Any) -> bool:
        if x is None or y is None:
            return x is None and y is None
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return x.shape == y.shape and bool(np.allclose(x, y, rtol=1e-6, atol=0.0))

    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and close(a.low, b.low) and close(a.high, b.high)


def _action_text(spec: Any) -> str:
    return f"{spec.dtype} {tuple(spec.shape)} in [{spec.low}, {spec.high}]"


def _env_kwargs(spec: EnvSpec, policy_config: dict[str, Any], env_kwargs: dict[str, Any] | None,
                split: str, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Env kwargs of an eval: the ``recorded`` collection kwargs, what the env's entry infers
    from the policy on top, and the given ones on top of both (one key at a time: a given
    ``observed_vehicles`` keeps the recorded ``intentions``); checked against what the policy
    needs; the split passed on where the env has instruction splits."""
    needed = spec.policy_env_kwargs(policy_config) if spec.policy_env_kwargs else {}
    kwargs = {**(recorded or {}), **needed, **(env_kwargs or {})}
    missing = {k: v for k, v in needed.items() if v and kwargs.get(k) != v}
    if missing:  # fail here, not as crash-looping clients
        raise ValueError(f"the policy needs env kwargs {missing}; env_kwargs {env_kwargs} lack them")
    if spec.split_kwarg is not None:
        kwargs[spec.split_kwarg] = split
    elif split != "train":
        raise ValueError(f"env {spec.key!r} has no instruction splits; split must be 'train', got {split!r}")
    return kwargs


def _policy_identity(policy_store: str, version: int | None, baseline: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The policy's config and a digest of its weights (so a retrained store never
    reuses stale eval shards). Version 0 runs ``baseline``: its digest covers its
    config and, for a policy loaded from a file (``path``), the file's bytes."""
    if version is None:
        h = hashlib.sha256(json.dumps(baseline, sort_keys=True).encode())
        if "path" in baseline:
            with open(baseline["path"], "rb") as f:
                h.update(f.read())
        return baseline, h.hexdigest()
    weights, config = PolicyRegistry(policy_store).load(version)
    return config, hashlib.sha256(safetensors.torch.save(weights)).hexdigest()


def _provenance(policy_config: dict[str, Any]) -> dict[str, Any]:
    """The small, human-relevant part of a policy config (not the full training config)."""
    keys = ("kind", "algorithm", "parent_version", "snapshot", "episodes", "updates", "noise", "mode", "algo", "path")
    return {k: policy_config[k] for k in keys if k in policy_config}


def _metric_stats(values: list[bool | float], bounds: tuple[float | None, float | None] = (None, None)
                  ) -> dict[str, Any]:
    """A boolean metric as a rate with a Wilson interval, a numeric one as a mean with a t interval
    clipped to the metric's ``bounds``."""
    if all(isinstance(v, bool) for v in values):
        k = sum(values)
        return {"rate": k / len(values), "ci95": list(wilson_interval(k, len(values))), "episodes": len(values)}
    return {"mean": float(np.mean(values)), "ci95": mean_interval(values, 0.95, *bounds), "episodes": len(values)}


Bounds = Mapping[str, tuple[float | None, float | None]]  # EnvSpec.bounds


def _task_stats(episodes: list[EpisodeInfo], ids: Iterable[str] = (), bounds: Bounds | None = None) -> dict[str, Any]:
    bounds = bounds or {}
    n = len(episodes)
    judged = [e for e in episodes if e.success is not None]
    k = sum(bool(e.success) for e in judged)
    metrics: dict[str, list] = {}
    for e in episodes:
        for name, value in e.attrs.get("metrics", {}).items():
            if name not in ids:  # a mean of world indices or seeds is no statistic
                metrics.setdefault(name, []).append(value)
    return {
        "episodes": n,
        "successes": k,
        "judged": len(judged),
        "success_rate": k / len(judged) if judged else None,
        "ci95": list(wilson_interval(k, len(judged))) if judged else None,
        "mean_length": float(np.mean([e.length for e in episodes])) if n else None,
        "length_ci95": mean_interval((e.length for e in episodes), 0.95, *bounds.get("length", (0, None))),
        "mean_return": float(np.mean([e.ret for e in episodes])) if n else None,
        "return_ci95": mean_interval((e.ret for e in episodes), 0.95, *bounds.get("return", (None, None))),
        "metrics": {name: _metric_stats(values, bounds.get(name, (None, None))) for name, values in metrics.items()},
    }


def _step_limit(env_cfg: dict[str, Any], episodes: list[EpisodeInfo]) -> int | None:
    """The most steps any of ``episodes`` could last: the kwargs' ``max_episode_steps`` (a dataset's
    recorded one included), else the largest limit the clients' envs reported; None when unknown."""
    limit = env_cfg.get("max_episode_steps")
    if isinstance(limit, int) and limit > 0:
        return limit
    reported = [e.attrs.get("step_limit") for e in episodes]
    return max(reported) if reported and all(isinstance(n, int) and n > 0 for n in reported) else None


def _summarise(episodes: list[EpisodeInfo], tasks: list[str], ids: Iterable[str] = (),
               bounds: Bounds | None = None) -> dict[str, Any]:
    """Per-task and overall statistics, and one row per episode; metrics named in ``ids`` (the
    env's ``metric_ids``) stay in the rows only; intervals are clipped to the env's ``bounds``."""
    per_task = {t: _task_stats([e for e in episodes if e.task_id == t], ids, bounds) for t in tasks}
    rates = [s["success_rate"] for s in per_task.values() if s["success_rate"] is not None]
    return {
        "tasks": per_task,
        "mean_success_rate": float(np.mean(rates)) if rates else None,
        "overall": _task_stats(episodes, ids, bounds),
        "episodes": [
            {"key": e.key, "task": e.task_id, "seed": e.seed, "success": e.success, "length": e.length,
             "return": e.ret, "metrics": e.attrs.get("metrics", {}), "policy_version": e.policy_version,
             "instruction": e.instruction}
            for e in episodes
        ],
    }


def _seed_overlap(policy_store: str, episodes: list[EpisodeInfo]) -> int:
    """How many eval episodes reuse a layout seed recorded in the policy store."""
    store = Store.open(policy_store)  # read shard metadata directly: a snapshot would write into the training store
    train_seeds = {e.seed for shard in store.shards() for e in store.shard_episodes(shard)}
    return sum(e.seed in train_seeds for e in episodes)
