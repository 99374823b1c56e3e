"""Publishing a trained policy to a store's registry, once."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from robo_post.store import PolicyArtifactError, PolicyRegistry


class NonFiniteWeightsError(ValueError):
    """A trained policy holds NaN or infinite weights (training diverged): it is not published."""


def publish_once(registry: PolicyRegistry, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> int:
    """Publish ``(weights, config)``, or return the version that already is exactly that: the
    newest (a run killed after publishing, before its ``summary.json``, resumes at its final
    checkpoint and would otherwise publish the same policy a second time), or one published
    earlier with the newest version's weights (a finished run rerun under its first settings
    after a publication under others). The newest version's weights under another config (a
    finished run published again under changed settings) are published with
    ``same_weights_as`` naming the version that first held them.

    Raises:
        NonFiniteWeightsError: a weight is NaN or infinite (a fleet following the registry would
            run it, every action non-finite).
    """
    bad = sorted(k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if bad:
        raise NonFiniteWeightsError(f"the trained policy has non-finite weights in {len(bad)} tensors ({bad[0]}, ...): "
                                    "training diverged (a lower algo.lr or grad_clip may help); nothing was published")
    latest = registry.latest()
    if latest is not None:
        try:
            published, published_config = registry.load(latest)
        except PolicyArtifactError as e:
            # A version damaged after publishing must not block every later one; validate lists it.
            print(f"warning: {e}; publishing version {latest + 1} after it", file=sys.stderr)
            return registry.publish(weights, config)
        if (published.keys() == weights.keys()
                and all(torch.equal(published[k], v.detach().cpu()) for k, v in weights.items())):
            origin = published_config.get("same_weights_as", latest)
            wanted = json.loads(json.dumps(config))
            for version in reversed(registry.versions()):  # the newest first; the family ends at its origin
                try:
                    version_config = published_config if version == latest else registry.load(version)[1]
                except PolicyArtifactError:
                    continue
                if version != origin and version_config.get("same_weights_as") != origin:
                    continue
                if {k: v for k, v in version_config.items() if k not in ("version", "same_weights_as")} == wanted:
                    return version
                if version == origin:
                    break
            config = {**config, "same_weights_as": origin}
    return registry.publish(weights, config)
