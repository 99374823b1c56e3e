"""Simulated environments (tabletop MuJoCo tasks, driving, highway meta-actions, reacher, point mass,
shutdown grid) and the env registry (``env_spec``)."""

import gymnasium as gym

# The entry point is a string, so importing this package does not import MuJoCo.
gym.register(
    id="robo_post/Tabletop-v0",
    entry_point="robo_post.envs.tabletop:TabletopEnv",
    kwargs={"task": "reach"},
)

# Driving scenarios from highway-env; highway-env is imported only on make().
gym.register(
    id="robo_post/Driving-v0",
    entry_point="robo_post.envs.driving:DrivingEnv",
    kwargs={"scenario": "highway-fast"},
)

# highway-env's fast highway with discrete meta-actions and counterfactual candidate scoring.
gym.register(
    id="robo_post/HighwayMeta-v0",
    entry_point="robo_post.envs.highway_meta:HighwayMetaEnv",
)

# Sparse-reward Reacher-v5 of demonstration E3 (docs/methods.md, "Demonstrations: E3").
gym.register(
    id="robo_post/SparseReacher-v0",
    entry_point="robo_post.envs.reacher:SparseReacherEnv",
    max_episode_steps=50,
)

# Dense-reward Reacher-v5 with an optional fixed target (steering).
gym.register(
    id="robo_post/Reacher-v0",
    entry_point="robo_post.envs.reacher:DenseReacherEnv",
    max_episode_steps=50,
)

# 2-D point mass reaching a goal (steering).
gym.register(
    id="robo_post/PointMass-v0",
    entry_point="robo_post.envs.point_mass:PointMassEnv",
    max_episode_steps=100,
)

# Shutdown gridworld of DReST (docs/methods.md, section 9): one mini-episode per episode.
gym.register(
    id="robo_post/ShutdownGrid-v0",
    entry_point="robo_post.envs.shutdown_grid:ShutdownGridEnv",
)

# After the gymnasium ids above: the registry's entries refer to them.
from robo_post.envs.registry import (  # noqa: E402
    EnvMakeError,
    EnvRegistryError,
    EnvSpec,
    NoExpertError,
    NoPriorError,
    PriorFactory,
    UnknownEnvError,
    UnknownExpertModeError,
    UnknownTaskError,
    UnsupportedSpaceError,
    env_spec,
    make_prior,
    register_env,
    spec_for_env,
)

__all__ = [
    "EnvMakeError",
    "EnvRegistryError",
    "EnvSpec",
    "NoExpertError",
    "NoPriorError",
    "PriorFactory",
    "UnknownEnvError",
    "UnknownExpertModeError",
    "UnknownTaskError",
    "UnsupportedSpaceError",
    "env_spec",
    "make_prior",
    "register_env",
    "spec_for_env",
]
