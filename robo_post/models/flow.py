"""Flow-matching action-chunk policy ("flow VLA"): observations (+ language) -> H actions.

Conventions (docs/methods.md): flow time w in [0, 1], w = 0 is noise
x_0 ~ N(0, I), w = 1 is the (normalised) action chunk x_1;
x_w = (1 - w) x_0 + w x_1. The network predicts the chunk, x_1(s, x_w, w), trained by
regression onto x_1; the velocity the ODE follows is v = (x_1(s, x, w) - x) / (1 - w).
(Models published before predict the velocity x_1 - x_0 directly: ``predicts="velocity"``.)
Sampling runs N Euler steps x <- x + v(s, x, i/N) / N and clips to [-1, 1].

Shapes: observations are a dict of (B, ...) tensors, one per key of the model's
feature spec (``robo_post.models.features``), plus ``instruction``: a list of B
strings when the model reads language. Action chunks are (B, H, A) in env units;
the model works on normalised chunks internally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from robo_post.models.encoders import BoundedActions, ObservationEncoder, mlp, obs_batch
from robo_post.models.features import Feature, FeatureConfigJSON


@dataclass
class FlowPolicyConfig(FeatureConfigJSON):
    """Architecture of a flow policy; saved as JSON beside its weights.

    Attributes:
        features: observation key -> ``Feature`` (role and shape) the model reads.
        action_dim: A, size of one action.
        horizon: H, actions per chunk.
        use_text: encode ``obs["instruction"]`` with the frozen MiniLM encoder.
        embed_dim: width of each modality embedding.
        hidden_dim: width of the fusion and velocity MLPs.
        flow_steps: N Euler steps when sampling.
        action_low / action_high: env action bounds, mapped to [-1, 1].
        execute_steps: actions of a chunk executed open-loop before re-planning.
        deterministic: one action per state instead of a random draw: the chunk integrated
            from the noise's centre (x_0 = 0), or with ``mode_draws`` > 1 the densest of that many
            chunks from a fixed set of noises (``densest``). Training is unchanged.
        mode_draws: K fixed noises a deterministic policy integrates (the first the centre).
            The centre is a point between the data's modes where behaviours differ and acts
            like none of them; the mode of K draws is a noisier estimate where they agree.
        predicts: what the network outputs: ``chunk`` (x_1; its regression target has no
            noise term, so BC converges several times faster on near-deterministic
            demonstrations) or ``velocity`` (x_1 - x_0, the form of models published before).
    """

    features: dict[str, Feature]
    action_dim: int
    horizon: int = 8
    use_text: bool = True
    embed_dim: int = 128
    hidden_dim: int = 256
    flow_steps: int = 10
    action_low: list[float] = field(default_factory=list)
    action_high: list[float] = field(default_factory=list)
    execute_steps: int | None = None
    deterministic: bool = False
    mode_draws: int = 1
    predicts: str = "chunk"

    def __post_init__(self):
        if self.predicts not in PREDICTS:
            raise ValueError(f"FlowPolicyConfig.predicts must be one of {PREDICTS}, got {self.predicts!r}")
        if self.mode_draws < 1:
            raise ValueError(f"FlowPolicyConfig.mode_draws must be >= 1, got {self.mode_draws}")


PREDICTS = ("chunk", "velocity")
# Smallest 1 - w the chunk-to-velocity map divides by. Euler sampling never goes past
# w = 1 - 1/N; only the adjoint's Jacobian at w = 1 reaches it.
MIN_REMAINING = 0.05
TIME_FREQS = 4
TIME_FEATURES = 2 * TIME_FREQS + 1


def time_features(w: torch.Tensor, n: int = TIME_FREQS) -> torch.Tensor:
    """Fourier features of flow time w (B,) -> (B, 2n + 1); low frequencies keep v smooth in w."""
    freqs = math.pi * 2.0 ** torch.arange(n, device=w.device, dtype=w.dtype)
    angles = w[:, None] * freqs
    return torch.cat([w[:, None], angles.sin(), angles.cos()], dim=-1)


class FlowPolicy(BoundedActions, nn.Module):
    """Observation encoder + velocity field v(s, x, w) over a flattened action chunk."""

    def __init__(self, config: FlowPolicyConfig):
        super().__init__()
        self.config = c = config
        self.encoder = ObservationEncoder(c.features, c.use_text, c.embed_dim, c.hidden_dim)
        self.chunk_dim = c.horizon * c.action_dim
        # Outputs the chunk or the velocity (``predicts``); the name is the weights' key in published artifacts.
        self.velocity_net = mlp([c.hidden_dim + self.chunk_dim + TIME_FEATURES, c.hidden_dim, c.hidden_dim, self.chunk_dim])
        self.register_action_bounds(c.action_low, c.action_high, c.action_dim)
        # a deterministic policy's noises, built once rather than at every decision
        self.register_buffer("mode_noise", fixed_noises(c.mode_draws, c.horizon, c.action_dim), persistent=False)

    # --- normalisation ---------------------------------------------------------
    def set_state_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        """Standardise the state vector with dataset statistics."""
        self.encoder.set_state_stats(mean, std)

    # --- networks --------------------------------------------------------------
    def encode(self, obs: dict[str, Any]) -> torch.Tensor:
        """Observation dict (B, ...) -> state embedding (B, hidden_dim)."""
        return self.encoder(obs)

    def output(self, z: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The network's raw output (B, H, A) at z (B, hidden), x (B, H, A) normalised, w (B,)."""
        inp = torch.cat([z, x.flatten(1), time_features(w)], dim=-1)
        return self.velocity_net(inp).view_as(x)

    def velocity(self, z: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """v(s, x, w): z (B, hidden), x (B, H, A) normalised, w (B,) -> (B, H, A)."""
        out = self.output(z, x, w)
        if self.config.predicts == "velocity":
            return out
        return (out - x) / (1 - w).clamp(min=MIN_REMAINING)[:, None, None]

    # --- training --------------------------------------------------------------
    def bc_loss(self, obs: dict[str, Any], actions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Flow-matching BC loss on env-unit chunks (B, H, A); ``mask`` (B, H) drops padding.

        A chunk-predicting model regresses onto x_1; the velocity loss is this one weighted
        by 1 / (1 - w)^2, which puts most weight where x_w already shows the answer.
        """
        x1 = self.normalize_actions(actions.to(self.device)).clamp(-1.0, 1.0)
        x0 = torch.randn_like(x1)
        w = torch.rand(x1.shape[0], device=self.device)
        xw = (1 - w[:, None, None]) * x0 + w[:, None, None] * x1
        target = x1 if self.config.predicts == "chunk" else x1 - x0
        err = (self.output(self.encode(obs), xw, w) - target).pow(2).mean(-1)  # (B, H)
        if mask is None:
            return err.mean()
        mask = mask.to(self.device).float()
        return (err * mask).sum() / mask.sum().clamp(min=1.0)

    # --- sampling --------------------------------------------------------------
    @torch.no_grad()
    def sample(self, obs: dict[str, Any], noise: torch.Tensor | None = None, seed: int | None = None) -> torch.Tensor:
        """Sample action chunks (B, H, A) in env units by N Euler steps.

        Pass ``noise`` (B, H, A) or a ``seed`` for deterministic samples; a ``deterministic``
        policy given no noise starts from x_0 = 0, or acts at the densest of its ``mode_draws`` fixed draws.
        """
        z = self.encode(obs)
        shape = (z.shape[0], self.config.horizon, self.config.action_dim)
        if noise is None and self.config.deterministic:
            k = self.config.mode_draws
            if len(self.mode_noise) != k:  # the setting changed after construction
                self.mode_noise = fixed_noises(k, *shape[1:]).to(self.device)
            chunks = self.integrate(z.repeat_interleave(k, 0), self.mode_noise.repeat(shape[0], 1, 1))
            return self.unnormalize_actions(densest(chunks.view(shape[0], k, -1)).view(shape))
        if noise is None:
            gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
            noise = torch.randn(shape, generator=gen, device=self.device)
        return self.unnormalize_actions(self.integrate(z, noise))

    @torch.no_grad()
    def integrate(self, z: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Euler ODE from ``noise`` (B, H, A) at state embeddings ``z`` -> chunks in [-1, 1]."""
        x = noise.to(self.device)
        n = self.config.flow_steps
        for i in range(n):
            w = torch.full((x.shape[0],), i / n, device=self.device)
            x = x + self.velocity(z, x, w) / n
        return x.clamp(-1.0, 1.0)

    # --- artifacts -------------------------------------------------------------
    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(weights, config)`` for ``PolicyRegistry.publish``; provenance goes in the config."""
        weights = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}  # a copy: training goes on
        return weights, {"kind": "flow", "model": self.config.to_json(), **provenance}

    @classmethod
    def from_artifact(cls, weights: dict[str, torch.Tensor], config: dict[str, Any], device: str = "cpu") -> "FlowPolicy":
        model_json, weights = upgrade_artifact(config["model"], weights)
        model_json = {"predicts": "velocity", **model_json}  # published before chunk prediction existed
        model = cls(FlowPolicyConfig.from_json(model_json))
        model.load_state_dict(weights)
        return model.to(device).eval()


def fixed_noises(k: int, horizon: int, action_dim: int) -> torch.Tensor:
    """A deterministic policy's ``k`` noises (k, H, A): the centre (x_0 = 0), then draws of seed 0."""
    noises = torch.randn((k, horizon, action_dim), generator=torch.Generator().manual_seed(0))
    noises[0] = 0.0
    return noises


def densest(x: torch.Tensor, iters: int = 10) -> torch.Tensor:
    """The mode of each row's K samples ``x`` (B, K, D) -> (B, D), by mean shift.

    A Gaussian kernel with Silverman's per-coordinate bandwidth; the shift starts at the
    sample of highest kernel density. With one sample it returns it.
    """
    b, k, d = x.shape
    if k == 1:
        return x[:, 0]
    h = (x.std(1, keepdim=True) * (4.0 / ((d + 2) * k)) ** (1.0 / (d + 4))).clamp_min(1e-3)  # (B, 1, D)

    def weights(y: torch.Tensor) -> torch.Tensor:  # (B, M, D) -> kernel weights (B, M, K)
        return torch.exp(-0.5 * (((y[:, :, None] - x[:, None]) / h[:, None]) ** 2).sum(-1))

    y = x.gather(1, weights(x).sum(-1).argmax(1)[:, None, None].expand(b, 1, d))  # (B, 1, D)
    for _ in range(iters):
        w = weights(y)  # (B, 1, K)
        y = (w @ x) / w.sum(-1, keepdim=True)
    return y[:, 0]


def upgrade_artifact(model: dict[str, Any], weights: dict[str, torch.Tensor],
                     prefix: str = "") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An architecture config and weights as published before feature specs existed
    (fixed ``proprio``/``image`` keys: ``proprio_dim``, ``image_size``), in today's form.

    Configs that already carry ``features`` come back unchanged. ``prefix`` is the
    weights' prefix of the upgraded module (``policy.`` in a ranked artifact).
    """
    if "features" in model:
        return model, weights
    model = dict(model)
    features = {"proprio": {"role": "state", "shape": [model.pop("proprio_dim")]}}
    size = model.pop("image_size", None)
    if size:
        features["image"] = {"role": "image", "shape": [size, size, 3]}
    model["features"] = features
    renames = (("encoder.proprio.", "encoder.state."), ("encoder.proprio_mean", "encoder.state_mean"),
               ("encoder.proprio_std", "encoder.state_std"), ("encoder.image.", "encoder.images.image."))
    upgraded = {}
    for key, value in weights.items():
        if key.startswith(prefix):
            for old, new in renames:
                if key[len(prefix):].startswith(old):
                    key = prefix + new + key[len(prefix) + len(old):]
                    break
        upgraded[key] = value
    return model, upgraded


class FlowPolicyRunner:
    """Runs a flow policy step by step in an env: sample a chunk, execute it open-loop.

    Implements the fleet ``Policy`` protocol (``reset(env, seed)``, ``act(obs, env)``).
    The model input is the observation's feature keys; a model that reads language
    gets the env's ``instruction`` attribute (empty when the env has none).
    """

    def __init__(self, model: FlowPolicy, device: str = "cpu"):
        self.model = model.to(device).eval()
        self.execute = model.config.execute_steps or model.config.horizon
        self.queue: list[np.ndarray] = []
        self.seed = 0

    def reset(self, env: Any, seed: int) -> None:
        self.queue, self.seed = [], seed

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        if not self.queue:
            c = self.model.config
            chunk = self.model.sample(obs_batch(obs, c.features, c.use_text, env), seed=self.seed)[0].cpu().numpy()
            self.seed += 1
            self.queue = list(chunk[: self.execute])
        return self.queue.pop(0)
