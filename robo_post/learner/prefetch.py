"""Batches prepared ahead by a background thread, so the update never waits on numpy.

``Prefetcher(sample, rngs, depth, device)`` calls ``sample()`` in a worker thread,
in the same order as a synchronous loop would, so the batches are exactly the
same. On a CUDA device each batch is copied from pinned memory with
``non_blocking`` while the current update runs.

Resume stays exact: the worker runs ahead of the learner, so the live RNGs are
ahead too. Each batch carries the RNG states that follow it, and ``consumed_rngs``
returns generators at the state after the last batch the learner took: what a
checkpoint must save to continue with the next batch.
"""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any, Callable

import numpy as np
import torch

_STOP = object()


def to_device(batch: Any, device: torch.device, pin: bool) -> Any:
    """``batch`` (nested dicts/lists of tensors and other values) on ``device``."""
    if isinstance(batch, torch.Tensor):
        if pin and batch.device.type == "cpu":
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=pin)
    if isinstance(batch, dict):
        return {k: to_device(v, device, pin) for k, v in batch.items()}
    return batch


class Prefetcher:
    """Iterator-like source of batches from a background thread.

    Args:
        sample: produces one batch of CPU tensors per call (it owns ``rngs``).
        rngs: the numpy generators ``sample`` draws from (checkpointed by the loop).
        depth: batches prepared ahead.
        device: where batches are delivered.
    """

    def __init__(self, sample: Callable[[], dict], rngs: dict[str, np.random.Generator], depth: int = 2,
                 device: torch.device | str = "cpu"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.sample, self.rngs = sample, rngs
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.consumed = {k: copy.deepcopy(g.bit_generator.state) for k, g in rngs.items()}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="prefetch", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            while not self.stop.is_set():
                batch = to_device(self.sample(), self.device, self.pin)
                after = {k: copy.deepcopy(g.bit_generator.state) for k, g in self.rngs.items()}
                while not self.stop.is_set():
                    try:
                        self.queue.put((batch, after), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the learner, which re-raises it
            self.queue.put((_STOP, e))

    def __call__(self) -> dict:
        batch, after = self.queue.get()
        if batch is _STOP:
            raise after
        self.consumed = after
        return batch

    def consumed_rngs(self) -> dict[str, np.random.Generator]:
        """Generators at the state after the last batch handed out (for checkpoints)."""
        out = {}
        for name, state in self.consumed.items():
            g = np.random.Generator(type(self.rngs[name].bit_generator)())
            g.bit_generator.state = copy.deepcopy(state)
            out[name] = g
        return out

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
