"""Run records: what a ``run_dir`` holds about its run, and the checks made on it before a
run starts, resumes or is taken as finished.

A run records its settings in ``config.yaml`` (``begin_run``), its progress in a checkpoint
and, once done, its ``summary.json``. From those, ``finished_run`` hands back a finished
run's summary instead of training again, ``check_resume`` refuses to resume a run under
other settings or a smaller budget, and ``run_lock`` keeps two processes out of one run dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from typing import Any, Callable, Iterator

import yaml
from omegaconf import DictConfig, OmegaConf

from robo_post.config import absolute_paths, changed_settings, check_dir_path, describe_changes
from robo_post.learner.checkpoint import CheckpointError, checkpoint_state, has_checkpoint
from robo_post.store import PolicyArtifactError, PolicyNotFoundError, PolicyRegistry
from robo_post.utils.io import try_lock

# The settings a run's weights were trained with, once a publication under other settings
# (a finished run rerun with them) has rewritten its config.yaml.
TRAINED_RECORD = "trained_config.yaml"


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
