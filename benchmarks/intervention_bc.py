"""HG-DAgger on the overseer's rescues: does imitating the interventions lift BC?

With ``fleet.overseer.enabled=true fleet.overseer.deadline=F`` the fleet's overseer takes
over every deploy (and online) episode that the policy has not finished after a fraction F
of its step limit, and drives it to the end with the scripted expert; those steps are
stored with ``intervention=True``. This script fine-tunes BC (``--version``, default v1)
on the windows a co-trained base imitates with ``lwd.imitation.enabled=true`` (the
successful demonstrations and every intervention step, uniformly: HG-DAgger's update),
then rolls the BC policy and the fine-tuned one out in-process on the same fresh layouts
and prints success per task for both.

    .venv/bin/python benchmarks/tabletop_loop.py --out runs/ov --algos divl_qam recipe=none \\
        preset.deploy_episodes=160 fleet.overseer.enabled=true fleet.overseer.deadline=0.5
    .venv/bin/python benchmarks/intervention_bc.py --store runs/ov/shared/store

The first command records BC's 160 deploy episodes under the overseer (and runs DIVL+QAM
on them); any store with intervention steps in ``deploy-*`` shards will do.
"""

from __future__ import annotations

import argparse

import torch

from robo_post.algos.bc_flow import BCFlow, BCFlowConfig
from robo_post.eval.rollout import in_process_success
from robo_post.models.flow import FlowPolicy
from robo_post.store import ImitationSampler, PolicyRegistry, Store, WindowSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True, help="store with demos, a BC version and overseen deploy episodes")
    parser.add_argument("--version", type=int, default=1, help="BC version to fine-tune")
    parser.add_argument("--clients", default="deploy", help="client-id prefix of the overseen episodes")
    parser.add_argument("--demo-clients", default="demo", help="client-id prefix of the demonstrations")
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="BC's learning rate in configs/run.yaml")
    parser.add_argument("--tasks", nargs="+", default=["reach", "push", "pick", "place"])
    parser.add_argument("--episodes", type=int, default=30, help="layouts per task")
    parser.add_argument("--seed", type=int, default=4242, help="layout seed (away from the training and eval seeds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    snap = Store.open(args.store).snapshot()
    weights, config = PolicyRegistry(args.store).load(args.version)
    bc_policy = FlowPolicy.from_artifact(weights, config)
    H = bc_policy.config.horizon
    demos = [e for e in snap.episodes(success=True) if e.client_id.startswith(f"{args.demo_clients}-")]
    overseen = [e for e in snap.episodes() if e.client_id.startswith(f"{args.clients}-")]
    imitation = ImitationSampler([WindowSampler.from_snapshot(snap, demos + overseen, horizon=H, seed=0)],
                                 lambda e: e.success and e.client_id.startswith(f"{args.demo_clients}-"), seed=1)
    steps = len(imitation) - sum(e.length for e in demos)
    if not steps:
        raise ValueError(f"no intervention steps in the {args.clients}-* episodes of {args.store}")
    rescued = sum(e.attrs.get("interventions", 0) > 0 for e in overseen)
    print(f"{len(demos)} demos; {len(overseen)} {args.clients} episodes, {rescued} with interventions, "
          f"{steps} intervention steps")

    dagger = BCFlow(BCFlowConfig(lr=args.lr), bc_policy.config)
    dagger.policy.load_state_dict(bc_policy.state_dict())  # fine-tune from BC (HG-DAgger aggregates, then refits)
    for _ in range(args.updates):
        dagger.update(imitation.sample(args.batch_size))

    rows = {}
    for name, policy in ((f"BC v{args.version}", bc_policy), ("+ interventions", dagger.policy.eval())):
        rows[name] = in_process_success(policy, args.tasks, args.episodes, seed=args.seed)
    print(f"\nSuccess on {args.episodes} fresh layouts per task (seed {args.seed}), in %:")
    print(f"{'policy':<16}" + "".join(f"{t:>8}" for t in args.tasks) + f"{'mean':>8}")
    for name, r in rows.items():
        print(f"{name:<16}" + "".join(f"{100 * r[f'success/{t}']:8.1f}" for t in args.tasks)
              + f"{100 * r['success/mean']:8.1f}")
    gap = rows["+ interventions"]["success/mean"] - rows[f"BC v{args.version}"]["success/mean"]
    print(f"gap: {100 * gap:+.1f} points over {len(args.tasks) * args.episodes} episodes each")


if __name__ == "__main__":
    main()
