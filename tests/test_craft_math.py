"""Invariants of CRAFT's math, the candidate-scoring policy and the method object."""

import json
import math
import os

import numpy as np
import pytest
import torch

from robo_post.algos.craft import (Craft, CraftBatchError, CraftConfig, CraftConfigError, EMATeacher, WindowValue,
                                   bc_pretrain, categorical_kl, dual_clip_surrogate, event_mask, event_returns,
                                   batch_scaled_advantages, evpo_advantages, explained_variance, grounded_advantage,
                                   group_advantages, guard_targets, veto_targets,
                                   policy_losses, residual, residual_for_batch, scale_advantages)
from robo_post.learner.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from robo_post.models.candidate_policy import (CandidateConfigError, CandidatePolicy, CandidatePolicyConfig,
                                               CandidatePolicyRunner)
from robo_post.models.features import state_features

VOCAB = [[0, 1, 1], [1, 1, 1], [2, 1, 1], [3, 1, 1], [4, 4]]
K = len(VOCAB)


def small_policy(seed=0, dim=4):
    torch.manual_seed(seed)
    return CandidatePolicy(CandidatePolicyConfig(state_features(dim), K, VOCAB, embed_dim=16, hidden_dim=32))


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --- 1. group advantages ------------------------------------------------------------------
def test_group_advantages_sum_zero_unit_std_and_affine_invariant():
    scores = torch.randn(32, 8, generator=gen(0), dtype=torch.float64) * 3 + 1
    adv = group_advantages(scores)
    assert torch.allclose(adv.sum(-1), torch.zeros(32, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(adv.std(-1, unbiased=False), torch.ones(32, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(group_advantages(2.5 * scores - 7.0), adv, atol=1e-5)
    assert not torch.allclose(group_advantages(-scores), adv, atol=1e-3)  # a < 0 flips the ranking


def test_group_advantages_constant_group_is_zero_and_masked_entries_are_left_out():
    scores = torch.tensor([[0.3] * 6, [1.0, 2.0, 3.0, 100.0, -50.0, 4.0]])
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    adv = group_advantages(scores, mask=mask)
    assert not torch.isnan(adv).any()
    assert torch.equal(adv[0], torch.zeros(6))
    expected = torch.tensor([-1.0, 0.0, 1.0]) * math.sqrt(1.5)  # population std of (1, 2, 3) is sqrt(2/3)
    assert torch.allclose(adv[1, :3], expected, atol=1e-4)
    assert torch.equal(adv[1, 3:], torch.zeros(3))
    with pytest.raises(CraftBatchError, match="no valid candidate"):
        group_advantages(scores, mask=torch.zeros_like(mask))


def test_batch_scaled_advantages_centre_each_state_on_one_batch_scale():
    # state 0: a crash among near-equal candidates; state 1: candidates a little speed apart
    scores = torch.tensor([[0.40, 0.41, -1.0, 0.39], [0.30, 0.31, 0.32, 0.33], [0.2, 0.2, 0.2, 0.2]],
                          dtype=torch.float64)
    adv = batch_scaled_advantages(scores, eps=0.0)
    centred = scores - scores.mean(-1, keepdim=True)
    assert torch.allclose(adv, centred / centred.pow(2).mean().sqrt(), atol=1e-12)
    assert torch.allclose(adv.sum(-1), torch.zeros(3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(adv.pow(2).mean(), torch.tensor(1.0, dtype=torch.float64))  # unit std over the batch
    assert torch.equal(adv[2], torch.zeros(4, dtype=torch.float64))  # a constant group stays exactly 0
    assert adv[0].abs().max() > 10 * adv[1].abs().max()  # the crash state keeps its larger spread
    assert group_advantages(scores)[1].abs().max() > group_advantages(scores)[0, :2].abs().max()  # z-scores do not
    assert torch.allclose(batch_scaled_advantages(2.5 * scores - 7.0), batch_scaled_advantages(scores), atol=1e-4)
    mask = torch.tensor([[True, True, False, True]] * 3)
    masked = batch_scaled_advantages(scores, eps=0.0, mask=mask)
    assert torch.equal(masked[:, 2], torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(masked[mask].pow(2).mean(), torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(CraftBatchError, match="no valid candidate"):
        batch_scaled_advantages(scores, mask=torch.zeros_like(mask))
    with pytest.raises(CraftConfigError, match="proxy_norm"):
        CraftConfig(proxy_norm="state")


# --- 3. dense proxy gradient --------------------------------------------------------------
def test_dense_proxy_gradient_matches_the_hand_formula():
    logits = torch.randn(6, K, generator=gen(1), dtype=torch.float64, requires_grad=True)
    adv = group_advantages(torch.randn(6, K, generator=gen(2), dtype=torch.float64))
    pi = logits.softmax(-1)
    (pi * adv.detach()).sum().backward()
    # d log pi_k / d logits = e_k - pi, so sum_k pi_k A_k (e_k - pi) = pi * A - pi (pi . A)
    hand = pi * adv - pi * (pi * adv).sum(-1, keepdim=True)
    assert torch.allclose(logits.grad, hand.detach(), atol=1e-12)


# --- 4. decomposition ---------------------------------------------------------------------
K_BANDIT = 4


def bandit():
    """One state, K=4 candidates with pi = (1/8, 1/8, 1/4, 1/2): a batch of 8 rows holding each k*
    in proportion to pi makes a batch mean an exact expectation over k* ~ pi."""
    pi = torch.tensor([1 / 8, 1 / 8, 1 / 4, 1 / 2], dtype=torch.float64)
    q = torch.tensor([1.0, -2.0, 0.5, 0.25], dtype=torch.float64)  # true candidate values
    a_true = q - (pi * q).sum()  # A^pi(s, k): zero mean under pi
    chosen = torch.tensor([0, 1, 2, 2, 3, 3, 3, 3])
    a_true = a_true / a_true[chosen].std(unbiased=False)  # unit std over the batch (a rescaled reward)
    return pi, a_true, chosen


def grad_of(loss_fn, theta_init):
    theta = theta_init.clone().requires_grad_(True)
    loss_fn(theta).backward()
    return theta.grad


def test_proxy_plus_residual_equals_the_full_advantage_gradient():
    pi, a_true, chosen = bandit()
    theta0 = pi.log()
    proxy_adv = group_advantages(torch.tensor([[0.9, -1.0, 1.2, 0.1]], dtype=torch.float64)).expand(8, -1)
    G = 2.0 * a_true[chosen] + 3.0  # an event return whose batch z-score is the true advantage
    delta = residual_for_batch(grounded_advantage(G)[0], proxy_adv, chosen, "cv").double()

    def craft_objective(theta):
        logits = theta.expand(8, -1)
        proxy, res, _ = policy_losses(logits, theta.detach().expand(8, -1), proxy_adv, chosen, delta,
                                      proxy_weight="policy")
        return -(proxy + res)

    full = grad_of(lambda theta: (theta.softmax(-1) * a_true).sum(), theta0)  # sum_k grad pi_k A_k
    assert torch.allclose(grad_of(craft_objective, theta0), full, atol=1e-4)
    assert full.abs().max() > 0.05
    # the proxy alone is biased: it differs from the full gradient
    proxy_only = grad_of(lambda th: -policy_losses(th.expand(8, -1), th.detach().expand(8, -1), proxy_adv, chosen,
                                                   delta, proxy_weight="policy")[0], theta0)
    assert not torch.allclose(proxy_only, full, atol=1e-2)


@pytest.mark.parametrize("proxy_weight,lambda_res", [("uniform", 4.0), ("uniform", 1.0), ("policy", 1.0),
                                                       ("policy", 4.0), ("floor", 1.0)])
def test_expected_update_weighs_each_proxy_advantage_by_w_minus_lambda_pi(proxy_weight, lambda_res):
    # k* ~ pi and z(G) = 0 everywhere: the proxy and the cv residual's -A~[k*] are all that is left
    pi, _, chosen = bandit()
    theta0 = pi.log()
    proxy_adv = group_advantages(torch.tensor([[0.9, -1.0, 1.2, 0.1]], dtype=torch.float64)).expand(8, -1)
    delta = residual_for_batch(torch.zeros(8, dtype=torch.float64), proxy_adv, chosen, "cv")

    def objective(theta):
        logits = theta.expand(8, -1)
        proxy, res, _ = policy_losses(logits, theta.detach().expand(8, -1), proxy_adv, chosen, delta,
                                      proxy_weight=proxy_weight)
        return -(proxy + lambda_res * res)

    uniform = torch.full_like(pi, 1 / K_BANDIT)
    w = {"uniform": uniform, "policy": pi, "floor": torch.maximum(pi, uniform)}[proxy_weight]
    c = w - lambda_res * pi
    # d log pi_k / d theta_j = 1[j = k] - pi_j
    by_hand = sum(c[k] * proxy_adv[0, k] * (torch.eye(K_BANDIT, dtype=torch.float64)[k] - pi)
                  for k in range(K_BANDIT))
    g = grad_of(objective, theta0)
    assert torch.allclose(g, by_hand, atol=1e-10)
    if proxy_weight == "policy" and lambda_res == 1.0:
        assert torch.allclose(g, torch.zeros_like(g), atol=1e-10)  # the proxy cancels: a control variate
    if (proxy_weight, lambda_res) == ("uniform", 4.0):
        # candidate 2 (pi 1/4) has the best proxy advantage, yet its logit is pushed down
        assert proxy_adv[0].argmax() == 2 and g[2] < 0
    if proxy_weight == "floor":
        # only the candidates picked less than 1/K of the time get the proxy's push
        assert torch.equal(c > 1e-12, pi < 1 / K_BANDIT) and (c >= 0).all()


def test_residual_is_zero_when_the_proxy_is_the_true_advantage():
    pi, a_true, chosen = bandit()
    G = 0.5 * a_true[chosen] - 1.0
    delta = residual_for_batch(grounded_advantage(G)[0], a_true.expand(8, -1), chosen, "cv")
    assert torch.allclose(delta, torch.zeros(8, dtype=delta.dtype), atol=1e-4)


def test_uniform_proxy_weight_pushes_each_logit_by_its_advantage():
    # RIFT's mean over candidates: at rho = 1 the logit gradient is A~ / K, not the policy gradient
    theta0 = torch.randn(1, K, generator=gen(3), dtype=torch.float64)
    adv = group_advantages(torch.randn(1, K, generator=gen(4), dtype=torch.float64))
    g = grad_of(lambda th: -policy_losses(th, th.detach(), adv, torch.tensor([0]), torch.zeros(1))[0], theta0)
    assert torch.allclose(g, adv / K, atol=1e-10)


def test_a_floor_kept_to_some_states_weighs_the_others_by_the_policy():
    logits = torch.randn(4, K, generator=gen(7), dtype=torch.float64, requires_grad=True)
    adv = group_advantages(torch.randn(4, K, generator=gen(8), dtype=torch.float64))
    floored = torch.tensor([True, False, True, False])
    proxy, _, _ = policy_losses(logits, logits.detach(), adv, torch.zeros(4, dtype=torch.long), torch.zeros(4),
                                proxy_weight="floor", floored=floored)
    pi = logits.detach().softmax(-1)
    w = torch.where(floored[:, None], torch.maximum(pi, torch.tensor(1 / K, dtype=pi.dtype)), pi)
    assert torch.allclose(proxy.detach(), -(w * adv).sum(-1).mean(), atol=1e-12)
    everywhere, _, _ = policy_losses(logits, logits.detach(), adv, torch.zeros(4, dtype=torch.long), torch.zeros(4),
                                     proxy_weight="floor")
    assert not torch.allclose(proxy, everywhere)


def test_floor_proxy_weight_counts_each_state_valid_candidates_and_survives_an_empty_row():
    logits = torch.randn(3, 4, generator=gen(5), dtype=torch.float64, requires_grad=True)
    valid = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.randn(3, 4, generator=gen(6), dtype=torch.float64) * valid
    proxy, _, _ = policy_losses(logits, logits.detach(), adv, torch.tensor([0, 0, 1]), torch.zeros(3),
                                valid=valid, proxy_weight="floor")
    proxy.backward()
    assert torch.isfinite(logits.grad).all() and torch.equal(logits.grad[1], torch.zeros(4, dtype=torch.float64))
    # at rho = 1 the loss is -mean_s sum_k max(pi_k, 1/K_s) A~_k, with K_s the state's valid candidates
    pi = (logits.detach().masked_fill(~valid, float("-inf"))).softmax(-1).nan_to_num(0.0)
    k_s = valid.sum(-1, keepdim=True).clamp(min=1)
    expected = -(valid * torch.maximum(pi, 1.0 / k_s) * adv).sum(-1).mean()
    assert torch.allclose(proxy.detach(), expected, atol=1e-12)


# --- residual and events -----------------------------------------------------------------
def test_event_returns_are_windowed_and_truncated_at_the_episode_end():
    events = torch.tensor([0.0, 0.0, -0.3, 0.0, -1.0])
    G = event_returns(events, gamma=0.5, window=3)
    assert torch.allclose(G, torch.tensor([-0.075, -0.15, -0.3 - 0.25, -0.5, -1.0]))
    assert torch.equal(event_mask(events, 2), torch.tensor([False, True, True, True, True]))
    assert torch.equal(event_mask(torch.tensor([-1.0, 0.0, 0.0, 0.0]), 2), torch.tensor([True, False, False, False]))
    with pytest.raises(CraftConfigError, match="window"):
        event_returns(events, 0.9, 0)


def test_residual_modes():
    G = torch.tensor([0.0, -1.0, 0.0, -0.3])
    z = (G - G.mean()) / (G.std(unbiased=False) + 1e-5)
    adv, ev, use_critic = grounded_advantage(G)  # no critic: the batch z-score
    assert torch.allclose(adv, z, atol=1e-6) and math.isnan(ev) and use_critic is False
    a = torch.tensor([0.5, -0.2, 0.1, 0.0])
    mask = torch.tensor([False, True, False, True])
    assert torch.equal(residual(adv, a, "cv"), adv - a)
    assert torch.equal(residual(adv, a, "event", mask), torch.where(mask, adv, torch.zeros(4)))
    assert torch.equal(residual(grounded_advantage(torch.zeros(4))[0], a, "event", mask), torch.zeros(4))  # no event
    constant = grounded_advantage(torch.full((6,), -0.3))[0]
    assert torch.equal(residual(constant, torch.zeros(6), "cv"), torch.zeros(6))  # a constant batch
    with pytest.raises(CraftConfigError, match="event_mask"):
        residual(adv, a, "event")
    with pytest.raises(CraftConfigError, match="residual_mode"):
        residual(adv, a, "bogus")


def old_zscore(G, eps=1e-5):
    """The residual's grounded advantage before the baseline option, written out."""
    shifted = G - G.reshape(-1)[0]
    centred = shifted - shifted.mean()
    return centred / (centred.pow(2).mean().sqrt() + eps)


def test_batch_baseline_residuals_are_bit_identical_to_the_value_free_z_score():
    g = gen(20)
    G = torch.randn(97, generator=g) * 0.4 - 0.2
    proxy_adv = group_advantages(torch.randn(97, K, generator=g))
    chosen = torch.randint(0, K, (97,), generator=g)
    executed = proxy_adv.gather(-1, chosen[:, None])[:, 0]
    mask = torch.rand(97, generator=g) > 0.5
    adv = grounded_advantage(G)[0]
    assert torch.equal(residual_for_batch(adv, proxy_adv, chosen, "cv"), old_zscore(G) - executed)
    assert torch.equal(residual_for_batch(adv, proxy_adv, chosen, "event", mask), mask.float() * old_zscore(G))
    # evpo's batch-mean branch (a critic that loses the gate) is the same z-score, bit for bit
    loser = grounded_advantage(G, -G)
    assert torch.equal(loser[0], old_zscore(G)) and loser[2] is False and loser[1] < 0


# --- EVPO ----------------------------------------------------------------------------------
def test_explained_variance_gate_picks_the_lower_variance_baseline():
    # G = V* + eps, V = V* + eta with random noise scales: EV > 0 exactly when Var(G - V) < Var(G - mean G)
    g = torch.Generator().manual_seed(21)
    mismatches, critic_wins = 0, 0
    for _ in range(1000):
        sigma_s, sigma_eta, sigma_eps = (10 ** (torch.rand(3, generator=g, dtype=torch.float64) * 3 - 1.5)).tolist()
        v_star = sigma_s * torch.randn(32, generator=g, dtype=torch.float64)
        G = v_star + sigma_eps * torch.randn(32, generator=g, dtype=torch.float64)
        V = v_star + sigma_eta * torch.randn(32, generator=g, dtype=torch.float64)
        ev = explained_variance(G, V)
        critic_lower = bool((G - V).var(unbiased=False) < (G - G.mean()).var(unbiased=False))
        _, _, use_critic = evpo_advantages(G, V)
        mismatches += ((ev > 0) != critic_lower) + (use_critic != critic_lower)
        critic_wins += critic_lower
        assert ev == pytest.approx(1 - float((G - V).var(unbiased=False) / G.var(unbiased=False)), abs=1e-9)
    assert mismatches == 0
    assert 100 < critic_wins < 900  # both branches were exercised


def test_evpo_edge_cases():
    G = torch.tensor([0.0, -1.0, 0.0, -0.3, -0.3, 0.2])
    adv, ev, use_critic = evpo_advantages(G, G.clone())  # a perfect critic
    assert ev == 1.0 and use_critic is True and torch.equal(adv, torch.zeros(6))
    adv, ev, use_critic = evpo_advantages(G, torch.full((6,), 0.7))  # a constant critic: a tie, the batch mean
    assert ev == 0.0 and use_critic is False
    assert torch.allclose(adv, G - G.mean(), atol=1e-7)
    flat = torch.full((6,), -0.3)  # Var(G) = 0: EV undefined, batch mean, all-zero advantages
    adv, ev, use_critic = evpo_advantages(flat, torch.randn(6, generator=gen(22)))
    assert math.isnan(ev) and use_critic is False and torch.equal(adv, torch.zeros(6))
    scaled, ev, use_critic = grounded_advantage(flat, torch.randn(6, generator=gen(22)))
    delta = residual(scaled, torch.zeros(6), "cv")
    assert torch.equal(scaled, torch.zeros(6)) and torch.isfinite(delta).all() and use_critic is False
    # the threshold: a critic with EV 0.75 passes 0.5 but not 0.8
    V = G + torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]) * 0.5 * G.std(unbiased=False)  # Var(G - V) = Var(G) / 4
    ev = explained_variance(G, V)
    assert ev == pytest.approx(0.75, abs=1e-6)
    assert evpo_advantages(G, V, 0.5)[2] is True and evpo_advantages(G, V, 0.8)[2] is False


def test_evpo_branches_are_the_two_extremes_of_the_gain():
    g = gen(23)
    G = torch.randn(50, generator=g) - 0.5
    V = G + 0.1 * torch.randn(50, generator=g) + 0.3  # a good but biased critic
    adv, ev, use_critic = evpo_advantages(G, V)  # K = 1: the critic baseline
    assert use_critic and ev > 0.5 and torch.equal(adv, G - V)
    adv, ev, use_critic = evpo_advantages(G, V, threshold=2.0)  # forced K = 0: the batch mean
    assert not use_critic and torch.allclose(adv, G - G.mean(), atol=1e-6)
    # the critic branch is scaled to unit std but keeps its mean: the critic's baseline is not replaced
    scaled, _, _ = grounded_advantage(G, V)
    assert torch.allclose(scaled, (G - V) / ((G - V).std(unbiased=False) + 1e-5), atol=1e-6)
    assert scaled.mean() < -1.0 and scaled.std(unbiased=False) == pytest.approx(1.0, abs=1e-3)
    assert torch.equal(scale_advantages(G - V, centred=False), scaled)


def test_critic_reads_the_policy_features_with_its_own_weights_and_the_policy_state_stats():
    policy = small_policy(15)
    policy.set_state_stats(np.arange(4.0), np.full(4, 3.0))
    critic = WindowValue.for_policy(policy)
    assert torch.equal(critic.encoder.state_mean, policy.encoder.state_mean)
    assert torch.equal(critic.encoder.state_std, policy.encoder.state_std)
    assert not torch.equal(critic.encoder.state[0].weight, policy.encoder.state[0].weight)
    assert critic({"state": torch.randn(7, 4, generator=gen(24))}).shape == (7,)


# --- 5. dual clip --------------------------------------------------------------------------
def test_dual_clip_is_ppo_clip_for_nonnegative_advantages_and_floored_for_negative():
    ratio = torch.linspace(0.05, 6.0, 120, dtype=torch.float64)[:, None]
    adv = torch.tensor([0.0, 0.3, 2.0, -0.1, -1.0, -4.0], dtype=torch.float64)[None]
    s = dual_clip_surrogate(ratio, adv, 0.2, 3.0)
    ppo = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    pos = adv[0] >= 0
    assert torch.equal(s[:, pos], ppo[:, pos])
    assert (s[:, ~pos] >= 3.0 * adv[:, ~pos]).all()
    assert (s[:, ~pos] == 3.0 * adv[:, ~pos]).any()  # the floor is reached at large ratios
    assert dual_clip_surrogate(torch.tensor(10.0), torch.tensor(-1.0), 0.2, 3.0).item() == -3.0  # PPO alone: -10


def test_an_extreme_ratio_gives_finite_gradients():
    # a student that moved e^200 away from the acting policy: clipped everywhere, so zero gradient, not NaN
    logits = torch.tensor([[100.0, 0.0, 0.0]], requires_grad=True)
    proxy_loss, residual_loss, _ = policy_losses(logits, torch.tensor([[-100.0, 0.0, 0.0]]),
                                                 torch.tensor([[-1.0, 0.5, 0.5]]), torch.tensor([0]),
                                                 torch.tensor([-1.0]))
    (proxy_loss + residual_loss).backward()
    assert torch.isfinite(logits.grad).all()
    assert residual_loss.item() == pytest.approx(3.0)  # the dual-clip floor c |A|


def test_at_ratio_one_the_losses_are_minus_the_mean_advantages():
    logits = torch.randn(16, K, generator=gen(5))
    adv = torch.randn(16, K, generator=gen(6))
    delta = torch.randn(16, generator=gen(7))
    chosen = torch.randint(0, K, (16,), generator=gen(8))
    proxy, res, ratio = policy_losses(logits, logits.clone(), adv, chosen, delta)
    assert torch.allclose(ratio, torch.ones_like(ratio))
    assert torch.allclose(proxy, -adv.mean(), atol=1e-6) and torch.allclose(res, -delta.mean(), atol=1e-6)
    pi = logits.softmax(-1)
    proxy_pi, _, _ = policy_losses(logits, logits.clone(), adv, chosen, delta, proxy_weight="policy")
    assert torch.allclose(proxy_pi, -(pi * adv).sum(-1).mean(), atol=1e-6)


# --- 6. EMA teacher ------------------------------------------------------------------------
def test_ema_teacher_starts_bitwise_equal_is_frozen_and_follows_the_ema_rule():
    pre = small_policy(1)
    teacher = EMATeacher(pre)
    for (name, t), p in zip(teacher.policy.state_dict().items(), pre.state_dict().values()):
        assert torch.equal(t, p), name
    assert all(not p.requires_grad for p in teacher.parameters())
    student = small_policy(2)  # different weights, same architecture
    before = [p.clone() for p in teacher.parameters()]
    for _ in range(3):
        teacher.update(student, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(teacher.parameters(), before))
    teacher.update(student, 0.9)
    for t, b, s in zip(teacher.parameters(), before, student.parameters()):
        assert torch.allclose(t, 0.9 * b + 0.1 * s, atol=1e-6)
    assert not torch.allclose(teacher.policy.head[-1].weight, before[-2])
    with pytest.raises(CraftConfigError, match="ema_m"):
        teacher.update(student, 1.5)


# --- 7. KL ---------------------------------------------------------------------------------
def test_categorical_kl_nonnegative_zero_on_identical_and_asymmetric():
    p, q = torch.randn(64, K, generator=gen(9)), torch.randn(64, K, generator=gen(10))
    kl = categorical_kl(p, q)
    assert (kl >= -1e-7).all() and kl.max() > 0.01
    assert torch.allclose(categorical_kl(p, p), torch.zeros(64), atol=1e-7)
    skew_p, skew_q = torch.tensor([[4.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0, 0.0]])
    a, b = skew_p.softmax(-1)[0], skew_q.softmax(-1)[0]
    assert torch.allclose(categorical_kl(skew_p, skew_q), (a * (a / b).log()).sum(), atol=1e-6)
    assert torch.allclose(categorical_kl(skew_q, skew_p), (b * (b / a).log()).sum(), atol=1e-6)
    assert abs(categorical_kl(skew_p, skew_q).item() - categorical_kl(skew_q, skew_p).item()) > 0.1


def test_masked_kl_ignores_invalid_candidates_without_nan_gradients():
    p = torch.tensor([[2.0, 0.0, 50.0]], requires_grad=True)
    q = torch.tensor([[0.0, 1.0, -50.0]])
    mask = torch.tensor([[True, True, False]])
    kl = categorical_kl(p, q, mask)
    assert torch.allclose(kl, categorical_kl(p[:, :2], q[:, :2]), atol=1e-6)
    kl.sum().backward()
    assert torch.isfinite(p.grad).all() and p.grad[0, 2] == 0


def perturbed_craft(**config):
    pre = small_policy(3)
    craft = Craft(CraftConfig(**config), pre)
    with torch.no_grad():
        craft.policy.head[-1].bias.add_(torch.tensor([3.0, 0.0, -1.0, 0.0, 0.5]))  # skew the student
    return craft


def random_batch(n=64, seed=11, valid=False):
    g = gen(seed)
    batch = {"obs": {"state": torch.randn(n, 4, generator=g)},
             "proxy_adv": group_advantages(torch.randn(n, K, generator=g)),
             "chosen": torch.randint(0, K, (n,), generator=g),
             "old_logits": torch.randn(n, K, generator=g) * 0.1,
             "delta": torch.randn(n, generator=g)}
    if valid:
        batch["valid"] = torch.rand(n, K, generator=g) > 0.3
        batch["valid"][:, 0] = True
        batch["chosen"] = torch.zeros(n, dtype=torch.long)
        batch["proxy_adv"] = group_advantages(torch.randn(n, K, generator=g), mask=batch["valid"])
    return batch


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_kl_direction_option_switches_the_kl(direction):
    craft = perturbed_craft(kl_direction=direction, lr=0.0)
    batch = random_batch()
    with torch.no_grad():
        s, t = craft.policy.logits(batch["obs"]), craft.teacher.logits(batch["obs"])
    reverse, forward = categorical_kl(s, t).mean(), categorical_kl(t, s).mean()
    assert abs(reverse - forward) > 1e-3
    metrics = craft.update(batch)
    assert torch.allclose(metrics["kl_teacher"], reverse if direction == "reverse" else forward, atol=1e-5)


# --- the method ----------------------------------------------------------------------------
def test_craft_update_moves_the_student_and_the_teacher_follows_by_ema():
    pre = small_policy(4)
    craft = Craft(CraftConfig(lr=1e-2, ema_m=0.99), pre)
    teacher_before = [p.clone() for p in craft.teacher.parameters()]
    student_before = [p.clone() for p in craft.policy.parameters()]
    metrics = craft.update(random_batch(valid=True))
    assert set(metrics) >= {"loss", "proxy_loss", "residual_loss", "sd_loss", "kl_teacher", "kl_old", "clip_fraction"}
    assert all(v.dim() == 0 and torch.isfinite(v) and not v.requires_grad for v in metrics.values())
    moved = max((a - b).abs().max().item() for a, b in zip(craft.policy.parameters(), student_before))
    assert moved > 1e-3
    for t, b, s in zip(craft.teacher.parameters(), teacher_before, craft.policy.parameters()):
        assert torch.allclose(t, 0.99 * b + 0.01 * s, atol=1e-6)
    # the reference policy the method was built from is untouched
    assert all(torch.equal(a, b) for a, b in zip(pre.parameters(), teacher_before))
    weights, config = craft.artifact(version=3)
    assert config["kind"] == "candidate" and config["algorithm"] == "craft" and config["version"] == 3
    fit = craft.fit(random_batch(n=40), gen(0))
    assert torch.isfinite(fit["loss"])


def test_ablation_switches_drop_their_term():
    batch = random_batch()
    batch["delta"] = torch.zeros(64)  # no residual signal: only the proxy (and the KL) can move the student
    for use_proxy, moves in ((False, False), (True, True)):
        craft = Craft(CraftConfig(use_proxy=use_proxy, beta_sd=0.0, lr=1e-2), small_policy(5))
        before = [p.clone() for p in craft.policy.parameters()]
        craft.update(batch)
        changed = any(not torch.equal(a, b) for a, b in zip(craft.policy.parameters(), before))
        assert changed == moves


def test_trainable_head_moves_only_the_scoring_head_and_keeps_the_encoder_bitwise():
    pre = small_policy(6)
    craft = Craft(CraftConfig(trainable="head", lr=1e-2), pre)
    assert not any(p.requires_grad for p in craft.policy.encoder.parameters())
    assert sum(p.numel() for g in craft.optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in craft.policy.head.parameters())
    craft.fit(random_batch(n=40, valid=True), gen(1))
    assert all(torch.equal(a, b) for a, b in zip(craft.policy.encoder.parameters(), pre.encoder.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(craft.teacher.policy.encoder.parameters(), pre.encoder.parameters()))
    assert max((a - b).abs().max().item() for a, b in zip(craft.policy.head.parameters(), pre.head.parameters())) > 1e-3
    full = Craft(CraftConfig(lr=1e-2), pre)
    full.fit(random_batch(n=40, valid=True), gen(1))
    assert not all(torch.equal(a, b) for a, b in zip(full.policy.encoder.parameters(), pre.encoder.parameters()))


def test_nonpositive_adv_gate_applies_the_kl_only_where_the_executed_advantage_is_not_positive():
    craft = perturbed_craft(kl_gate="nonpositive_adv", lr=0.0)
    batch = random_batch()
    with torch.no_grad():
        kl = categorical_kl(craft.policy.logits(batch["obs"]), craft.teacher.logits(batch["obs"]))
    executed = batch["proxy_adv"].gather(-1, batch["chosen"][:, None])[:, 0] + batch["delta"]
    gate = executed <= 0
    assert 0 < gate.sum() < 64
    metrics = craft.update(batch)
    assert torch.allclose(metrics["sd_loss"], (kl * gate).mean(), atol=1e-6)
    assert not torch.allclose(metrics["sd_loss"], kl.mean(), atol=1e-4)


def test_craft_config_names_a_bad_option():
    for bad, name in (({"residual_mode": "x"}, "residual_mode"), ({"kl_direction": "sideways"}, "kl_direction"),
                      ({"kl_gate": "maybe"}, "kl_gate"), ({"proxy_weight": "x"}, "proxy_weight"),
                      ({"dual_c": 0.5}, "dual_c"), ({"ema_m": 1.2}, "ema_m"),
                      ({"use_proxy": False, "use_residual": False}, "use_proxy"),
                      ({"baseline": "foo"}, "baseline"), ({"evpo_threshold": math.nan}, "evpo_threshold"),
                      ({"trainable": "encoder"}, "trainable"), ({"gamma_event": 2.0}, "gamma_event"),
                      ({"gamma_event": -1.0}, "gamma_event"), ({"bc_label_smoothing": 1.5}, "bc_label_smoothing"),
                      ({"bc_updates": -5}, "bc_updates"), ({"explore_margin": -1.0}, "explore_margin"),
                      ({"iterations": -1}, "iterations"), ({"explore_margin": math.inf}, "explore_margin"),
                      ({"proxy_weight": "floor", "floor_margin": -0.5}, "floor_margin"),
                      ({"floor_margin": 1.0}, "floor_margin=1.0 limits proxy_weight=floor")):
        with pytest.raises(CraftConfigError, match=name):
            CraftConfig(**bad)
    with pytest.raises(CraftBatchError, match="delta"):
        Craft(CraftConfig(), small_policy()).update({k: v for k, v in random_batch().items() if k != "delta"})
    with pytest.raises(CraftBatchError, match="event_return"):
        Craft(CraftConfig(baseline="evpo"), small_policy()).update(random_batch())
    with pytest.raises(CraftConfigError, match="no critic"):
        Craft(CraftConfig(), small_policy()).values(random_batch()["obs"])


# --- EVPO's critic in the method ----------------------------------------------------------
def evpo_batch(craft, threshold, seed=16):
    """``random_batch`` with event returns and the residual of the gate forced by ``threshold``."""
    batch = random_batch(seed=seed)
    G = batch["obs"]["state"][:, 0] * 0.5 + 0.1 * torch.randn(64, generator=gen(seed + 1))
    adv, _, use_critic = grounded_advantage(G, craft.values(batch["obs"]), threshold)
    batch["delta"] = residual_for_batch(adv, batch["proxy_adv"], batch["chosen"])
    return batch | {"event_return": G}, use_critic


def test_the_critic_trains_the_same_in_both_branches_of_the_gate():
    crafts = []
    for _ in range(2):
        torch.manual_seed(0)  # the same critic initialisation in both
        crafts.append(Craft(CraftConfig(baseline="evpo", lr=1e-2), small_policy(17)))
    assert set(crafts[0].modules) == {"policy", "teacher", "critic"} and set(crafts[0].optimizers) == {"policy",
                                                                                                         "critic"}
    assert set(Craft(CraftConfig(), small_policy(17)).modules) == {"policy", "teacher"}  # batch: no critic
    critic_batch, use_critic = evpo_batch(crafts[0], -math.inf)
    mean_batch, use_mean = evpo_batch(crafts[1], math.inf)
    assert use_critic and not use_mean and not torch.allclose(critic_batch["delta"], mean_batch["delta"], atol=1e-3)
    before = [p.clone() for p in crafts[0].critic.parameters()]
    metrics = [crafts[0].update(critic_batch), crafts[1].update(mean_batch)]
    assert metrics[0]["value_loss"] > 0 and torch.equal(metrics[0]["value_loss"], metrics[1]["value_loss"])
    for a, b, p0 in zip(crafts[0].critic.parameters(), crafts[1].critic.parameters(), before):
        assert torch.equal(a.grad, b.grad) and torch.equal(a, b)
    assert max((a - p0).abs().max().item() for a, p0 in zip(crafts[0].critic.parameters(), before)) > 1e-3
    # the gate did change the policy's update (so the equality above is not vacuous)
    assert not all(torch.equal(a, b) for a, b in zip(crafts[0].policy.parameters(), crafts[1].policy.parameters()))


def test_the_critic_learns_the_event_return():
    torch.manual_seed(1)
    craft = Craft(CraftConfig(baseline="evpo", lr=3e-3, epochs=30, minibatch=32), small_policy(18))
    batch, _ = evpo_batch(craft, 0.0)
    ev_before = explained_variance(batch["event_return"], craft.values(batch["obs"]))
    craft.fit(batch, gen(2))
    ev_after = explained_variance(batch["event_return"], craft.values(batch["obs"]))
    assert ev_before < 0.5 < ev_after


def test_checkpoint_round_trip_restores_the_critic_and_its_optimiser(tmp_path):
    torch.manual_seed(2)
    craft = Craft(CraftConfig(baseline="evpo", lr=1e-2), small_policy(19))
    first, _ = evpo_batch(craft, 0.0, seed=30)
    craft.update(first)
    save_checkpoint(str(tmp_path / "ckpt"), craft.modules, craft.optimizers, {}, {"iteration": 1})
    second, _ = evpo_batch(craft, 0.0, seed=40)
    uninterrupted = craft.update(second)
    torch.manual_seed(3)  # a different critic initialisation, overwritten by the checkpoint
    resumed = Craft(CraftConfig(baseline="evpo", lr=1e-2), small_policy(19))
    assert not torch.equal(resumed.critic.head[-1].weight, craft.critic.head[-1].weight)
    load_checkpoint(str(tmp_path / "ckpt"), resumed.modules, resumed.optimizers, {})
    assert resumed.critic_optimizer.state_dict()["state"][0]["step"] == 1
    again = resumed.update(second)
    assert all(torch.equal(again[k], uninterrupted[k]) for k in uninterrupted)
    for name, module in craft.modules.items():
        for (key, a), b in zip(module.state_dict().items(), resumed.modules[name].state_dict().values()):
            assert torch.equal(a, b), (name, key)


def test_a_damaged_or_foreign_checkpoint_is_a_typed_error(tmp_path):
    craft = Craft(CraftConfig(), small_policy(19))
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, craft.modules, craft.optimizers, {}, {"iteration": 1})
    wider = Craft(CraftConfig(), small_policy(19, dim=6))  # other model settings than the checkpoint's
    with pytest.raises(CheckpointError, match="does not fit this run's 'policy'"):
        load_checkpoint(ckpt, wider.modules, wider.optimizers, {})
    with open(os.path.join(ckpt, "tensors.safetensors"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"ckpt is unreadable \(SafetensorError"):
        load_checkpoint(ckpt, craft.modules, craft.optimizers, {})


def test_a_flipped_byte_inside_the_tensors_is_found_before_resuming(tmp_path):
    """A well-formed tensor file with changed values (a flipped bit, NaN written over a weight)
    parses; only the checksum recorded at saving tells it from the one saved."""
    net = torch.nn.Linear(2, 2)
    modules, optimizers = {"net": net}, {"net": torch.optim.Adam(net.parameters())}
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, modules, optimizers, {}, {"update": 3})
    tensors = os.path.join(ckpt, "tensors.safetensors")
    blob = bytearray(open(tensors, "rb").read())
    blob[-1] ^= 0x40  # the last byte of the last tensor's data
    open(tensors, "wb").write(bytes(blob))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"ckpt is damaged: tensors.safetensors does not match the checksum its "
                                              r"state.json recorded"):
        load_checkpoint(ckpt, modules, optimizers, {})
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    state_file = os.path.join(ckpt, "state.json")
    payload = json.load(open(state_file))
    del payload["tensors_sha256"]  # a checkpoint saved before checksums were recorded loads as it is
    json.dump(payload, open(state_file, "w"))
    assert load_checkpoint(ckpt, modules, optimizers, {}) == {"update": 3}


@pytest.mark.parametrize("damage", ["[]", '{"state": {"update": 3}}', '{"state": {"update": 3}, "optimizers": {}, '
                                    '"numpy_rngs": {}}', None])
def test_a_checkpoint_with_a_damaged_or_missing_state_file_is_a_typed_error(tmp_path, damage):
    from robo_post.learner.checkpoint import checkpoint_state, has_checkpoint

    net = torch.nn.Linear(2, 2)
    modules, optimizers = {"net": net}, {"net": torch.optim.Adam(net.parameters())}
    net(torch.ones(1, 2)).sum().backward()
    optimizers["net"].step()
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, modules, optimizers, {}, {"update": 3})
    state_file = os.path.join(ckpt, "state.json")
    if damage is None:
        os.remove(state_file)  # the tensors alone: no fresh start that would overwrite the run
    else:
        with open(state_file, "w") as f:
            f.write(damage)
    assert has_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"ckpt (is unreadable|does not fit this run's optimizers or is damaged)"):
        load_checkpoint(ckpt, modules, optimizers, {})
    if damage != '{"state": {"update": 3}, "optimizers": {}, "numpy_rngs": {}}':  # its counters still read
        with pytest.raises(CheckpointError, match=r"ckpt is unreadable \((ValueError|FileNotFoundError)"):
            checkpoint_state(ckpt)


@pytest.mark.parametrize("counter", [None, "3", -1, True])
def test_a_checkpoint_whose_step_counter_was_edited_is_a_typed_error(tmp_path, counter):
    net = torch.nn.Linear(2, 2)
    modules, optimizers = {"net": net}, {"net": torch.optim.Adam(net.parameters())}
    ckpt = str(tmp_path / "ckpt")
    save_checkpoint(ckpt, modules, optimizers, {}, {"update": 3})
    state_file = os.path.join(ckpt, "state.json")
    with open(state_file) as f:
        payload = json.load(f)
    payload["state"] = {} if counter is None else {"update": counter}
    with open(state_file, "w") as f:
        json.dump(payload, f)
    assert load_checkpoint(ckpt, modules, optimizers, {}) == payload["state"]  # no counter asked for
    with pytest.raises(CheckpointError, match=rf"ckpt is damaged: its state.json holds update={counter!r}, not the step"):
        load_checkpoint(ckpt, modules, optimizers, {}, ("update",))

@pytest.mark.slow
def test_bc_pretraining_fits_a_separable_candidate_set():
    g = gen(12)
    x = torch.randn(512, 4, generator=g)
    target = x[:, :2].sum(-1).gt(0).long() * 3 + x[:, 2].gt(0).long()  # candidates 0, 1, 3, 4 by sign pattern
    policy = small_policy(6)
    result = bc_pretrain(policy, {"state": x}, target, updates=300, lr=3e-3, minibatch=128, generator=gen(0))
    assert result["accuracy"] > 0.95
    with torch.no_grad():
        assert (policy.logits({"state": x}).argmax(-1) == target).float().mean() > 0.95
    smoothed = small_policy(6)
    result = bc_pretrain(smoothed, {"state": x}, target, updates=300, lr=3e-3, minibatch=128, generator=gen(0),
                         label_smoothing=0.2)
    with torch.no_grad():
        peak = smoothed.logits({"state": x}).softmax(-1).max(-1).values
        sharp = policy.logits({"state": x}).softmax(-1).max(-1).values
    assert result["accuracy"] > 0.95 and peak.mean() < 0.9 < sharp.mean()  # same choices, mass left elsewhere


# --- the candidate policy ------------------------------------------------------------------
def test_candidate_policy_artifact_round_trips_with_its_vocabulary():
    policy = small_policy(7)
    policy.set_state_stats(np.arange(4.0), np.full(4, 2.0))
    weights, config = policy.artifact(algorithm="bc")
    assert config["kind"] == "candidate" and json.loads(json.dumps(config)) == config
    again = CandidatePolicy.from_artifact(weights, config)
    obs = {"state": torch.randn(3, 4, generator=gen(13))}
    assert torch.equal(again.logits(obs), policy.logits(obs))
    assert again.config.candidates == VOCAB
    with pytest.raises(CandidateConfigError, match="n_candidates"):
        CandidatePolicyConfig(state_features(4), 3, VOCAB)
    with pytest.raises(CandidateConfigError, match="empty"):
        CandidatePolicyConfig(state_features(4), 2, [[1], []])


class FakeEnv:
    def __init__(self, valid=None):
        self.unwrapped = self
        self.valid = valid
        self.calls = []

    def candidate_extras(self, candidates):
        self.calls.append(candidates)
        out = {"cf_scores": np.arange(len(candidates), dtype=np.float32)}
        if self.valid is not None:
            out["valid"] = np.asarray(self.valid)
        return out


def test_runner_executes_the_first_meta_action_and_exposes_extras():
    policy = small_policy(8)
    obs = {"state": np.ones(4, dtype=np.float32)}
    with torch.no_grad():
        logits = policy.logits({"state": torch.ones(1, 4)})[0]
    greedy = int(logits.argmax())
    runner = CandidatePolicyRunner(policy)
    env = FakeEnv()
    runner.reset(env, 0)
    action = runner.act(obs, env)
    assert action.shape == () and action.dtype == np.int64 and int(action) == VOCAB[greedy][0]
    assert env.calls == []  # the hook runs only when extras are asked for (recording), never in act
    extras = runner.extras()
    assert extras["chosen"].dtype == np.int64 and int(extras["chosen"]) == greedy
    assert extras["logits"].dtype == np.float32 and np.allclose(extras["logits"], logits.numpy())
    assert np.array_equal(extras["cf_scores"], np.arange(K)) and env.calls == [VOCAB]
    # the hook is skipped when env extras are off
    quiet, env = CandidatePolicyRunner(policy, env_extras=False), FakeEnv()
    quiet.reset(env, 0)
    quiet.act(obs, env)
    assert env.calls == [] and set(quiet.extras()) == {"logits", "chosen"}


def test_sampling_runner_is_seeded_per_episode():
    policy = small_policy(9)
    with torch.no_grad():
        policy.head[-1].weight.zero_()  # a uniform policy: samples spread over all candidates
    obs, env = {"state": np.zeros(4, dtype=np.float32)}, FakeEnv()
    runner = CandidatePolicyRunner(policy, deterministic=False, env_extras=False)

    def episode(seed):
        runner.reset(env, seed)
        out = []
        for _ in range(30):
            runner.act(obs, env)
            out.append(int(runner.extras()["chosen"]))
        return out

    first, again, other = episode(1), episode(1), episode(2)
    assert first == again and first != other and len(set(first)) >= 3


class ProxyEnv(FakeEnv):
    """An env hook that scores candidate ``best`` highest."""

    def __init__(self, best, with_scores=True):
        super().__init__()
        self.best, self.with_scores = best, with_scores

    def candidate_extras(self, candidates):
        self.calls.append(candidates)
        scores = np.zeros(len(candidates), dtype=np.float32)
        scores[self.best] = 1.0
        return {"proxy_scores": scores} if self.with_scores else {"cf_scores": scores}


@pytest.mark.slow
def test_exploring_runner_samples_the_mixture_with_the_proxys_best_and_records_its_logits():
    policy = small_policy(12)
    obs = {"state": np.full(4, 0.5, dtype=np.float32)}
    with torch.no_grad():
        pi = policy.logits({"state": torch.full((1, 4), 0.5)})[0].softmax(-1).numpy()
    best, eps = int(pi.argmin()), 0.3
    mu = (1 - eps) * pi
    mu[best] += eps
    runner, env = CandidatePolicyRunner(policy, deterministic=False, explore_eps=eps), ProxyEnv(best)
    runner.reset(env, 0)
    chosen = []
    for _ in range(2000):
        runner.act(obs, env)
        extras = runner.extras()
        chosen.append(int(extras["chosen"]))
        assert np.allclose(np.exp(extras["logits"]), mu, atol=1e-6)
    assert len(env.calls) == 2000  # the hook scored each decision once, before the choice
    freq = np.bincount(chosen, minlength=K) / len(chosen)
    assert np.abs(freq - mu).max() < 0.04 and freq[best] > pi[best] + 0.25
    # greedy acting (evaluation, deployment) ignores exploration and asks the env nothing in act
    greedy, env = CandidatePolicyRunner(policy, explore_eps=eps), ProxyEnv(best)
    greedy.reset(env, 0)
    assert int(greedy.act(obs, env)) == VOCAB[int(pi.argmax())][0] and env.calls == []
    # with a margin, only where the proxy's best beats the policy's first choice by more than it (here by 1.0)
    for margin, explores in ((0.9, True), (1.1, False)):
        gated, env = CandidatePolicyRunner(policy, deterministic=False, explore_eps=eps, explore_margin=margin), \
            ProxyEnv(best)
        gated.reset(env, 0)
        gated.act(obs, env)
        acting = torch.as_tensor(gated.extras()["logits"]).softmax(-1).numpy()  # the recorded logits' distribution
        assert np.allclose(acting, mu if explores else pi, atol=1e-6)
    with pytest.raises(CandidateConfigError, match="proxy_scores"):
        runner.act(obs, ProxyEnv(best, with_scores=False))
    with pytest.raises(CandidateConfigError, match=r"\[0, 1\)"):
        CandidatePolicyRunner(policy, explore_eps=1.0)
    with pytest.raises(CraftConfigError, match="explore_eps"):
        CraftConfig(explore_eps=-0.1)


def test_ratios_against_the_exploring_mixture_let_a_rare_candidate_grow_past_the_policys_clip():
    """A candidate the policy picks 0.4% of the time, executed with a positive residual: against the
    policy's own logits the clip stops its growth at 1.2x; against the mixture that gave it 0.3 the
    clip allows up to 1.2 x 0.3."""
    rare, eps = 4, 0.3
    base = torch.tensor([[3.0, 0.0, 0.0, 0.0, -1.6]])
    pi_old = base.softmax(-1)
    mu = (1 - eps) * pi_old
    mu[:, rare] += eps
    grown = base.clone()
    grown[0, rare] += math.log(1.3)  # 1.3x its old probability: past the policy's clip, far inside the mixture's
    for old, clipped in ((pi_old.log(), True), (mu.log(), False)):
        logits = grown.clone().requires_grad_(True)
        _, residual_loss, _ = policy_losses(logits, old, torch.zeros(1, K), torch.tensor([rare]), torch.ones(1),
                                            proxy_weight="policy")
        residual_loss.backward()
        assert (logits.grad.abs().max() == 0) if clipped else (logits.grad[0, rare] < -0.01)
    # the same through Craft.fit: a batch of such states, every update on the rare candidate
    n, grew = 64, {}
    policy = small_policy(13)
    with torch.no_grad():
        policy.head[-1].weight.zero_()
        policy.head[-1].bias.copy_(base[0])
    obs = {"state": torch.randn(n, 4, generator=gen(3))}
    for name, old in (("policy", pi_old.log()), ("mixture", mu.log())):
        craft = Craft(CraftConfig(lr=3e-3, proxy_weight="policy", lambda_res=1.0, beta_sd=0.0, minibatch=32), policy)
        craft.fit({"obs": obs, "proxy_adv": torch.zeros(n, K), "chosen": torch.full((n,), rare),
                   "old_logits": old.expand(n, -1), "delta": torch.ones(n)}, gen(0))
        with torch.no_grad():
            grew[name] = float((craft.policy.logits(obs).softmax(-1)[:, rare] / pi_old[0, rare]).mean())
    assert grew["mixture"] > 3 * grew["policy"] > 3.0


@pytest.mark.parametrize("proxy_weight", ["uniform", "policy"])
def test_updates_raise_the_probability_of_the_candidate_with_positive_advantage(proxy_weight):
    craft = Craft(CraftConfig(lr=3e-3, proxy_weight=proxy_weight, minibatch=32, epochs=2), small_policy(10))
    batch = random_batch(n=64, seed=14)
    batch["proxy_adv"] = group_advantages(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0]).expand(64, -1))
    with torch.no_grad():
        batch["old_logits"] = craft.policy.logits(batch["obs"])
    before = batch["old_logits"].softmax(-1)[:, 2].mean()
    craft.fit(batch, gen(1))
    with torch.no_grad():
        after = craft.policy.logits(batch["obs"]).softmax(-1)[:, 2].mean()
    assert after > before + 0.05


def test_target_kl_stops_a_batchs_passes_after_the_first_step_past_it():
    batch = random_batch(n=64)
    full = Craft(CraftConfig(lr=1e-2, epochs=4, minibatch=16), small_policy(3)).fit(batch, gen(0))
    assert int(full["updates"]) == 16  # 4 passes x 4 minibatches
    # a tiny trust region: the first step already leaves it, so exactly one update is made
    stopped = Craft(CraftConfig(lr=1e-2, epochs=4, minibatch=16, target_kl=1e-12), small_policy(3)).fit(batch, gen(0))
    assert int(stopped["updates"]) == 1 and float(stopped["kl_old"]) > 1e-12
    # a wide one never binds: the same updates as without it, bit for bit
    wide = Craft(CraftConfig(lr=1e-2, epochs=4, minibatch=16, target_kl=1e9), small_policy(3))
    again = Craft(CraftConfig(lr=1e-2, epochs=4, minibatch=16), small_policy(3))
    wide.fit(batch, gen(0)), again.fit(batch, gen(0))
    assert all(torch.equal(a, b) for a, b in zip(wide.policy.parameters(), again.policy.parameters()))
    with pytest.raises(CraftConfigError, match="target_kl"):
        CraftConfig(target_kl=0.0)


@pytest.mark.parametrize("setting, shown", [({"event_weights": [-1, -0.3, 0, 0, "x"]}, "event_weights must be a list of finite"),
                                            ({"event_weights": [-1, -0.3, 0, 0, math.nan]}, "event_weights must be a list of finite"),
                                            ({"event_weights": [[-1], 0]}, "event_weights must be a list of finite"),
                                            ({"lambda_res": math.nan}, "lambda_res must be a finite number, got nan"),
                                            ({"dual_c": math.nan}, "dual_c must be a finite number, got nan"),
                                            ({"lr": math.inf}, "lr must be a finite number, got inf"),
                                            ({"veto_acting": True}, "veto_acting .* needs veto_updates > 0")])
def test_non_numeric_or_non_finite_settings_are_config_errors(setting, shown):
    # a NaN weight passed every range check and trained NaN losses into published versions
    with pytest.raises(CraftConfigError, match=shown):
        CraftConfig(**setting)
    assert CraftConfig(lambda_res=1, event_weights=[-1, 0, 0, 0, 0]).lambda_res == 1  # integers are numbers


# --- the guard term ------------------------------------------------------------------------------
def test_guard_targets_pick_the_states_where_the_policys_choice_is_predicted_to_go_wrong():
    scores = torch.tensor([[0.5, -1.0, 0.2, 0.0, 0.0],    # the policy's choice (1) crashes, 0 is 1.5 better: critical
                           [0.5, -0.1, 0.3, 0.0, 0.0],    # its choice scores -0.1 < 0, but the best only 0.6 above: critical
                           [0.9, 0.2, 0.0, 0.0, 0.0],     # its choice is safe (0.2 >= 0): not critical
                           [-0.9, -1.0, -0.95, -1.0, -1.0]])  # its choice crashes, nothing is 0.3 better: not critical
    old_logits = torch.tensor([[0.0, 3.0, 0.0, 0.0, 0.0]]).repeat(4, 1)
    critical, target = guard_targets(scores, old_logits, tau=0.02, margin=0.3, danger=0.0)
    assert critical.tolist() == [True, True, False, False]
    moved = (old_logits.log_softmax(-1) + (scores - scores.mean(-1, keepdim=True)) / 0.02).softmax(-1)
    assert torch.allclose(target[:2], moved[:2]) and torch.allclose(target.sum(-1), torch.ones(4))
    assert torch.equal(target[2:], old_logits[2:].softmax(-1))  # elsewhere: the acting policy itself
    assert target[0].argmax() == 0 and target[0, 0] > 0.999  # nearly all on the proxy's best
    # a large temperature leaves the acting policy as it was
    assert torch.allclose(guard_targets(scores, old_logits, 1e6, 0.3, 0.0)[1], old_logits.softmax(-1), atol=1e-4)


def test_the_guard_term_raises_the_critical_states_best_candidate_and_is_off_by_default():
    policy = small_policy(7)
    obs = {"state": torch.randn(6, 4, generator=gen(1))}
    with torch.no_grad():
        before = policy.logits(obs).softmax(-1)[:, 2]
    guard = {"obs": obs, "target": torch.nn.functional.one_hot(torch.full((6,), 2), K).float()}
    batch = random_batch(n=32)
    batch["delta"], batch["proxy_adv"] = torch.zeros(32), torch.zeros(32, K)  # only the guard (and the KL) acts
    on, off = Craft(CraftConfig(guard_weight=1.0, beta_sd=0.0, lr=1e-2), policy), Craft(CraftConfig(lr=1e-2), policy)
    first = on.update(batch, guard)["guard_loss"]
    for _ in range(19):
        last = on.update(batch, guard)["guard_loss"]
    assert first > 0.5 and last < first / 2
    with torch.no_grad():
        assert (on.policy.logits(obs).softmax(-1)[:, 2] > before + 0.1).all()
    # fit hands the guard to every update; at weight 0 (the default) it changes nothing
    without = Craft(CraftConfig(lr=1e-2), policy)
    assert off.fit({**random_batch(n=32), "guard": guard}, gen(0))["guard_loss"] == 0
    without.fit(random_batch(n=32), gen(0))
    assert all(torch.equal(a, b) for a, b in zip(off.policy.parameters(), without.policy.parameters()))
    with pytest.raises(CraftConfigError, match="guard_weight > 0 distils the proxy's scores: it needs use_proxy"):
        CraftConfig(guard_weight=1.0, use_proxy=False)
    with pytest.raises(CraftConfigError, match="guard_tau must be a number > 0"):
        CraftConfig(guard_tau=0.0)
    with pytest.raises(CraftConfigError, match="guard_margin must be a finite number >= 0"):
        CraftConfig(guard_margin=-1)


def test_veto_targets_drop_the_candidates_predicted_to_go_wrong_and_keep_the_policys_order():
    scores = torch.tensor([[0.5, -1.0, 0.2, -0.6, -0.4],     # 1 and 3 vetoed (below -0.5, far below the best)
                           [-1.0, -1.2, -1.1, -0.9, -1.3],    # all below -0.5, only those more than 0.3 below the best (-0.9)
                           [0.1, 0.2, 0.3, 0.0, 0.1]])        # nothing predicted to go wrong
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.5, 0.0]]).repeat(3, 1)
    vetoed, target = veto_targets(scores, logits, danger=-0.5, margin=0.3)
    assert vetoed.tolist() == [[False, True, False, True, False], [False, False, False, False, True],
                               [False] * 5]
    pi = logits.softmax(-1)
    kept = pi * ~vetoed
    assert torch.allclose(target, kept / kept.sum(-1, keepdim=True)) and torch.allclose(target.sum(-1), torch.ones(3))
    assert torch.allclose(target[2], pi[2])  # untouched where nothing is vetoed (renormalised by 1)
    assert target[0].argmax() == 2  # the policy's own favourite among what is left, not the proxy's best (0)
    assert not vetoed.gather(-1, scores.argmax(-1, keepdim=True)).any()  # the best is never vetoed
    with pytest.raises(CraftConfigError, match="veto_updates > 0 reads the proxy's scores"):
        CraftConfig(veto_updates=10, use_proxy=False)
    with pytest.raises(CraftConfigError, match="veto_margin must be a finite number >= 0"):
        CraftConfig(veto_margin=-0.1)
