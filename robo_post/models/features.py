"""The observation contract: which store keys a model reads, and in what role.

Models and critics are built from a *feature spec*, not from hard-coded keys. A
feature spec maps each observation key of the store schema to a role:

==============  =============================================  ==========================
role            what the store holds                           how a model encodes it
==============  =============================================  ==========================
``state``       float/int/bool vector (any shape, flattened)   standardised, then an MLP
``image``       uint8 (H, W, C), C in {1, 3, 4}, H, W >= 18    a small CNN
``discrete``    an integer scalar with bounds [low, high]      a learned embedding
==============  =============================================  ==========================

Language is not an observation key: it is the episode's instruction text, and a
model reads it only with ``use_text``. Every state key is concatenated into one
standardised vector; the statistics come from the training data
(``set_state_stats``) and travel with the weights.

Roles are inferred from the schema (``infer_features``); ``overrides`` can drop a
key (``None``) or force its role.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

ROLES = ("state", "image", "discrete")


class FeatureSpecError(ValueError):
    """A feature spec does not fit the data (unknown key or role, a role the key's dtype/shape cannot take)."""


@dataclass(frozen=True)
class Feature:
    """One observation key as a model reads it.

    Attributes:
        role: ``state``, ``image`` or ``discrete``.
        shape: per-step shape in the store.
        low: smallest value of a ``discrete`` key (its embedding index 0).
        n: number of values of a ``discrete`` key.
    """

    role: str
    shape: tuple[int, ...]
    low: int = 0
    n: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if self.role not in ROLES:
            raise FeatureSpecError(f"unknown feature role {self.role!r}; roles are {ROLES}")

    @property
    def size(self) -> int:
        """Width of the flattened value (state) or 1 (discrete)."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.role == "state" else 1


# The image encoder's three strided convolutions need at least this many pixels per side.
MIN_IMAGE_SIDE = 18


def _is_image(shape: tuple[int, ...], dtype: np.dtype) -> bool:
    return dtype == np.uint8 and len(shape) == 3 and shape[2] in (1, 3, 4)


def _infer_role(key: str, spec: Any) -> Feature:
    shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
    if _is_image(shape, dtype) and min(shape[:2]) >= MIN_IMAGE_SIDE:
        return Feature("image", shape)
    if dtype.kind in "iu" and shape == () and spec.low is not None and spec.high is not None:
        low, high = int(np.min(spec.low)), int(np.max(spec.high))
        return Feature("discrete", shape, low=low, n=high - low + 1)
    return Feature("state", shape)


def _forced(key: str, role: str, spec: Any) -> Feature:
    inferred = _infer_role(key, spec)
    if role == inferred.role:
        return inferred
    if role == "state":  # any numeric key can be read as a vector
        return Feature("state", tuple(spec.shape))
    if role == "image" and _is_image(tuple(spec.shape), np.dtype(spec.dtype)):
        raise FeatureSpecError(f"observation {key!r} (shape {tuple(spec.shape)}) is too small for the image encoder: "
                               f"it needs at least {MIN_IMAGE_SIDE} x {MIN_IMAGE_SIDE} pixels; read it as role 'state'")
    raise FeatureSpecError(f"observation {key!r} (dtype {spec.dtype}, shape {tuple(spec.shape)}) cannot take role {role!r}")


def infer_features(observations: Mapping[str, Any], overrides: Mapping[str, str | None] | None = None,
                   use_images: bool = True) -> dict[str, Feature]:
    """Feature spec of a store schema's ``observations`` (key -> ``ArraySpec``).

    Args:
        overrides: key -> role, or ``None`` to leave the key out.
        use_images: ``False`` leaves every image key out (the state-only variant).
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(observations))
    if unknown:
        raise FeatureSpecError(f"feature overrides name keys not in the store: {unknown}; keys: {sorted(observations)}")
    features = {}
    for key, spec in observations.items():
        if key in overrides:
            if overrides[key] is None:
                continue
            feature = _forced(key, overrides[key], spec)
        else:
            feature = _infer_role(key, spec)
        if feature.role == "image" and not use_images:
            continue
        features[key] = feature
    if not features:
        raise FeatureSpecError(f"no observation key left to read (keys {sorted(observations)}, overrides {overrides})")
    return features


def state_keys(features: Mapping[str, Feature]) -> list[str]:
    return [k for k, f in features.items() if f.role == "state"]


def state_dim(features: Mapping[str, Feature]) -> int:
    """Width of the concatenated state vector."""
    return sum(features[k].size for k in state_keys(features))


def features_to_json(features: Mapping[str, Feature]) -> dict[str, dict[str, Any]]:
    return {k: {**asdict(f), "shape": list(f.shape)} for k, f in features.items()}


def features_from_json(d: Mapping[str, Mapping[str, Any]]) -> dict[str, Feature]:
    return {k: Feature(v["role"], tuple(v["shape"]), v.get("low", 0), v.get("n", 0)) for k, v in d.items()}


class FeatureConfigJSON:
    """JSON form of a dataclass config whose ``features`` field is a feature spec (saved beside weights)."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "features": features_to_json(self.features)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]):
        return cls(**{**d, "features": features_from_json(d["features"])})


def state_features(dim: int, key: str = "state") -> dict[str, Feature]:
    """A single state vector of width ``dim`` (tests, synthetic benchmarks)."""
    return {key: Feature("state", (dim,))}
