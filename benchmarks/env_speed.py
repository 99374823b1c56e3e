"""Tabletop env throughput: control steps per second, state-only vs with images.

Each row measures the state-only env (the baseline) and the image variants in the
same run, and prints their ratio. Run: ``python benchmarks/env_speed.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np

from robo_post.envs.tabletop import TASKS, TabletopEnv


def steps_per_second(task: str, n_steps: int, **env_kwargs) -> float:
    """Steps/s of ``TabletopEnv(task, **env_kwargs)`` under seeded random actions, resets included."""
    env = TabletopEnv(task, **env_kwargs)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(n_steps, 4)).astype(np.float32)
    env.reset(seed=0)
    start = time.perf_counter()
    for i, action in enumerate(actions):
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset(seed=i)
    elapsed = time.perf_counter() - start
    env.close()
    return n_steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="control steps per measurement")
    parser.add_argument("--image-size", type=int, default=64)
    args = parser.parse_args()

    print(f"{'task':<6} {'state':>8} {'image':>8} {'image/4':>8} {'image/state':>12} {'image/4/state':>14}")
    for task in TASKS:
        state = steps_per_second(task, args.steps, render_images=False)
        image = steps_per_second(task, args.steps, render_images=True, image_size=args.image_size)
        every4 = steps_per_second(
            task, args.steps, render_images=True, image_size=args.image_size, render_every=4
        )
        print(f"{task:<6} {state:8.0f} {image:8.0f} {every4:8.0f} {image / state:12.2f} {every4 / state:14.2f}")
    print(f"steps/s; image = {args.image_size}x{args.image_size} every step, image/4 = render_every=4")


if __name__ == "__main__":
    main()
