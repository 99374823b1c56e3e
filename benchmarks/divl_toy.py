"""E2 DIVL value toy (docs/methods.md, "Demonstrations: E2"): does the distributional value behave as described?

MDP: a chain of 30 one-hot states, goal at 29 (terminal, reward 1). A primitive
action a in [-1, 1] selects a move: a <= 0 "play" (-1 if a < -0.5, else stay;
a 10% chance of knocking the task over: terminal failure), 0 < a <= 0.5
"careful" (+1), a > 0.5 "risky shortcut" (+3, 15% chance of terminal failure). Chunks
are H = 3 primitive actions, gamma = 0.99 per step, episodes truncated at 60 steps.

Heterogeneous replay over the same states: 50% careful episodes (always succeed,
slowly), 25% risky episodes (succeed with probability 0.85^10 ~ 0.2), both from
state 0, and 25% failing play (start anywhere past 0). The data goes through the real
store and ``WindowSampler`` (n-step chunk returns, termination).

Arms, each with n in {1, 5} chunk steps: IQL expectile 0.7 and 0.9, DIVL with
constant tau = 0.6, DIVL with adaptive tau (tau_base 0.6, alpha 0.3, clip
[0.4, 0.9], the clip of the third-party LWD port ``HaoyunT/lwd_wall_repo``, under
which LWD's observed tau range is unclipped). Toy settings: EMA rate 0.02 (LWD 0.005) so values propagate
along the chain within the budget. Baselines: the Monte-Carlo value of the
behaviour data and the in-support optimum V*(0) = gamma^28 (careful all the way).

Printed: (a) start-state value vs updates per arm; (c) mean normalised entropy
and tau vs updates (DIVL adaptive); (d) the mode of p(.|s) along three successful
and three failed trajectories; (b) Quant_tau V(s) for tau -> 1 against the max over
in-support actions of Q(s, a), and the 0.9-expectile IQL for comparison; (e) the
gap between DIVL's read-out at tau = 0.6 (alpha = 0) and a scalar V trained with
the pinball loss at the same tau, both fitted afresh on the same frozen features and
target-critic labels of the trained constant-tau run, in units of the atom spacing.

Run: ``python benchmarks/divl_toy.py [--quick]`` (two worker processes, one thread each).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import numpy as np
import torch

from robo_post.algos.divl import DIVL, DIVLConfig, asymmetric_loss, cat_quantile
from robo_post.algos.iql import IQL, IQLConfig
from robo_post.models.features import state_features
from robo_post.models.critic import CriticConfig
from robo_post.models.encoders import mlp
from robo_post.store import ArraySpec, Store, StoreSchema, WindowSampler

N_STATES, GOAL, H, GAMMA, T_MAX = 30, 29, 3, 0.99, 60
CRITIC = CriticConfig(features=state_features(N_STATES, "proprio"), action_dim=1, horizon=H, use_text=False, embed_dim=64, hidden_dim=64)
EMA = 0.02
STATE: dict = {}  # store path and settings, set before the workers fork


def rollout(rng: np.random.Generator, kind: str) -> tuple[list[int], np.ndarray, bool]:
    """One episode: visited states (T + 1), actions (T,), success."""
    s = int(rng.integers(1, GOAL)) if kind == "play" else 0
    states, actions = [s], []
    for _ in range(T_MAX):
        a = {"careful": rng.uniform(0.1, 0.4), "risky": rng.uniform(0.6, 0.9), "play": rng.uniform(-0.9, -0.1)}[kind]
        actions.append(a)
        if (a > 0.5 and rng.random() < 0.15) or (a <= 0 and rng.random() < 0.1):
            states.append(s)
            return states, np.array(actions), False  # knocked over: terminal failure
        s = min(GOAL, max(0, s + (3 if a > 0.5 else 1 if a > 0 else -1 if a < -0.5 else 0)))
        states.append(s)
        if s == GOAL:
            return states, np.array(actions), True
    return states, np.array(actions), False  # truncated


def build_store(root: str, episodes: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    schema = StoreSchema(observations={"proprio": ArraySpec("float32", (N_STATES,))},
                         action=ArraySpec("float32", (1,), low=-1.0, high=1.0))
    store = Store.create(root, schema)
    log = []
    with store.writer("toy", fsync=False) as w:
        for i in range(episodes):
            kind = ("careful", "risky", "careful", "play")[i % 4]
            states, actions, success = rollout(rng, kind)
            T = len(actions)
            ended = success or (T < T_MAX)  # goal or knocked over
            rewards = np.zeros(T)
            rewards[-1] = float(success)
            last = np.arange(T) == T - 1
            w.write_episode({"proprio": np.eye(N_STATES, dtype=np.float32)[states]}, actions[:, None].astype(np.float32),
                            rewards=rewards, terminated=last & ended, truncated=last & (not ended), success=success)
            log.append({"kind": kind, "states": states, "success": success})
    return log


def one_hot(states) -> dict:
    return {"proprio": torch.eye(N_STATES)[torch.as_tensor(states)]}


def make_learner(arm: str):
    if arm.startswith("iql"):
        return IQL(CRITIC, IQLConfig(expectile=float(arm.split()[1]), ema_rate=EMA))
    if arm == "divl adaptive":
        return DIVL(CRITIC, DIVLConfig(ema_rate=EMA, tau_min=0.4, tau_max=0.9))
    return DIVL(CRITIC, DIVLConfig(ema_rate=EMA, adaptive_tau=False))


def proposition_1_gap(divl: DIVL, sampler: WindowSampler, steps: int, tau: float = 0.6) -> np.ndarray:
    """|Quant_tau of a categorical head - pinball scalar head| per state, in dz (check e).

    Both heads are fitted afresh on the same frozen encoder features and target-critic
    labels, so only the value loss differs (LWD's Proposition 1; docs/methods.md, "DIVL: relation to IQL").
    """
    h, K = CRITIC.hidden_dim, len(divl.atoms)
    cat_head, pin_head = mlp([h, h, h, K], layer_norm=True), mlp([h, h, h, 1], layer_norm=True)
    opt = torch.optim.Adam([*cat_head.parameters(), *pin_head.parameters()], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        batch = sampler.sample(STATE["batch"])
        with torch.no_grad():
            z = divl.net.encode(batch["obs"])
            chunk = divl.net.normalize_actions(batch["actions"])
            label = divl.target.q(divl.target.encode(batch["obs"]), chunk).min(0).values
        loss = divl.value_loss(cat_head(z), label)[0] + asymmetric_loss(label - pin_head(z).squeeze(-1), tau, 1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        z = divl.net.encode(one_hot(list(range(GOAL))))
        quant = cat_quantile(cat_head(z).softmax(-1), divl.atoms, torch.tensor(tau))
        gap = (quant - pin_head(z).squeeze(-1)).abs() / (divl.atoms[1] - divl.atoms[0])
    return gap.numpy()


def train(spec: tuple[str, int]) -> dict:
    arm, n_step = spec
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sampler = WindowSampler.from_snapshot(Store.open(STATE["root"]).snapshot(), horizon=H, n_step=n_step,
                                          gamma=GAMMA, seed=0)
    learner = make_learner(arm)
    curve, start = [], time.perf_counter()
    window: list[dict] = []
    for step in range(1, STATE["steps"] + 1):
        window.append(learner.update(sampler.sample(STATE["batch"])))
        if step % STATE["eval_every"] == 0:
            curve.append({"step": step, "v0": learner.state_value(one_hot([0])).item(),
                          **{k: float(np.mean([m[k] for m in window])) for k in ("tau_mean", "entropy_next_mean")
                             if k in window[0]}})
            window = []
    out = {"arm": arm, "n": n_step, "curve": curve, "seconds": time.perf_counter() - start}
    states = list(range(GOAL))
    out["v_states"] = learner.state_value(one_hot(states)).tolist()
    if isinstance(learner, DIVL):
        p = learner.value_distribution(one_hot(states))
        out["mode"] = learner.atoms[p.argmax(-1)].tolist()
        out["q_tau"] = {t: cat_quantile(p, learner.atoms, torch.tensor(t)).tolist() for t in (0.9, 0.99)}
        out["dz"] = (learner.atoms[1] - learner.atoms[0]).item()
    # Max over in-support chunks at each state of the target-min Q (check b).
    batch = sampler.sample(0, starts=np.arange(len(sampler)))
    with torch.no_grad():
        q = learner.q_values(batch["obs"], learner.net.normalize_actions(batch["actions"])).min(0).values
    s_idx = batch["obs"]["proprio"].argmax(-1)
    out["q_max"] = [q[s_idx == s].max().item() if (s_idx == s).any() else float("nan") for s in states]
    if arm == "divl const" and n_step == 1:
        out["prop1_gap"] = proposition_1_gap(learner, sampler, STATE["steps"]).tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer updates and episodes (~1 min)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    steps = 600 if args.quick else 2000
    STATE.update(steps=steps, batch=128, eval_every=steps // 5)
    with tempfile.TemporaryDirectory() as tmp:
        STATE["root"] = tmp + "/store"
        log = build_store(STATE["root"], 300 if args.quick else 600)
        arms = ["iql 0.7", "iql 0.9", "divl const", "divl adaptive"]
        jobs = [(a, n) for a in arms for n in (1, 5)]
        with mp.get_context("fork").Pool(args.workers) as pool:
            results = {(r["arm"], r["n"]): r for r in pool.map(train, jobs, chunksize=1)}

    v_star = GAMMA ** (GOAL - 1)
    mc = np.mean([GAMMA ** (len(e["states"]) - 2) * e["success"] for e in log if e["states"][0] == 0])
    success = np.mean([e["success"] for e in log])
    print(f"E2 DIVL toy ({'quick' if args.quick else 'full'}): {len(log)} episodes (success {success:.2f}), "
          f"{steps} updates x batch {STATE['batch']}; V*(0) in-support optimum {v_star:.3f}; "
          f"behaviour Monte-Carlo value at state 0 {mc:.3f}")
    steps_row = [c["step"] for c in results["iql 0.7", 1]["curve"]]
    print("\n(a) start-state value V(0) vs updates")
    print(f"{'arm':<15} {'n':>2} " + " ".join(f"{s:>7}" for s in steps_row) + f" {'|V-V*|':>7} {'sec':>6}")
    for (arm, n), r in results.items():
        vals = [c["v0"] for c in r["curve"]]
        print(f"{arm:<15} {n:>2} " + " ".join(f"{v:7.3f}" for v in vals) + f" {abs(vals[-1] - v_star):7.3f} "
              f"{r['seconds']:6.1f}")

    print("\n(c) DIVL adaptive: mean normalised entropy H~ and mean tau at the bootstrap states vs updates")
    for n in (1, 5):
        curve = results["divl adaptive", n]["curve"]
        print(f"n={n}  H~ : " + " ".join(f"{c['entropy_next_mean']:.3f}" for c in curve))
        print(f"n={n}  tau: " + " ".join(f"{c['tau_mean']:.3f}" for c in curve))

    ref = results["divl adaptive", 1]
    print("\n(d) mode of p(.|s) along trajectories (DIVL adaptive, n=1), every chunk")
    longest_failures = sorted((e for e in log if not e["success"]), key=lambda e: -len(e["states"]))
    shown = [e for e in log if e["success"] and e["kind"] == "careful"][:1] + \
        [e for e in log if e["success"] and e["kind"] == "risky"][:2] + \
        [e for e in longest_failures if e["kind"] == "risky"][:2] + \
        [e for e in longest_failures if e["kind"] == "play"][:1]
    for e in shown:
        modes = [ref["mode"][s] for s in e["states"][:-1:H]]
        print(f"{'success' if e['success'] else 'failure'} {e['kind']:<7}: " + " ".join(f"{m:.2f}" for m in modes))

    dz = ref["dz"]
    print("\n(b) tau -> 1: mean over states of Quant_tau V(s) - max_{a in data} Q(s, a), in units of dz")
    for (arm, n) in (("divl adaptive", 1), ("divl const", 1)):
        r = results[arm, n]
        for t in (0.9, 0.99):
            gap = np.nanmean(np.array(r["q_tau"][t]) - np.array(r["q_max"])) / dz
            print(f"{arm:<14} n={n} tau={t:<4}: {gap:+6.2f} dz")
    r = results["iql 0.9", 1]
    print(f"{'iql 0.9':<14} n=1 V(s)    : {np.nanmean(np.array(r['v_states']) - np.array(r['q_max'])) / dz:+6.2f} dz")

    gap = np.array(results["divl const", 1]["prop1_gap"])
    print(f"\n(e) alpha = 0, tau = 0.6, same features and labels: |Quant_tau(categorical) - pinball V| over states: "
          f"mean {gap.mean():.2f} dz, max {gap.max():.2f} dz (Proposition 1: within 1 dz)")
    print(f"wall {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
