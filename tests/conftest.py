"""Test-wide settings."""

import os

import pytest
import torch

# One torch thread per test process: the suite shares 2 cores with the fleet
# processes it spawns, and oversubscribed intra-op threads slow CPU torch ~10x.
torch.set_num_threads(1)
os.environ.setdefault("MUJOCO_GL", "egl")


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback for the session, its fake credentials in the environment.
    Skips (saying how to install it) where moto is not installed."""
    from s3_server import S3Server, moto_available, restore_env, set_env

    if not moto_available():
        pytest.skip("moto[server] is not installed (see the README: the store on S3)")
    server = S3Server()
    old = set_env(server.env)
    try:
        yield server
    finally:
        restore_env(old)
        server.close()
