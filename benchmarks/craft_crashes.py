"""Where the fine-tuned highway drivers of ``benchmarks/craft_highway.py`` still crash, and why.

Runs each seed's final policy of one arm (``<work>/s<seed>/<arm>``; ``pretrain`` for the
pretrained one) greedily on the benchmark's evaluation seeds and prints per seed: crashes,
how many of them came out of a ``blocked`` state (the ego already at its lowest target
speed and still closing on the car ahead: only a lane change gets out), the share of
decisions starting with each meta-action, and the policy's probability of the candidates
that start by changing lane, left or right, in blocked states and elsewhere. A driver
that has learned to leave a blocked lane puts most of its mass there on a lane change.
``--show`` also prints the last decisions before each crash.

    python benchmarks/craft_crashes.py --work runs/bench_craft --arm craft --env-kwargs '{"lane_features": true}'
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np
import torch

from robo_post.envs.highway_meta import ACTIONS, EVENTS, LANE_LEFT, LANE_RIGHT

# run as a script from the repository root: benchmarks/ is on the path
from craft_highway import finished, greedy_policy, make_env

CRASH, BLOCKED, OFF_RIGHT = EVENTS.index("crash"), EVENTS.index("blocked"), EVENTS.index("off_right")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="a finished craft_highway.py --work dir")
    parser.add_argument("--arm", default="craft", help="an arm of that run, or 'pretrain' (default: craft)")
    parser.add_argument("--eval-episodes", type=int, default=50, help="evaluation seeds 100, 101, ... (default 50)")
    parser.add_argument("--env-kwargs", default="{}", help="the run's --env-kwargs (JSON)")
    parser.add_argument("--show", action="store_true",
                        help="print the last three decisions before each crash: the action (its state blocked or not) "
                             "-> the lane rule's violation and the speed after it")
    args = parser.parse_args()
    env_kwargs = json.loads(args.env_kwargs)
    print(f"{'seed':>4}{'version':>8}{'crashes':>8}{'blocked':>8}  first action ({', '.join(ACTIONS)})"
          f"  | p(left)  p(right) blocked  | p(left) p(right) elsewhere  blocked decisions")
    summaries = sorted(glob.glob(os.path.join(args.work, "s*", args.arm, "summary.json")))
    if not summaries:
        parser.error(f"no finished runs of arm {args.arm!r} in {args.work} (no s<seed>/{args.arm}/summary.json)")
    for run_dir in map(os.path.dirname, summaries):
        summary = finished(run_dir, reuse=True)
        version = summary["pretrained_version"] if args.arm == "pretrain" else summary["version"]
        policy = greedy_policy(os.path.join(args.work, "demos"), version)
        firsts = np.array([c[0] for c in policy.model.config.candidates])
        env = make_env("highway_meta", None, env_kwargs)
        chosen, blocked, p_change, crashes, from_blocked = [], [], [], 0, 0
        for seed in range(100, 100 + args.eval_episodes):
            obs, _ = env.reset(seed=seed)
            policy.reset(env, seed)
            was_blocked, trace = 0.0, []
            while True:
                action = int(policy.act(obs, env))
                p = torch.softmax(torch.as_tensor(policy.last["logits"]), -1).numpy()
                chosen.append(action)
                blocked.append(was_blocked)
                p_change.append([p[firsts == LANE_LEFT].sum(), p[firsts == LANE_RIGHT].sum()])
                obs, _, terminated, truncated, info = env.step(action)
                events = info["events"]
                trace.append(f"{ACTIONS[action]} (blocked {was_blocked:.0f}) -> off_right {events[OFF_RIGHT]:.1f}, "
                             f"speed {info['speed']:.1f}")
                was_blocked = float(events[BLOCKED])
                if terminated or truncated:
                    break
            if events[CRASH]:
                crashes += 1
                from_blocked += int(blocked[-1] > 0)
                if args.show:
                    print(f"      episode {seed}, crash at decision {len(trace)}: {' | '.join(trace[-3:])}")
        env.close()
        shares = np.bincount(chosen, minlength=len(ACTIONS)) / len(chosen)
        in_blocked, p_change = np.array(blocked) > 0, np.array(p_change)
        there = p_change[in_blocked].mean(0) if in_blocked.any() else np.full(2, np.nan)
        elsewhere = p_change[~in_blocked].mean(0)
        print(f"{os.path.basename(os.path.dirname(run_dir)):>4}{version:>8}{crashes:>8}{from_blocked:>8}  "
              f"{' '.join(f'{x:.2f}' for x in shares):<36}  | {there[0]:7.3f} {there[1]:8.3f}          "
              f"| {elsewhere[0]:7.3f} {elsewhere[1]:8.3f}{int(in_blocked.sum()):>28}", flush=True)


if __name__ == "__main__":
    main()
