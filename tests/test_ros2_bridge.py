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
import signal
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import rclpy
import yaml
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from robo_post.cli import main as cli_main
from robo_post.fleet import ros2
from robo_post.fleet.recorder import ACTION_TOPIC, EPISODE_TOPIC, IMAGE_TOPIC, JOINT_TOPIC
from robo_post.fleet.robot import MalformedMessage, image_msg, joint_msg
from robo_post.fleet.ros2_settings import STATUS_QOS, STATUS_TOPIC, topic_qos
from robo_post.store import PolicyRegistry, ShardLockedError, Store

pytestmark = pytest.mark.ros2

DEADLINE_S = 60.0
_domains = itertools.count()
TABLETOP = ros2.RobotDescription.load("tabletop")
ARM2_PATH = str(Path(__file__).parent / "data" / "robots" / "arm2.yaml")
ARM2 = ros2.RobotDescription.load(ARM2_PATH)  # 2 joints (position + velocity), no camera, 3 action dims


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


def assert_store_matches_dump(root: str, client: str, dump_path: Path, expected: dict[int, int | None],
                              robot: ros2.RobotDescription = TABLETOP) -> None:
    """The committed episodes are exactly the sim's episodes ``expected`` (index -> policy
    version, None for either), array for array, each run by one policy version throughout."""
    store = Store.open(root)
    snap = store.snapshot()
    recorded = {e.attrs["robot_episode"]: e for e in snap.episodes(client=client)}
    assert sorted(recorded) == sorted(expected)
    dump = np.load(dump_path)  # no pickle: plain arrays and one JSON string
    meta = json.loads(str(dump["meta"]))
    keys = [robot.joint_key] + ([robot.camera.key] if robot.camera else [])
    assert sorted(store.schema.observations) == sorted(keys + [robot.task_key])
    for i in expected:
        ep, sim = snap.load(recorded[i]), meta[i]
        T = sim["length"]
        assert not sim["aborted"] and ep["info"].length == T
        for key in keys:
            got, want = ep["obs"][key], dump[f"ep{i}_{key}"]
            assert got.dtype == want.dtype and got.shape == want.shape == (T + 1, *want.shape[1:])
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ep["obs"][robot.task_key], np.full(T + 1, robot.tasks.index(sim["task"])))
        np.testing.assert_array_equal(ep["action"], dump[f"ep{i}_action"])
        np.testing.assert_array_equal(ep["reward"], dump[f"ep{i}_reward"].astype(np.float32))
        np.testing.assert_array_equal(ep["timestamp"], dump[f"ep{i}_stamp"][:-1] / 1e9)
        info = ep["info"]
        assert (info.attrs["start_stamp_ns"], info.attrs["end_stamp_ns"]) == (
            int(dump[f"ep{i}_stamp"][0]), int(dump[f"ep{i}_stamp"][-1]))  # exact, wall-clock stamps included
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


@pytest.mark.slow
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
    """A third ROS participant that watches bridge heartbeats (and, once ``listen`` is
    called, episode events) and publishes messages of its own, bad ones included."""

    def __init__(self, domain_id: int, robot: ros2.RobotDescription = TABLETOP, listen: bool = True):
        self.robot = robot
        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node("injector", namespace="/robot", context=self.context)
        qos = topic_qos(100)
        self.joint = self.node.create_publisher(JointState, JOINT_TOPIC, qos)
        self.image = self.node.create_publisher(Image, IMAGE_TOPIC, qos) if robot.camera else None
        self.episode = self.node.create_publisher(String, EPISODE_TOPIC, qos)
        self.events: list[dict[str, Any]] = []
        self.heartbeat: dict[str, Any] = {}
        self.node.create_subscription(String, STATUS_TOPIC, self._on_heartbeat, STATUS_QOS)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        if listen:
            self.listen()

    def listen(self) -> None:
        """Subscribe to episode events (a sim with ``subscribers=2`` waits for this)."""
        self.node.create_subscription(String, EPISODE_TOPIC, self._on_event, topic_qos(100))

    def _on_event(self, msg: String) -> None:
        self.events.append(json.loads(msg.data))

    def _on_heartbeat(self, msg: String) -> None:
        self.heartbeat = json.loads(msg.data)

    def bridge_matched(self, topics: tuple[str, ...], publishers: int) -> bool:
        """Whether the bridge's last heartbeat shows its readers matched to ``publishers`` writers."""
        return all(self.heartbeat.get("matched", {}).get(t, 0) >= publishers for t in topics)

    def started(self) -> list[int]:
        return [e["episode"] for e in self.events if e["event"] == "start"]

    def ended(self) -> dict[int, dict[str, Any]]:
        return {e["episode"]: e for e in self.events if e["event"] == "end"}

    def running(self) -> int | None:
        """The episode the sim has started and not yet ended, as far as we have heard."""
        ended = self.ended()
        live = [k for k in self.started() if k not in ended]
        return live[-1] if live else None

    def spin_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.executor.spin_once(timeout_sec=0.02)

    def spin_for(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        self.spin_until(lambda: time.monotonic() > until, f"{seconds} s")

    def inject(self) -> None:
        now = self.node.get_clock().now().nanoseconds
        names, dim = TABLETOP.joints, TABLETOP.joint_dim
        good = np.zeros(dim)
        self.joint.publish(joint_msg(now, names[:5], good[:5]))  # 5 of the 31 joints
        self.joint.publish(joint_msg(now, names, np.full(dim, np.nan)))  # NaN
        self.image.publish(image_msg(now, np.zeros((64, 64, 3), np.uint8), encoding="bgr8"))  # encoding
        self.image.publish(image_msg(now, np.zeros((32, 32, 3), np.uint8)))  # size
        self.joint.publish(joint_msg(1, names, good))  # stamp long before the last one

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()


@pytest.mark.slow
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
        injector.spin_until(lambda: injector.bridge_matched((JOINT_TOPIC, IMAGE_TOPIC), 2), "matching")
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
    assert status["malformed"] == {"joint_names": 1, "nan": 1, "image_encoding": 1, "image_size": 1,
                                   "out_of_order": 1}
    assert status["discarded"] == {"malformed": 1} and status["committed"] == 4
    assert status["policy_version"] == 1
    expected = {i: 0 for i in range(k)} | {k + 1: None} | {i: 1 for i in range(k + 2, 5)}
    assert_store_matches_dump(root, "robot-1", dump, expected)
    assert not json.loads(str(np.load(dump)["meta"]))[k]["aborted"]  # the robot was served throughout
    assert cli_main(["store", "validate", root]) == 0


def wait_status(root: str, client: str, condition: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """Poll the bridge's status file until ``condition`` holds."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            status = read_status(root, client)
        except (FileNotFoundError, ValueError):
            status = {}
        if status and condition(status):
            return status
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last status {status}"
        time.sleep(0.1)


def release(bridge: subprocess.Popen, procs: dict[str, tuple[subprocess.Popen, Path]], injector: Injector) -> None:
    """Clean up after a test that may have left the bridge stopped: resume it, then end everything."""
    if bridge.poll() is None:
        os.kill(bridge.pid, signal.SIGCONT)
    kill_all(procs)
    injector.close()


def stop_bridge_once_matched(injector: Injector, bridge: subprocess.Popen, topics: tuple[str, ...]) -> None:
    """SIGSTOP the bridge once it is matched with the sim and us, then let the sim (which
    waits for a second episode subscriber) start: everything it sends queues up."""
    injector.spin_until(lambda: injector.bridge_matched(topics, 2), "matching")
    injector.spin_for(0.6)  # let the sim receive heartbeats that show the bridge matched
    os.kill(bridge.pid, signal.SIGSTOP)
    injector.listen()


@pytest.mark.slow
def test_faults_are_blamed_by_stamp_under_queued_traffic(tmp_path):
    """While the bridge is stalled the robot queues 4 episodes, whose joint messages on
    episode 1's first and last steps are malformed (names that do not match the positions;
    NaN), and an end without a start is queued among them. Only episode 1 is discarded, as
    malformed (not timeout); the episodes before and after it are recorded exactly."""
    root, dump, domain_id = str(tmp_path / "store"), tmp_path / "sim.npz", fresh_domain()
    domain = f"domain_id={domain_id}"
    injector = Injector(domain_id, ARM2, listen=False)
    procs = {
        "bridge": spawn(tmp_path, "bridge", ["ros2-bridge", f"store={root}", f"robot={ARM2_PATH}", "client_id=arm-1",
                                             domain, "timeout=20", "max_steps=20", "burst_episodes=5"]),
        "sim": spawn(tmp_path, "sim", ["ros2-sim", f"robot={ARM2_PATH}", domain, "episodes=4", "rate_hz=0",
                                       "max_steps=20", "policy=random", "subscribers=2", f"dump={dump}",
                                       "faults=1:0:names+1:-1:nan"]),
    }
    bridge = procs["bridge"][0]
    try:
        stop_bridge_once_matched(injector, bridge, (JOINT_TOPIC, EPISODE_TOPIC))
        injector.spin_until(lambda: 1 in injector.ended(), "episode 1 to end")
        stamp = injector.ended()[1]["stamp"] + 1  # between episodes 1 and 2
        injector.episode.publish(String(data=json.dumps({"event": "end", "episode": 99, "length": 0, "rewards": [],
                                                         "stamp": stamp})))
        injector.spin_until(lambda: 3 in injector.ended(), "the last episode to end")
        injector.spin_for(0.3)
        os.kill(bridge.pid, signal.SIGCONT)
        status = wait_status(root, "arm-1", lambda s: s["committed"] + sum(s["discarded"].values()) >= 4
                             and sum(s["malformed"].values()) >= 3, "4 closed episodes and 3 malformed messages")
        assert status["committed"] == 3 and status["discarded"] == {"malformed": 1}
        assert status["malformed"] == {"nan": 1, "joint_length": 1, "end_without_start": 1}
        assert status["lost"] == {}
        bridge.send_signal(signal.SIGTERM)
        wait_exit(procs)
    finally:
        release(bridge, procs, injector)
    log = procs["bridge"][1].read_text()
    assert "joint message has 1 names but 2 position values (names ['shoulder'])" in log
    assert "end of episode 99" in log and "never started" in log
    assert "discarded episode 1 (malformed)" in log and "timeout" not in log
    assert_store_matches_dump(root, "arm-1", dump, {0: 0, 2: 0, 3: 0}, robot=ARM2)


@pytest.mark.slow
def test_other_robot_two_long_episodes_in_one_burst(tmp_path, capsys):
    """A robot that is not the tabletop (2 joints recorded as positions and velocities, no
    camera, 3 action dims with their own bounds, its own tasks): two 1000-step episodes
    sent as fast as possible, within the burst the bridge documents (2 episodes of
    max_steps=1000), are both recorded exactly under a schema derived from its description;
    a store recorded from another robot is refused."""
    root, dump, domain = str(tmp_path / "store"), tmp_path / "sim.npz", f"domain_id={fresh_domain()}"
    procs = {
        "bridge": spawn(tmp_path, "bridge", ["ros2-bridge", f"store={root}", f"robot={ARM2_PATH}", "client_id=arm-2",
                                             domain, "exit_on_final=true", "timeout=20", "max_steps=1000",
                                             "burst_episodes=2"]),
        "sim": spawn(tmp_path, "sim", ["ros2-sim", f"robot={ARM2_PATH}", domain, "episodes=2", "rate_hz=0",
                                       "max_steps=1000", "policy=random", "task=fold", f"dump={dump}"]),
    }
    try:
        wait_exit(procs)
    finally:
        kill_all(procs)
    status = read_status(root, "arm-2")
    assert (status["committed"], status["malformed"], status["discarded"], status["lost"]) == (2, {}, {}, {})
    assert status["max_burst"] == {"episodes": 2, "max_steps": 1000, "messages_per_topic": 2002}
    assert_store_matches_dump(root, "arm-2", dump, {0: 0, 1: 0}, robot=ARM2)
    schema = Store.open(root).schema
    assert schema.attrs["robot"] == "arm2" and "env" not in schema.attrs
    assert (schema.action.shape, schema.action.low, schema.action.high) == ((3,), [-2.0, -0.5, 0.0], [2.0, 0.5, 1.0])
    assert schema.observations["joints"].shape == (4,) and schema.observations["goal"].high == 1
    meta = json.loads(str(np.load(dump)["meta"]))
    assert [m["length"] for m in meta] == [1000, 1000] and {m["task"] for m in meta} == {"fold"}
    capsys.readouterr()
    assert cli_main(["fleet", "ros2-bridge", f"store={root}", "client_id=other", f"domain_id={fresh_domain()}"]) == 2
    err = capsys.readouterr().err
    assert "robot 'tabletop': observation 'image' is uint8(64, 64, 3)" in err and "keys ['goal', 'joints']" in err


@pytest.mark.slow
def test_refused_bursts_are_counted_and_a_killed_bridge_reads_dead(tmp_path):
    """A burst beyond what the bridge documents (6 episodes queued against a queue of one
    episode while it is stalled) loses messages: they are counted in ``lost`` and their
    episodes discarded as ``overflow``, never as ``timeout``; an episode longer than the
    limit is discarded as ``too_long``. A SIGKILLed bridge still says running in its file,
    and reads as dead."""
    root, domain_id = str(tmp_path / "store"), fresh_domain()
    domain = f"domain_id={domain_id}"
    injector = Injector(domain_id, ARM2, listen=False)
    procs = {
        "bridge": spawn(tmp_path, "bridge", ["ros2-bridge", f"store={root}", f"robot={ARM2_PATH}", "client_id=arm-3",
                                             domain, "timeout=20", "max_steps=20", "burst_episodes=1"]),
        "sim": spawn(tmp_path, "sim", ["ros2-sim", f"robot={ARM2_PATH}", domain, "episodes=6", "rate_hz=0",
                                       "max_steps=20", "burst_episodes=8", "policy=random", "subscribers=2"]),
    }
    bridge = procs["bridge"][0]
    try:
        stop_bridge_once_matched(injector, bridge, (JOINT_TOPIC, EPISODE_TOPIC))
        injector.spin_until(lambda: 5 in injector.ended(), "the last episode to end")
        injector.spin_for(0.3)
        os.kill(bridge.pid, signal.SIGCONT)
        status = wait_status(root, "arm-3", lambda s: s["committed"] + sum(s["discarded"].values()) >= 6,
                             "6 closed episodes")
        assert status["lost"].get(JOINT_TOPIC, 0) > 0 and status["discarded"].get("overflow", 0) >= 1
        assert status["committed"] + status["discarded"]["overflow"] == 6 and status["malformed"] == {}
        wait_exit({"sim": procs["sim"]})
        procs["long"] = spawn(tmp_path, "long", ["ros2-sim", f"robot={ARM2_PATH}", domain, "episodes=1", "rate_hz=0",
                                                 "max_steps=21", "policy=random"])
        wait_exit({"long": procs["long"]})
        status = wait_status(root, "arm-3", lambda s: "too_long" in s["discarded"], "the too-long episode")
        assert status["discarded"]["too_long"] == 1 and "timeout" not in status["discarded"]
        assert ros2.read_bridge_status(root, "arm-3")["state"] == "running"
        bridge.kill()
        bridge.wait()
    finally:
        release(bridge, procs, injector)
    assert read_status(root, "arm-3")["state"] == "running"  # the file alone cannot tell
    dead = ros2.read_bridge_status(root, "arm-3")
    assert dead["state"] == "dead" and dead["dead_reason"] == f"process {bridge.pid} is gone"
    stale = ros2.read_bridge_status(root, "arm-3", now=dead["heartbeat"] + 60, stale_s=10)
    out = subprocess.run([sys.executable, "-m", "robo_post.cli", "fleet", "ros2-status", f"store={root}"],
                         capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 1 and json.loads(out.stdout)["state"] == "dead", out.stderr  # scripts can watch it
    assert stale["state"] == "dead"


# --- in-process bridge: handlers fed directly, no second participant --------------------
class LocalBridge:
    """A BridgeNode on its own domain whose message handlers the test calls directly, as a
    robot's messages would arrive, with its own per-publisher sequence numbers."""

    def __init__(self, root: str, robot: str = ARM2_PATH):
        self.context = Context()
        rclpy.init(context=self.context, domain_id=fresh_domain(), signal_handler_options=SignalHandlerOptions.NO)
        self.node = ros2.BridgeNode(ros2.BridgeConfig(store=root, robot=robot, client_id="unit"), self.context)
        self._seq: dict[str, int] = {}
        self._generation = 0

    def info(self, topic: str) -> dict[str, Any]:
        self._seq[topic] = self._seq.get(topic, 0) + 1
        gid = f"{topic}/{self._generation}".encode()
        return {"publication_sequence_number": self._seq[topic], "publisher_gid": {"data": gid}}

    def restart_robot(self) -> None:
        """The robot's publishers are new ones from here on."""
        self._seq.clear()
        self._generation += 1

    def event(self, **payload: Any) -> None:
        self.node._on_event(String(data=json.dumps(payload)), self.info(EPISODE_TOPIC))

    def episode(self, index: int, start: int, steps: int, end: bool = True, end_first: bool = False,
                **end_fields: Any) -> None:
        """Episode ``index`` with observations stamped start, start+1, ...; ``end_fields``
        override the end event's fields (None: leave the field out); ``end_first``: the end
        event overtakes the data, so the episode completes in a data callback."""
        fields = {"event": "end", "episode": index, "seed": index, "task": "fold", "length": steps,
                  "rewards": [0.0] * steps, "success": False, "terminated": True, "truncated": False,
                  "aborted": False, "stamp": start + steps, "final": False} | end_fields
        end_event = {k: v for k, v in fields.items() if v is not None}
        self.event(event="start", episode=index, seed=index, task="fold", instruction="fold", stamp=start)
        if end and end_first:
            self.event(**end_event)
        for t in range(steps + 1):
            self.node._on_joint(ARM2.joint_msg(start + t, np.full(4, 0.1 * t)), self.info(JOINT_TOPIC))
            if t < steps:
                action = ARM2.action_msg(start + t, np.array([0.5, 0.1, 0.5]))
                self.node._on_action(action, self.info(ACTION_TOPIC))
        if end and not end_first:
            self.event(**end_event)

    def close(self) -> dict[str, Any]:
        try:
            return self.node.close()
        finally:
            self.context.try_shutdown()


def test_store_of_another_robot_or_layout_is_refused(tmp_path):
    """Same shapes are not enough: a description with the joints in another order (or
    another robot name) would silently swap columns of episodes already stored."""
    root = str(tmp_path / "store")
    LocalBridge(root).close()
    for name, edit, message in [
        ("swapped", lambda d: d["joints"].update(names=["elbow", "shoulder"]), "another layout"),
        ("tasks", lambda d: d["tasks"].update(names=["fold", "wave"]), "another layout"),
        ("renamed", lambda d: d.update(name="arm3"), "recorded from robot 'arm2'"),
    ]:
        data = yaml.safe_load(Path(ARM2_PATH).read_text())
        edit(data)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ros2.RobotDescriptionError, match=message):
            LocalBridge(root, str(path)).close()
    assert Store.open(root).schema.attrs["layout"]["joints"] == ["shoulder", "elbow"]


def test_end_flags_must_be_booleans(tmp_path):
    """``"success": "false"`` is truthy: recorded as is, a failure would be stored as a
    success (and ``"aborted": "false"`` would discard a good episode). A missing flag is
    refused with its end event; found only at commit, in a data callback, it used to
    raise KeyError out of the executor and kill the bridge."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3, success="false")
        bridge.episode(1, 2_000, 3, terminated=None)
        bridge.episode(2, 3_000, 3, end_first=True, terminated=None)
        bridge.episode(3, 4_000, 3, end_first=True)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (1, {"malformed": 3}, {"event": 3})
    snap = Store.open(root).snapshot()
    assert [e.attrs["robot_episode"] for e in snap.episodes(client="unit")] == [3]


def test_restarted_robot_reusing_an_open_index_is_recorded(tmp_path):
    """A robot killed mid-episode 1 restarts and counts from 0 again before the bridge's
    timeout: its own episode 1 is recorded, the dead one is discarded as abandoned."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(1, 1_000, 5, end=False)  # killed after a few steps
        bridge.restart_robot()
        bridge.episode(0, 2_000, 3)
        bridge.episode(1, 3_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (2, {"abandoned": 1}, {})
    snap = Store.open(root).snapshot()
    episodes = {e.attrs["robot_episode"]: snap.load(e) for e in snap.episodes(client="unit")}
    assert sorted(episodes) == [0, 1]
    np.testing.assert_array_equal(episodes[1]["timestamp"], (3_000 + np.arange(3)) / 1e9)
    assert (episodes[1]["info"].attrs["start_stamp_ns"], episodes[1]["info"].attrs["end_stamp_ns"]) == (3_000, 3_003)


def test_a_stamp_far_ahead_then_an_episode_without_its_end_costs_only_those_two(tmp_path):
    """The far stamp stayed in the pool and was given to every later episode; the first one
    closed without its end (the robot restarted) then closed every stamp up to it, and each
    later start was refused: 2 of 6 episodes recorded instead of 4."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    far = 2_100_000_000 * 10**9
    try:
        bridge.episode(0, 1_000, 3)
        bridge.event(event="start", episode=1, seed=1, task="fold", instruction="fold", stamp=2_000)
        for t in range(4):
            bridge.node._on_joint(ARM2.joint_msg(2_000 + t, np.full(4, 0.1)), bridge.info(JOINT_TOPIC))
            if t == 0:  # one message from a node on another clock
                bridge.node._on_joint(ARM2.joint_msg(far, np.full(4, 0.1)), bridge.info(JOINT_TOPIC))
            if t < 3:
                bridge.node._on_action(ARM2.action_msg(2_000 + t, np.array([0.5, 0.1, 0.5])),
                                       bridge.info(ACTION_TOPIC))
        bridge.event(event="end", episode=1, seed=1, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, aborted=False, stamp=2_003, final=False)
        bridge.episode(2, 3_000, 3)
        bridge.episode(3, 4_000, 3, end=False)  # the robot restarts mid-episode
        bridge.restart_robot()
        bridge.episode(3, 5_000, 3)
        bridge.episode(4, 6_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"]) == (4, {"abandoned": 1, "malformed": 1}), status
    assert status["malformed"] == {"out_of_order": 1}
    snap = Store.open(root).snapshot()
    assert sorted((e.attrs["robot_episode"], e.attrs["start_stamp_ns"]) for e in snap.episodes(client="unit")) == [
        (0, 1_000), (2, 3_000), (3, 5_000), (4, 6_000)]


def test_exit_on_final_exits_when_the_final_episodes_start_was_refused(tmp_path):
    """The bridge ran on after the final episode's start was refused ('already closed; ignored')."""
    bridge = LocalBridge(str(tmp_path / "store"))
    bridge.node.cfg.exit_on_final = True
    try:
        bridge.episode(0, 1_000, 3)
        bridge.event(event="start", episode=1, seed=1, task="bogus", instruction="fold", stamp=2_000)  # refused
        assert not bridge.node.done
        bridge.event(event="end", episode=1, seed=1, task="bogus", length=0, rewards=[], success=False,
                     terminated=True, truncated=False, aborted=False, stamp=2_001, final=True)
        assert bridge.node.done
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"]) == (1, {"malformed": 1})


def test_robot_restarted_with_its_clock_behind_is_recorded(tmp_path):
    """A robot restarted with sim time from 0 (or a clock behind the old one): without
    forgetting the old stamps, every later message is refused as out of order until the
    bridge itself restarts."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 10_000, 3)
        bridge.episode(1, 20_000, 3, end=False)  # killed mid-episode
        bridge.restart_robot()
        bridge.episode(0, 1_000, 3)
        bridge.episode(1, 2_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (3, {"abandoned": 1}, {})
    snap = Store.open(root).snapshot()
    starts = sorted(round(snap.load(e)["timestamp"][0] * 1e9) for e in snap.episodes(client="unit"))
    assert starts == [1_000, 2_000, 10_000]


def test_data_arriving_before_the_first_start_event_is_no_clock_reset(tmp_path):
    """Topics are delivered independently: a robot's first observations may overtake its
    first start event, which must not be taken for a restarted clock that drops them."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        for t in range(4):
            bridge.node._on_joint(ARM2.joint_msg(1_000 + t, np.full(4, 0.1 * t)), bridge.info(JOINT_TOPIC))
            if t < 3:
                action = ARM2.action_msg(1_000 + t, np.array([0.5, 0.1, 0.5]))
                bridge.node._on_action(action, bridge.info(ACTION_TOPIC))
        bridge.event(event="start", episode=0, seed=0, task="fold", instruction="fold", stamp=1_000)
        bridge.event(event="end", episode=0, seed=0, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=1_003)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (1, {}, {})


def test_a_fractional_length_is_a_malformed_end(tmp_path):
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3, length=2.7, rewards=[0.0, 0.0])  # was read as 2 steps
        bridge.episode(1, 2_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (1, {"malformed": 1}, {"event": 1})


def test_an_episode_index_that_is_not_an_integer_is_a_malformed_event(tmp_path):
    """An index 1.5 (or "3") was recorded as episode 1 (or 3)."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3)
        bridge.episode(1.5, 2_000, 3)
        bridge.episode("3", 3_000, 3)
        bridge.episode(4, 4_000, 3)
    finally:
        status = bridge.close()
    assert status["committed"] == 2 and status["malformed"]["event"] == 4
    assert [e.attrs["robot_episode"] for e in Store.open(root).snapshot().episodes(client="unit")] == [0, 4]


def test_end_without_stamp_discards_its_episode_and_loses_nothing(tmp_path):
    """An end event without a stamp still names its episode: that one is discarded as
    malformed at once (not after the timeout), and the event is not also counted as lost."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3, stamp=None)
        assert (bridge.node.recorder.discarded, bridge.node.recorder.malformed) == ({"malformed": 1}, {"event": 1})
        bridge.episode(1, 2_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["lost"]) == (1, {"malformed": 1}, {})


def test_unstamped_message_is_named_as_such(tmp_path):
    """A robot that never sets header.stamp gets ``no_stamp``, not ``out_of_order``
    ("stamp 0 is not after 0"), and its good episodes are still recorded."""
    bridge = LocalBridge(str(tmp_path / "store"))
    try:
        bridge.node._on_joint(ARM2.joint_msg(0, np.zeros(4)), bridge.info(JOINT_TOPIC))
        bridge.node._on_action(ARM2.action_msg(0, np.zeros(3)), bridge.info(ACTION_TOPIC))
        bridge.episode(0, 1_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["malformed"]) == (1, {"no_stamp": 2})


def test_one_stamp_far_ahead_costs_one_episode_not_the_topic(tmp_path):
    """A node on another clock stamps one joint message far ahead (wall time among sim time).
    Every later joint message used to be refused as out of order, so nothing was recorded again
    until the bridge restarted; now the order check resumes after the message that follows it."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3)
        bridge.event(event="start", episode=1, seed=1, task="fold", instruction="fold", stamp=2_000)
        bridge.node._on_joint(ARM2.joint_msg(2_000, np.zeros(4)), bridge.info(JOINT_TOPIC))
        bridge.node._on_joint(ARM2.joint_msg(1_700_000_000 * 10**9, np.zeros(4)), bridge.info(JOINT_TOPIC))
        for t in range(1, 4):  # the rest of episode 1
            bridge.node._on_joint(ARM2.joint_msg(2_000 + t, np.zeros(4)), bridge.info(JOINT_TOPIC))
        for t in range(3):
            bridge.node._on_action(ARM2.action_msg(2_000 + t, np.array([0.5, 0.1, 0.5])), bridge.info(ACTION_TOPIC))
        bridge.event(event="end", episode=1, seed=1, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=2_003)
        bridge.episode(2, 3_000, 3)
        bridge.episode(3, 4_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (3, {"malformed": 1}, {"out_of_order": 1})
    snap = Store.open(root).snapshot()
    assert [e.attrs["robot_episode"] for e in snap.episodes(client="unit")] == [0, 2, 3]


def test_a_start_stamp_far_ahead_costs_its_episode_not_every_later_one(tmp_path):
    """A start event stamped far ahead (another clock), its data and end stamped right: its bad
    end closed stamps up to the bogus start, so every later episode was refused as "not after the
    episodes already seen" until the bridge restarted. Likewise once such a start alone times out."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3)
        bridge.event(event="start", episode=1, seed=1, task="fold", instruction="fold", stamp=1_700_000_000 * 10**9)
        for t in range(4):
            bridge.node._on_joint(ARM2.joint_msg(2_000 + t, np.zeros(4)), bridge.info(JOINT_TOPIC))
            if t < 3:
                bridge.node._on_action(ARM2.action_msg(2_000 + t, np.array([0.5, 0.1, 0.5])),
                                       bridge.info(ACTION_TOPIC))
        bridge.event(event="end", episode=1, seed=1, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=2_003)
        bridge.episode(2, 3_000, 3)
        bridge.event(event="start", episode=3, seed=3, task="fold", instruction="fold", stamp=1_800_000_000 * 10**9)
        bridge.node.cfg.timeout = 0.0  # the robot sends nothing more for a while
        bridge.node.tick()
        bridge.node.cfg.timeout = 5.0
        bridge.episode(4, 4_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"]) == (3, {"malformed": 1, "timeout": 1})
    snap = Store.open(root).snapshot()
    assert [e.attrs["robot_episode"] for e in snap.episodes(client="unit")] == [0, 2, 4]


def test_a_start_stamp_far_ahead_without_an_end_costs_only_its_own_episode(tmp_path):
    """A start event stamped far ahead whose episode never ends (its robot went on with the next):
    every later start came "not after the episodes already seen" and was refused until the
    bogus one timed out. Nothing at or after that stamp ever arrived, so it is that one that is
    dropped, and the next start records. A start behind an episode that holds data is still refused."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3)
        bridge.event(event="start", episode=1, seed=1, task="fold", instruction="fold", stamp=1_700_000_000 * 10**9)
        bridge.episode(2, 3_000, 3)
        bridge.episode(3, 4_000, 3, end=False)
        bridge.event(event="start", episode=4, seed=4, task="fold", instruction="fold", stamp=3_500)  # behind ep 3
        bridge.event(event="end", episode=3, seed=3, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=4_003)
        bridge.episode(5, 5_000, 3)
    finally:
        status = bridge.close()
    # committed + discarded = the 6 episodes started: episode 1 and the refused episode 4 are lost
    assert status["committed"] == 4 and status["discarded"] == {"malformed": 2}
    assert status["malformed"] == {"event": 2}  # episode 1's start and episode 4's
    snap = Store.open(root).snapshot()
    assert [e.attrs["robot_episode"] for e in snap.episodes(client="unit")] == [0, 2, 3, 5]


def test_a_start_event_sent_twice_is_recorded_once(tmp_path):
    """A robot that re-sends a start event (a retry, a bridged topic seen twice) used to get its
    episode discarded: the copy was "not after the episodes already seen" and faulted its stamp."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.event(event="start", episode=0, seed=0, task="fold", instruction="fold", stamp=1_000)
        bridge.episode(0, 1_000, 3)
        bridge.episode(1, 2_000, 3)
        bridge.event(event="start", episode=1, seed=5, task="fold", instruction="fold", stamp=2_000)  # not a copy
        bridge.event(event="start", episode=0, seed=0, task="fold", instruction="fold", stamp=1_000)  # late copy
    finally:
        status = bridge.close()
    assert status["committed"] == 2 and status["malformed"] == {"event": 1} and status["discarded"] == {"malformed": 1}
    snap = Store.open(root).snapshot()
    assert [e.attrs["robot_episode"] for e in snap.episodes(client="unit")] == [0, 1]


def test_a_repeated_stamp_never_replaces_recorded_data(tmp_path):
    """Comparing with the previous message only, a stamp repeated after an older one would pass
    the order check: its data must not silently replace what that stamp already holds."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3, end=False)
        bridge.node._on_joint(ARM2.joint_msg(500, np.zeros(4)), bridge.info(JOINT_TOPIC))  # out of order
        bridge.node._on_joint(ARM2.joint_msg(1_001, np.full(4, 9.0)), bridge.info(JOINT_TOPIC))  # repeated
        bridge.event(event="end", episode=0, seed=0, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=1_003)
        bridge.episode(1, 2_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (1, {"malformed": 1}, {"out_of_order": 2})
    snap = Store.open(root).snapshot()
    assert [e.attrs["robot_episode"] for e in snap.episodes(client="unit")] == [1]


def test_a_float_event_stamp_is_refused_not_rounded(tmp_path, capfd):
    """Event stamps are the header stamps in integer nanoseconds. A float one was truncated
    (an end at 1_003.9 read as 1_003), and beyond 2**53 ns (any wall-clock stamp) JSON has
    already rounded it onto another message's stamp, so it cannot be kept exactly: it is
    refused, naming the field and value, and costs its own episode only."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3, stamp=1_003.9)  # an end: its episode is discarded at once
        bridge.episode(1, 2_000, 3)
        bridge.event(event="start", episode=2, seed=2, task="fold", instruction="fold", stamp=3_000.0)
        for t in range(4):  # episode 2's data, then its end: never recorded, never an end_without_start
            bridge.node._on_joint(ARM2.joint_msg(3_000 + t, np.zeros(4)), bridge.info(JOINT_TOPIC))
            if t < 3:
                bridge.node._on_action(ARM2.action_msg(3_000 + t, np.zeros(3)), bridge.info(ACTION_TOPIC))
        bridge.event(event="end", episode=2, seed=2, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=3_003)
        bridge.episode(3, 4_000, 3)
        # the same for a policy version: int() recorded 1.5 as version 1
        bridge.event(event="start", episode=4, seed=4, task="fold", instruction="fold", stamp=5_000,
                     policy_version=1.5)
        bridge.event(event="end", episode=4, seed=4, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=5_003)
    finally:
        status = bridge.close()
    # committed + discarded = the 5 episodes started: 0 by its end, 2 and 4 by their starts
    assert (status["committed"], status["discarded"], status["malformed"]) == (2, {"malformed": 3}, {"event": 3})
    assert [e.attrs["robot_episode"] for e in Store.open(root).snapshot().episodes(client="unit")] == [1, 3]
    err = capfd.readouterr().err
    assert "stamp must be a JSON integer, got 1003.9" in err and "stamp must be a JSON integer, got 3000.0" in err
    assert "policy_version must be a JSON integer, got 1.5" in err


def test_a_second_bridge_on_the_namespace_into_the_same_store_is_refused(tmp_path):
    """Under another client_id it recorded every episode a second time (an ERROR line only)."""
    root = str(tmp_path / "store")
    context = Context()
    rclpy.init(context=context, domain_id=fresh_domain(), signal_handler_options=SignalHandlerOptions.NO)
    try:
        first = ros2.BridgeNode(ros2.BridgeConfig(store=root, robot=ARM2_PATH, client_id="b0"), context)
        with pytest.raises(ShardLockedError, match=r"another bridge records namespace /robot \(ROS domain \d+\) into "):
            ros2.BridgeNode(ros2.BridgeConfig(store=root, robot=ARM2_PATH, client_id="b1"), context)
        first.close()
        ros2.BridgeNode(ros2.BridgeConfig(store=root, robot=ARM2_PATH, client_id="b1"), context).close()
    finally:
        context.try_shutdown()


def test_an_end_event_shorter_than_its_data_is_not_committed_cut_short(tmp_path):
    """An end event overtaking its data with ``length`` 3 for 5 steps (its stamp s_5) committed
    the first 3 steps as the episode and dropped the rest, with no word."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 5, end_first=True, length=3, rewards=[0.0] * 3)
        bridge.episode(1, 2_000, 3, end_first=True)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"]) == (1, {"inconsistent": 1})
    (episode,) = Store.open(root).snapshot().episodes(client="unit")
    assert (episode.attrs["robot_episode"], episode.length) == (1, 3)


def test_an_end_event_sent_twice_before_its_data_is_recorded_once(tmp_path, capfd):
    """An end event re-sent while its data are still in flight was an ``end_without_start``; a
    second end that disagrees with the first discards its episode as malformed."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)

    def episode(index: int, start: int, second_length: int) -> None:
        end = {"event": "end", "episode": index, "seed": index, "task": "fold", "length": 3, "rewards": [0.0] * 3,
               "success": False, "terminated": True, "truncated": False, "stamp": start + 3}
        bridge.event(event="start", episode=index, seed=index, task="fold", instruction="fold", stamp=start)
        bridge.event(**end)
        bridge.event(**end | {"length": second_length, "rewards": [0.0] * second_length})
        for t in range(4):
            bridge.node._on_joint(ARM2.joint_msg(start + t, np.zeros(4)), bridge.info(JOINT_TOPIC))
            if t < 3:
                bridge.node._on_action(ARM2.action_msg(start + t, np.zeros(3)), bridge.info(ACTION_TOPIC))

    try:
        episode(0, 1_000, 3)
        episode(1, 2_000, 2)
        episode(2, 3_000, 3)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (2, {"malformed": 1}, {"event": 1})
    assert [e.attrs["robot_episode"] for e in Store.open(root).snapshot().episodes(client="unit")] == [0, 2]
    err = capfd.readouterr().err
    assert "end of episode 0 (stamp 1003) received again; ignored" in err
    assert "bad end of episode 1: a second end (stamp 2003, length 2) unlike the first (stamp 2003, length 3)" in err


def test_rewards_must_be_finite_json_numbers(tmp_path, capfd):
    """``float()`` recorded a reward "1.0" or true as 1.0 and a string "123" as three rewards,
    and a NaN reward cost a store round trip; an integer beyond float64 raised OverflowError out
    of the callback. Each is a bad end naming the field and the value's type; ints stay numbers."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3, rewards=[0.0, "1.0", 0.0])
        bridge.episode(1, 2_000, 3, rewards=[True, 0.0, 0.0])
        bridge.episode(2, 3_000, 3, rewards="123")
        bridge.episode(3, 4_000, 3, rewards=[0.0, 0.0, float("nan")])  # json writes NaN, and reads it back
        bridge.episode(4, 5_000, 3, rewards=[0.0, 10**400, 0.0])
        bridge.episode(5, 6_000, 3, rewards=[1, 0.5, -2])
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (1, {"malformed": 5}, {"event": 5})
    snap = Store.open(root).snapshot()
    (episode,) = snap.episodes(client="unit")
    assert episode.attrs["robot_episode"] == 5
    np.testing.assert_array_equal(snap.load(episode)["reward"], [1.0, 0.5, -2.0])
    err = capfd.readouterr().err
    for reason in ["rewards[1] must be a JSON number, got str '1.0'", "rewards[0] must be a JSON number, got bool True",
                   "rewards must be a JSON list of numbers, got str", "rewards[2] is nan: rewards must be finite",
                   "rewards[1] is inf: rewards must be finite"]:
        assert reason in err


def test_joint_states_naming_other_joints_are_recorded(tmp_path):
    """A robot's joint_states often names joints that are not recorded (wheels, gripper
    fingers): every such message was refused as ``joint_names``. The described joints are
    picked by name, in the described order, whatever the others hold; a described joint that
    is missing (or repeated) is refused by name. Actions stay strict."""
    names = ["wheel", "elbow", "gripper", "shoulder"]

    def joints(ns: int, t: int) -> JointState:
        return joint_msg(ns, names, np.array([np.nan, 2.0 + t, 7.0, 1.0 + t]),
                              velocity=np.array([np.inf, 20.0, 7.0, 10.0]))

    np.testing.assert_array_equal(ARM2.parse_joints(joints(1, 0)), np.float32([1, 2, 10, 20]))
    for bad, reason in [(["wheel", "elbow", "gripper", "base"], r"missing \['shoulder'\]"),
                        (["elbow", "elbow", "gripper", "shoulder"], r"repeated \['elbow'\]")]:
        msg = joints(1, 0)
        msg.name = bad
        with pytest.raises(MalformedMessage, match=reason) as e:
            ARM2.parse_joints(msg)
        assert e.value.kind == "joint_names"
    with pytest.raises(MalformedMessage, match=r"unknown \['gripper'\]"):
        ARM2.parse_action(joint_msg(1, [*ARM2.action_names, "gripper"], np.array([0.5, 0.1, 0.5, 0.0])))
    data = yaml.safe_load(Path(ARM2_PATH).read_text())
    del data["joints"]["names"]  # nothing to select by: refused, not "record whatever arrives"
    with pytest.raises(ros2.RobotDescriptionError, match="missing joints.names"):
        ros2.RobotDescription.from_dict(data)

    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.event(event="start", episode=0, seed=0, task="fold", instruction="fold", stamp=1_000)
        for t in range(4):
            bridge.node._on_joint(joints(1_000 + t, t), bridge.info(JOINT_TOPIC))
            if t < 3:
                bridge.node._on_action(ARM2.action_msg(1_000 + t, np.zeros(3)), bridge.info(ACTION_TOPIC))
        bridge.event(event="end", episode=0, seed=0, task="fold", length=3, rewards=[0.0] * 3, success=False,
                     terminated=True, truncated=False, stamp=1_003)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"], status["malformed"]) == (1, {}, {})
    snap = Store.open(root).snapshot()
    (episode,) = snap.episodes(client="unit")
    want = [[1 + t, 2 + t, 10, 20] for t in range(4)]
    np.testing.assert_array_equal(snap.load(episode)["obs"]["joints"], np.float32(want))


def test_discards_are_counted_by_reason_in_the_log_and_status(tmp_path, capfd):
    """Each discard and the final log line give the counts by reason, as the status does."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 4, length=3, rewards=[0.0] * 3)  # 5 observations for 3 steps
        bridge.episode(1, 2_000, 4, length=3, rewards=[0.0] * 3)
        bridge.episode(2, 3_000, 3, success="false")
        bridge.episode(3, 4_000, 3)
        bridge.episode(4, 5_000, 3, end=False)  # still open at shutdown
        assert read_status(root, "unit")["discarded"] == {"inconsistent": 2, "malformed": 1}
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"]) == (1, {"inconsistent": 2, "malformed": 1, "shutdown": 1})
    err = capfd.readouterr().err
    assert "discarded episode 1 (inconsistent); so far discarded 2 episodes: inconsistent=2" in err
    assert "discarded episode 2 (malformed); so far discarded 3 episodes: inconsistent=2, malformed=1" in err
    assert ("stopping: committed=1 to shard unit; discarded 4 episodes: inconsistent=2, malformed=1, shutdown=1"
            in err)


def test_a_damaged_status_file_is_named_in_one_line(tmp_path, capsys):
    """`ros2-status` on a status file that is not a JSON object used to end in an AttributeError
    traceback, and on one with an unreadable pid or heartbeat in a ValueError naming no file."""
    (tmp_path / "fleet").mkdir()
    path = tmp_path / "fleet" / "arm-0.json"
    good = {"client_id": "arm-0", "kind": "ros2-bridge", "state": "running", "pid": os.getpid(), "host": "h",
            "heartbeat": time.time()}
    # A scan of the store cannot tell a file that is no JSON object from another client's.
    for text, why, scan_skips in [("[1]", "a JSON list, not an object", True),
                                  ('{"state": "run', "JSONDecodeError", True),
                                  (json.dumps({**good, "pid": "x"}), "invalid literal for int", False),
                                  (json.dumps({**good, "heartbeat": None}), "float", False)]:
        path.write_text(text)
        for args in ([], ["client_id=arm-0"]):
            capsys.readouterr()
            assert cli_main(["fleet", "ros2-status", f"store={tmp_path}", *args]) == 1
            err = capsys.readouterr().err.strip()
            if not args and scan_skips:
                assert err == f"robo-post fleet ros2-status: no ROS 2 bridge has run on the store {tmp_path}"
            else:
                assert err.startswith(f"robo-post fleet ros2-status: {path} is not a bridge status (") and why in err
                assert "\n" not in err
    path.write_text(json.dumps(good))
    assert cli_main(["fleet", "ros2-status", f"store={tmp_path}"]) == 0


def test_image_rows_may_be_padded():
    """A valid ROS image may pad its rows (step > width * channels); the padding is not
    recorded, and an image whose data do not fill height * step is still refused."""
    image = np.arange(64 * 64 * 3, dtype=np.uint32).astype(np.uint8).reshape(64, 64, 3)
    padded = np.concatenate([image.reshape(64, 192), np.full((64, 64), 7, np.uint8)], axis=1)
    msg = image_msg(1, image)
    msg.step, msg.data = 256, padded.tobytes()
    np.testing.assert_array_equal(TABLETOP.parse_image(msg), image)
    msg.data = padded.tobytes()[:-1]
    with pytest.raises(MalformedMessage, match="step 256"):
        TABLETOP.parse_image(msg)


def test_cli_refuses_bad_args_in_one_line(tmp_path, capsys):
    """A bad namespace or domain id is refused in one line before ROS starts (ROS itself
    would raise a traceback, or log a DDS error and exit without a word of ours); so is a
    sim config its robot cannot run; ros2-status on a missing store says so instead of
    printing nothing."""
    for arg, message in [("namespace=bad-ns", "namespace='bad-ns': Invalid namespace"),
                         ("domain_id=300", "domain_id=300: ROS domain ids are 0..232"),
                         # accepted before, then every episode was discarded as a timeout
                         ("timeout=-1", "timeout=-1.0: seconds an open episode may stay silent, must be > 0"),
                         ("timeout=0", "timeout=0.0: seconds an open episode may stay silent, must be > 0"),
                         ("timeout=abc", "timeout='abc': could not convert string to float: 'abc'"),
                         ("burst_episodes=0", "burst_episodes=0: whole episodes a topic queue holds, must be >= 1"),
                         ("max_steps=-1", "max_steps=-1 must be >= 0 (0: the description's)")]:
        assert cli_main(["fleet", "ros2-bridge", f"store={tmp_path / 'store'}", arg]) == 2
        err = capsys.readouterr().err
        assert message in err and ("max_steps" in arg or "max_steps" not in err)  # only the wrong setting is named
        assert not (tmp_path / "store").exists()
    sim = ["fleet", "ros2-sim", f"robot={ARM2_PATH}", f"domain_id={fresh_domain()}", "discovery_timeout=1"]
    assert cli_main(sim) == 1  # the default policy=expert: refused before waiting for a bridge
    assert "names no simulator env, and its kinematic stand-in has no expert" in capsys.readouterr().err
    assert cli_main([*sim, "task=nope", "policy=random"]) == 1  # not an AttributeError from a half-built node
    assert "RobotDescriptionError: task 'nope' is not one of robot 'arm2'" in capsys.readouterr().err
    assert cli_main(["fleet", "ros2-status", f"store={tmp_path / 'none'}"]) == 1
    assert capsys.readouterr().err.strip() == f"robo-post fleet ros2-status: no store {tmp_path / 'none'}"
    # a missing required key was the dataclass's "__init__() missing 1 required positional argument"
    assert cli_main(["fleet", "ros2-status"]) == 2
    assert capsys.readouterr().err.strip() == "robo-post fleet ros2-status: missing store=..."
    assert cli_main(["fleet", "ros2-status", f"store={tmp_path}", "stale_s=-1"]) == 2
    assert "stale_s=-1.0: a heartbeat age in seconds must be > 0" in capsys.readouterr().err


def test_publisher_of_another_type_and_another_bridge_are_reported(tmp_path):
    """DDS never matches a publisher of another message type: without a check, a robot
    publishing e.g. String on joint_states only ever sees its episodes time out. A second
    bridge on the namespace records every episode again, silently."""
    bridge = LocalBridge(str(tmp_path / "store"))
    context = Context()
    rclpy.init(context=context, domain_id=bridge.context.get_domain_id(),
               signal_handler_options=SignalHandlerOptions.NO)
    robot = rclpy.create_node("robot", namespace="/robot", context=context)
    try:
        robot.create_publisher(String, JOINT_TOPIC, topic_qos(10))
        robot.create_publisher(String, STATUS_TOPIC, STATUS_QOS)  # as another bridge does
        deadline = time.monotonic() + DEADLINE_S
        while not (bridge.node.wrong_type and bridge.node.other_bridges) and time.monotonic() < deadline:
            bridge.node._check_graph()
            time.sleep(0.05)
        status = bridge.node.write_status("running")
    finally:
        robot.destroy_node()
        context.try_shutdown()
        bridge.close()
    assert status["wrong_type"] == {JOINT_TOPIC: ["std_msgs/msg/String"]} and status["other_bridges"] == 1


def test_episodes_queued_behind_the_bridges_backlog_are_not_timed_out(tmp_path):
    """Four episodes sent back to back while the bridge was busy: their start events came first and
    their data queued behind the bridge's backlog. Timed on the wall clock from their starts, all but
    the first were discarded as `timeout` although every message arrived."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.node.cfg.timeout = 0.05
        starts = [1_000 * (i + 1) for i in range(4)]
        for i, start in enumerate(starts):
            bridge.event(event="start", episode=i, seed=i, task="fold", instruction="fold", stamp=start)
        for i, start in enumerate(starts):
            for t in range(21):
                bridge.node._on_joint(ARM2.joint_msg(start + t, np.full(4, 0.1 * t)), bridge.info(JOINT_TOPIC))
                if t < 20:
                    bridge.node._on_action(ARM2.action_msg(start + t, np.array([0.5, 0.1, 0.5])),
                                           bridge.info(ACTION_TOPIC))
                if t % 5 == 0:  # a slow bridge: more than `timeout` passes while the later episodes wait,
                    bridge.node.tick()  # ticking right after a message: on a loaded machine a sleep before
                    time.sleep(0.02)  # the tick can outlast `timeout` and read as a robot gone silent
            bridge.event(event="end", episode=i, seed=i, task="fold", length=20, rewards=[0.0] * 20, success=False,
                         terminated=True, truncated=False, aborted=False, stamp=start + 20, final=False)
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"]) == (4, {})


def test_an_episode_the_robot_left_times_out_on_the_robots_clock(tmp_path):
    """The robot gave up episode 0 without its end and went on: once every data topic has delivered
    stamps `timeout` past its last message, it is discarded, without waiting for the bridge to idle."""
    root = str(tmp_path / "store")
    bridge = LocalBridge(root)
    try:
        bridge.episode(0, 1_000, 3, end=False)
        bridge.episode(1, 1_000 + 10 * 10**9, 3)  # 10 s later on the robot's clock; timeout is 5 s
        bridge.node.tick()  # milliseconds of wall time since the last message
        assert [ep.index for ep in bridge.node.recorder.open_episodes] == []
    finally:
        status = bridge.close()
    assert (status["committed"], status["discarded"]) == (1, {"timeout": 1})


@pytest.mark.slow
def test_a_paused_bridge_records_a_whole_burst_of_long_episodes(tmp_path):
    """The documented burst end to end, under the case an earlier run lost half of: a robot whose
    description says ``max_steps: 2000``, a bridge with ``burst_episodes=4`` and a 5 s timeout,
    SIGSTOPped while the sim sends four 2000-step episodes back to back and for longer than the
    timeout after the last one. Resumed, the bridge records all four exactly: nothing is lost and
    nothing is discarded as ``timeout`` (the silence was the bridge's, not the robot's)."""
    steps, episodes, timeout = 2000, 4, 5.0
    robot_path = tmp_path / "arm2-long.yaml"
    robot_path.write_text(yaml.safe_dump({**yaml.safe_load(Path(ARM2_PATH).read_text()), "max_steps": steps}))
    robot = ros2.RobotDescription.load(str(robot_path))
    root, dump, domain_id = str(tmp_path / "store"), tmp_path / "sim.npz", fresh_domain()
    domain = f"domain_id={domain_id}"
    injector = Injector(domain_id, robot, listen=False)
    procs = {
        "bridge": spawn(tmp_path, "bridge", ["ros2-bridge", f"store={root}", f"robot={robot_path}",
                                             "client_id=arm-4", domain, "exit_on_final=true", f"timeout={timeout}",
                                             f"burst_episodes={episodes}"]),
        "sim": spawn(tmp_path, "sim", ["ros2-sim", f"robot={robot_path}", domain, f"episodes={episodes}",
                                       "rate_hz=0", "policy=random", "task=fold", "subscribers=2",
                                       f"burst_episodes={episodes}", f"dump={dump}"]),
    }
    bridge = procs["bridge"][0]
    try:
        stop_bridge_once_matched(injector, bridge, (JOINT_TOPIC, EPISODE_TOPIC))
        paused = time.monotonic()
        injector.spin_until(lambda: episodes - 1 in injector.ended(), "the last episode to end")
        sent = time.monotonic() - paused
        injector.spin_for(timeout + 2.0)  # a wall-clock timeout would fire on resuming
        os.kill(bridge.pid, signal.SIGCONT)
        resumed = time.monotonic()
        status = wait_status(root, "arm-4", lambda s: s["committed"] + sum(s["discarded"].values()) >= episodes,
                             f"{episodes} closed episodes")
        drained = time.monotonic() - resumed
        print(f"burst of {episodes} x {steps} steps: sent in {sent:.1f} s, bridge paused {resumed - paused:.1f} s, "
              f"drained in {drained:.1f} s; status {status}")
        assert (status["committed"], status["discarded"], status["lost"], status["malformed"]) == (episodes, {}, {}, {})
        assert status["max_burst"] == {"episodes": episodes, "max_steps": steps,
                                       "messages_per_topic": episodes * (steps + 1)}
        wait_exit(procs)
    finally:
        release(bridge, procs, injector)
    assert "timeout" not in procs["bridge"][1].read_text()
    meta = json.loads(str(np.load(dump)["meta"]))
    assert [m["length"] for m in meta] == [steps] * episodes and all(m["truncated"] for m in meta)
    assert_store_matches_dump(root, "arm-4", dump, dict.fromkeys(range(episodes), 0), robot=robot)
