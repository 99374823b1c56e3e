"""The live ROS 2 bridge and `store import-rosbag` on one run of the simulated robot.

While the bridge records the run, a bag recorder in this process (what `ros2 bag record`
does: raw subscriptions, each message's bytes as they came over the wire) captures every
message the sim publishes, and writes them as an MCAP and a sqlite3 bag with rosbags. Each
bag imported into a store of its own must hold the bridge's episodes array for array, with
the same discard and malformed-message counts. Needs the `ros` extra (rclpy).
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede importing mujoco

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")  # a ROS 2 test: needs the `ros` extra

from rclpy.context import Context  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.signals import SignalHandlerOptions  # noqa: E402
from rosbags.rosbag2 import StoragePlugin, Writer  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from test_ros2_bridge import DEADLINE_S, fresh_domain, kill_all, read_status, spawn, wait_exit  # noqa: E402

from robo_post.fleet.ros2_settings import topic_qos  # noqa: E402
from robo_post.fleet.rosbag import MSG_TYPES, TYPESTORE, BagImportConfig, import_rosbag  # noqa: E402
from robo_post.store import Store  # noqa: E402

pytestmark = pytest.mark.ros2

MSG_CLASSES = {"sensor_msgs/msg/JointState": JointState, "sensor_msgs/msg/Image": Image, "std_msgs/msg/String": String}
STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}


class BagRecorder:
    """A test-only `ros2 bag record` of the robot's topics: every message as raw CDR with its
    receive time, checked complete by each publisher's sequence numbers."""

    def __init__(self, domain_id: int, namespace: str = "/robot"):
        self.namespace = namespace
        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node("bag_recorder", namespace=namespace, context=self.context)
        qos = topic_qos(100_000)  # never the reason a message is missing
        self.subs = {topic: self.node.create_subscription(MSG_CLASSES[msgtype], topic, self._callback(topic), qos,
                                                          raw=True)
                     for topic, msgtype in MSG_TYPES.items()}
        self.messages: list[tuple[str, int, bytes]] = []  # (topic, receive time ns, raw CDR)
        self._sequence: dict[tuple[str, bytes], int] = {}
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)

    def _callback(self, topic: str) -> Callable[[bytes, dict[str, Any]], None]:
        def on_message(raw: bytes, info: dict[str, Any]) -> None:
            key = (topic, bytes(info["publisher_gid"]["data"]))
            seq = info["publication_sequence_number"]
            assert seq == self._sequence.get(key, 0) + 1, f"the recording missed {topic} messages before number {seq}"
            self._sequence[key] = seq
            # strictly increasing, so that the bag's order is the order received
            last = self.messages[-1][1] if self.messages else 0
            self.messages.append((topic, max(time.time_ns(), last + 1), raw))
        return on_message

    def matched(self) -> bool:
        return all(sub.get_publisher_count() > 0 for sub in self.subs.values())

    def spin_until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.executor.spin_once(timeout_sec=0.02)

    def drain(self, quiet_s: float = 0.5) -> None:
        """Take what is still queued: spin until nothing arrives for ``quiet_s``."""
        count, until = -1, 0.0
        while count != len(self.messages) or time.monotonic() < until:
            if count != len(self.messages):
                count, until = len(self.messages), time.monotonic() + quiet_s
            self.executor.spin_once(timeout_sec=0.02)

    def write(self, path: Path, storage: str) -> Path:
        """The recording as a rosbag2 bag with ``storage`` (mcap or sqlite3)."""
        with Writer(path, version=9, storage_plugin=STORAGES[storage]) as writer:
            connections = {topic: writer.add_connection(f"{self.namespace}/{topic}", msgtype, typestore=TYPESTORE)
                           for topic, msgtype in MSG_TYPES.items()}
            for topic, received, raw in self.messages:
                writer.write(connections[topic], received, raw)
        return path

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()


def assert_same_episodes(live_root: str, live_client: str, bag_root: str, bag_client: str, bag: Path) -> None:
    """The two shards hold the same episodes: every array equal, and the metadata of the
    recording equal (not the shard, nor where the episode came from: the bridge, or ``bag``)."""
    live_store, bag_store = Store.open(live_root), Store.open(bag_root)
    assert live_store.schema == bag_store.schema
    live_snap, bag_snap = live_store.snapshot(), bag_store.snapshot()
    live = {e.attrs["robot_episode"]: e for e in live_snap.episodes(client=live_client)}
    imported = {e.attrs["robot_episode"]: e for e in bag_snap.episodes(client=bag_client)}
    assert sorted(live) == sorted(imported) and live
    for index in live:
        a, b = live_snap.load(live[index]), bag_snap.load(imported[index])
        assert sorted(a) == sorted(b)
        for key in a:
            if key == "info":
                continue
            arrays = a[key] if isinstance(a[key], dict) else {"": a[key]}
            others = b[key] if isinstance(b[key], dict) else {"": b[key]}
            assert sorted(arrays) == sorted(others), key
            for name in arrays:
                assert arrays[name].dtype == others[name].dtype, (key, name)
                np.testing.assert_array_equal(arrays[name], others[name], err_msg=f"episode {index} {key} {name}")
        x, y = a["info"], b["info"]
        fields = ("task_id", "instruction", "seed", "success", "length", "policy_version", "terminated", "start_time",
                  "end_time", "ret", "checksum")
        assert [getattr(x, f) for f in fields] == [getattr(y, f) for f in fields]
        assert (x.attrs["source"], y.attrs["source"], y.attrs["bag"]) == ("ros2", "rosbag2", str(bag))
        provenance = ("source", "bag")
        assert {k: v for k, v in x.attrs.items() if k not in provenance} == {
            k: v for k, v in y.attrs.items() if k not in provenance}


@pytest.mark.slow
def test_a_bag_of_the_run_imports_as_the_live_bridge_recorded_it(tmp_path):
    """Episode 1's first joint message lacks a joint and its last is NaN: the bridge discards it as
    malformed, and so must each import; episodes 0 and 2 (camera images included) match exactly."""
    root, domain_id = str(tmp_path / "live"), fresh_domain()
    domain = f"domain_id={domain_id}"
    recorder = BagRecorder(domain_id)
    # The sim first, so that the recorder has matched its publishers before the bridge lets it start.
    procs = {"sim": spawn(tmp_path, "sim", ["ros2-sim", domain, "episodes=3", "rate_hz=0", "subscribers=2",
                                            "faults=1:0:names+1:-1:nan"])}
    try:
        recorder.spin_until(recorder.matched, "the recorder to match the sim's publishers")
        procs["bridge"] = spawn(tmp_path, "bridge", ["ros2-bridge", f"store={root}", "client_id=live", domain,
                                                     "exit_on_final=true", "timeout=20"])
        recorder.spin_until(lambda: all(proc.poll() is not None for proc, _ in procs.values()), "the run to end")
        recorder.drain()
        wait_exit(procs)
    finally:
        kill_all(procs)
        recorder.close()
    live = read_status(root, "live")
    assert (live["committed"], live["discarded"], live["lost"]) == (2, {"malformed": 1}, {})
    assert live["malformed"] == {"joint_length": 1, "nan": 1}
    for storage in STORAGES:
        bag = recorder.write(tmp_path / f"run-{storage}", storage)
        imported = str(tmp_path / f"imported-{storage}")
        done = import_rosbag(str(bag), imported, BagImportConfig(timeout=20))
        assert (done.committed, done.discarded, done.malformed) == (
            live["committed"], live["discarded"], live["malformed"])
        assert done.messages == len(recorder.messages)
        assert_same_episodes(root, "live", imported, "rosbag", bag)
