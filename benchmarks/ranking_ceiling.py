"""How much could a perfect critic gain by choosing the policy's first chunk? A Monte Carlo ceiling.

On each fresh layout the flow (default v1, BC) proposes ``--n`` chunks at the first
decision. Each proposal is executed (its first ``execute_steps`` actions) and the flow
then acts plainly to the end, ``--k`` times with different sampling seeds. The success
rate of those continuations is a Monte Carlo Q of the proposal. A proposal is chosen by
its first k/2 continuations and scored by the other k/2 (held out, so the choice's luck
does not inflate its score); plain acting is the mean over all proposals of the same
held-out half.

    .venv/bin/python benchmarks/ranking_ceiling.py --store runs/demo/store --task push

Prints per layout and overall: plain success vs. the chosen proposal's success. A gap
near zero means no critic, however good, can gain much by ranking the first chunk;
the outcome is decided by what happens after it.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from robo_post.envs.tabletop import TabletopEnv
from robo_post.fleet.client import episode_seed
from robo_post.models.flow import FlowPolicyRunner
from robo_post.models.ranked import flow_of
from robo_post.store import PolicyRegistry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store holding the policy registry")
    parser.add_argument("--version", type=int, default=1, help="flow version (1 = BC)")
    parser.add_argument("--task", default="push")
    parser.add_argument("--layouts", type=int, default=12)
    parser.add_argument("--n", type=int, default=8, help="first-decision proposals per layout")
    parser.add_argument("--k", type=int, default=8, help="continuations per proposal (even: half choose, half score)")
    parser.add_argument("--seed", type=int, default=777, help="layout seed")
    args = parser.parse_args()
    if args.k < 2 or args.k % 2:
        parser.error("--k must be an even number >= 2")
    torch.set_num_threads(1)
    flow = flow_of(*PolicyRegistry(args.store).load(args.version))
    runner, execute = FlowPolicyRunner(flow), flow.config.execute_steps or flow.config.horizon
    image = flow.config.features.get("image")
    env = TabletopEnv(task=args.task, render_images=image is not None, image_size=image.shape[0] if image else 64)
    plain, chosen = [], []
    for layout in range(args.layouts):
        seed = episode_seed(args.seed, args.task, layout)
        obs, _ = env.reset(seed=seed)
        batch = {"proprio": torch.as_tensor(obs["proprio"])[None].repeat(args.n, 1),
                 "instruction": [env.unwrapped.instruction] * args.n}  # n copies of the state: n proposals
        if image:
            batch["image"] = torch.as_tensor(obs["image"])[None].repeat(args.n, 1, 1, 1)
        chunks = flow.sample(batch, seed=seed).numpy()
        wins = np.zeros((args.n, args.k))
        for i, chunk in enumerate(chunks):
            for j in range(args.k):
                obs, info = env.reset(seed=seed)
                runner.reset(env, episode_seed(args.seed, f"{args.task}/{layout}/{i}", j))
                done = False
                for action in chunk[:execute]:
                    obs, _, terminated, truncated, info = env.step(action)
                    if done := terminated or truncated:
                        break
                while not done:
                    obs, _, terminated, truncated, info = env.step(runner.act(obs, env))
                    done = terminated or truncated
                wins[i, j] = info["success"]
        choose, score = wins[:, : args.k // 2].mean(1), wins[:, args.k // 2:].mean(1)
        plain.append(score.mean())
        chosen.append(score[choose == choose.max()].mean())
        print(f"layout {layout:3d}: plain {plain[-1]:.2f}  chosen {chosen[-1]:.2f}", flush=True)
    gap = np.array(chosen) - np.array(plain)
    print(f"{args.task}, {args.layouts} layouts, {args.n} proposals x {args.k} continuations: plain {100 * np.mean(plain):.1f}%, "
          f"chosen first chunk {100 * np.mean(chosen):.1f}%, gap {100 * gap.mean():+.1f} points "
          f"(standard error {100 * gap.std(ddof=1) / np.sqrt(len(gap)):.1f})")


if __name__ == "__main__":
    main()
