"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

A checkpoint holds named modules, named optimizers, the torch and numpy RNG
states and a JSON dict of counters/config. It is written to a temporary
directory and swapped in with renames, so a learner killed mid-save keeps its
previous checkpoint. The JSON part records the SHA-256 of the tensor file, so damage
inside a well-formed tensor file (a flipped byte, a NaN written over weights) is found
on resume instead of trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np
import torch
from safetensors.torch import load, save

from robo_post.utils.io import naming

TENSORS, STATE = "tensors.safetensors", "state.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read back into this run (damaged, or written by other model settings)."""


def _flatten_optimizer(prefix: str, opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    sd = opt.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{prefix}.state.{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[k] = v
    meta[prefix] = {"param_groups": sd["param_groups"], "scalars": scalars, "indices": [int(i) for i in sd["state"]]}


def _unflatten_optimizer(prefix: str, opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> None:
    info = meta[prefix]
    state: dict[int, dict[str, Any]] = {i: dict(info["scalars"].get(str(i), {})) for i in info["indices"]}
    head = f"{prefix}.state."
    for key, value in tensors.items():
        if key.startswith(head):
            idx, name = key[len(head):].split(".", 1)
            state[int(idx)][name] = value
    opt.load_state_dict({"state": state, "param_groups": info["param_groups"]})


def save_checkpoint(
    path: str,
    modules: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    rngs: dict[str, np.random.Generator],
    state: dict[str, Any],
) -> None:
    """Atomically write a checkpoint directory at ``path``."""
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for name, module in modules.items():
        for k, v in module.state_dict().items():
            v = v.detach().cpu().contiguous()
            # safetensors stores no aliases: a module registered under two names (SB3's
            # shared feature extractor) is written twice, and loads back shared.
            if v.untyped_storage().data_ptr() in stored:
                v = v.clone()
            stored.add(v.untyped_storage().data_ptr())
            tensors[f"module.{name}.{k}"] = v
    meta: dict[str, Any] = {}
    for name, opt in optimizers.items():
        _flatten_optimizer(f"optim.{name}", opt, tensors, meta)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    blob = save(tensors)
    payload = {
        "state": state,
        "tensors_sha256": hashlib.sha256(blob).hexdigest(),
        "optimizers": meta,
        "numpy_rngs": {name: rng.bit_generator.state for name, rng in rngs.items()},
    }
    tmp, old = f"{path}.tmp", f"{path}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with naming(path), open(os.path.join(tmp, TENSORS), "wb") as f:
        f.write(blob)
    with naming(path), open(os.path.join(tmp, STATE), "w") as f:
        json.dump(payload, f)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: str,
    modules: dict[str, torch.nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    rngs: dict[str, np.random.Generator],
    counters: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Restore a checkpoint in place; returns the saved ``state`` dict, in which each of
    ``counters`` (the steps the run resumes from) is a non-negative int."""
    path = _complete(path)
    try:
        with open(os.path.join(path, TENSORS), "rb") as f:
            blob = f.read()
        payload = _payload(path)
        tensors = load(blob)
    except Exception as e:  # safetensors raises its own error type for a malformed file
        raise _unreadable(path, e) from e
    digest = payload.get("tensors_sha256")  # absent in checkpoints written before it was recorded
    if digest is not None and hashlib.sha256(blob).hexdigest() != digest:
        raise CheckpointError(f"checkpoint {path} is damaged: {TENSORS} does not match the checksum its {STATE} "
                              f"recorded when it was saved; a new run_dir starts over")
    for name in counters:
        value = payload["state"].get(name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise CheckpointError(f"checkpoint {path} is damaged: its {STATE} holds {name}={value!r}, not the "
                                  f"step count this run resumes from; a new run_dir starts over")
    for name, module in modules.items():
        head = f"module.{name}."
        try:
            module.load_state_dict({k[len(head):]: v for k, v in tensors.items() if k.startswith(head)})
        except RuntimeError as e:
            raise CheckpointError(f"checkpoint {path} does not fit this run's {name!r} (written with other model "
                                  f"settings?); a new run_dir starts over") from e
    try:
        for name, opt in optimizers.items():
            _unflatten_optimizer(f"optim.{name}", opt, tensors, payload["optimizers"])
        torch.set_rng_state(tensors["rng.torch"])
    except (KeyError, TypeError, ValueError) as e:  # an entry missing or edited, or another run's optimizers
        raise CheckpointError(f"checkpoint {path} does not fit this run's optimizers or is damaged "
                              f"({type(e).__name__}: {e}); a new run_dir starts over") from e
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    for name, rng in rngs.items():
        if name in payload["numpy_rngs"]:  # a new phase may bring new samplers; they keep their seeds
            rng.bit_generator.state = payload["numpy_rngs"][name]
    return payload["state"]


def _complete(path: str) -> str:
    """``path``, or its ``.old`` copy when the writer was killed between the two renames of ``save_checkpoint``."""
    if not os.path.exists(os.path.join(path, STATE)) and os.path.exists(f"{path}.old"):
        return f"{path}.old"
    return path


def _payload(path: str) -> dict[str, Any]:
    """The checkpoint's JSON part, as ``save_checkpoint`` wrote it."""
    with open(os.path.join(path, STATE)) as f:
        payload = json.load(f)
    if not (isinstance(payload, dict) and {"state", "optimizers", "numpy_rngs"} <= payload.keys()
            and isinstance(payload["state"], dict)):
        raise ValueError(f"{STATE} is not the state, optimizers and numpy_rngs a checkpoint saves")
    return payload


def _unreadable(path: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); a new run_dir starts over")


def checkpoint_state(path: str) -> dict[str, Any]:
    """The saved ``state`` dict (counters) of a checkpoint, without loading its tensors."""
    path = _complete(path)
    try:
        return _payload(path)["state"]
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from e


def has_checkpoint(path: str) -> bool:
    # The folder alone counts: save_checkpoint never leaves it without its files, so a missing
    # one is damage to report, not a fresh run that would start over and overwrite the log.
    return os.path.isdir(path) or os.path.exists(os.path.join(f"{path}.old", STATE))
