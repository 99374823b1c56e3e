"""Action-chunk window sampling with chunked n-step returns.

A window starts at any step ``t`` of an episode of length ``T`` and covers the
action chunk ``a_{t:t+H}``. Batches (``B`` windows) are dicts of torch tensors:

=================  ================  ===========================================
key                shape             meaning
=================  ================  ===========================================
``obs[k]``         (B, *obs_shape)   observation at t (uint8 images stay uint8);
                                     ``obs["instruction"]`` is a list of B strings
``actions``        (B, H, A)         a_t .. a_{t+H-1}; past the episode end the
                                     last action is repeated; float32, or int64
                                     for integer (discrete) actions
``action_mask``    (B, H) bool       True where the action is real, not padding
``rewards``        (B,) float32      sum_{i<K} gamma^i r_{t+i}, K = n_step * H,
                                     stopping at the episode end
``next_obs[k]``    (B, *obs_shape)   bootstrap observation s_{t+K}; if the window
                                     runs past the end: the final observation
``discounts``      (B,) float32      gamma^K inside the episode; gamma^(T-t) when
                                     a truncated episode ends inside the window;
                                     0 when a terminated one does (no bootstrap),
                                     or a truncated one with
                                     ``bootstrap_truncated=False``
``policy_version`` (B,) int64        version that produced a_t
``indices``        (B,) int64        global step index (for priorities)
``extras[name]``   (B, *shape)       the schema's per-step extras at t, stored
                                     dtype (the key is absent when the schema
                                     declares no extras)
=================  ================  ===========================================

This is the chunk TD target of docs/methods.md, "Chunked TD targets": the critic
target is ``rewards + discounts * V(next_obs)``.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from robo_post.store.replay import FreshPER, FreshPERConfig
from robo_post.store.schema import STEP_COLUMNS
from robo_post.store.store import EpisodeInfo, Snapshot


class _Grow:
    """A numpy array that grows along axis 0 by doubling (amortised O(1) appends)."""

    def __init__(self, dtype, shape):
        self.data = np.zeros((0, *shape), dtype=dtype)
        self.n = 0

    def extend(self, rows: np.ndarray) -> None:
        need = self.n + len(rows)
        if need > len(self.data):
            new = np.zeros((max(need, 2 * len(self.data), 1024), *self.data.shape[1:]), dtype=self.data.dtype)
            new[: self.n] = self.data[: self.n]
            self.data = new
        self.data[self.n : need] = rows
        self.n = need

    @property
    def view(self) -> np.ndarray:
        return self.data[: self.n]


class WindowSampler:
    """Uniform random windows over episodes loaded into memory.

    Args:
        horizon: H, the action-chunk length.
        n_step: number of chunks in the TD backup (K = n_step * H env steps).
        gamma: per-step discount.
        obs_keys: observation keys to keep (default: all in the schema).
        device: torch device for returned tensors.
        seed: RNG seed for window selection.
        bootstrap_truncated: bootstrap from the final observation of an episode cut by a
            time limit (gym semantics). False makes every episode end terminal: a time-out
            is a failure worth its rewards so far, the episode-level success label of
            LWD's sparse-reward setting. Without a clock in the state, bootstrapping a
            time-out gives a failed attempt the value of the same state on a successful one.
            None (``"auto"``) reads it from each episode's success label: a truncated
            episode labelled a failure ends there, any other truncated one (labelled a
            success, or by a store without a success rule: dense-reward control cut by its
            time limit) is bootstrapped.
    """

    def __init__(
        self,
        horizon: int = 5,
        n_step: int = 1,
        gamma: float = 0.99,
        obs_keys: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
        bootstrap_truncated: bool | None = True,
    ):
        if horizon < 1 or n_step < 1:
            raise ValueError("horizon and n_step must be >= 1")
        self.horizon, self.n_step, self.gamma = horizon, n_step, gamma
        self.bootstrap_truncated = bootstrap_truncated
        self.obs_keys = None if obs_keys is None else list(obs_keys)
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)
        self.episodes: list[EpisodeInfo] = []
        self._obs: dict[str, _Grow] = {}
        self._extras: dict[str, _Grow] | None = None  # None until the first episode; {} if none declared
        # Actions with each episode's last action repeated H - 1 more times, so the
        # window of every start step is one contiguous run of rows.
        self._action: _Grow | None = None
        # Everything a window needs that depends only on its start step is computed
        # once per step when episodes are added; sample() is then a few gathers.
        self._version = _Grow(np.int64, ())
        self._intervention = _Grow(bool, ())  # a_t was the overseer's, not the policy's
        self._ordinal = _Grow(np.int64, ())  # episode ordinal (for the instruction)
        self._obs_row = _Grow(np.int64, ())  # observation row of s_t
        self._next_row = _Grow(np.int64, ())  # observation row of the bootstrap s_{t+K}
        self._action_row = _Grow(np.int64, ())  # row of a_t in the padded actions
        self._action_mask = _Grow(bool, (horizon,))  # True where a_{t+i} is real, not padding
        self._return = _Grow(np.float32, ())  # chunked discounted reward sum
        self._discount = _Grow(np.float32, ())
        self._return_to_go = _Grow(np.float32, ())  # sum_i gamma^i r_{t+i} to the episode end
        self._pow = gamma ** np.arange(n_step * horizon + 1, dtype=np.float64)

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, episodes: Iterable[EpisodeInfo] | None = None, **kwargs) -> "WindowSampler":
        sampler = cls(**kwargs)
        sampler.add_episodes(snapshot, snapshot.episodes() if episodes is None else episodes)
        return sampler

    def __len__(self) -> int:
        """Number of steps (= possible window starts) held."""
        return self._version.n

    def returns_to_go(self) -> np.ndarray:
        """Discounted return from every held step to its episode's end (no bootstrap), (steps,)."""
        return self._return_to_go.view

    def obs_stats(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-dimension mean and std of observation ``key`` over the held data."""
        data = self._obs[key].view.astype(np.float64)
        return data.mean(axis=0), data.std(axis=0)

    def action_range(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-dimension smallest and largest action over the held data."""
        data = self._action.view
        return data.min(axis=0), data.max(axis=0)

    def add_episodes(self, snapshot: Snapshot, episodes: Iterable[EpisodeInfo]) -> None:
        """Load ``episodes`` of ``snapshot`` into memory (one read per shard)."""
        by_shard: dict[str, list[EpisodeInfo]] = {}
        for ep in episodes:
            by_shard.setdefault(ep.client_id, []).append(ep)
        keys = self.obs_keys or list(snapshot.store.schema.observations)
        for shard, eps in sorted(by_shard.items()):
            data = snapshot.load_shard(shard)
            for ep in eps:
                self._append(ep, data, keys)
        self._instructions = np.array([e.instruction for e in self.episodes], dtype=object)
        if self._action is None:
            return
        # (rows, H, A) view whose row i is the action window starting at padded row i.
        pad = self._action.view
        self._action_windows = np.lib.stride_tricks.as_strided(
            pad, (len(pad) - self.horizon + 1, self.horizon, *pad.shape[1:]), (pad.strides[0], *pad.strides), writeable=False
        )

    def bootstraps(self, ep: EpisodeInfo) -> bool:
        """Whether a window running past the end of truncated episode ``ep`` bootstraps."""
        if self.bootstrap_truncated is None:
            return ep.success is not False
        return self.bootstrap_truncated

    def _append(self, ep: EpisodeInfo, data: dict, keys: list[str]) -> None:
        T, s0, o0 = ep.length, ep.step_start, ep.obs_start
        H, K = self.horizon, self.n_step * self.horizon
        if self._action is None:
            self.obs_keys = keys
            for k in keys:
                self._obs[k] = _Grow(data["obs"][k].dtype, data["obs"][k].shape[1:])
            # Float actions become float32 (what the learner trains on); integer ones stay integers.
            self._action = _Grow(np.int64 if data["action"].dtype.kind in "iu" else np.float32, data["action"].shape[1:])
            self._extras = {k: _Grow(v.dtype, v.shape[1:]) for k, v in data["extras"].items()}
        obs_start, action_start = self._obs[keys[0]].n, self._action.n
        for k in keys:
            self._obs[k].extend(data["obs"][k][o0 : o0 + T + 1])
        actions = data["action"][s0 : s0 + T]
        self._action.extend(np.concatenate([actions, np.repeat(actions[-1:], H - 1, axis=0)]))
        for k, grow in self._extras.items():
            grow.extend(data["extras"][k][s0 : s0 + T])
        table = data["step"][s0 : s0 + T]
        t = np.arange(T)
        # Rewards r_t .. r_{t+K-1}, zero past the episode end.
        r = table[:, 0].astype(np.float32)[np.minimum(t[:, None] + np.arange(K), T - 1)] * (t[:, None] + np.arange(K) < T)
        taken = np.minimum(K, T - t)  # env steps until bootstrap (or episode end)
        no_bootstrap = (t + K >= T) & (ep.terminated or not self.bootstraps(ep))
        self._return.extend((r @ self._pow[:K]).astype(np.float32))
        self._discount.extend((self._pow[taken] * ~no_bootstrap).astype(np.float32))
        rtg = np.zeros(T + 1)
        for i in range(T - 1, -1, -1):
            rtg[i] = table[i, 0] + self.gamma * rtg[i + 1]
        self._return_to_go.extend(rtg[:T].astype(np.float32))
        self._version.extend(table[:, 3])
        self._intervention.extend(table[:, STEP_COLUMNS.index("intervention")] > 0)
        self._ordinal.extend(np.full(T, len(self.episodes)))
        self._obs_row.extend(obs_start + t)
        self._next_row.extend(obs_start + t + taken)  # == final-observation row when the window overruns
        self._action_row.extend(action_start + t)
        self._action_mask.extend(t[:, None] + np.arange(H) < T)
        self.episodes.append(ep)

    def sample(
        self, batch_size: int, min_policy_version: int | None = None, starts: np.ndarray | None = None
    ) -> dict:
        """Sample ``batch_size`` windows (see module docstring for the batch layout).

        Args:
            min_policy_version: bounded staleness: only start windows on steps whose
                ``policy_version`` is at least this.
            starts: explicit global step indices instead of uniform sampling.
        """
        if len(self) == 0:
            raise ValueError("sampler holds no episodes")
        if starts is None:
            if min_policy_version is None:
                starts = self.rng.integers(0, len(self), batch_size)
            else:
                eligible = np.flatnonzero(self._version.view >= min_policy_version)
                if len(eligible) == 0:
                    raise ValueError(f"no steps with policy_version >= {min_policy_version}")
                starts = eligible[self.rng.integers(0, len(eligible), batch_size)]
        t = np.ascontiguousarray(starts, dtype=np.int64)
        rows, next_rows = self._obs_row.view[t], self._next_row.view[t]
        instructions = self._instructions[self._ordinal.view[t]].tolist()
        # Fancy indexing yields new contiguous arrays: from_numpy shares them, no copy.
        to = torch.from_numpy if self.device.type == "cpu" else lambda x: torch.from_numpy(x).to(self.device)
        batch = {
            "obs": {k: to(self._obs[k].view[rows]) for k in self.obs_keys} | {"instruction": instructions},
            "actions": to(self._action_windows[self._action_row.view[t]]),
            "action_mask": to(self._action_mask.view[t]),
            "rewards": to(self._return.view[t]),
            "next_obs": {k: to(self._obs[k].view[next_rows]) for k in self.obs_keys} | {"instruction": instructions},
            "discounts": to(self._discount.view[t]),
            "policy_version": to(self._version.view[t]),
            "indices": to(t),
        }
        if self._extras:
            batch["extras"] = {k: to(grow.view[t]) for k, grow in self._extras.items()}
        return batch


class ImitationSampler:
    """Windows whose first action a demonstrator chose: every step of the demonstration
    episodes (``is_demo``) and the intervention steps of all others (HG-DAgger's data),
    drawn uniformly from the windows already held by ``samplers`` (no second copy).

    What a co-trained BC base imitates (``lwd.imitation``): the learner's batches mix
    every source, and a base that imitated them all would imitate failures too.
    """

    def __init__(self, samplers: list[WindowSampler], is_demo: Callable[[EpisodeInfo], bool], seed: int = 0):
        self.samplers, self.is_demo = list(samplers), is_demo
        self.starts = [np.zeros(0, dtype=np.int64) for _ in self.samplers]
        self._demo: list[list[bool]] = [[] for _ in self.samplers]  # is_demo per episode ordinal
        self._indexed = [0] * len(self.samplers)
        self.rng = np.random.default_rng(seed)
        self.refresh()

    def refresh(self) -> None:
        """Index the windows added to the samplers since the last call."""
        for i, s in enumerate(self.samplers):
            rows = np.arange(self._indexed[i], len(s))
            self._demo[i] += [self.is_demo(e) for e in s.episodes[len(self._demo[i]):]]
            demo = np.array(self._demo[i], dtype=bool)[s._ordinal.view[rows]]
            self.starts[i] = np.concatenate([self.starts[i], rows[demo | s._intervention.view[rows]]])
            self._indexed[i] = len(s)

    def __len__(self) -> int:
        return sum(len(st) for st in self.starts)

    def sample(self, batch_size: int) -> dict:
        if not len(self):
            raise ValueError("no demonstration or intervention steps to imitate")
        counts = self.rng.multinomial(batch_size, [len(st) / len(self) for st in self.starts])
        return _concat([s.sample(0, starts=st[self.rng.integers(0, len(st), n)])
                        for s, st, n in zip(self.samplers, self.starts, counts) if n])


class PrioritizedSampler:
    """FreshPER (docs/methods.md, "Online data: FreshPER") over the windows of a ``WindowSampler``.

    Every window start is one replay item, stored at the learner step its episode
    reached the learner; ``add_windows`` registers the windows of episodes just added
    to the sampler. Batches carry IS ``weights`` (B,) and ``replay_ids`` (B,); after
    the learner step, ``update_priorities(batch, td_error)`` sets the base priorities
    to |TD error|. Items enter at base priority ``initial_priority`` (1 = the largest
    |TD| of a success-in-[0, 1] critic), with decay factor 1.

    Args:
        sampler: the windows to draw from.
        config: ``FreshPERConfig``.
        initial_priority: base priority before a window's first TD error is known.
        seed: seed of the replay's stratified draws.
    """

    def __init__(self, sampler: WindowSampler, config: FreshPERConfig, initial_priority: float = 1.0, seed: int = 0):
        self.sampler, self.initial_priority = sampler, initial_priority
        self.per = FreshPER(max(len(sampler), 1), config, seed, on_full="error")
        self.window = np.zeros(self.per.capacity, dtype=np.int64)  # replay id -> window start
        self.step = 0  # the learner sets its current update before each draw

    def __len__(self) -> int:
        return len(self.per)

    def add_windows(self, stored_at: np.ndarray) -> None:
        """Make the sampler's last ``len(stored_at)`` window starts (just added by
        ``add_episodes``) replay items stored at these learner steps."""
        n = len(stored_at)
        starts = np.arange(len(self.sampler) - n, len(self.sampler))
        if len(self.per) + n > self.per.capacity:
            self._grow(len(self.per) + n)
        self._add(starts, np.asarray(stored_at), np.full(n, self.initial_priority))

    def _add(self, starts: np.ndarray, stored_at: np.ndarray, base: np.ndarray) -> None:
        for step in np.unique(stored_at):
            sel = stored_at == step
            self.window[self.per.add(base[sel], int(step))] = starts[sel]

    def _grow(self, size: int) -> None:
        """Move every item, with its base priority and stored step, into a larger buffer."""
        old, ids = self.per, np.arange(len(self.per))
        starts = self.window[ids]
        self.per = FreshPER(max(size, 2 * old.capacity), old.config, on_full="error")
        self.per.rng = old.rng  # one stream of draws across growths
        self.window = np.zeros(self.per.capacity, dtype=np.int64)
        self._add(starts, old.stored_at(ids), old.base_priority(ids) - old.config.eps)

    def sample(self, batch_size: int) -> dict:
        ids, weights = self.per.sample(batch_size, self.step)
        batch = self.sampler.sample(batch_size, starts=self.window[ids])
        batch["weights"] = torch.from_numpy(weights).to(self.sampler.device)
        batch["replay_ids"] = torch.from_numpy(ids).to(self.sampler.device)
        return batch

    def update_priorities(self, batch: dict, td_error: torch.Tensor) -> None:
        """New base priorities |TD| for the rows of ``batch`` drawn from this replay (``replay_ids >= 0``)."""
        ids = batch["replay_ids"].cpu().numpy()
        mine = ids >= 0
        self.per.update_priorities(ids[mine], td_error.detach().cpu().numpy()[mine], self.step)


class MixedSampler:
    """Draw a fixed fraction of each batch from a second (online) sampler.

    Args:
        offline: sampler over the offline dataset.
        online: sampler over fleet data gathered online.
        online_fraction: share of each batch taken from ``online`` (once it holds data).
    """

    def __init__(self, offline: WindowSampler, online: "WindowSampler | PrioritizedSampler",
                 online_fraction: float = 0.5):
        if not 0.0 <= online_fraction <= 1.0:
            raise ValueError("online_fraction must be in [0, 1]")
        self.offline, self.online, self.online_fraction = offline, online, online_fraction

    def sample(self, batch_size: int, **kwargs) -> dict:
        """A batch whose ``source`` tensor is 0 for offline rows and 1 for online rows."""
        n_on = int(round(batch_size * self.online_fraction)) if len(self.online) else 0
        n_off = batch_size - n_on
        if n_off and not len(self.offline):
            n_on, n_off = batch_size, 0
        parts = [(s.sample(n, **kwargs), src) for s, n, src in ((self.offline, n_off, 0), (self.online, n_on, 1)) if n]
        if any("weights" in p for p, _ in parts):  # one side prioritized: uniform rows get weight 1, no replay id
            for p, _ in parts:
                n = len(p["rewards"])
                p.setdefault("weights", torch.ones(n, device=p["rewards"].device))
                p.setdefault("replay_ids", torch.full((n,), -1, dtype=torch.int64, device=p["rewards"].device))
        batch = _concat([p for p, _ in parts])
        batch["source"] = torch.cat([torch.full((len(p["rewards"]),), src, dtype=torch.int64) for p, src in parts]).to(
            batch["rewards"].device
        )
        return batch


def _concat(batches: list[dict]) -> dict:
    if len(batches) == 1:
        return batches[0]
    out = {}
    for key, value in batches[0].items():
        if isinstance(value, dict):
            out[key] = {k: _cat([b[key][k] for b in batches]) for k in value}
        else:
            out[key] = _cat([b[key] for b in batches])
    return out


def _cat(parts: list) -> torch.Tensor | list:
    return torch.cat(parts) if isinstance(parts[0], torch.Tensor) else [x for p in parts for x in p]
