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
    for version in sorted({e.policy_version for e in episodes}):
        obs, _, extras, _ = load_episodes(snap, [e for e in episodes if e.policy_version == version])
        state = obs["state"]
        lane = np.rint(state[:, 2] * Y_SCALE / AbstractLane.DEFAULT_WIDTH).astype(int)  # the ego row's y
        off = lane < RIGHTMOST
        p = torch.softmax(torch.as_tensor(extras["logits"]), -1).numpy()
        adv = group_advantages(torch.as_tensor(extras["proxy_scores"])).numpy()
        best = extras["proxy_scores"].argmax(-1)
        executed = np.bincount(firsts[extras["chosen"]], minlength=len(ACTIONS)) / len(state)
        print(f"{version:>7}{len(state):>7}{int(extras['events'][:, 0].sum()):>8}  "
              f"{' '.join(f'{x:.2f}' for x in executed):<40}| "
              f"{p[off][:, right].sum(1).mean():7.3f} {adv[off][:, right].mean():9.2f} "
              f"{np.isin(best[off], right).mean():10.2f} {np.isin(extras['chosen'][off], right).mean():14.3f}")
    _, _, extras, lengths = load_episodes(snap, episodes)
    # a decision state is blocked when the step that led to it raised the event (never an episode's first)
    raised = extras["events"][:, EVENTS.index("blocked")] > 0
    blocked = np.concatenate([np.r_[False, r[:-1]] for r in np.split(raised, np.cumsum(lengths)[:-1])])
    left = [k for k, c in enumerate(CANDIDATES) if c[0] == LANE_LEFT]
    p = torch.softmax(torch.as_tensor(extras["logits"]), -1).numpy()[:, left].sum(1)
    adv = group_advantages(torch.as_tensor(extras["proxy_scores"])).numpy()[:, left].mean(1)
    best, chosen = np.isin(extras["proxy_scores"].argmax(-1), left), np.isin(extras["chosen"], left)
    for name, m in (("blocked", blocked), ("not blocked", ~blocked)):
        print(f"{name} states: {int(m.sum())} of {len(m)}  p(left) {p[m].mean():.3f}  A~(left) {adv[m].mean():.2f}"
              f"  best left {best[m].mean():.2f}  executed left {chosen[m].mean():.3f}")


if __name__ == "__main__":
    main()
