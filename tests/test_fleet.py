"""Fleet: registry hot-swap between episodes, crash/restart, Ray launcher, overseer,
`robo-post collect` end to end, and client determinism.

Everything runs state-only tabletop envs on the short ``reach`` task so the whole
file stays well under two minutes on two cores. Waits are bounded by generous
deadlines that only turn a hang into a failure; nothing asserts on timing.
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede importing mujoco

import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest
import ray
from omegaconf import OmegaConf

from robo_post.envs.tabletop import TabletopEnv
from robo_post.fleet import policies
from robo_post.config import compose
from robo_post.envs import NoExpertError
from robo_post.fleet.client import OverseerUnsupportedError
from robo_post.fleet.collect import client_configs, collect
from robo_post.fleet.client import ClientConfig, make_env, read_status, run_client, store_schema
from robo_post.fleet.launcher import FleetError, LocalLauncher, RayLauncher, raise_unfinished
from robo_post.fleet.policies import ExpertPolicy, register_policy_kind
from robo_post.store import PolicyRegistry, Snapshot, Store
from robo_post.store.integrity import validate_store

ENV: dict[str, Any] = {"name": "tabletop", "render_images": False}
TASKS = ["reach"]
DEADLINE_S = 300.0  # only turns a hung fleet into a failure (loaded shared cores included); never a performance bound


def make_store(root: str, env: dict[str, Any] = ENV) -> Store:
    return Store.create(root, store_schema(env, "reach"))


def wait_for(condition: Callable[[], bool], what: str, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def supervise(launcher: LocalLauncher | RayLauncher, on_poll: Callable[[], None] = lambda: None) -> None:
    """Drive a started launcher to completion (what ``launcher.run`` does, minus the UI)."""
    deadline = time.monotonic() + DEADLINE_S
    while launcher.poll():
        on_poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"fleet did not finish: {launcher.statuses()}")
        time.sleep(0.02)


def committed(store: Store, shard: str) -> int:
    return store.read_commit(shard)["episodes"]


@pytest.mark.fleet
def test_hot_swap_happens_only_between_episodes(tmp_path):
    store = make_store(str(tmp_path / "store"))
    registry = PolicyRegistry(store.root)
    registry.publish({}, {"kind": "random"})  # v1: 40-step episodes, so v2 lands mid-episode
    cfg = ClientConfig(store=store.root, client_id="swap", episodes=12, env=ENV, tasks=TASKS)
    result: dict[str, Any] = {}
    client = threading.Thread(target=lambda: result.update(run_client(cfg)))
    client.start()
    try:
        wait_for(lambda: committed(store, "swap") >= 2, "two v1 episodes")
        # Ten v1 episodes (~1 s) of margin remain for the client to pick this up.
        assert registry.publish({}, {"kind": "expert", "noise": 0.05}) == 2
    finally:
        client.join(DEADLINE_S)
    assert result["state"] == "done" and result["policy_version"] == 2

    snap = store.snapshot()
    versions = []
    for ep in snap:
        column = snap.load(ep)["policy_version"]
        assert (column == ep.policy_version).all(), f"{ep.key} switched policy mid-episode: {np.unique(column)}"
        assert ep.attrs["policy"] == f"v{ep.policy_version}"
        versions.append(ep.policy_version)
    assert len(versions) == 12
    assert versions == sorted(versions), versions
    assert set(versions) == {1, 2}
    assert versions[:2] == [1, 1]


@pytest.mark.slow
@pytest.mark.fleet
def test_local_launcher_restarts_a_killed_client_without_losing_episodes(tmp_path):
    store = make_store(str(tmp_path / "store"))
    # Random actions over 100 steps make each episode long (~0.3 s), so a kill
    # right after a status update lands mid-episode, not inside a commit.
    env = {**ENV, "max_steps": 100}
    configs = [
        ClientConfig(store=store.root, client_id=f"c{i}", episodes=5, env=env, tasks=TASKS, policy={"kind": "random"})
        for i in range(2)
    ]
    launcher = LocalLauncher(configs, max_restarts=2)
    killed: dict[str, Any] = {}

    def kill_c0_once() -> None:
        status = read_status(store.root, "c0")
        if killed or not status or status["episodes"] < 2:
            return
        pid = launcher.procs["c0"].pid
        assert status["pid"] == pid  # the status file names the live process
        killed.update(pid=pid, before=store.shard_episodes("c0"))
        os.kill(pid, signal.SIGKILL)

    launcher.start()
    try:
        supervise(launcher, kill_c0_once)
    finally:
        launcher.stop()

    assert killed, "client c0 finished before it could be killed"
    assert launcher.restarts == {"c0": 1, "c1": 0} and not launcher.failed, launcher.statuses()
    for status in launcher.statuses():
        assert status["state"] == "done" and status["episodes"] == status["target"] == 5, status
    assert read_status(store.root, "c0")["pid"] != killed["pid"]
    checked, problems = validate_store(store.root)
    assert problems == [] and checked == 10
    after = store.shard_episodes("c0")
    assert len(killed["before"]) <= len(after)
    assert after[: len(killed["before"])] == killed["before"]  # committed episodes survive the kill untouched


@pytest.mark.slow
@pytest.mark.fleet
def test_a_client_that_crashes_the_same_way_twice_is_not_restarted_again(tmp_path):
    """A deterministic error (here a policy version never published) was restarted max_restarts times."""
    store = make_store(str(tmp_path / "store"))
    configs = [ClientConfig(store=store.root, client_id="c0", episodes=2, env=ENV, tasks=TASKS, policy_version=9)]
    launcher = LocalLauncher(configs, max_restarts=3)
    launcher.start()
    try:
        supervise(launcher, lambda: None)
    finally:
        launcher.stop()
    assert launcher.restarts == {"c0": 1} and launcher.failed == {"c0": 1}
    assert "policy version 9 not found" in read_status(store.root, "c0")["last_error"]


@pytest.mark.slow
@pytest.mark.fleet
def test_ray_launcher_runs_two_clients(tmp_path):
    store = make_store(str(tmp_path / "store"))
    configs = [ClientConfig(store=store.root, client_id=f"ray{i}", episodes=3, env=ENV, tasks=TASKS) for i in range(2)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        launcher = RayLauncher(configs)
        launcher.start()
        try:
            supervise(launcher)
        finally:
            launcher.stop()
    finally:
        ray.shutdown()
    assert launcher.errors == {"ray0": "", "ray1": ""}
    assert [s["state"] for s in launcher.statuses()] == ["done", "done"]
    snap = store.snapshot()
    assert len(snap) == 6 and sorted(snap.counts) == ["ray0", "ray1"]
    assert validate_store(store.root)[1] == []


@pytest.mark.slow
@pytest.mark.fleet
def test_ray_fleet_on_two_nodes_writes_to_s3_and_a_killed_node_loses_only_its_episode_in_flight(s3_server, tmp_path,
                                                                                                  monkeypatch):
    """Two Ray nodes (Ray's cluster utilities: two raylets on this machine), one client on each,
    both writing to a store on S3. The worker node is killed mid-run: its client is rescheduled
    on the head node, waits out the dead writer's lease, and resumes from its committed episodes."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("ROBO_POST_STATE_DIR", str(tmp_path / "state"))
    url = f"s3://{s3_server.bucket()}/fleet"
    store = make_store(url)
    episodes = 6
    configs = [ClientConfig(store=url, client_id=f"node{i}", episodes=episodes, env=ENV, tasks=TASKS) for i in range(2)]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = cluster.add_node(num_cpus=1)
    head = cluster.head_node.node_id
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        launcher = RayLauncher(configs)
        launcher.start()
        try:
            # Each client needs a whole CPU of the two: one runs on each node.
            wait_for(lambda: all(s.get("episodes", 0) >= 1 for s in launcher.statuses()), "both clients' first episode")
            running = {s["client_id"]: s for s in launcher.statuses()}
            nodes = {c: s["node"] for c, s in running.items()}
            assert sorted(nodes.values()) == sorted([head, worker.node_id]), nodes
            victim = next(c for c, n in nodes.items() if n == worker.node_id)
            before = committed(store, victim)
            # The node dies whole: its raylet and the client's process (which would outlive its raylet here).
            os.kill(running[victim]["pid"], signal.SIGKILL)
            cluster.remove_node(worker, allow_graceful=False)
            supervise(launcher)
            after = {s["client_id"]: s for s in launcher.statuses()}
        finally:
            launcher.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert launcher.errors == {"node0": "", "node1": ""}
    snap = Store.open(url).snapshot()
    assert snap.counts == {c.client_id: {**snap.counts[c.client_id], "episodes": episodes} for c in configs}
    assert before <= committed(store, victim) == episodes  # nothing committed before the kill was lost
    assert after[victim]["node"] == head and after[victim]["pid"] != running[victim]["pid"]
    assert validate_store(url) == (2 * episodes, [])


@pytest.mark.slow
@pytest.mark.fleet
def test_ray_launcher_joins_an_existing_cluster_without_sizing_it(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    RayLauncher([], address="auto", num_cpus=2)  # fleet/ray.yaml sets num_cpus for local runs
    RayLauncher([], address=None, num_cpus=2)
    # Ray raises when num_cpus is given while connecting to a running cluster.
    assert [(c["address"], c["num_cpus"]) for c in calls] == [("auto", None), (None, 2)]


class ZeroPolicy:
    """Never moves: the overseer must notice the stall."""

    def reset(self, env: Any, seed: int) -> None:
        pass

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        return np.zeros(env.action_space.shape, np.float32)


def replay_with_expert(snap: Snapshot, ep, env: TabletopEnv) -> list[tuple[np.ndarray, np.ndarray]]:
    """Re-run an episode's recorded actions; at intervention steps pair each with the
    expert's action in the same state (a noise-free expert is a pure function of state)."""
    data = snap.load(ep)
    obs, _ = env.reset(seed=ep.seed)
    expert = ExpertPolicy()
    expert.reset(env, ep.seed)
    pairs = []
    for action, intervened in zip(data["action"], data["intervention"]):
        if intervened:
            pairs.append((action, expert.act(obs, env)))
        obs, *_ = env.step(action)
    return pairs


@pytest.mark.fleet
def test_overseer_takes_over_a_stalled_policy_with_expert_actions(tmp_path, monkeypatch):
    monkeypatch.setattr(policies, "POLICY_KINDS", dict(policies.POLICY_KINDS))  # keep "zero" local to this test
    register_policy_kind("zero", lambda weights, config, device: ZeroPolicy())
    store = make_store(str(tmp_path / "store"))
    overseer = {"enabled": True, "stall_steps": 5, "stall_tol": 1e-3, "takeover_steps": 20}
    for client_id, ovs in (("on", overseer), ("off", {**overseer, "enabled": False})):
        run_client(ClientConfig(store=store.root, client_id=client_id, episodes=3, env=ENV, tasks=TASKS,
                                policy={"kind": "zero"}, follow_registry=False, overseer=ovs))

    snap = store.snapshot()
    env = make_env(ENV, "reach")
    on, off = snap.episodes(client="on"), snap.episodes(client="off")
    for ep in on:
        data = snap.load(ep)
        assert data["intervention"].any() and not data["intervention"][:5].any()  # only after a stall window
        assert ep.attrs["interventions"] == data["intervention"].sum()
        assert (data["action"][~data["intervention"]] == 0).all()
        for recorded, expert in replay_with_expert(snap, ep, env):
            np.testing.assert_allclose(recorded, expert, atol=1e-6)
        assert ep.success  # the expert finishes reach within its takeover
    for ep in off:
        data = snap.load(ep)
        assert not data["intervention"].any() and ep.attrs["interventions"] == 0 and not ep.success
    env.close()


class WanderPolicy:
    """Moves every step without getting anywhere: no stall, so only a deadline rescues it."""

    def reset(self, env: Any, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        return self.rng.uniform(-1, 1, env.action_space.shape).astype(np.float32)


@pytest.mark.fleet
def test_overseer_deadline_rescues_the_rest_of_a_slow_episode(tmp_path, monkeypatch):
    monkeypatch.setattr(policies, "POLICY_KINDS", dict(policies.POLICY_KINDS))
    register_policy_kind("wander", lambda weights, config, device: WanderPolicy())
    store = make_store(str(tmp_path / "store"))
    overseer = {"enabled": True, "stall_steps": 5, "stall_tol": 0.0, "takeover_steps": 5, "deadline": 0.5}
    run_client(ClientConfig(store=store.root, client_id="c", episodes=2, env=ENV, tasks=TASKS, policy={"kind": "wander"},
                            follow_registry=False, overseer=overseer))
    snap = store.snapshot()
    env = make_env(ENV, "reach")
    deadline = env.unwrapped.max_steps // 2
    for ep in snap.episodes():
        flags = snap.load(ep)["intervention"]
        assert not flags[:deadline].any() and flags[deadline:].all()  # rescued from the deadline to the end
        assert ep.success and ep.length > deadline
        for recorded, expert in replay_with_expert(snap, ep, env):
            np.testing.assert_allclose(recorded, expert, atol=1e-6)
    with pytest.raises(ValueError, match="overseer.deadline"):
        run_client(ClientConfig(store=store.root, client_id="bad", episodes=1, env=ENV, tasks=TASKS, policy={"kind": "wander"},
                                follow_registry=False, overseer={**overseer, "deadline": 1.5}))
    assert len(store.snapshot().episodes()) == 2  # nothing lost, nothing half-written
    env.close()


class SlipPolicy(ExpertPolicy):
    """The expert, except that on a seeded 30% of steps its first action dimension flips sign."""

    def reset(self, env: Any, seed: int) -> None:
        super().reset(env, seed)
        self.rng = np.random.default_rng(seed)

    def act(self, obs: dict[str, Any], env: Any) -> np.ndarray:
        action = super().act(obs, env).copy()
        if self.rng.random() < 0.3:
            action[0] = -action[0]
        return action


@pytest.mark.fleet
def test_overseer_divergence_gate_takes_over_where_the_policy_leaves_the_expert(tmp_path, monkeypatch):
    monkeypatch.setattr(policies, "POLICY_KINDS", dict(policies.POLICY_KINDS))
    register_policy_kind("slip", lambda weights, config, device: SlipPolicy())
    store = make_store(str(tmp_path / "store"))
    tol, takeover = 0.05, 2
    overseer = {"enabled": True, "divergence": tol, "takeover_steps": takeover}
    run_client(ClientConfig(store=store.root, client_id="c", episodes=4, env=ENV, tasks=["push"], policy={"kind": "slip"},
                            follow_registry=False, overseer=overseer))
    snap = store.snapshot()
    env = make_env(ENV, "push")
    span = env.action_space.high - env.action_space.low
    taken = kept = 0
    for ep in snap.episodes():
        data = snap.load(ep)
        obs, _ = env.reset(seed=ep.seed)
        policy, expert = SlipPolicy(), ExpertPolicy()
        policy.reset(env, ep.seed)  # the client's policy seed (= the layout seed without groups)
        expert.reset(env, ep.seed)
        remaining = 0
        for action, intervened in zip(data["action"], data["intervention"]):
            proposed, wanted = policy.act(obs, env), expert.act(obs, env)
            if remaining == 0 and (np.abs(proposed - wanted) > tol * span).any():
                remaining = takeover  # the gate: a takeover starts only where the policy left the expert
            assert intervened == (remaining > 0)
            np.testing.assert_allclose(action, wanted if intervened else proposed, atol=1e-6)
            remaining = max(remaining - 1, 0)
            taken, kept = taken + intervened, kept + (not intervened)
            obs, *_ = env.step(action)
        assert ep.attrs["interventions"] == data["intervention"].sum()
    assert taken > 0 and kept > 0
    with pytest.raises(ValueError, match="overseer.divergence"):
        run_client(ClientConfig(store=store.root, client_id="bad", episodes=1, env=ENV, tasks=["push"],
                                policy={"kind": "slip"}, follow_registry=False, overseer={**overseer, "divergence": 0.0}))
    assert len(store.snapshot().episodes()) == 4
    env.close()


def _exited(pid: int) -> bool:
    """True once ``pid`` is gone or a zombie (an orphan's reaper may be slow or absent in containers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.fleet
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="clients follow their launcher through prctl")
def test_clients_stop_with_a_killed_launcher_and_a_rerun_is_not_locked_out(tmp_path):
    root = str(tmp_path / "store")
    cli = os.path.join(os.path.dirname(sys.executable), "robo-post")
    # random actions for 100 steps: each episode takes a while, so neither client is done when the launcher dies
    args = [cli, "collect", f"store={root}", "fleet.n_clients=2", "env.kwargs.render_images=false", "env.tasks=[reach]",
            "+env.kwargs.max_steps=100", "policy=random", "show=false"]
    launcher = subprocess.Popen([*args, "episodes=400"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    statuses = lambda: [read_status(root, f"client-{i}") for i in range(2)]  # noqa: E731
    wait_for(lambda: all(s and s["episodes"] >= 1 for s in statuses()), "both clients to commit an episode")
    pids = [s["pid"] for s in statuses()]
    launcher.kill()  # SIGKILL: no cleanup runs in the launcher
    launcher.wait()
    wait_for(lambda: all(_exited(pid) for pid in pids), "the clients to exit")
    store = Store.open(root)
    # the clients stopped with their launcher instead of finishing their 200 episodes each
    before = [committed(store, f"client-{i}") for i in range(2)]
    assert all(1 <= n < 200 for n in before), before
    # so a rerun finds its shards free, and adds its episodes to what was committed
    rerun = subprocess.run([*args, "episodes=4"], capture_output=True, text=True, timeout=DEADLINE_S)
    assert rerun.returncode == 0, rerun.stderr
    assert [committed(store, f"client-{i}") for i in range(2)] == [n + 2 for n in before]
    assert validate_store(root)[1] == []


def test_unfinished_clients_are_named_with_their_last_error_line():
    trace = 'Traceback (most recent call last):\n  File "client.py", line 1\nShardLockedError: shard \'c0\' is locked\n'
    statuses = [{"client_id": "c0", "state": "crashed", "last_error": trace},
                {"client_id": "c1", "state": "running"}, {"client_id": "c2", "state": "done"}]
    with pytest.raises(FleetError) as e:
        raise_unfinished(statuses, "fleet clients", "/s")
    assert str(e.value) == ("fleet clients did not finish (c0: ShardLockedError: shard 'c0' is locked; c1: running); "
                            "logs in /s/fleet/")
    raise_unfinished(statuses[2:], "fleet clients", "/s")  # all done: nothing raised


@pytest.mark.slow
@pytest.mark.fleet
def test_collect_cli_end_to_end(tmp_path):
    root = str(tmp_path / "store")
    cli = os.path.join(os.path.dirname(sys.executable), "robo-post")
    overrides = ["episodes=4", "fleet.n_clients=2", "env.kwargs.render_images=false", "show=false"]
    proc = subprocess.run([cli, "collect", f"store={root}", *overrides], capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = subprocess.run([cli, "store", "info", root, "--json"], capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["episodes"] == 4 and info["shards"] == 2
    assert validate_store(root)[1] == []
    # more of the same: no warning that the store was recorded with other kwargs (the instruction
    # split, which the env config names and the recorded kwargs leave out, made one every time)
    proc = subprocess.run([cli, "collect", f"store={root}", *overrides], capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_collect_refuses_an_expert_or_overseer_the_env_lacks_before_any_client(tmp_path):
    """The default policy=expert on a gymnasium id crashed every client (and its restarts)
    only after the store was made."""
    root = str(tmp_path / "store")
    cfg = compose("collect", ["env=gym", "env.name=FrozenLake-v1", f"store={root}", "episodes=2", "show=false"])
    with pytest.raises(NoExpertError, match="'FrozenLake-v1' has no scripted expert; collect with another policy"):
        collect(cfg)
    # following a registry that holds nothing yet, the clients run the expert too (each crashed)
    cfg.fleet.follow_registry = True
    with pytest.raises(NoExpertError, match="nothing is published in .* yet for fleet.follow_registry=true to run"):
        collect(cfg)
    cfg.fleet.follow_registry = False
    cfg.policy.kind, cfg.fleet.overseer.enabled = "random", True
    with pytest.raises(OverseerUnsupportedError, match="'FrozenLake-v1' has no overseer"):
        collect(cfg)
    assert not os.path.exists(root)


@pytest.mark.fleet
def test_same_config_and_seed_give_identical_episodes(tmp_path):
    runs = []
    for name in ("a", "b"):
        store = make_store(str(tmp_path / name))
        # Noise makes the actions depend on the per-episode seed, not only on the state.
        run_client(ClientConfig(store=store.root, client_id="det", episodes=4, env=ENV, tasks=TASKS,
                                policy={"kind": "expert", "noise": 0.3}, seed=7))
        snap = store.snapshot()
        runs.append([(ep, snap.load(ep)) for ep in snap])
    assert len(runs[0]) == len(runs[1]) == 4
    assert len({ep.seed for ep, _ in runs[0]}) == 4  # every episode gets its own seed
    for (ep_a, a), (ep_b, b) in zip(*runs):
        assert (ep_a.seed, ep_a.instruction, ep_a.length, ep_a.success) == (ep_b.seed, ep_b.instruction,
                                                                           ep_b.length, ep_b.success)
        for key in ("action", "reward", "terminated", "truncated", "policy_version", "intervention"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        for key in a["obs"]:
            np.testing.assert_array_equal(a["obs"][key], b["obs"][key], err_msg=f"obs/{key}")


@pytest.mark.fleet
def test_layout_repeats_rerun_each_layout_with_new_policy_seeds(tmp_path):
    store = make_store(str(tmp_path / "groups"))
    run_client(ClientConfig(store=store.root, client_id="grp", episodes=4, env=ENV, tasks=["reach", "push"],
                            policy={"kind": "expert", "noise": 0.3}, seed=7, layout_repeats=2))
    snap = store.snapshot()
    episodes = [(ep, snap.load(ep)) for ep in snap]
    assert [ep.task_id for ep, _ in episodes] == ["reach", "reach", "push", "push"]
    for (a, da), (b, db) in (episodes[:2], episodes[2:]):
        assert a.seed == b.seed  # one layout per group: the same first observation...
        np.testing.assert_array_equal(da["obs"]["proprio"][0], db["obs"]["proprio"][0])
        assert not np.array_equal(da["action"][0], db["action"][0])  # ...acted on with different policy noise
    assert episodes[0][0].seed != episodes[2][0].seed
    with pytest.raises(ValueError, match="layout_repeats"):
        client_configs(OmegaConf.create({"env": {"name": "tabletop", "kwargs": {}}, "episodes": 2, "fleet": {
            "n_clients": 1, "layout_repeats": 0}}), store)


@pytest.mark.slow
@pytest.mark.fleet
def test_the_status_table_counts_only_this_runs_episodes(tmp_path):
    """A second collect into a shard holding 3 episodes showed '5/5' for 2 new ones, and their
    success rate mixed in the earlier episodes."""
    from rich.console import Console

    from robo_post.fleet.launcher import status_table

    store = make_store(str(tmp_path / "store"))
    LocalLauncher([ClientConfig(store=store.root, client_id="c0", episodes=3, env=ENV, tasks=TASKS)]).run(show=False)
    launcher = LocalLauncher([ClientConfig(store=store.root, client_id="c0", episodes=5, env=ENV, tasks=TASKS)])
    statuses = launcher.run(show=False)
    assert statuses[0]["episodes"] == 5 and statuses[0]["before"]["episodes"] == 3  # the shard's totals stay
    done = store.shard_episodes("c0")
    new_rate = sum(bool(e.success) for e in done[3:]) / 2
    console = Console(width=200, record=True)
    console.print(status_table(statuses))
    row = next(line for line in console.export_text().splitlines() if "c0" in line)
    assert "2/2" in row and "5/5" not in row and f"{new_rate:.0%}" in row
