"""Does a critic tell a flow policy's chunks apart? An offline check, seconds per critic.

The flow (default v1, BC) acts plainly on fresh tabletop layouts; at every decision it
proposes ``--n`` chunks and executes the first, and every observation, proposal and
episode outcome is kept. Then each critic (of the published ``flow_ranked`` versions
given) rates the kept proposals, and the script prints per task:

- ``spread``: the std of Q over one decision's proposals (mean over decisions), against
  the std of the proposals' mean Q across decisions (states), and their ratio. Best-of-N
  and QAM act only on the first; a critic whose Q barely moves with the chunk ranks noise.
- ``adv AUC``: per episode, the mean over its decisions of the executed chunk's
  standardised advantage, (Q(executed) - mean Q) / std Q; the AUC of that score for
  success. A critic that ranks chunks puts it above 0.5 (chance); its standard error is
  about 0.06 at 100 episodes and 35% success.
- ``V AUC``: the AUC of the first decision's mean Q for success: how well the critic
  reads the layout's difficulty, which needs no action sensitivity.

    .venv/bin/python benchmarks/critic_sensitivity.py --store runs/demo/store --critic-versions 2 3

Cheaper and less noisy than ``critic_ranking.py`` (which rolls out best-of-N itself):
the rollouts are made once and each critic is scored on the same proposals.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
from torch import nn

from robo_post.eval.rollout import in_process_success
from robo_post.models.ranked import RankedFlowPolicy, flow_of
from robo_post.store import PolicyRegistry


class _Recorder(nn.Module):
    """Acts with the first of N proposals and keeps (episode, observation, proposals) per decision."""

    def __init__(self, proposer: RankedFlowPolicy, outcomes: list[bool]):
        super().__init__()
        self.proposer, self.outcomes, self.decisions = proposer, outcomes, []

    @property
    def config(self):
        return self.proposer.config

    @property
    def device(self) -> torch.device:
        return self.proposer.device

    def sample(self, obs: dict[str, Any], seed: int | None = None) -> torch.Tensor:
        x = self.proposer.propose(obs, seed=seed)
        self.decisions.append((len(self.outcomes), obs, x))  # episodes end by appending to outcomes
        return self.proposer.policy.unnormalize_actions(x[:, 0])


def _auc(score: np.ndarray, success: np.ndarray) -> float:
    """P(score of a success > score of a failure), ties half."""
    pos, neg = score[success], score[~success]
    if not len(pos) or not len(neg):
        return float("nan")
    return float((pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store holding the policy registry")
    parser.add_argument("--flow-version", type=int, default=1, help="version whose flow proposes the chunks (1 = BC)")
    parser.add_argument("--critic-versions", type=int, nargs="+", required=True, help="published flow_ranked versions")
    parser.add_argument("--n", type=int, default=16, help="chunks proposed per decision")
    parser.add_argument("--tasks", nargs="+", default=["reach", "push", "pick", "place"])
    parser.add_argument("--episodes", type=int, default=100, help="layouts per task")
    parser.add_argument("--seed", type=int, default=4242, help="layout seed (away from the training and eval seeds)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    registry = PolicyRegistry(args.store)
    flow = flow_of(*registry.load(args.flow_version))
    critics = {v: RankedFlowPolicy.from_artifact(*registry.load(v)).critic for v in args.critic_versions}

    outcomes: list[bool] = []
    # Proposals come from the flow alone; any of the critics makes the proposer, none is consulted.
    recorder = _Recorder(RankedFlowPolicy(flow, next(iter(critics.values())), args.n), outcomes)
    in_process_success(recorder, args.tasks, args.episodes, seed=args.seed, outcomes=outcomes)
    episode = np.array([e for e, _, _ in recorder.decisions])
    success = np.array(outcomes)
    task_of = np.repeat(args.tasks, args.episodes)
    print(f"flow v{args.flow_version}, {args.n} proposals per decision, {args.episodes} layouts per task, "
          f"{len(episode)} decisions; plain success " + ", ".join(
              f"{t} {100 * success[task_of == t].mean():.0f}%" for t in args.tasks))
    print(f"{'critic':<7} {'task':<6} {'Q spread: proposals':>20} {'states':>7} {'ratio':>6} {'adv AUC':>8} {'V AUC':>6}")
    for version, critic in critics.items():
        ranker = RankedFlowPolicy(flow, critic, args.n)
        q = torch.cat([ranker.rate(obs, x) for _, obs, x in recorder.decisions]).numpy()  # (decisions, N)
        advantage = (q[:, 0] - q.mean(1)) / (q.std(1) + 1e-8)
        for task in args.tasks:
            eps = np.flatnonzero(task_of == task)
            rows = np.isin(episode, eps)
            spread, across = q[rows].std(1).mean(), q[rows].mean(1).std()
            score = np.array([advantage[episode == e].mean() for e in eps])
            first = np.array([q[np.argmax(episode == e)].mean() for e in eps])
            print(f"v{version:<6} {task:<6} {spread:20.4f} {across:7.4f} {spread / across:6.3f} "
                  f"{_auc(score, success[eps]):8.3f} {_auc(first, success[eps]):6.3f}", flush=True)


if __name__ == "__main__":
    main()
