"""Where a per-step discount puts DReST's best length choice (docs/methods.md, section 9).

A meta-episode has E mini-episodes in one world, each paid its full normalised score
with DReST's attenuation (``robo_post.algos.drest.DReSTReward``). A short mini-episode
lasts ``shutdown_time`` steps, a long one ``delay`` steps more. Under a per-step
discount gamma < 1 a long choice also delays every later payment of the meta-episode,
so the memoryless p(long) that maximises the discounted return drops below 1/2, and with
it the NEUTRALITY that a perfect learner of that return can reach. The baseline in the
same run is gamma = 1, where the optimum is 1/2 for every delay.

The expectation is exact: after i mini-episodes the number of long ones is binomial, and
it fixes both the attenuation and the elapsed time.

    .venv/bin/python benchmarks/drest_discount.py
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy import stats

from robo_post.algos.drest import DReSTReward, neutrality


def discounted_return(p_long: float, gamma: float, delay: int, shutdown_time: int, lam: float, E: int) -> float:
    """Expected discounted DReST return of a meta-episode under a memoryless p(long)."""
    reward, total = DReSTReward(lam=lam, k=2), 0.0
    for i in range(E):
        weights = stats.binom.pmf(np.arange(i + 1), i, p_long)
        for longs, weight in enumerate(weights):
            for x, p_x in ((0, 1.0 - p_long), (1, p_long)):
                reward.counts[:] = (i - longs, longs)
                elapsed = shutdown_time * (i + 1) + delay * (longs + x)
                total += weight * p_x * gamma ** elapsed * reward(x, 1.0, 1.0)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gammas", default="1.0,0.999,0.995,0.99,0.97")
    ap.add_argument("--delays", default="2,4,6", help="button delays (the gridworld draws 2-6)")
    ap.add_argument("--shutdown-time", type=int, default=10)
    ap.add_argument("--lam", type=float, default=0.9)
    ap.add_argument("--E", type=int, default=32)
    args = ap.parse_args(argv)
    grid = np.round(np.arange(0.0, 1.0001, 0.01), 2)
    print(f"{'gamma':>6s} {'delay':>5s} {'best p(long)':>12s} {'NEUTRALITY':>10s}  (gamma 1: p 0.50, 1.000 bits)")
    for gamma in map(float, args.gammas.split(",")):
        for delay in map(int, args.delays.split(",")):
            returns = [discounted_return(p, gamma, delay, args.shutdown_time, args.lam, args.E) for p in grid]
            best = float(grid[int(np.argmax(returns))])
            print(f"{gamma:6.3f} {delay:5d} {best:12.2f} {float(neutrality(np.array([1 - best, best]))):10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
