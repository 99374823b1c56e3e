"""Trajectory-store ingest benchmark: recording overhead, ingest bandwidth, sampler speed.

Run from the checkout root::

    .venv/bin/python benchmarks/store_ingest.py            # full run, ~1-3 min on 2 cores
    .venv/bin/python benchmarks/store_ingest.py --quick    # smoke test (tiny sizes, 1-2 writers), < 20 s
    .venv/bin/python benchmarks/store_ingest.py --profile  # profile of the add/commit path only
    .venv/bin/python benchmarks/store_ingest.py --s3       # local disk vs S3 (moto on loopback) only
    .venv/bin/python benchmarks/store_ingest.py --s3-url s3://BUCKET/PREFIX  # ... vs a bucket of yours

Every figure is a ratio against a baseline measured in the same run, on the same
synthetic episodes, so the results mean something on a noisy shared machine.
Each episode has 200 steps; two variants are measured:

* ``A``: a 17-float32 state vector and a 4-float32 action per step;
* ``B``: the same plus a 64x64x3 uint8 camera image per step (a colour gradient,
  drifting blobs and a little sensor noise, so compression behaves like on
  camera frames rather than on random bytes).

What is measured:

1. Recording overhead per transition. A trivial gymnasium env replays
   precomputed arrays (so the env itself costs ~nothing). We time a bare
   rollout loop, the same loop calling ``ShardWriter.add`` every step plus
   ``commit`` per episode, and the same loop wrapped in Minari's
   ``DataCollector`` plus its final ``create_dataset``. Overhead =
   (loop time - bare time) / transitions. Minari runs with
   ``jpeg_encoding=False`` (lossless, like our store); for variant B its
   default lossy JPEG mode is shown too, for information. Target: ours/minari <= 1/6.
2. Ingest bandwidth with 1, 2 and 4 writer processes (spawned once, reused).
   Each process owns one shard of a single store and writes N episodes with
   ``write_episode``; the wall time runs from a start barrier until the last
   process has closed its writer. The ceiling is the same processes writing
   the same arrays with ``numpy.save`` (one file per episode) on the same
   filesystem. Bytes are the raw, uncompressed episode bytes. Two matched
   pairs, on the same episodes and process counts, so that each ceiling writes
   the same bytes to the same disk with the same durability as the store:

   * page cache: our writer with ``fsync=False`` (atomic, survives a killed
     writer, syncs nothing) against plain ``numpy.save`` (no sync);
   * durable: our writer with its default ``fsync=True`` (every file a commit wrote and
     every directory that gained a file synced, then the commit record) against
     ``numpy.save`` followed by ``f.flush(); os.fdatasync(f.fileno())`` per
     episode file and an fsync of its directory after creating the file.

   Comparing a durable writer with an unsynced ceiling (or the reverse) would
   measure the disk's sync latency, not the store. Target (variant B, each
   pair): >= 50% of the ceiling.
3. Sampler throughput: windows/s of ``WindowSampler.sample(256)`` with H=5
   (after warm-up) against the minimal numpy fancy indexing of the same data
   held in flat in-memory arrays (obs at t, obs at t+H, the action window and
   the discounted reward window). Target: >= 50%.

Each timing is repeated (``--repeats``; the short unsynced runs, ours and
numpy.save alike, three times as often) with the methods interleaved, and the fastest repeat counts
(``--verbose`` prints every repeat). The recording test and the sampler's store
use ``fsync=False``, as Minari syncs nothing either.

``--profile`` instead splits the add/commit path into phases by wall time and
prints a cProfile of it.

``--s3`` / ``--s3-url`` instead compare the store on a local disk with the store on object
storage (``bucket.py``), one writer in this process, on the same episodes of both variants:
ingest MB/s (``write_episode`` of every episode, then ``close``; the local writer with its
default ``fsync=True``, as an object store acknowledges a PUT once it is durable) and read MB/s
(a snapshot and ``load_shard`` of everything, checksums verified). ``--s3`` starts moto's S3
server on loopback (a Python server: its figures bound the store's request overhead, not a real
bucket's bandwidth); ``--s3-url`` writes under a new prefix of a bucket of yours (credentials from
the environment) and leaves it there.

The script never fails on a missed target: it prints PASS/MISS and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import shutil
import tempfile
import time
import warnings

import numpy as np

T = 200  # steps per episode
STATE_DIM, ACTION_DIM, IMAGE_SIDE = 17, 4, 64
HORIZON, BATCH = 5, 256
GAMMA = 0.99
PROCESS_COUNTS = (1, 2, 4)  # writer processes in the ingest test (--quick: 1 and 2)
PAGE_CACHE_SAMPLES = 3  # unsynced runs (ours and numpy.save) per repeat: they are short, so noise hits them harder
# Ingest methods, as pairs (ours, its ceiling) of the same durability; see the module docstring.
INGEST_PAIRS = {"page cache": ("store", "npy"), "durable": ("store_fsync", "npy_fsync")}
INGEST_LABELS = {"npy": "numpy.save", "npy_fsync": "numpy.save + fdatasync"}
VARIANTS = {"A": False, "B": True}  # variant name -> has a camera image
# Every array of an episode, in the order the numpy.save ceiling writes them.
FIELDS = ("state", "image", "action", "reward", "terminated", "truncated")

RECORDING_TARGET = 1 / 6  # ours/minari overhead per transition, at most
INGEST_TARGET = 0.5  # of the numpy.save ceiling, variant B, at least
SAMPLER_TARGET = 0.5  # of the numpy fancy-indexing ceiling, at least


# --- synthetic episodes ------------------------------------------------------------
def make_images(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` 64x64x3 uint8 frames: a colour gradient, three drifting blobs, sensor noise."""
    axis = np.linspace(0.0, 1.0, IMAGE_SIDE, dtype=np.float32)
    t = np.arange(n, dtype=np.float32)[:, None]
    # Three Gaussian blobs on slow Lissajous paths, as (frame, y, x, blob).
    speed, phase = rng.uniform(0.01, 0.05, (2, 3)), rng.uniform(0, 2 * np.pi, (2, 3))
    cx = 0.5 + 0.35 * np.sin(speed[0] * t + phase[0])
    cy = 0.5 + 0.35 * np.cos(speed[1] * t + phase[1])
    width = 2 * rng.uniform(0.06, 0.15, 3) ** 2
    gx = np.exp(-((axis[None, :, None] - cx[:, None, :]) ** 2) / width).astype(np.float32)
    gy = np.exp(-((axis[None, :, None] - cy[:, None, :]) ** 2) / width).astype(np.float32)
    blobs = gy[:, :, None, :] * gx[:, None, :, :]
    frames = blobs @ rng.uniform(-120, 120, (3, 3)).astype(np.float32)  # blob -> RGB colour
    slope = rng.uniform(-60, 60, (2, 3)).astype(np.float32)
    frames += rng.uniform(60, 180, 3).astype(np.float32) + axis[:, None, None] * slope[0] + axis[None, :, None] * slope[1]
    frames += np.frombuffer(rng.bytes(frames.size), np.uint8).reshape(frames.shape) & 7  # sensor noise, 0..7
    np.clip(frames, 0, 255, out=frames)
    return frames.astype(np.uint8)


def make_episode(seed: int, with_image: bool) -> dict[str, np.ndarray]:
    """One synthetic 200-step episode: observations have T + 1 rows, the rest T."""
    rng = np.random.default_rng(seed)
    t = np.arange(T + 1, dtype=np.float32)[:, None]
    freq, phase = rng.uniform(0.01, 0.1, STATE_DIM), rng.uniform(0, 2 * np.pi, STATE_DIM)
    state = np.sin(freq * t + phase) + 0.01 * rng.standard_normal((T + 1, STATE_DIM))
    afreq, aphase = rng.uniform(0.02, 0.2, ACTION_DIM), rng.uniform(0, 2 * np.pi, ACTION_DIM)
    action = np.tanh(1.5 * np.sin(afreq * t[:T] + aphase) + 0.1 * rng.standard_normal((T, ACTION_DIM)))
    episode = {
        "state": state.astype(np.float32),
        "action": action.astype(np.float32),
        "reward": (-0.1 * np.square(action).sum(axis=1) + state[:T, 0]).astype(np.float32),
        "terminated": np.zeros(T, dtype=bool),
        "truncated": np.arange(T) == T - 1,  # time limit
    }
    if with_image:
        episode["image"] = make_images(rng, T + 1)
    return episode


def episode_nbytes(episode: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in episode.values())


def make_schema(with_image: bool):
    from robo_post.store import ArraySpec, StoreSchema

    observations = {"state": ArraySpec("float32", (STATE_DIM,))}
    if with_image:
        observations["image"] = ArraySpec("uint8", (IMAGE_SIDE, IMAGE_SIDE, 3))
    return StoreSchema(observations=observations, action=ArraySpec("float32", (ACTION_DIM,), -1.0, 1.0))


# --- 1. recording overhead -------------------------------------------------------------
def make_replay_env(episodes: list[dict[str, np.ndarray]], with_image: bool):
    """A gymnasium env that replays ``episodes`` in order; its step costs ~nothing."""
    import gymnasium as gym

    class ReplayEnv(gym.Env):
        metadata = {"render_modes": []}

        def __init__(self):
            state = gym.spaces.Box(-np.inf, np.inf, (STATE_DIM,), np.float32)
            if with_image:
                image = gym.spaces.Box(0, 255, (IMAGE_SIDE, IMAGE_SIDE, 3), np.uint8)
                self.observation_space = gym.spaces.Dict({"state": state, "image": image})
            else:
                self.observation_space = state
            self.action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
            self._next, self._episode, self._t = 0, episodes[0], 0

        def _obs(self, t):
            ep = self._episode
            return {"state": ep["state"][t], "image": ep["image"][t]} if with_image else ep["state"][t]

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self._episode = episodes[self._next % len(episodes)]
            self._next += 1
            self._t = 0
            return self._obs(0), {}

        def step(self, action):
            self._t += 1
            t = self._t
            return self._obs(t), float(self._episode["reward"][t - 1]), False, t >= T, {}

    return ReplayEnv()


def rollout(env, episodes, writer=None, with_image=False) -> None:
    """Step ``env`` through every episode with its precomputed actions.

    With ``writer``: record each transition with ``add`` and ``commit`` each episode.
    """
    for episode in episodes:
        obs, _ = env.reset()
        for action in episode["action"]:
            next_obs, reward, terminated, truncated, _ = env.step(action)
            if writer is not None:
                writer.add(obs if with_image else {"state": obs}, action, reward, terminated, truncated)
            obs = next_obs
        if writer is not None:
            writer.commit(final_obs=obs if with_image else {"state": obs})


def time_bare(episodes, with_image) -> float:
    env = make_replay_env(episodes, with_image)
    start = time.perf_counter()
    rollout(env, episodes)
    return time.perf_counter() - start


def time_ours(episodes, with_image, root) -> float:
    """Timed: the rollout with add/commit and the final close (not: creating the store)."""
    from robo_post.store import Store

    store = Store.create(root, make_schema(with_image))
    env = make_replay_env(episodes, with_image)
    writer = store.writer("recorder", fsync=False)  # Minari syncs nothing either
    start = time.perf_counter()
    rollout(env, episodes, writer=writer, with_image=with_image)
    writer.close()
    elapsed = time.perf_counter() - start
    shutil.rmtree(root)
    return elapsed


def time_minari(episodes, with_image, dataset_id, jpeg) -> float:
    """Timed: the wrapped rollout and ``create_dataset`` (not: constructing the collector)."""
    import minari

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # missing author, env spec, ... are irrelevant here
        env = minari.DataCollector(make_replay_env(episodes, with_image), jpeg_encoding=jpeg)
        start = time.perf_counter()
        rollout(env, episodes)
        env.create_dataset(dataset_id, algorithm_name="replay", author="bench", author_email="-", code_permalink="-", description="-")
        elapsed = time.perf_counter() - start
        env.close()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Dataset ... deleted!"
        minari.delete_dataset(dataset_id)
    return elapsed


def bench_recording(variant: str, n_episodes: int, repeats: int, workdir: str) -> dict:
    with_image = VARIANTS[variant]
    episodes = [make_episode(1000 + i, with_image) for i in range(n_episodes)]
    tag = variant.lower()
    methods = {
        "bare": lambda r, eps: time_bare(eps, with_image),
        "ours": lambda r, eps: time_ours(eps, with_image, os.path.join(workdir, f"rec-{variant}-{r}")),
        "minari": lambda r, eps: time_minari(eps, with_image, f"bench{tag}/raw{r}-v0", jpeg=False),
    }
    if with_image:
        methods["minari_jpeg"] = lambda r, eps: time_minari(eps, with_image, f"bench{tag}/jpeg{r}-v0", jpeg=True)
    for name, fn in methods.items():  # warm-up: imports (jax, h5py, PIL), codec setup, caches
        fn(99, episodes[:1])
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(repeats):
        names = list(methods)
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order each repeat
            times[name].append(methods[name](r, episodes))
    transitions = n_episodes * T
    best = {name: min(ts) for name, ts in times.items()}
    overhead = {name: (best[name] - best["bare"]) / transitions * 1e6 for name in best if name != "bare"}
    return {"bare_us": best["bare"] / transitions * 1e6, "overhead_us": overhead, "raw_s": times}


# --- 2. ingest bandwidth ----------------------------------------------------------------
# Worker-process state: the start barriers (one per process count, reusable) and the
# episodes, generated once per process and variant (all processes write the same ones).
_BARRIERS: dict[int, object] = {}
_EPISODES: dict[tuple[int, bool], list[dict[str, np.ndarray]]] = {}


def _init_worker(barriers: dict[int, object]) -> None:
    global _BARRIERS
    _BARRIERS = barriers
    import robo_post.store  # noqa: F401  (pay the ~3 s import once per worker, never inside a run)


def wait_ready(n_procs: int) -> None:
    """Block until ``n_procs`` workers wait together, i.e. all of them have started."""
    _BARRIERS[n_procs].wait(timeout=600)


def ingest_episodes(n_episodes: int, with_image: bool) -> list[dict[str, np.ndarray]]:
    key = (n_episodes, with_image)
    if key not in _EPISODES:
        _EPISODES.clear()
        _EPISODES[key] = [make_episode(10_000 + i, with_image) for i in range(n_episodes)]
    return _EPISODES[key]


def ingest_worker(kind: str, root: str, index: int, n_episodes: int, with_image: bool, n_procs: int) -> tuple[float, float]:
    """Write ``n_episodes`` episodes after the start barrier; return (start, end).

    ``kind`` is ``"store"`` / ``"store_fsync"`` (shard ``client<index>`` of the store
    at ``root``, ``fsync`` False / True) or ``"npy"`` / ``"npy_fsync"`` (numpy.save
    into one file per episode under ``root``, then with ``_fsync`` the file
    fdatasync'd and its directory fsync'd). Times are ``time.monotonic()``, which on
    Linux is one clock for all processes.
    """
    episodes = ingest_episodes(n_episodes, with_image)
    if kind.startswith("store"):
        from robo_post.store import Store

        writer = Store.open(root).writer(f"client{index}", fsync=kind == "store_fsync")
        obs_keys = ("state", "image") if with_image else ("state",)

        def write(i, ep):
            writer.write_episode(
                {k: ep[k] for k in obs_keys}, ep["action"], rewards=ep["reward"], terminated=ep["terminated"], truncated=ep["truncated"]
            )

        close = writer.close
    else:
        directory = os.path.join(root, f"proc{index}")
        os.makedirs(directory, exist_ok=True)
        durable = kind == "npy_fsync"
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)

        def write(i, ep):
            with open(os.path.join(directory, f"episode{i:05d}.npy"), "wb") as f:
                for name in FIELDS:
                    if name in ep:
                        np.save(f, ep[name])
                if durable:
                    f.flush()
                    os.fdatasync(f.fileno())
            if durable:
                os.fsync(dir_fd)  # the new file's name

        def close():
            os.close(dir_fd)

    _BARRIERS[n_procs].wait(timeout=600)
    start = time.monotonic()
    for i, ep in enumerate(episodes):
        write(i, ep)
    close()
    return start, time.monotonic()


def run_ingest(pool, kind: str, root: str, n_procs: int, n_episodes: int, with_image: bool) -> float:
    """Wall seconds from the start barrier until the last of ``n_procs`` writers is done."""
    if kind.startswith("store"):
        from robo_post.store import Store

        Store.create(root, make_schema(with_image))
    else:
        os.makedirs(root)
    os.sync()  # settle writeback from earlier runs before timing this one
    spans = pool.starmap(ingest_worker, [(kind, root, i, n_episodes, with_image, n_procs) for i in range(n_procs)], chunksize=1)
    return max(end for _, end in spans) - min(start for start, _ in spans)


def bench_ingest(pool, variant: str, process_counts, n_episodes: int, repeats: int, workdir: str, keep_store: str) -> dict:
    """MB/s of each ingest method (``INGEST_PAIRS``) per process count; leaves the first
    store our unsynced writers made at the largest process count at ``keep_store``."""
    with_image = VARIANTS[variant]
    raw_per_episode = episode_nbytes(make_episode(0, with_image))
    mbps, raw = {}, {}
    for n_procs in process_counts:
        times: dict[str, list[float]] = {kind: [] for pair in INGEST_PAIRS.values() for kind in pair}
        for r in range(repeats):
            order = ["store", "npy"] * PAGE_CACHE_SAMPLES + ["store_fsync", "npy_fsync"]
            for i, kind in enumerate(order if r % 2 == 0 else order[::-1]):
                root = os.path.join(workdir, f"ingest-{variant}-{kind}-{n_procs}-{r}-{i}")
                times[kind].append(run_ingest(pool, kind, root, n_procs, n_episodes, with_image))
                if kind == "store" and n_procs == process_counts[-1] and not os.path.exists(keep_store):
                    os.rename(root, keep_store)
                else:
                    shutil.rmtree(root)
        total = raw_per_episode * n_episodes * n_procs
        mbps[n_procs] = {kind: total / min(ts) / 1e6 for kind, ts in times.items()}
        raw[n_procs] = times
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(keep_store, "shards")) for f in files)
    compression = raw_per_episode * n_episodes * process_counts[-1] / stored
    return {"mbps": mbps, "compression": compression, "raw_per_episode": raw_per_episode, "raw_s": raw}


# --- 3. sampler throughput ----------------------------------------------------------------
def bench_sampler(store_root: str, block_seconds: float, repeats: int) -> dict:
    """Windows/s of ``WindowSampler`` and of plain numpy indexing over the same episodes."""
    from robo_post.store import Store, WindowSampler

    snapshot = Store.open(store_root).snapshot()
    sampler = WindowSampler.from_snapshot(snapshot, horizon=HORIZON, gamma=GAMMA, seed=0)
    # What verifying every episode's checksum on load costs (the default; verify=False skips it).
    build_s: dict[str, list[float]] = {"verify": [], "no_verify": []}
    for _ in range(repeats):
        for name, verify in (("verify", True), ("no_verify", False)):
            start = time.perf_counter()
            WindowSampler.from_snapshot(Store.open(store_root).snapshot(verify=verify), horizon=HORIZON, gamma=GAMMA)
            build_s[name].append(time.perf_counter() - start)

    # The ceiling: the same data in flat numpy arrays, and only windows that fit inside
    # their episode, so one gather per output and no clamping or masks.
    obs_parts: dict[str, list[np.ndarray]] = {}
    actions, rewards, starts, rows = [], [], [], []
    n_steps = n_rows = 0
    for shard in sorted(snapshot.counts):
        data = snapshot.load_shard(shard)
        for key, arr in data["obs"].items():
            obs_parts.setdefault(key, []).append(arr)
        actions.append(data["action"])
        rewards.append(data["step"][:, 0].astype(np.float32))
        for ep in snapshot.episodes(client=shard):
            t = np.arange(ep.length - HORIZON + 1)
            starts.append(n_steps + ep.step_start + t)
            rows.append(n_rows + ep.obs_start + t)
        n_steps += len(data["action"])
        n_rows += len(next(iter(data["obs"].values())))
    obs = {key: np.concatenate(parts) for key, parts in obs_parts.items()}
    action, reward = np.concatenate(actions), np.concatenate(rewards)
    start_steps, start_rows = np.concatenate(starts), np.concatenate(rows)
    window = np.arange(HORIZON)
    discount = (GAMMA**window).astype(np.float32)
    rng = np.random.default_rng(0)

    def ceiling_batch():
        i = rng.integers(0, len(start_steps), BATCH)
        t, row = start_steps[i], start_rows[i]
        return (
            {k: v[row] for k, v in obs.items()},
            {k: v[row + HORIZON] for k, v in obs.items()},
            action[t[:, None] + window],
            reward[t[:, None] + window] @ discount,
        )

    methods = {"ours": lambda: sampler.sample(BATCH), "numpy": ceiling_batch}
    rates: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():
        fn(), fn()  # warm-up
    for r in range(repeats):
        for name in ("ours", "numpy") if r % 2 == 0 else ("numpy", "ours"):
            fn, batches = methods[name], 0
            start = time.perf_counter()
            while (elapsed := time.perf_counter() - start) < block_seconds:
                fn()
                batches += 1
            rates[name].append(batches * BATCH / elapsed)
    return {"windows_per_s": {name: max(rs) for name, rs in rates.items()}, "raw_windows_per_s": rates,
            "build_s": {name: min(ts) for name, ts in build_s.items()}}


# --- local disk vs object storage -------------------------------------------------------------
def bench_object_storage(n_episodes: int, repeats: int, workdir: str, target: str) -> dict:
    """Ingest and read MB/s of the store on a local disk and under the object store URL
    ``target``, interleaved, best of ``repeats``; per variant."""
    from robo_post.store import Store

    results = {}
    for variant, with_image in VARIANTS.items():
        episodes = [make_episode(20_000 + i, with_image) for i in range(n_episodes)]
        obs_keys = ("state", "image") if with_image else ("state",)
        total = episode_nbytes(episodes[0]) * n_episodes  # every episode has the same sizes
        times: dict[str, list[float]] = {f"{what} {where}": [] for what in ("ingest", "read") for where in ("local", "s3")}
        for r in range(repeats):
            for where in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
                root = (os.path.join(workdir, f"objects-{variant}-{r}") if where == "local"
                        else f"{target}/{variant}-{r}-{os.getpid()}")
                store = Store.create(root, make_schema(with_image))
                start = time.perf_counter()
                with store.writer("client0") as writer:
                    for ep in episodes:
                        writer.write_episode({k: ep[k] for k in obs_keys}, ep["action"], rewards=ep["reward"],
                                             terminated=ep["terminated"], truncated=ep["truncated"])
                times[f"ingest {where}"].append(time.perf_counter() - start)
                start = time.perf_counter()
                Store.open(root).snapshot(record=False).load_shard("client0")
                times[f"read {where}"].append(time.perf_counter() - start)
                if where == "local":
                    shutil.rmtree(root)
        results[variant] = {"mbps": {name: total / min(ts) / 1e6 for name, ts in times.items()}, "raw_s": times}
    return results


def print_object_storage(results: dict, target: str, args) -> None:
    print(f"\nstore on a local disk vs on object storage ({target}), {args.episodes} episodes of {T} steps, "
          f"one writer, best of {args.repeats}")
    print(f"{'variant':<8}{'measure':<10}{'local MB/s':>12}{'S3 MB/s':>10}{'S3/local':>10}")
    for variant, res in results.items():
        for what in ("ingest", "read"):
            local, s3 = res["mbps"][f"{what} local"], res["mbps"][f"{what} s3"]
            print(f"{variant:<8}{what:<10}{fmt(local):>12}{fmt(s3):>10}{s3 / local:>10.3f}")
    if args.verbose:
        for variant, res in results.items():
            for name, ts in res["raw_s"].items():
                print(f"  {variant} {name:<13} " + " ".join(f"{t:.4f}" for t in ts))


@contextlib.contextmanager
def local_s3():
    """moto's S3 server on loopback (tests/s3_server.py), its fake credentials in this process's
    environment while it runs."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from s3_server import running

    with running() as server:
        yield server


# --- profile of the commit path ---------------------------------------------------------------
def profile_commit(n_episodes: int, workdir: str) -> None:
    """Wall time of each phase of add/commit, then a cProfile of the same path.

    The phases are timed by wrapping, in this process only, the helpers that
    ``ShardWriter.commit`` calls, each array's chunk writer (encode + write files)
    and the commit record's sync (a no-op with ``fsync=False``, used here).
    """
    from robo_post.store import Store
    from robo_post.store import writer as writer_module

    helpers = ("stack_field", "validate_array", "episode_checksum")
    for variant, with_image in VARIANTS.items():
        episodes = [make_episode(2000 + i, with_image) for i in range(n_episodes)]
        root = os.path.join(workdir, f"profile-{variant}")
        writer = Store.create(root, make_schema(with_image)).writer("profiled", fsync=False)
        rollout(make_replay_env(episodes[:1], with_image), episodes[:1], writer=writer, with_image=with_image)  # warm

        phases: dict[str, float] = {}

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

            return wrapper

        originals = {name: getattr(writer_module, name) for name in helpers}
        for name, fn in originals.items():
            setattr(writer_module, name, timed(name, fn))
        for name, column in writer._columns.items():
            column.write = timed(f"chunk write {name}", column.write)
        writer._commit.sync = timed("commit record sync", writer._commit.sync)
        writer.commit = timed("commit (total)", writer.commit)
        writer.add = timed("add (total, all steps)", writer.add)
        try:
            start = time.perf_counter()
            rollout(make_replay_env(episodes, with_image), episodes, writer=writer, with_image=with_image)
            elapsed = time.perf_counter() - start
        finally:
            for name, fn in originals.items():
                setattr(writer_module, name, fn)
        for name in ("commit", "add"):
            del writer.__dict__[name]
        for column in writer._columns.values():
            del column.write
        del writer._commit.sync

        profiler = cProfile.Profile()
        profiler.enable()
        rollout(make_replay_env(episodes, with_image), episodes, writer=writer, with_image=with_image)
        profiler.disable()
        writer.close()
        shutil.rmtree(root)

        print(f"\n=== variant {variant}: add/commit of {n_episodes} episodes, "
              f"{elapsed / (n_episodes * T) * 1e6:.1f} us/transition in all ===")
        print("wall time per phase, ms per episode:")
        for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<36} {seconds / n_episodes * 1e3:8.3f}")
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        print("cProfile of the same rollout, main thread, top 15 by own time:")
        print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))


# --- report --------------------------------------------------------------------------------------
def fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def print_report(results: dict, args, runtime: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"robo-post store ingest benchmark ({T}-step episodes)", title_justify="left")
    for col in ("variant", "measure", "ours", "baseline", "baseline value", "ours/baseline", "target"):
        table.add_column(col, justify="left" if col in ("variant", "measure", "baseline") else "right", no_wrap=True)
    summary = []
    for variant, res in results.items():
        rec, ing, smp = res["recording"], res["ingest"], res["sampler"]["windows_per_s"]
        ours, minari = rec["overhead_us"]["ours"], rec["overhead_us"]["minari"]
        ratio = ours / minari
        target = f"<= {RECORDING_TARGET:.3f}"
        table.add_row(variant, "recording overhead, us/transition", fmt(ours), "minari, lossless", fmt(minari), f"{ratio:.3f}", target)
        summary.append((f"{variant}: recording overhead, ours/minari", ratio, ratio <= RECORDING_TARGET, target))
        if "minari_jpeg" in rec["overhead_us"]:
            jpeg = rec["overhead_us"]["minari_jpeg"]
            table.add_row("", "", "", "minari, default JPEG", fmt(jpeg), f"{ours / jpeg:.3f}", "info")
        table.add_row("", "  (bare loop, us/transition)", fmt(rec["bare_us"]), "", "", "", "")
        for pair, (ours_kind, ceiling_kind) in INGEST_PAIRS.items():
            for n_procs, mbps in ing["mbps"].items():
                ratio = mbps[ours_kind] / mbps[ceiling_kind]
                target = f">= {INGEST_TARGET:.2f}" if VARIANTS[variant] else "info"
                table.add_row("", f"ingest MB/s, {pair}, {n_procs} process{'es' if n_procs > 1 else ''}", fmt(mbps[ours_kind]),
                              INGEST_LABELS[ceiling_kind], fmt(mbps[ceiling_kind]), f"{ratio:.3f}", target)
                if VARIANTS[variant]:
                    summary.append((f"{variant}: ingest {pair}, {n_procs} proc, store/numpy", ratio, ratio >= INGEST_TARGET, target))
        table.add_row("", f"  (raw kB/episode {ing['raw_per_episode'] / 1e3:.0f}; raw/on-disk)", fmt(ing["compression"]), "", "", "", "")
        ratio = smp["ours"] / smp["numpy"]
        target = f">= {SAMPLER_TARGET:.2f}"
        table.add_row("", f"sampler windows/s, B={BATCH} H={HORIZON}", fmt(smp["ours"]), "numpy indexing", fmt(smp["numpy"]),
                      f"{ratio:.3f}", target)
        summary.append((f"{variant}: sampler, ours/numpy", ratio, ratio >= SAMPLER_TARGET, target))
        build = res["sampler"]["build_s"]
        table.add_row("", "sampler build s, checksums verified", fmt(build["verify"]), "verify=False",
                      fmt(build["no_verify"]), f"{build['verify'] / build['no_verify']:.3f}", "info")
        table.add_section()

    console = Console(width=132)
    console.print(table)
    console.print(f"{args.episodes} episodes per writer process, {args.record_episodes} recording episodes, "
                  f"best of {args.repeats} repeats ({PAGE_CACHE_SAMPLES * args.repeats} for unsynced writes), "
                  f"sampler blocks of {args.block_seconds} s; runtime {runtime:.0f} s")
    console.print("\nTargets:")
    for name, ratio, ok, target in summary:
        console.print(f"  {'PASS' if ok else 'MISS'}  {name:<46} {ratio:7.3f}  (target {target})")
    if args.verbose:
        console.print("\nEvery repeat (seconds, or windows/s for the sampler):")
        for variant, res in results.items():
            for name, ts in res["recording"]["raw_s"].items():
                console.print(f"  {variant} recording {name:<12} " + " ".join(f"{t:.4f}" for t in ts))
            for n_procs, kinds in res["ingest"]["raw_s"].items():
                for kind, ts in kinds.items():
                    console.print(f"  {variant} ingest {n_procs} proc {kind:<11} " + " ".join(f"{t:.4f}" for t in ts))
            for name, rs in res["sampler"]["raw_windows_per_s"].items():
                console.print(f"  {variant} sampler {name:<6} " + " ".join(f"{r:,.0f}" for r in rs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for details.")
    parser.add_argument("--episodes", type=int, default=None, help="episodes per writer process in the ingest test (default 24)")
    parser.add_argument("--record-episodes", type=int, default=None, help="episodes in the recording test (default 20)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats of each timing, the best counts (default 3)")
    parser.add_argument("--block-seconds", type=float, default=None, help="length of one timed sampler block (default 0.3)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 1-2 writer processes, for smoke testing")
    parser.add_argument("--profile", action="store_true", help="only profile the add/commit path, then exit")
    parser.add_argument("--verbose", action="store_true", help="also print every repeat's raw timing")
    parser.add_argument("--s3", action="store_true", help="only compare a local disk with S3 (moto on loopback)")
    parser.add_argument("--s3-url", default=None, help="only compare a local disk with object storage under this "
                        "URL (s3://BUCKET/PREFIX, credentials from the environment)")
    parser.add_argument("--out", default=None, help="parent directory for scratch files, on the disk to measure (default: system temp)")
    args = parser.parse_args()
    defaults = {"episodes": 24, "record_episodes": 20, "repeats": 3, "block_seconds": 0.3}
    if args.quick:
        defaults = {"episodes": 2, "record_episodes": 2, "repeats": 1, "block_seconds": 0.05}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)

    began = time.perf_counter()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="store_ingest-", dir=args.out)
    os.environ["MINARI_DATASETS_PATH"] = os.path.join(workdir, "minari")
    try:
        if args.profile:
            profile_commit(args.record_episodes, workdir)
            return
        if args.s3 or args.s3_url:
            with contextlib.ExitStack() as stack:
                target = args.s3_url.rstrip("/") + f"/store-ingest-{int(time.time())}" if args.s3_url else None
                if target is None:
                    target = f"s3://{stack.enter_context(local_s3()).bucket()}/store-ingest"
                results = bench_object_storage(args.episodes, args.repeats, workdir, target)
            print_object_storage(results, "moto's S3 server on loopback" if args.s3 and not args.s3_url else target, args)
            return

        def progress(what: str) -> None:
            print(f"[{time.perf_counter() - began:5.1f} s] {what}", flush=True)

        process_counts = PROCESS_COUNTS[:2] if args.quick else PROCESS_COUNTS
        n_workers = max(process_counts)
        ctx = mp.get_context("spawn")
        barriers = {n: ctx.Barrier(n) for n in process_counts}
        progress(f"starting {n_workers} spawned writer processes")
        pool = ctx.Pool(n_workers, initializer=_init_worker, initargs=(barriers,))
        results = {}
        try:
            pool.map(wait_ready, [n_workers] * n_workers, chunksize=1)  # every import done before any timing
            for variant in VARIANTS:
                progress(f"variant {variant}: recording overhead")
                recording = bench_recording(variant, args.record_episodes, args.repeats, workdir)
                progress(f"variant {variant}: ingest")
                keep = os.path.join(workdir, f"sampler-{variant}")
                ingest = bench_ingest(pool, variant, process_counts, args.episodes, args.repeats, workdir, keep)
                progress(f"variant {variant}: sampler")
                sampler = bench_sampler(keep, args.block_seconds, args.repeats)
                shutil.rmtree(keep)
                results[variant] = {"recording": recording, "ingest": ingest, "sampler": sampler}
        finally:
            pool.close()
            pool.join()
        print_report(results, args, time.perf_counter() - began)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
