"""Composition rules of deployment-time steering, and the KL-budget selector (docs/steering.md).

Every rule maps a frozen diagonal-Gaussian actor ``N(mu_A, sigma_A^2)`` and a
goal-conditioned prior ``N(mu_G, sigma_G^2)`` (all tensors (..., A), element-wise,
precisions ``lam = sigma^-2``) to a diagonal Gaussian to act from:

- ``frozen``:   the actor.
- ``poe``:      pi_alpha ∝ pi_A^(1-alpha) p_G^alpha, the precision-weighted product:
                lam = (1-alpha) lam_A + alpha lam_G, mu = [(1-alpha) lam_A mu_A + alpha lam_G mu_G] / lam.
- ``klreg``:    KL-regularised adaptation with beta = alpha / (1 - alpha). ``tilt`` form
                (argmax E[beta log p_G] - KL(pi || pi_A), pi ∝ pi_A p_G^beta): lam = lam_A + beta lam_G,
                the PoE mean, covariance smaller by 1 + beta. ``geometric`` form
                (argmin KL(pi || pi_A) + beta KL(pi || p_G)): exactly the PoE Gaussian.
- ``additive``: precision-blind mixing of means, ``mix`` (1-alpha) mu_A + alpha mu_G, or ``residual``
                mu_A + alpha mu_G for a prior that outputs an action delta; the actor's std.
- ``prior``:    the prior alone.

The selector picks the largest alpha on a grid whose mean KL(pi_alpha || pi_A) over
visited states stays within a budget; it needs no returns. KL grows with alpha on
[0, 1) (the variance term is minimal at alpha = 0 and the mean shift grows), so the
feasible alphas are a prefix of the sorted grid.
"""

from __future__ import annotations

from typing import Sequence

import torch

from robo_post.models.gaussian import Gaussian

RULES = ("frozen", "poe", "klreg", "additive", "prior")
KLREG_FORMS = ("tilt", "geometric")
ADDITIVE_FORMS = ("mix", "residual")


class SteeringConfigError(ValueError):
    """A steering setting outside what the rules define."""


def check_rule(rule: str, alpha: float, klreg_form: str = "tilt", additive_form: str = "mix") -> None:
    """Raise ``SteeringConfigError`` naming the setting when a combination is undefined."""
    if rule not in RULES:
        raise SteeringConfigError(f"unknown steering rule {rule!r}; one of {RULES}")
    if klreg_form not in KLREG_FORMS:
        raise SteeringConfigError(f"klreg_form={klreg_form!r}; one of {KLREG_FORMS}")
    if additive_form not in ADDITIVE_FORMS:
        raise SteeringConfigError(f"additive_form={additive_form!r}; one of {ADDITIVE_FORMS}")
    if not 0.0 <= alpha <= 1.0 or (rule == "klreg" and alpha >= 1.0):
        allowed = "[0, 1)" if rule == "klreg" else "[0, 1]"
        raise SteeringConfigError(f"alpha={alpha} for rule {rule!r}; allowed {allowed}")


def compose(actor: Gaussian, prior: Gaussian, alpha: float, rule: str = "poe", klreg_form: str = "tilt",
            additive_form: str = "mix") -> Gaussian:
    """The steered Gaussian of ``rule`` at weight ``alpha`` (see the module docstring)."""
    check_rule(rule, alpha, klreg_form, additive_form)
    if rule == "frozen" or (alpha == 0.0 and rule in ("poe", "klreg")):  # exactly the actor, no rounding
        return actor
    if rule == "prior":
        return prior
    if rule == "additive":
        mean = actor.mean + alpha * prior.mean if additive_form == "residual" else (
            (1 - alpha) * actor.mean + alpha * prior.mean)
        return Gaussian(mean, actor.log_std)
    lam_a, lam_g = actor.precision, prior.precision
    if rule == "poe" or klreg_form == "geometric":  # the geometric KL-Reg form is the PoE Gaussian itself
        w_a, w_g = 1.0 - alpha, alpha
    else:  # tilt: pi_A * p_G^beta
        w_a, w_g = 1.0, alpha / (1.0 - alpha)
    lam = w_a * lam_a + w_g * lam_g
    mean = (w_a * lam_a * actor.mean + w_g * lam_g * prior.mean) / lam
    return Gaussian(mean, -0.5 * torch.log(lam))


def kl_diag(p: Gaussian, q: Gaussian) -> torch.Tensor:
    """KL(p || q) of diagonal Gaussians, summed over the last axis: (...,)."""
    return (q.log_std - p.log_std + (p.std ** 2 + (p.mean - q.mean) ** 2) / (2.0 * q.std ** 2) - 0.5).sum(-1)


def kl_curve(actor: Gaussian, prior: Gaussian, grid: Sequence[float]) -> list[float]:
    """Mean KL(pi_alpha || pi_A) of PoE over a batch of visited states, for each alpha of ``grid``."""
    return [float(kl_diag(compose(actor, prior, a, "poe"), actor).mean()) for a in grid]


def select_alpha(actor: Gaussian, prior: Gaussian, grid: Sequence[float], kl_budget: float,
                 alpha_max: float | None = None) -> tuple[float, list[float]]:
    """The KL-budget selector: the largest alpha of ``grid`` (capped at ``alpha_max``) whose mean
    KL(pi_alpha || pi_A) over the visited states in ``actor``/``prior`` (batches (N, A)) is at most
    ``kl_budget``; 0 when none is. Returns ``(alpha, kl per grid alpha)``."""
    if kl_budget < 0:
        raise SteeringConfigError(f"kl_budget={kl_budget}; must be >= 0")
    grid = sorted(float(a) for a in grid)
    if not grid or grid[0] < 0 or grid[-1] >= 1:
        raise SteeringConfigError(f"alpha grid {grid}: needs values in [0, 1)")
    kls = kl_curve(actor, prior, grid)
    cap = grid[-1] if alpha_max is None else alpha_max
    feasible = [a for a, kl in zip(grid, kls) if kl <= kl_budget and a <= cap]
    return (max(feasible) if feasible else 0.0), kls
