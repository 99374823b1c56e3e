"""ROS 2 bridge end to end with real rclpy over loopback.

The simulated robot and the bridge run as separate processes through the CLI; the sim
dumps everything it published and the store must hold exactly that. Malformed messages
come from a third publisher (this test process). Each test gets its own ROS domain, and
``robo_post.fleet.ros2`` keeps discovery on loopback. Waits are bounded by generous
deadlines that only turn a hang into a failure.
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede importing mujoco

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from robo_post.cli import main as cli_main
from robo_post.envs.tabletop import PROPRIO_DIM, TASKS
from robo_post.fleet import ros2
from robo_post.store import PolicyRegistry, Store

DEADLINE_S = 60.0
_domains = itertools.count()


def fresh_domain() -> int:
    """A ROS domain id no other test (or concurrent test run, most likely) is using."""
    return 1 + (os.getpid() * 3 + next(_domains)) % 200


def spawn(tmp: Path, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
    log = tmp / f"{name}.log"
    env = {**os.environ, "ROS_LOG_DIR": str(tmp / "ros-log")}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "robo_post.cli", "fleet", *args], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    return proc, log


def wait_exit(procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    for name, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"{name} exited with {rc}:\n{log.read_text()[-4000:]}"


def kill_all(procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """Kill what still runs and print every log (pytest shows it if the test fails)."""
    for name, (proc, log) in procs.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        print(f"--- {name} ---\n{log.read_text()}")


def assert_store_matches_dump(root: str, client: str, dump_path: Path, expected: dict[int, int | None]) -> None:
    """The committed episodes are exactly the sim's episodes ``expected`` (index -> policy
    version, None for either), array for array, each run by one policy version throughout."""
    snap = Store.open(root).snapshot()
    recorded = {e.attrs["robot_episode"]: e for e in snap.episodes(client=client)}
    assert sorted(recorded) == sorted(expected)
    dump = np.load(dump_path)  # no pickle: plain arrays and one JSON string
    meta = json.loads(str(dump["meta"]))
    for i in expected:
        ep, sim = snap.load(recorded[i]), meta[i]
        T = sim["length"]
        assert not sim["aborted"] and ep["info"].length == T
        for key in ("proprio", "image"):
            got, want = ep["obs"][key], dump[f"ep{i}_{key}"]
            assert got.dtype == want.dtype and got.shape == want.shape == (T + 1, *want.shape[1:])
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ep["obs"]["task_id"], np.full(T + 1, TASKS.index(sim["task"])))
        np.testing.assert_array_equal(ep["action"], dump[f"ep{i}_action"])
        np.testing.assert_array_equal(ep["reward"], dump[f"ep{i}_reward"].astype(np.float32))
        np.testing.assert_array_equal(ep["timestamp"], dump[f"ep{i}_stamp"][:-1] / 1e9)
        assert ep["terminated"][-1] == sim["terminated"] and ep["truncated"][-1] == sim["truncated"]
        assert not ep["terminated"][:-1].any() and not ep["truncated"][:-1].any()
        info = ep["info"]
        assert (info.task_id, info.instruction, info.seed, info.success) == (
            sim["task"], sim["instruction"], sim["seed"], sim["success"]
        )
        assert (ep["policy_version"] == info.policy_version).all()
        assert expected[i] in (None, info.policy_version)


def read_status(root: str, client: str) -> dict[str, Any]:
    with open(os.path.join(root, "fleet", f"{client}.json")) as f:
        return json.load(f)


def test_records_sim_episodes_exactly(tmp_path):
    """Data collection: the sim's expert acts and publishes its actions; the bridge records."""
    root, dump, domain = str(tmp_path / "store"), tmp_path / "sim.npz", f"domain_id={fresh_domain()}"
    procs = {
        "bridge": spawn(tmp_path, "bridge", ["ros2-bridge", f"store={root}", "client_id=robot-0", domain,
                                             "exit_on_final=true", "timeout=20"]),
        "sim": spawn(tmp_path, "sim", ["ros2-sim", domain, "episodes=3", "rate_hz=0", f"dump={dump}"]),
    }
    try:
        wait_exit(procs)
    finally:
        kill_all(procs)
    assert_store_matches_dump(root, "robot-0", dump, dict.fromkeys(range(3), 0))
    status = read_status(root, "robot-0")
    assert status["committed"] == 3 and status["malformed"] == {} and status["discarded"] == {}


class Injector:
    """A third ROS participant that watches episode events and publishes bad messages."""

    def __init__(self, domain_id: int):
        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node("injector", namespace="/robot", context=self.context)
        self.joint = self.node.create_publisher(JointState, ros2.JOINT_TOPIC, ros2.QOS)
        self.image = self.node.create_publisher(Image, ros2.IMAGE_TOPIC, ros2.QOS)
        self.events: list[dict[str, Any]] = []
        self.heartbeat: dict[str, Any] = {}
        self.node.create_subscription(String, ros2.EPISODE_TOPIC, self._on_event, ros2.QOS)
        self.node.create_subscription(String, ros2.STATUS_TOPIC, self._on_heartbeat, ros2.QOS)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)

    def _on_event(self, msg: String) -> None:
        self.events.append(json.loads(msg.data))

    def _on_heartbeat(self, msg: String) -> None:
        self.heartbeat = json.loads(msg.data)

    def bridge_matched(self, topics: tuple[str, ...], publishers: int) -> bool:
        """Whether the bridge's last heartbeat shows its readers matched to ``publishers`` writers."""
        return all(self.heartbeat.get("matched", {}).get(t, 0) >= publishers for t in topics)

    def started(self) -> list[int]:
        return [e["episode"] for e in self.events if e["event"] == "start"]

    def running(self) -> int | None:
        """The episode the sim has started and not yet ended, as far as we have heard."""
        ended = {e["episode"] for e in self.events if e["event"] == "end"}
        live = [k for k in self.started() if k not in ended]
        return live[-1] if live else None

    def spin_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.executor.spin_once(timeout_sec=0.02)

    def inject(self) -> None:
        now = self.node.get_clock().now().nanoseconds
        good = np.zeros(PROPRIO_DIM)
        self.joint.publish(ros2.joint_msg(now, ros2.PROPRIO_NAMES[:5], good[:5]))  # wrong length
        self.joint.publish(ros2.joint_msg(now, ros2.PROPRIO_NAMES, np.full(PROPRIO_DIM, np.nan)))  # NaN
        self.image.publish(ros2.image_msg(now, np.zeros((64, 64, 3), np.uint8), encoding="bgr8"))  # encoding
        self.image.publish(ros2.image_msg(now, np.zeros((32, 32, 3), np.uint8)))  # size
        self.joint.publish(ros2.joint_msg(1, ros2.PROPRIO_NAMES, good))  # stamp long before the last one

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()


def test_malformed_messages_discard_only_their_episode(tmp_path):
    """The bridge serves a policy; bad messages during one episode (k >= 1) are counted and
    cost only that episode; the robot keeps being served, a policy published meanwhile is
    swapped in at an episode boundary, later episodes are recorded, and the store stays valid."""
    root, dump, domain_id = str(tmp_path / "store"), tmp_path / "sim.npz", fresh_domain()
    domain = f"domain_id={domain_id}"
    injector = Injector(domain_id)
    procs = {
        "bridge": spawn(tmp_path, "bridge", ["ros2-bridge", f"store={root}", "client_id=robot-1", domain,
                                             "serve_policy=true", "policy=random", "exit_on_final=true",
                                             "timeout=20"]),
        "sim": spawn(tmp_path, "sim", ["ros2-sim", domain, "episodes=5", "act_locally=false", "rate_hz=30",
                                       "max_steps=40", "action_timeout=20", "subscribers=2", f"dump={dump}"]),
    }
    try:
        # Both the sim's and our publishers must reach the bridge, or injected messages would vanish.
        injector.spin_until(lambda: injector.bridge_matched((ros2.JOINT_TOPIC, ros2.IMAGE_TOPIC), 2), "matching")
        injector.spin_until(lambda: len(injector.started()) >= 2, "episode 1 to start")
        assert injector.started()[:2] == [0, 1]  # the sim waited for us (subscribers=2): we see every event
        # Inject into the first episode k >= 1 still running 0.2 s after we heard it start (so
        # the bridge has taken the start event). On a starved CI machine we may hear episode 1
        # late, after it ended; then k is a later one. An episode lasts ~1.4 s.
        while True:
            injector.spin_until(lambda: (injector.running() or 0) >= 1, "an episode to run")
            k, settled = injector.running(), time.monotonic() + 0.2
            injector.spin_until(lambda: time.monotonic() > settled, "a moment")
            if injector.running() == k:
                break
        assert k <= 2, f"heard episode {k} start first; too late to check a later policy swap"
        injector.inject()
        # v1 lands during episode k (fsync can take a while on a busy disk): episode k+1 may or
        # may not run it, k+2 (>= 1.4 s later) must, none may switch mid-episode, and earlier
        # episodes ran v0.
        PolicyRegistry(root).publish({}, {"kind": "random"})
        wait_exit(procs)
    finally:
        kill_all(procs)
        injector.close()

    status = read_status(root, "robot-1")
    assert status["malformed"] == {"joint_length": 1, "nan": 1, "image_encoding": 1, "image_size": 1,
                                   "out_of_order": 1}
    assert status["discarded"] == {"malformed": 1} and status["committed"] == 4
    assert status["policy_version"] == 1
    expected = {i: 0 for i in range(k)} | {k + 1: None} | {i: 1 for i in range(k + 2, 5)}
    assert_store_matches_dump(root, "robot-1", dump, expected)
    assert not json.loads(str(np.load(dump)["meta"]))[k]["aborted"]  # the robot was served throughout
    assert cli_main(["store", "validate", root]) == 0
