"""A fleet client: run episodes with the newest policy, commit each to its own shard.

Run one with ``python -m robo_post.fleet.client '<ClientConfig as JSON>'``; the
launchers do exactly that (local processes) or call ``run_client`` in an actor
(Ray). Configs cross process boundaries as JSON, never pickle.

Per-client status (episodes, steps/s, policy version, last error) is written to
``STORE/fleet/<client>.json`` after every episode, for launchers and people.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from gymnasium import spaces

from robo_post.envs.registry import EnvRegistryError, EnvSpec, env_spec
from robo_post.fleet.policies import ExpertPolicy, build_policy, policy_extras, recorded_extras
from robo_post.store import EpisodeValidationError, PolicyRegistry, Store, StoreSchema
from robo_post.utils.io import absolute_root, host_dir, write_json_atomic


MAX_REJECTED_IN_A_ROW = 3
LAUNCHER_PID_ENV = "ROBO_POST_LAUNCHER_PID"  # set by LocalLauncher for the clients it spawns


@dataclass
class ClientConfig:
    """Everything one client needs; JSON-serialisable.

    Attributes:
        store: store root directory (must exist; launchers create it).
        client_id: shard name of this client.
        episodes: stop once the shard holds this many committed episodes.
        env: ``name`` (an alias or gymnasium id, see ``robo_post.envs.env_spec``) and
            constructor kwargs.
        tasks: the env's tasks cycled episode by episode; empty: its default tasks.
        policy: artifact config used until the registry has a version (version 0).
        follow_registry: load the newest registry version at every episode boundary.
        overseer: ``{"enabled", "stall_steps", "stall_tol", "takeover_steps", "deadline", "divergence"}``
            (``Overseer``).
        seed: base seed; episode seeds derive from (seed, seed_key or client_id, episode index).
        seed_key: clients sharing a seed_key see the same layouts (common random numbers
            when comparing policy versions).
        policy_store: store whose registry policies come from (default: ``store``).
        policy_version: pin this registry version: loaded once, never hot-swapped
            (evaluation of one exact policy).
        layout_repeats: episodes per layout: each layout (and task) is run this many times
            in a row with different policy sampling seeds, so a critic sees several actions
            from the very same start state (GRPO-style groups; simulation only).
        role: what the episodes are for (a store role: demo, play, deploy, online, eval,
            other), recorded with each episode.
        device: torch device learned policies run on.
    """

    store: str
    client_id: str
    episodes: int
    env: dict[str, Any]
    tasks: list[str] = field(default_factory=list)
    policy: dict[str, Any] = field(default_factory=lambda: {"kind": "expert"})
    follow_registry: bool = True
    overseer: dict[str, Any] = field(default_factory=lambda: {"enabled": False})
    seed: int = 0
    seed_key: str | None = None
    policy_store: str | None = None
    policy_version: int | None = None
    layout_repeats: int = 1
    role: str = "other"
    device: str = "cpu"


def make_env(env_cfg: dict[str, Any], task: str | None):
    """Build the env named in ``env_cfg`` (through the env registry) for one task."""
    return env_spec(env_cfg["name"]).make(task, **{k: v for k, v in env_cfg.items() if k != "name"})


def store_schema(env_cfg: dict[str, Any], task: str | None) -> StoreSchema:
    """The store schema matching an env's observation and action spaces; the
    schema's ``env`` attr is the env's registry key (alias, else gymnasium id)."""
    env = make_env(env_cfg, task)
    try:
        return StoreSchema.from_spaces(env.observation_space, env.action_space, env=env_spec(env_cfg["name"]).key)
    finally:
        env.close()


def recorded_env_kwargs(policy_store: str, spec: EnvSpec) -> dict[str, Any] | None:
    """The env kwargs the store's episodes were collected with, when the store records ``spec``'s
    env: those every episode agrees on. A kwarg the episodes set to different values (or only
    some set) is left at the env's default and named on stderr. ``None``: another env's store,
    or episodes that record no kwargs (older stores); the env's defaults apply. The
    instruction split stays the eval's own choice."""
    store = Store.open(policy_store)
    recorded_in = store.schema.attrs.get("env")
    # "module:Env-v0" names the env Minari recorded as "Env-v0" (the module only registers it)
    if recorded_in is None or recorded_in.rpartition(":")[2] != spec.key.rpartition(":")[2]:
        return None
    # each episode's "env_kwargs" attr, as run_client (or an import) recorded it
    recorded = [e.attrs.get("env_kwargs") for e in store.snapshot().episodes()]
    if not recorded or any(kwargs is None for kwargs in recorded):
        return None
    keys = set().union(*recorded) - {spec.split_kwarg}
    agreed = {k: recorded[0][k] for k in sorted(keys) if all(k in r and r[k] == recorded[0][k] for r in recorded)}
    if mixed := sorted(keys - set(agreed)):
        print(f"the episodes of {policy_store} were recorded with different values of env kwargs {mixed}; "
              "the env's defaults apply to them unless given", file=sys.stderr)
    return agreed


class InvalidActionError(ValueError):
    """A policy produced an action outside the env's action space (or a non-finite one)."""


def executable_action(action: Any, space: spaces.Space) -> np.ndarray:
    """The action as the env and the store take it: a Box action cast to the space's
    dtype and clipped to its bounds; an integer (e.g. Discrete) action kept integer and
    checked, never clipped or cast to float.

    Raises:
        InvalidActionError: non-finite, or outside an integer space.
    """
    if isinstance(space, spaces.Box):
        a = np.asarray(action, dtype=space.dtype)
        if not np.isfinite(a).all():
            raise InvalidActionError(f"non-finite action {a}")
        return np.clip(a, space.low, space.high)
    a = np.asarray(action)
    if a.dtype.kind not in "iub":
        raise InvalidActionError(f"action {a} of dtype {a.dtype} for the integer space {space}")
    a = a.astype(space.dtype).reshape(space.shape)
    if not space.contains(a):
        raise InvalidActionError(f"action {a} outside the action space {space}")
    # A Discrete action as its space samples it, a numpy scalar: envs that index tables
    # with it (FrozenLake's transitions dict) refuse a 0-d array, which is unhashable.
    return a[()] if a.ndim == 0 else a


def episode_seed(seed: int, client_id: str, episode: int) -> int:
    """Deterministic, well-spread seed for one episode of one client."""
    return int(np.random.SeedSequence([seed, zlib.crc32(client_id.encode()), episode]).generate_state(1)[0])


class Overseer:
    """Scripted stand-in for a human supervisor (HG-DAgger style).

    When the policy stalls (the observation the env's registry entry names,
    ``spec.overseer_key``, moved less than ``stall_tol`` over the last
    ``stall_steps`` steps) the env's expert takes over for ``takeover_steps`` steps. With
    ``deadline`` set, an episode still running after that fraction of its step limit
    is rescued (the limit is ``spec.step_limit``): the expert takes over until it ends (a supervisor who stops waiting
    for a slow attempt). With ``divergence`` set (instead of the stall gate), the expert is
    asked at every step and takes over whenever the policy's action leaves the expert's by
    more than that fraction of the action range in any dimension (a discrete action: any
    other action), as a supervisor who grabs the wheel when the policy is about to do what
    the expert would not (the HG-DAgger gate). Taken-over steps are recorded with ``intervention=True``.
    """

    def __init__(self, spec: EnvSpec, stall_steps: int = 10, stall_tol: float = 1e-3, takeover_steps: int = 10,
                 deadline: float | None = None, divergence: float | None = None, **_: Any):
        if deadline is not None and not 0.0 < deadline <= 1.0:
            raise ValueError(f"overseer.deadline must be a fraction of the step limit in (0, 1], got {deadline}")
        if divergence is not None and not 0.0 < divergence <= 1.0:
            raise ValueError(f"overseer.divergence must be a fraction of the action range in (0, 1], got {divergence}")
        if not spec.supports_overseer:
            raise OverseerUnsupportedError(
                f"env {spec.key!r} has no overseer (it needs a scripted expert and an observation to watch)")
        self.spec = spec
        self.stall_steps, self.stall_tol, self.takeover_steps = stall_steps, stall_tol, takeover_steps
        self.deadline, self.divergence = deadline, divergence
        self.expert = ExpertPolicy()
        self.history: list[np.ndarray] = []
        self.remaining = 0
        self.steps, self.deadline_step = 0, None

    def reset(self, env: Any, seed: int) -> None:
        self.expert.reset(env, seed)
        self.history, self.remaining, self.steps = [], 0, 0
        self.deadline_step = None
        if self.deadline is not None:
            limit = self.spec.step_limit(env)
            if limit is None:
                raise ValueError(f"overseer.deadline needs an env with a step limit; {self.spec.key!r} has none")
            self.deadline_step = int(self.deadline * limit)

    def filter(self, obs: dict[str, Any], action: np.ndarray, env: Any) -> tuple[np.ndarray, bool]:
        """Return the action to execute and whether the overseer intervened."""
        self.steps += 1
        if self.deadline_step is not None and self.steps > self.deadline_step:
            return self.expert.act(obs, env), True
        # The divergence gate needs the expert's action every step; the stall gate only when it takes over.
        expert = self.expert.act(obs, env) if self.divergence is not None else None
        if self.divergence is None:
            state = np.asarray(obs[self.spec.overseer_key], dtype=np.float64)
            self.history = (self.history + [state])[-(self.stall_steps + 1) :]
        if self.remaining == 0 and self._gate(action, expert, env.action_space):
            self.remaining = self.takeover_steps
        if self.remaining > 0:
            self.remaining -= 1
            if self.remaining == 0:
                self.history = []  # give the policy a fresh window after handing back
            return (self.expert.act(obs, env) if expert is None else expert), True
        return action, False

    def _gate(self, action: np.ndarray, expert: np.ndarray | None, space: Any) -> bool:
        """Whether a takeover starts now: the policy left the expert's action, or it stalled."""
        if self.divergence is not None:
            return _diverges(action, expert, space, self.divergence)
        stalled = len(self.history) > self.stall_steps
        return stalled and np.abs(self.history[-1] - self.history[0]).max() < self.stall_tol


def _diverges(action: np.ndarray, expert: np.ndarray, space: Any, tol: float) -> bool:
    """Whether ``action`` differs from ``expert`` by more than ``tol`` of ``space``'s range in any dimension."""
    if not isinstance(space, spaces.Box):
        return not np.array_equal(action, expert)
    span = np.where(np.isfinite(space.high - space.low), space.high - space.low, 1.0)
    return bool((np.abs(np.asarray(action, np.float64) - expert) > tol * span).any())


class OverseerUnsupportedError(EnvRegistryError):
    """The overseer was enabled for an env whose registry entry does not support one."""


def run_client(cfg: ClientConfig) -> dict[str, Any]:
    """Run episodes until the shard holds ``cfg.episodes``; returns the final status."""
    torch.set_num_threads(1)  # one core per client; the fleet scales by processes
    store = Store.open(cfg.store)
    registry = PolicyRegistry(cfg.policy_store or store.root)
    status_path = os.path.join(host_dir(store.root, "fleet"), f"{cfg.client_id}.json")
    os.makedirs(os.path.dirname(status_path), exist_ok=True)
    spec = env_spec(cfg.env["name"])
    tasks = cfg.tasks or list(spec.default_tasks())
    overseer = Overseer(spec, **cfg.overseer) if cfg.overseer.get("enabled") else None
    env_kwargs = {k: v for k, v in cfg.env.items() if k != "name"}  # recorded per episode: eval rebuilds this env
    envs: dict[str, Any] = {}
    version, policy = 0, build_policy({}, cfg.policy, cfg.device)
    if cfg.policy_version is not None:
        version, policy = cfg.policy_version, build_policy(*registry.load(cfg.policy_version), cfg.device)
    t_start, steps_run, rejected_in_a_row = time.perf_counter(), 0, 0
    with store.writer(cfg.client_id, takeover=True) as writer:  # a restarted client waits out its dead self
        done = store.shard_episodes(cfg.client_id)  # counters survive restarts: start from what is committed
        status = {"client_id": cfg.client_id, "pid": os.getpid(), "episodes": len(done),
                  "steps": sum(e.length for e in done), "successes": sum(bool(e.success) for e in done),
                  "judged": sum(e.success is not None for e in done),
                  "rejected": 0, "interventions": 0, "steps_per_s": 0.0, "policy_version": 0, "last_error": None,
                  "state": "running", "target": cfg.episodes}
        write_json_atomic(status_path, status, fsync=False)
        while writer.n_episodes < cfg.episodes:
            if cfg.follow_registry and cfg.policy_version is None:
                latest = registry.latest()
                if latest is not None and latest != version:  # hot-swap only between episodes
                    policy, version = build_policy(*registry.load(latest), cfg.device), latest
            index = writer.n_episodes
            group = index // cfg.layout_repeats  # episodes of one group share the task and the layout
            task = tasks[group % len(tasks)]
            env = envs.get(task) or envs.setdefault(task, make_env(cfg.env, task))
            seed = episode_seed(cfg.seed, cfg.seed_key or cfg.client_id, group)
            obs, info = env.reset(seed=seed)
            policy.reset(env, episode_seed(cfg.seed, cfg.seed_key or cfg.client_id, index))  # = seed when not grouped
            if overseer:
                overseer.reset(env, seed)
            t0, n_interventions = time.time(), 0
            infos = []  # per-step infos, for the env's per-episode metrics
            while True:
                try:
                    action = executable_action(policy.act(obs, env), env.action_space)
                except InvalidActionError as e:
                    raise InvalidActionError(f"policy {policy_name(cfg, version)}: {e}") from None
                intervened = False
                if overseer:
                    action, intervened = overseer.filter(obs, action, env)
                    n_interventions += intervened
                decided = policy_extras(policy, store.schema.extras)  # what the policy acted from, for audits
                next_obs, reward, terminated, truncated, info = env.step(action)
                reported = spec.step_extras(info) if spec.step_extras and store.schema.extras else {}
                writer.add(obs, action, reward, terminated, truncated, policy_version=version, intervention=intervened,
                           extras=recorded_extras(store.schema.extras, decided, reported))
                if spec.metrics is not None:
                    infos.append(info)
                obs = next_obs
                if terminated or truncated:
                    break
            steps = writer.pending_steps
            success = spec.success(info)
            attrs = {"interventions": n_interventions, "policy": policy_name(cfg, version), "env_kwargs": env_kwargs}
            if cfg.policy_store:  # whose version numbers policy_version counts (a shared store may hold several)
                attrs["policy_store"] = absolute_root(cfg.policy_store)
            limit = spec.step_limit(env)
            if isinstance(limit, int) and limit > 0:  # bounds the eval's length interval when the kwargs do not name it
                attrs["step_limit"] = limit
            metrics = spec.episode_metrics(infos)
            if metrics:
                attrs["metrics"] = metrics
            try:
                writer.commit(
                    final_obs=obs, task_id=task, instruction=spec.instruction(env), seed=seed, success=success,
                    policy_version=version, start_time=t0, end_time=time.time(), attrs=attrs, role=cfg.role,
                )
                status["judged"] += success is not None
                status["successes"] += bool(success)
                status["interventions"] += n_interventions
                rejected_in_a_row = 0
            except EpisodeValidationError as e:  # one bad episode must not stop the fleet...
                status["rejected"] += 1
                status["last_error"] = str(e)
                rejected_in_a_row += 1
                if rejected_in_a_row >= MAX_REJECTED_IN_A_ROW:  # ...but a broken setup must not spin forever
                    raise
            steps_run += steps
            status.update(episodes=writer.n_episodes, steps=status["steps"] + steps, policy_version=version,
                          steps_per_s=steps_run / (time.perf_counter() - t_start))
            write_json_atomic(status_path, status, fsync=False)
    status["state"] = "done"
    write_json_atomic(status_path, status, fsync=False)
    for env in envs.values():
        env.close()
    return status


def policy_name(cfg: ClientConfig, version: int) -> str:
    return f"v{version}" if version else f"fallback:{cfg.policy.get('kind')}"


def read_status(store_root: str, client_id: str) -> dict[str, Any] | None:
    """The last status a client wrote, or ``None`` before its first write."""
    try:
        with open(os.path.join(host_dir(store_root, "fleet"), f"{client_id}.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def exit_with_launcher() -> None:
    """Have the kernel stop this client when the process that launched it dies (Linux).

    A launcher killed outright (SIGKILL, or SIGTERM, which skips its cleanup) would otherwise
    leave its clients writing; a rerun's clients would then find their shards locked.
    Committed episodes are safe either way: a killed client loses only its open episode.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(launcher):  # the launcher died before the request took effect
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    exit_with_launcher()
    cfg = ClientConfig(**json.loads(argv[0]))
    try:
        run_client(cfg)
    except Exception:
        status = read_status(cfg.store, cfg.client_id) or {"client_id": cfg.client_id}
        status.update(state="crashed", last_error=traceback.format_exc(limit=3))
        write_json_atomic(os.path.join(host_dir(cfg.store, "fleet"), f"{cfg.client_id}.json"), status, fsync=False)
        raise
    return 0


def config_json(cfg: ClientConfig) -> str:
    return json.dumps(asdict(cfg))


if __name__ == "__main__":
    sys.exit(main())
