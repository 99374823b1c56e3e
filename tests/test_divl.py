"""DIVL properties listed in docs/methods.md, "DIVL: what the tests check"."""

import copy
import math

import numpy as np
import pytest
import torch

from robo_post.algos.divl import (
    DIVL,
    DIVLConfig,
    adaptive_tau,
    asymmetric_loss,
    atom_support,
    c51_project,
    cat_quantile,
    norm_entropy,
    td_target,
)
from robo_post.algos.iql import IQL, IQLConfig
from robo_post.models.features import state_features
from robo_post.models.critic import CriticConfig, CriticNet
from robo_post.models.encoders import mlp
from robo_post.store import ArraySpec, Store, StoreSchema, WindowSampler

torch.set_num_threads(1)


def argmin_on_grid(x: torch.Tensor, weights: torch.Tensor, tau: float, power: int, n: int = 40001) -> float:
    """Minimiser over v of sum_k w_k rho_{tau,p}(x_k - v), by a dense grid on [min x, max x]."""
    v = torch.linspace(x.min().item(), x.max().item(), n, dtype=torch.float64)
    loss = (asymmetric_loss(x[None, :] - v[:, None], tau, power) * weights).sum(-1)
    return v[loss.argmin()].item()


# --- 1. expectile and pinball ----------------------------------------------------------
def test_asymmetric_losses_and_their_minimisers():
    u = torch.randn(1000, dtype=torch.float64)
    assert torch.equal(asymmetric_loss(u, 0.5, 2), 0.5 * u**2)
    assert torch.equal(asymmetric_loss(u, 0.5, 1), 0.5 * u.abs())

    x = torch.tensor(np.random.default_rng(0).gamma(2.0, size=50))
    w = torch.full_like(x, 1 / 50)
    step = (x.max() - x.min()).item() / 40000
    assert argmin_on_grid(x, w, 0.5, 2) == pytest.approx(x.mean().item(), abs=step)
    expectiles = [argmin_on_grid(x, w, tau, 2) for tau in (0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.99999)]
    assert all(b >= a for a, b in zip(expectiles, expectiles[1:]))
    assert expectiles[-1] == pytest.approx(x.max().item(), abs=0.01 * (x.max() - x.min()).item())
    for tau in (0.13, 0.33, 0.71, 0.95):  # n * tau not an integer: the minimiser is unique
        expected = np.quantile(x.numpy(), tau, method="inverted_cdf")
        assert argmin_on_grid(x, w, tau, 1) == pytest.approx(expected, abs=step)


# --- 2. C51 projection ---------------------------------------------------------------
def test_c51_projection_keeps_mass_and_mean():
    z = atom_support(-0.1, 1.1, 51).double()
    y = torch.cat([torch.rand(1000, dtype=torch.float64) * 1.6 - 0.3, z[[0, 7, 25, 50]]])
    m = c51_project(y, z)
    assert (m >= 0).all()
    torch.testing.assert_close(m.sum(-1), torch.ones(len(y), dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(m @ z, y.clamp(-0.1, 1.1), atol=1e-6, rtol=0)
    # On an atom: one-hot, no lost mass.
    for k, j in enumerate((0, 7, 25, 50)):
        assert torch.equal(m[1000 + k], torch.nn.functional.one_hot(torch.tensor(j), 51).double())
    # Outside the support: the end atoms.
    out = c51_project(torch.tensor([-5.0, 7.0], dtype=torch.float64), z)
    assert out[0, 0] == 1 and out[1, -1] == 1 and out.sum() == 2
    # float32 atoms from linspace: the top end must not leave the grid.
    z32 = atom_support(-0.1, 1.1, 201)
    assert c51_project(torch.tensor([1.1, 1.0999999]), z32).sum(-1).tolist() == pytest.approx([1.0, 1.0])


# --- 3. categorical quantile ----------------------------------------------------------
def test_categorical_quantile():
    z = atom_support(-0.1, 1.1, 51).double()
    p = torch.distributions.Dirichlet(torch.ones(51)).sample((8,)).double()
    taus = torch.linspace(0.01, 1.0, 100, dtype=torch.float64)
    q = torch.stack([cat_quantile(p, z, t) for t in taus], -1)
    assert (q.diff(dim=-1) >= 0).all()
    onehot = torch.nn.functional.one_hot(torch.tensor([3, 17, 50]), 51).double()
    for t in (1e-6, 0.3, 0.5, 0.999, 1.0):
        assert torch.equal(cat_quantile(onehot, z, torch.tensor(t)), z[[3, 17, 50]])
    # tau = 1 returns the largest atom with mass even when the raw CDF ends below 1.
    p32 = torch.zeros(2, 51)
    p32[0, [4, 9]] = torch.tensor([0.5, 0.4999999])
    p32[1, :30] = torch.distributions.Dirichlet(torch.ones(30)).sample()
    p32[1, 29] += 1e-6  # no longer sums to 1
    assert p32[0].cumsum(0)[-1] < 1.0
    assert cat_quantile(p32, z.float(), torch.tensor(1.0)).tolist() == pytest.approx([z[9].item(), z[29].item()])
    # Histogram of on-atom samples: equals numpy's inverted-CDF quantile.
    idx = np.random.default_rng(1).integers(0, 51, 77)
    samples = z.numpy()[idx]
    hist = torch.bincount(torch.tensor(idx), minlength=51).double() / len(idx)
    for t in (0.05, 0.3, 0.52, 0.77, 0.9, 1.0):
        assert cat_quantile(hist[None], z, torch.tensor(t)).item() == pytest.approx(
            np.quantile(samples, t, method="inverted_cdf"), abs=1e-12)
    # Linear read-out lies between the neighbouring atoms and never above the atom read-out.
    lin = cat_quantile(p, z, torch.tensor(0.6), "linear")
    atom = cat_quantile(p, z, torch.tensor(0.6))
    assert ((lin <= atom) & (lin >= atom - (z[1] - z[0]) - 1e-12)).all()


# --- 4. entropy and adaptive tau ----------------------------------------------------------
def test_entropy_and_adaptive_tau():
    K = 51
    uniform = torch.softmax(torch.zeros(2, K, requires_grad=True), -1)
    onehot = torch.nn.functional.one_hot(torch.tensor([0, 30]), K).float()
    torch.testing.assert_close(norm_entropy(uniform), torch.ones(2))
    assert torch.equal(norm_entropy(onehot), torch.zeros(2))
    tau_u = adaptive_tau(uniform, 0.6, 0.3, 0.5, 0.95)
    assert tau_u.tolist() == pytest.approx([0.5, 0.5])  # 0.6 - 0.3 = 0.3, clipped up
    assert adaptive_tau(uniform, 0.6, 0.3, 0.2, 0.95).tolist() == pytest.approx([0.3, 0.3])
    assert adaptive_tau(onehot, 0.9, 0.3, 0.5, 0.85).tolist() == pytest.approx([0.85, 0.85])  # clipped down
    assert adaptive_tau(onehot, 0.6, 0.3, 0.5, 0.95).tolist() == pytest.approx([0.6, 0.6])
    assert not tau_u.requires_grad
    # Zero-initialised value logits: tau = max(tau_min, tau_base - alpha) at the start.
    critic = CriticConfig(features=state_features(3, "proprio"), action_dim=1, horizon=2, use_text=False, embed_dim=8, hidden_dim=16)
    for cfg, expected in ((DIVLConfig(), 0.5), (DIVLConfig(tau_min=0.1), 0.3)):
        learner = DIVL(critic, cfg)
        obs = {"proprio": torch.randn(5, 3)}
        p = learner.value_distribution(obs)
        assert torch.equal(p, torch.full_like(p, 1 / 51))
        assert learner.tau(p).tolist() == pytest.approx([expected] * 5)
        learner.set_stage("online")
        assert learner.tau(p).tolist() == pytest.approx([max(cfg.tau_min, 0.9 - 0.3)] * 5)


# --- 5. Proposition 1 -----------------------------------------------------------------
def test_proposition_1_quantile_of_fitted_distribution_is_the_pinball_minimiser():
    z = atom_support(-0.1, 1.1, 201).double()
    q = torch.tensor([0.05, 0.31, 0.47, 0.5, 0.62, 0.88, 0.97], dtype=torch.float64)
    pi = torch.tensor([0.1, 0.2, 0.05, 0.15, 0.2, 0.1, 0.2], dtype=torch.float64)
    target = pi @ c51_project(q, z)  # expected C51 label under a ~ D(.|s)
    logits = torch.zeros(201, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.1)
    for _ in range(1500):
        loss = -(target * torch.log_softmax(logits, -1)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    p = logits.detach().softmax(-1)
    assert (p - target).abs().max() < 1e-3  # cross-entropy recovered the push-forward
    dz = (z[1] - z[0]).item()
    for tau in (0.3, 0.6, 0.9):
        v_pinball = argmin_on_grid(q, pi, tau, 1)
        assert abs(cat_quantile(p[None], z, torch.tensor(tau)).item() - v_pinball) <= dz + 1e-9


# --- 6. chunk TD through the sampler ----------------------------------------------------------
def test_chunk_td_targets_from_the_sampler(tmp_path):
    g, H = 0.9, 2
    schema = StoreSchema(observations={"x": ArraySpec("float32", ())}, action=ArraySpec("float32", (1,)))
    store = Store.create(str(tmp_path / "s"), schema)
    episodes = [(np.array([0, 0, 0.5, 0, 0, 0, 1.0]), True), (np.array([1, 2, 3, 4, 5, 6, 7, 8.0]), False)]
    with store.writer("a", fsync=False) as w:
        for r, term in episodes:
            T = len(r)
            w.write_episode({"x": np.arange(T + 1, dtype=np.float32)}, np.zeros((T, 1), np.float32), rewards=r,
                            terminated=(np.arange(T) == T - 1) & term, truncated=(np.arange(T) == T - 1) & (not term))
    snap = store.snapshot()
    v_next = torch.tensor([0.7, 0.3, 1e6, 0.2])
    r0 = episodes[0][0]

    # n = 1: r_t = sum_{i<H} g^i r_{t+i}, bootstrap g^H; bit-exact with the 1-step formula.
    b1 = WindowSampler.from_snapshot(snap, horizon=H, n_step=1, gamma=g).sample(0, starts=np.array([0, 1, 6, 9]))
    one_step_r = torch.tensor([r0[0] + g * r0[1], r0[1] + g * r0[2], r0[6], 3 + g * 4], dtype=torch.float32)
    one_step_d = torch.tensor([g**H, g**H, 0.0, g**H], dtype=torch.float32)
    assert torch.equal(td_target(b1["rewards"], b1["discounts"], v_next), one_step_r + one_step_d * v_next)
    # done: the target is the reward, whatever V(s') is.
    assert td_target(b1["rewards"], b1["discounts"], v_next)[2].item() == 1.0

    # n = 3 chunks: bootstrap g^(nH) inside the episode; termination inside the window
    # drops the bootstrap and every reward after the terminal step.
    b3 = WindowSampler.from_snapshot(snap, horizon=H, n_step=3, gamma=g).sample(0, starts=np.array([0, 3, 7, 8]))
    assert b3["discounts"].tolist() == pytest.approx([g**6, 0.0, g**6, g**6])
    y = td_target(b3["rewards"], b3["discounts"], torch.tensor([0.7, 1e6, 0.3, 0.2]))
    assert y[1].item() == pytest.approx(sum(g**i * r0[3 + i] for i in range(4)))  # steps 3..6, then the episode ends
    assert y[0].item() == pytest.approx(g**2 * 0.5 + g**6 * 0.7)
    assert y[2].item() == pytest.approx(sum(g**i * (1 + i) for i in range(6)) + g**6 * 0.3, rel=1e-6)


# --- learner: update order (17), encoder stepped once (18), learning on a bandit -------------
def _bandit_batch(n: int = 128) -> dict:
    """One state, two chunk-actions: a = +0.5 pays 1, a = -0.5 pays 0; no bootstrap."""
    a = torch.where(torch.rand(n) < 0.5, 0.5, -0.5)
    obs = {"proprio": torch.ones(n, 2), "instruction": ["go"] * n}
    return {"obs": obs, "next_obs": obs, "actions": a.view(n, 1, 1).expand(n, 2, 1).clone(),
            "action_mask": torch.ones(n, 2, dtype=torch.bool), "rewards": (a > 0).float(), "discounts": torch.zeros(n)}


CRITIC = CriticConfig(features=state_features(2, "proprio"), action_dim=1, horizon=2, use_text=False, embed_dim=16, hidden_dim=32)


@pytest.mark.parametrize("mode", ["sequential", "joint"])
def test_update_order_and_single_encoder_step(mode):
    learner = DIVL(CRITIC, DIVLConfig(update_mode=mode))
    ids_v = {id(p) for g in learner.opt_v.param_groups for p in g["params"]}
    ids_q = {id(p) for g in learner.opt_q.param_groups for p in g["params"]}
    assert not ids_v & ids_q
    assert {id(p) for p in learner.net.encoder_parameters()} <= ids_q
    assert ids_v | ids_q == {id(p) for p in learner.net.parameters()}

    batch = _bandit_batch(32)
    batch["discounts"] = torch.full((32,), 0.9)
    before = [p.detach().clone() for p in learner.net.value_head.parameters()]
    seen = {}
    bootstrap = learner.bootstrap

    def spy(logits):
        seen["value_head"] = [p.detach().clone() for p in learner.net.value_head.parameters()]
        return bootstrap(logits)

    learner.bootstrap = spy
    learner.update(batch)
    updated = [p.detach() for p in learner.net.value_head.parameters()]
    used_updated = all(torch.equal(a, b) for a, b in zip(seen["value_head"], updated))
    used_previous = all(torch.equal(a, b) for a, b in zip(seen["value_head"], before))
    assert (used_updated, used_previous) == ((True, False) if mode == "sequential" else (False, True))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["divl", "iql"])
def test_value_learners_fit_a_two_action_bandit(kind):
    torch.manual_seed(0)
    if kind == "divl":
        learner = DIVL(CRITIC, DIVLConfig(lr=5e-3, ema_rate=0.1, adaptive_tau=False, tau_base_offline=0.6))
    else:
        learner = IQL(CRITIC, IQLConfig(lr=5e-3, ema_rate=0.1, expectile=0.9))
    for _ in range(150):
        metrics = learner.update(_bandit_batch())
    assert math.isfinite(metrics["loss_q"])
    obs = {"proprio": torch.ones(2, 2)}
    chunks = torch.tensor([0.5, -0.5]).view(2, 1, 1).expand(2, 2, 1)
    q = learner.q_values(obs, learner.net.normalize_actions(chunks), net="online")
    torch.testing.assert_close(q, torch.tensor([[1.0, 0.0], [1.0, 0.0]]), atol=0.05, rtol=0)
    v = learner.state_value(obs)
    if kind == "divl":
        # Half the replay actions are worth 1: the 0.6-quantile sits on the top mode.
        p = learner.value_distribution(obs)[0]
        atoms = learner.atoms
        assert p[(atoms - 0).abs() < 0.05].sum() > 0.3 and p[(atoms - 1).abs() < 0.05].sum() > 0.3
        assert v.tolist() == pytest.approx([1.0, 1.0], abs=0.05)
    else:
        # 0.9-expectile of {0, 1} with equal weights is 0.9.
        assert v.tolist() == pytest.approx([0.9, 0.9], abs=0.05)


# --- 7. the batched Q ensemble ----------------------------------------------------------
def _critic_config(num_q=2):
    return CriticConfig(features=state_features(5), action_dim=2, horizon=3, use_text=False, embed_dim=8,
                        hidden_dim=16, num_q=num_q)


def _per_head_layout(net):
    """``net``'s state dict as written before the batched ensemble: one ``mlp`` per head (``q_heads.{j}.{k}.*``)."""
    state = {}
    for key, value in net.state_dict().items():
        if key.startswith("q_heads."):
            for j in range(value.shape[0]):
                state[f"q_heads.{j}.{key[len('q_heads.'):]}"] = value[j].clone()
        else:
            state[key] = value.clone()
    return state


def _per_head_q(net, z, chunk):
    """Q (num_q, B) by a Python loop over per-head ``mlp`` modules loaded from the old layout."""
    state, heads = _per_head_layout(net), []
    for j in range(net.config.num_q):
        head = mlp([net.config.hidden_dim + chunk[0].numel(), net.config.hidden_dim, net.config.hidden_dim, 1],
                   layer_norm=True)
        head.load_state_dict({k[len(f"q_heads.{j}."):]: v for k, v in state.items() if k.startswith(f"q_heads.{j}.")})
        heads.append(head)
    inp = torch.cat([z, chunk.flatten(1)], -1)
    return torch.stack([h(inp).squeeze(-1) for h in heads])


@pytest.mark.parametrize("num_q", [2, 5])
def test_batched_q_ensemble_equals_the_per_head_loop(num_q):
    torch.manual_seed(0)
    net = CriticNet(_critic_config(num_q), 0)
    with torch.no_grad():  # LayerNorm affines away from their (1, 0) init, so they are checked too
        for p in net.q_heads.parameters():
            p.add_(0.2 * torch.randn_like(p))
    z, chunk = torch.randn(7, 16), torch.randn(7, 3, 2, requires_grad=True)
    q, want = net.q(z, chunk), _per_head_q(net, z, chunk)
    assert q.shape == (num_q, 7) and q.std(0).min() > 0  # heads differ
    torch.testing.assert_close(q, want, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(q.mean(0).sum(), chunk)
    (want_grad,) = torch.autograd.grad(want.mean(0).sum(), chunk)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_a_per_head_state_dict_and_its_optimizer_state_resume_exactly():
    """Checkpoints written before the batched ensemble: weights and Adam moments stack on load,
    and the next update matches the one the saving learner takes."""
    batch = {"obs": {"state": torch.randn(8, 5)}, "next_obs": {"state": torch.randn(8, 5)},
             "actions": torch.rand(8, 3, 2) * 2 - 1, "rewards": torch.rand(8), "discounts": torch.full((8,), 0.9)}
    torch.manual_seed(0)
    saved = DIVL(_critic_config())
    for _ in range(2):
        saved.update(batch)
    old_net, old_target = _per_head_layout(saved.net), _per_head_layout(saved.target)
    assert "q_heads.1.0.weight" in old_net and "q_heads.0.weight" not in old_net
    opt = saved.opt_q.state_dict()
    heads = [id(p) for p in saved.net.q_heads.parameters()]
    ids = [id(p) for p in saved.opt_q.param_groups[0]["params"]]
    start, count = ids.index(heads[0]), len(heads)
    old_state = {i: {k: v.clone() for k, v in opt["state"][i].items()} for i in range(start)}  # encoder: same indices
    for j in range(2):  # head j's copy of every stacked parameter, numbered as a per-head ModuleList's were
        for i in range(count):
            old_state[start + j * count + i] = {k: v[j].clone() if v.dim() else v.clone()
                                                for k, v in opt["state"][start + i].items()}
    old_opt = {"state": old_state, "param_groups": [{**opt["param_groups"][0], "params": list(range(start + 2 * count))}]}

    torch.manual_seed(1)
    resumed = DIVL(_critic_config())
    resumed.net.load_state_dict(old_net)
    resumed.target.load_state_dict(old_target)
    resumed.opt_q.load_state_dict(old_opt)
    resumed.opt_v.load_state_dict(copy.deepcopy(saved.opt_v.state_dict()))  # loading shares tensors; the saver goes on
    for a, b in zip(resumed.net.parameters(), saved.net.parameters()):
        assert torch.equal(a, b)
    saved.update(batch)
    resumed.update(batch)
    for a, b in zip(resumed.net.parameters(), saved.net.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="heads"):  # a head missing from an old-layout dict is named
        DIVL(_critic_config()).net.load_state_dict({k: v for k, v in old_net.items() if not k.startswith("q_heads.1.")})


@pytest.mark.parametrize("v_min,v_max", [(10.0, 10.0), (10.0, -10.0), (0.0, float("inf")), (float("nan"), 1.0)])
def test_a_value_support_without_width_is_refused(v_min, v_max):
    """Equal bounds trained to NaN losses and inverted ones to a negative cross-entropy, both published."""
    with pytest.raises(ValueError, match=r"algo.value.v_min=.* and algo.value.v_max=.*: the value support needs finite "
                                         "v_min < v_max"):
        DIVLConfig(v_min=v_min, v_max=v_max)
    with pytest.raises(ValueError, match="at least 2 atoms"):
        DIVLConfig(num_atoms=1)
