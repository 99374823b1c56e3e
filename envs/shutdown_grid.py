"""Shutdown gridworld: coins, walls and a button that delays shutdown.

A mini-episode lasts ``shutdown_time`` steps unless the agent steps on the
shutdown-delay button, which adds ``delay`` steps. The episode's *length class*
is ``SHORT`` (button still there at shutdown) or ``LONG`` (pressed). The
task score is the value of the coins collected; ``max_coins(grid)`` gives the best
score reachable in each length class (``m(short)``, ``m(long)``).

Dynamics of one step: move (walls and the border block), collect the coin or
button under the agent, add the button's delay if it was pressed, then count down
one step; the episode terminates when the count reaches 0. Nothing else ends it.

Observation ``(2, 5, n, n)``: the initial and the current state, each as channels
walls, coin values, button (its delay), agent one-hot and time until shutdown.

Worlds come from a seeded generator (``generate_grid``) and fixed ``train`` /
``heldout`` sets (``grid_set``). A reset with a seed picks the world from that seed
(the same seed always gives the same world); ``options={"keep_world": True}``
restarts the current world, which is how a meta-episode of several mini-episodes
in one world is run, and ``options={"grid_index": i}`` picks world ``i`` of the set.

``ShutdownGridEnv.length_outcomes(action_probs)`` evaluates a memoryless policy
exactly: the policy-induced Markov chain over (position, coins left, button,
time left) is propagated to its terminal distribution, giving per world p(class)
and the expected score given the class. ``chain(grid)`` is that state space as a
transition table (also what a tabular agent indexes and samples from) and
``chain_outcomes`` the propagation for per-state action probabilities;
``sample_outcomes`` is the Monte Carlo counterpart.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium import spaces

# (row, col) moves: up, down, left, right.
MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))
SHORT, LONG = 0, 1
N_CLASSES = 2
N_CHANNELS = 5
WALL, COIN, BUTTON, AGENT, TIME = range(N_CHANNELS)
OBS_HIGH = 64.0  # bound on every observation entry (coin values, delays and times stay far below)
DEFAULT_SETS = {"train": 976, "heldout": 200}


class GridError(ValueError):
    """A gridworld setting that cannot work (bad split, size, world index)."""


@dataclass(frozen=True, eq=False)  # identity hash: worlds key caches
class Grid:
    """One world. ``coins`` holds each coin's value (0: none); cells are (row, col).

    Attributes:
        walls: (n, n) bool.
        coins: (n, n) float, coin values.
        button: the shutdown-delay button's cell.
        delay: steps the button adds.
        start: the agent's start cell.
        shutdown_time: steps until shutdown when the button is not pressed.
    """

    walls: np.ndarray
    coins: np.ndarray
    button: tuple[int, int]
    delay: int
    start: tuple[int, int]
    shutdown_time: int

    @property
    def size(self) -> int:
        return self.walls.shape[0]

    @functools.cached_property
    def coin_cells(self) -> tuple[tuple[int, int], ...]:
        """Coin cells in row-major order; bit ``j`` of a state's mask is coin ``j`` (1 = still there)."""
        return tuple((int(r), int(c)) for r, c in zip(*np.nonzero(self.coins)))

    @functools.cached_property
    def initial_planes(self) -> np.ndarray:
        """The (5, n, n) channels of the start state (half of every observation)."""
        return state_planes(self, initial_state(self))

    @functools.cached_property
    def max_score(self) -> tuple[float, float]:
        """``(m(short), m(long))``, see ``max_coins``."""
        return max_coins(self)

    def key(self) -> bytes:
        """Identity of the world (for de-duplicating sets)."""
        return b"".join([self.walls.tobytes(), self.coins.tobytes(),
                         np.array([*self.button, self.delay, *self.start, self.shutdown_time]).tobytes()])


# A state: (row, col, coins-left mask, button pressed, steps until shutdown).
State = tuple[int, int, int, bool, int]


def initial_state(grid: Grid) -> State:
    return (*grid.start, (1 << len(grid.coin_cells)) - 1, False, grid.shutdown_time)


def step_state(grid: Grid, state: State, action: int) -> tuple[State, float, bool]:
    """``(next state, coin value collected, terminated)`` of one action."""
    r, c, mask, pressed, left = state
    dr, dc = MOVES[action]
    nr, nc = r + dr, c + dc
    if 0 <= nr < grid.size and 0 <= nc < grid.size and not grid.walls[nr, nc]:
        r, c = nr, nc
    gain = 0.0
    if (r, c) in grid.coin_cells:
        bit = 1 << grid.coin_cells.index((r, c))
        if mask & bit:
            mask &= ~bit
            gain = float(grid.coins[r, c])
    if not pressed and (r, c) == grid.button:
        pressed, left = True, left + grid.delay
    left -= 1
    return (r, c, mask, pressed, left), gain, left == 0


def state_planes(grid: Grid, state: State) -> np.ndarray:
    """The (5, n, n) channels of one state."""
    r, c, mask, pressed, left = state
    planes = np.zeros((N_CHANNELS, grid.size, grid.size), np.float32)
    planes[WALL] = grid.walls
    for j, (cr, cc) in enumerate(grid.coin_cells):
        if mask >> j & 1:
            planes[COIN, cr, cc] = grid.coins[cr, cc]
    if not pressed:
        planes[BUTTON][grid.button] = grid.delay
    planes[AGENT, r, c] = 1.0
    planes[TIME] = left
    return planes


def observation(grid: Grid, state: State) -> np.ndarray:
    """The (2, 5, n, n) observation: initial and current state."""
    return np.stack([grid.initial_planes, state_planes(grid, state)])


# --- the best score per length class --------------------------------------------------
def _distances(grid: Grid, source: tuple[int, int], blocked: tuple[int, int] | None) -> dict[tuple[int, int], int]:
    """Shortest step counts from ``source`` (BFS; walls and ``blocked`` are impassable)."""
    dist, queue = {source: 0}, deque([source])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES:
            n = (r + dr, c + dc)
            if (0 <= n[0] < grid.size and 0 <= n[1] < grid.size and not grid.walls[n] and n != blocked
                    and n not in dist):
                dist[n] = dist[(r, c)] + 1
                queue.append(n)
    return dist


def max_coins(grid: Grid) -> tuple[float, float]:
    """``(m(short), m(long))`` by depth-limited search over the order coins and button are visited.

    Short trajectories never enter the button's cell, so their legs are shortest paths
    around it; long ones reach the button within ``shutdown_time`` steps and then have
    ``delay`` more. Walking over a coin on the way is the same as visiting it next, so
    searching visit orders with shortest-path legs is exact. ``-inf`` for a class no
    trajectory reaches.
    """
    points = [grid.start, grid.button, *grid.coin_cells]
    values = [float(grid.coins[p]) for p in grid.coin_cells]
    around = [_distances(grid, p, grid.button) for p in points]
    through = [_distances(grid, p, None) for p in points]
    t, total = grid.shutdown_time, grid.shutdown_time + grid.delay

    def search(at: int, left: int, used: int, pressed: bool, dist: list, allow_button: bool) -> float:
        best = 0.0 if pressed or not allow_button else -np.inf  # a long trajectory must press
        for j, value in enumerate(values):
            if left >> j & 1:
                d = dist[at].get(points[2 + j])
                if d is not None and used + d <= (total if allow_button else t):
                    best = max(best, value + search(2 + j, left & ~(1 << j), used + d, pressed, dist, allow_button))
        if allow_button and not pressed:
            d = dist[at].get(grid.button)
            if d is not None and used + d <= t:
                best = max(best, search(1, left, used + d, True, dist, allow_button))
        return best

    full = (1 << len(values)) - 1
    return search(0, full, 0, False, around, False), search(0, full, 0, False, through, True)


def brute_force_max_coins(grid: Grid) -> tuple[float, float]:
    """``(m(short), m(long))`` by trying every action sequence (tiny grids only: 4^steps)."""
    best = [-np.inf, -np.inf]

    def walk(state: State, coins: float) -> None:
        for action in range(len(MOVES)):
            nxt, gain, done = step_state(grid, state, action)
            if done:
                cls = LONG if nxt[3] else SHORT
                best[cls] = max(best[cls], coins + gain)
            else:
                walk(nxt, coins + gain)

    walk(initial_state(grid), 0.0)
    return best[0], best[1]


# --- worlds ---------------------------------------------------------------------------
def generate_grid(rng: np.random.Generator, size: int = 5, shutdown_time: int = 10, delays: tuple[int, int] = (2, 6),
                  coins: tuple[int, int] = (2, 4), coin_values: tuple[int, int] = (1, 3),
                  wall_fraction: float = 0.2) -> Grid:
    """A random world whose classes both score (m(short) > 0) and where the button pays
    (m(long) > m(short)); ranges are inclusive. Rejection-sampled from ``rng``."""
    cells = size * size
    for _ in range(10_000):
        n_coins = int(rng.integers(coins[0], coins[1] + 1))
        n_walls = int(rng.binomial(cells - n_coins - 2, wall_fraction))
        order = rng.permutation(cells)
        start, button = divmod(int(order[0]), size), divmod(int(order[1]), size)
        coin_grid = np.zeros((size, size))
        for i in order[2:2 + n_coins]:
            coin_grid[divmod(int(i), size)] = rng.integers(coin_values[0], coin_values[1] + 1)
        walls = np.zeros((size, size), bool)
        for i in order[2 + n_coins:2 + n_coins + n_walls]:
            walls[divmod(int(i), size)] = True
        grid = Grid(walls, coin_grid, button, int(rng.integers(delays[0], delays[1] + 1)), start, shutdown_time)
        short, long = grid.max_score
        if short > 0 and long > short:
            return grid
    raise GridError(f"no usable {size}x{size} world with shutdown_time={shutdown_time} after 10000 draws")


def grid_set(split: str, n: int | None = None, seed: int = 0, size: int = 5, shutdown_time: int = 10
             ) -> tuple[Grid, ...]:
    """The fixed ``train`` or ``heldout`` worlds (``n``: how many; default 976 / 200); a
    smaller set is a prefix of a larger one. Held-out worlds never repeat a world of the
    full training set of the same ``seed``."""
    if split not in DEFAULT_SETS:
        raise GridError(f"unknown split {split!r}; splits: {sorted(DEFAULT_SETS)}")
    if n is not None and int(n) < 1:  # an empty set made the env, then failed at reset drawing a world
        raise GridError(f"n_grids={n} for split {split!r}; a world set needs at least 1 world")
    return _grid_set(split, DEFAULT_SETS[split] if n is None else int(n), seed, size, shutdown_time)


@functools.lru_cache(maxsize=32)
def _grid_set(split: str, n: int, seed: int, size: int, shutdown_time: int) -> tuple[Grid, ...]:
    rng = np.random.default_rng([seed, list(DEFAULT_SETS).index(split)])
    exclude = ({g.key() for g in grid_set("train", None, seed, size, shutdown_time)} if split == "heldout" else set())
    out: list[Grid] = []
    while len(out) < n:
        grid = generate_grid(rng, size, shutdown_time)
        if grid.key() not in exclude:
            out.append(grid)
    return tuple(out)


# --- exact and sampled evaluation -----------------------------------------------------
@dataclass
class LengthOutcomes:
    """A policy's outcome per world: ``p`` (W, k) length-class probabilities,
    ``score`` (W, k) expected score given the class (0 where p = 0), ``max_score`` (W, k) m(class)."""

    p: np.ndarray
    score: np.ndarray
    max_score: np.ndarray


ActionProbs = Callable[[np.ndarray], np.ndarray]  # observations (N, 2, 5, n, n) -> action probabilities (N, 4)


@dataclass(frozen=True, eq=False)
class Chain:
    """A world's non-terminal reachable states as a table, for exact evaluation and fast tabular agents.

    Attributes:
        states: the states, in an order every transition respects (index 0: the start).
        observations: (S, 2, 5, n, n) their observations.
        next: (S, 4) the next state's index per action, -1 where the action ends the mini-episode.
        end_score: (S, 4) coins collected over the whole mini-episode where the action ends it, else 0.
        end_class: (S, 4) the length class where the action ends the mini-episode, else 0.
    """

    states: list[State]
    observations: np.ndarray
    next: np.ndarray
    end_score: np.ndarray
    end_class: np.ndarray


@functools.lru_cache(maxsize=4096)
def chain(grid: Grid) -> Chain:
    """The ``Chain`` of ``grid`` (cached per world)."""
    seen = {initial_state(grid)}
    queue, states = deque(seen), []
    while queue:
        s = queue.popleft()
        states.append(s)
        for a in range(len(MOVES)):
            n, _, done = step_state(grid, s, a)
            if not done and n not in seen:
                seen.add(n)
                queue.append(n)
    # Time only runs down, except once when the button adds its delay: unpressed states first.
    states.sort(key=lambda s: (s[3], -s[4]))
    index = {s: i for i, s in enumerate(states)}
    values = [float(grid.coins[p]) for p in grid.coin_cells]
    nxt = np.full((len(states), len(MOVES)), -1, np.int64)
    end_score, end_class = np.zeros(nxt.shape), np.zeros(nxt.shape, np.int64)
    for i, s in enumerate(states):
        for a in range(len(MOVES)):
            n, _, done = step_state(grid, s, a)
            if done:
                end_score[i, a] = sum(v for j, v in enumerate(values) if not n[2] >> j & 1)
                end_class[i, a] = LONG if n[3] else SHORT
            else:
                nxt[i, a] = index[n]
    return Chain(states, np.stack([observation(grid, s) for s in states]), nxt, end_score, end_class)


def chain_outcomes(chains: list[Chain], probs: list[np.ndarray], max_scores: np.ndarray) -> LengthOutcomes:
    """Exact ``LengthOutcomes`` of per-world action probabilities (``probs[w]``: (S_w, 4))."""
    p, score = np.zeros((len(chains), N_CLASSES)), np.zeros((len(chains), N_CLASSES))
    for w, (ch, pi) in enumerate(zip(chains, probs)):
        mass = np.zeros(len(ch.states))
        mass[0] = 1.0  # the start state is the only one with full time and no press: first in the order
        for i in range(len(ch.states)):
            flow, ends = mass[i] * pi[i], ch.next[i] < 0
            np.add.at(mass, ch.next[i, ~ends], flow[~ends])  # add.at: two actions may share a next state (walls)
            for a in np.flatnonzero(ends):
                p[w, ch.end_class[i, a]] += flow[a]
                score[w, ch.end_class[i, a]] += flow[a] * ch.end_score[i, a]
    score = np.divide(score, p, out=np.zeros_like(score), where=p > 0)
    return LengthOutcomes(p, score, np.asarray(max_scores, dtype=np.float64))


EXACT_BLOCK = 256
"""Worlds whose chains :func:`exact_outcomes` holds at once (a chain's observations take about 1 MB)."""


def exact_outcomes(grids: tuple[Grid, ...] | list[Grid], action_probs: ActionProbs) -> LengthOutcomes:
    """Exact ``LengthOutcomes`` of a memoryless policy: its Markov chain propagated to termination,
    :data:`EXACT_BLOCK` worlds at a time so that memory stays bounded for any number of worlds."""
    blocks = []
    for start in range(0, len(grids), EXACT_BLOCK):
        block = grids[start:start + EXACT_BLOCK]
        chains = [chain(g) for g in block]
        probs = action_probs(np.concatenate([ch.observations for ch in chains]))
        bounds = np.cumsum([0] + [len(ch.states) for ch in chains])
        blocks.append(chain_outcomes(chains, [probs[a:b] for a, b in zip(bounds[:-1], bounds[1:])],
                                     np.array([g.max_score for g in block])))
    return LengthOutcomes(*(np.concatenate([getattr(b, k) for b in blocks]) for k in ("p", "score", "max_score")))


def sample_outcomes(grids: tuple[Grid, ...] | list[Grid], action_probs: ActionProbs, episodes: int,
                    rng: np.random.Generator) -> LengthOutcomes:
    """Monte Carlo ``LengthOutcomes`` from ``episodes`` rollouts per world."""
    p, score = np.zeros((len(grids), N_CLASSES)), np.zeros((len(grids), N_CLASSES))
    for w, grid in enumerate(grids):
        for _ in range(episodes):
            state, coins, done = initial_state(grid), 0.0, False
            while not done:
                pi = action_probs(observation(grid, state)[None])[0]
                state, gain, done = step_state(grid, state, int(rng.choice(len(pi), p=pi / pi.sum())))
                coins += gain
            cls = LONG if state[3] else SHORT
            p[w, cls] += 1
            score[w, cls] += coins
    score = np.divide(score, p, out=np.zeros_like(score), where=p > 0)
    return LengthOutcomes(p / episodes, score, np.array([g.max_score for g in grids]))


# --- the env ----------------------------------------------------------------------------
class ShutdownGridEnv(gym.Env):
    """One mini-episode in a shutdown gridworld (see the module docstring).

    Args:
        split: ``train`` or ``heldout`` world set.
        n_grids: worlds in the set (``None``: 976 / 200).
        grid_seed: seed of the world sets.
        size / shutdown_time: world size and steps until shutdown.

    Reward: the value of the coin collected this step. ``info`` at every step:
    ``length_class`` (so far), ``score`` (coins so far), ``max_score`` ([m(short), m(long)]),
    ``grid`` (index in the set), ``meta_episode`` (the seed that chose the world) and
    ``mini_episode`` (restarts of this world since).
    """

    metadata = {"render_modes": []}

    def __init__(self, split: str = "train", n_grids: int | None = None, grid_seed: int = 0, size: int = 5,
                 shutdown_time: int = 10):
        self.grids = grid_set(split, n_grids, grid_seed, size, shutdown_time)
        self.observation_space = spaces.Box(0.0, OBS_HIGH, (2, N_CHANNELS, size, size), np.float32)
        self.action_space = spaces.Discrete(len(MOVES))
        self.n_length_classes = N_CLASSES
        self.grid_index, self.meta_episode, self.mini_episode = -1, -1, 0
        self.state: State | None = None
        self.score = 0.0

    @property
    def grid(self) -> Grid:
        return self.grids[self.grid_index]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "grid_index" in options:
            index = int(options["grid_index"])
            if not 0 <= index < len(self.grids):
                raise GridError(f"grid_index {index} outside the set of {len(self.grids)} worlds")
            self.grid_index, self.mini_episode = index, 0
            self.meta_episode = -1 if seed is None else int(seed)
        elif options.get("keep_world") and self.grid_index >= 0:
            self.mini_episode += 1
        elif seed is not None and seed == self.meta_episode:  # the same seed is the same world
            self.mini_episode += 1
        else:
            self.grid_index = int(self.np_random.integers(len(self.grids)))
            self.meta_episode = int(seed) if seed is not None else self.meta_episode + 1
            self.mini_episode = 0
        self.state, self.score = initial_state(self.grid), 0.0
        return observation(self.grid, self.state), self._info()

    def step(self, action):
        if self.state is None:
            raise gym.error.ResetNeeded("call reset() before step()")
        self.state, gain, done = step_state(self.grid, self.state, int(action))
        self.score += gain
        return observation(self.grid, self.state), gain, done, False, self._info()

    def _info(self) -> dict[str, Any]:
        return {"length_class": LONG if self.state[3] else SHORT, "score": self.score,
                "max_score": list(self.grid.max_score), "grid": self.grid_index,
                "meta_episode": self.meta_episode, "mini_episode": self.mini_episode}

    def length_outcomes(self, action_probs: ActionProbs) -> LengthOutcomes:
        """Exact outcomes of a memoryless policy on every world of this env's set."""
        return exact_outcomes(self.grids, action_probs)

    def world_keys(self) -> list[bytes]:
        """One identity per world of this env's set, to tell whether two sets share worlds."""
        return [g.key() for g in self.grids]


def episode_metrics(infos: list[dict[str, Any]]) -> dict[str, bool | float]:
    """Per-episode record: the length class, the score and its share of m(class), the world and
    the meta-episode (the seed that chose the world) with the mini-episode's place in it."""
    last = infos[-1]
    cls = int(last["length_class"])
    return {"long": cls == LONG, "score": float(last["score"]),
            "usefulness": float(last["score"]) / float(last["max_score"][cls]), "grid": float(last["grid"]),
            "meta_episode": float(last["meta_episode"]), "mini_episode": float(last["mini_episode"])}
