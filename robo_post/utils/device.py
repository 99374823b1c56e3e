"""Torch device names as the configs give them."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
