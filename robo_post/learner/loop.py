"""The update loop shared by every method that trains on batches.

The loop is method-agnostic: a method exposes ``modules``, ``optimizers`` and
``update(batch) -> metrics``. The loop logs metric windows to
``RUN/metrics.jsonl`` (with a wall-clock ``time``; ``robo_post.utils.io.read_metrics`` reads
it back) and to the experiment trackers
(``robo_post.learner.tracking``: TensorBoard in ``RUN/tensorboard/`` by default),
saves ``RUN/run_metadata.json``, checkpoints to ``RUN/checkpoint`` (resume continues
bit-for-bit) and shows progress; drivers (``robo_post.learner.train.DRIVERS``) publish.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from typing import Any, Callable

import numpy as np
import torch

from robo_post.learner.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from robo_post.learner.prefetch import Prefetcher
from robo_post.learner.tracking import Tracker


# Packages whose versions are saved with every run (what a result depends on).
TRACKED_PACKAGES = ("robo-post", "torch", "numpy", "zarr", "gymnasium", "mujoco", "highway-env", "minari",
                    "stable-baselines3", "hydra-core")


def _git_commit(path: str) -> str | None:
    """The commit of the checkout holding ``path`` (``+dirty`` with uncommitted changes); None outside git."""
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def write_run_metadata(run_dir: str, device: torch.device | str, seeds: dict[str, Any]) -> dict[str, Any]:
    """Save what a run's results depend on beside them: ``RUN/run_metadata.json``
    (code commit, package versions, device, host, seeds, command line)."""
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    device = torch.device(device)
    meta = {
        "started": time.time(), "git_commit": _git_commit(os.path.dirname(os.path.abspath(__file__))),
        "packages": versions, "python": platform.python_version(), "host": socket.gethostname(),
        "platform": platform.platform(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or None,
        "torch_threads": torch.get_num_threads(), "seeds": seeds, "argv": sys.argv,
    }
    with open(os.path.join(run_dir, "run_metadata.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    return meta


def truncate_log(path: str, last_update: int) -> None:
    """Drop log lines written after the checkpoint we resume from, and a last line a kill cut short."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if line.endswith("\n") and json.loads(line)["update"] <= last_update:
                    keep.append(line)
            except ValueError:
                continue
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
    prefetch: int = 0,
    amp: str | None = None,
    tracking: Any = None,
    compile: bool = False,
    phase_start: int = 0,
) -> list[dict[str, float]]:
    """Run ``updates`` updates of ``algo`` (resuming from ``run_dir`` if a checkpoint exists).

    ``after_update(update)`` runs after each update, before its checkpoint (e.g. to publish).
    ``prefetch > 0`` prepares that many batches ahead in a background thread (``sample``
    must then return CPU tensors and own ``rngs``; batches and resume are unchanged);
    ``amp="bf16"`` runs updates under bfloat16 autocast. ``tracking`` selects the experiment
    trackers each logged row also goes to (``robo_post.learner.tracking``; None = TensorBoard).
    ``compile=True`` compiles the method's networks with ``torch.compile`` before the first
    update (``compile_networks``; weights, checkpoints and artifacts are unchanged).
    ``phase_start``: the update a later phase of one run starts at (the online phase after
    the offline one): the checkpoint there is no run being resumed.

    Returns the logged metric windows (each the mean over ``log_every`` updates).
    """
    if amp not in (None, "bf16"):
        raise ValueError(f"amp must be null or 'bf16', got {amp!r}")
    os.makedirs(run_dir, exist_ok=True)
    ckpt, log_path = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "metrics.jsonl")
    device = next((p.device for m in algo.modules.values() for p in m.parameters()), torch.device("cpu"))
    write_run_metadata(run_dir, device, {"torch_initial_seed": torch.initial_seed()})
    start = 0
    if compile:
        compile_networks(algo.modules.values())
    if has_checkpoint(ckpt):
        start = load_checkpoint(ckpt, algo.modules, algo.optimizers, rngs, ("update",))["update"]
        if hasattr(algo, "updates"):  # algorithms that schedule on the step count
            algo.updates = start
        if phase_start < start < updates:
            print(f"resuming {run_dir} from its checkpoint at update {start} of {updates}", file=sys.stderr)
    truncate_log(log_path, start)  # also the rows of a run killed before its first checkpoint
    tracker = Tracker(run_dir, tracking, start)
    logged: list[dict[str, float]] = []
    window: dict[str, list[torch.Tensor | float]] = {}
    t_window, wait = time.perf_counter(), 0.0
    progress = _progress(show, updates, start)
    prefetcher = Prefetcher(sample, rngs, prefetch, device) if prefetch and start < updates else None
    next_batch = prefetcher or sample
    checkpoint_rngs = prefetcher.consumed_rngs if prefetcher else lambda: rngs
    with progress, open(log_path, "a") as log, prefetcher or contextlib.nullcontext(), tracker:
        task = progress.add_task("train", total=updates, completed=start, info="")
        for update in range(start + 1, updates + 1):
            t0 = time.perf_counter()
            batch = next_batch()
            wait += time.perf_counter() - t0
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                metrics = algo.update(batch)
            for k, v in metrics.items():
                window.setdefault(k, []).append(v)
            if after_update is not None:
                after_update(update)
            if update % log_every == 0 or update == updates:
                means = window_means(window)  # its one host read also waits for the window's queued device work
                elapsed = time.perf_counter() - t_window
                row = {"update": update, "time": time.time(), **means}
                row.update(updates_per_s=len(next(iter(window.values()))) / elapsed, data_wait=wait / elapsed)
                if evaluate and eval_every and (update % eval_every == 0 or update == updates):
                    row.update({f"eval/{k}": v for k, v in evaluate(update).items()})
                log.write(json.dumps(row) + "\n")
                log.flush()
                tracker.log(row)
                logged.append(row)
                window, t_window, wait = {}, time.perf_counter(), 0.0
                first = next(k for k in row if k not in ("update", "time"))
                progress.update(task, info=f"{first} {row[first]:.4f}  {row['updates_per_s']:.1f} upd/s")
            if update % checkpoint_every == 0 or update == updates:
                save_checkpoint(ckpt, algo.modules, algo.optimizers, checkpoint_rngs(), {"update": update})
            progress.update(task, completed=update)
    return logged


def compile_networks(modules: Any) -> int:
    """``torch.compile`` every outermost ``nn.Sequential`` inside ``modules``, in place; returns how many.

    The sequential blocks are a method's pure-tensor hot spots (velocity and fusion MLPs, Q
    ensembles, value heads, CNN trunks), while the modules around them branch on Python data
    (instruction caches, observation dicts) and would only break the graph. ``Module.compile``
    keeps parameter names, so checkpoints and artifacts do not change. Shapes are left
    dynamic: the same network sees several batch sizes (e.g. B and N * B in QAM).
    """
    outer = {id(m): m for module in modules for m in module.modules() if isinstance(m, torch.nn.Sequential)}
    inner = {id(c) for m in outer.values() for c in m.modules() if c is not m}
    targets = [m for key, m in outer.items() if key not in inner]
    # Every instance shares Sequential.forward's code object, whose compiled entries dynamo caps
    # (8 by default): past the cap the rest would silently run eager. Allow each target a few.
    limits = torch._dynamo.config
    limits.recompile_limit = max(limits.recompile_limit, 4 * len(targets))
    limits.accumulated_recompile_limit = max(limits.accumulated_recompile_limit, 4 * len(targets))
    for m in targets:
        m.compile(dynamic=True)
    return len(targets)


def window_means(window: dict[str, list[torch.Tensor | float]]) -> dict[str, float]:
    """Mean of each metric over a log window, with one device-to-host copy for all of them."""
    if not window:
        return {}
    means = [torch.stack([torch.as_tensor(x, dtype=torch.float32) for x in v]).mean() for v in window.values()]
    device = means[0].device
    return dict(zip(window, torch.stack([m.to(device) for m in means]).tolist()))


def _progress(show: bool, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), disable=not show,
    )


