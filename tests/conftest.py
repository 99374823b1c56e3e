"""Test-wide settings."""

import os

import torch

# One torch thread per test process: the suite shares 2 cores with the fleet
# processes it spawns, and oversubscribed intra-op threads slow CPU torch ~10x.
torch.set_num_threads(1)
os.environ.setdefault("MUJOCO_GL", "egl")
