"""The bandit selector: alpha from on-line calibration episodes, scored by success then return.

The KL budget reads no returns, so it keeps the steered policy near the actor exactly when
the actor is wrong for the new goal. Where episodes can be run and the env defines success
or a return, this selector reads that signal instead. Its arms are alpha = 0 (the frozen
actor) and every grid alpha up to ``alpha_max``; successive halving (Karnin et al., 2013)
spends an episode ``budget`` over R = ceil(log2 K) rounds for the K grid arms:

    round r:  every surviving grid arm and alpha = 0 play the same fresh seeds (paired),
              n_r = floor(budget / (R * (|S_r| + 1))) episodes each;
              keep the better ceil(|S_r| / 2) grid arms by (success rate, mean return)
              over all their episodes (ties: the smaller alpha).

alpha = 0 plays every round and is never eliminated: it is the floor. The last grid arm
is chosen only if it beats alpha = 0 on its paired differences d = arm - frozen, with
one-sided Student-t lower confidence bounds LCB at level 1 - delta / K (Bonferroni over the
arms the survivor was picked from):

    LCB(d_success) > 0,   or   mean(d_success) >= 0 and LCB(d_return) > margin * |mean frozen return|;

else alpha = 0. A prior that changes nothing or hurts (an honest random prior) keeps the
frozen actor; ``margin`` keeps the tiny, systematic return shifts of deterministic
policies from counting as a gain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from scipy import stats

from robo_post.steering.poe import SteeringConfigError

DELTA = 0.05  # family-wise error of choosing a grid arm that does not beat the frozen actor


def rank(r: Any) -> tuple[float, float]:
    """Sort key of an arm's rollouts (``returns``, ``successes`` or None): success rate (0 where
    undefined), then mean return."""
    return (0.0 if r.successes is None else float(np.mean(r.successes)), float(np.mean(r.returns)))


def bandit_arms(grid: Sequence[float], alpha_max: float | None = None) -> list[float]:
    """The grid arms the bandit plays besides alpha = 0: the grid's positive alphas up to ``alpha_max``, sorted.

    Raises:
        SteeringConfigError: a grid outside [0, 1).
    """
    arms = sorted(float(a) for a in grid)
    if not arms or arms[0] < 0 or arms[-1] >= 1:
        raise SteeringConfigError(f"alpha grid {arms}: needs values in [0, 1)")
    return [a for a in arms if a > 0 and (alpha_max is None or a <= alpha_max)]


def halving_plan(arms: int, budget: int) -> list[int]:
    """Episodes per arm in each successive-halving round for ``arms`` grid arms (plus alpha = 0).

    Raises:
        SteeringConfigError: no grid arm, or a budget that leaves a round without an episode per
            arm or the last arm with fewer than 2 paired episodes (no confidence bound).
    """
    if arms < 1:
        raise SteeringConfigError("the bandit needs at least one grid alpha (within alpha_max) besides 0")
    rounds = max(1, math.ceil(math.log2(arms)))
    alive = [math.ceil(arms / 2 ** r) for r in range(rounds)]
    # the first round is the thinnest; a single round must give 2 episodes for a confidence bound
    need = rounds * (arms + 1) * (2 if rounds == 1 else 1)
    if budget < need:
        raise SteeringConfigError(f"a bandit budget of {budget} episodes is too small for {arms} grid alphas and "
                                  f"alpha = 0 over {rounds} rounds; at least {need}")
    return [budget // (rounds * (n + 1)) for n in alive]


def lower_bound(d: np.ndarray, level: float) -> float:
    """One-sided Student-t lower confidence bound of the mean of ``d`` (-inf below 2 values)."""
    if len(d) < 2:
        return -math.inf
    return float(d.mean() - stats.t.ppf(level, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))


@dataclass
class BanditChoice:
    """What the bandit chose and what it spent.

    Attributes:
        alpha: the chosen alpha (0: the frozen actor).
        episodes: calibration episodes played, all arms and rounds together.
        rounds: the grid arms alive in each round.
        arms: per alpha played: episodes, success rate (None where undefined), mean return.
        survivor: the last grid arm, tested against alpha = 0.
        lcb_success / lcb_return: its lower bounds on the paired success / return differences.
        threshold: what its return bound had to clear (margin * |mean frozen return|).
    """

    alpha: float
    episodes: int
    rounds: list[list[float]]
    arms: dict[float, dict[str, Any]]
    survivor: float
    lcb_success: float | None
    lcb_return: float
    threshold: float

    def record(self) -> dict[str, Any]:
        """JSON-ready: arms keyed by alpha as text."""
        return {"alpha": self.alpha, "episodes": self.episodes, "rounds": self.rounds,
                "arms": {f"{a:g}": v for a, v in self.arms.items()}, "survivor": self.survivor,
                "lcb_success": self.lcb_success, "lcb_return": self.lcb_return,
                "threshold": self.threshold}


@dataclass
class Pooled:
    """An arm's episodes over the rounds it played, in seed order (successes None where undefined)."""

    returns: np.ndarray
    successes: np.ndarray | None

    @classmethod
    def of(cls, rollouts: Sequence[Any]) -> "Pooled":
        undefined = any(r.successes is None for r in rollouts)
        return cls(np.concatenate([np.asarray(r.returns, float) for r in rollouts]),
                   None if undefined else np.concatenate([np.asarray(r.successes, float) for r in rollouts]))


def select_alpha_bandit(play: Callable[[float, Sequence[int]], Any], grid: Sequence[float], budget: int,
                        alpha_max: float | None = None, margin: float = 0.01, seed: int = 0) -> BanditChoice:
    """Successive halving over alpha = 0 and the grid (module docstring).

    Args:
        play: ``(alpha, seeds) -> rollouts`` with ``returns`` (n,) and ``successes`` (n,) or None,
            one episode per seed (alpha = 0 must act as the frozen actor).
        grid: the grid alphas, in [0, 1); those above ``alpha_max`` are not played.
        budget: calibration episodes to spend at most, all arms together.
        margin: return gain over alpha = 0 a grid arm must show with confidence when success
            ties, as a fraction of |mean frozen return|.
        seed: first calibration seed; each round plays the next n_r seeds.

    Raises:
        SteeringConfigError: a grid outside [0, 1) or a budget too small for it (``halving_plan``).
    """
    arms = bandit_arms(grid, alpha_max)
    plan = halving_plan(len(arms), budget)
    played: dict[float, list[Any]] = {a: [] for a in [0.0, *arms]}
    rounds, alive, next_seed = [], arms, seed
    for n in plan:
        rounds.append(sorted(alive))
        seeds = list(range(next_seed, next_seed + n))
        next_seed += n
        for a in [0.0, *alive]:  # the same seeds for every arm: paired differences with alpha = 0
            played[a].append(play(a, seeds))
        alive = sorted(alive, key=lambda a: (*rank(Pooled.of(played[a])), -a), reverse=True)
        alive = alive[:math.ceil(len(alive) / 2)]
    best = alive[0]
    # the survivor played every round, on alpha = 0's seeds
    frozen, arm = Pooled.of(played[0.0]), Pooled.of(played[best])
    level = 1.0 - DELTA / len(arms)
    threshold = margin * abs(float(frozen.returns.mean()))
    lcb_return = lower_bound(arm.returns - frozen.returns, level)
    if arm.successes is not None and frozen.successes is not None:
        d_success = arm.successes - frozen.successes
        lcb_success = lower_bound(d_success, level)
        beats = lcb_success > 0 or (d_success.mean() >= 0 and lcb_return > threshold)
    else:
        lcb_success, beats = None, lcb_return > threshold
    pooled = {a: Pooled.of(rs) for a, rs in played.items() if rs}
    return BanditChoice(
        alpha=best if beats else 0.0, episodes=sum(len(p.returns) for p in pooled.values()), rounds=rounds,
        arms={a: {"episodes": len(p.returns), "return": float(p.returns.mean()),
                  "success": None if p.successes is None else float(p.successes.mean())} for a, p in pooled.items()},
        survivor=best, lcb_success=lcb_success, lcb_return=lcb_return, threshold=threshold)
