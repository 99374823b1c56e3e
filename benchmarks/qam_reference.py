"""Our DIVL+QAM learner step against the QAM authors' JAX implementation, on one CPU thread.

    .venv/bin/python benchmarks/qam_reference.py \\
        --reference-python /path/to/jax-venv/bin/python --reference-repo /path/to/qam-checkout
    .venv/bin/python benchmarks/qam_reference.py --quick      # ours only when no reference is given

The reference is github.com/ColinQiyangLi/qam (``agents/qam.py``), imported from the
user's checkout by a worker subprocess in its own environment (jax/jaxlib 0.4.38,
flax 0.10.2, optax 0.2.4, distrax 0.1.5, tensorflow-probability 0.25, ml_collections);
none of its code is in this repository. Without both paths, or when the worker cannot
import it, the reference is skipped with one line saying why.

Workload (both sides): synthetic state-only batches, 31-d observation, chunks of 8 x 4
actions, batch 256, 10 flow steps, 2 critics, hidden width 256 and 512. Per width:

- ``actor``: ours ``QAM.update`` (SDE paths, lean adjoint, adjoint-matching regression,
  frozen base); theirs one jitted gradient step on ``actor_loss`` (the same three
  stages plus their co-trained BC flow loss on the base).
- ``full``: ours ``ActorCritic.update`` (DIVL value + critic step, target EMA, then the
  QAM step); theirs ``QAMAgent.update`` (critic TD step bootstrapping from a 10-step
  actor sample, BC + AM actor step, target EMAs).

Networks: ours as the learner builds them (policy: state encoder + 2-layer fusion MLP
once per batch, then a 3-layer velocity MLP per flow step; critic: its own encoder and
twin 3-layer LayerNorm heads); theirs at the authors' default depth (``--reference-depth``
hidden layers of the same width on concat(obs, action, t)). Timings are interleaved
(ours, theirs, ours, ...) so both see the same machine load; the printed ratio is
ours/reference updates/s per repetition, and its median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from robo_post.algos.actor_critic import ActorCritic
from robo_post.models.features import state_features
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig

OBS, HORIZON, ACTION, BATCH, FLOW_STEPS, NUM_Q = 31, 8, 4, 256, 10, 2

# The worker run by the reference's interpreter: builds their agent from their checkout, then
# answers "actor N" / "full N" lines with the seconds N updates took (after XLA finished).
WORKER = r"""
import json, sys, time
spec = json.loads(sys.argv[2])
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from agents.qam import QAMAgent, get_config

w, depth, B, H, A, O = spec["width"], spec["depth"], spec["batch"], spec["horizon"], spec["action"], spec["obs"]
config = get_config()
config.update(dict(actor_hidden_dims=(w,) * depth, value_hidden_dims=(w,) * depth, num_qs=spec["num_q"],
                   flow_steps=spec["flow_steps"], horizon_length=H, action_chunking=True, batch_size=B))
rng = np.random.default_rng(0)
f32 = lambda *s: jnp.asarray(rng.standard_normal(s), dtype=jnp.float32)
batch = {"observations": f32(B, O), "next_observations": f32(B, H, O),
         "actions": jnp.clip(f32(B, H, A), -1, 1), "rewards": jnp.asarray(rng.random((B, H)), dtype=jnp.float32),
         "masks": jnp.ones((B, H), jnp.float32), "valid": jnp.ones((B, H), jnp.float32)}
agent = QAMAgent.create(0, batch["observations"][0], batch["actions"][0, 0], dict(config))  # one unbatched example, as their main.py

@jax.jit
def actor_step(agent, batch):
    rng, next_rng = jax.random.split(agent.rng)
    network, info = agent.network.apply_loss_fn(loss_fn=lambda params: agent.actor_loss(batch, params, rng))
    return agent.replace(network=network, rng=next_rng), info

steps = {"actor": actor_step, "full": lambda agent, batch: agent.update(batch)}
for step in steps.values():  # compile both before any timing
    agent, info = step(agent, batch)
jax.block_until_ready((agent.network.params, info))
print("ready", flush=True)
for line in sys.stdin:
    kind, n = line.split()
    t0 = time.perf_counter()
    for _ in range(int(n)):
        agent, info = steps[kind](agent, batch)
    jax.block_until_ready((agent.network.params, info))
    print(time.perf_counter() - t0, flush=True)
"""


# The offline worker: trains their agent on a dataset file as their main.py does (sequences of
# ``horizon`` steps at their batch size), prints "ready" with its wall time, then answers each line
# of JSON observations (N, D) with JSON actions (N, horizon * A) sampled as their evaluation does.
OFFLINE_WORKER = r"""
import json, sys, time
spec = json.loads(sys.argv[2])
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
from agents.qam import QAMAgent, get_config
from utils.datasets import Dataset

np.random.seed(spec["seed"])  # their sample_sequence draws from numpy's global generator
data = Dataset.create(**{k: v for k, v in np.load(spec["data"]).items()})
config = get_config()
config.update(dict(horizon_length=spec["horizon"], action_chunking=True, batch_size=spec["batch"],
                   discount=spec["discount"], **spec["config"]))
example = data.sample(())
agent = QAMAgent.create(spec["seed"], example["observations"], example["actions"], dict(config))
t0 = time.perf_counter()
for _ in range(spec["updates"]):
    agent, info = agent.update(data.sample_sequence(config["batch_size"], sequence_length=spec["horizon"],
                                                    discount=config["discount"]))
jax.block_until_ready(agent.network.params)
print("ready", json.dumps({"wall_s": time.perf_counter() - t0,
                           "final": {k: float(v) for k, v in info.items() if np.ndim(v) == 0}}), flush=True)
rng = jax.random.PRNGKey(spec["seed"])
for line in sys.stdin:
    rng, key = jax.random.split(rng)
    actions = agent.sample_actions(np.asarray(json.loads(line), np.float32), rng=key)
    print(json.dumps(np.asarray(actions).tolist()), flush=True)
"""


def _worker(python: str, code: str, repo: str, spec: dict) -> tuple[subprocess.Popen, str]:
    """Start ``code`` under ``python`` on one CPU thread; (process, the rest of its "ready" line)."""
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
               JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([python, "-c", code, repo, json.dumps(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    head, _, rest = proc.stdout.readline().strip().partition(" ")
    if head != "ready":
        err = proc.communicate()[1].strip().splitlines()
        errors = [e for e in err if e.split(":")[0].endswith(("Error", "Exception"))]  # the raised error's line
        raise RuntimeError((errors or err or [f"worker exited with {proc.returncode}"])[-1])
    return proc, rest


def reference_problem(python: str | None, repo: str | None) -> str | None:
    """Why the authors' QAM cannot run from these paths (None when it can be tried)."""
    if not (python and repo):
        return "pass --reference-python and --reference-repo"
    if not os.path.exists(os.path.join(repo, "agents", "qam.py")):
        return f"no agents/qam.py in {repo}"
    if not os.path.exists(python):
        return f"no interpreter at {python}"
    return None


def write_reference_dataset(snap: Any, episodes: list, key: str, low: np.ndarray, high: np.ndarray, path: str) -> int:
    """Store episodes -> their ``Dataset`` fields in an ``.npz`` (returns the transition count):
    actions scaled from [low, high] to [-1, 1] and clipped 1e-5 inside, as their loader clips;
    ``terminals`` ends each episode, ``masks`` is 0 only after a true termination (a time-out
    bootstraps, as in their D4RL loader). A one-dimensional action gets a second coordinate fixed
    at 0: their vector field squeezes a one-dimensional output, which breaks its own sampler."""
    fields: dict[str, list] = {k: [] for k in ("observations", "actions", "rewards", "next_observations",
                                               "terminals", "masks")}
    for ep in episodes:
        d = snap.load(ep)
        o, a = d["obs"][key].astype(np.float32), d["action"].astype(np.float32)
        end = np.zeros(len(a), np.float32)
        end[-1] = 1.0
        fields["observations"].append(o[:-1])
        fields["next_observations"].append(o[1:])
        a = np.clip(2 * (a - low) / (high - low) - 1, -1 + 1e-5, 1 - 1e-5)
        fields["actions"].append(np.pad(a, ((0, 0), (0, max(0, 2 - a.shape[1])))))
        fields["rewards"].append(d["reward"].astype(np.float32))
        fields["terminals"].append(end)
        fields["masks"].append(1.0 - end * float(ep.terminated))
    arrays = {k: np.concatenate(v) for k, v in fields.items()}
    np.savez(path, **arrays)
    return len(arrays["rewards"])


class OfflineReference:
    """The authors' QAM trained offline in a worker process on ``data`` (``write_reference_dataset``)
    for ``updates`` at ``batch``, one action per decision, their settings updated by ``config``;
    then ``predict(obs) -> actions`` in the env's units, like a d3rlpy policy. ``info``: their
    wall time and last update's metrics."""

    def __init__(self, python: str, repo: str, data: str, updates: int, batch: int, discount: float, seed: int,
                 low: np.ndarray, high: np.ndarray, config: dict[str, Any]):
        spec = {"data": data, "updates": updates, "batch": batch, "discount": discount, "seed": seed, "horizon": 1,
                "config": config}
        self.proc, ready = _worker(python, OFFLINE_WORKER, repo, spec)
        self.info = json.loads(ready)
        self.low, self.high = low, high

    def predict(self, obs: np.ndarray) -> np.ndarray:
        self.proc.stdin.write(json.dumps(np.asarray(obs, np.float32).tolist()) + "\n")
        self.proc.stdin.flush()
        actions = np.asarray(json.loads(self.proc.stdout.readline()), np.float32)
        return self.low + (actions[:, : len(self.low)] + 1) / 2 * (self.high - self.low)  # less the padding

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Reference:
    """The authors' agent in a worker process; ``time(kind, n)`` -> seconds for n updates."""

    def __init__(self, python: str, repo: str, spec: dict):
        self.proc, _ = _worker(python, WORKER, repo, spec)

    def time(self, kind: str, n: int) -> float:
        self.proc.stdin.write(f"{kind} {n}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def ours(width: int) -> tuple[ActorCritic, dict]:
    """Our DIVL+QAM method at ``width`` (critic warm-up off) and one synthetic batch."""
    torch.manual_seed(0)
    reference = FlowPolicy(FlowPolicyConfig(features=state_features(OBS), action_dim=ACTION, horizon=HORIZON,
                                            use_text=False, hidden_dim=width, flow_steps=FLOW_STEPS))
    method = ActorCritic("divl_qam", reference, critic={"num_q": NUM_Q})
    g = torch.Generator().manual_seed(0)
    batch = {"obs": {"state": torch.randn(BATCH, OBS, generator=g)},
             "next_obs": {"state": torch.randn(BATCH, OBS, generator=g)},
             "actions": (torch.randn(BATCH, HORIZON, ACTION, generator=g)).clamp(-1, 1),
             "rewards": torch.rand(BATCH, generator=g), "discounts": torch.full((BATCH,), 0.99 ** HORIZON)}
    return method, batch


def time_ours(method: ActorCritic, batch: dict, kind: str, n: int, amp: bool = False) -> float:
    critic_fn = method.value.critic_fn(method.actor.config.q_net)
    step = (lambda: method.actor.update(batch, critic_fn)) if kind == "actor" else (lambda: method.update(batch))
    t0 = time.perf_counter()
    for _ in range(n):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):  # as train_loop does with amp=bf16
            metrics = step()
    torch.stack(list(metrics.values())).sum().item()  # wait for the queued work (a no-op on CPU)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference-python", help="python of an environment with the reference's dependencies")
    parser.add_argument("--reference-repo", help="checkout of github.com/ColinQiyangLi/qam")
    parser.add_argument("--reference-depth", type=int, default=4, help="hidden layers of their MLPs (their default 4)")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--updates", type=int, default=10, help="updates per timed repetition")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions per cell")
    parser.add_argument("--quick", action="store_true", help="3 updates x 2 repetitions")
    parser.add_argument("--amp", choices=["bf16"], help="run ours under bfloat16 autocast (train's amp=bf16)")
    args = parser.parse_args()
    n, reps = (3, 2) if args.quick else (args.updates, args.reps)
    torch.set_num_threads(1)
    problem = reference_problem(args.reference_python, args.reference_repo)
    skip = None if problem is None else f"reference skipped: {problem}"
    print(f"one CPU thread; obs {OBS}, chunk {HORIZON}x{ACTION}, batch {BATCH}, {FLOW_STEPS} flow steps, {NUM_Q} critics; "
          f"{reps} interleaved repetitions of {n} updates per cell; ours {'bf16 autocast' if args.amp else 'fp32'}")
    if skip:
        print(skip)
    print(f"{'width':>6} {'step':<6} {'ours upd/s':>11} {'ref upd/s':>10} {'ours/ref':>9}  per repetition")
    for width in args.widths:
        method, batch = ours(width)
        reference = None
        if skip is None:
            spec = {"width": width, "depth": args.reference_depth, "batch": BATCH, "horizon": HORIZON,
                    "action": ACTION, "obs": OBS, "flow_steps": FLOW_STEPS, "num_q": NUM_Q}
            try:
                reference = Reference(args.reference_python, args.reference_repo, spec)
            except (OSError, RuntimeError) as e:
                skip = f"reference skipped: its worker failed to start: {e}"
                print(skip)
        for kind in ("actor", "full"):
            time_ours(method, batch, kind, 2, args.amp == "bf16")  # warm-up
            mine, theirs = [], []
            for _ in range(reps):
                mine.append(n / time_ours(method, batch, kind, n, args.amp == "bf16"))
                if reference is not None:
                    theirs.append(n / reference.time(kind, n))
            if reference is None:
                print(f"{width:>6} {kind:<6} {statistics.median(mine):>11.2f} {'-':>10} {'-':>9}")
                continue
            ratios = [a / b for a, b in zip(mine, theirs)]
            print(f"{width:>6} {kind:<6} {statistics.median(mine):>11.2f} {statistics.median(theirs):>10.2f} "
                  f"{statistics.median(ratios):>9.2f}  {' '.join(f'{r:.2f}' for r in ratios)}", flush=True)
        if reference is not None:
            reference.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
