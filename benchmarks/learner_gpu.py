"""DIVL+QAM learner updates/s on CPU vs. GPU, at the default size and a 10x larger policy.

One short prepared check for a lent GPU machine (CI never runs it):

    .venv/bin/python benchmarks/learner_gpu.py            # cpu and, if present, cuda
    .venv/bin/python benchmarks/learner_gpu.py --quick    # fewer timed updates

Synthetic batches with the tabletop shapes (proprio 31, 64x64x3 image, chunk 8x4)
feed the real ``ActorCritic('divl_qam')`` learner; the text encoder is off so nothing is downloaded.
Prints updates/s per device and the GPU/CPU ratio for each size.
"""

from __future__ import annotations

import argparse
import time

import torch

from robo_post.learner.algorithms import ActorCritic
from robo_post.models.features import Feature, state_features
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig

SIZES = {"default": dict(embed_dim=128, hidden_dim=256), "10x": dict(embed_dim=384, hidden_dim=896)}


def batch(device: torch.device, b: int = 64) -> dict:
    obs = lambda: {"proprio": torch.randn(b, 31, device=device),
                   "image": torch.randint(0, 256, (b, 64, 64, 3), dtype=torch.uint8, device=device)}
    return {"obs": obs(), "next_obs": obs(), "actions": torch.rand(b, 8, 4, device=device) * 2 - 1,
            "action_mask": torch.ones(b, 8, dtype=torch.bool, device=device),
            "rewards": torch.rand(b, device=device), "discounts": torch.full((b,), 0.9, device=device)}


def updates_per_s(size: str, device: torch.device, n: int) -> tuple[float, int]:
    torch.manual_seed(0)
    policy = FlowPolicy(FlowPolicyConfig(features=state_features(31, "proprio") | {"image": Feature("image", (64, 64, 3))}, action_dim=4, horizon=8, use_text=False,
                                         **SIZES[size])).to(device)
    algo = ActorCritic("divl_qam", policy, device=device)
    data = batch(device)
    for _ in range(3):  # warm-up (cuDNN autotune, allocator)
        algo.update(data)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        algo.update(data)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0), sum(p.numel() for p in policy.parameters())


def main() -> None:
    torch.set_num_threads(1)  # CPU row: one core, as the learner runs beside the fleet
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n = 5 if args.quick else 30
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"{'size':<8} {'policy params':>14} " + " ".join(f"{d.type + ' upd/s':>12}" for d in devices) + "   gpu/cpu")
    for size in SIZES:
        rates = [updates_per_s(size, d, n) for d in devices]
        ratio = f"{rates[1][0] / rates[0][0]:8.1f}x" if len(rates) > 1 else "   (no gpu)"
        print(f"{size:<8} {rates[0][1]:>14,} " + " ".join(f"{r:>12.2f}" for r, _ in rates) + f"   {ratio}")


if __name__ == "__main__":
    main()
