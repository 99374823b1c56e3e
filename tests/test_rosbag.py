"""`robo-post store import-rosbag` on bags written here with rosbags (no ROS install needed):
episodes in recorded order through the bridge's recorder, and one-line typed errors that
leave an existing store's episodes alone. The live bridge against a bag of the same run is
tests/test_ros2_rosbag.py."""

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore

from robo_post.cli import main as cli_main
from robo_post.fleet.rosbag import BagImportConfig, BagNotFoundError, BagReadError, BagTopicError, import_rosbag
from robo_post.fleet.robot import RobotDescription
from robo_post.store import Store

TS = get_typestore(Stores.ROS2_KILTED)
ARM2_PATH = str(Path(__file__).parent / "data" / "robots" / "arm2.yaml")
ARM2 = RobotDescription.load(ARM2_PATH)  # 2 joints (position + velocity), no camera, 3 action dims
JOINT, STRING = "sensor_msgs/msg/JointState", "std_msgs/msg/String"
STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}


def joint_state(ns: int, names: list[str], position: np.ndarray, velocity: np.ndarray | None = None) -> Any:
    sec, nanosec = divmod(ns, 10**9)
    header = TS.types["std_msgs/msg/Header"](stamp=TS.types["builtin_interfaces/msg/Time"](sec=sec, nanosec=nanosec),
                                             frame_id="")
    empty = np.zeros(0, np.float64)
    return TS.types[JOINT](header=header, name=names, position=np.asarray(position, np.float64),
                           velocity=empty if velocity is None else np.asarray(velocity, np.float64), effort=empty)


def string(text: str) -> Any:
    return TS.types[STRING](data=text)


def arm2_episode(index: int, start: int, steps: int, nan_at: int | None = None,
                 end_first: bool = False) -> tuple[list[tuple[str, str, Any]], dict[str, Any]]:
    """Messages (topic, type, message) of one arm2 episode with stamps start, start + 1, ...,
    and the arrays it should be recorded as; ``nan_at``: that step's joints are NaN;
    ``end_first``: the end event overtakes the data, as events do over a busy link."""
    rng = np.random.default_rng(index)
    joints = rng.normal(size=(steps + 1, 4)).astype(np.float32)
    actions = rng.uniform(ARM2.action_low, ARM2.action_high, size=(steps, 3)).astype(np.float32)
    rewards = rng.normal(size=steps).round(3).tolist()
    start_event = {"event": "start", "episode": index, "seed": 100 + index, "task": "fold",
                   "instruction": f"fold number {index}", "stamp": start}
    end_event = {"event": "end", "episode": index, "seed": 100 + index, "task": "fold", "length": steps,
                 "rewards": rewards, "success": index % 2 == 0, "terminated": True, "truncated": False,
                 "aborted": False, "stamp": start + steps, "final": False}
    msgs = [("instruction", STRING, string("fold (the topic's copy)")),
            ("episode", STRING, string(json.dumps(start_event)))]
    if end_first:
        msgs.append(("episode", STRING, string(json.dumps(end_event))))
    for t in range(steps + 1):
        values = np.full(4, np.nan) if t == nan_at else joints[t]
        msgs.append(("joint_states", JOINT, joint_state(start + t, ["elbow", "shoulder", "gripper"],
                                                        values[[1, 0, 0]], values[[3, 2, 2]])))
        if t < steps:
            msgs.append(("action", JOINT, joint_state(start + t, list(ARM2.action_names), actions[t])))
    if not end_first:
        msgs.append(("episode", STRING, string(json.dumps(end_event))))
    expected = {"joints": joints, "action": actions, "reward": np.asarray(rewards), "seed": 100 + index,
                "instruction": f"fold number {index}", "success": index % 2 == 0, "stamps": (start, start + steps)}
    return msgs, expected


def write_bag(path: Path, storage: str, messages: list[tuple[str, str, Any]], namespace: str = "/robot") -> Path:
    """A rosbag2 bag of ``messages`` received 1 ms apart, as `ros2 bag record` writes it."""
    with Writer(path, version=9, storage_plugin=STORAGES[storage]) as writer:
        connections = {}
        for i, (topic, msgtype, msg) in enumerate(messages):
            name = f"{namespace}/{topic}"
            if name not in connections:
                connections[name] = writer.add_connection(name, msgtype, typestore=TS)
            writer.write(connections[name], 1_700_000_000 * 10**9 + i * 10**6, TS.serialize_cdr(msg, msgtype))
    return path


def good_messages() -> tuple[list[tuple[str, str, Any]], dict[int, dict[str, Any]]]:
    """Episodes 0 and 2 good (2's end event overtakes its data), 1 with a NaN joint message; a
    topic of another node among them. Returns the messages and the episodes to be recorded."""
    messages, expected = [], {}
    for index, start, kwargs in [(0, 1_000, {}), (1, 2_000, {"nan_at": 2}), (2, 3_000, {"end_first": True})]:
        msgs, want = arm2_episode(index, start, 4 + index, **kwargs)
        messages += msgs
        expected[index] = want
    messages.insert(3, ("rosout_note", STRING, string("not the robot's")))
    return messages, {i: expected[i] for i in (0, 2)}


def good_bag(tmp_path: Path, storage: str) -> tuple[Path, dict[int, dict[str, Any]]]:
    messages, expected = good_messages()
    return write_bag(tmp_path / f"bag-{storage}", storage, messages), expected


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_a_bag_is_recorded_as_the_bridge_records(tmp_path, storage):
    bag, expected = good_bag(tmp_path, storage)
    root = str(tmp_path / "store")
    done = import_rosbag(str(bag), root, BagImportConfig(robot=ARM2_PATH))
    assert (done.committed, done.steps, done.discarded, done.malformed) == (2, 10, {"malformed": 1}, {"nan": 1})
    snap = Store.open(root).snapshot()
    episodes = {e.attrs["robot_episode"]: e for e in snap.episodes(client="rosbag")}
    assert sorted(episodes) == [0, 2]
    for index, want in expected.items():
        ep = snap.load(episodes[index])
        np.testing.assert_array_equal(ep["obs"]["joints"], want["joints"])
        np.testing.assert_array_equal(ep["obs"]["goal"], np.full(len(want["joints"]), ARM2.tasks.index("fold")))
        np.testing.assert_array_equal(ep["action"], want["action"])
        np.testing.assert_array_equal(ep["reward"], want["reward"])
        assert ep["terminated"][-1] and not ep["terminated"][:-1].any() and not ep["truncated"].any()
        info = ep["info"]
        assert (info.seed, info.instruction, info.success, info.task_id) == (
            want["seed"], want["instruction"], want["success"], "fold")
        assert (info.attrs["start_stamp_ns"], info.attrs["end_stamp_ns"]) == want["stamps"]
        assert (info.attrs["source"], info.attrs["namespace"], info.attrs["bag"]) == ("rosbag2", "/robot", str(bag))


def test_the_cli_imports_with_the_bridges_settings(tmp_path, capsys):
    bag, _ = good_bag(tmp_path, "mcap")
    root = str(tmp_path / "store")
    assert cli_main(["store", "import-rosbag", str(bag), root, f"robot={ARM2_PATH}", "client_id=arm", "max_steps=5"]) == 0
    out = capsys.readouterr().out
    # episode 2 has 6 steps: over max_steps=5
    assert (f"imported 1 episode (4 steps) from {bag} into {root} (shard arm); discarded 2 episodes: malformed=1, "
            "too_long=1; malformed messages: nan=1") in out
    assert [e.attrs["robot_episode"] for e in Store.open(root).snapshot().episodes(client="arm")] == [0]


def test_bad_settings_are_refused_in_one_line(tmp_path, capsys):
    bag, _ = good_bag(tmp_path, "mcap")
    for args, rc, shown in [(["tiemout=3"], 2, "expected key=value with key in"),
                            (["timeout=0"], 2, "timeout=0.0: seconds an open episode may stay silent"),
                            (["robot=nowhere"], 1, "RobotDescriptionError: cannot read robot description")]:
        assert cli_main(["store", "import-rosbag", str(bag), str(tmp_path / "store"), *args]) == rc
        err = capsys.readouterr().err.strip()
        assert shown in err and "\n" not in err
    assert not (tmp_path / "store").exists()


def storage_file(bag: Path) -> Path:
    (path,) = [p for p in bag.iterdir() if p.suffix in (".mcap", ".db3")]
    return path


def missing(tmp: Path) -> Path:
    return tmp / "nowhere"


def not_a_bag(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def other_topics(tmp: Path) -> Path:
    return write_bag(tmp / "other", "mcap", [("chatter", STRING, string("hi"))])


def another_namespace(tmp: Path) -> Path:
    return write_bag(tmp / "ns", "sqlite3", arm2_episode(0, 1_000, 3)[0], namespace="/arm")


def truncated(storage: str):
    def make(tmp: Path) -> Path:
        path = storage_file(good_bag(tmp, storage)[0])
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path.parent
    return make


def corrupted(storage: str):
    """A bad sector in the last episode: the CDR header of its last joint message overwritten.
    An import that did not read the bag whole first would have committed episode 0 by then."""
    def make(tmp: Path) -> Path:
        path = storage_file(good_bag(tmp, storage)[0])
        last = next(msg for topic, _, msg in reversed(good_messages()[0]) if topic == "joint_states")
        raw, data = bytes(TS.serialize_cdr(last, JOINT)), path.read_bytes()
        assert data.count(raw) == 1
        path.write_bytes(data.replace(raw, b"\x7f\x7f" + raw[2:]))
        return path.parent
    return make


BAD_BAGS = {
    "missing": (missing, BagNotFoundError, "no rosbag2 recording at"),
    "not a bag": (not_a_bag, BagReadError, "cannot be read as a rosbag2 recording: FileNotFoundError: Expected "
                                           "metadata file"),
    "other topics": (other_topics, BagTopicError,
                     "has no /robot/action (sensor_msgs/msg/JointState), /robot/episode (std_msgs/msg/String), "
                     "/robot/joint_states (sensor_msgs/msg/JointState) for robot 'arm2' under namespace /robot; "
                     "it has /robot/chatter (std_msgs/msg/String)"),
    "another namespace": (another_namespace, BagTopicError, "under namespace /robot; it has /arm/action"),
    "truncated mcap": (truncated("mcap"), BagReadError, "cannot be read as a rosbag2 recording: ReaderError: File "
                                                        "end magic is invalid"),
    "truncated sqlite3": (truncated("sqlite3"), BagReadError, "cannot be read as a rosbag2 recording: ReaderError: "
                                                              "Cannot open database"),
    "corrupted mcap": (corrupted("mcap"), BagReadError, "is damaged (truncated or corrupted): SerdeError: Invalid "
                                                        "or unsupported CDR encapsulation"),
    "corrupted sqlite3": (corrupted("sqlite3"), BagReadError, "is damaged (truncated or corrupted): SerdeError: "
                                                              "Invalid or unsupported CDR encapsulation"),
}


@pytest.mark.parametrize("case", sorted(BAD_BAGS))
def test_a_bad_bag_fails_in_one_line_and_writes_nothing(tmp_path, capsys, case):
    make, error, shown = BAD_BAGS[case]
    root = str(tmp_path / "store")
    (tmp_path / "good").mkdir()
    assert import_rosbag(str(good_bag(tmp_path / "good", "mcap")[0]), root, BagImportConfig(robot=ARM2_PATH)).committed
    before = [(e.key, e.length) for e in Store.open(root).snapshot().episodes()]
    bag = str(make(tmp_path))
    with pytest.raises(error, match=re.escape(shown)):
        import_rosbag(bag, root, BagImportConfig(robot=ARM2_PATH, client_id="again"))
    assert cli_main(["store", "import-rosbag", bag, root, f"robot={ARM2_PATH}", "client_id=again"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"robo-post store: {error.__name__}: ") and shown in err and "\n" not in err
    assert [(e.key, e.length) for e in Store.open(root).snapshot().episodes()] == before
    assert not os.path.exists(os.path.join(root, "shards", "again"))
