"""A real S3 server for tests: moto's server mode on loopback, in a subprocess.

Credentials are fake, random per server, and reach the clients through environment variables
only (``S3Server.env``), as in production; tests grep the store for them.
"""

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator


class S3Server:
    """moto's S3 server on a free loopback port; ``bucket()`` makes a fresh bucket."""

    def __init__(self):
        with socket.socket() as s:  # a free port; moto binds it right after
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key = "AKIA" + secrets.token_hex(8).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self.env = {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": "us-east-1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"moto's S3 server did not start on port {self.port}")
                time.sleep(0.1)

    def bucket(self) -> str:
        """Create a new, empty bucket; returns its name."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        # moto checks no signature: a plain PUT creates the bucket.
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10).close()
        return name

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def moto_available() -> bool:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def running() -> Iterator[S3Server]:
    """A server whose fake credentials are in this process's environment (and so its children's)
    while it runs; the environment is put back after."""
    server = S3Server()
    old = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.close()
