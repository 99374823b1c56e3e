"""FreshPER: the properties listed in docs/methods.md, "Online data: what the tests check", plus sum-tree checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from robo_post.store.replay import FreshPER, FreshPERConfig, ReplayFullError, SumTree, ess


def _filled(cfg: FreshPERConfig, base, stored, capacity=None, seed=0) -> FreshPER:
    """A buffer holding items with the given base priorities and stored steps (in that order)."""
    buf = FreshPER(capacity or len(base), cfg, seed=seed)
    for b, s in zip(base, stored):
        buf.add(np.array([b]), int(s))
    return buf


# ------------------------------------------------------------------ SumTree
def test_sumtree_update_total_leaves():
    t = SumTree(5)
    t.update([0, 2, 4], [1.0, 0.0, 3.0])
    assert t.total() == 4.0
    np.testing.assert_array_equal(t.leaves(), [1.0, 0.0, 0.0, 0.0, 3.0])
    t.update(np.array([1, 4]), np.array([2.5, 0.5]))
    assert t.total() == pytest.approx(4.0)
    np.testing.assert_array_equal(t.leaves([1, 4]), [2.5, 0.5])
    with pytest.raises(IndexError):
        t.update([5], [1.0])
    with pytest.raises(ValueError):
        t.update([0], [-1.0])


def test_sumtree_set_all_matches_incremental_updates():
    rng = np.random.default_rng(1)
    vals = rng.random(37)
    a, b = SumTree(37), SumTree(37)
    a.set_all(vals)
    b.update(np.arange(37), vals)
    np.testing.assert_allclose(a.tree, b.tree, rtol=1e-12)
    assert a.total() == pytest.approx(vals.sum(), rel=1e-12)


def test_sumtree_single_leaf():
    t = SumTree(1)
    t.update([0], [2.0])
    assert t.total() == 2.0
    np.testing.assert_array_equal(t.stratified_sample(4, np.random.default_rng(0)), [0, 0, 0, 0])


def test_stratified_frequencies_match_probabilities():
    """200k stratified draws: per-leaf counts pass a chi-square test against P(i) = leaf/total."""
    rng = np.random.default_rng(123)
    vals = rng.random(50) ** 2 + 0.01
    t = SumTree(50)
    t.set_all(vals)
    p = vals / vals.sum()
    counts = np.zeros(50)
    for _ in range(200):
        counts += np.bincount(t.stratified_sample(1000, rng), minlength=50)
    expected = 200_000 * p
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # Stratification only lowers the variance below multinomial; 49 dof, chi2 99.9% quantile ~ 85.4.
    assert chi2 < 85.4, chi2
    np.testing.assert_allclose(counts / 200_000, p, atol=3e-3)


def test_zero_leaves_never_drawn():
    rng = np.random.default_rng(7)
    t = SumTree(100)  # padded to 128 leaves; leaves 100..127 are padding
    vals = np.zeros(100)
    live = np.array([0, 3, 64, 99])
    vals[live] = [1e-12, 5.0, 1e-300, 2.0]  # tiny but positive leaves are fine, zeros are not
    t.set_all(vals)
    drawn = np.concatenate([t.stratified_sample(512, rng) for _ in range(200)])
    assert set(np.unique(drawn)) <= set(live.tolist())
    assert drawn.min() >= 0 and drawn.max() < 100

    buf = FreshPER(1000, FreshPERConfig(), seed=0)  # 997 unused slots must never come out
    buf.add(np.array([1.0, 2.0, 3.0]), step=0)
    ids, _ = buf.sample(4096, step=10)
    assert set(np.unique(ids)) <= {0, 1, 2}


def test_zero_leaves_never_drawn_when_rounding_overshoots():
    """A point past the true mass of a subtree (what float rounding of internal sums can do)
    must not fall into a zero leaf: simulated by inflating the root above its children."""
    t = SumTree(4)
    t.set_all(np.array([1.0, 0.0, 2.0, 0.0]))
    t.tree[1] *= 1.5  # root 4.5 > 3.0 = sum of children
    drawn = t.stratified_sample(1000, np.random.default_rng(0))
    assert set(np.unique(drawn)) <= {0, 2}


def test_stratified_sample_rejects_empty_tree():
    with pytest.raises(ValueError):
        SumTree(4).stratified_sample(2, np.random.default_rng(0))
    with pytest.raises(ValueError):
        FreshPER(4).sample(2, step=0)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"priority": "q_value"}, "q_value"),
        ({"alpha": -0.1}, "alpha"),
        ({"tau": 0.0}, "tau"),
        ({"tau": float("nan")}, "tau"),
        ({"beta0": -1.0}, "beta0"),
        ({"beta1": float("inf")}, "beta1"),
        ({"beta_steps": -5}, "beta_steps"),
        ({"eps": 0.0}, "eps"),
        ({"refresh_interval": 0}, "refresh_interval"),
        ({"refresh_interval": 1.5}, "refresh_interval"),
    ],
)
def test_bad_config_raises(kwargs, word):
    with pytest.raises(ValueError, match=word):
        FreshPERConfig(**kwargs)


def test_config_defaults_and_signals():
    c = FreshPERConfig()
    assert (c.alpha, c.tau, c.beta0, c.beta1, c.eps, c.refresh_interval, c.priority) == (
        0.6, 500.0, 0.4, 1.0, 1e-6, 1, "td")
    for sig in ("td", "reward", "advantage"):
        assert FreshPERConfig(priority=sig).priority == sig
    assert math.isinf(FreshPERConfig(tau=float("inf")).tau)
    with pytest.raises(ValueError, match="on_full"):
        FreshPER(4, on_full="drop")


# ------------------------------------------------------------------ limits
def test_inv1_tau_inf_is_standard_per_exactly():
    rng = np.random.default_rng(0)
    base = rng.random(64) * 3
    stored = rng.integers(0, 5000, 64)
    cfg = FreshPERConfig(tau=float("inf"), alpha=0.6)
    buf = _filled(cfg, base, stored)
    buf.refresh(10_000)
    expected = (base + cfg.eps) ** cfg.alpha
    np.testing.assert_array_equal(buf.tree.leaves(np.arange(64)), expected)
    np.testing.assert_allclose(buf.probabilities(), expected / expected.sum(), rtol=1e-12)
    # sampling at any later step changes nothing: no decay at tau = inf
    buf.sample(8, step=50_000)
    np.testing.assert_array_equal(buf.tree.leaves(np.arange(64)), expected)


@pytest.mark.parametrize("tau, alpha", [(500.0, 0.6), (50.0, 1.0), (7.0, 0.3)])
def test_inv1_equal_base_probability_closed_form(tau, alpha):
    ages = np.array([0, 1, 10, 37, 100, 250, 500, 1000])
    step = 2000
    buf = _filled(FreshPERConfig(tau=tau, alpha=alpha), np.full(len(ages), 0.7), step - ages)
    buf.refresh(step)
    P = buf.probabilities()
    closed = np.exp(-alpha * ages / tau)
    np.testing.assert_allclose(P / P[0], closed, rtol=1e-6)
    np.testing.assert_allclose(P, closed / closed.sum(), rtol=1e-6)
    assert P.sum() == pytest.approx(1.0, rel=1e-12)


def test_inv1_general_leaf_formula_and_half_life():
    rng = np.random.default_rng(3)
    base = rng.random(20)
    stored = rng.integers(0, 1000, 20)
    cfg = FreshPERConfig(tau=500.0, alpha=0.6)
    buf = _filled(cfg, base, stored)
    buf.refresh(1500)
    expected = ((base + cfg.eps) * np.exp(-(1500 - stored) / cfg.tau)) ** cfg.alpha
    np.testing.assert_allclose(buf.tree.leaves(np.arange(20)), expected, rtol=1e-9)
    # sampling-probability half-life tau ln2 / alpha = 577.6 steps at the paper defaults
    h = cfg.tau * math.log(2) / cfg.alpha
    assert h == pytest.approx(577.6, abs=0.05)
    assert math.exp(-cfg.alpha * h / cfg.tau) == pytest.approx(0.5, rel=1e-12)


# ------------------------------------------------------------------ fresh samples
def test_inv2_new_items_have_decay_one_and_positive_priority():
    cfg = FreshPERConfig(tau=100.0, alpha=0.6)
    buf = FreshPER(16, cfg)
    buf.add(np.array([1.0, 2.0]), step=0)
    ids = buf.add(np.array([0.0, 3.0, -4.0]), step=900)  # base 0 -> eps; sign dropped
    np.testing.assert_array_equal(ids, [2, 3, 4])
    np.testing.assert_array_equal(buf.base_priority(ids), [cfg.eps, 3.0 + cfg.eps, 4.0 + cfg.eps])
    leaves_at_add = buf.tree.leaves(ids)
    np.testing.assert_allclose(leaves_at_add, (np.array([0.0, 3.0, 4.0]) + cfg.eps) ** cfg.alpha, rtol=1e-12)
    buf.refresh(900)  # the refresh at the add step reproduces them bit for bit: decay factor 1
    np.testing.assert_array_equal(buf.tree.leaves(ids), leaves_at_add)
    assert leaves_at_add[0] == pytest.approx(cfg.eps ** cfg.alpha, rel=1e-12)
    # every stored priority stays > 0, however old (tau small, age huge)
    buf.refresh(10**7)
    assert np.all(buf.tree.leaves(np.arange(len(buf))) > 0)
    assert np.all(buf.probabilities() >= 0) and buf.tree.total() > 0
    _, w = buf.sample(64, step=10**7)
    assert np.all(np.isfinite(w)) and np.all(w > 0)


# ------------------------------------------------------------------ IS weights
def test_inv3_weights_in_unit_interval_max_one():
    rng = np.random.default_rng(5)
    buf = _filled(FreshPERConfig(tau=200.0), rng.random(300) * 5, rng.integers(0, 1000, 300))
    for step in (1000, 5000, 20000):
        ids, w = buf.sample(64, step=step)
        assert w.dtype == np.float32 and w.shape == (64,) and ids.shape == (64,)
        assert np.all(w > 0) and np.all(w <= 1.0)
        assert w.max() == 1.0
        # closed form: w_i ∝ (N P_i)^(-beta)
        beta = buf.beta(step)
        raw = (len(buf) * buf.probabilities(ids)) ** (-beta)
        np.testing.assert_allclose(w, raw / raw.max(), rtol=1e-5)
    # reference-code normalisation: divide by the largest weight any item could get
    ids, wb = buf.sample(64, step=20000, normalize="buffer")
    assert np.all(wb > 0) and np.all(wb <= 1.0 + 1e-6)


def test_inv3_beta_zero_gives_ones():
    rng = np.random.default_rng(6)
    buf = _filled(FreshPERConfig(beta0=0.0, beta1=0.0), rng.random(100), rng.integers(0, 100, 100))
    _, w = buf.sample(32, step=200)
    np.testing.assert_array_equal(w, np.ones(32, dtype=np.float32))


def test_beta_annealing_schedule():
    buf = FreshPER(4, FreshPERConfig(beta0=0.4, beta1=1.0, beta_steps=1000))
    assert buf.beta(0) == pytest.approx(0.4)
    assert buf.beta(500) == pytest.approx(0.7)
    assert buf.beta(1000) == pytest.approx(1.0)
    assert buf.beta(10**6) == pytest.approx(1.0)
    assert FreshPER(4, FreshPERConfig(beta_steps=0)).beta(0) == 1.0


def test_ess():
    assert ess(np.ones(10)) == pytest.approx(10.0)
    assert ess(np.array([1.0, 0.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert ess(np.array([1.0, 0.5])) == pytest.approx(2.25 / 1.25)
    assert FreshPER.ess(np.ones(3)) == pytest.approx(3.0)


# ------------------------------------------------------------------ tree consistency
def test_inv4_root_equals_leaf_sum_and_refresh_is_deterministic():
    rng = np.random.default_rng(8)
    buf = _filled(FreshPERConfig(tau=50.0), rng.random(1000) * 10, np.sort(rng.integers(0, 3000, 1000)),
                  capacity=1500)
    buf.update_priorities(rng.integers(0, 1000, 200), rng.random(200), step=3000)
    buf.refresh(3100)
    leaves = buf.tree.leaves()
    assert buf.tree.total() == pytest.approx(leaves.sum(), rel=1e-9)
    assert np.all(leaves[1000:] == 0)  # unused slots
    tree1 = buf.tree.tree.copy()
    buf.refresh(3100)
    np.testing.assert_array_equal(buf.tree.tree, tree1)
    # every internal node is the sum of its children after a refresh
    t, p = buf.tree.tree, buf.tree._p
    np.testing.assert_allclose(t[1:p], t[2 : 2 * p : 2] + t[3 : 2 * p : 2], rtol=1e-12)


def test_refresh_interval_controls_auto_refresh():
    cfg = FreshPERConfig(tau=10.0, refresh_interval=5)
    buf = _filled(cfg, [1.0, 1.0], [0, 0])
    buf.sample(2, step=10)  # first sample always refreshes
    leaf10 = buf.tree.leaves([0]).copy()
    buf.sample(2, step=14)  # 4 < 5 steps later: no refresh
    np.testing.assert_array_equal(buf.tree.leaves([0]), leaf10)
    buf.sample(2, step=15)
    np.testing.assert_allclose(buf.tree.leaves([0]), ((1 + cfg.eps) * math.exp(-1.5)) ** cfg.alpha, rtol=1e-12)


# ------------------------------------------------------------------ age source
def test_inv5_age_from_stored_step_not_update_or_sample_step():
    cfg = FreshPERConfig(tau=100.0, alpha=0.6)
    buf = _filled(cfg, [1.0, 1.0, 1.0], [0, 0, 400])
    buf.sample(4, step=400)  # sampling does not reset the age either
    buf.update_priorities([0], [2.0], step=400)  # updated at 400, stored at 0
    assert buf.stored_at([0, 1, 2]).tolist() == [0, 0, 400]
    want0 = ((2.0 + cfg.eps) * math.exp(-400 / cfg.tau)) ** cfg.alpha
    assert buf.tree.leaves([0])[0] == pytest.approx(want0, rel=1e-12)
    buf.refresh(500)
    leaves = buf.tree.leaves([0, 1, 2])
    np.testing.assert_allclose(
        leaves,
        [((2.0 + cfg.eps) * math.exp(-5.0)) ** 0.6, ((1.0 + cfg.eps) * math.exp(-5.0)) ** 0.6,
         ((1.0 + cfg.eps) * math.exp(-1.0)) ** 0.6],
        rtol=1e-12,
    )
    # step=None: the latest step seen (500) is used for the decay, age still from stored step 0
    buf.update_priorities([1], [3.0])
    assert buf.tree.leaves([1])[0] == pytest.approx(((3.0 + cfg.eps) * math.exp(-5.0)) ** 0.6, rel=1e-12)
    assert buf.mean_age([0, 2], step=500) == pytest.approx(300.0)


# ------------------------------------------------------------------ capacity
def test_full_buffer_error_mode():
    buf = FreshPER(3, FreshPERConfig(), on_full="error")
    buf.add(np.ones(2), 0)
    with pytest.raises(ReplayFullError, match="capacity 3"):
        buf.add(np.ones(2), 1)
    assert len(buf) == 2
    with pytest.raises(ReplayFullError):
        FreshPER(3).add(np.ones(4), 0)


def test_full_buffer_evicts_highest_score_and_reuses_ids():
    cfg = FreshPERConfig(tau=100.0)
    buf = FreshPER(4, cfg)
    buf.add(np.array([5.0, 0.1, 1.0]), 0)  # ids 0, 1, 2
    buf.add(np.array([0.1]), 150)  # id 3: low priority but younger
    # scores at step 200, (age/tau) / (base exp(-age/tau) + eps):
    #   id0 2/(5e^-2) = 2.96, id1 2/(0.1e^-2) = 147.8, id2 2/(1e^-2) = 14.8, id3 0.5/(0.1e^-0.5) = 8.2
    ids = buf.add(np.array([9.0]), 200)
    assert ids.tolist() == [1]  # old AND low priority leaves first; its id is reused
    assert buf.stored_at([1])[0] == 200 and buf.base_priority([1])[0] == pytest.approx(9.0 + cfg.eps)
    ids = buf.add(np.array([1.0, 1.0]), 200)  # new id1 has age 0 -> score 0, kept
    assert sorted(ids.tolist()) == [2, 3]
    assert len(buf) == 4
    buf.refresh(200)
    assert buf.tree.total() == pytest.approx(buf.tree.leaves().sum(), rel=1e-9)


def test_tau_inf_eviction_is_fifo():
    buf = FreshPER(3, FreshPERConfig(tau=float("inf")))
    buf.add(np.array([1.0]), 5)
    buf.add(np.array([0.1]), 6)
    buf.add(np.array([9.0]), 7)
    assert buf.add(np.array([1.0]), 8).tolist() == [0]
    assert buf.add(np.array([1.0]), 9).tolist() == [1]
