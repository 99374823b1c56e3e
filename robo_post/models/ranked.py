"""Best-of-N acting: sample N chunks from a flow policy, execute the one the critic rates highest.

QAM's acting option ``best_of_n`` (docs/methods.md, "QAM: acting and best-of-N"), the
rejection-sampling extraction of IDQL/IFQL: the critic only has to *rank* chunks the
policy already proposes, so it is never queried far from the data. ``best_of_n = 1``
is plain sampling. A ranked policy is published as its own artifact kind,
``flow_ranked``: the flow weights under ``policy.``, the critic's under ``critic.``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from robo_post.models.critic import aggregate_heads
from robo_post.models.critic import CriticConfig, CriticNet
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig, upgrade_artifact


class RankedFlowPolicy(nn.Module):
    """A ``FlowPolicy`` whose ``sample`` returns the best of ``best_of_n`` chunks under ``critic``.

    Args:
        policy: proposes the chunks.
        critic: rates them with its twin Q heads.
        best_of_n: chunks proposed per state (>= 1).
        q_agg: ``mean`` or ``min`` over the Q heads.
    """

    def __init__(self, policy: FlowPolicy, critic: CriticNet, best_of_n: int, q_agg: str = "mean"):
        super().__init__()
        if best_of_n < 1:
            raise ValueError(f"best_of_n must be >= 1, got {best_of_n}")
        aggregate_heads(torch.zeros(2, 1), q_agg)  # validates q_agg now, not at the first action
        self.policy, self.critic, self.best_of_n, self.q_agg = policy, critic, best_of_n, q_agg

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def config(self) -> FlowPolicyConfig:
        """The flow's config (horizon, execute_steps, modalities), as ``FlowPolicyRunner`` reads it."""
        return self.policy.config

    @torch.no_grad()
    def propose(self, obs: dict[str, Any], noise: torch.Tensor | None = None, seed: int | None = None) -> torch.Tensor:
        """``best_of_n`` normalised chunks (B, N, H, A) from the flow. ``noise`` is (B, N, H, A); or pass a ``seed``."""
        z, c = self.policy.encode(obs), self.policy.config
        b, n = z.shape[0], self.best_of_n
        if noise is None:
            gen = torch.Generator(device=self.policy.device).manual_seed(seed) if seed is not None else None
            noise = torch.randn((b, n, c.horizon, c.action_dim), generator=gen, device=self.policy.device)
        x = self.policy.integrate(z.repeat_interleave(n, 0), noise.reshape(b * n, c.horizon, c.action_dim))
        return x.view(b, n, c.horizon, c.action_dim)

    @torch.no_grad()
    def rate(self, obs: dict[str, Any], chunks: torch.Tensor) -> torch.Tensor:
        """The critic's Q (B, N) of normalised chunks (B, N, H, A), heads aggregated by ``q_agg``."""
        b, n = chunks.shape[:2]
        zc = self.critic.encode(obs).repeat_interleave(n, 0)
        return aggregate_heads(self.critic.q(zc, chunks.flatten(0, 1)), self.q_agg).view(b, n)

    def sample(self, obs: dict[str, Any], noise: torch.Tensor | None = None, seed: int | None = None) -> torch.Tensor:
        """Best chunks (B, H, A) in env units. ``noise`` is (B, N, H, A); or pass a ``seed``."""
        x = self.propose(obs, noise, seed)
        best = x[torch.arange(x.shape[0], device=x.device), self.rate(obs, x).argmax(1)]
        return self.policy.unnormalize_actions(best)

    def artifact(self, **provenance: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(weights, config)`` for ``PolicyRegistry.publish`` (kind ``flow_ranked``)."""
        flow_weights, flow_config = self.policy.artifact()
        weights = {f"policy.{k}": v for k, v in flow_weights.items()}
        weights |= {f"critic.{k}": v.detach().cpu().clone() for k, v in self.critic.state_dict().items()}
        value_outputs = 0 if self.critic.value_head is None else self.critic.value_head[-1].out_features
        return weights, {"kind": "flow_ranked", "model": flow_config["model"], "critic": self.critic.config.to_json(),
                         "value_outputs": value_outputs, "best_of_n": self.best_of_n, "q_agg": self.q_agg,
                         **provenance}

    @classmethod
    def from_artifact(cls, weights: dict[str, torch.Tensor], config: dict[str, Any],
                      device: str = "cpu") -> "RankedFlowPolicy":
        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}

        policy = FlowPolicy.from_artifact(part("policy."), {"model": config["model"]})
        critic_json, critic_weights = upgrade_artifact(config["critic"], part("critic."))
        critic = CriticNet(CriticConfig.from_json(critic_json), config["value_outputs"])
        critic.load_state_dict(critic_weights)
        return cls(policy, critic, config["best_of_n"], config["q_agg"]).to(device).eval()


FLOW_KINDS = ("flow", "flow_ranked")  # artifact kinds that hold a flow (flow_of)


def flow_of(weights: dict[str, torch.Tensor], config: dict[str, Any]) -> FlowPolicy:
    """The flow of a registry artifact: a ``flow`` itself, or the proposer of a ``flow_ranked``."""
    if config["kind"] == "flow_ranked":
        return RankedFlowPolicy.from_artifact(weights, config).policy
    return FlowPolicy.from_artifact(weights, config)
