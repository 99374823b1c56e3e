"""`robo-post run`: the main job, end to end on embedded defaults.

Stages (each is skipped when its output already exists, so a killed run resumes):

1. ``demos``: the fleet records scripted expert demonstrations (with action noise)
   and "play" episodes (``play.mode``: near misses, or the expert under heavy noise)
   into ``RUN/store``.
2. ``bc``: flow BC on the successful demonstrations -> policy v1 in the registry.
3. ``deploy``: the fleet runs v1 and records its own successes and failures (LWD's
   "rollout" data), so the critic sees the actions of the policy it will improve. In
   the default recipe (``configs/recipe/interventions.yaml``) a scripted overseer
   takes over the episodes still running at half their step limit (interventions).
4. ``lwd``: offline DIVL+QAM on all episodes (demos, play, rollouts) -> v2; then
   online, concurrently: the fleet runs the newest version (overseen likewise) while
   the learner mixes its episodes with the offline data and publishes a version every
   K updates. In the default recipe QAM's base is co-trained on the successful demos
   and the interventions (``lwd.imitation``).
5. ``eval``: every published version on seen and held-out instruction phrasings.
6. ``report``: Markdown/HTML report with success tables, curves and rollout frames.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from robo_post.config import absolute_paths, changed_settings, check_dir_path, compose, describe_changes
from robo_post.pipelines import lwd
from robo_post.store import PolicyRegistry, Store, StoreNotFoundError
from robo_post.utils.io import write_json_atomic


def _compose(name: str, values: dict[str, Any], overrides: list[str] | None = None) -> DictConfig:
    base = compose(name, overrides or [])
    _open_free_form(base, values)
    return OmegaConf.merge(base, values)


def _open_free_form(node: DictConfig, values: dict[str, Any]) -> None:
    """Let ``values`` add keys to the mappings ``node`` leaves empty (``algo.env_kwargs: {}``),
    free-form by design, as ``+key=value`` does on a job's command line; a key any other mapping
    lacks stays an error."""
    for key, value in values.items():
        child = node.get(key) if key in node else None
        if isinstance(child, DictConfig) and isinstance(value, dict):
            if len(child) == 0:
                OmegaConf.set_struct(child, False)
            else:
                _open_free_form(child, value)


def bc_stage_config(cfg: DictConfig) -> DictConfig:
    """The ``robo-post train`` config of the run's first training stage (``bc.*`` over the train
    defaults of ``bc.algo.name``, BC of the demos unless a recipe names another method).

    Raises:
        RunSettingsError: a ``bc.*`` setting that training has not (e.g. a misspelt key).
    """
    method = cfg.bc.algo.get("name")  # a recipe may train another method first (recipe=craft)
    try:
        return _compose("train", {
            "store": run_store(cfg), "run_dir": os.path.join(cfg.run_dir, "bc"),
            "device": cfg.device, "seed": cfg.seed, "show": cfg.show, **OmegaConf.to_container(cfg.bc, resolve=True),
        }, [f"algo={method}"] if method else None)
    except ConfigKeyError as e:
        raise RunSettingsError(f"bc.{e.full_key}: `robo-post train{f' algo={method}' if method else ''}` has no "
                               f"such setting ({e.msg.splitlines()[0]})") from None


def run_store(cfg: DictConfig) -> str:
    """Where the run's episodes and policies live: ``store``, else ``RUN_DIR/store``."""
    return cfg.get("store") or os.path.join(cfg.run_dir, "store")


def collect_stage(cfg: DictConfig, store_root: str, prefix: str, episodes: int, policy: dict[str, Any],
                  follow_registry: bool = False, show: bool | None = None, layout_repeats: int = 1,
                  overseer: dict[str, Any] | None = None) -> None:
    """Record episodes under client ids ``prefix-*`` until they hold ``episodes``; clients run
    ``policy``, or the newest registry version when ``follow_registry``, each layout
    ``layout_repeats`` times, watched by ``overseer`` (``fleet.overseer`` keys) if given."""
    from robo_post.fleet.collect import collect

    try:
        store = Store.open(store_root)
    except StoreNotFoundError:  # the first stage creates it
        store = None
    done = sum(1 for e in store.snapshot() if e.client_id.startswith(f"{prefix}-")) if store else 0
    if done >= episodes:
        return
    collect_cfg = _compose("collect", {
        "store": store_root, "episodes": episodes - done, "seed": cfg.seed, "show": cfg.show if show is None else show,
        "policy": policy,
        "fleet": {"n_clients": cfg.fleet.n_clients, "client_prefix": prefix, "follow_registry": follow_registry,
                  **({"address": cfg.fleet.address} if cfg.fleet.launcher == "ray" else {}),
                  "layout_repeats": layout_repeats, **({"overseer": overseer} if overseer else {})},
    }, [f"fleet={cfg.fleet.launcher}"])
    collect_cfg.env = cfg.env  # replaced whole: another env's kwargs must not merge in
    collect(collect_cfg)


class RunSettingsError(ValueError):
    """A run setting one of its stages cannot take."""


class RunSettingsChangedError(ValueError):
    """A run dir reused with other settings than the run it holds was started with."""


class NoEvalSplitError(ValueError):
    """``eval.splits`` names no split the env has: the run would evaluate nothing."""


# Where and how fast a rerun goes on, at any level (``device``, ``lwd.device``): not what it trains.
RESUMABLE_SETTINGS = ("device", "torch_threads", "show")


def check_same_settings(cfg: DictConfig) -> None:
    """Refuse a ``run_dir`` whose ``config.yaml`` records other settings: finished stages are
    skipped on a rerun, so their data and versions would stay those of the recorded settings
    while ``config.yaml`` and the report claimed the new ones.

    Raises:
        RunSettingsChangedError: names the changed settings with their recorded and new values.
    """
    path = os.path.join(cfg.run_dir, "config.yaml")
    if not os.path.exists(path):
        return

    try:
        recorded = OmegaConf.to_container(OmegaConf.load(path))
    except (yaml.YAMLError, ValueError) as e:  # edited by hand: which settings it held is unknown
        raise RunSettingsChangedError(f"{path} is damaged ({type(e).__name__}); restore it, or use a new "
                                      "run_dir") from None
    changed = {k: v for k, v in changed_settings(recorded, OmegaConf.to_container(cfg, resolve=True)).items()
               if k.rpartition(".")[2] not in RESUMABLE_SETTINGS}
    if changed:
        raise RunSettingsChangedError(
            f"{cfg.run_dir} holds a run with other settings ({describe_changes(changed)}); its "
            "finished stages would be kept as they are. Rerun with the recorded settings to resume it, or use a "
            "new run_dir")


def check_stages(cfg: DictConfig) -> None:
    """Refuse, before the run dir is made, an env the recipe's fleet stages cannot run in: a
    missing expert, play mode or overseer otherwise failed a later stage, after the earlier
    stages (demos, BC training) had run.

    Raises:
        NoExpertError: the env has no scripted expert (the demonstrations need one).
        UnknownExpertModeError: a ``play.mode`` the env's expert does not have.
        OverseerUnsupportedError: ``fleet.overseer.enabled`` on an env without an overseer.
        The first method's ``check_env`` error (e.g. ``CraftDataError``): what it lacks in the env.
        RunSettingsError: a ``bc.*`` setting its training stage has not.
    """
    from robo_post.envs.registry import NoExpertError, UnknownExpertModeError, env_spec
    from robo_post.fleet.client import Overseer
    from robo_post.learner.train import check_env

    spec = env_spec(cfg.env.name)
    if spec.expert is None:
        raise NoExpertError(f"robo-post run records scripted demonstrations; env {spec.key!r} has no scripted "
                            "expert (collect and train on it with `robo-post collect` and `robo-post train`)")
    if cfg.play.episodes and cfg.play.mode not in spec.expert_modes:
        raise UnknownExpertModeError(f"play.mode={cfg.play.mode}: the expert of env {spec.key!r} has no such mode; "
                                     f"modes: {', '.join(spec.expert_modes)} (or play.episodes=0)")
    # the overseer watches the fleet's own policies: the deploy and online stages
    if cfg.fleet.overseer.enabled and (cfg.deploy.episodes or (cfg.lwd.enabled and cfg.lwd.online.episodes)):
        Overseer(spec, **OmegaConf.to_container(cfg.fleet.overseer, resolve=True))
    if cfg.bc.algo.get("name"):  # a recipe's first method may need more of the env (recipe=craft)
        check_env(cfg.bc.algo, spec.key)
    bc_stage_config(cfg)
    if not eval_splits(cfg):  # the run would end having evaluated nothing
        raise NoEvalSplitError(f"eval.splits={list(cfg.eval.splits)}: env {spec.key!r} has no instruction "
                               "splits; only 'train' can be evaluated")


def eval_splits(cfg: DictConfig) -> list[str]:
    """The splits of ``eval.splits`` the env has: held-out instruction phrasings exist only for envs
    with language splits (the default asks for both, so it runs everywhere)."""
    from robo_post.envs.registry import env_spec

    return [s for s in cfg.eval.splits if s == "train" or env_spec(cfg.env.name).split_kwarg is not None]


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run every stage; returns the evaluation results per policy version and split."""
    from robo_post.eval import evaluate, write_report
    from robo_post.learner.tracking import tracking_settings
    from robo_post.learner.train import train

    tracking_settings(cfg.get("tracking"))  # an enabled tracker that is not installed fails before any work
    check_stages(cfg)
    check_dir_path("run_dir", cfg.run_dir)
    check_same_settings(cfg)
    os.makedirs(cfg.run_dir, exist_ok=True)
    store_root = run_store(cfg)
    eval_store = os.path.join(cfg.run_dir, "eval-store")
    path = os.path.join(cfg.run_dir, "config.yaml")
    with open(f"{path}.tmp", "w") as f:  # swapped in whole: a rerun compares its settings with it
        f.write(OmegaConf.to_yaml(absolute_paths(OmegaConf.to_container(cfg, resolve=True))))
    os.replace(f"{path}.tmp", path)

    collect_stage(cfg, store_root, "demo", cfg.demos.episodes, {"kind": "expert", "noise": cfg.demos.noise})
    collect_stage(cfg, store_root, "play", cfg.play.episodes, {"kind": "expert", "noise": cfg.play.noise, "mode": cfg.play.mode})

    registry = PolicyRegistry(store_root)
    bc_dir = os.path.join(cfg.run_dir, "bc")
    if not os.path.exists(os.path.join(bc_dir, "summary.json")):  # not finished: a killed run's stage resumes
        train(bc_stage_config(cfg))

    # The fleet's own policies run under the overseer (interventions), the scripted demos and play do not.
    overseer = OmegaConf.to_container(cfg.fleet.overseer, resolve=True)
    collect_stage(cfg, store_root, "deploy", cfg.deploy.episodes, {"kind": "expert"}, follow_registry=True,
                  layout_repeats=cfg.deploy.layout_repeats, overseer=overseer)

    run_dirs = [bc_dir]
    if cfg.lwd.enabled:
        lwd_dir = os.path.join(cfg.run_dir, "lwd")
        run_dirs.append(lwd_dir)
        summary_path = os.path.join(lwd_dir, "summary.json")
        if not os.path.exists(summary_path):
            lwd.offline(store_root, lwd_dir, cfg.lwd)
        with open(summary_path) as f:
            offline_snapshot = json.load(f)["snapshot"]
        if cfg.lwd.online.episodes and not os.path.exists(os.path.join(lwd_dir, "online.json")):
            # The fleet runs the newest version (hot-swapped at episode boundaries) while the learner trains.
            fleet_error: list[BaseException] = []

            def fleet() -> None:
                try:
                    collect_stage(cfg, store_root, cfg.lwd.online.client_prefix, cfg.lwd.online.episodes,
                                  {"kind": "expert"}, follow_registry=True, show=False, overseer=overseer)
                except BaseException as e:  # re-raised below, after the learner stops
                    fleet_error.append(e)

            thread = threading.Thread(target=fleet, name="fleet", daemon=True)
            thread.start()
            lwd.online(store_root, lwd_dir, cfg.lwd, offline_snapshot, fleet_running=thread.is_alive)
            thread.join()
            if fleet_error:
                raise fleet_error[0]

    splits = eval_splits(cfg)
    results = []
    versions = [v for v in registry.versions() if v >= cfg.eval.from_version]
    for version in versions:
        for split in splits:
            results.append(evaluate(
                store_root, version, list(cfg.env.tasks or []), cfg.eval.episodes_per_task, split=split,
                n_clients=cfg.fleet.n_clients, out_store=eval_store, seed=cfg.eval.seed, show=cfg.show,
            ))
    report = write_report(os.path.join(cfg.run_dir, "report"), results, run_dirs=run_dirs, eval_store=eval_store)
    summary = {
        "report": report,
        "results": [{"version": r["policy"]["version"], "split": r["split"], "mean_success": r["mean_success_rate"],
                     "per_task": {t: d["success_rate"] for t, d in r["tasks"].items()}} for r in results],
    }
    write_json_atomic(os.path.join(cfg.run_dir, "summary.json"), summary, indent=1)
    return summary
