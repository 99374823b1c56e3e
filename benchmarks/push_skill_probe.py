"""Diagnostic: how a published tabletop policy moves the block, per instruction split.

For each split (train / held-out phrasings) it rolls the policy out on the same
``--episodes`` layouts of one block task and prints, per episode, success, the
block's peak height and the episode length. A block that stays near table height
(~0.02 m) was pushed; one raised to ~0.1 m was carried. Used to find why BC did
better on ``push`` with the held-out phrasings than with the trained ones: it
carried the block there, which counted as a push until the env failed push
episodes whose block rises above ``PUSH_MAX_HEIGHT``.

    .venv/bin/python benchmarks/push_skill_probe.py --store runs/demo/store --version 1
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from robo_post.envs.tabletop import TabletopEnv
from robo_post.fleet.policies import build_policy
from robo_post.store import PolicyRegistry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store holding the policy registry")
    parser.add_argument("--version", type=int, default=1, help="policy version (1 = BC in `robo-post run`)")
    parser.add_argument("--task", default="push", choices=["push", "pick", "place"])
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--seed", type=int, default=5000, help="layout seeds seed .. seed + episodes - 1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    artifact = PolicyRegistry(args.store).load(args.version)
    for split in ("train", "heldout"):
        rows = []
        for seed in range(args.seed, args.seed + args.episodes):
            env = TabletopEnv(task=args.task, instruction_split=split)
            policy = build_policy(*artifact)  # fresh per episode, as fleet clients reset it
            obs, _ = env.reset(seed=seed)
            policy.reset(env, seed)
            block, peak, done, info, steps = env.stages[0].block, 0.0, False, {}, 0
            while not done:
                obs, _, terminated, truncated, info = env.step(policy.act(obs, env))
                peak, done, steps = max(peak, float(env.block_position(block)[2])), terminated or truncated, steps + 1
            rows.append((bool(info["success"]), peak, steps, env.instruction))
        print(f"{split}: success {np.mean([r[0] for r in rows]):.2f}, median peak block height "
              f"{np.median([r[1] for r in rows]):.3f} m")
        for success, peak, steps, text in rows:
            print(f"  {'ok  ' if success else 'fail'} peak {peak:.3f} m  {steps:3d} steps  {text!r}")


if __name__ == "__main__":
    main()
