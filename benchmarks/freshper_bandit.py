"""FreshPER CPU-scale demonstration (docs/methods.md, "Demonstrations: FreshPER drifting bandit").

Env: a 10-armed Gaussian bandit, arm means a permutation of linspace(0, 1, 10), reward
noise sd 0.3. At step T/2 the means are permuted again (per seed: a random permutation
under which the old best arm drops to the lower half), T = 20k learner updates.

Learner (identical for all arms): a softmax policy pi = softmax(theta) over the arms, one
new environment step per update, REINFORCE with an EMA reward baseline b (rate 0.01) and
an entropy bonus (0.05), step size 0.1:

    theta += lr * sum_i[ w_i * min(pi(a_i) / mu_i(a_i), 1) * (r_i - b) * (e_{a_i} - pi) ] / sum_i w_i
           + lr * ent * dH/dtheta

mu_i is the behaviour probability stored with each item (the policy when it acted); the
min(., 1) is the clipped-IS off-policy correction; w_i are the replay IS weights. The batch
sum is divided by sum_i w_i (self-normalised IS), not by B, so that dividing w by the batch
max does not silently shrink the step size of the prioritised arms.

Arms:
  * on-policy: each update uses only the newest sample (w = 1, ratio 1);
  * PER: FreshPER(tau = inf) with |r| priority (priority="reward"), batch 32;
  * FreshPER: tau in {50, 200, 1000} with |r| priority, batch 32.
Replay: capacity T (nothing is evicted), alpha 0.6, beta 0.4 -> 1.0 over T steps, refresh
every step (paper defaults); rewards never change, so priorities are not updated.

Printed per arm (mean ± std over seeds): pseudo-regret sum_t (mu*_t - mu_t(a_t)), total and
after the drift; recovery time (defined in the output); mean age of the sampled items over
the second half, at the drift and at the end; ESS/B of the replay IS weights w and of the
full per-item weight w * clipped ratio. Then the expected outcomes (docs/methods.md,
"Demonstrations: FreshPER drifting bandit") with PASS/MISS (never fails; exit 0).

Run: ``python benchmarks/freshper_bandit.py [--quick] [--seeds N] [--workers N]``
(full: 5 seeds, ~200 CPU-s in 2 worker processes: ~2 min on 2 idle cores, 6.5 min measured at
load average 6-7; --quick: T = 2000, 2 seeds, ~7 CPU-s, a smoke run whose numbers mean little).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from robo_post.store.replay import FreshPER, FreshPERConfig, ess  # noqa: E402

K = 10
NOISE = 0.3
LR = 0.1
ENT = 0.05
BASELINE_RATE = 0.01
CLIP = 1.0
BATCH = 32
ALPHA = 0.6
TAUS = (50.0, 200.0, 1000.0)
RECOVERY_WINDOW = 200
RECOVERY_FRAC = 0.9


def arm_names() -> list[str]:
    return ["on-policy", "PER |r| (tau=inf)"] + [f"FreshPER tau={int(t)}" for t in TAUS]


def make_means(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Means before and after the drift: permutations of linspace(0, 1, K); the old best arm
    ends up in the lower half after the drift."""
    rng = np.random.default_rng(10_000 + seed)
    levels = np.linspace(0.0, 1.0, K)
    mu0 = levels[rng.permutation(K)]
    old_best = int(np.argmax(mu0))
    while True:
        mu1 = levels[rng.permutation(K)]
        if mu1[old_best] < np.median(levels):
            return mu0, mu1


def run(arm: str, seed: int, T: int) -> dict:
    """One learner run; returns per-step chosen-arm means and replay diagnostics."""
    mu0, mu1 = make_means(seed)
    rng = np.random.default_rng(seed)
    u_act = rng.random(T)
    noise = rng.standard_normal(T) * NOISE
    theta = np.zeros(K)
    b = 0.0
    chosen_mean = np.empty(T)
    opt = np.empty(T)
    replay = arm != "on-policy"
    if replay:
        tau = float("inf") if arm.startswith("PER") else float(arm.split("=")[1])
        cfg = FreshPERConfig(alpha=ALPHA, tau=tau, beta0=0.4, beta1=1.0, beta_steps=T, priority="reward")
        buf = FreshPER(T, cfg, seed=seed)
        acts = np.zeros(T, dtype=np.int64)
        rews = np.zeros(T)
        mub = np.zeros(T)
        ages = np.zeros(T)
        ess_w = np.zeros(T)
        ess_tot = np.zeros(T)
    half = T // 2
    for t in range(T):
        mu = mu0 if t < half else mu1
        z = np.exp(theta - theta.max())
        pi = z / z.sum()
        a = min(int(np.searchsorted(np.cumsum(pi), u_act[t], side="right")), K - 1)
        r = mu[a] + noise[t]
        chosen_mean[t] = mu[a]
        opt[t] = mu.max()
        if replay:
            i = int(buf.add(np.array([r]), t)[0])  # priority |r| + eps, decay factor 1
            acts[i], rews[i], mub[i] = a, r, pi[a]
            ids, w = buf.sample(BATCH, t)
            ba, br = acts[ids], rews[ids]
            rho = np.minimum(pi[ba] / mub[ids], CLIP)  # clipped-IS correction for policy drift
            coef = w * rho * (br - b) / w.sum()
            ages[t] = buf.mean_age(ids, t)
            ess_w[t] = ess(w) / BATCH
            ess_tot[t] = ess(w * rho) / BATCH
        else:
            ba = np.array([a])
            coef = np.array([r - b])
        grad = np.bincount(ba, weights=coef, minlength=K) - coef.sum() * pi
        logpi = np.log(pi + 1e-300)
        ent = -(pi * logpi).sum()
        grad += ENT * (-pi * (logpi + ent))  # dH/dtheta
        theta += LR * grad
        b += BASELINE_RATE * (r - b)
    out = {"chosen_mean": chosen_mean, "opt": opt}
    if replay:
        out.update(ages=ages, ess_w=ess_w, ess_tot=ess_tot)
    return out


def summarize(res: dict, T: int) -> dict:
    half = T // 2
    reg = res["opt"] - res["chosen_mean"]
    # recovery: first step after the drift at which the trailing RECOVERY_WINDOW-step mean of
    # mu_t(a_t) reaches RECOVERY_FRAC * (new optimum); censored at T/2 if never
    post = res["chosen_mean"][half:]
    c = np.concatenate([[0.0], np.cumsum(post)])
    W = RECOVERY_WINDOW
    ma = (c[W:] - c[:-W]) / W  # ma[j] = mean of post[j : j + W], ends at step half + j + W - 1
    hit = np.nonzero(ma >= RECOVERY_FRAC * res["opt"][-1])[0]
    rec = float(hit[0] + W) if hit.size else float(T - half)
    s = {"regret": reg.sum(), "regret_post": reg[half:].sum(), "recovery": rec, "censored": not hit.size}
    if "ages" in res:
        tail = max(T // 40, 50)
        s.update(age_post=res["ages"][half:].mean(), age_drift=res["ages"][half - tail:half].mean(),
                 age_end=res["ages"][-tail:].mean(), ess_w=res["ess_w"].mean(), ess_tot=res["ess_tot"].mean())
    return s


def _job(args):
    arm, seed, T = args
    return arm, seed, summarize(run(arm, seed, T), T)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 2000, 2 seeds (smoke run)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="T (learner updates); default 20000")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    T = args.steps or (2000 if args.quick else 20000)
    n_seeds = args.seeds or (2 if args.quick else 5)
    arms = arm_names()
    jobs = [(arm, s, T) for s in range(n_seeds) for arm in arms]
    t0 = time.time()
    if args.workers > 1:
        with mp.get_context("fork").Pool(args.workers) as pool:
            results = pool.map(_job, jobs, chunksize=1)
    else:
        results = [_job(j) for j in jobs]
    by_arm = {arm: [r for a, _, r in results if a == arm] for arm in arms}

    def ms(arm, key, fmt="{:.0f}"):
        v = np.array([r[key] for r in by_arm[arm]], dtype=float)
        return (fmt + " ± " + fmt).format(v.mean(), v.std())

    print(f"FreshPER drifting-bandit demo: K={K} arms, T={T} updates, drift at t={T // 2}, "
          f"{n_seeds} seeds, batch {BATCH}, alpha {ALPHA}, beta 0.4->1.0; {time.time() - t0:.0f} s")
    print(f"recovery = steps after the drift until the trailing {RECOVERY_WINDOW}-step mean of mu_t(a_t) "
          f">= {RECOVERY_FRAC:.0%} of the new optimum (incl. the window; censored at {T // 2} = never)")
    print("age = mean age (learner steps) of the sampled batch: over t >= T/2 | just before the drift | at the end;"
          " ESS/B: of the replay IS weights w | of w * clipped ratio")
    hdr = (f"{'arm':<20} {'regret total':>15} {'regret post':>15} {'recovery':>14} {'cens':>4} "
           f"{'age post':>13} {'age@T/2':>13} {'age@T':>13} {'ESS_w/B':>11} {'ESS_tot/B':>11}")
    print(hdr)
    print("-" * len(hdr))
    for arm in arms:
        cens = sum(r["censored"] for r in by_arm[arm])
        row = f"{arm:<20} {ms(arm, 'regret'):>15} {ms(arm, 'regret_post'):>15} {ms(arm, 'recovery'):>14} {cens:>4} "
        if arm == "on-policy":
            row += f"{'0 (fresh)':>13} {'0':>13} {'0':>13} {'1.00':>11} {'1.00':>11}"
        else:
            row += (f"{ms(arm, 'age_post'):>13} {ms(arm, 'age_drift'):>13} {ms(arm, 'age_end'):>13} "
                    f"{ms(arm, 'ess_w', '{:.2f}'):>11} {ms(arm, 'ess_tot', '{:.2f}'):>11}")
        print(row)

    mean = {arm: {k: float(np.mean([r[k] for r in by_arm[arm]])) for k in by_arm[arm][0]} for arm in arms}
    per, onp = "PER |r| (tau=inf)", "on-policy"
    fresh = [a for a in arms if a.startswith("FreshPER")]
    print("\nExpected (design-choice targets; means over seeds):")

    def line(ok: bool, text: str) -> None:
        print(f"  [{'PASS' if ok else 'MISS'}] {text}")

    # ties (all censored at T/2) are broken by the post-drift regret
    slowest = all((mean[per]["recovery"], mean[per]["regret_post"]) > (mean[a]["recovery"], mean[a]["regret_post"])
                  for a in arms if a != per)
    line(slowest, "PER recovers slowest (recovery time; ties -> post-drift regret): "
         + ", ".join(f"{a} {mean[a]['recovery']:.0f}/{mean[a]['regret_post']:.0f}" for a in arms))
    for a in fresh:  # ties (both censored) are broken by the post-drift regret, as above
        line((mean[a]["recovery"], mean[a]["regret_post"]) <= (mean[onp]["recovery"], mean[onp]["regret_post"]),
             f"{a} recovers at least as fast as on-policy: recovery/post-drift regret "
             f"{mean[a]['recovery']:.0f}/{mean[a]['regret_post']:.0f} vs {mean[onp]['recovery']:.0f}/"
             f"{mean[onp]['regret_post']:.0f}")
    for a in fresh:
        tau = float(a.split("=")[1])
        bound = tau / ALPHA
        line(mean[a]["age_end"] <= 2 * bound,
             f"{a}: mean sampled age O(tau/alpha): {mean[a]['age_end']:.0f} at T <= 2 tau/alpha = {2 * bound:.0f}"
             f" (tau/alpha = {bound:.0f})")
    line(mean[per]["age_end"] >= 1.5 * mean[per]["age_drift"],
         f"PER mean sampled age keeps growing: {mean[per]['age_drift']:.0f} at T/2 -> {mean[per]['age_end']:.0f}"
         f" at T (>= 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
