"""Critic and value networks for in-sample value learning (DIVL, IQL).

One module, ``CriticNet``, holds LWD's "critic and value backbone" (docs/methods.md,
"DIVL: networks"): a state encoder shared by

- twin scalar heads ``Q_j(s, a)`` on ``concat(z, flattened normalised chunk)``
  with LayerNorm (clipped double-Q), and
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
    """

    features: dict[str, Feature]
    action_dim: int
    horizon: int = 8
    use_text: bool = True
    embed_dim: int = 128
    hidden_dim: int = 256
    action_low: list[float] = field(default_factory=list)
    action_high: list[float] = field(default_factory=list)

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



class CriticNet(nn.Module):
    """State encoder + twin Q heads + value head (``value_outputs`` logits; 0 = no value head, as in FQL)."""

    def __init__(self, config: CriticConfig, value_outputs: int):
        super().__init__()
        self.config = c = config
        e, h = c.embed_dim, c.hidden_dim
        self.encoder = ObservationEncoder(c.features, c.use_text, e, h)
        chunk_dim = c.horizon * c.action_dim
        self.q_heads = nn.ModuleList([mlp([h + chunk_dim, h, h, 1], layer_norm=True) for _ in range(2)])
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
        """Twin Q values (2, B) for z (B, hidden) and a normalised chunk (B, H, A)."""
        inp = torch.cat([z, chunk.flatten(1)], dim=-1)
        return torch.stack([head(inp).squeeze(-1) for head in self.q_heads])

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
