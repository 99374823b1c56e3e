"""Flow policy speed vs. a plain MLP Gaussian policy of similar size, in one run.

    .venv/bin/python benchmarks/policy_speed.py [--quick]

For the image and the state-only variant of the flow VLA (``FlowPolicy``, text
encoder off so nothing is loaded) and for an MLP Gaussian chunk policy with about
the same parameter count, on one CPU thread:

- training updates/s at batch 64 (flow-matching loss vs. Gaussian log-likelihood);
- inference latency per action chunk at batch 1 and batch 64 (10 Euler steps vs.
  one forward pass), and whether batch 1 fits a 10 Hz control loop (100 ms).

Prints a table with the flow/MLP ratios.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from robo_post.models.features import Feature, state_features
from robo_post.models.encoders import ImageEncoder, mlp
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig

H, A, P, S = 8, 4, 31, 64


class GaussianMLPPolicy(nn.Module):
    """Baseline: same encoders, a diagonal Gaussian over the flattened chunk."""

    def __init__(self, image: bool, hidden: int):
        super().__init__()
        self.image = ImageEncoder((S, S, 3), 128) if image else None
        self.proprio = nn.Linear(P, 128)
        self.net = mlp([128 * (2 if image else 1), hidden, hidden, hidden, 2 * H * A])

    def forward(self, obs):
        parts = [self.proprio(obs["proprio"])] + ([self.image(obs["image"])] if self.image is not None else [])
        mean, log_std = self.net(torch.cat(parts, -1)).chunk(2, -1)
        return mean, log_std.clamp(-5, 2)

    def loss(self, obs, actions):
        mean, log_std = self(obs)
        return (((actions.flatten(1) - mean) / log_std.exp()).pow(2) / 2 + log_std).mean()

    @torch.no_grad()
    def sample(self, obs):
        mean, log_std = self(obs)
        return (mean + log_std.exp() * torch.randn_like(mean)).view(-1, H, A)


def obs(b: int, image: bool) -> dict:
    out = {"proprio": torch.randn(b, P)}
    if image:
        out["image"] = torch.randint(0, 256, (b, S, S, 3), dtype=torch.uint8)
    return out


def rate(fn, n: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - t0)


def measure(model, loss_fn, sample_fn, image: bool, n: int) -> dict[str, float]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    train_obs, actions = obs(64, image), torch.rand(64, H, A) * 2 - 1

    def step():
        loss = loss_fn(train_obs, actions)
        opt.zero_grad()
        loss.backward()
        opt.step()

    model.eval()
    o1, o64 = obs(1, image), obs(64, image)
    lat1 = 1e3 / rate(lambda: sample_fn(o1), 4 * n)
    lat64 = 1e3 / rate(lambda: sample_fn(o64), n)
    model.train()
    return {"params": sum(p.numel() for p in model.parameters()), "upd/s": rate(step, n), "ms b1": lat1, "ms b64": lat64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    n = 5 if parser.parse_args().quick else 30
    torch.set_num_threads(1)  # one core, as on a robot's control computer
    torch.manual_seed(0)
    print(f"{'variant':<8} {'policy':<13} {'params':>9} {'upd/s':>8} {'ms/chunk b1':>12} {'ms/chunk b64':>13} {'10 Hz':>6}")
    for image in (True, False):
        name = "image" if image else "state"
        features = state_features(P, "proprio") | ({"image": Feature("image", (S, S, 3))} if image else {})
        flow = FlowPolicy(FlowPolicyConfig(features=features, action_dim=A, horizon=H, use_text=False))
        rows = {"flow (N=10)": measure(flow, lambda o, a: flow.bc_loss(o, a), lambda o: flow.sample(o), image, n)}
        hidden = 256
        while sum(p.numel() for p in GaussianMLPPolicy(image, hidden).parameters()) < rows["flow (N=10)"]["params"]:
            hidden += 32  # match the flow policy's size
        gauss = GaussianMLPPolicy(image, hidden)
        rows["mlp gaussian"] = measure(gauss, gauss.loss, gauss.sample, image, n)
        for policy, r in rows.items():
            ok = "yes" if r["ms b1"] < 100 else "no"
            print(f"{name:<8} {policy:<13} {r['params']:>9,} {r['upd/s']:>8.1f} {r['ms b1']:>12.2f} {r['ms b64']:>13.2f} {ok:>6}")
        f, g = rows["flow (N=10)"], rows["mlp gaussian"]
        print(f"{name:<8} {'flow / mlp':<13} {f['params'] / g['params']:>9.2f} {f['upd/s'] / g['upd/s']:>8.2f} "
              f"{f['ms b1'] / g['ms b1']:>12.2f} {f['ms b64'] / g['ms b64']:>13.2f}")


if __name__ == "__main__":
    main()
