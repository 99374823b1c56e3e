"""Does a critic rank a flow policy's chunks? Plain sampling vs best-of-N vs worst-of-N.

The same flow (by default the BC policy, v1) acts on the same tabletop layouts three
ways: plain samples, the best of N chunks under a published version's critic (what
``lwd.best_of_n`` publishes), and the worst of N under that critic. A critic that ranks
puts best above plain above worst; one that does not leaves all three within noise.

    .venv/bin/python benchmarks/critic_ranking.py --store runs/demo/store --critic-version 2

Prints success per task for each way of acting (train instruction phrasings), and the
binomial standard error of each mean (a difference of two means has ~1.4x that).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from robo_post.eval.rollout import in_process_success
from robo_post.models.ranked import RankedFlowPolicy, flow_of
from robo_post.store import PolicyRegistry


class _Negated(nn.Module):
    """A critic with its Q values negated, so best-of-N picks the worst chunk."""

    def __init__(self, critic: nn.Module):
        super().__init__()
        self.critic = critic

    def encode(self, obs):
        return self.critic.encode(obs)

    def q(self, z, chunk):
        return -self.critic.q(z, chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store holding the policy registry")
    parser.add_argument("--flow-version", type=int, default=1, help="version whose flow proposes the chunks (1 = BC)")
    parser.add_argument("--critic-version", type=int, required=True, help="a published flow_ranked version (its critic)")
    parser.add_argument("--n", type=int, default=16, help="chunks proposed per decision")
    parser.add_argument("--tasks", nargs="+", default=["reach", "push", "pick", "place"])
    parser.add_argument("--episodes", type=int, default=50, help="layouts per task")
    parser.add_argument("--seed", type=int, default=7000, help="layout seed (as in-training evaluation derives them)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    registry = PolicyRegistry(args.store)
    flow = flow_of(*registry.load(args.flow_version))
    critic = RankedFlowPolicy.from_artifact(*registry.load(args.critic_version)).critic
    ways = {"plain": flow, f"best of {args.n}": RankedFlowPolicy(flow, critic, args.n),
            f"worst of {args.n}": RankedFlowPolicy(flow, _Negated(critic), args.n)}
    print(f"flow v{args.flow_version}, critic of v{args.critic_version}, {args.episodes} layouts per task")
    print(f"{'acting':<12} " + " ".join(f"{t:>7}" for t in args.tasks) + f" {'mean':>7}  standard error")
    for name, model in ways.items():
        # Same layouts and the same per-layout sampling seeds for every way of acting.
        success = in_process_success(model, args.tasks, args.episodes, seed=args.seed)
        rates = [success[f"success/{task}"] for task in args.tasks]
        mean = float(np.mean(rates))
        se = np.sqrt(mean * (1 - mean) / (len(rates) * args.episodes))  # binomial, over every episode
        print(f"{name:<12} " + " ".join(f"{100 * r:6.1f}%" for r in rates) + f" {100 * mean:6.1f}%  {100 * se:.1f}", flush=True)


if __name__ == "__main__":
    main()
