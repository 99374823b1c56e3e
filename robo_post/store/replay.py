"""Freshness-Aware Prioritized Experience Replay (FreshPER).

Implements FreshPER (docs/methods.md, "Online data: FreshPER"; Ma et al., arXiv:2604.16918,
reference code ``Vision-CAIR/Freshness-Aware-PER``, ``roll/agentic/replay_buffer/``)::

    base priority  p_i^base = |signal_i| + eps          signal: TD error | reward | advantage
    effective      p_i      = p_i^base * exp(-age_i / tau),   age_i = step - stored_at_i
    sampling       P(i)     = p_i^alpha / sum_j p_j^alpha       (sum tree, stratified)
    IS weight      w_i      = (N P(i))^(-beta) / max_j w_j,     beta annealed beta0 -> beta1
    eviction score (age_i / tau) / (p_i + eps)                  (highest score leaves first)

Because alpha is applied after the decay, ``P(i) ∝ exp(-alpha * age_i / tau)`` for equal
base priorities: the priority half-life is ``tau ln2`` (346.6 steps at tau = 500) and the
sampling-probability half-life ``tau ln2 / alpha`` (577.6 steps at alpha = 0.6) (derived
from the equations above). ``tau = inf`` is standard PER.

Items are integer ids (slots) ``0 .. capacity-1``; the caller maps them to data (e.g. window
start rows in the trajectory store, each with the step it was stored at and its base
priority). Ids are handed out in insertion order until the buffer is full;
after that each ``add`` evicts (``on_full="evict"``, the paper's eviction rule) and **reuses the
evicted ids**, so the caller must overwrite its data for the returned ids. With
``on_full="error"`` a full buffer raises :class:`ReplayFullError` instead.

Choices the paper leaves open or where the reference code differs, documented here:

* IS weights are normalised by the max over the *sampled batch* (``w / w.max()``, so the
  batch maximum is exactly 1, a tested property). The reference code
  (``trajectory_buffer.py::compute_importance_weights``) instead divides by the largest
  weight any item in the buffer could get (from the minimum leaf), so its weights are
  <= 1 but the batch max is usually < 1; ``sample(..., normalize="buffer")`` gives that.
* New items enter with decay factor 1 and their own base priority; the
  reference code enters them at the running max priority (classic PER convention).
* The eviction score uses the effective priority ``p_i`` of the equation above; the reference
  code uses the tree leaf ``p_i^alpha`` and multiplies by ``1 + log1p(sample_count)/10``.
  Ties (e.g. every score 0 when tau = inf) evict the oldest item first, i.e. FIFO.
* The refresh is synchronous (the reference code runs it on a background CPU thread). With
  ``tau = inf`` every decay factor is 1, so the automatic refresh inside :meth:`sample` is
  skipped (``add``/``update_priorities`` keep the leaves exact).
* Leaves are computed in log space and floored at the smallest normal float64, so a valid
  item's leaf never underflows to 0 (priorities stay > 0) and IS weights stay
  finite. The reference code floors the effective priority at 1e-8 instead; our floor only
  acts once ``alpha * age / tau`` exceeds ~700.
* Magnitudes are taken (``|signal|``) in ``add``/``update_priorities``, so raw TD errors,
  rewards or advantages can be passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["FreshPER", "FreshPERConfig", "ReplayFullError", "SumTree", "ess"]

PRIORITY_SIGNALS = ("td", "reward", "advantage")
# Smallest positive normal float64: the floor for a valid leaf (see module docstring).
_LEAF_FLOOR = float(np.finfo(np.float64).tiny)


class ReplayFullError(RuntimeError):
    """Raised by :meth:`FreshPER.add` when the buffer is full and ``on_full="error"``."""


def ess(weights: np.ndarray) -> float:
    """Effective sample size of importance weights, ``(sum w)^2 / sum w^2`` (in [1, len(w)])."""
    w = np.asarray(weights, dtype=np.float64)
    s2 = float(np.dot(w, w))
    return float(w.sum() ** 2 / s2) if s2 > 0 else 0.0


class SumTree:
    """Array-based binary sum tree over ``capacity`` leaves, vectorised with numpy.

    Layout: ``P = next_pow2(capacity)``; node 1 is the root, node ``k`` has children ``2k``
    and ``2k+1``, leaves are nodes ``P .. P+capacity-1`` (``tree[P + i]`` is leaf ``i``), the
    padding leaves stay 0. Values must be >= 0; a leaf of 0 is never drawn.
    """

    def __init__(self, capacity: int):
        if int(capacity) < 1:
            raise ValueError(f"SumTree capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._p = 1 << max(0, (self.capacity - 1).bit_length())  # leaves start here
        self._depth = self._p.bit_length() - 1  # log2(P) levels below the root
        self.tree = np.zeros(2 * self._p, dtype=np.float64)

    def total(self) -> float:
        """Sum of all leaves (the root)."""
        return float(self.tree[1])

    def leaves(self, indices=None) -> np.ndarray:
        """Leaf values at ``indices`` (all ``capacity`` leaves if None); a copy."""
        if indices is None:
            return self.tree[self._p : self._p + self.capacity].copy()
        return self.tree[self._p + self._check(indices)]

    def update(self, indices, values) -> None:
        """Set leaves ``indices`` to ``values`` and fix their ancestors: O(B log N).

        With repeated indices the last value wins (numpy fancy-assignment order).
        """
        idx = self._check(indices)
        vals = np.broadcast_to(np.asarray(values, dtype=np.float64), idx.shape)
        if idx.size == 0:
            return
        if not np.all(np.isfinite(vals)) or np.any(vals < 0):
            raise ValueError("SumTree values must be finite and >= 0")
        t = self.tree
        if idx.size <= 4:  # a few items: scalar walks beat ~5 numpy calls per level
            for i, v in zip(idx.tolist(), vals.tolist()):
                n = i + self._p
                t[n] = v
                while n > 1:
                    n >>= 1
                    t[n] = t[2 * n] + t[2 * n + 1]
            return
        node = idx + self._p
        t[node] = vals
        for _ in range(self._depth):  # one vectorised pass per level, root last
            node >>= 1
            # duplicate parents are harmless: each writes the same sum of final children
            t[node] = t[2 * node] + t[2 * node + 1]

    def set_all(self, values) -> None:
        """Replace every leaf and rebuild all levels bottom-up: O(N), one numpy op per level."""
        vals = np.asarray(values, dtype=np.float64)
        if vals.shape != (self.capacity,):
            raise ValueError(f"set_all needs shape ({self.capacity},), got {vals.shape}")
        if not np.all(np.isfinite(vals)) or np.any(vals < 0):
            raise ValueError("SumTree values must be finite and >= 0")
        self.tree[self._p : self._p + self.capacity] = vals
        self.tree[self._p + self.capacity :] = 0.0
        self._rebuild()

    def _leaf_view(self) -> np.ndarray:
        """Writable view of the ``capacity`` leaves; call :meth:`_rebuild` after writing."""
        return self.tree[self._p : self._p + self.capacity]

    def _rebuild(self) -> None:
        t = self.tree
        lo = self._p
        while lo > 1:  # level [lo, 2lo) -> parents [lo/2, lo)
            t[lo // 2 : lo] = t[lo : 2 * lo : 2] + t[lo + 1 : 2 * lo : 2]
            lo //= 2

    def stratified_sample(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """Draw ``batch_size`` leaves: one uniform point in each of B equal strata of
        ``[0, total)``, then a batched descent (log2 P levels). Returns int64 leaf indices.

        The walk goes right iff the point is at or past the left mass, so a zero-mass left
        subtree is never entered. Float rounding can push a point past the mass of the right
        subtree too; such (rare) walks are redone with the guarded descent, which also refuses
        a zero-mass right subtree, so zero leaves (unused slots) are never drawn.
        """
        b = int(batch_size)
        if b < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        total = self.total()
        if not total > 0:
            raise ValueError("cannot sample from a SumTree whose total is 0")
        seg = total / b
        u = (np.arange(b) + rng.random(b)) * seg
        np.minimum(u, np.nextafter(total, 0.0), out=u)
        t = self.tree
        node = np.ones(b, dtype=np.int64)
        v = u.copy()
        for _ in range(self._depth):  # fast path: 5 small numpy ops per level
            node <<= 1
            left = t[node]
            go = v >= left
            np.subtract(v, left, out=v, where=go)
            node += go
        bad = t[node] <= 0
        if bad.any():
            node[bad] = self._guarded_descent(u[bad])
        return node - self._p

    def _guarded_descent(self, u: np.ndarray) -> np.ndarray:
        t = self.tree
        node = np.ones(len(u), dtype=np.int64)
        for _ in range(self._depth):
            left = t[2 * node]
            go = (u >= left) & (t[2 * node + 1] > 0)
            u = np.where(go, u - left, u)
            node = 2 * node + go
        return node

    def _check(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.capacity):
            raise IndexError(f"leaf index out of range [0, {self.capacity})")
        return idx


@dataclass
class FreshPERConfig:
    """FreshPER hyperparameters (Hydra group ``replay.*``; docs/methods.md, "Online data: configuration")."""

    alpha: float = 0.6
    """Priority exponent (``priority_exponent``), applied after the decay. Paper default 0.6."""
    tau: float = 500.0
    """Age-decay time constant in learner steps; ``float('inf')`` = standard PER.
    Paper default 500 (1000 for FrozenLake). Rescale if a learner step differs from a
    training iteration of the reference code."""
    beta0: float = 0.4
    """IS-correction exponent at step 0. Paper default 0.4."""
    beta1: float = 1.0
    """IS-correction exponent after annealing. Paper default 1.0."""
    beta_steps: int = 10000
    """Learner steps over which beta goes linearly from beta0 to beta1 (design choice: the
    paper gives only the endpoints; 0 means beta1 from the start)."""
    eps: float = 1e-6
    """Added to every base priority so priorities are > 0. Paper default 1e-6."""
    refresh_interval: int = 1
    """Learner steps between O(N) age-decay refreshes done by ``sample``. Paper default 1;
    raise it if the refresh is too slow at large capacity."""
    priority: str = "td"
    """Base-priority signal: ``td`` (|TD error|, critic-based learners; the recommended
    default), ``reward`` (|R|, critic-free) or ``advantage`` (|A|, PPO). All three are in the
    reference code; the buffer itself only records the choice (the caller passes the signal)."""

    def __post_init__(self) -> None:
        if self.priority not in PRIORITY_SIGNALS:
            raise ValueError(f"replay.priority must be one of {PRIORITY_SIGNALS}, got {self.priority!r}")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"replay.alpha must be finite and >= 0, got {self.alpha!r}")
        if math.isnan(self.tau) or self.tau <= 0:
            raise ValueError(f"replay.tau must be > 0 (float('inf') = standard PER), got {self.tau!r}")
        for name in ("beta0", "beta1"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"replay.{name} must be finite and >= 0, got {v!r}")
        if int(self.beta_steps) != self.beta_steps or self.beta_steps < 0:
            raise ValueError(f"replay.beta_steps must be an integer >= 0, got {self.beta_steps!r}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"replay.eps must be finite and > 0, got {self.eps!r}")
        if int(self.refresh_interval) != self.refresh_interval or self.refresh_interval < 1:
            raise ValueError(f"replay.refresh_interval must be an integer >= 1, got {self.refresh_interval!r}")


class FreshPER:
    """Prioritized replay whose priorities decay as ``exp(-age / tau)`` (docs/methods.md, "Online data: FreshPER").

    Typical learner loop::

        ids = buf.add(np.abs(td), step)                 # new items: decay factor 1
        ids, w = buf.sample(B, step)                    # refreshes every refresh_interval steps
        ... loss = (w * per_item_loss).mean() ...
        buf.update_priorities(ids, np.abs(new_td), step)
    """

    def __init__(self, capacity: int, config: FreshPERConfig | None = None, seed: int = 0,
                 on_full: str = "evict"):
        if on_full not in ("evict", "error"):
            raise ValueError(f"on_full must be 'evict' or 'error', got {on_full!r}")
        self.config = config if config is not None else FreshPERConfig()
        self.capacity = int(capacity)
        self.on_full = on_full
        self.tree = SumTree(self.capacity)
        self.rng = np.random.default_rng(seed)
        self._base = np.zeros(self.capacity, dtype=np.float64)  # |signal| + eps
        self._alog = np.zeros(self.capacity, dtype=np.float64)  # alpha * log(base)
        # k_i = alpha (log base_i + stored_at_i / tau): leaf_i = exp(k_i - alpha step / tau), so the
        # O(N) refresh is one subtraction and one exp per item
        self._key = np.zeros(self.capacity, dtype=np.float64)
        self._stored_at = np.zeros(self.capacity, dtype=np.int64)
        self._max_stored: int | None = None
        self.size = 0  # valid items are ids [0, size): slots are filled in order, never freed
        self._last_step: int | None = None  # latest step seen (default for update_priorities)
        self._last_refresh: int | None = None

    # ---------------------------------------------------------------- priorities
    def _leaf(self, ids, step: int, out: np.ndarray | None = None) -> np.ndarray:
        """Leaf (base * exp(-age/tau))**alpha of ``ids`` (an index array or a slice) at ``step``.

        Finite tau: ``exp(k_i - alpha step / tau)`` with ``k_i = alpha (log base_i + stored_at_i
        / tau)`` (log space, in place, floored at the smallest normal float). If ``step``
        precedes a stored step, the age is clipped at 0 as in the reference code.
        tau = inf: exactly ``base**alpha`` (standard PER).
        """
        c = self.config
        if math.isinf(c.tau):
            leaf = np.power(self._base[ids], c.alpha, out=out)
        elif self._max_stored is not None and step < self._max_stored:  # rare: clip negative ages
            age = np.maximum(step - self._stored_at[ids], 0).astype(np.float64)
            leaf = np.exp(self._alog[ids] - (c.alpha / c.tau) * age, out=out)
        else:
            leaf = np.subtract(self._key[ids], c.alpha * step / c.tau, out=out)
            np.exp(leaf, out=leaf)
        return np.maximum(leaf, _LEAF_FLOOR, out=leaf)

    def _set_base(self, ids: np.ndarray, base_priority) -> None:
        p = np.abs(np.asarray(base_priority, dtype=np.float64)).reshape(-1)
        if p.shape != ids.shape:
            p = np.broadcast_to(p, ids.shape)
        if not np.all(np.isfinite(p)):
            raise ValueError("base priorities must be finite")
        self._base[ids] = p + self.config.eps
        self._alog[ids] = self.config.alpha * np.log(self._base[ids])
        self._set_key(ids)

    def _set_key(self, ids: np.ndarray) -> None:
        if not math.isinf(self.config.tau):
            self._key[ids] = self._alog[ids] + (self.config.alpha / self.config.tau) * self._stored_at[ids]

    def _see(self, step: int) -> None:
        self._last_step = step if self._last_step is None else max(self._last_step, step)

    def beta(self, step: int) -> float:
        """IS exponent at ``step``: linear from beta0 (step 0) to beta1 (step >= beta_steps)."""
        c = self.config
        frac = 1.0 if c.beta_steps == 0 else min(max(step / c.beta_steps, 0.0), 1.0)
        return c.beta0 + (c.beta1 - c.beta0) * frac

    # ---------------------------------------------------------------- public API
    def add(self, base_priority: np.ndarray, step: int) -> np.ndarray:
        """Insert ``len(base_priority)`` items stored at ``step``; returns their int64 ids.

        Stores base = |base_priority| + eps, stored_at = step, leaf = base**alpha (decay
        factor 1). When full: ``on_full="evict"`` frees the existing items with the highest
        eviction score (age/tau)/(p+eps) (ties: oldest, then lowest id) and reuses their ids;
        ``on_full="error"`` raises :class:`ReplayFullError`.
        """
        step = int(step)
        k = int(np.asarray(base_priority).reshape(-1).shape[0])
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        if k > self.capacity:
            raise ReplayFullError(f"cannot add {k} items to a replay buffer of capacity {self.capacity}")
        n_free = self.capacity - self.size
        ids = np.arange(self.size, self.size + min(k, n_free), dtype=np.int64)
        if k > n_free:
            if self.on_full == "error":
                raise ReplayFullError(
                    f"replay buffer full (capacity {self.capacity}, {self.size} stored, adding {k}); "
                    "use on_full='evict' or a larger capacity")
            ids = np.concatenate([ids, self._evict(k - n_free, step)])
        self.size += min(k, n_free)
        self._stored_at[ids] = step
        self._set_base(ids, base_priority)  # also sets the refresh key from stored_at
        self._max_stored = step if self._max_stored is None else max(self._max_stored, step)
        self.tree.update(ids, self._leaf(ids, step))  # age 0: decay factor exactly 1
        self._see(step)
        return ids

    def _evict(self, k: int, step: int) -> np.ndarray:
        """Ids of the k valid items with the highest (age/tau)/(p+eps), p the effective priority."""
        c = self.config
        n = self.size
        age = np.maximum(step - self._stored_at[:n], 0).astype(np.float64)
        if math.isinf(c.tau):
            score = np.zeros(n)  # age/inf = 0 for all: pure FIFO through the tie-break
        else:
            p = self._base[:n] * np.exp(-age / c.tau)
            score = (age / c.tau) / (p + c.eps)
        order = np.lexsort((np.arange(n), self._stored_at[:n], -score))
        return order[:k].astype(np.int64)

    def refresh(self, step: int) -> None:
        """Recompute every valid leaf as (base * exp(-(step - stored_at)/tau))**alpha: O(N)."""
        step = int(step)
        n = self.size
        leaves = self.tree._leaf_view()
        if n:
            self._leaf(slice(0, n), step, out=leaves[:n])  # written in place, no temporaries
        leaves[n:] = 0.0  # unused slots: never drawn
        self.tree._rebuild()
        self._last_refresh = step
        self._see(step)

    def sample(self, batch_size: int, step: int, normalize: str = "batch") -> tuple[np.ndarray, np.ndarray]:
        """Stratified sample of ``batch_size`` ids with P(i) = leaf_i / total, and IS weights.

        ``w_i = (N P(i))^(-beta(step))``, N = number of stored items, divided by the batch max
        (``normalize="batch"``: max exactly 1) or by the largest weight any
        stored item could get (``normalize="buffer"``, reference code). Refreshes the decay
        first when ``refresh_interval`` steps have passed since the last refresh (skipped
        when tau = inf). Returns (int64 ids, float32 weights).
        """
        if normalize not in ("batch", "buffer"):
            raise ValueError(f"normalize must be 'batch' or 'buffer', got {normalize!r}")
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        step = int(step)
        if not math.isinf(self.config.tau) and (
                self._last_refresh is None or abs(step - self._last_refresh) >= self.config.refresh_interval):
            self.refresh(step)
        self._see(step)
        ids = self.tree.stratified_sample(batch_size, self.rng)
        beta = self.beta(step)
        # log w = -beta * log(N * leaf / total); normalised in log space so it cannot overflow
        log_leaf = np.log(self.tree.leaves(ids))
        logw = -beta * (math.log(self.size) + log_leaf - math.log(self.tree.total()))
        if normalize == "batch":
            ref = logw.max()
        else:
            min_leaf = self.tree.tree[self.tree._p : self.tree._p + self.size].min()
            ref = -beta * (math.log(self.size) + math.log(min_leaf) - math.log(self.tree.total()))
        w = np.exp(logw - ref)
        return ids, w.astype(np.float32)

    def update_priorities(self, ids, base_priority, step: int | None = None) -> None:
        """Set new base priorities (|base_priority| + eps, e.g. |TD error| after a learner step)
        and refresh those leaves with their current decay. The age is measured from the
        item's *stored* step, not from when it was last sampled or updated; ``step`` defaults
        to the latest step seen.
        """
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return
        self._check_ids(ids)
        if step is None:
            step = self._last_step if self._last_step is not None else 0
        step = int(step)
        self._set_base(ids, base_priority)
        self.tree.update(ids, self._leaf(ids, step))
        self._see(step)

    # ---------------------------------------------------------------- diagnostics
    def stored_at(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        self._check_ids(ids)
        return self._stored_at[ids].copy()

    def base_priority(self, ids) -> np.ndarray:
        """Stored base priorities (|signal| + eps)."""
        ids = np.asarray(ids, dtype=np.int64)
        self._check_ids(ids)
        return self._base[ids].copy()

    def probabilities(self, ids=None) -> np.ndarray:
        """Current sampling probabilities leaf_i / total (as of the last refresh/update)."""
        ids = np.arange(self.size) if ids is None else np.asarray(ids, dtype=np.int64)
        self._check_ids(ids)
        return self.tree.leaves(ids) / self.tree.total()

    def mean_age(self, ids, step: int) -> float:
        """Mean age ``step - stored_at`` of ``ids`` in learner steps."""
        ids = np.asarray(ids, dtype=np.int64)
        self._check_ids(ids)
        return float(np.mean(int(step) - self._stored_at[ids]))

    @staticmethod
    def ess(weights: np.ndarray) -> float:
        """Effective sample size of IS weights, ``(sum w)^2 / sum w^2``."""
        return ess(weights)

    def __len__(self) -> int:
        return self.size

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.size):
            raise IndexError(f"replay id out of range [0, {self.size})")
