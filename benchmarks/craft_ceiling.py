"""Can a candidate scorer learn what the CRAFT proxy chooses? The proxy as a planner vs. its distillations.

Reads the on-policy episodes that ``benchmarks/craft_highway.py`` recorded (every
``*-online`` store under ``--work``: observations and the proxy's scores of all K
candidates at every state) and compares, greedily on the benchmark's evaluation seeds:

- **planner**: the proxy's best candidate at every step (counterfactual scoring in
  non-reactive clones at every decision; no learning);
- **distilled**: the pretrained policy's architecture trained on every recorded state,
  by cross-entropy on the proxy's best candidate (``--objective ce``: the most direct way
  to learn the planner's choices, with far more signal per state than the clipped policy
  gradient), or by maximising CRAFT's proxy term over all K candidates to convergence,
  ``sum_k pi_k A~_k`` plus ``--entropy`` times the policy's entropy, with the advantages
  ``A~`` of ``--objective group`` (per-state z-scores) or ``batch`` (per-state centring on
  one batch scale; see ``proxy_norm``);
- **mirror** (``--objective mirror``, from the pretrained weights): the proxy's advice only
  where the policy's own choice is predicted to go wrong. In states where the proxy scores the
  policy's first choice below ``--danger`` and its best candidate more than ``--margin`` above
  it, the target is ``softmax(log pi + (r~ - mean r~) / --tau)``; elsewhere the policy itself;
  cross-entropy to convergence. Does the right answer in the few critical states carry over to
  the evaluation's?
- **DAgger round r**: the distilled policy's own greedy episodes, scored by the proxy at
  every state, added to the data and the policy retrained (``--dagger`` rounds of
  ``--dagger-episodes`` episodes on seeds disjoint from the evaluation's).

With ``--planner-episodes N`` the data are instead the planner's own episodes (seeds from
2000), in the env built with ``--env-kwargs`` (e.g. more observed vehicles), and the scorer
is a fresh candidate policy for that env's observation: the same question for another
observation, without a CRAFT run first.

If the distilled policies stay far below the planner, CRAFT's gap to the planner is not
an optimisation budget of its loss but what the scorer can learn from its observation.

    python benchmarks/craft_ceiling.py --work runs/bench_craft       # after craft_highway.py
    python benchmarks/craft_ceiling.py --planner-episodes 60 --env-kwargs '{"observed_vehicles": 8}'
    python benchmarks/craft_ceiling.py --work runs/bench_craft --objective batch --dagger 0
    python benchmarks/craft_ceiling.py --work runs/bench_craft --objective mirror --skip-planner
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import time

import numpy as np
import torch

from robo_post.algos.craft import PROXY_NORMS, bc_pretrain, fit_minibatches, take_rows
from robo_post.envs.highway_meta import counterfactual_scores
from robo_post.envs.registry import env_spec
from robo_post.fleet.client import store_schema
from robo_post.models.candidate_policy import CandidatePolicy, CandidatePolicyConfig
from robo_post.models.features import infer_features
from robo_post.store.registry import PolicyRegistry
from robo_post.store.store import Store

from craft_highway import rollouts  # run as a script from the repository root: benchmarks/ is on the path


def recorded_states(work: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Observations (N, D) and proxy scores (N, K) of every recorded decision under ``work``."""
    obs, scores = [], []
    for root in sorted(glob.glob(os.path.join(work, "s*", "*-online"))):
        snap = Store.open(root).snapshot(record=False)
        for episode in snap.episodes():
            data = snap.load(episode)
            proxy = data["extras"]["proxy_scores"]
            obs.append(data["obs"]["state"][:len(proxy)])
            scores.append(proxy)
    if not obs:
        raise SystemExit(f"no on-policy episodes with proxy scores under {work}/s*/*-online: run craft_highway.py first")
    return torch.as_tensor(np.concatenate(obs)), torch.as_tensor(np.concatenate(scores))


class Chooser:
    """A fleet-style policy executing the first action of the candidate ``choose(obs, env)``
    picks; with ``record`` it keeps every state it saw and the proxy's scores there."""

    def __init__(self, choose, record: bool = False):
        self.choose, self.record, self.candidates = choose, record, env_spec("highway_meta").candidates()
        self.states: list[np.ndarray] = []
        self.scores: list[np.ndarray] = []

    def reset(self, env, seed) -> None:
        pass

    def act(self, obs, env) -> int:
        if self.record:
            self.states.append(obs["state"])
            self.scores.append(counterfactual_scores(env, self.candidates))
        return self.candidates[self.choose(obs, env)][0]


def distill(policy: CandidatePolicy, obs: torch.Tensor, scores: torch.Tensor, objective: str, entropy: float,
            updates: int, mirror: tuple[float, float, float] = (0.05, 0.3, 0.0)) -> float:
    """Train ``policy`` in place on the states ``obs`` (N, D) and their proxy scores (N, K);
    returns the share of states where its argmax is the proxy's best candidate. ``mirror``:
    ``(tau, margin, danger)`` of ``objective='mirror'``."""
    generator = torch.Generator().manual_seed(0)
    if objective == "ce":
        return bc_pretrain(policy, {"state": obs}, scores.argmax(-1), updates, generator=generator)["accuracy"]
    if objective == "mirror":
        tau, margin, danger = mirror
        with torch.no_grad():
            own = policy.logits({"state": obs}).log_softmax(-1)
        first = scores.gather(-1, own.argmax(-1, keepdim=True))[:, 0]
        critical = (first < danger) & (scores.max(-1).values - first > margin)
        target = torch.where(critical[:, None], (own + (scores - scores.mean(-1, keepdim=True)) / tau).softmax(-1),
                             own.exp())
        print(f"mirror: {int(critical.sum())} of {len(obs)} states where the policy's choice is predicted to go "
              "wrong", flush=True)

        def cross_entropy(index: torch.Tensor) -> torch.Tensor:
            log_pi = policy.logits(take_rows({"state": obs}, index)).log_softmax(-1)
            return -(target[index] * log_pi).sum(-1).mean()

        fit_minibatches(policy, len(obs), cross_entropy, updates, 1e-3, 256, 1.0, generator)
        with torch.no_grad():
            return float((policy.logits({"state": obs}).argmax(-1) == scores.argmax(-1)).float().mean())
    advantages = PROXY_NORMS[objective](scores)

    def loss(index: torch.Tensor) -> torch.Tensor:
        log_pi = policy.logits(take_rows({"state": obs}, index)).log_softmax(-1)
        pi = log_pi.exp()
        return -(pi * advantages[index]).sum(-1).mean() + entropy * (pi * log_pi).sum(-1).mean()

    fit_minibatches(policy, len(obs), loss, updates, 1e-3, 256, 1.0, generator)
    with torch.no_grad():
        return float((policy.logits({"state": obs}).argmax(-1) == scores.argmax(-1)).float().mean())


def greedy(policy: CandidatePolicy):
    def choose(obs, env) -> int:
        with torch.no_grad():
            return int(policy.logits({"state": torch.as_tensor(obs["state"])[None]}).argmax(-1))
    return choose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/bench_craft", help="craft_highway.py's work dir")
    parser.add_argument("--eval-episodes", type=int, default=30)
    parser.add_argument("--updates", type=int, default=4000, help="distillation steps per (re)training")
    parser.add_argument("--objective", choices=("ce", "mirror", *PROXY_NORMS), default="ce",
                        help="ce: cross-entropy on the best candidate; group / batch: CRAFT's proxy term with "
                             "those advantages, to convergence; mirror: the proxy's advice where the policy's own "
                             "choice is predicted to go wrong (--tau, --margin, --danger)")
    parser.add_argument("--tau", type=float, default=0.05, help="mirror: temperature of the proxy's scores")
    parser.add_argument("--margin", type=float, default=0.3,
                        help="mirror: the best candidate's score above the policy's choice, at least")
    parser.add_argument("--danger", type=float, default=0.0, help="mirror: the policy's choice scores below this")
    parser.add_argument("--entropy", type=float, default=0.05, help="entropy bonus of --objective group / batch")
    parser.add_argument("--init", choices=("pretrained", "fresh"), default="pretrained",
                        help="with --work: start from the pretrained policy's weights, or from fresh ones with "
                             "the recorded states' statistics")
    parser.add_argument("--skip-planner", action="store_true", help="leave out the planner's evaluation")
    parser.add_argument("--dagger", type=int, default=3, help="DAgger rounds")
    parser.add_argument("--dagger-episodes", type=int, default=20)
    parser.add_argument("--planner-episodes", type=int, default=0,
                        help="learn from this many of the planner's own episodes instead of --work's recordings")
    parser.add_argument("--env-kwargs", default="{}", help="JSON env kwargs with --planner-episodes")
    parser.add_argument("--out", default=None, help="JSON results (default: <work>/ceiling.json)")
    args = parser.parse_args()
    if args.objective == "mirror" and (args.init == "fresh" or args.planner_episodes):
        parser.error("--objective mirror moves the pretrained policy: it needs --work and --init pretrained")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # fresh scorers start from the same weights
    candidates = env_spec("highway_meta").candidates()
    planner = Chooser(lambda o, env: int(np.argmax(counterfactual_scores(env, candidates))))
    eval_seeds = list(range(100, 100 + args.eval_episodes))
    rows = {}
    if args.planner_episodes:
        env_kwargs = json.loads(args.env_kwargs)
        recorder = Chooser(planner.choose, record=True)
        rollouts(recorder, list(range(2000, 2000 + args.planner_episodes)), env_kwargs)
        obs = torch.as_tensor(np.asarray(recorder.states, np.float32))
        scores = torch.as_tensor(np.asarray(recorder.scores, np.float32))
        features = infer_features(store_schema({"name": "highway_meta", **env_kwargs}, None).observations)

        def fresh() -> CandidatePolicy:  # default widths, statistics of the planner's states
            policy = CandidatePolicy(CandidatePolicyConfig(features, len(candidates), candidates))
            policy.set_state_stats(obs.numpy().mean(0), obs.numpy().std(0))
            return policy
    else:
        summary = json.load(open(os.path.join(args.work, "s0", "pretrain", "summary.json")))
        store = os.path.join(args.work, "demos")
        env_kwargs = Store.open(store).snapshot(record=False).episodes()[0].attrs.get("env_kwargs") or {}

        obs, scores = recorded_states(args.work)
        pretrained = CandidatePolicy.from_artifact(*PolicyRegistry(store).load(summary["pretrained_version"]))

        def fresh() -> CandidatePolicy:  # the pretrained policy, or its architecture with the data's statistics
            if args.init == "pretrained":
                return copy.deepcopy(pretrained)
            policy = CandidatePolicy(pretrained.config)
            policy.set_state_stats(obs.numpy().mean(0), obs.numpy().std(0))
            return policy

        rows["pretrained"] = rollouts(Chooser(greedy(pretrained)), eval_seeds, env_kwargs)
    best = scores.argmax(-1)
    print(f"{len(best)} recorded states; share of each candidate as the proxy's best: "
          f"{np.round(np.bincount(best.numpy(), minlength=scores.shape[1]) / len(best), 3).tolist()}", flush=True)
    if not args.skip_planner:
        t0 = time.perf_counter()
        rows["planner"] = rollouts(planner, eval_seeds, env_kwargs)
        rows["planner"]["wall_s"] = time.perf_counter() - t0
    for r in range(args.dagger + 1):
        policy = fresh()
        accuracy = distill(policy, obs, scores, args.objective, args.entropy, args.updates,
                           (args.tau, args.margin, args.danger))
        name = "distilled" if r == 0 else f"dagger {r}"
        rows[name] = {**rollouts(Chooser(greedy(policy)), eval_seeds, env_kwargs), "states": len(best),
                      "train_accuracy": accuracy}
        print(f"{name}: {rows[name]}", flush=True)
        if r < args.dagger:
            seeds = range(1000 + r * args.dagger_episodes, 1000 + (r + 1) * args.dagger_episodes)
            recorder = Chooser(greedy(policy), record=True)
            rollouts(recorder, list(seeds), env_kwargs)
            obs = torch.cat([obs, torch.as_tensor(np.asarray(recorder.states, np.float32))])
            scores = torch.cat([scores, torch.as_tensor(np.asarray(recorder.scores, np.float32))])
            best = scores.argmax(-1)
    print(f"\n{'policy':<12}{'return':>9}{'crash':>8}{'speed':>8}{'states':>8}{'train acc':>11}")
    for name, row in rows.items():
        print(f"{name:<12}{row['return']:>9.2f}{row['crash']:>8.2f}{row['speed']:>8.1f}{row.get('states', ''):>8}"
              f"{row.get('train_accuracy', float('nan')):>11.3f}")
    default = "ceiling_planner.json" if args.planner_episodes else "ceiling.json"
    with open(args.out or os.path.join(args.work, default), "w") as f:
        json.dump({"args": vars(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
