"""Experiment tracking: each logged metrics row, as scalars, to TensorBoard and optionally W&B or MLflow.

A run's ``tracking`` settings (``configs/train.yaml``; ``tracking`` in ``configs/run.yaml``):

- ``tensorboard: true`` (default) writes event files to ``RUN/tensorboard/``
  (``tensorboard --logdir RUN``); ``false`` writes none.
- ``wandb: {project: ..., ...}`` logs the same rows to Weights & Biases; the mapping is
  passed to ``wandb.init`` (``true`` = its defaults). Needs ``pip install wandb``.
- ``mlflow: {experiment: ..., tracking_uri: ..., run_name: ...}`` logs them to MLflow
  (``true`` = its defaults). Needs ``pip install mlflow``.

Every numeric value of a row except ``update`` and ``time`` becomes a scalar at
``step = row["update"]`` (wall time ``row["time"]``). Neither W&B nor MLflow is a
dependency: enabling one that is not installed raises ``TrackingError`` before training.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

# Row keys that are the step and the wall clock, not metrics.
NOT_SCALARS = ("update", "time")
MLFLOW_KEYS = ("experiment", "tracking_uri", "run_name")


class TrackingError(ValueError):
    """A tracking setting that cannot be honoured (unknown key, tracker not installed)."""


def tracking_settings(tracking: Mapping[str, Any] | None) -> dict[str, Any]:
    """Normalised ``tracking`` settings: ``tensorboard`` a bool, ``wandb``/``mlflow`` None (off) or
    a dict of options. Raises ``TrackingError`` for an unknown key or an enabled tracker that is
    not installed, so a run fails before it trains."""
    tracking = OmegaConf.to_container(tracking, resolve=True) if OmegaConf.is_config(tracking) else dict(tracking or {})
    unknown = sorted(set(tracking) - {"tensorboard", "wandb", "mlflow"})
    if unknown:
        raise TrackingError(f"unknown tracking settings {unknown}; known: tensorboard, wandb, mlflow")
    out: dict[str, Any] = {"tensorboard": bool(tracking.get("tensorboard", True))}
    for name in ("wandb", "mlflow"):
        value = tracking.get(name)
        if value is None or value is False:
            out[name] = None
            continue
        options = {} if value is True else dict(value)
        if name == "mlflow" and set(options) - set(MLFLOW_KEYS):
            raise TrackingError(f"unknown tracking.mlflow settings {sorted(set(options) - set(MLFLOW_KEYS))}; "
                                f"known: {', '.join(MLFLOW_KEYS)}")
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise TrackingError(f"tracking.{name} is enabled but {name} is not installed ({e}); "
                                f"`pip install {name}` or set tracking.{name}=null") from e
        out[name] = options
    return out


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's metrics as floats (numbers only; ``update`` and ``time`` left out)."""
    return {k: float(v) for k, v in row.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker:
    """Sends metrics rows to the enabled trackers; use as a context manager.

    Args:
        run_dir: the run's folder (TensorBoard writes to ``run_dir/tensorboard``).
        tracking: the ``tracking`` settings (see the module docstring); None = TensorBoard only.
        start: the step a resumed run continues after (0: a fresh start); TensorBoard hides
            events logged after it by the interrupted run (as ``metrics.jsonl`` drops their rows).
    """

    def __init__(self, run_dir: str, tracking: Mapping[str, Any] | None = None, start: int = 0):
        settings = tracking_settings(tracking)
        self.tensorboard = self.wandb = self.mlflow = None
        name = os.path.basename(os.path.normpath(run_dir))
        if settings["tensorboard"]:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start + 1)
        if settings["wandb"] is not None:
            import wandb

            self.wandb = wandb.init(**{"dir": run_dir, "name": name, **settings["wandb"]})
        if settings["mlflow"] is not None:
            import mlflow

            options = settings["mlflow"]
            if options.get("tracking_uri"):
                mlflow.set_tracking_uri(options["tracking_uri"])
            if options.get("experiment"):
                mlflow.set_experiment(options["experiment"])
            self.mlflow = mlflow
            mlflow.start_run(run_name=options.get("run_name") or name)

    def log(self, row: Mapping[str, Any]) -> None:
        """Log every metric of ``row`` at step ``row["update"]``."""
        values, step = scalars(row), int(row["update"])
        if self.tensorboard is not None:
            for k, v in values.items():
                self.tensorboard.add_scalar(k, v, step, walltime=row.get("time"))
            self.tensorboard.flush()  # rows are a log window apart: show each as it lands
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        """Flush and close every tracker."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
