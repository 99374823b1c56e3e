"""The auto selector: the bandit where the env scores the new goal by success, the KL budget elsewhere.

The KL budget (``robo_post.steering.poe.select_alpha``) reads no task signal. It is safe to
run anywhere, but it keeps the steered policy near the actor exactly when the actor is wrong
for the new goal: there a good prior disagrees with it strongly, the KL grows fast with alpha,
and the budget stops at a small alpha that does not reach the goal. The bandit
(``robo_post.steering.bandit``) reads success, then return, in steered calibration episodes and
keeps the frozen actor unless an alpha beats it with confidence.

Auto first plays the frozen actor on calibration seeds. Its visited states are what the KL
budget reads; whether those episodes report success (``info["is_success"]`` or the env
registry's success rule) tells whether the env scores the goal:

- success defined: the bandit, whose floor keeps the frozen actor when no alpha helps;
- no success: the KL budget on those states. A return alone is the reward designer's signal,
  which may score the old task rather than the new goal; ``selector.kind=bandit`` reads it
  when the user vouches for it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from robo_post.steering.bandit import select_alpha_bandit
from robo_post.steering.poe import select_alpha
from robo_post.steering.sources import Source


def auto_kind(successes: Any) -> str:
    """The selector auto runs: ``bandit`` where the frozen calibration episodes report success
    (``successes`` not None), else ``kl_budget``."""
    return "kl_budget" if successes is None else "bandit"


def select_alpha_auto(frozen: Any, actor: Source, prior: Source, play: Callable[[float, Sequence[int]], Any],
                      grid: Sequence[float], kl_budget: float, bandit_episodes: int, alpha_max: float | None = None,
                      margin: float = 0.01, seed: int = 0) -> tuple[float, dict[str, Any]]:
    """Alpha from the bandit where ``frozen`` reports success, else from the KL budget on its states.

    Args:
        frozen: the frozen actor's calibration episodes: ``successes`` ((n,) or None where the env
            defines none) and ``states`` (every visited observation, each key (N, ...)).
        actor / prior: the sources, for the KL budget's distributions at ``frozen.states``.
        play: ``(alpha, seeds) -> rollouts`` of steered episodes, for the bandit.
        grid / alpha_max: the alpha grid and the cap, for either selector.
        kl_budget: the KL budget's bound in nats (the fallback).
        bandit_episodes / margin / seed: the bandit's budget, return margin and first seed.

    Returns:
        ``(alpha, record)``: the record names the selector used (``kind``) and why, then that
        selector's own record.
    """
    if auto_kind(frozen.successes) == "kl_budget":
        with torch.no_grad():
            alpha, kls = select_alpha(actor.distribution(frozen.states), prior.distribution(frozen.states), grid,
                                      kl_budget, alpha_max)
        return alpha, {"kind": "kl_budget", "why": "the frozen calibration episodes report no success",
                       "alpha": alpha, "kl_budget": kl_budget, "kl_curve": kls,
                       "states": len(next(iter(frozen.states.values())))}
    choice = select_alpha_bandit(play, grid, bandit_episodes, alpha_max, margin, seed)
    return choice.alpha, {"kind": "bandit", "why": "the env reports success", "bandit_episodes": bandit_episodes,
                          "frozen_calibration_success": float(frozen.successes.mean()), **choice.record()}
