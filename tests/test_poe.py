"""Invariants of the steering rules and the KL-budget selector (docs/steering.md)."""

import math

import numpy as np
import pytest
import torch

from robo_post.models.gaussian import Gaussian
from robo_post.steering.evaluate import Rollouts, compare, label, paired_bootstrap, rank
from robo_post.steering.poe import SteeringConfigError, compose, kl_curve, kl_diag, select_alpha
from robo_post.steering.sources import QUALITIES, ScriptedPrior, SteeringSourceError, squashed_gaussian

GRID = (0.1, 0.3, 0.5, 0.7, 0.9)


def random_pair(seed=0, n=64, d=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return Gaussian(r(n, d), 0.5 * r(n, d)), Gaussian(r(n, d) * 2, 0.5 * r(n, d))


@pytest.mark.parametrize("alpha", GRID)
def test_poe_and_tilted_klreg_share_the_mean_and_differ_by_one_plus_beta(alpha):
    actor, prior = random_pair()
    poe, klreg = compose(actor, prior, alpha, "poe"), compose(actor, prior, alpha, "klreg", "tilt")
    beta = alpha / (1 - alpha)
    assert torch.allclose(poe.mean, klreg.mean, atol=1e-12)
    ratio = poe.std ** 2 / klreg.std ** 2
    assert torch.allclose(ratio, torch.full_like(ratio, 1 + beta), rtol=1e-12)


def test_geometric_klreg_has_the_poe_covariance():
    actor, prior = random_pair(1)
    for alpha in GRID:
        poe, geo = compose(actor, prior, alpha, "poe"), compose(actor, prior, alpha, "klreg", "geometric")
        assert torch.allclose(geo.log_std, poe.log_std, atol=1e-12) and torch.allclose(geo.mean, poe.mean, atol=1e-12)


def test_poe_limits_alpha_zero_is_the_actor_alpha_one_the_prior():
    actor, prior = random_pair(2)
    zero, one = compose(actor, prior, 0.0, "poe"), compose(actor, prior, 1.0, "poe")
    assert torch.equal(zero.mean, actor.mean) and torch.allclose(zero.log_std, actor.log_std, atol=1e-12)
    assert torch.allclose(one.mean, prior.mean, atol=1e-12) and torch.allclose(one.log_std, prior.log_std, atol=1e-12)
    near = compose(actor, prior, 1 - 1e-9, "poe")
    assert torch.allclose(near.mean, prior.mean, atol=1e-6)


def test_a_huge_prior_variance_anchors_to_the_actor():
    actor, prior = random_pair(3)
    vague = Gaussian(prior.mean, torch.full_like(prior.log_std, math.log(1e6)))
    for alpha in GRID:
        assert torch.allclose(compose(actor, vague, alpha, "poe").mean, actor.mean, atol=1e-6)
    # An overconfident wrong prior is not anchored: precision weighting follows it.
    sharp = Gaussian(prior.mean, torch.full_like(prior.log_std, math.log(1e-3)))
    assert torch.allclose(compose(actor, sharp, 0.5, "poe").mean, prior.mean, atol=1e-3)


def test_poe_mean_between_the_experts_and_precision_at_least_the_smaller():
    actor, prior = random_pair(4)
    for alpha in GRID:
        s = compose(actor, prior, alpha, "poe")
        lo, hi = torch.minimum(actor.mean, prior.mean), torch.maximum(actor.mean, prior.mean)
        assert bool(((s.mean >= lo - 1e-12) & (s.mean <= hi + 1e-12)).all())
        assert bool((s.precision >= torch.minimum(actor.precision, prior.precision) * (1 - 1e-12)).all())


def test_additive_and_prior_rules():
    actor, prior = random_pair(5)
    mix = compose(actor, prior, 0.3, "additive")
    assert torch.allclose(mix.mean, 0.7 * actor.mean + 0.3 * prior.mean) and torch.equal(mix.log_std, actor.log_std)
    res = compose(actor, prior, 0.3, "additive", additive_form="residual")
    assert torch.allclose(res.mean, actor.mean + 0.3 * prior.mean)
    assert compose(actor, prior, 0.3, "prior") is prior and compose(actor, prior, 0.3, "frozen") is actor


def test_closed_form_kl_equals_torch_distributions():
    p, q = random_pair(6)
    expected = torch.distributions.kl_divergence(torch.distributions.Normal(p.mean, p.std),
                                                 torch.distributions.Normal(q.mean, q.std)).sum(-1)
    assert torch.allclose(kl_diag(p, q), expected, atol=1e-10)


def test_kl_to_the_actor_is_zero_at_alpha_zero_and_non_decreasing():
    actor, prior = random_pair(7)
    grid = np.linspace(0.0, 0.95, 40)
    kls = kl_curve(actor, prior, grid)
    assert kls[0] == pytest.approx(0.0, abs=1e-12)
    assert all(b >= a - 1e-12 for a, b in zip(kls, kls[1:]))


def test_selector_limits_and_monotone_budget():
    actor, prior = random_pair(8)
    assert select_alpha(actor, prior, GRID, 0.0)[0] == 0.0
    assert select_alpha(actor, prior, GRID, math.inf)[0] == 0.9
    assert select_alpha(actor, prior, GRID, math.inf, alpha_max=0.5)[0] == 0.5
    chosen = [select_alpha(actor, prior, GRID, eps)[0] for eps in (0.01, 0.1, 0.5, 1, 2, 5, 20, 100)]
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]
    alpha, kls = select_alpha(actor, prior, GRID, 1.0)
    assert all(k <= 1.0 for a, k in zip(GRID, kls) if a <= alpha)


def test_an_honest_random_prior_barely_moves_a_confident_actor_an_overconfident_one_does():
    actor, _ = random_pair(9)
    actor = Gaussian(actor.mean, torch.full_like(actor.mean, math.log(0.1)))
    target = torch.rand_like(actor.mean) * 2 - 1
    honest = Gaussian(target, torch.full_like(actor.mean, math.log(3.0)))
    overconfident = Gaussian(target, torch.full_like(actor.mean, math.log(0.2)))
    gap = (target - actor.mean).abs()
    for alpha in GRID:
        shift = (compose(actor, honest, alpha, "poe").mean - actor.mean).abs()
        assert bool((shift <= 0.011 * gap + 1e-12).all())  # g(alpha) <= 0.9/9 / (0.1 * 100) ~ 1%
    assert bool(((compose(actor, overconfident, 0.9, "poe").mean - actor.mean).abs() >= 0.6 * gap).all())


def test_bad_settings_are_typed_errors():
    actor, prior = random_pair(10)
    with pytest.raises(SteeringConfigError, match="rule"):
        compose(actor, prior, 0.5, "mixture")
    with pytest.raises(SteeringConfigError, match="alpha=1.0"):
        compose(actor, prior, 1.0, "klreg")
    with pytest.raises(SteeringConfigError, match="alpha=1.5"):
        compose(actor, prior, 1.5, "poe")
    with pytest.raises(SteeringConfigError, match="kl_budget"):
        select_alpha(actor, prior, GRID, -1.0)
    with pytest.raises(SteeringSourceError, match="std"):
        ScriptedPrior(lambda o: o["x"], np.zeros(2), np.ones(2), std=0.0)


def test_squashed_gaussian_moments_match_monte_carlo():
    mean_u, log_std_u = torch.tensor([[0.3, 2.5, -1.0]]), torch.tensor([[-1.0, 0.0, 0.5]])
    centre, std = squashed_gaussian(mean_u, log_std_u)
    u = mean_u + log_std_u.exp() * torch.randn(200_000, 3, generator=torch.Generator().manual_seed(0))
    mc = ((torch.tanh(u) - torch.tanh(mean_u)) ** 2).mean(0).sqrt()
    assert torch.allclose(centre, torch.tanh(mean_u))
    assert torch.allclose(std[0], mc, rtol=0.02)


def test_scripted_prior_qualities():
    controller = lambda obs: np.clip(obs["goal"] - obs["position"], -1, 1)  # noqa: E731
    obs = {"goal": np.full((5, 2), 0.5), "position": np.zeros((5, 2))}
    good = ScriptedPrior(controller, -np.ones(2), np.ones(2), **QUALITIES["good"])
    d = good.distribution(obs)
    assert np.allclose(d.mean.numpy(), 0.5) and np.allclose(d.std.numpy(), 0.2)
    rand = ScriptedPrior(controller, -np.ones(2), np.ones(2), **QUALITIES["random_honest"])
    m = rand.distribution(obs).mean.numpy()
    assert (np.abs(m) <= 1).all() and m.std() > 0.1 and np.allclose(rand.distribution(obs).std.numpy(), 3.0)


def test_success_ranks_before_return_where_the_env_defines_it():
    """A steered arm reaching the goal every time at a lower return (it moves further) read HURT, and
    the oracle alpha (best return) reached the goal in none of its episodes."""
    rng = np.random.default_rng(0)
    reaches = Rollouts(rng.normal(-20.0, 1.0, 60), np.ones(60))
    misses = Rollouts(rng.normal(-10.0, 1.0, 60), np.zeros(60))
    assert compare(reaches, misses) == "HELP" and compare(misses, reaches) == "HURT"
    assert max([misses, reaches], key=rank) is reaches
    both = Rollouts(reaches.returns + 5.0, np.ones(60))  # the same successes: return decides
    assert compare(both, reaches) == "HELP" and compare(reaches, both) == "HURT"
    no_success = Rollouts(misses.returns, None)
    assert compare(reaches, no_success) == "HURT"  # nothing to rank by but the return


def test_paired_bootstrap_labels():
    rng = np.random.default_rng(0)
    assert label(*paired_bootstrap(rng.normal(1.0, 1.0, 200))[1:]) == "HELP"
    assert label(*paired_bootstrap(rng.normal(-1.0, 1.0, 200))[1:]) == "HURT"
    assert label(*paired_bootstrap(rng.normal(0.0, 1.0, 200))[1:]) == "FROZEN"
    # one difference resamples to itself: a zero-width CI that labelled any nonzero difference
    with pytest.raises(ValueError, match="at least 2 differences, got 1"):
        paired_bootstrap(np.array([-3.0]))
