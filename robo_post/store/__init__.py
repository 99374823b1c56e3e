"""Trajectory store: zarr v3 shards (one writer each), atomic episode commits,
consistent snapshots, chunked-window sampling and a policy registry."""

from robo_post.store.registry import PolicyArtifactError, PolicyNotFoundError, PolicyRegistry, PolicyVersionExistsError
from robo_post.store.replay import FreshPER, FreshPERConfig
from robo_post.store.sampler import ImitationSampler, MixedSampler, PrioritizedSampler, WindowSampler
from robo_post.store.schema import (
    ROLES,
    SCHEMA_VERSION,
    ArraySpec,
    EpisodeNotFoundError,
    EpisodeTooLargeError,
    EpisodeValidationError,
    InvalidNameError,
    SchemaVersionError,
    ShardDamagedError,
    ShardLockedError,
    StoreError,
    StoreIntegrityError,
    StoreNotFoundError,
    StoreSchema,
    UnsupportedFormatError,
    infer_role,
)
from robo_post.store.store import EpisodeInfo, Snapshot, Store
from robo_post.store.writer import ShardWriter

__all__ = [
    "ROLES",
    "SCHEMA_VERSION",
    "ArraySpec",
    "EpisodeInfo",
    "EpisodeNotFoundError",
    "EpisodeTooLargeError",
    "EpisodeValidationError",
    "FreshPER",
    "FreshPERConfig",
    "ImitationSampler",
    "InvalidNameError",
    "MixedSampler",
    "PolicyArtifactError",
    "PolicyNotFoundError",
    "PolicyRegistry",
    "PolicyVersionExistsError",
    "PrioritizedSampler",
    "SchemaVersionError",
    "ShardDamagedError",
    "ShardLockedError",
    "ShardWriter",
    "Snapshot",
    "Store",
    "StoreError",
    "StoreIntegrityError",
    "StoreNotFoundError",
    "StoreSchema",
    "UnsupportedFormatError",
    "WindowSampler",
    "infer_role",
]
