"""The update loop shared by every method that trains on batches.

The loop is method-agnostic: a method exposes ``modules``, ``optimizers`` and
``update(batch) -> metrics``. The loop logs metric windows to
``RUN/metrics.jsonl``, checkpoints to ``RUN/checkpoint`` (resume continues
bit-for-bit) and shows progress; drivers (``robo_post.learner.drivers``) publish.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import numpy as np
import torch

from robo_post.learner.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def truncate_log(path: str, last_update: int) -> None:
    """Drop log lines written after the checkpoint we resume from."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if json.loads(line)["update"] <= last_update]
    with open(path, "w") as f:
        f.writelines(keep)


def train_loop(
    algo: Any,
    sample: Callable[[], dict],
    run_dir: str,
    updates: int,
    rngs: dict[str, np.random.Generator],
    log_every: int = 100,
    checkpoint_every: int = 1000,
    eval_every: int = 0,
    evaluate: Callable[[int], dict[str, float]] | None = None,
    show: bool = True,
    after_update: Callable[[int], None] | None = None,
) -> list[dict[str, float]]:
    """Run ``updates`` updates of ``algo`` (resuming from ``run_dir`` if a checkpoint exists).

    ``after_update(update)`` runs after each update, before its checkpoint (e.g. to publish).

    Returns the logged metric windows (each the mean over ``log_every`` updates).
    """
    os.makedirs(run_dir, exist_ok=True)
    ckpt, log_path = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "metrics.jsonl")
    start = 0
    if has_checkpoint(ckpt):
        start = load_checkpoint(ckpt, algo.modules, algo.optimizers, rngs)["update"]
        truncate_log(log_path, start)
        if hasattr(algo, "updates"):  # algorithms that schedule on the step count
            algo.updates = start
    logged: list[dict[str, float]] = []
    window: dict[str, list[float]] = {}
    t_window, wait = time.perf_counter(), 0.0
    progress = _progress(show, updates, start)
    with progress, open(log_path, "a") as log:
        task = progress.add_task("train", total=updates, completed=start, info="")
        for update in range(start + 1, updates + 1):
            t0 = time.perf_counter()
            batch = sample()
            wait += time.perf_counter() - t0
            for k, v in algo.update(batch).items():
                window.setdefault(k, []).append(v)
            if after_update is not None:
                after_update(update)
            if update % log_every == 0 or update == updates:
                elapsed = time.perf_counter() - t_window
                row = {"update": update, **{k: float(np.mean(v)) for k, v in window.items()}}
                row.update(updates_per_s=len(next(iter(window.values()))) / elapsed, data_wait=wait / elapsed)
                if evaluate and eval_every and (update % eval_every == 0 or update == updates):
                    row.update({f"eval/{k}": v for k, v in evaluate(update).items()})
                log.write(json.dumps(row) + "\n")
                log.flush()
                logged.append(row)
                window, t_window, wait = {}, time.perf_counter(), 0.0
                first = next(k for k in row if k != "update")
                progress.update(task, info=f"{first} {row[first]:.4f}  {row['updates_per_s']:.1f} upd/s")
            if update % checkpoint_every == 0 or update == updates:
                save_checkpoint(ckpt, algo.modules, algo.optimizers, rngs, {"update": update})
            progress.update(task, completed=update)
    return logged


def _progress(show: bool, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), disable=not show,
    )


