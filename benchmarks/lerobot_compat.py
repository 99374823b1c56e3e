"""Our LeRobot v3.0 files against the ``lerobot`` package itself, run in its own environment.

    .venv/bin/python benchmarks/lerobot_compat.py --lerobot-python /path/to/lerobot-venv/bin/python \\
        [--out benchmarks/results/lerobot_compat.json]

Not a timing: a table of PASS/FAIL checks (SKIP where lerobot itself cannot do its part).
Without ``--lerobot-python``, or when that interpreter cannot import
``lerobot.datasets.lerobot_dataset``, it prints one line saying why and exits 0; otherwise it
exits 1 when a check fails.

lerobot cannot share the project's venv (0.6.x needs Python 3.12, 0.4.x pins an older torch):
set one up apart, e.g. (lerobot 0.4.4 on Python 3.11, as checked here; torch is the CPU
build the registry gives for that pin; lerobot's own pins are bypassed with ``--no-deps``)::

    python3.11 -m venv ~/lerobot-venv
    ~/lerobot-venv/bin/pip install --no-deps lerobot==0.4.4 torchvision==0.28.0 torchcodec==0.13.0
    ~/lerobot-venv/bin/pip install torch==2.13.0 "numpy<2.4" "datasets>=4,<5" "huggingface-hub>=0.34.2,<0.36" \\
        pandas pyarrow "av>=15,<16" "jsonlines>=4,<5" "packaging>=24.2,<26" pillow fsspec draccus==0.10.0 \\
        "termcolor>=2.4,<4" "deepdiff>=7,<9" "einops>=0.8,<0.9" "accelerate>=1.10,<2"

numpy < 2.4: lerobot 0.4.4's ``save_episode`` hands shape-(1,) features (``next.reward``, ...)
to ``datasets`` as arrays, which numpy 2.4 no longer converts to scalars (the reverse
direction then reports SKIP with that reason; reading is unaffected).

torchcodec (lerobot's default video decoder) needs the system's FFmpeg libraries (Debian:
``apt-get install libavcodec59 libavformat59 libavutil57 libswscale6 libswresample4
libavdevice59 libavfilter8``). Where it cannot decode, the worker replaces lerobot's
``decode_video_frames`` by a PyAV decoder with the same contract (frames nearest the queried
timestamps, within ``tolerance_s``; float32 (C, H, W) in [0, 1]) and says so: lerobot 0.4.4's
other backend calls ``torchvision.io.VideoReader``, which torchvision 0.28 no longer has.
Where torchvision's C++ ops do not load (the registry's wheel is a CUDA build), the worker
defines the two op schemas ``torchvision`` registers unconditionally (``nms``, ``qnms``) so
that ``import torchvision`` succeeds; lerobot's dataset code uses only ``transforms``. Both
workarounds are listed in the output. Nothing touches the network: the worker runs with
``HF_HUB_OFFLINE=1`` and lerobot's hub calls replaced by ones that raise.

Our side (this venv) builds a store with the project's own tooling: a float64 state with
names, a float32 action, rewards, terminated and truncated episodes, an instruction (one
episode without: it exports its task id), a 64x48 camera, a float32 extra; 4 episodes of
5, 12, 3 and 9 steps in 2 shards. It exports it with ``export_lerobot`` three ways:

- ``video``: H.264 (our default), tiny file limits so data and video span several files;
- ``video_av1``: AV1 (lerobot's default codec), default file limits;
- ``images``: PNG frames embedded in the data files (``--images``).

The worker loads each folder with ``LeRobotDataset(repo_id, root=PATH)`` (local root only)
and reads every frame through ``__getitem__``, plus action chunks and camera pairs through
``delta_timestamps`` (lerobot's training path: padding at episode ends). Checks: episode and
frame counts, features, tasks, per-episode metadata, meta/stats.json; per frame state,
action, reward, done, truncated, extra, timestamp, indices and task exactly; camera frames
exactly (PNG) or at least ``MIN_PSNR_DB`` per episode (video, the bound tests/test_lerobot.py
asserts for our own round trip) and each decoded frame nearest its own source frame.

Reverse: the worker writes a dataset with ``LeRobotDataset.create`` / ``add_frame`` /
``save_episode`` / ``finalize`` (video and image variants) from arrays this side made, and
reads it back with lerobot; ``import_lerobot(..., success_from="feature:next.success")``
imports it and every array is compared with what was written (camera frames: PNG exactly;
video against lerobot's own decoding of the same file, and against the source frames).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from robo_post.store import ArraySpec, Store, StoreSchema
from robo_post.store.lerobot_io import export_lerobot, import_lerobot

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_lerobot import camera_frames  # noqa: E402  (the tests' synthetic camera, at H x W below)

# The per-episode PSNR bound tests/test_lerobot.py asserts for our own video round trip.
MIN_PSNR_DB = 30.0
LENGTHS = (5, 12, 3, 9)
REVERSE_LENGTHS = (4, 7, 5)
REVERSE_TASKS = ["stack the blocks", "wipe the table", "stack the blocks"]
H, W = 48, 64
FPS = 10
INSTRUCTIONS = ["pick the cube", "open the drawer", "pick the cube", ""]
DELTA_STEPS = 4  # action chunk length asked through delta_timestamps
SCHEMA = StoreSchema(
    observations={
        "state": ArraySpec("float64", (4,), low=-5.0, high=5.0, unit="m"),
        "image": ArraySpec("uint8", (H, W, 3)),
    },
    action=ArraySpec("float32", (2,), low=-1.0, high=1.0),
    extras={"logits": ArraySpec("float32", (3,))},
    attrs={"robot": "arm", "lerobot": {"names": {"observation.state": ["x", "y", "z", "gripper"],
                                                 "action": ["dx", "dy"]}}},
)

# Run by lerobot's interpreter: argv[1] is a JSON spec {"mode": probe | read | write, "out": path, ...};
# the answer is written as JSON to spec["out"] (lerobot logs to stdout and stderr).
WORKER = r'''
import importlib.util, json, os, sys, time, traceback
spec = json.loads(sys.argv[1])
notes = []
out = {"notes": notes}

def finish():
    with open(spec["out"], "w") as f:
        json.dump(out, f)

try:
    import numpy as np
    import torch
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
    finish()
    sys.exit(0)
torch.set_num_threads(1)

# torchvision: the registry's wheel is a CUDA build; without its C++ ops, `import torchvision` fails on the
# fake-kernel registration of nms/qnms (the only ones not guarded by _has_ops). Define their schemas first.
tv = importlib.util.find_spec("torchvision")
if tv is not None:
    lib_path = os.path.join(list(tv.submodule_search_locations)[0], "_C.so")
    try:
        torch.ops.load_library(lib_path)
    except Exception as e:
        global_tv_lib = torch.library.Library("torchvision", "DEF")
        global_tv_lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        global_tv_lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        notes.append("torchvision's C++ ops do not load here (" + str(e).splitlines()[0][:120] + "): defined the "
                     "nms/qnms op schemas so that `import torchvision` succeeds (lerobot's dataset code uses only "
                     "torchvision.transforms)")

try:
    import lerobot
    from importlib.metadata import version
    out["lerobot"] = version("lerobot")
    out["packages"] = {}
    for name in ("torch", "torchvision", "torchcodec", "numpy", "datasets", "huggingface-hub", "pyarrow", "pandas",
                 "av"):
        try:
            out["packages"][name] = version(name)
        except Exception:
            out["packages"][name] = None
    import lerobot.datasets.lerobot_dataset as lds
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
    finish()
    sys.exit(0)

def offline(name):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"network access attempted: {name}")
    return refuse
for name in ("snapshot_download", "get_safe_version", "HfApi"):
    if hasattr(lds, name):
        setattr(lds, name, offline(name))

# Video decoding: lerobot's default (torchcodec) when it decodes here, else PyAV with the same contract.
backend = lds.get_safe_default_codec()
probe = spec.get("probe_video")
if spec.get("force_pyav"):
    notes.append("--pyav-decoder: lerobot's default decoder not used")
    backend = None
elif backend == "torchcodec":
    try:
        from torchcodec.decoders import VideoDecoder
        if probe:
            VideoDecoder(probe, seek_mode="approximate").get_frames_at(indices=[0])
    except Exception as e:
        notes.append("torchcodec cannot decode here (" + str(e).strip().splitlines()[0][:160] + ")")
        backend = None
else:
    notes.append("torchcodec is not installed")
    backend = None
if backend is None:
    import av
    from lerobot.datasets.video_utils import FrameTimestampError

    def decode_video_frames(video_path, timestamps, tolerance_s, backend=None):
        frames, pts = [], []
        with av.open(str(video_path)) as container:
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                frames.append(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1))
                pts.append(float(frame.pts * stream.time_base))
                if pts[-1] >= max(timestamps) - tolerance_s:
                    break
        dist = (torch.tensor(timestamps)[:, None] - torch.tensor(pts)[None, :]).abs()
        min_, argmin_ = dist.min(1)
        if not (min_ < tolerance_s).all():
            raise FrameTimestampError(f"queried {timestamps}, nearest frames {min_.tolist()} s away in {video_path}")
        return torch.stack([frames[i] for i in argmin_]).float() / 255

    lds.decode_video_frames = decode_video_frames
    backend = "pyav (lerobot's decode_video_frames replaced: lerobot 0.4.4's 'pyav' backend needs "\
              "torchvision.io.VideoReader, gone from torchvision 0.28)"
out["video_backend"] = backend

def jsonable(x):
    if isinstance(x, torch.Tensor):
        x = x.numpy()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x

def camera(x):
    """lerobot's float32 (C, H, W) in [0, 1] -> uint8 (H, W, C) as nested lists."""
    return (x.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).tolist()

def read(root, repo_id, delta_indices):
    ds = LeRobotDataset(repo_id, root=root)
    meta = ds.meta
    cams = list(meta.camera_keys)
    out.update({
        "codebase_version": meta.info["codebase_version"], "fps": ds.fps, "num_episodes": ds.num_episodes,
        "num_frames": ds.num_frames, "total_tasks": meta.total_tasks, "robot_type": meta.robot_type,
        "features": jsonable(meta.features), "camera_keys": cams, "video_keys": list(meta.video_keys),
        "tasks": {str(t): int(i) for t, i in zip(meta.tasks.index, meta.tasks["task_index"])},
        "episodes": [{k: jsonable(e[k]) for k in ("episode_index", "length", "dataset_from_index",
                                                   "dataset_to_index", "tasks")} for e in meta.episodes],
        "stats": {k: {s: jsonable(v) for s, v in st.items()} for k, st in (meta.stats or {}).items()},
    })
    table = ds.hf_dataset.data.table  # the parquet columns as lerobot loaded them, before its torch transform
    out["raw"] = table.select([c for c in table.column_names if c not in cams]).to_pydict()
    items = []
    for i in range(len(ds)):
        item = ds[i]
        items.append({k: (camera(v) if k in cams else jsonable(v)) for k, v in item.items()})
    out["items"] = items
    out["item_types"] = {k: [str(getattr(v, "dtype", type(v).__name__)), list(getattr(v, "shape", ()))]
                         for k, v in ds[0].items()}
    if delta_indices:
        fps = ds.fps
        deltas = {"action": [k / fps for k in range(spec["delta_steps"])], **{c: [-1 / fps, 0.0] for c in cams}}
        dd = LeRobotDataset(repo_id, root=root, delta_timestamps=deltas)
        chunks = {}
        for i in delta_indices:
            item = dd[i]
            chunks[str(i)] = {k: ([camera(f) for f in v] if k in cams else jsonable(v)) for k, v in item.items()
                              if k == "action" or k in cams or k.endswith("_is_pad")}
        out["deltas"] = chunks

try:
    if spec["mode"] == "read":
        t0 = time.perf_counter()
        read(spec["root"], spec["repo_id"], spec.get("delta_indices"))
        out["seconds"] = time.perf_counter() - t0
    elif spec["mode"] == "write":
        data = np.load(spec["data"])
        use_videos = spec["use_videos"]
        features = {
            "observation.state": {"dtype": "float32", "shape": (4,), "names": ["x", "y", "z", "gripper"]},
            "observation.images.front": {"dtype": "video" if use_videos else "image", "shape": tuple(spec["shape"]),
                                         "names": ["height", "width", "channels"]},
            "action": {"dtype": "float32", "shape": (2,), "names": ["dx", "dy"]},
            "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
            "next.done": {"dtype": "bool", "shape": (1,), "names": None},
            "next.success": {"dtype": "bool", "shape": (1,), "names": None},
        }
        t0 = time.perf_counter()
        try:
            ds = LeRobotDataset.create(spec["repo_id"], fps=spec["fps"], features=features, root=spec["root"],
                                       robot_type="so100", use_videos=use_videos, vcodec=spec["vcodec"],
                                       encoder_threads=1)
            start = 0
            for ep, (T, task) in enumerate(zip(spec["lengths"], spec["tasks"])):
                for t in range(T):
                    j = start + t
                    ds.add_frame({"observation.state": data["state"][j], "observation.images.front": data["image"][j],
                                  "action": data["action"][j], "next.reward": data["reward"][j:j + 1],
                                  "next.done": data["done"][j:j + 1], "next.success": data["success"][j:j + 1],
                                  "task": task})
                ds.save_episode()
                start += T
            ds.finalize()
        except Exception as e:
            out["write_error"] = f"{type(e).__name__}: {e}"
            if "0-dimensional" in str(e):
                out["write_error"] += (f" (numpy {np.__version__}: lerobot 0.4.4's save_episode passes shape-(1,) "
                                       "features to datasets as arrays, which numpy >= 2.4 will not turn into scalars; "
                                       "install numpy<2.4 in lerobot's venv)")
            out["traceback"] = traceback.format_exc()[-2000:]
            finish()
            sys.exit(0)
        out["write_seconds"] = time.perf_counter() - t0
        out["info"] = json.load(open(os.path.join(spec["root"], "meta", "info.json")))
        read(spec["root"], spec["repo_id"], None)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
    out["traceback"] = traceback.format_exc()[-3000:]
finish()
'''


class Worker:
    """Runs WORKER under lerobot's interpreter, offline, its caches in ``scratch``."""

    def __init__(self, python: str, scratch: str):
        self.python, self.scratch = python, scratch
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                        HF_HOME=os.path.join(scratch, "hf-home"), HF_LEROBOT_HOME=os.path.join(scratch, "lerobot-home"),
                        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
        self.env.pop("PYTHONPATH", None)
        self.calls = 0

    def __call__(self, spec: dict, timeout: float = 600) -> dict:
        self.calls += 1
        spec = dict(spec, out=os.path.join(self.scratch, f"worker-{self.calls}.json"))
        proc = subprocess.run([self.python, "-c", WORKER, json.dumps(spec)], capture_output=True, text=True,
                              env=self.env, timeout=timeout, cwd=self.scratch)
        if not os.path.exists(spec["out"]):
            err = (proc.stderr or proc.stdout).strip().splitlines()
            errors = [e for e in err if e.split(":")[0].endswith(("Error", "Exception"))]
            raise RuntimeError((errors or err or [f"worker exited with {proc.returncode}"])[-1])
        with open(spec["out"]) as f:
            return json.load(f)


def lerobot_problem(python: str | None, worker: Worker | None) -> tuple[str | None, dict]:
    """Why lerobot cannot be checked from this interpreter (None when it can), and the probe's answer."""
    if not python:
        return "pass --lerobot-python PATH (the python of a venv with lerobot, see --help)", {}
    if not os.path.exists(python):
        return f"no interpreter at {python}", {}
    try:
        answer = worker({"mode": "probe"}, timeout=300)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"its interpreter failed: {e}", {}
    if "error" in answer:
        return f"it cannot import lerobot.datasets.lerobot_dataset: {answer['error']}", answer
    return None, answer


# --- our side: the store and what it should read as -------------------------------------------
def build_store(root: str) -> Store:
    rng = np.random.default_rng(0)
    store = Store.create(root, SCHEMA)
    writers = {c: store.writer(c) for c in ("robot-a", "robot-b")}
    for i, T in enumerate(LENGTHS):
        done, terminated = np.arange(T) == T - 1, i % 2 == 0
        writers[("robot-a", "robot-b")[i % 2]].write_episode(
            {"state": rng.uniform(-5, 5, (T + 1, 4)), "image": camera_frames(T + 1, rng, H, W)},
            rng.uniform(-1, 1, (T, 2)).astype(np.float32),
            rewards=rng.normal(size=T), terminated=done & terminated, truncated=done & (not terminated),
            task_id=f"task-{i % 2}", instruction=INSTRUCTIONS[i], success=[True, None, False, True][i],
            role="demo", extras={"logits": rng.normal(size=(T, 3)).astype(np.float32)})
    for w in writers.values():
        w.close()
    return store


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0 ** 2 / mse))


def expected_frames(store: Store) -> list[dict[str, Any]]:
    """What lerobot should return per global frame index, in export order (the snapshot's)."""
    snap = store.snapshot()
    frames, index = [], 0
    for ep, info in enumerate(snap.episodes()):
        d = snap.load(info)
        T = info.length
        for t in range(T):
            frames.append({
                "observation.state": d["obs"]["state"][t], "observation.image": d["obs"]["image"][t],
                "action": d["action"][t], "logits": d["extras"]["logits"][t], "next.reward": d["reward"][t],
                "next.done": bool(d["terminated"][t]), "next.truncated": bool(d["truncated"][t]),
                "timestamp": t / FPS, "frame_index": t, "episode_index": ep, "index": index,
                "task": info.instruction or info.task_id, "_T": T, "_start": index - t,
                "_episode_images": d["obs"]["image"][:T]})
            index += 1
    return frames


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, direction: str, variant: str, name: str, ok: bool | None, detail: str = "") -> None:
        """ok None: SKIP (lerobot itself could not do its part)."""
        result = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        self.rows.append({"direction": direction, "variant": variant, "check": name, "result": result,
                          "detail": detail})

    def count(self, result: str) -> int:
        return sum(r["result"] == result for r in self.rows)


def exact(a: Any, b: Any, dtype: str) -> bool:
    a, b = np.asarray(a, dtype), np.asarray(b, dtype)
    return a.shape == b.shape and np.array_equal(a, b)


def first_mismatch(pairs: list[tuple[int, Any, Any]], dtype: str) -> str:
    for i, a, b in pairs:
        if not exact(a, b, dtype):
            return f"index {i}: lerobot {np.asarray(a, dtype).tolist()} vs store {np.asarray(b, dtype).tolist()}"
    return ""


def check_read(checks: Checks, variant: str, got: dict, frames: list[dict], store: Store, video: bool) -> None:
    d = "ours -> lerobot"
    if "error" in got:
        checks.add(d, variant, "LeRobotDataset(repo_id, root=PATH) loads it", False, got["error"])
        return
    snap = store.snapshot()
    infos = list(snap.episodes())
    n = len(frames)
    checks.add(d, variant, "LeRobotDataset(repo_id, root=PATH) loads it", True,
               f"codebase {got['codebase_version']}, {got['seconds']:.1f} s for every frame")
    checks.add(d, variant, "episodes and frames", (got["num_episodes"], got["num_frames"], len(got["items"])) ==
               (len(infos), n, n),
               f"{got['num_episodes']} episodes, {got['num_frames']} frames (store {len(infos)}, {n})")
    feats = got["features"]
    want = {"observation.state": ("float64", [4]), "action": ("float32", [2]), "logits": ("float32", [3]),
            "next.reward": ("float64", [1]), "next.done": ("bool", [1]), "next.truncated": ("bool", [1]),
            "observation.image": ("video" if video else "image", [H, W, 3])}
    bad = {k: (feats.get(k, {}).get("dtype"), feats.get(k, {}).get("shape")) for k in want
           if (feats.get(k, {}).get("dtype"), list(feats.get(k, {}).get("shape") or [])) != want[k]}
    keys = set(got["items"][0]) if got["items"] else set()
    missing = [k for k in [*want, "timestamp", "frame_index", "episode_index", "index", "task_index", "task"]
               if k not in keys]
    cam_type = got["item_types"].get("observation.image", ["?", []])
    ok = not bad and not missing and got["camera_keys"] == ["observation.image"] and \
        got["video_keys"] == (["observation.image"] if video else []) and cam_type == ["torch.float32", [3, H, W]]
    checks.add(d, variant, "features (dtype, shape) and item keys", ok,
               f"camera item {cam_type[0]} {cam_type[1]}; names {feats['observation.state'].get('names')}"
               + (f"; differ: {bad}" if bad else "") + (f"; missing in items: {missing}" if missing else ""))
    tasks, order = {}, []
    for info in infos:
        t = info.instruction or info.task_id
        if t not in tasks:
            tasks[t] = len(tasks)
        order.append(t)
    checks.add(d, variant, "tasks (meta/tasks.parquet)", got["tasks"] == tasks, f"{got['tasks']}")
    eps = got["episodes"]
    starts = np.cumsum([0, *[i.length for i in infos]])
    want_eps = [{"episode_index": k, "length": i.length, "dataset_from_index": int(starts[k]),
                 "dataset_to_index": int(starts[k + 1]), "tasks": [order[k]]} for k, i in enumerate(infos)]
    checks.add(d, variant, "per-episode metadata (meta/episodes)", eps == want_eps,
               f"lengths {[e['length'] for e in eps]}" + ("" if eps == want_eps else f"; got {eps}, want {want_eps}"))
    actions = np.concatenate([snap.load(i)["action"] for i in infos]).astype(np.float64)
    stats = got["stats"].get("action", {})
    ok = bool(stats) and np.allclose(stats.get("mean"), actions.mean(0)) and \
        np.allclose(stats.get("std"), actions.std(0))
    checks.add(d, variant, "meta/stats.json loads (action mean, std)", ok, f"stats for {len(got['stats'])} features")

    items = got["items"][:n]
    for key, dtype in (("observation.state", "float64"), ("action", "float32"), ("logits", "float32"),
                       ("next.reward", "float64"), ("next.done", "bool"), ("next.truncated", "bool"),
                       ("frame_index", "int64"), ("episode_index", "int64"), ("index", "int64")):
        # What __getitem__ returns, against the store's value in the dtype lerobot returns it in: lerobot 0.4.4's
        # hf_transform_to_torch makes tensors with torch.tensor(python values), so float64 columns come back float32.
        returned = got["item_types"].get(key, ["?"])[0].replace("torch.", "")
        pairs = [(i, it.get(key), np.asarray(f[key]).astype(returned)) for i, (it, f) in enumerate(zip(items, frames))]
        miss = first_mismatch(pairs, returned)
        if returned == dtype:
            checks.add(d, variant, f"{key} per frame, exact", not miss, miss or f"{n} frames, {dtype}")
            continue
        checks.add(d, variant, f"{key} per frame, exact as {returned}", not miss,
                   miss or f"{n} frames; lerobot's __getitem__ returns this {dtype} feature as {returned}")
        raw = got["raw"].get(key, [])
        miss = first_mismatch([(i, r, f[key]) for i, (r, f) in enumerate(zip(raw, frames))], dtype) or \
            ("" if len(raw) == n else f"{len(raw)} rows")
        checks.add(d, variant, f"{key} in the table lerobot loads, exact {dtype}", not miss, miss or f"{n} frames")
    ts = np.array([it["timestamp"] for it in items])
    want_ts = np.array([f["timestamp"] for f in frames])
    err = float(np.max(np.abs(ts - want_ts)))
    checks.add(d, variant, "timestamp per frame (frame_index / fps)", err < 1e-6, f"max error {err:.1e} s")
    wrong = [i for i, (it, f) in enumerate(zip(items, frames)) if it.get("task") != f["task"]]
    checks.add(d, variant, "task string per frame", not wrong, f"first wrong index {wrong[0]}" if wrong else
               f"{len(set(f['task'] for f in frames))} tasks")

    # Camera frames.
    decoded = [np.asarray(it["observation.image"], np.uint8) for it in items]
    if video:
        per_episode = []
        for ep, info in enumerate(infos):
            idx = range(int(starts[ep]), int(starts[ep + 1]))
            per_episode.append(psnr(np.stack([decoded[i] for i in idx]), np.stack([frames[i]["observation.image"]
                                                                                   for i in idx])))
        checks.add(d, variant, f"camera frames, PSNR >= {MIN_PSNR_DB:g} dB per episode",
                   min(per_episode) >= MIN_PSNR_DB,
                   f"{[round(p, 2) for p in per_episode]} dB ({got['video_backend'].split(' (')[0]})")
        off = [i for i, f in enumerate(frames)
               if int(np.argmax([psnr(decoded[i], x) for x in f["_episode_images"]])) != f["frame_index"]]
        checks.add(d, variant, "each decoded frame nearest its own source frame", not off,
                   f"off at indices {off}" if off else f"{n} frames")
    else:
        wrong = [i for i, f in enumerate(frames) if not np.array_equal(decoded[i], f["observation.image"])]
        checks.add(d, variant, "camera frames (PNG) exact", not wrong, f"differ at {wrong}" if wrong else f"{n} frames")

    # delta_timestamps: an action chunk and the previous camera frame, padded at the episode's ends.
    bad_actions, bad_pads, bad_cams = [], [], []
    for i_str, item in got["deltas"].items():
        i = int(i_str)
        f = frames[i]
        t, T, start = f["frame_index"], f["_T"], f["_start"]
        steps = [min(t + k, T - 1) for k in range(DELTA_STEPS)]
        want_a = np.stack([frames[start + s]["action"] for s in steps])
        if not exact(item["action"], want_a, "float32"):
            bad_actions.append(i)
        if list(item["action_is_pad"]) != [t + k > T - 1 for k in range(DELTA_STEPS)] or \
                list(item["observation.image_is_pad"]) != [t == 0, False]:
            bad_pads.append(i)
        for got_frame, s in zip(item["observation.image"], (max(t - 1, 0), t)):
            g = np.asarray(got_frame, np.uint8)
            if video:
                if int(np.argmax([psnr(g, x) for x in f["_episode_images"]])) != s:
                    bad_cams.append(i)
            elif not np.array_equal(g, f["_episode_images"][s]):
                bad_cams.append(i)
    k = len(got["deltas"])
    checks.add(d, variant, f"delta_timestamps: action chunks of {DELTA_STEPS}, exact", not bad_actions,
               f"wrong at {bad_actions}" if bad_actions else f"{k} indices (each episode's first, middle, last)")
    checks.add(d, variant, "delta_timestamps: *_is_pad at episode ends", not bad_pads,
               f"wrong at {bad_pads}" if bad_pads else f"{k} indices")
    checks.add(d, variant, "delta_timestamps: camera at t-1 and t", not bad_cams,
               f"wrong at {sorted(set(bad_cams))}" if bad_cams else f"{k} indices")


# --- reverse: lerobot writes, we import --------------------------------------------------------
def reverse_data(path: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    n = sum(REVERSE_LENGTHS)
    done = np.concatenate([np.arange(T) == T - 1 for T in REVERSE_LENGTHS])
    success = done & np.repeat([True, False, True], REVERSE_LENGTHS)
    data = {"state": rng.normal(size=(n, 4)).astype(np.float32),
            "action": rng.uniform(-1, 1, (n, 2)).astype(np.float32),
            "reward": rng.normal(size=n).astype(np.float32), "done": done, "success": success,
            "image": np.concatenate([camera_frames(T, rng, H, W) for T in REVERSE_LENGTHS])}
    np.savez(path, **data)
    return data


def check_reverse(checks: Checks, variant: str, got: dict, data: dict, root: str, store_root: str, video: bool) -> None:
    d = "lerobot -> ours"
    if "write_error" in got:  # lerobot itself cannot write here: nothing of ours to check
        checks.add(d, variant, "LeRobotDataset.create / add_frame / save_episode / finalize", None, got["write_error"])
        return
    if "error" in got:
        checks.add(d, variant, "lerobot reads back what it wrote", False, got["error"])
        return
    feature = got["info"]["features"]["observation.images.front"]
    codec = (feature.get("info") or {}).get("video.codec", "-")
    checks.add(d, variant, "LeRobotDataset.create / add_frame / save_episode / finalize", True,
               f"{len(REVERSE_LENGTHS)} episodes in {got['write_seconds']:.1f} s, camera {feature['dtype']}"
               + (f" ({codec})" if video else ""))
    try:
        done = import_lerobot(root, store_root, success_from="feature:next.success")
    except Exception as e:  # a failure here is what this check reports
        checks.add(d, variant, "import_lerobot(--success-from feature:next.success)", False, f"{type(e).__name__}: {e}")
        return
    checks.add(d, variant, "import_lerobot(--success-from feature:next.success)",
               (done.imported, done.invalid, done.ignored) == (len(REVERSE_LENGTHS), (), ()),
               f"imported {done.imported}, invalid {list(done.invalid)}, ignored {list(done.ignored)}")
    store = Store.open(store_root)
    schema = store.schema
    ok = (schema.observations == {"state": ArraySpec("float32", (4,)), "images.front": ArraySpec("uint8", (H, W, 3))}
          and schema.action == ArraySpec("float32", (2,)) and schema.extras == {"next.success": ArraySpec("bool", (1,))}
          and schema.attrs.get("lerobot", {}).get("fps") == FPS
          and schema.attrs["lerobot"].get("robot_type") == "so100")
    checks.add(d, variant, "store schema from lerobot's features", ok,
               f"observations {sorted(schema.observations)}, extras {sorted(schema.extras)}, "
               f"attrs.lerobot {schema.attrs.get('lerobot')}")
    snap = store.snapshot()
    infos = sorted(snap.episodes(), key=lambda e: e.attrs["imported_from"]["episode"])
    starts = np.cumsum([0, *REVERSE_LENGTHS])
    meta = [(e.length, e.instruction, e.success, e.terminated) for e in infos]
    want = [(T, REVERSE_TASKS[k], bool(data["success"][starts[k + 1] - 1]), True)
            for k, T in enumerate(REVERSE_LENGTHS)]
    checks.add(d, variant, "episodes: length, instruction (task), success, terminated", meta == want, f"{meta}")
    wrong: dict[str, list[int]] = {}
    for k, e in enumerate(infos):
        x, sl = snap.load(e), slice(starts[k], starts[k + 1])
        for name, a, b in (("state", x["obs"]["state"][:-1], data["state"][sl]),
                           ("action", x["action"], data["action"][sl]),
                           ("reward", x["reward"], data["reward"][sl].astype(np.float64)),
                           ("next.success", x["extras"]["next.success"][:, 0], data["success"][sl]),
                           ("terminated", x["terminated"], data["done"][sl])):
            if not (np.shape(a) == np.shape(b) and np.array_equal(a, b)):
                wrong.setdefault(name, []).append(k)
    checks.add(d, variant, "state, action, reward, next.success, terminated exact", not wrong,
               f"differ: {wrong}" if wrong else f"{sum(REVERSE_LENGTHS)} frames")
    ours = np.concatenate([snap.load(e)["obs"]["images.front"][:-1] for e in infos])
    theirs = np.stack([np.asarray(it["observation.images.front"], np.uint8) for it in got["items"]])
    if not video:
        checks.add(d, variant, "camera frames (PNG) exact", np.array_equal(ours, data["image"]),
                   f"{len(ours)} frames")
        return
    same = psnr(ours, theirs)
    max_diff = int(np.max(np.abs(ours.astype(int) - theirs.astype(int))))
    source = [psnr(ours[starts[k]:starts[k + 1]], data["image"][starts[k]:starts[k + 1]]) for k in range(len(infos))]
    lerobot_source = [psnr(theirs[starts[k]:starts[k + 1]], data["image"][starts[k]:starts[k + 1]])
                      for k in range(len(infos))]
    checks.add(d, variant, f"camera: our decoding vs lerobot's, PSNR >= {MIN_PSNR_DB:g} dB", same >= MIN_PSNR_DB,
               f"{same:.2f} dB, max |diff| {max_diff}")
    off = [i for i in range(len(ours))
           if int(np.argmax([psnr(ours[i], theirs[j]) for j in range(len(theirs))])) != i]
    checks.add(d, variant, "camera: each of our frames nearest lerobot's frame of the same index", not off,
               f"off at {off}" if off else f"{len(ours)} frames")
    checks.add(d, variant, f"camera vs source frames, PSNR >= {MIN_PSNR_DB:g} dB per episode",
               min(source) >= MIN_PSNR_DB,
               f"ours {[round(p, 2) for p in source]} dB; "
               f"lerobot's own decoding {[round(p, 2) for p in lerobot_source]} dB")


@contextlib.contextmanager
def quiet_output():
    """File descriptors 1 and 2 to /dev/null (SVT-AV1 prints its configuration on stderr)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def print_table(checks: Checks) -> None:
    widths = [max(len(str(r[k])) for r in checks.rows) for k in ("direction", "variant", "check")]
    widths = [max(w, len(h)) for w, h in zip(widths, ("direction", "variant", "check"))]
    print(f"{'direction':<{widths[0]}}  {'variant':<{widths[1]}}  {'check':<{widths[2]}}  result  detail")
    for r in checks.rows:
        print(f"{r['direction']:<{widths[0]}}  {r['variant']:<{widths[1]}}  {r['check']:<{widths[2]}}  "
              f"{r['result']:<6}  {r['detail']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lerobot-python", help="python of a venv where lerobot is installed")
    parser.add_argument("--out", help="write the checks as JSON here")
    parser.add_argument("--keep", help="keep the store and datasets in this new folder (default: a temporary one)")
    parser.add_argument("--no-reverse", action="store_true", help="skip lerobot -> ours")
    parser.add_argument("--pyav-decoder", action="store_true",
                        help="decode lerobot's videos with the worker's PyAV decoder even where torchcodec works")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])

    with tempfile.TemporaryDirectory(prefix="lerobot-compat-") as tmp:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=bool(args.keep is None))
        worker = Worker(os.path.abspath(args.lerobot_python), work) if args.lerobot_python else None
        problem, probe = lerobot_problem(args.lerobot_python, worker)
        if problem:
            print(f"lerobot check skipped: {problem}")
            return
        t0 = time.perf_counter()
        store = build_store(os.path.join(work, "store"))
        frames = expected_frames(store)
        starts = np.cumsum([0, *LENGTHS])
        delta_indices = sorted({int(i) for a, b in zip(starts[:-1], starts[1:]) for i in (a, (a + b) // 2, b - 1)})
        checks = Checks()
        variants = {"video": dict(data_files_size_in_mb=0.001, video_files_size_in_mb=0.001),
                    "video_av1": dict(codec="libsvtav1"), "images": dict(images=True)}
        backend, notes = None, list(probe.get("notes", []))
        for name, kwargs in variants.items():
            with quiet_output():
                root = export_lerobot(store.snapshot(), os.path.join(work, f"ours-{name}"), fps=FPS, **kwargs)
            probe_video = None if name == "images" else os.path.join(
                root, "videos/observation.image/chunk-000/file-000.mp4")
            got = worker({"mode": "read", "root": root, "repo_id": f"robo_post/{name}", "delta_indices": delta_indices,
                          "delta_steps": DELTA_STEPS, "probe_video": probe_video,
                          "force_pyav": args.pyav_decoder})
            backend = got.get("video_backend", backend) if name != "images" else backend
            notes += [n for n in got.get("notes", []) if n not in notes]
            check_read(checks, name, got, frames, store, video=name != "images")
        reverse_note = "not run (--no-reverse)" if args.no_reverse else None
        if not args.no_reverse:
            data = reverse_data(os.path.join(work, "reverse.npz"))
            for name, use_videos in (("lerobot_video", True), ("lerobot_images", False)):
                root = os.path.join(work, name)
                got = worker({"mode": "write", "root": root, "repo_id": f"local/{name}",
                              "data": os.path.join(work, "reverse.npz"), "use_videos": use_videos,
                              "vcodec": "libsvtav1", "fps": FPS, "lengths": list(REVERSE_LENGTHS), "shape": [H, W, 3],
                              "tasks": REVERSE_TASKS})
                if "write_error" in got:
                    reverse_note = f"lerobot could not write a dataset offline here: {got['write_error']}"
                check_reverse(checks, name, got, data, root, os.path.join(work, f"store-{name}"), video=use_videos)
        seconds = time.perf_counter() - t0

    packages = ", ".join(f"{k} {v}" for k, v in probe.get("packages", {}).items() if v)
    print(f"lerobot {probe.get('lerobot')} at {args.lerobot_python} ({packages}); video decoding in lerobot: {backend}")
    for note in notes:
        print(f"note: {note}")
    if reverse_note:
        print(f"reverse: {reverse_note}")
    print_table(checks)
    failed, skipped = checks.count("FAIL"), checks.count("SKIP")
    print(f"{checks.count('PASS')} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")
          + f" ({seconds:.0f} s)")
    print(f"command: {command}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "lerobot": probe.get("lerobot"), "lerobot_packages": probe.get("packages"),
                       "lerobot_python": args.lerobot_python,
                       "python": sys.version.split()[0], "video_backend": backend, "notes": notes,
                       "reverse_note": reverse_note, "seconds": round(seconds, 1),
                       "passed": checks.count("PASS"), "failed": failed, "skipped": skipped, "checks": checks.rows},
                      f, indent=1)
            f.write("\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
