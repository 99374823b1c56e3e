"""Critic and value networks for in-sample value learning (DIVL, IQL).

One module, ``CriticNet``, holds LWD's "critic and value backbone" (docs/methods.md,
"DIVL: networks"): a state encoder shared by

- an ensemble of ``num_q`` scalar heads ``Q_j(s, a)`` (twin by default: clipped
  double-Q) on ``concat(z, flattened normalised chunk)`` with LayerNorm, evaluated
  as one batched computation (``EnsembleMLP``), and
- a value head on ``z`` (K categorical logits for DIVL, 1 scalar for IQL).

The encoder mirrors ``FlowPolicy.encode`` (the same feature spec and optional
instruction text) but has its own weights: the critic never shares parameters
with the policy (in LWD, policy, critic and value are separate modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from robo_post.models.encoders import ObservationEncoder, mlp
from robo_post.models.features import Feature, FeatureConfigJSON
from robo_post.models.flow import FlowPolicyConfig


@dataclass
class CriticConfig(FeatureConfigJSON):
    """Architecture of ``CriticNet``.

    Attributes:
        features: observation key -> ``Feature`` the critic reads.
        action_dim: A, size of one action.
        horizon: H, actions per chunk (the critic sees the flattened H*A chunk).
        use_text: encode ``obs["instruction"]`` with the frozen MiniLM encoder.
        embed_dim: width of each modality embedding.
        hidden_dim: width of the encoder and head MLPs.
        action_low / action_high: env action bounds, mapped to [-1, 1] (as the policy's chunks).
        num_q: Q heads in the ensemble (2: clipped double-Q).
    """

    features: dict[str, Feature]
    action_dim: int
    horizon: int = 8
    use_text: bool = True
    embed_dim: int = 128
    hidden_dim: int = 256
    action_low: list[float] = field(default_factory=list)
    action_high: list[float] = field(default_factory=list)
    num_q: int = 2

    @classmethod
    def like(cls, policy: FlowPolicyConfig, use_images: bool = True, **overrides: Any) -> "CriticConfig":
        """Same observation features, chunk shape and action bounds as a policy.

        ``use_images=False`` drops the image keys (a camera-free critic beside a camera policy).
        """
        shared = {k: getattr(policy, k) for k in ("features", "action_dim", "horizon", "use_text",
                                                   "embed_dim", "hidden_dim", "action_low", "action_high")}
        if not use_images:
            shared["features"] = {k: f for k, f in policy.features.items() if f.role != "image"}
        return cls(**(shared | overrides))



class EnsembleLinear(nn.Module):
    """Several ``nn.Linear(in, out)`` of the same shape evaluated as one batched product.

    ``weight`` (n, out, in) and ``bias`` (n, out) are the members' tensors stacked (copied at
    construction), so member ``j`` is ``weight[j]``, ``bias[j]``. Input (B, in), shared by all
    members, or (n, B, in); output (n, B, out).
    """

    def __init__(self, members: list[nn.Linear]):
        super().__init__()
        self.in_features, self.out_features = members[0].in_features, members[0].out_features
        self.weight = nn.Parameter(torch.stack([m.weight.detach() for m in members]))
        self.bias = nn.Parameter(torch.stack([m.bias.detach() for m in members]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        if x.dim() == 2:  # shared input: one GEMM against all members' weights side by side
            out = F.linear(x, self.weight.reshape(n * self.out_features, self.in_features), self.bias.reshape(-1))
            return out.view(x.shape[0], n, self.out_features).transpose(0, 1)
        return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight.transpose(1, 2))


class EnsembleLayerNorm(nn.Module):
    """Several ``nn.LayerNorm(dim)`` on (n, B, dim); their affine ``weight``/``bias`` stacked to (n, dim)."""

    def __init__(self, members: list[nn.LayerNorm]):
        super().__init__()
        self.eps = members[0].eps
        self.weight = nn.Parameter(torch.stack([m.weight.detach() for m in members]))
        self.bias = nn.Parameter(torch.stack([m.bias.detach() for m in members]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Per member, so the affine stays inside the fused layer_norm kernel (forward and backward):
        # a separate broadcast multiply-add measured slower on CPU.
        return torch.stack([F.layer_norm(x[j], x.shape[-1:], self.weight[j], self.bias[j], self.eps)
                            for j in range(x.shape[0])])


class EnsembleMLP(nn.Sequential):
    """``n`` independent copies of ``mlp(sizes, layer_norm)`` as one batched network: (B, in) -> (n, B, out).

    Built from ``n`` ``mlp`` members (same initialisation, in the same RNG order, as a list of
    them), whose ``k``-th layers are stacked into layer ``k`` here: a list's key ``{j}.{k}.{name}``
    is row ``j`` of key ``{k}.{name}`` (``stack_member_state`` converts).
    """

    def __init__(self, n: int, sizes: list[int], layer_norm: bool = False):
        members = [mlp(sizes, layer_norm) for _ in range(n)]
        stacked = {nn.Linear: EnsembleLinear, nn.LayerNorm: EnsembleLayerNorm}
        super().__init__(*[stacked[type(layer)]([m[k] for m in members]) if type(layer) in stacked else layer
                           for k, layer in enumerate(members[0])])
        self.n = n


def stack_member_state(state_dict: dict[str, Any], prefix: str, n: int) -> None:
    """Rewrite, in place, per-member keys ``{prefix}{j}.{k}.{name}`` (a ``ModuleList`` of ``n`` MLPs, the
    layout of checkpoints and artifacts written before ``EnsembleMLP``) as stacked ``{prefix}{k}.{name}``."""
    members: dict[str, dict[int, torch.Tensor]] = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        parts = key[len(prefix):].split(".")
        if len(parts) == 3 and parts[0].isdigit():  # {j}.{k}.{name}; the stacked layout has two parts
            members.setdefault(f"{parts[1]}.{parts[2]}", {})[int(parts[0])] = state_dict.pop(key)
    for name, rows in members.items():
        if sorted(rows) != list(range(n)):
            raise ValueError(f"old-layout critic weights {prefix}*.{name} have heads {sorted(rows)}, expected 0..{n - 1}")
        state_dict[prefix + name] = torch.stack([rows[j] for j in range(n)])


class CriticNet(nn.Module):
    """State encoder + ``num_q`` Q heads (one ``EnsembleMLP``) + value head (``value_outputs`` logits;
    0 = no value head, as in FQL).

    State dicts in the layout before the batched ensemble (``q_heads.{j}.{k}.*``, one MLP per
    head) still load: ``load_state_dict`` stacks them; ``adopt_legacy_optimizer_state`` does the
    same for an optimizer's saved state.
    """

    def __init__(self, config: CriticConfig, value_outputs: int):
        super().__init__()
        self.config = c = config
        e, h = c.embed_dim, c.hidden_dim
        self.encoder = ObservationEncoder(c.features, c.use_text, e, h)
        chunk_dim = c.horizon * c.action_dim
        self.q_heads = EnsembleMLP(c.num_q, [h + chunk_dim, h, h, 1], layer_norm=True)
        self.value_head = mlp([h, h, h, value_outputs], layer_norm=True) if value_outputs else None
        if self.value_head is not None:
            # Zero logits at init: uniform categorical, so H~ = 1 and tau starts at
            # clip(tau_base - alpha) (docs/methods.md, "DIVL: adaptive quantile bootstrap").
            nn.init.zeros_(self.value_head[-1].weight)
            nn.init.zeros_(self.value_head[-1].bias)
        low = torch.tensor(c.action_low or [-1.0] * c.action_dim, dtype=torch.float32)
        high = torch.tensor(c.action_high or [1.0] * c.action_dim, dtype=torch.float32)
        self.register_buffer("action_low", low)
        self.register_buffer("action_high", high)
        self._register_load_state_dict_pre_hook(self._stack_legacy_heads)

    def _stack_legacy_heads(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        stack_member_state(state_dict, prefix + "q_heads.", self.config.num_q)

    def adopt_legacy_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Let ``optimizer`` (which holds ``q_heads``' parameters) load a state dict saved when the heads
        were separate modules: each stacked parameter takes its heads' moments stacked (resume stays exact)."""
        heads = [id(p) for p in self.q_heads.parameters()]
        n, count = self.config.num_q, len(heads)

        def hook(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
            for group, old in zip(opt.param_groups, saved["param_groups"]):
                ids = [id(p) for p in group["params"]]
                if heads[0] not in ids or len(old["params"]) != len(ids) + (n - 1) * count:
                    continue  # not this group, or already in the stacked layout
                start = ids.index(heads[0])
                old_ids = old["params"]
                per_head = [old_ids[start + j * count:start + (j + 1) * count] for j in range(n)]
                stacked = old_ids[start:start + count]  # the new parameters take head 0's indices
                for i, new_id in enumerate(stacked):
                    rows = [saved["state"].pop(per_head[j][i], None) for j in range(n)]
                    if rows[0] is not None:
                        saved["state"][new_id] = {k: torch.stack([r[k] for r in rows])
                                                  if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                                  for k, v in rows[0].items()}
                old["params"] = old_ids[:start] + stacked + old_ids[start + n * count:]
            return saved

        optimizer.register_load_state_dict_pre_hook(hook)

    @property
    def device(self) -> torch.device:
        return self.action_low.device

    def encoder_parameters(self) -> list[nn.Parameter]:
        """Parameters of the shared state encoder (everything but the heads)."""
        return list(self.encoder.parameters())

    def set_state_stats(self, mean: np.ndarray | torch.Tensor, std: np.ndarray | torch.Tensor) -> None:
        """Standardise the state vector with dataset statistics."""
        self.encoder.set_state_stats(mean, std)

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """(…, A) env units -> [-1, 1], the critic's input convention (docs/methods.md, "Flow-matching BC: conventions")."""
        return 2.0 * (actions.to(self.device) - self.action_low) / (self.action_high - self.action_low) - 1.0

    def encode(self, obs: dict[str, Any]) -> torch.Tensor:
        """Observation dict (B, ...) as the sampler yields it -> z (B, hidden_dim)."""
        return self.encoder(obs)

    def q(self, z: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        """Q values (num_q, B) of every head for z (B, hidden) and a normalised chunk (B, H, A)."""
        return self.q_heads(torch.cat([z, chunk.flatten(1)], dim=-1)).squeeze(-1)

    def value(self, z: torch.Tensor) -> torch.Tensor:
        """Value-head output (B, value_outputs): categorical logits or a scalar V."""
        return self.value_head(z)


def aggregate_heads(qs: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce twin/ensemble Q values (E, B) -> (B,) by ``mean`` or ``min``."""
    if agg == "mean":
        return qs.mean(0)
    if agg == "min":
        return qs.min(0).values
    raise ValueError(f"q_agg must be 'mean' or 'min', got {agg!r}")


@torch.no_grad()
def ema_update(target: nn.Module, online: nn.Module, rate: float) -> None:
    """target <- (1 - rate) * target + rate * online, parameters only (buffers are copied).

    One fused ``_foreach`` kernel per list instead of a Python loop of small ones."""
    torch._foreach_lerp_(list(target.parameters()), list(online.parameters()), rate)
    targets, sources = list(target.buffers()), list(online.buffers())
    if targets:
        torch._foreach_copy_(targets, sources)
