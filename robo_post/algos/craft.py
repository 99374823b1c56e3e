"""CRAFT: counterfactual-to-interactive reinforcement fine-tuning of a candidate-scoring policy (``algo=craft``).

A pre-trained policy scores K candidate futures at every visited state and executes
the chosen one's first action: a ``CandidatePolicy`` scores a fixed vocabulary of
discrete meta-action sequences; a ``ProposalPolicy`` (continuous actions) samples K
action chunks and scores each by its own log-likelihood, so that its ``pi(k|s)`` is
the candidate likelihood renormalised over the group. Either way the math below
sees K logits per state (``candidate_logits``). CRAFT fine-tunes the policy on-policy
with two learning signals and one anchor:

- a dense **proxy**: every candidate is scored counterfactually in an approximate
  model of the world, and the scores are normalised within the state's group;
- a sparse, grounded **residual**: short windows of event rewards from the real
  rollout correct the proxy on the executed candidate ``k*`` only;
- an **EMA teacher** started from the pre-trained policy, and a KL between student
  and teacher that keeps the student near reliable behaviour.

The equations, numbered as the code below refers to them (``pi`` the student,
``A`` the true closed-loop advantage, ``r~`` the counterfactual scores, ``e`` events):

(1) proxy advantage  ``A~_k = (r~_k - mean_j r~_j) / (std_j r~_j + eps)`` (population std per state);
(2) decomposition    ``sum_k grad pi_k A_k = sum_k grad pi_k A~_k + sum_k grad pi_k (A_k - A~_k)``:
    the proxy term is exact over all K candidates; sampling ``k* ~ pi`` turns the second
    into the expectation of ``grad log pi_k* (A_k* - A~_k*)``, so a proxy close to ``A``
    leaves little for this noisy one-sample term to carry;
(3) residual         ``G_t = sum_{j<W} gamma^j e_{t+j}`` and ``delta^_t = z(G_t) - A~_{t,k*}``
    (``cv``) or ``m_t z(G_t)`` (``event``), ``z`` the batch z-score, ``m_t`` "an event in the window";
    with ``baseline=evpo`` the grounded advantage in place of ``z(G)`` is ``G - V`` (a learned
    critic ``V``) when the critic's batch explained variance is above a threshold, else ``G - mean G``,
    scaled by its population std (EVPO: the lower-variance baseline of the two, per update);
(4) loss             ``L = L_proxy + lambda_res L_res + beta_sd L_SD`` with dual-clipped PPO
    surrogates on the ratios ``pi / pi_old`` (all candidates with ``A~``; ``k*`` with ``delta^``)
    and ``L_SD`` the student-teacher KL;
(5) teacher          ``theta_T <- m theta_T + (1 - m) theta`` after every optimiser step, no gradient.

The functions below are the math, one idea each, top to bottom; ``Craft`` composes
them into the registry's ``Method``. The env side (candidates, counterfactual scores,
events) and the on-policy loop belong to the driver.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import torch
from torch import nn

from robo_post.models.candidate_policy import CandidatePolicy, CandidatePolicyConfig
from robo_post.models.encoders import ObservationEncoder, mlp
from robo_post.models.proposal_policy import ProposalPolicy, ProposalPolicyConfig

RESIDUAL_MODES = ("cv", "event")
PROXY_WEIGHTS = ("uniform", "policy", "floor")
KL_DIRECTIONS = ("reverse", "forward")
KL_GATES = ("none", "nonpositive_adv")
BASELINES = ("batch", "evpo")
CANDIDATE_SOURCES = ("auto", "vocabulary", "proposals")
TRAINABLE = ("all", "head")

ScoringPolicy = CandidatePolicy | ProposalPolicy


MAX_LOG_RATIO = 20.0
"""Log-ratios ``log pi - log pi_old`` are capped here before ``exp`` (far inside every clip)."""


class CraftConfigError(ValueError):
    """A CRAFT setting outside its allowed values."""


class CraftBatchError(ValueError):
    """A CRAFT batch is missing an entry or has a state without any valid candidate."""


# --- (1) group-normalised proxy advantage -------------------------------------------------
def _centred_groups(scores: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(r~_k - mean_j r~_j)`` over each state's valid candidates (0 where invalid), the valid
    mask as floats and the count of valid candidates per state (B, 1).

    Raises:
        CraftBatchError: a state has no valid candidate.
    """
    valid = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    if not bool(valid.any(-1).all()):
        raise CraftBatchError("proxy advantages: a state has no valid candidate (mask row all False)")
    w = valid.to(scores.dtype)
    n = w.sum(-1, keepdim=True)
    # shifting by a member first is exact for a constant group (a rounded mean is not: its
    # tiny deviations over a tiny std would give advantages far from 0)
    shifted = (scores - scores.masked_fill(~valid, float("-inf")).amax(-1, keepdim=True)) * w
    return (shifted - shifted.sum(-1, keepdim=True) / n) * w, w, n


def group_advantages(scores: torch.Tensor, eps: float = 1e-5, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-state z-scores of the K candidates' counterfactual scores (B, K): ``proxy_norm=group``.

    ``A~_k = (r~_k - mean_j r~_j) / (std_j r~_j + eps)`` with the population std over the
    state's valid candidates (``mask`` (B, K) bool; all valid when ``None``). Invalid
    entries get 0. A constant group has zero deviation and so all-zero advantages.

    Raises:
        CraftBatchError: a state has no valid candidate.
    """
    centred, _, n = _centred_groups(scores, mask)
    std = (centred.pow(2).sum(-1, keepdim=True) / n).sqrt()
    return centred / (std + eps)


def batch_scaled_advantages(scores: torch.Tensor, eps: float = 1e-5, mask: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Per-state centred scores on one scale for the whole batch (B, K): ``proxy_norm=batch``.

    ``A~_k = (r~_k - mean_j r~_j) / (std_B + eps)``, ``std_B`` the population std of all
    valid centred entries of the batch. Each state's advantages still sum to 0 and the batch
    is still invariant to ``r~ -> a r~ + b`` (a > 0), but every state keeps its own spread:
    one where a candidate crashes weighs more than one whose candidates differ by a little
    speed, which the per-state z-score of ``group_advantages`` makes equally loud.

    Raises:
        CraftBatchError: a state has no valid candidate.
    """
    centred, w, _ = _centred_groups(scores, mask)
    std = (centred.pow(2).sum() / w.sum()).sqrt()
    return centred / (std + eps)


PROXY_NORMS = {"group": group_advantages, "batch": batch_scaled_advantages}
"""``proxy_norm`` option -> how a batch's counterfactual scores become proxy advantages."""


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``log pi(k|s)`` over the valid candidates (B, K); invalid entries read 0 (mask them out of any sum).

    Each row needs at least one valid candidate (the proxy advantages check the batch).
    """
    if mask is None:
        return logits.log_softmax(-1)
    # -inf keeps invalid probabilities exactly 0; zero-filling afterwards keeps every
    # difference of two log-probabilities finite (no inf - inf, no NaN gradient).
    return logits.masked_fill(~mask, float("-inf")).log_softmax(-1).masked_fill(~mask, 0.0)


def candidate_logits(policy: ScoringPolicy, obs: dict[str, Any], candidates: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The K candidate logits (B, K) of either policy kind, the input of every loss below.

    A ``CandidatePolicy`` scores its fixed vocabulary (``candidates`` is ``None``); a
    ``ProposalPolicy`` scores the stored proposals ``candidates`` (B, K, H, A) by their
    log-likelihood, whose softmax is the likelihood renormalised over the group.

    Raises:
        CraftBatchError: a proposal policy without candidates, or a vocabulary policy with some.
    """
    if isinstance(policy, ProposalPolicy):
        if candidates is None:
            raise CraftBatchError("a proposal policy's logits are its likelihoods of the batch's `candidates`; "
                                  "the batch has none")
        return policy.logits(obs, candidates)
    if candidates is not None:
        raise CraftBatchError("a vocabulary policy scores its own fixed vocabulary; the batch holds `candidates`")
    return policy.logits(obs)


# --- (4) dual-clipped surrogate and policy losses -------------------------------------------------------------
def dual_clip_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_clip: float = 0.2, dual_c: float = 3.0
                        ) -> torch.Tensor:
    """Per-element dual-clipped PPO surrogate (to be maximised).

    For ``A >= 0`` the PPO clip ``min(rho A, clip(rho, 1-eps, 1+eps) A)``; for ``A < 0`` that
    value floored at ``c A``, so a very large ratio on a bad candidate cannot make the
    surrogate (and its gradient) unbounded.
    """
    clipped = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv)
    return torch.where(adv >= 0, clipped, torch.maximum(clipped, dual_c * adv))


def policy_losses(logits: torch.Tensor, old_logits: torch.Tensor, proxy_adv: torch.Tensor, chosen: torch.Tensor,
                  delta: torch.Tensor, valid: torch.Tensor | None = None, eps_clip: float = 0.2, dual_c: float = 3.0,
                  proxy_weight: str = "uniform", floored: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two policy-gradient losses of (4) and the ratios ``rho = pi / pi_old`` (B, K).

    ``L_proxy`` is the negated dual-clipped surrogate of every valid candidate ``k`` with
    its proxy advantage; ``L_res`` that of the executed candidate ``chosen`` (B,) with the
    residual ``delta`` (B,), averaged over states. ``proxy_weight`` says how the K
    candidates of a state are combined in ``L_proxy``:

    - ``uniform``: the mean over all valid (state, candidate) pairs, as RIFT's loss. At
      ``rho = 1`` its gradient is ``sum_k grad log pi_k A~_k / K`` per state, which is *not*
      the proxy term ``sum_k grad pi_k A~_k`` of the decomposition (2).
    - ``policy``: per state ``sum_k pi_old(k) DC(rho_k, A~_k)``, averaged over states; at
      ``rho = 1`` its gradient is exactly ``sum_k grad pi_k A~_k``, so proxy plus residual
      (mode ``cv``) is the full-advantage policy gradient.
    - ``floor``: per state ``sum_k max(pi_old(k), 1/K) DC(rho_k, A~_k)``. With ``cv`` and
      ``lambda_res = 1`` the candidates the policy picks often follow the grounded return
      alone (as with ``policy``), and only those it picks less than ``1/K`` of the time, which
      the residual hardly ever samples, are pushed by the proxy, by ``(1/K - pi_k) A~_k``.
      ``floored`` (B,) bool keeps the floor to those states (``policy`` weights elsewhere).
    """
    if proxy_weight not in PROXY_WEIGHTS:
        raise CraftConfigError(f"craft proxy_weight {proxy_weight!r}; choose one of {PROXY_WEIGHTS}")
    old_log_p = masked_log_softmax(old_logits, valid)
    # beyond e^20 every surrogate is clipped (gradient 0) anyway; an inf ratio would turn that 0 into NaN
    ratio = (masked_log_softmax(logits, valid) - old_log_p).clamp(max=MAX_LOG_RATIO).exp()
    surrogate = dual_clip_surrogate(ratio, proxy_adv, eps_clip, dual_c)
    w = torch.ones_like(ratio) if valid is None else valid.to(ratio.dtype)
    if proxy_weight == "policy":
        proxy_loss = -(w * old_log_p.exp() * surrogate).sum(-1).mean()
    elif proxy_weight == "floor":
        floor = 1.0 / w.sum(-1, keepdim=True).clamp(min=1.0)  # 1/K over each state's valid candidates
        if floored is not None:
            floor = floor * floored.to(floor.dtype)[:, None]
        proxy_loss = -(w * torch.maximum(old_log_p.exp(), floor) * surrogate).sum(-1).mean()
    else:
        proxy_loss = -(surrogate * w).sum() / w.sum()
    executed = ratio.gather(-1, chosen.long()[:, None])[:, 0]
    residual_loss = -dual_clip_surrogate(executed, delta, eps_clip, dual_c).mean()
    return proxy_loss, residual_loss, ratio


def guard_targets(scores: torch.Tensor, old_logits: torch.Tensor, tau: float, margin: float, danger: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The guard term's critical states (B,) bool and the targets of all states (B, K).

    Critical: the proxy scores the acting policy's first choice (``argmax old_logits``) below
    ``danger`` and its best candidate more than ``margin`` above it. There the target is the
    acting policy moved toward the proxy, ``softmax(log pi_old + (r~ - mean r~) / tau)`` (at a
    small ``tau`` nearly all mass on the best candidates, the policy's own order among near
    ties); elsewhere the acting policy itself, which keeps the push from spreading to the
    states that do not call for it.
    """
    first = scores.gather(-1, old_logits.argmax(-1, keepdim=True))[:, 0]
    critical = (first < danger) & (scores.max(-1).values - first > margin)
    centred = scores - scores.mean(-1, keepdim=True)
    moved = (old_logits.log_softmax(-1) + centred / tau).softmax(-1)
    return critical, torch.where(critical[:, None], moved, old_logits.softmax(-1))


def veto_targets(scores: torch.Tensor, logits: torch.Tensor, danger: float, margin: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The vetoed candidates (B, K) bool and the targets (B, K) of ``veto_updates``: the policy's
    own distribution without the candidates the proxy predicts to go wrong, those scoring below
    ``danger`` and more than ``margin`` below the state's best, renormalised. The policy's order
    among the others stays, so it is not pushed toward what the proxy prefers (speed) elsewhere;
    the best candidate is never vetoed."""
    vetoed = (scores < danger) & (scores < scores.max(-1, keepdim=True).values - margin)
    kept = logits.softmax(-1) * (~vetoed).to(logits.dtype)
    return vetoed, kept / kept.sum(-1, keepdim=True).clamp(min=torch.finfo(kept.dtype).tiny)


# --- KL between two distributions over the candidates --------------------------------------
def categorical_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact ``KL(p || q) = sum_k p_k (log p_k - log q_k)`` per state (B,), over the valid candidates."""
    log_p, log_q = masked_log_softmax(p_logits, mask), masked_log_softmax(q_logits, mask)
    p = log_p.exp() if mask is None else log_p.exp() * mask
    return (p * (log_p - log_q)).sum(-1)


# --- (3) grounded residual --------------------------------------------------------------------
def event_returns(events: torch.Tensor, gamma: float, window: int) -> torch.Tensor:
    """Short-window discounted event return of one episode, ``G_t = sum_{j<W} gamma^j e_{t+j}`` (T,).

    The window is truncated at the episode's end (no event is borrowed from another episode).
    """
    if window < 1:
        raise CraftConfigError(f"craft window must be >= 1, got {window}")
    e = torch.as_tensor(events, dtype=torch.float32)
    out = torch.zeros_like(e)
    for j in range(min(window, e.shape[0])):
        out[: e.shape[0] - j] += gamma ** j * e[j:]
    return out


def event_mask(events: torch.Tensor, window: int) -> torch.Tensor:
    """``m_t = 1[an event (e != 0) in steps [t, t+W)]`` of one episode (T,) bool, truncated at its end."""
    hit = torch.as_tensor(events) != 0
    out = torch.zeros_like(hit)
    for j in range(min(window, hit.shape[0])):
        out[: hit.shape[0] - j] |= hit[j:]
    return out


def batch_centre(x: torch.Tensor) -> torch.Tensor:
    """``x - mean(x)`` over the whole batch; exact zeros for a constant batch."""
    shifted = x - x.reshape(-1)[0]  # exact zeros for a constant batch (see group_advantages)
    return shifted - shifted.mean()


def batch_zscore(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the whole batch (population std); all zeros for a constant batch."""
    centred = batch_centre(x)
    return centred / (centred.pow(2).mean().sqrt() + eps)


# --- (3') EVPO: the grounded advantage's baseline, chosen per update ---------------------------
def explained_variance(G: torch.Tensor, V: torch.Tensor) -> float:
    """Batch explained variance of the critic ``V`` for the targets ``G``: ``1 - Var_B(G - V) / Var_B(G)``.

    Population variances, in float64; ``nan`` when ``Var_B(G) = 0`` (as Stable-Baselines3's
    ``explained_variance``). Computed as ``(2 Cov(G, V) - Var(V)) / Var(G)``, the same value, so
    that a constant ``V`` gives exactly 0 and ``V = G`` exactly 1 (no rounding across the tie).
    """
    g, v = batch_centre(G.double().reshape(-1)), batch_centre(V.double().reshape(-1))
    var_g = g.pow(2).mean()
    if var_g == 0:
        return math.nan
    return float((2.0 * (g * v).mean() - v.pow(2).mean()) / var_g)


def evpo_advantages(G: torch.Tensor, V: torch.Tensor, threshold: float = 0.0
                    ) -> tuple[torch.Tensor, float, bool]:
    """EVPO's hard gate: ``(advantages, ev, use_critic)``.

    ``G - V`` (critic baseline) when ``ev > threshold``, else ``G - mean(G)`` (batch mean);
    a tie or an undefined ``ev`` (constant ``G``) takes the batch mean, whose advantages are
    then all 0. With population variances ``Var_B(G - mean G) = Var_B(G)``, so at threshold 0
    the gate picks exactly the baseline with the lower batch variance.
    """
    ev = explained_variance(G, V)
    use_critic = not math.isnan(ev) and ev > threshold
    adv = G - V.to(G.dtype) if use_critic else batch_centre(G)
    return adv, ev, use_critic


def scale_advantages(adv: torch.Tensor, centred: bool, eps: float = 1e-5) -> torch.Tensor:
    """``adv / (std_B(adv) + eps)`` (population std) without re-centring ``adv``.

    ``centred``: ``adv`` is ``batch_centre`` of the targets (the batch-mean baseline), whose std is
    its root mean square: the arithmetic of ``batch_zscore``, so that branch is bit for bit
    ``z(G)``. Otherwise (``G - V``) the std is taken about ``adv``'s own mean but the mean stays:
    subtracting it would put the batch mean back in place of the critic's baseline.
    """
    spread = adv if centred else batch_centre(adv)
    return adv / (spread.pow(2).mean().sqrt() + eps)


def grounded_advantage(G: torch.Tensor, V: torch.Tensor | None = None, threshold: float = 0.0,
                       eps: float = 1e-5) -> tuple[torch.Tensor, float, bool]:
    """The scaled grounded advantage of the executed candidates (B,), ``ev`` and ``use_critic``.

    Without a critic (``V`` is ``None``, ``baseline=batch``): ``z(G)``, ``nan``, ``False``.
    With one (``baseline=evpo``): ``evpo_advantages`` scaled by ``scale_advantages``.
    """
    G = G.float()
    if V is None:
        return batch_zscore(G, eps), math.nan, False
    adv, ev, use_critic = evpo_advantages(G, V.float(), threshold)
    return scale_advantages(adv, not use_critic, eps), ev, use_critic


def residual(advantage: torch.Tensor, proxy_adv_executed: torch.Tensor, mode: str = "cv",
             event_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The residual estimate ``delta^_t`` on the executed candidate (B,).

    ``advantage`` (B,), the scaled grounded advantage of ``grounded_advantage`` (``z(G)`` with
    the batch-mean baseline), stands in for the true advantage of ``k*``. Mode ``cv``
    (control variate): ``advantage - A~_{k*}``, the part of the true advantage the proxy
    missed. Mode ``event``: ``m * advantage``, the grounded signal only on states with an
    interaction-critical event in the window (``event_mask``).
    """
    if mode == "cv":
        return advantage - proxy_adv_executed.to(advantage.dtype)
    if mode == "event":
        if event_mask is None:
            raise CraftConfigError("craft residual_mode='event' needs event_mask")
        return event_mask.to(advantage.dtype) * advantage
    raise CraftConfigError(f"craft residual_mode {mode!r}; choose one of {RESIDUAL_MODES}")


def residual_for_batch(advantage: torch.Tensor, proxy_adv: torch.Tensor, chosen: torch.Tensor, mode: str = "cv",
                       event_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``residual`` from the full proxy advantages (B, K) and the executed indices ``chosen`` (B,)."""
    executed = proxy_adv.gather(-1, chosen.long()[:, None])[:, 0]
    return residual(advantage, executed, mode, event_mask)


# --- EVPO's critic ---------------------------------------------------------------------------
class WindowValue(nn.Module):
    """EVPO's critic: a state's expected event-window return ``V(s) ~ E[G_t | s_t = s]``.

    The policy's observation encoder and MLP widths (either kind) with its own weights and
    a one-output head; ``for_policy`` copies the policy's state statistics, so both read
    the same standardised state.
    """

    def __init__(self, config: CandidatePolicyConfig | ProposalPolicyConfig):
        super().__init__()
        self.encoder = ObservationEncoder(config.features, config.use_text, config.embed_dim, config.hidden_dim)
        self.head = mlp([config.hidden_dim, config.hidden_dim, 1])

    @classmethod
    def for_policy(cls, policy: ScoringPolicy) -> "WindowValue":
        """A fresh critic for ``policy``'s observations, on its device."""
        critic = cls(policy.config).to(policy.device)
        critic.encoder.state_mean.copy_(policy.encoder.state_mean)
        critic.encoder.state_std.copy_(policy.encoder.state_std)
        return critic

    def forward(self, obs: dict[str, Any]) -> torch.Tensor:
        """Values (B,) at a batch of observations."""
        return self.head(self.encoder(obs))[:, 0]


# --- (5) EMA teacher --------------------------------------------------------------------------
class EMATeacher(nn.Module):
    """A frozen copy of the pre-trained policy that trails the student: ``theta_T <- m theta_T + (1-m) theta``.

    Starts bitwise equal to the policy it is built from; its parameters never take a
    gradient. Buffers (state statistics) stay the pre-trained ones.
    """

    def __init__(self, policy: ScoringPolicy):
        super().__init__()
        self.policy = copy.deepcopy(policy).requires_grad_(False).eval()

    def logits(self, obs: dict[str, Any], candidates: torch.Tensor | None = None) -> torch.Tensor:
        """The teacher's candidate logits (B, K) (``candidates``: see ``candidate_logits``)."""
        return candidate_logits(self.policy, obs, candidates)

    @torch.no_grad()
    def update(self, student: nn.Module, m: float) -> None:
        """One EMA step toward ``student`` (same architecture); ``m = 1`` leaves the teacher as is."""
        if not 0.0 <= m <= 1.0:
            raise CraftConfigError(f"craft ema_m must be in [0, 1], got {m}")
        # lerp: theta_T + (1-m)(theta - theta_T) == m theta_T + (1-m) theta, one fused kernel
        torch._foreach_lerp_(list(self.policy.parameters()), list(student.parameters()), 1.0 - m)


# --- behaviour-cloning pretraining -------------------------------------------------------------
def bc_loss(policy: CandidatePolicy, obs: dict[str, Any], target_index: torch.Tensor,
            label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of the candidate indices ``target_index`` (B,) under the policy; with
    ``label_smoothing`` the target keeps that much mass spread over all candidates (a less peaked
    policy, whose low-probability candidates the clipped on-policy update can still raise)."""
    logits = policy.logits(obs)
    return torch.nn.functional.cross_entropy(logits, target_index.to(logits.device).long(),
                                             label_smoothing=label_smoothing)


def take_rows(tree: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """Rows ``index`` of every entry of a batch dict (tensors, nested dicts, lists such as instructions)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = take_rows(value, index)
        elif isinstance(value, torch.Tensor):
            out[key] = value[index.to(value.device)]
        else:
            out[key] = [value[i] for i in index.tolist()]
    return out


def minibatch_indices(n: int, size: int, epochs: int, generator: torch.Generator | None = None
                      ) -> Iterator[torch.Tensor]:
    """``epochs`` shuffled passes over ``n`` rows in minibatches of at most ``size``."""
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        yield from order.split(size)


def fit_minibatches(policy: nn.Module, n: int, loss_of: Any, updates: int, lr: float, minibatch: int,
                    grad_clip: float, generator: torch.Generator | None) -> None:
    """``updates`` AdamW steps of ``loss_of(index)`` on shuffled minibatches of ``n`` rows; ``policy`` ends in eval mode."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    policy.train()
    steps = 0
    while steps < updates:
        for index in minibatch_indices(n, minibatch, 1, generator):
            if steps == updates:
                break
            loss = loss_of(index)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
            optimizer.step()
            steps += 1
    policy.eval()


def bc_pretrain(policy: CandidatePolicy, obs: dict[str, Any], target_index: torch.Tensor, updates: int,
                lr: float = 1e-3, minibatch: int = 256, grad_clip: float = 1.0,
                generator: torch.Generator | None = None, label_smoothing: float = 0.0) -> dict[str, float]:
    """Behaviour-clone candidate indices into ``policy`` in place (``updates`` AdamW steps).

    Returns the final ``loss`` and the ``accuracy`` of the argmax over the whole set.
    """
    fit_minibatches(policy, int(target_index.shape[0]),
                    lambda index: bc_loss(policy, take_rows(obs, index), target_index[index], label_smoothing),
                    updates, lr, minibatch, grad_clip, generator)
    with torch.no_grad():
        logits = policy.logits(obs)
        target = target_index.to(logits.device).long()
        accuracy = (logits.argmax(-1) == target).float().mean()
        final = -logits.log_softmax(-1).gather(-1, target[:, None]).mean()
    return {"loss": float(final), "accuracy": float(accuracy)}


def chunk_bc_pretrain(policy: ProposalPolicy, obs: dict[str, Any], chunks: torch.Tensor, updates: int,
                      lr: float = 1e-3, minibatch: int = 256, grad_clip: float = 1.0,
                      generator: torch.Generator | None = None) -> dict[str, float]:
    """Maximum-likelihood behaviour cloning of action chunks (B, H, A) into a proposal policy, in place.

    Returns the final ``nll`` (mean Gaussian negative log-likelihood per action entry, in
    normalised units) and the ``mae`` of the mean chunk (env units) over the whole set.
    """
    fit_minibatches(policy, int(chunks.shape[0]), lambda index: policy.nll(take_rows(obs, index), chunks[index]),
                    updates, lr, minibatch, grad_clip, generator)
    with torch.no_grad():
        mean, _ = policy.distribution(obs)
        mae = (policy.unnormalize_actions(mean) - chunks.to(mean.device)).abs().mean()
        return {"nll": float(policy.nll(obs, chunks)), "mae": float(mae)}


# --- the method -------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    """A real number from a config (a bool or a string is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class CraftConfig:
    """CRAFT's hyperparameters.

    Attributes:
        eps_clip / dual_c: PPO clip range ``[1-eps, 1+eps]`` and the dual-clip floor ``c A`` (c > 1).
        ema_m: teacher momentum in [0, 1] (1 freezes the teacher at the pre-trained policy).
        beta_sd: weight of the student-teacher KL.
        lambda_res: weight of the residual loss (4 measured against 1, at which the proxy's
            pull towards speed, and the crashes that follow it, stayed uncorrected; docs/results.md).
            In mode ``cv`` the expected weight of ``A~_k`` in the update is ``w_k - lambda_res pi_k``
            (``w_k``: ``1/K`` uniform, ``pi_k`` policy): 0 for ``policy`` at 1 (REINFORCE on ``z(G)``,
            the proxy a control variate), negative for every candidate with ``pi_k > 1/(lambda_res K)``
            at the default ``uniform`` and 4 (docs/craft.md, "What the update follows on average").
        residual_mode: ``cv`` (control variate ``z(G) - A~_{k*}``) or ``event`` (``m z(G)``);
            with ``use_proxy`` off there is no proxy to correct: mode ``cv`` uses ``z(G)`` itself.
        baseline: the grounded advantage's baseline. ``batch``: the batch mean (``z(G)``,
            value-free). ``evpo``: a learned critic ``WindowValue`` of ``G``, used in place of
            the batch mean in an update only when its batch explained variance exceeds
            ``evpo_threshold``; the critic trains (MSE on ``G``) in every update either way.
        evpo_threshold: the explained variance the critic must exceed (0: it must beat the batch mean).
        kl_direction: ``reverse`` = KL(student || teacher) (mode-seeking: penalises mass the
            teacher lacks) or ``forward`` = KL(teacher || student).
        kl_gate: ``none`` applies the KL on every state. ``nonpositive_adv`` reads
            "asymmetric" as sign-dependent: the KL acts only on states whose executed
            candidate's advantage estimate (the proxy ``A~_{k*}`` plus the residual
            ``delta^``, each when its term is used) is <= 0, so the student may move freely
            where its own choice proved better and is held to the teacher elsewhere; the
            KL term stays a mean over all states (gated states count 0).
        proxy_norm: how counterfactual scores become proxy advantages: ``group`` (RIFT's
            per-state z-score, ``group_advantages``) or ``batch`` (per-state centring over one
            scale for the batch, ``batch_scaled_advantages``: states keep their own spread).
        proxy_weight: ``uniform`` (RIFT's mean over all candidates),
            ``policy`` (candidates weighted by ``pi_old``, the exact proxy term of the
            decomposition (2)) or ``floor`` (weighted by ``max(pi_old, 1/K)``: with ``cv``
            and ``lambda_res = 1`` the proxy's net push reaches only the candidates the
            policy rarely samples); see ``policy_losses``.
        floor_margin: with ``floor``, apply the floor only in states where the proxy's best
            candidate scores more than this above the acting policy's first choice, in the
            proxy's units (a predicted crash or TTC breach the policy heads into); ``policy``
            weights elsewhere. ``None``: every state.
        guard_weight: weight of the guard term (0: off; it needs ``use_proxy``): cross-entropy on
            every state recorded so far, all iterations' (``guard_targets``): toward
            ``softmax(log pi_old + (r~ - mean r~) / guard_tau)`` where the state is critical, toward
            the acting policy ``pi_old`` elsewhere. A state is critical when the proxy scores the
            acting policy's first choice below ``guard_danger`` and its best candidate more than
            ``guard_margin`` above it. The way out of such states (a lane change out of a blocked
            lane) is a few percent of the on-policy states, too rare for the clipped terms to
            raise a candidate the policy gives 5% to (docs/craft.md).
        guard_tau / guard_margin / guard_danger: that target's temperature and the critical
            states' thresholds, in the proxy's units.
        veto_updates: steps of a last fit before the final version is published (0: none): the
            student moved, on every state the run recorded, toward its own distribution without
            the candidates the proxy predicts to go wrong (``veto_targets``: scoring below
            ``veto_danger`` and more than ``veto_margin`` below the state's best); cross-entropy,
            ``bc_lr`` and ``bc_minibatch``. It uses only the recorded scores: no more episodes.
        veto_danger / veto_margin: those thresholds, in the proxy's units.
        veto_acting: fit each iteration's acting version the same way too (from the second
            iteration, on the states recorded so far), so the fleet samples from the vetoed
            policy and the run records the states it visits; the update's ratios are taken
            against the logits it acted with. Needs ``veto_updates > 0``.
        use_proxy / use_residual: the two policy-gradient terms (ablations: proxy only, residual only).
        gamma_event / window: discount and window W of the event returns.
        adv_eps: epsilon of the group and batch normalisations.
        lr / weight_decay / grad_clip: AdamW and the max global gradient norm.
        trainable: ``all`` fine-tunes every weight; ``head`` only the scoring head, with the
            observation encoder frozen at the pre-trained policy's (RIFT trains only its planner's
            scoring head), so the update reweighs the pre-trained features instead of reshaping them.
        epochs / minibatch: passes and minibatch size over one on-policy batch (``Craft.fit``).
        target_kl: stop a batch's passes after the first step whose KL(acting policy || student)
            over the candidates exceeds this (``None``: always all ``epochs``); a trust region for
            a proposal policy, whose renormalised likelihoods move fast with its mean.
        reference_version: registry version of the pre-trained policy to fine-tune;
            ``None``: the driver pre-trains a fresh one (``bc_pretrain``, ``chunk_bc_pretrain``).
        candidates: where the K candidates come from. ``vocabulary``: the env registry's fixed
            vocabulary of discrete meta-action sequences, scored by a ``CandidatePolicy``;
            ``proposals``: K action chunks sampled by a ``ProposalPolicy`` (a continuous
            action space); ``auto``: the vocabulary when the env has one, else proposals.
        n_proposals / horizon / min_std: a proposal policy's K (>= 2), chunk length H
            (``None``: the env registry's ``horizon``) and std floor in normalised units (> 0).
        bc_updates / bc_lr / bc_minibatch: that behaviour-cloning pretraining.
        bc_label_smoothing: target mass spread over all candidates in pretraining (0: one-hot;
            0.2 leaves every candidate enough probability for the clipped updates to raise it).
        model: ``CandidatePolicyConfig`` settings for a fresh policy (``embed_dim``, ``hidden_dim``).
        env / env_kwargs: the env the fleet runs (``None``: the store's) and constructor keywords
            over those the store's episodes were recorded with.
        iterations / episodes_per_iteration / n_clients: the on-policy loop: versions trained,
            episodes each version runs before its update, parallel client processes.
        explore_eps: share of each on-policy choice given to the proxy's best candidate (0: sample
            the policy alone). The clients record the logits of that mixture, so every ratio of
            the update is ``pi / mu`` against the distribution that chose, and its clip bounds a
            rarely chosen candidate by ``(1 + eps_clip) mu`` instead of ``(1 + eps_clip) pi_old``.
        explore_margin: explore only in states where the proxy's best candidate scores more than
            this above the policy's first choice, in the proxy's units (``None``: every state).
        oracle: also score the candidates in exact (reactive) clones, to measure the proxy's
            bias (the proxy-oracle advantage correlation; doubles the counterfactual cost).
        online_store: where the fleet records on-policy episodes (``None``: ``<store>-online``).
        event_weights: reward of each entry of the env's per-step ``events`` (crash, TTC breach,
            progress, off the rightmost lane, blocked); negatively weighted entries are the interaction-critical events of
            ``residual_mode=event``'s mask.
    """

    eps_clip: float = 0.2
    dual_c: float = 3.0
    ema_m: float = 0.99
    beta_sd: float = 0.05
    lambda_res: float = 4.0
    residual_mode: str = "cv"
    baseline: str = "batch"
    evpo_threshold: float = 0.0
    kl_direction: str = "reverse"
    kl_gate: str = "none"
    proxy_norm: str = "group"
    proxy_weight: str = "uniform"
    use_proxy: bool = True
    use_residual: bool = True
    gamma_event: float = 0.9
    window: int = 3
    adv_eps: float = 1e-5
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    trainable: str = "all"
    epochs: int = 8
    minibatch: int = 64
    target_kl: float | None = None
    reference_version: int | None = None
    candidates: str = "auto"
    n_proposals: int = 8
    horizon: int | None = None
    min_std: float = 0.1
    bc_updates: int = 2000
    bc_lr: float = 1e-3
    bc_minibatch: int = 256
    bc_label_smoothing: float = 0.2
    model: dict[str, Any] = field(default_factory=dict)
    env: str | None = None
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    iterations: int = 8
    episodes_per_iteration: int = 8
    n_clients: int = 2
    explore_eps: float = 0.0
    explore_margin: float | None = None
    floor_margin: float | None = None
    guard_weight: float = 0.0
    guard_tau: float = 0.02
    guard_margin: float = 0.3
    guard_danger: float = 0.0
    veto_updates: int = 0
    veto_danger: float = -0.5
    veto_margin: float = 0.3
    veto_acting: bool = False
    oracle: bool = False
    online_store: str | None = None
    event_weights: list[float] = field(default_factory=lambda: [-1.0, -0.3, 0.0, 0.0, 0.0])

    def __post_init__(self):
        for name, value, choices in (("residual_mode", self.residual_mode, RESIDUAL_MODES),
                                     ("kl_direction", self.kl_direction, KL_DIRECTIONS),
                                     ("kl_gate", self.kl_gate, KL_GATES),
                                     ("proxy_norm", self.proxy_norm, tuple(PROXY_NORMS)),
                                     ("proxy_weight", self.proxy_weight, PROXY_WEIGHTS),
                                     ("baseline", self.baseline, BASELINES),
                                     ("candidates", self.candidates, CANDIDATE_SOURCES),
                                     ("trainable", self.trainable, TRAINABLE)):
            if value not in choices:
                raise CraftConfigError(f"craft {name}={value!r}; choose one of {choices}")
        if not (self.use_proxy or self.use_residual):
            raise CraftConfigError("craft use_proxy and use_residual are both off: no policy-gradient term left")
        # a NaN passes every comparison below and would only surface as NaN losses after a published version
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and not (_is_number(value) and math.isfinite(value)):
                raise CraftConfigError(f"craft {f.name} must be a finite number, got {value!r}")
        if not (isinstance(self.event_weights, (list, tuple))
                and all(_is_number(w) and math.isfinite(w) for w in self.event_weights)):
            raise CraftConfigError(f"craft event_weights must be a list of finite numbers, one per event, "
                                   f"got {self.event_weights!r}")
        if not 0.0 < self.eps_clip < 1.0:
            raise CraftConfigError(f"craft eps_clip must be in (0, 1), got {self.eps_clip}")
        if math.isnan(self.evpo_threshold):
            raise CraftConfigError("craft evpo_threshold is NaN; give a number (0: the critic must beat the mean)")
        if self.dual_c <= 1.0:
            raise CraftConfigError(f"craft dual_c must be > 1, got {self.dual_c}")
        if not 0.0 <= self.ema_m <= 1.0:
            raise CraftConfigError(f"craft ema_m must be in [0, 1], got {self.ema_m}")
        for name in ("beta_sd", "lambda_res"):
            if getattr(self, name) < 0:
                raise CraftConfigError(f"craft {name} must be >= 0, got {getattr(self, name)}")
        for name in ("window", "epochs", "minibatch", "bc_minibatch", "episodes_per_iteration", "n_clients"):
            if getattr(self, name) < 1:
                raise CraftConfigError(f"craft {name} must be >= 1, got {getattr(self, name)}")
        if self.iterations < 0:  # 0: the pretrained policy is the final one
            raise CraftConfigError(f"craft iterations must be >= 0, got {self.iterations}")
        if self.target_kl is not None and not self.target_kl > 0:
            raise CraftConfigError(f"craft target_kl must be > 0 or null, got {self.target_kl}")
        if self.n_proposals < 2:
            raise CraftConfigError(f"craft n_proposals must be >= 2 (a group to choose from), got {self.n_proposals}")
        if self.horizon is not None and self.horizon < 1:
            raise CraftConfigError(f"craft horizon must be >= 1 or null (the env's), got {self.horizon}")
        if not 0.0 <= self.explore_eps < 1.0:
            raise CraftConfigError(f"craft explore_eps must be in [0, 1), got {self.explore_eps}")
        if not 0.0 <= self.gamma_event <= 1.0:
            raise CraftConfigError(f"craft gamma_event is a discount in [0, 1], got {self.gamma_event}")
        if not 0.0 <= self.bc_label_smoothing < 1.0:
            raise CraftConfigError(f"craft bc_label_smoothing must be in [0, 1), got {self.bc_label_smoothing}")
        if self.bc_updates < 1:
            raise CraftConfigError(f"craft bc_updates must be >= 1 (the pretraining of a fresh policy), "
                                   f"got {self.bc_updates}")
        for name in ("explore_margin", "floor_margin"):
            margin = getattr(self, name)
            if margin is not None and not (_is_number(margin) and math.isfinite(margin) and margin >= 0):
                raise CraftConfigError(f"craft {name} must be a number >= 0 (proxy units above the policy's first "
                                       f"choice) or null, got {margin!r}")
        if self.floor_margin is not None and self.proxy_weight != "floor":
            raise CraftConfigError(f"craft floor_margin={self.floor_margin} limits proxy_weight=floor, but "
                                   f"proxy_weight is {self.proxy_weight!r}")
        if not self.min_std > 0:
            raise CraftConfigError(f"craft min_std must be > 0, got {self.min_std}")
        if not (_is_number(self.guard_weight) and math.isfinite(self.guard_weight) and self.guard_weight >= 0):
            raise CraftConfigError(f"craft guard_weight must be a number >= 0 (0: off), got {self.guard_weight!r}")
        if self.guard_weight > 0 and not self.use_proxy:
            raise CraftConfigError("craft guard_weight > 0 distils the proxy's scores: it needs use_proxy=true")
        if not (_is_number(self.guard_tau) and math.isfinite(self.guard_tau) and self.guard_tau > 0):
            raise CraftConfigError(f"craft guard_tau must be a number > 0, got {self.guard_tau!r}")
        if self.veto_updates < 0:
            raise CraftConfigError(f"craft veto_updates must be >= 0 (0: none), got {self.veto_updates}")
        if self.veto_acting and self.veto_updates == 0:
            raise CraftConfigError("craft veto_acting fits the acting versions for veto_updates steps: it needs "
                                   "veto_updates > 0")
        if self.veto_updates > 0 and not self.use_proxy:
            raise CraftConfigError("craft veto_updates > 0 reads the proxy's scores: it needs use_proxy=true")
        for name in ("guard_margin", "guard_danger", "veto_margin", "veto_danger"):
            value = getattr(self, name)
            margin = name.endswith("margin")
            if not (_is_number(value) and math.isfinite(value)) or (margin and value < 0):
                raise CraftConfigError(f"craft {name} must be a finite number{' >= 0' * margin} "
                                       f"(proxy units), got {value!r}")


BATCH_KEYS = ("obs", "proxy_adv", "chosen", "old_logits", "delta")  # + "candidates" for a proposal policy
CRITIC_KEYS = ("event_return",)  # the critic's regression target, in batches of ``baseline=evpo``


class Craft:
    """Student, EMA teacher and optimiser; ``update(batch)`` is one gradient step of the loss (4).

    Built from a pre-trained ``CandidatePolicy`` or ``ProposalPolicy``: the student is a
    copy of it (the reference is left untouched), the teacher an ``EMATeacher`` of it. With
    ``baseline=evpo`` also a critic ``WindowValue`` with its own optimiser (``critic``
    in ``modules`` and ``optimizers``, so checkpoints carry it).

    Args:
        config: hyperparameters.
        reference: the pre-trained policy.
        device: where the networks live.
    """

    def __init__(self, config: CraftConfig, reference: ScoringPolicy, device: str | torch.device = "cpu"):
        self.config = config
        self.policy = copy.deepcopy(reference).to(device).requires_grad_(True)
        if config.trainable == "head":
            self.policy.encoder.requires_grad_(False)
        self.teacher = EMATeacher(self.policy)
        trained = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
        self.critic: WindowValue | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if config.baseline == "evpo":
            self.critic = WindowValue.for_policy(self.policy)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=config.lr,
                                                      weight_decay=config.weight_decay)

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The networks a checkpoint saves, by name."""
        critic = {"critic": self.critic} if self.critic is not None else {}
        return {"policy": self.policy, "teacher": self.teacher} | critic

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimisers a checkpoint saves, by name."""
        critic = {"critic": self.critic_optimizer} if self.critic_optimizer is not None else {}
        return {"policy": self.optimizer} | critic

    def _critic(self) -> tuple[WindowValue, torch.optim.Optimizer]:
        if self.critic is None or self.critic_optimizer is None:
            raise CraftConfigError(f"craft baseline={self.config.baseline!r} has no critic; it needs baseline='evpo'")
        return self.critic, self.critic_optimizer

    @torch.no_grad()
    def values(self, obs: dict[str, Any]) -> torch.Tensor:
        """The critic's values (B,) at a batch of observations, on the CPU (no gradient).

        Raises:
            CraftConfigError: the method has no critic (``baseline`` is not ``evpo``).
        """
        critic, _ = self._critic()
        critic.eval()
        return critic(obs).float().cpu()

    def artifact(self, policy: ScoringPolicy | None = None, **provenance: Any
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The student (or ``policy``, e.g. a copy of it fitted further) as an artifact of its kind
        (``candidate`` or ``proposal``)."""
        return (self.policy if policy is None else policy).artifact(**{"algorithm": "craft", **provenance})

    def teacher_kl(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """KL between student and teacher per state (B,) in the configured direction."""
        if self.config.kl_direction == "reverse":
            return categorical_kl(student_logits, teacher_logits, mask)
        return categorical_kl(teacher_logits, student_logits, mask)

    def update(self, batch: dict[str, Any], guard: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """One step of ``L = L_proxy + lambda_res L_res + beta_sd L_SD``, then one EMA step of the teacher.

        ``batch``: ``obs`` (model inputs), ``proxy_adv`` (B, K) group advantages, ``chosen``
        (B,) executed indices, ``old_logits`` (B, K) of the acting policy, ``delta`` (B,)
        residuals (computed over the whole on-policy batch before minibatching), optional
        ``valid`` (B, K) bool candidate mask; for a proposal policy ``candidates`` (B, K, H, A),
        the proposals the acting policy sampled, which student and teacher score by their
        likelihoods (``candidate_logits``); with a critic also ``event_return`` (B,), the
        ``G`` its MSE loss regresses on. The critic takes its own step on the same minibatch
        whichever baseline the residual used (its loss reads neither ``delta`` nor the gate).
        Metrics are 0-d detached tensors (``value_loss`` with a critic).
        """
        needed = BATCH_KEYS + (CRITIC_KEYS if self.critic is not None else ())
        missing = [k for k in needed if k not in batch]
        if missing:
            raise CraftBatchError(f"craft batch lacks {missing}; it needs {list(needed)} (+ optional 'valid')")
        c, device = self.config, self.policy.device
        valid = batch.get("valid")
        valid = None if valid is None else valid.to(device, torch.bool)
        proxy_adv = batch["proxy_adv"].to(device).float()
        chosen = batch["chosen"].to(device).long()
        delta = batch["delta"].to(device).float()
        old_logits = batch["old_logits"].to(device).float()

        candidates = batch.get("candidates")
        self.policy.train()
        logits = candidate_logits(self.policy, batch["obs"], candidates)
        with torch.no_grad():
            teacher_logits = self.teacher.logits(batch["obs"], candidates)
        floored = batch.get("floored")
        proxy_loss, residual_loss, ratio = policy_losses(logits, old_logits, proxy_adv, chosen, delta, valid,
                                                         c.eps_clip, c.dual_c, c.proxy_weight,
                                                         None if floored is None else floored.to(device))
        kl_teacher = self.teacher_kl(logits, teacher_logits, valid)
        gate = torch.ones_like(kl_teacher)
        if c.kl_gate == "nonpositive_adv":
            executed_adv = torch.zeros_like(delta)
            if c.use_proxy:
                executed_adv = executed_adv + proxy_adv.gather(-1, chosen[:, None])[:, 0]
            if c.use_residual:
                executed_adv = executed_adv + delta
            gate = (executed_adv <= 0).float()
        sd_loss = (gate * kl_teacher).mean()
        loss = c.beta_sd * sd_loss
        if c.use_proxy:
            loss = loss + proxy_loss
        if c.use_residual:
            loss = loss + c.lambda_res * residual_loss
        guard_loss = torch.zeros((), device=device)
        if guard is not None and c.guard_weight > 0:
            guard_logits = candidate_logits(self.policy, guard["obs"], guard.get("candidates"))
            guard_loss = -(guard["target"].to(device) * guard_logits.log_softmax(-1)).sum(-1).mean()
            loss = loss + c.guard_weight * guard_loss

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), c.grad_clip)
        self.optimizer.step()
        self.teacher.update(self.policy, c.ema_m)

        with torch.no_grad():
            kl_old = categorical_kl(old_logits, logits.detach(), valid).mean()
            w = torch.ones_like(ratio) if valid is None else valid.float()
            clip_fraction = (((ratio - 1.0).abs() > c.eps_clip).float() * w).sum() / w.sum()
        metrics = {"loss": loss.detach(), "proxy_loss": proxy_loss.detach(), "residual_loss": residual_loss.detach(),
                   "sd_loss": sd_loss.detach(), "kl_teacher": kl_teacher.detach().mean(), "kl_old": kl_old,
                   "clip_fraction": clip_fraction, "grad_norm": grad_norm.detach(), "guard_loss": guard_loss.detach()}
        if self.critic is not None:
            metrics["value_loss"] = self.update_critic(batch["obs"], batch["event_return"])
        return metrics

    def update_critic(self, obs: dict[str, Any], event_return: torch.Tensor) -> torch.Tensor:
        """One step of the critic's ``MSE(V(s), G)``; returns the loss before the step (0-d, detached).

        Raises:
            CraftConfigError: the method has no critic (``baseline`` is not ``evpo``).
        """
        critic, optimizer = self._critic()
        critic.train()
        loss = (critic(obs) - event_return.to(self.policy.device).float()).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), self.config.grad_clip)
        optimizer.step()
        return loss.detach()

    def fit(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``config.epochs`` shuffled passes of ``update`` over one on-policy batch in minibatches;
        with ``config.target_kl`` they stop after the first step whose KL to the acting policy exceeds it.
        ``batch["guard"]`` (``obs``, ``target``; optional): the guard term's states, whole in every update.

        Returns each metric's mean over the updates made (0-d tensors) and ``updates``, their number.
        """
        batch = dict(batch)
        guard = batch.pop("guard", None)
        n, history = int(batch["chosen"].shape[0]), []
        for index in minibatch_indices(n, self.config.minibatch, self.config.epochs, generator):
            history.append(self.update(take_rows(batch, index), guard))
            if self.config.target_kl is not None and float(history[-1]["kl_old"]) > self.config.target_kl:
                break  # the student has left the trust region around the policy that collected the batch
        means = {k: torch.stack([h[k] for h in history]).mean() for k in history[0]}
        return means | {"updates": torch.tensor(len(history))}
