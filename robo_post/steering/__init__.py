"""Deployment-time steering of frozen actors (docs/steering.md): composition rules and
the KL-budget selector (``poe``), actors and priors as diagonal Gaussians (``sources``),
the steered policy kind (``policy``) and the evaluation grid (``evaluate``)."""
