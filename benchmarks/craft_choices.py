"""What a CRAFT run's policies chose, version by version, and whether they learned to keep right.

Reads one on-policy store that ``benchmarks/craft_highway.py`` recorded (``<work>/s<seed>/<arm>-online``,
highway scene, meta-action vocabulary) and prints per policy version: decisions, crashes,
the share of decisions whose executed candidate starts with each meta-action, and, on the
states where the ego is not in the rightmost lane, the policy's probability of the
candidates that start by changing right, their mean group advantage, and how often one of
them is the proxy's best candidate or the executed one.

highway-env pays for the rightmost lane, and the heuristic the policies are cloned from
never changes lane; these columns show whether fine-tuning moves probability to the lane
changes the proxy favours. A last line does the same for the candidates that change left
on the states that are ``blocked`` (the ego already at its lowest target speed and still
closing on the car ahead: only a lane change gets out), against all other states.

    python benchmarks/craft_choices.py runs/bench_craft/s0/craft-online
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from highway_env.road.lane import AbstractLane

from robo_post.algos.craft import group_advantages
from robo_post.envs.highway_meta import ACTIONS, CANDIDATES, EVENTS, LANE_LEFT, LANE_RIGHT
from robo_post.learner.craft_driver import load_episodes
from robo_post.store.store import Store

Y_SCALE = 3 * AbstractLane.DEFAULT_WIDTH  # [m] the observation's y range (robo_post.envs.highway_meta)
RIGHTMOST = 2  # the fast highway has three lanes, at y = 0, 1 and 2 lane widths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", help="an on-policy store of craft_highway.py (<work>/s<seed>/<arm>-online)")
    args = parser.parse_args()
    snap = Store.open(args.store).snapshot(record=False)  # reading only: leave the store as it is
    episodes = snap.episodes()
    right = [k for k, c in enumerate(CANDIDATES) if c[0] == LANE_RIGHT]
    firsts = np.array([c[0] for c in CANDIDATES])
    print(f"{'version':>7}{'states':>7}{'crashes':>8}  executed first action "
          f"({', '.join(ACTIONS)})  | off the right lane: p(right) A~(right) best right  executed right")
    obs, _, extras, lengths = load_episodes(snap, episodes)  # loaded once; each version is a mask over steps
    step_version = np.repeat([e.policy_version for e in episodes], lengths)
    lane = np.rint(obs["state"][:, 2] * Y_SCALE / AbstractLane.DEFAULT_WIDTH).astype(int)  # the ego row's y
    p = torch.softmax(torch.as_tensor(extras["logits"]), -1).numpy()
    adv = group_advantages(torch.as_tensor(extras["proxy_scores"])).numpy()
    best, chosen = extras["proxy_scores"].argmax(-1), extras["chosen"]
    for version in np.unique(step_version):
        at = step_version == version
        off = at & (lane < RIGHTMOST)
        executed = np.bincount(firsts[chosen[at]], minlength=len(ACTIONS)) / at.sum()
        print(f"{version:>7}{at.sum():>7}{int(extras['events'][at, 0].sum()):>8}  "
              f"{' '.join(f'{x:.2f}' for x in executed):<40}| "
              f"{p[off][:, right].sum(1).mean():7.3f} {adv[off][:, right].mean():9.2f} "
              f"{np.isin(best[off], right).mean():10.2f} {np.isin(chosen[off], right).mean():14.3f}")
    # a decision state is blocked when the step that led to it raised the event (never an episode's first)
    raised = extras["events"][:, EVENTS.index("blocked")] > 0
    blocked = np.concatenate([np.r_[False, r[:-1]] for r in np.split(raised, np.cumsum(lengths)[:-1])])
    left = [k for k, c in enumerate(CANDIDATES) if c[0] == LANE_LEFT]
    for name, m in (("blocked", blocked), ("not blocked", ~blocked)):
        print(f"{name} states: {int(m.sum())} of {len(m)}  p(left) {p[m][:, left].sum(1).mean():.3f}"
              f"  A~(left) {adv[m][:, left].mean():.2f}  best left {np.isin(best[m], left).mean():.2f}"
              f"  executed left {np.isin(chosen[m], left).mean():.3f}")

if __name__ == "__main__":
    main()
