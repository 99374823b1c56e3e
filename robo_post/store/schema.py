"""Store schema, typed errors, and episode validation.

The schema is written once into ``store.json`` when a store is created; every
writer validates each episode against it before anything touches disk.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# 2: per-step extras, integer actions, episode roles. Version 1 stores (none of those)
# still open and take new episodes; their store.json keeps version 1.
SCHEMA_VERSION = 2
STORE_FORMAT = "robo-post-store"

OBS_DTYPES = ("float32", "float64", "uint8", "int32", "int64", "bool")
# Observation key of a bare (non-Dict) observation space, and the schema attr that
# marks it, so an export to Minari writes a bare space again.
BARE_OBS_KEY = "observation"
BARE_OBS_ATTR = "minari_bare_observation"

# Where an episode came from. Records written before roles existed get one from their
# shard's name (``infer_role``).
ROLES = ("demo", "play", "deploy", "online", "eval", "imported", "other")
_ROLE_PREFIXES = (("demo-", "demo"), ("play-", "play"), ("deploy-", "deploy"), ("online-", "online"),
                  ("eval", "eval"), ("minari", "imported"))

# Integers that float64 step columns (and JSON readers that parse numbers as doubles)
# hold exactly: policy versions must stay below this.
MAX_EXACT_INT = 2**53

# Per-step scalar columns, stored together as one (T, len(STEP_COLUMNS)) float64
# table so a commit costs one array write instead of seven. float64 holds every
# value exactly: bools, policy versions < 2**53, unix timestamps to the microsecond.
STEP_COLUMNS = (
    "reward",
    "terminated",
    "truncated",
    "policy_version",
    "intervention",
    "timestamp",
    "behavior_logprob",
)

# An episode may take at most 1/MEMORY_SHARE of the machine's memory: reading one back peaks at
# about three times its bytes (zarr's decode buffers beside the arrays it returns; 2.2x to 3.1x
# measured), and a write of broadcast arrays copies them once.
MEMORY_SHARE = 4

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class StoreError(Exception):
    """Base class for every error the store raises on purpose."""


class EpisodeValidationError(StoreError, ValueError):
    """An episode does not match the store schema. Nothing was written.

    Attributes:
        field: name of the offending field (e.g. ``"obs/image"``, ``"action"``).
        step: index of the offending step inside the episode, or ``None`` when the
            problem is not tied to one step.
    """

    def __init__(self, field: str, message: str, step: int | None = None):
        self.field = field
        self.step = step
        where = f"field {field!r}" + (f" at step {step}" if step is not None else "")
        super().__init__(f"invalid episode: {where}: {message}")


class InvalidNameError(StoreError, ValueError):
    """A client id or other path component is not a safe name."""


class SchemaVersionError(StoreError):
    """The store was written by a newer, unknown schema version."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No store exists at the given path."""


class EpisodeNotFoundError(StoreError, LookupError):
    """No committed episode of the given key or index (or none at all) in the store."""


class EpisodeTooLargeError(EpisodeValidationError):
    """An episode whose arrays would need more memory than ``episode_byte_limit()``: refused
    before any of them is allocated, so a write writes nothing and a read reads nothing. A
    validation error (field ``length``), so a fleet client rejects such an episode and goes on,
    and an import with ``--skip-invalid`` skips it, as they do other invalid episodes.

    Attributes:
        episode: its key ``SHARD/N`` (on a write: the key it would have had).
        length: its steps, as given or as its record declares them.
        nbytes: the bytes of its arrays (``episode_nbytes``).
        limit: ``episode_byte_limit()``.
    """

    def __init__(self, episode: str, length: int, nbytes: int, limit: int, doing: str):
        self.episode, self.length, self.nbytes, self.limit = episode, length, nbytes, limit
        super().__init__("length", (
            f"episode {episode} {doing}: its {length} steps need {_gib(nbytes)} ({nbytes} bytes), over the limit of "
            f"{_gib(limit)}, a quarter of this machine's {_gib(limit * MEMORY_SHARE)} of memory (reading an episode "
            "back takes about three times its bytes)"))


class ShardLockedError(StoreError):
    """Another live process already writes to this shard."""


class StoreIntegrityError(StoreError):
    """On-disk data does not match its committed record (corruption)."""


class ShardDamagedError(StoreIntegrityError):
    """A shard's commit record is missing or damaged, so what it committed is uncertain.

    Readers and writers refuse rather than guess (a guess could hide committed
    episodes, and a writer would then overwrite them); ``robo-post store repair``
    rebuilds the record from the episode index and the data whose checksums verify.

    Attributes:
        shard: the shard's name.
    """

    def __init__(self, shard: str, reason: str):
        self.shard = shard
        super().__init__(f"shard {shard!r}: {reason}; run `robo-post store repair` to rebuild its commit record")


class UnsupportedFormatError(StoreError):
    """On-disk data in a layout no released robo-post wrote (a pre-release store)."""


class StoreURLError(StoreError, ValueError):
    """A store URL that names no object store location (unknown scheme, no bucket, a bad
    bucket name, credentials or a query in it)."""


class StoreAccessError(StoreError, PermissionError):
    """The object store refused us: no credentials in the environment, or wrong ones, or no
    permission on the bucket."""


class StoreLayoutError(StoreIntegrityError):
    """A file (or anything but a folder) where the store keeps a folder, e.g. at ``snapshots``.

    Attributes:
        path: that path.
    """

    def __init__(self, path: str, what: str, way_out: str):
        self.path = path
        kind = "a file" if os.path.isfile(path) else "not a folder"
        super().__init__(f"{path} is {kind} where the store keeps {what}: {way_out}")


def check_folder(path: str, what: str, way_out: str) -> None:
    """Raise ``StoreLayoutError`` when ``path`` exists but is not a folder (a missing one is
    the caller's to create or do without)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StoreLayoutError(path, what, way_out)


def episode_byte_limit() -> int:
    """The most bytes an episode's arrays may take: a quarter (``MEMORY_SHARE``) of this machine's
    physical memory (``os.sysconf``: pages times page size), as reading one back peaks at about
    three times its bytes (5.9 GiB on a machine of 23.5 GiB)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MEMORY_SHARE


def episode_nbytes(schema: "StoreSchema", length: int) -> int:
    """Bytes of the arrays of an episode of ``length`` steps: its ``length + 1`` observations, and
    per step its action, step table row and extras (Python integers: no overflow at any length)."""
    per_step = schema.action.step_nbytes + len(STEP_COLUMNS) * 8 + sum(s.step_nbytes for s in schema.extras.values())
    return (length + 1) * sum(s.step_nbytes for s in schema.observations.values()) + length * per_step


def check_episode_size(schema: "StoreSchema", episode: str, length: int, doing: str) -> None:
    """Raise ``EpisodeTooLargeError`` (saying what was ``doing``) when an episode of ``length``
    steps would take more than ``episode_byte_limit()``; call it before allocating any of its arrays."""
    nbytes, limit = episode_nbytes(schema, length), episode_byte_limit()
    if nbytes > limit:
        raise EpisodeTooLargeError(episode, length, nbytes, limit, doing)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def infer_role(client_id: str) -> str:
    """The role of an episode recorded without one, from its shard's name: ``demo-``,
    ``play-``, ``deploy-``, ``online-`` -> that role, ``eval...`` -> ``eval``,
    ``minari...`` -> ``imported``, anything else -> ``other``."""
    return next((role for prefix, role in _ROLE_PREFIXES if client_id.startswith(prefix)), "other")


def check_role(role: str) -> str:
    """Return ``role`` if it is one of ``ROLES``, else raise ``EpisodeValidationError``."""
    if role not in ROLES:
        raise EpisodeValidationError("role", f"unknown role {role!r}; roles are {ROLES}")
    return role


def check_name(name: str, what: str = "client id") -> str:
    """Return ``name`` if it is safe as a single path component, else raise.

    Safe means: 1-128 chars of ``[A-Za-z0-9_.-]``, starting alphanumeric (so no
    ``..``, no ``/``, no hidden files, no empty string).
    """
    if not isinstance(name, str) or not _SAFE_NAME.match(name):
        raise InvalidNameError(
            f"{what} {name!r} is not a safe name: use 1-128 characters of "
            "[A-Za-z0-9_.-] starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class ArraySpec:
    """dtype, per-step shape and optional elementwise bounds of one field."""

    dtype: str
    shape: tuple[int, ...]
    low: float | list | None = None
    high: float | list | None = None
    unit: str = ""

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if np.dtype(self.dtype).name != self.dtype:
            object.__setattr__(self, "dtype", np.dtype(self.dtype).name)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "low": self.low, "high": self.high, "unit": self.unit}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "spec") -> "ArraySpec":
        """Read ``to_json``'s dict; ``ValueError`` naming the key of ``where`` that is missing
        or of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError(f"{where!r} must be an object, not {_json_kind(d)}")
        shape = _entry(d, "shape", list, where)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"'{where}.shape' must be a list of sizes (integers >= 0), not {shape!r}")
        return cls(_entry(d, "dtype", str, where), tuple(shape), d.get("low"), d.get("high"),
                   _entry(d, "unit", str, where, ""))

    @property
    def step_nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class StoreSchema:
    """What every episode in a store looks like.

    Args:
        observations: observation key -> spec. Images are ``uint8`` of shape (H, W, C).
        action: spec of one action (per step, not per chunk); ``low``/``high`` are enforced.
            Floating point, or integer for discrete actions (e.g. ``ArraySpec("int64", (),
            low=0, high=n - 1)`` for gymnasium's ``Discrete(n)``).
        schema_version: format version; readers refuse versions newer than theirs.
        attrs: free-form JSON metadata of the store.
        extras: per-step arrays beside the action (name -> spec), e.g. a policy's
            internals; every step of every episode must give each of them.
    """

    observations: dict[str, ArraySpec]
    action: ArraySpec
    schema_version: int = SCHEMA_VERSION
    attrs: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, ArraySpec] = field(default_factory=dict)

    def __post_init__(self):
        if not self.observations:
            raise ValueError("a schema needs at least one observation key")
        for what, specs in (("observation", self.observations), ("extra", self.extras)):
            for key, spec in specs.items():
                check_name(key, f"{what} key")
                if spec.dtype not in OBS_DTYPES:
                    raise ValueError(f"{what} {key!r}: dtype {spec.dtype} not in {OBS_DTYPES}")
        if np.dtype(self.action.dtype).kind not in "fiu":
            raise ValueError(f"actions must be floating point or integer, not {self.action.dtype}")
        if self.schema_version < 2 and (self.extras or self.action_is_discrete):
            raise ValueError("extras and integer actions need schema_version >= 2")

    @property
    def action_is_discrete(self) -> bool:
        """True for integer (Discrete/MultiDiscrete) actions."""
        return np.dtype(self.action.dtype).kind in "iu"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STORE_FORMAT,
            "schema_version": self.schema_version,
            "observations": {k: v.to_json() for k, v in self.observations.items()},
            "action": self.action.to_json(),
            "extras": {k: v.to_json() for k, v in self.extras.items()},
            "step_columns": list(STEP_COLUMNS),
            "attrs": self.attrs,
        }

    def layout_differences(self, other: "StoreSchema") -> list[str]:
        """What keeps episodes of one from fitting the other, one line per differing entry
        (``"extras['events']: float32 (3,) != float32 (4,)"``, this schema's entry first);
        empty when they fit. ``schema_version`` does not count (a version 1 store takes
        episodes of an equal version 2 schema)."""
        def entries(d: dict[str, Any]) -> dict[str, Any]:
            return {"action": d["action"],
                    **{f"{section}[{key!r}]": value for section in ("observations", "extras", "attrs")
                       for key, value in d[section].items()}}

        mine, theirs = entries(self.to_json()), entries(other.to_json())
        return [f"{name}: {_describe(mine.get(name))} != {_describe(theirs.get(name))}"
                for name in sorted(mine.keys() | theirs.keys()) if mine.get(name) != theirs.get(name)]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "StoreSchema":
        """Read ``to_json``'s dict. Raises ``StoreError`` for another format,
        ``SchemaVersionError`` for a newer version, ``ValueError`` naming a key that is missing
        or of the wrong type."""
        if not isinstance(d, dict):
            raise ValueError(f"a schema must be a JSON object, not {_json_kind(d)}")
        if d.get("format") != STORE_FORMAT:
            raise StoreError(f"not a robo-post store (format={d.get('format')!r})")
        version = d.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"store has schema_version {version!r} but this robo-post reads up to "
                f"{SCHEMA_VERSION}; upgrade robo-post to open it"
            )
        return cls(
            observations={k: ArraySpec.from_json(v, f"observations.{k}")
                          for k, v in _entry(d, "observations", dict).items()},
            action=ArraySpec.from_json(_entry(d, "action", dict), "action"),
            schema_version=version,
            attrs=_entry(d, "attrs", dict, default={}),
            extras={k: ArraySpec.from_json(v, f"extras.{k}")
                    for k, v in _entry(d, "extras", dict, default={}).items()},  # absent in version 1
        )

    @classmethod
    def from_spaces(cls, observation_space, action_space, **attrs) -> "StoreSchema":
        """Build a schema from gymnasium spaces.

        Observations: a Dict of Boxes/Discretes, or one bare Box/Discrete, stored as the
        key ``"observation"`` (``BARE_OBS_KEY``; marked in ``attrs`` so that a Minari
        export writes a bare space again). Actions: a Box, a Discrete (int64 in
        ``start .. start + n - 1``) or a MultiDiscrete (int64, per element).
        """
        import gymnasium as gym

        obs = {}
        if not isinstance(observation_space, gym.spaces.Dict):
            observation_space = gym.spaces.Dict({BARE_OBS_KEY: observation_space})
            attrs = {BARE_OBS_ATTR: BARE_OBS_KEY, **attrs}
        for key, space in observation_space.spaces.items():
            if isinstance(space, gym.spaces.Box):
                bounded = np.all(np.isfinite(space.low)) and np.all(np.isfinite(space.high))
                obs[key] = ArraySpec(
                    space.dtype.name,
                    space.shape,
                    space.low.tolist() if bounded and space.dtype != np.uint8 else None,
                    space.high.tolist() if bounded and space.dtype != np.uint8 else None,
                )
            elif isinstance(space, gym.spaces.Discrete):
                obs[key] = ArraySpec("int64", (), int(space.start), int(space.start + space.n - 1))
            else:
                raise ValueError(f"observation {key!r}: unsupported space {space}")
        if isinstance(action_space, gym.spaces.Box):
            act = ArraySpec(action_space.dtype.name, action_space.shape, action_space.low.tolist(), action_space.high.tolist())
        elif isinstance(action_space, gym.spaces.Discrete):
            act = ArraySpec("int64", (), int(action_space.start), int(action_space.start + action_space.n - 1))
        elif isinstance(action_space, gym.spaces.MultiDiscrete):
            start = np.asarray(action_space.start, dtype=np.int64)
            high = start + np.asarray(action_space.nvec, dtype=np.int64) - 1
            act = ArraySpec("int64", action_space.shape, start.tolist(), high.tolist())
        else:
            raise ValueError(f"action space {action_space} unsupported: use a Box, Discrete or MultiDiscrete")
        return cls(observations=obs, action=act, attrs=attrs)


def _first_bad_step(mask_per_step: np.ndarray) -> int:
    return int(np.flatnonzero(mask_per_step.reshape(len(mask_per_step), -1).any(axis=1))[0])


def _check_bounds(name: str, arr: np.ndarray, spec: ArraySpec) -> None:
    # One whole-array test per bound; the per-step search runs only on a failure.
    for bound, where, out_of_range in ((spec.low, "below lower", np.less), (spec.high, "above upper", np.greater)):
        if bound is None:
            continue
        limit = np.asarray(bound, dtype=np.float64).reshape(spec.shape if np.size(bound) > 1 else ())
        bad = out_of_range(arr, limit)
        if bad.any():
            i = _first_bad_step(bad)
            raise EpisodeValidationError(name, f"value {where} bound {bound}: {arr[i].tolist()}", i)


def validate_array(name: str, arr: np.ndarray, spec: ArraySpec, length: int) -> None:
    """Check one stacked field (leading axis = steps) against its spec."""
    if arr.shape[0] != length:
        raise EpisodeValidationError(name, f"has {arr.shape[0]} rows, expected {length}")
    if arr.shape[1:] != spec.shape:
        raise EpisodeValidationError(name, f"shape {arr.shape[1:]} per step, schema says {spec.shape}")
    if arr.dtype != np.dtype(spec.dtype):
        # Floats may widen/narrow between float32/float64; anything else must match exactly.
        if not (arr.dtype.kind == "f" and np.dtype(spec.dtype).kind == "f"):
            raise EpisodeValidationError(name, f"dtype {arr.dtype}, schema says {spec.dtype}")
    if arr.dtype.kind == "f":
        finite = np.isfinite(arr)
        if not finite.all():
            raise EpisodeValidationError(name, "contains NaN or inf", _first_bad_step(~finite))
        if arr.dtype.itemsize > np.dtype(spec.dtype).itemsize:
            # Narrowing rounds, which is accepted, but a value past the narrower type's
            # range would be stored as inf.
            limit = np.finfo(spec.dtype).max
            too_big = np.abs(arr) > limit
            if too_big.any():
                i = _first_bad_step(too_big)
                raise EpisodeValidationError(name, f"value beyond the {spec.dtype} range (|x| <= {limit:.7g})", i)
    _check_bounds(name, arr, spec)


def stack_field(name: str, values: list, spec: ArraySpec) -> np.ndarray:
    """Stack per-step values, naming the first step whose shape is wrong."""
    try:
        arr = np.stack([np.asarray(v) for v in values])
    except ValueError:
        for i, v in enumerate(values):
            if np.shape(v) != spec.shape:
                raise EpisodeValidationError(name, f"shape {np.shape(v)}, schema says {spec.shape}", i) from None
        raise
    return arr


_REQUIRED = object()


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words: ``an object``, ``a list``, ``a string``, ..."""
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "a list"), (str, "a string"), (int, "an integer"),
             (float, "a number"), (type(None), "null"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _entry(d: dict[str, Any], key: str, kind: type, where: str = "", default: Any = _REQUIRED) -> Any:
    """``d[key]`` if it is a ``kind``, else ``ValueError`` naming the key (inside ``where``) as missing
    or of the wrong type; ``default`` (when given) stands in for a missing key."""
    name = f"{where}.{key}" if where else key
    if key not in d:
        if default is _REQUIRED:
            raise ValueError(f"missing key {name!r}")
        return default
    if not isinstance(d[key], kind) or isinstance(d[key], bool) and kind is not bool:
        raise ValueError(f"{name!r} must be {_json_kind(kind())}, not {_json_kind(d[key])}")
    return d[key]


def _describe(entry: Any) -> str:
    """An array spec's JSON as ``float32 (3,)`` (its bounds when set), anything else as is; ``absent`` for None."""
    if entry is None:
        return "absent"
    if isinstance(entry, dict) and {"dtype", "shape"} <= set(entry):
        text = f"{entry['dtype']} {tuple(entry['shape'])}"
        if entry.get("low") is not None or entry.get("high") is not None:
            text += f" in [{_short(entry.get('low'))}, {_short(entry.get('high'))}]"
        return text
    return repr(entry)


def _short(bound: Any) -> str:
    """A bound list of more than 4 values as its first three, an ellipsis and the last (a driving
    observation's 88 bounds made a message of 1,650 characters)."""
    if isinstance(bound, list) and len(bound) > 4:
        return f"[{', '.join(map(str, bound[:3]))}, ..., {bound[-1]}] ({len(bound)} values)"
    return str(bound)
