"""QAM properties listed in docs/methods.md, "QAM: what the tests check".

Gaussian closed forms: data N(mu, s^2) with an independent coupling has
the flow velocity v(x, w) = mu + k(w) (x - w mu), k(w) = (w s^2 - (1 - w)) / D(w),
D(w) = (1 - w)^2 + w^2 s^2. End-to-end checks run in normalised action units
(bounds [-1, 1]) on N(0.15, 0.25^2), the closed-form checks' N(0.3, 0.5^2) halved so no
mass is clipped.
"""

import copy
import dataclasses
import math

import pytest
import torch

from robo_post.algos.divl import DIVL
from robo_post.algos.fql import FQL, FQLConfig
from robo_post.algos.qam import (
    QAM,
    QAMConfig,
    adjoint_step,
    am_loss,
    am_target,
    cap_path_kl,
    lean_adjoint,
    policy_velocity,
    sample_path,
    terminal_adjoint,
    time_grid,
)
from robo_post.models.features import state_features
from robo_post.models.critic import CriticConfig
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig

torch.set_num_threads(1)
MU, S = 0.15, 0.25  # base of the end-to-end checks (normalised units)


def gauss_velocity(mu: float, s: float):
    """Exact flow-matching velocity of N(mu, s^2) (see the module docstring)."""
    def v(x, w):
        D = (1 - w) ** 2 + w * w * s * s
        return mu + (w * s * s - (1 - w)) / D * (x - w * mu)
    return v


def normal_quantiles(n: int) -> torch.Tensor:
    """Deterministic N(0, 1) 'samples' (mid-point quantiles): ODE moments without sampling noise."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    return math.sqrt(2) * torch.erfinv(2 * u - 1)


def euler_ode(v, x, n):
    for i in range(n):
        x = x + v(x, i / n) / n
    return x


# --- 7. flow matching on Gaussian data ---------------------------------------------------
def test_euler_sampling_of_the_exact_gaussian_velocity():
    x = euler_ode(gauss_velocity(0.3, 0.5), normal_quantiles(20000), 1000)
    assert x.mean().item() == pytest.approx(0.3, abs=1e-2)
    assert x.std().item() == pytest.approx(0.5, abs=1e-2)


def _batch(n: int, actions: torch.Tensor | None = None) -> dict:
    actions = torch.zeros(n, 1, 1) if actions is None else actions.view(n, 1, 1)
    return {"obs": {"proprio": torch.zeros(n, 1)}, "actions": actions}


@pytest.fixture(scope="module")
def base_policy() -> FlowPolicy:
    return train_base()


def train_base(predicts: str = "chunk") -> FlowPolicy:
    """A 1-D flow policy trained by flow-matching BC on N(MU, S^2)."""
    torch.manual_seed(0)
    policy = FlowPolicy(FlowPolicyConfig(features=state_features(1, "proprio"), action_dim=1, horizon=1, use_text=False, embed_dim=16,
                                         hidden_dim=128, predicts=predicts))
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 800)
    for _ in range(800):
        batch = _batch(256, MU + S * torch.randn(256))
        loss = policy.bc_loss(batch["obs"], batch["actions"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return policy.requires_grad_(False)


def sample_moments(policy: FlowPolicy, n: int = 4000, steps: int = 100) -> tuple[float, float]:
    """Mean and std of the policy's flow, by a fine Euler ODE (10 steps visibly shrink the std)."""
    with torch.no_grad():
        v = policy_velocity(policy, policy.encode(_batch(n)["obs"]))
        x = euler_ode(v, normal_quantiles(n).float().view(n, 1, 1), steps).flatten()
    return x.mean().item(), x.std().item()


def test_flow_matching_mlp_approaches_the_exact_velocity(base_policy):
    g = torch.Generator().manual_seed(1)
    w = 0.05 + 0.9 * torch.rand(4096, generator=g)
    x = (1 - w) * torch.randn(4096, generator=g) + w * (MU + S * torch.randn(4096, generator=g))
    with torch.no_grad():
        z = base_policy.encode(_batch(4096)["obs"])
        v_net = base_policy.velocity(z, x.view(-1, 1, 1), w).flatten()
    v_exact = gauss_velocity(MU, S)(x, w)
    assert ((v_net - v_exact).norm() / v_exact.norm()).item() < 0.05
    mean, std = sample_moments(base_policy)
    assert mean == pytest.approx(MU, abs=0.03) and std == pytest.approx(S, abs=0.03)


# --- 8. memoryless SDE --------------------------------------------------------------------
def test_memoryless_sde_preserves_marginals_and_the_lwd_schedule_does_not():
    # N = 500, 1e5 samples: Euler bias (exact moment recursion) +5e-4 mean, +2e-3 std;
    # sampling error 1.6e-3 / 1.1e-3. Tolerance 5e-3.
    torch.manual_seed(0)
    v = gauss_velocity(0.3, 0.5)
    grid = time_grid(500)
    x = sample_path(v, v, torch.randn(100_000), grid, keep_path=False)
    assert x.mean().item() == pytest.approx(0.3, abs=5e-3)
    assert x.std().item() == pytest.approx(0.5, abs=5e-3)
    w = grid.t_drift
    lwd = dataclasses.replace(grid, sigma=torch.sqrt(2 * w * (1 - w)))  # as transcribed from LWD's text
    x = sample_path(v, v, torch.randn(100_000), lwd, keep_path=False)
    assert x.std().item() == pytest.approx(0.334, abs=0.01)


# --- 9. lean adjoint --------------------------------------------------------------------
def test_lean_adjoint_matches_the_closed_form():
    kappa, c, s = 2.0, 1.5, 0.5
    v = gauss_velocity(0.3, s)
    for n, at_half in ((10, -1.311), (100, -1.213)):
        grid = time_grid(n)
        xs = torch.zeros(n + 1, 1, dtype=torch.float64)  # the Jacobian of an affine v does not depend on x
        adjs = lean_adjoint(v, xs, torch.full((1,), -kappa * c, dtype=torch.float64), grid).flatten()
        w = grid.t
        exact = -kappa * c * w * s * s / ((1 - w) ** 2 + w * w * s * s)
        keep = w >= 0.1 - 1e-12
        rel = ((adjs - exact).abs() / exact.abs())[keep].max().item()
        assert rel < 6 / n
        assert adjs[n // 2].item() == pytest.approx(at_half, abs=1e-3)
        assert exact[n // 2].item() == pytest.approx(-1.2)


# --- 10. the AM optimum is the tilted flow ---------------------------------------------------
def test_am_target_is_the_tilted_gaussian_velocity():
    mu, s, kappa, c = 0.3, 0.5, 2.0, 1.5
    v_base, v_tilt = gauss_velocity(mu, s), gauss_velocity(mu + kappa * s * s * c, s)

    def adjoint(w):
        return -kappa * c * w * s * s / ((1 - w) ** 2 + w * w * s * s)

    def target(x, w):
        return am_target(v_base(x, w), adjoint(w), torch.tensor(2 * (1 - w) / w, dtype=torch.float64).sqrt())

    x = torch.randn(100, dtype=torch.float64)
    for w in (0.1, 0.5, 0.9):
        torch.testing.assert_close(target(x, w), v_tilt(x, w), atol=1e-12, rtol=0)
    # Sampling the target; (1 - w) / w * adjoint = -kappa c s^2 (1 - w) / D(w) is finite at w = 0.
    def target_velocity(x, w):
        return v_base(x, w) + kappa * s * s * c * (1 - w) / ((1 - w) ** 2 + w * w * s * s)

    ode = euler_ode(target_velocity, normal_quantiles(20000), 1000)
    assert ode.mean().item() == pytest.approx(1.05, abs=5e-3) and ode.std().item() == pytest.approx(0.5, abs=5e-3)
    torch.manual_seed(1)
    sde = sample_path(target_velocity, target_velocity, torch.randn(100_000), time_grid(500), keep_path=False)
    assert sde.mean().item() == pytest.approx(1.05, abs=5e-3) and sde.std().item() == pytest.approx(0.5, abs=5e-3)


# --- 11. zero gradient means no change --------------------------------------------------------
@pytest.mark.parametrize("case", ["kappa0", "flat_critic"])
def test_zero_q_gradient_leaves_the_fine_policy_unchanged(case):
    torch.manual_seed(0)
    policy = FlowPolicy(FlowPolicyConfig(features=state_features(1, "proprio"), action_dim=2, horizon=2, use_text=False, embed_dim=8,
                                         hidden_dim=16))
    qam = QAM(policy, QAMConfig(inv_temp=0.0 if case == "kappa0" else 2.0))
    before = copy.deepcopy(qam.fine.state_dict())

    def critic(obs, a):
        return (a.sum((1, 2)) if case == "kappa0" else torch.zeros(a.shape[0]))[None]

    for _ in range(2):
        metrics = qam.update({"obs": {"proprio": torch.zeros(32, 1)}, "actions": torch.zeros(32, 2, 2)}, critic)
        assert metrics["loss_am"] == 0.0 and metrics["grad_norm"] == 0.0 and metrics["kl_path"] == 0.0
    after = qam.fine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# --- 12. loss forms -----------------------------------------------------------------------
def test_am_loss_forms_are_equal():
    g = torch.Generator().manual_seed(0)
    shape = (10, 64, 3, 2)
    v_fine, v_base, adj = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    sigma = time_grid(10).sigma.view(10, 1, 1, 1)
    control_form = ((2 * (v_fine - v_base) / sigma + sigma * adj) ** 2).flatten(2).sum(-1)
    torch.testing.assert_close(am_loss(v_fine, v_base, adj, sigma), control_form, atol=1e-10, rtol=1e-10)


# --- 13. VJP correctness ------------------------------------------------------------------
def test_adjoint_step_vjp_matches_an_explicit_matrix():
    g = torch.Generator().manual_seed(0)
    A, b = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    x, adj = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)
    w, h = 0.37, 0.1
    got = adjoint_step(lambda x, t: x @ A.T + b, x, adj, w, h)  # v(x) = A x + b per row
    jac = 2 * A - torch.eye(4, dtype=torch.float64) / w  # d/dx (2 v - x / w)
    torch.testing.assert_close(got, adj + h * (jac.T @ adj.T).T, atol=1e-12, rtol=0)


# --- 14. sign, monotonicity, clip_adj ---------------------------------------------------------
def test_clip_adj_zeroes_saturated_coordinates():
    a1 = torch.tensor([[0.5, 1.2, -0.3, -1.7]])
    c = torch.tensor([1.0, 2.0, 3.0, 4.0])
    adj, q = terminal_adjoint(lambda obs, a: (a * c).sum(-1)[None], None, a1, inv_temp=0.5, clip=True)
    assert adj.tolist() == [[-0.5, 0.0, -1.5, 0.0]]
    assert q.item() == pytest.approx(0.5 + 2.0 - 0.9 - 4.0)
    adj, _ = terminal_adjoint(lambda obs, a: (a * c).sum(-1)[None], None, a1, inv_temp=0.5, clip=False)
    assert adj.tolist() == [[-0.5, -1.0, -1.5, -2.0]]


def run_qam(base: FlowPolicy, critic, flow_steps: int = 10, **config) -> tuple[QAM, dict]:
    torch.manual_seed(0)
    base = copy.deepcopy(base)
    base.config.flow_steps = flow_steps  # N of the SDE, adjoint and loss grid
    qam = QAM(base, QAMConfig(**{"lr": 3e-3, "lr_decay_steps": 100, "q_scale": 1.0, **config}))
    for _ in range(100):
        metrics = qam.update(_batch(128), critic)
    return qam, metrics


@pytest.mark.slow
@pytest.mark.parametrize("predicts", ["chunk", "velocity"])
def test_qam_tilts_along_c_monotonically_in_kappa(base_policy, predicts):
    base = base_policy if predicts == "chunk" else train_base("velocity")
    c = 1.5
    linear = lambda obs, a: c * a.flatten(1).sum(-1)[None]  # noqa: E731
    m0, s0 = sample_moments(base)
    results = {}
    for kappa in (0.5, 2.0):
        qam, metrics = run_qam(base, linear, inv_temp=kappa)
        results[kappa] = (*sample_moments(qam.fine), metrics["kl_path"])
    # E[Q] = c E[a] and KL(pi_theta || pi_beta) grow with kappa (kappa = 0: the base, KL 0).
    assert m0 < results[0.5][0] < results[2.0][0] and 0 < results[0.5][2] < results[2.0][2]
    # End-to-end AM fit: the tilt of the learned base is N(m0 + kappa s0^2 c, s0^2). A chunk-predicting
    # policy fits the late, near-singular part of the velocity less closely: its std comes out ~15% narrow.
    for kappa, (mean, std, _) in results.items():
        assert mean == pytest.approx(m0 + kappa * s0**2 * c, abs=0.03)
        assert std == pytest.approx(s0, abs=0.03 if predicts == "velocity" else 0.045)


@pytest.mark.slow
def test_measured_q_scale_tilts_alike_on_any_reward_scale(base_policy):
    """With ``q_scale`` measured (the default), a linear critic c * a + b moves the policy by
    kappa * s0 (one temperature, one share of the policy's spread) whatever c and b are."""
    m0, s0 = sample_moments(base_policy)
    drawn = sample_moments(base_policy, steps=10)[1]  # the spread of the 10-step sampler the scale is measured on
    for c, b in ((1.5, 0.0), (150.0, -40.0)):
        qam, metrics = run_qam(base_policy, lambda obs, a: c * a.flatten(1).sum(-1)[None] + b, q_scale=None)  # noqa: B023
        assert metrics["q_scale"].item() == pytest.approx(c * drawn, rel=0.15)
        # The tilt N(m0 + kappa s0^2 c / q_scale, s0^2): the same shift on both scales.
        assert sample_moments(qam.fine)[0] == pytest.approx(m0 + 0.5 * s0**2 / drawn, abs=0.03)
    fql_means = []
    for c, b in ((1.5, 0.0), (150.0, -40.0)):
        torch.manual_seed(0)
        fql = FQL(base_policy, FQLConfig(alpha=10.0, lr=3e-3))
        for _ in range(150):
            fql.update(_batch(128), lambda obs, a: c * a.flatten(1).sum(-1)[None] + b)  # noqa: B023
        fql_means.append(fql.act(_batch(4000)["obs"]).mean().item())
    # alpha (a - target)^2 against c a / q_scale: a = target + 1 / (2 alpha drawn) on both scales.
    assert fql_means == pytest.approx([m0 + 1 / (20 * drawn)] * 2, abs=0.03)


@pytest.mark.slow
def test_heads_that_disagree_more_than_the_policy_spreads_set_the_temperature(base_policy):
    """A critic whose heads disagree on the data's chunks by more than the policy's own chunks
    spread in Q measures the tilt in that disagreement: Q differences within the critic's
    error move the policy less (a near-deterministic policy otherwise divides by ~0)."""
    m0, s0 = sample_moments(base_policy)
    c, d = 1.5, 2.0
    heads = lambda obs, a: torch.stack([c * a.flatten(1).sum(-1) + d, c * a.flatten(1).sum(-1) - d])  # noqa: E731
    qam, metrics = run_qam(base_policy, heads, q_scale=None)
    resolution = 2**0.5 * d  # the heads' spread: root of their (unbiased) variance
    assert metrics["q_scale"].item() == pytest.approx(resolution, rel=1e-4)
    assert sample_moments(qam.fine)[0] == pytest.approx(m0 + 0.5 * s0**2 * c / resolution, abs=0.02)


def test_the_trust_region_caps_each_states_target_kl_and_leaves_the_rest_alone():
    """Samples whose target control costs more than ``max_kl`` are scaled down to exactly it;
    the others are untouched (the cap is a per-state temperature, not a batch one)."""
    grid = time_grid(10)
    sigma = grid.sigma.view(-1, 1, 1, 1)
    adjs = torch.randn(10, 6, 4, 2) * torch.tensor([0.01, 0.1, 1.0, 3.0, 10.0, 30.0]).view(1, 6, 1, 1)
    capped, kl = cap_path_kl(adjs, sigma, grid.h, 0.5)
    after = (0.5 * grid.h * sigma[:-1] ** 2 * capped[:-1].pow(2)).flatten(2).sum(-1).sum(0)
    assert torch.allclose(after, kl.clamp(max=0.5), rtol=1e-5)
    keep = kl <= 0.5
    assert 0 < keep.sum() < 6 and torch.equal(capped[:, keep], adjs[:, keep])


@pytest.mark.slow
def test_a_critic_steep_against_its_unit_moves_the_policy_by_the_budget_only(base_policy):
    """A linear critic 40x steeper than the pinned unit asks for a tilt of ~(kappa s0 c)^2 / 2
    nats; a budget of kappa^2 / 2 (the default with a measured unit) holds the fine policy's path
    KL at it, and the policy moves by kappa s0, the shift that KL buys. A pinned unit is uncapped."""
    m0, s0 = sample_moments(base_policy)
    steep = lambda obs, a: 40.0 * a.flatten(1).sum(-1)[None]  # noqa: E731
    assert QAM(base_policy, QAMConfig(q_scale=1.0)).max_kl == math.inf
    assert QAM(base_policy, QAMConfig(inv_temp=0.5)).max_kl == 0.125
    free, m_free = run_qam(base_policy, steep, inv_temp=0.5)
    capped, m_capped = run_qam(base_policy, steep, inv_temp=0.5, max_kl=0.125)
    assert m_free["kl_path"] > 10 * 0.125 and m_free["capped"] == 0.0 and m_capped["capped"] == 1.0
    assert m_capped["kl_path"] == pytest.approx(0.125, abs=0.03)
    shift = sample_moments(capped.fine)[0] - m0
    assert shift == pytest.approx(0.5 * s0, abs=0.03) and shift < sample_moments(free.fine)[0] - m0 - 0.2


# --- 15. path source ------------------------------------------------------------------------
@pytest.mark.slow
def test_path_source_fine_reaches_the_exact_tilt_and_reference_does_not(base_policy):
    q, a0, kappa = 16.0, 0.6, 2.0  # kappa q s^2 = 2
    quadratic = lambda obs, a: (-0.5 * q * (a.flatten(1) - a0) ** 2).sum(-1)[None]  # noqa: E731
    m0, s0 = sample_moments(base_policy)
    precision = 1 / s0**2 + kappa * q
    exact = ((m0 / s0**2 + kappa * q * a0) / precision, precision**-0.5)
    # N = 20: at N = 10 the explicit adjoint steps of this stiff tilt bias the fine fit by ~0.05.
    fine = sample_moments(run_qam(base_policy, quadratic, 20, inv_temp=kappa, path_source="fine")[0].fine)
    ref = sample_moments(run_qam(base_policy, quadratic, 20, inv_temp=kappa, path_source="reference")[0].fine)
    assert fine == pytest.approx(exact, abs=0.03)
    # Reference paths give the first-order control: here the mean overshoots towards a0.
    assert ref[0] - exact[0] > 0.1


def test_fql_baseline_moves_along_c_and_stays_near_the_reference(base_policy):
    torch.manual_seed(0)
    fql = FQL(base_policy, FQLConfig(alpha=10.0, lr=3e-3, q_scale=1.0))
    linear = lambda obs, a: 1.5 * a.flatten(1).sum(-1)[None]  # noqa: E731
    for _ in range(150):
        metrics = fql.update(_batch(128), linear)
    a = fql.act(_batch(4000)["obs"]).flatten()
    m0, s0 = sample_moments(base_policy)
    # alpha * d/da (a - target)^2 = c at a = target + c / (2 alpha): a shift of 0.075, no tilt of the shape.
    assert a.mean().item() == pytest.approx(m0 + 1.5 / 20, abs=0.03)
    assert metrics["distill_loss"] < 0.05


# --- co-trained base: imitates the learner's imitation windows, not the batch --------------------
@pytest.mark.slow
@pytest.mark.parametrize("actor", ["qam", "fql"])
def test_cotrained_base_imitates_the_imitation_windows(base_policy, actor):
    """The batch's actions sit at +0.6 (every source, failures too), the imitation windows'
    (demonstrations, interventions) at -0.6: the co-trained base, and with it the
    reference, follows the imitation windows, or the batch when there are none."""
    flat = lambda obs, a: torch.zeros(1, a.shape[0])  # noqa: E731  (no critic pull)
    means = {}
    for imitate in (True, False):
        torch.manual_seed(0)
        if actor == "qam":
            learner = QAM(base_policy, QAMConfig(base="ema_cotrained", ema_rate=0.2, lr=3e-3))
        else:
            learner = FQL(base_policy, FQLConfig(base="ema_cotrained", ema_rate=0.2, lr=3e-3))
        for _ in range(150):
            batch = _batch(128, torch.full((128,), 0.6))
            if imitate:
                batch["imitation"] = _batch(128, torch.full((128,), -0.6))
            metrics = learner.update(batch, flat)
        assert metrics["bc_loss_base"] < 0.5
        means[imitate] = sample_moments(learner.reference)[0]
    assert means[True] == pytest.approx(-0.6, abs=0.1) and means[False] == pytest.approx(0.6, abs=0.1)
    with pytest.raises(ValueError, match="base"):
        FQL(base_policy, FQLConfig(base="cotrained"))


# --- 19-20. no critic gradient from the actor; frozen base ------------------------------------
def test_actor_update_touches_neither_critic_nor_reference():
    torch.manual_seed(0)
    pc = FlowPolicyConfig(features=state_features(3, "proprio"), action_dim=2, horizon=2, use_text=False, embed_dim=8, hidden_dim=16)
    policy = FlowPolicy(pc)
    divl = DIVL(CriticConfig.like(pc))
    batch = {"obs": {"proprio": torch.randn(16, 3)}, "next_obs": {"proprio": torch.randn(16, 3)},
             "actions": torch.rand(16, 2, 2) * 2 - 1, "rewards": torch.rand(16), "discounts": torch.full((16,), 0.9)}
    divl.update(batch)
    critic_state = {k: v.clone() for k, v in divl.net.state_dict().items()} | {
        "target." + k: v.clone() for k, v in divl.target.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in divl.net.named_parameters() if p.grad is not None}
    ref_state = copy.deepcopy(policy.state_dict())
    for q_net in ("target", "online"):
        qam = QAM(policy, QAMConfig(inv_temp=5.0))
        for _ in range(2):
            metrics = qam.update(batch, divl.critic_fn(q_net))
        assert metrics["grad_norm"] > 0
        assert all(torch.equal(ref_state[k], v) for k, v in qam.reference.state_dict().items())
    assert all(torch.equal(ref_state[k], v) for k, v in policy.state_dict().items())
    after = divl.net.state_dict() | {"target." + k: v for k, v in divl.target.state_dict().items()}
    assert all(torch.equal(critic_state[k], after[k]) for k in critic_state)
    assert all(torch.equal(grads[n], p.grad) for n, p in divl.net.named_parameters() if p.grad is not None)
