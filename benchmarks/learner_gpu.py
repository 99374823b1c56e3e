"""DIVL+QAM learner updates/s through the real hot path, on CPU and (where present) GPU.

One short prepared check for a lent GPU machine (CI never runs it):

    .venv/bin/python benchmarks/learner_gpu.py            # cpu and, if present, cuda
    .venv/bin/python benchmarks/learner_gpu.py --quick    # fewer timed updates
    .venv/bin/python benchmarks/learner_gpu.py --compile  # each cell also with torch.compile

The path is the one `robo-post train algo=divl_qam` takes: a store snapshot ->
``WindowSampler`` -> (optionally) the background prefetcher -> the device ->
``train_loop`` with the ``divl_qam`` method built through the registry. The script
first records a small synthetic store in a temporary folder (31-d proprio, 64x64x3
camera, four instructions so the frozen MiniLM text encoder is on; it loads offline
from its wheel; chunks of 8 x 4-d actions), so it needs nothing else.

Grid: policy size (default, and a 10x policy with a wider ``hidden_dim``) x device x
prefetch (0 / 2) x bf16 autocast (off / on). Each cell runs one warm-up log window and
one timed window and prints updates/s and the data-wait fraction (the share of the
window the learner waited for its batch) as ``train_loop`` logs them; then the prefetch
ratio (upd/s with prefetch / without), with ``--compile`` the compiled/eager ratio (the
compile time is in the warm-up window), and, with a GPU, the GPU/CPU ratio per cell.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
from omegaconf import OmegaConf

from robo_post.algos.registry import method_spec
from robo_post.learner.data import measure
from robo_post.learner.loop import train_loop
from robo_post.store import ArraySpec, Store, StoreSchema, WindowSampler

# Policy sizes: the default FlowPolicy (0.53M trainable parameters) and a wider one with 10x as many (5.3M).
SIZES = {"default": dict(embed_dim=128, hidden_dim=256, flow_steps=10),
         "10x": dict(embed_dim=128, hidden_dim=1232, flow_steps=10)}
INSTRUCTIONS = ("reach the red cube", "push the green cube left", "place the blue cube on the pad", "open the drawer")
HORIZON, BATCH, GAMMA = 8, 64, 0.99


def make_store(root: str, episodes: int = 16, length: int = 40) -> Store:
    """A synthetic image + state + instruction store (sparse success reward) under ``root``."""
    schema = StoreSchema({"proprio": ArraySpec("float32", (31,)), "image": ArraySpec("uint8", (64, 64, 3))},
                         ArraySpec("float32", (4,), -1.0, 1.0))
    store = Store.create(root, schema)
    rng = np.random.default_rng(0)
    with store.writer("demo-0") as w:
        for i in range(episodes):
            success = bool(rng.random() < 0.5)
            w.write_episode({"proprio": rng.normal(size=(length + 1, 31)).astype(np.float32),
                             "image": rng.integers(0, 256, (length + 1, 64, 64, 3), dtype=np.uint8)},
                            rng.uniform(-1, 1, (length, 4)).astype(np.float32),
                            rewards=np.eye(length, dtype=np.float32)[-1] * success,
                            terminated=np.arange(length) == length - 1, success=success, role="demo",
                            instruction=INSTRUCTIONS[i % len(INSTRUCTIONS)])
    return store


def build(store: Store, size: str, device: torch.device, sampler: WindowSampler):
    """The ``divl_qam`` method (critic warm-up off, so every update moves the actor too), from an
    untrained BC reference of ``size``, sized from the sampler's data as the driver does."""
    torch.manual_seed(0)
    model = OmegaConf.create({"features": None, "use_images": True, "use_text": True, "execute_steps": 4})
    bc = method_spec("bc_flow")
    bc_data = measure(store.schema, sampler, model, GAMMA, None)
    reference = bc.build(bc.make_config({"model": SIZES[size]}), bc_data, device, None).policy
    spec = method_spec("divl_qam")
    config = spec.make_config({"critic_warmup": 0})
    method = spec.build(config, measure(store.schema, sampler, model, GAMMA, reference), device, reference)
    return method, sum(p.numel() for p in reference.parameters() if p.requires_grad)


def run_cell(store: Store, size: str, device: torch.device, prefetch: int, amp: str | None, n: int,
             run_dir: str, compile: bool = False) -> tuple[dict, int]:
    """One warm-up window and one timed window of ``n`` updates; returns the timed row."""
    sampler = WindowSampler.from_snapshot(store.snapshot(), horizon=HORIZON, gamma=GAMMA, seed=0,
                                          device="cpu" if prefetch else device)
    method, params = build(store, size, device, sampler)
    rows = train_loop(method, lambda: sampler.sample(BATCH), run_dir, 2 * n, {"sampler": sampler.rng},
                      log_every=n, checkpoint_every=10 ** 9, show=False, prefetch=prefetch, amp=amp,
                      tracking={"tensorboard": False}, compile=compile)
    return rows[-1], params


def main() -> None:
    torch.set_num_threads(1)  # CPU rows: one core, as the learner runs beside the fleet
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 timed updates per cell instead of 30")
    parser.add_argument("--updates", type=int, default=None, help="timed updates per cell")
    parser.add_argument("--compile", action="store_true", help="also run every cell with train_loop(compile=True)")
    args = parser.parse_args()
    n = args.updates or (5 if args.quick else 30)
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    else:
        print("no GPU was available: CPU rows only")
    rates: dict[tuple, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(os.path.join(tmp, "store"))
        print(f"store: {len(store.snapshot().episodes())} episodes, batch {BATCH}, chunk {HORIZON}, "
              f"text on; {n} timed updates per cell after {n} warm-up")
        print(f"{'device':<7}{'size':<9}{'policy params':>14}{'prefetch':>10}{'bf16':>6}{'compile':>9}{'upd/s':>9}"
              f"{'data wait':>11}")
        for device in devices:
            for size in SIZES:
                for amp in (None, "bf16"):
                    for prefetch in (0, 2):
                        for compiled in (False, True) if args.compile else (False,):
                            cell = (device.type, size, amp, prefetch) + (("compiled",) if compiled else ())
                            row, params = run_cell(store, size, device, prefetch, amp, n,
                                                   os.path.join(tmp, "-".join(map(str, cell))), compiled)
                            rates[cell] = row["updates_per_s"]
                            print(f"{device.type:<7}{size:<9}{params:>14,}{prefetch:>10}{'on' if amp else 'off':>6}"
                                  f"{'on' if compiled else 'off':>9}{row['updates_per_s']:>9.2f}{row['data_wait']:>11.1%}",
                                  flush=True)
    if args.compile:
        print("\ncompile ratio (upd/s compiled / eager):")
        for cell, rate in rates.items():
            if len(cell) == 5:
                dev, size, amp, prefetch = cell[:4]
                print(f"  {dev:<5} {size:<8} prefetch {prefetch} bf16 {'on ' if amp else 'off'}  {rate / rates[cell[:4]]:.2f}x")
    rates = {cell: rate for cell, rate in rates.items() if len(cell) == 4}
    print("\nprefetch ratio (upd/s with prefetch 2 / without):")
    for (dev, size, amp, prefetch), rate in rates.items():
        if prefetch:
            print(f"  {dev:<5} {size:<8} bf16 {'on ' if amp else 'off'}  {rate / rates[(dev, size, amp, 0)]:.2f}x")
    if len(devices) > 1:
        print("\ngpu/cpu ratio (upd/s):")
        for (dev, size, amp, prefetch), rate in rates.items():
            if dev == "cuda":
                print(f"  {size:<8} prefetch {prefetch} bf16 {'on ' if amp else 'off'}  "
                      f"{rate / rates[('cpu', size, amp, prefetch)]:.1f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
