"""Policy push latency: from a learner's ``publish`` to a fleet client holding the new weights,
through the policy registry on a local disk and on S3, measured in the same run.

Run from the checkout root::

    .venv/bin/python benchmarks/registry_push.py                 # local disk vs S3 (moto on loopback)
    .venv/bin/python benchmarks/registry_push.py --s3-url s3://BUCKET/PREFIX   # ... vs a bucket of yours

A publisher (this process) publishes ``--versions`` policies of ``--size-mb`` of float32 weights,
one every ``--interval`` seconds. A follower process polls ``latest()`` as fast as it can and
loads each new version it sees (checksums verified), as a fleet client does at an episode
boundary. Per version: latency = (follower has the weights) - (publisher called ``publish``),
both clocks on this host. Printed: p50/p99 latency, p50 publish time, versions the follower
saw (a version published while the follower was loading the previous one is skipped, as a
client would skip it), and the S3/local ratio of each. A client polls at episode ends, so in
a fleet the episode's remaining time adds to these figures; this measures the registry.

moto is a single-threaded Python server on loopback: its figures bound the client's overhead
(requests, checksums, listing), not a real bucket's network latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from robo_post.store.registry import PolicyRegistry  # noqa: E402

FOLLOWER = """
import json, sys, time
from robo_post.store.registry import PolicyRegistry
reg, seen = PolicyRegistry(sys.argv[1]), 0
print("ready", flush=True)
while seen < int(sys.argv[2]):
    latest = reg.latest()
    if latest is not None and latest > seen:
        weights, config = reg.load(latest)
        print(json.dumps({"version": latest, "loaded": time.time()}), flush=True)
        seen = latest
"""


def measure(root: str, versions: int, size_mb: float, interval: float) -> dict[str, list[float]]:
    """Publish ``versions`` policies into the registry at ``root`` while a follower process loads them."""
    weights = {"w": torch.randn(int(size_mb * 2**20 / 4))}
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, root, str(versions)], stdout=subprocess.PIPE,
                                text=True, env=os.environ)
    assert follower.stdout.readline().strip() == "ready"
    registry, started, publish_s = PolicyRegistry(root), {}, []
    for v in range(1, versions + 1):
        time.sleep(interval)
        started[v] = time.time()
        registry.publish(weights, {"kind": "benchmark"}, version=v)
        publish_s.append(time.time() - started[v])
    loaded = [json.loads(line) for line in follower.communicate(timeout=120)[0].splitlines()]
    return {"latency_s": [r["loaded"] - started[r["version"]] for r in loaded], "publish_s": publish_s}


def summary(res: dict[str, list[float]], versions: int) -> dict[str, float]:
    lat = np.array(res["latency_s"])
    return {"p50_ms": 1e3 * float(np.percentile(lat, 50)), "p99_ms": 1e3 * float(np.percentile(lat, 99)),
            "publish_p50_ms": 1e3 * float(np.median(res["publish_s"])), "seen": len(lat), "published": versions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--size-mb", type=float, default=1.0, help="weights per version (a state flow policy: ~1 MB)")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between publishes")
    parser.add_argument("--s3-url", default=None, help="object storage under this URL instead of moto "
                        "(s3://BUCKET/PREFIX, credentials from the environment)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(tempfile.TemporaryDirectory(prefix="registry-push-"))
        if args.s3_url:
            remote = args.s3_url.rstrip("/") + f"/registry-push-{int(time.time())}"
        else:
            from store_ingest import local_s3

            remote = f"s3://{stack.enter_context(local_s3()).bucket()}/registry-push"
        for name, root in (("local", local), ("s3", remote)):
            results[name] = summary(measure(root, args.versions, args.size_mb, args.interval), args.versions)
    where = args.s3_url or "moto's S3 server on loopback"
    print(f"push latency, publish -> follower holds the weights ({args.versions} versions of {args.size_mb} MB, "
          f"one every {args.interval} s; S3: {where})")
    print(f"{'':<16}{'local':>10}{'s3':>10}{'s3/local':>10}")
    for key in ("p50_ms", "p99_ms", "publish_p50_ms"):
        local, s3 = results["local"][key], results["s3"][key]
        print(f"{key:<16}{local:>10.1f}{s3:>10.1f}{s3 / local:>10.2f}")
    print(f"{'versions seen':<16}{results['local']['seen']:>10}{results['s3']['seen']:>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args) | {"s3": where}, **results}, f, indent=1)


if __name__ == "__main__":
    main()
