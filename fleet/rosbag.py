"""``robo-post store import-rosbag BAG STORE [key=value ...]``: a rosbag2 recording of a
robot (MCAP or sqlite3 storage) into a store shard, as the live ROS 2 bridge records it.

The bag must hold the robot's topics under its namespace (``/robot/joint_states``,
``/robot/episode``, ...; see ``robo_post.fleet.ros2``) with the bridge's message types; other
topics are ignored. Its messages go, in recorded order (receive timestamps), to the same
``EpisodeRecorder`` the bridge's subscription callbacks feed: the same robot description,
stamp alignment, validation, episode commits and per-kind discard counts. The bag's receive
timestamps stand in for the bridge's clock in the silence ``timeout``; episodes still open
where the recording ends are discarded as ``shutdown``, like those of a bridge stopped there.
A bag keeps no publisher sequence numbers, so messages a recorder missed are not counted in
``lost``: their episodes end up discarded (``inconsistent``, ``malformed`` or ``shutdown``).

All or nothing: the bag is read and decoded whole before the store is opened, so a
missing, foreign, truncated or corrupted bag fails (one line) before anything is written.
Nothing here needs ROS: ``rosbags`` reads and decodes the messages in pure Python.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rosbags.interfaces import Connection
from rosbags.rosbag2 import Reader
from rosbags.typesys import Stores, get_typestore

from robo_post.fleet.recorder import (ACTION_TOPIC, EPISODE_TOPIC, IMAGE_TOPIC, INSTRUCTION_TOPIC, JOINT_TOPIC,
                                      EpisodeRecorder)
from robo_post.fleet.robot import DEFAULT_ROBOT, RobotDescription
from robo_post.store import Store, StoreError, StoreNotFoundError

# The bridge's topics and the types it subscribes them with. These message definitions are
# the same in every ROS 2 distribution; the typestore is that of the `ros` extra's (Kilted).
MSG_TYPES = {JOINT_TOPIC: "sensor_msgs/msg/JointState", IMAGE_TOPIC: "sensor_msgs/msg/Image",
             ACTION_TOPIC: "sensor_msgs/msg/JointState", INSTRUCTION_TOPIC: "std_msgs/msg/String",
             EPISODE_TOPIC: "std_msgs/msg/String"}
TYPESTORE = get_typestore(Stores.ROS2_KILTED)
LOG = logging.getLogger(__name__)


class RosbagError(StoreError, ValueError):
    """A rosbag2 recording that cannot be imported; the message names the bag and why."""


class BagNotFoundError(RosbagError, FileNotFoundError):
    """No file or folder at the bag's path."""


class BagReadError(RosbagError):
    """The bag cannot be read whole: not a rosbag2 recording, truncated, or corrupted."""


class BagTopicError(RosbagError):
    """The bag lacks a topic the robot's episodes need, under the namespace given."""


@dataclass
class BagImportConfig:
    """``robo-post store import-rosbag BAG STORE key=value ...``: record a rosbag2 recording
    of a robot into a store shard, as the ROS 2 bridge would have recorded it live.

    Attributes:
        robot: robot description (a name in ``configs/robots/`` or a file path), as the bridge's.
        client_id: shard to write.
        namespace: namespace of the robot's topics in the bag.
        timeout: seconds (of the robot's clock, or of the bag's receive timestamps when nothing
            at all was received) after which an open episode is discarded, as the bridge's.
        max_steps: episode limit (0: the description's ``max_steps``); longer episodes are
            discarded as ``too_long``.
    """

    robot: str = DEFAULT_ROBOT
    client_id: str = "rosbag"
    namespace: str = "/robot"
    timeout: float = 5.0
    max_steps: int = 0

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout}: seconds an open episode may stay silent, must be > 0")
        if self.max_steps < 0:
            raise ValueError(f"max_steps={self.max_steps} must be >= 0 (0: the description's)")


@dataclass
class BagImport:
    """What an import did: episodes committed (and their steps), episodes discarded and
    messages dropped as malformed (each by kind, as the bridge counts them), messages read,
    and the discards as the bridge logs them (``discarded 1 episode: malformed=1``)."""

    committed: int
    steps: int
    discarded: dict[str, int]
    malformed: dict[str, int]
    messages: int
    discard_summary: str


def import_rosbag(bag: str, store: str, cfg: BagImportConfig) -> BagImport:
    """Record the robot's episodes in the rosbag2 recording ``bag`` (a bag folder, or one
    ``.mcap`` or ``.db3`` file) into the shard ``cfg.client_id`` of ``store`` (created with
    the robot's schema if missing; an existing store must match the robot).

    Raises:
        BagNotFoundError, BagReadError, BagTopicError: before anything is written.
        RobotDescriptionError: a bad description, or a store of another robot or layout.
    """
    robot = RobotDescription.load(cfg.robot)
    namespace = "/" + cfg.namespace.strip("/")
    with _open(bag) as reader:
        connections = _connections(reader, bag, namespace, robot)
        count = sum(1 for _ in _messages(reader, bag, connections))  # all or nothing: the whole bag reads
        try:
            target = Store.open(store)
        except StoreNotFoundError:
            target = Store.create(store, robot.schema(), exist_ok=True)
        robot.check_store(target.schema, f"the store {target.root}")
        with target.writer(cfg.client_id) as writer:
            steps_before = writer.n_steps
            recorder = EpisodeRecorder(
                robot, writer, max_steps=cfg.max_steps or robot.max_steps,
                depth=0,  # no queues and no sequence numbers in a bag: nothing is ever counted lost
                attrs={"source": "rosbag2", "namespace": namespace, "bag": os.path.abspath(bag)},
                log=LOG, now=reader.start_time / 1e9)
            for topic, timestamp, msg in _messages(reader, bag, connections):
                now = timestamp / 1e9
                recorder.expire(now, cfg.timeout)  # the bridge's periodic check, at each arrival
                if topic == EPISODE_TOPIC:
                    recorder.on_event(msg.data, {}, now)
                elif topic == INSTRUCTION_TOPIC:
                    recorder.on_instruction(msg.data)
                else:
                    recorder.on_data(topic, msg, {}, now)
            recorder.shutdown()
            steps = writer.n_steps - steps_before
    return BagImport(recorder.committed, steps, dict(recorder.discarded), dict(recorder.malformed), count,
                     recorder.discard_summary())


@contextmanager
def _open(bag: str) -> Iterator[Reader]:
    """``Reader(bag)``, open, with rosbags' errors as ours."""
    if not os.path.exists(bag):
        raise BagNotFoundError(f"no rosbag2 recording at {bag}")
    try:
        reader = Reader(bag)
        reader.open()
    except Exception as e:  # see _messages
        raise BagReadError(f"{bag} cannot be read as a rosbag2 recording: {_one_line(e)}") from None
    try:
        yield reader
    finally:
        reader.close()


def _connections(reader: Reader, bag: str, namespace: str, robot: RobotDescription) -> dict[int, str]:
    """The bag's connections of the robot's topics with the bridge's types: connection id -> topic
    (relative). Connections of another type are left out, as DDS keeps them from the bridge."""
    wanted = {INSTRUCTION_TOPIC, EPISODE_TOPIC, JOINT_TOPIC, ACTION_TOPIC} | ({IMAGE_TOPIC} if robot.camera else set())
    full = {f"{namespace.rstrip('/')}/{topic}": topic for topic in wanted}
    out: dict[int, str] = {}
    for conn in reader.connections:
        topic = full.get(conn.topic)
        if topic is None:
            continue
        if conn.msgtype == MSG_TYPES[topic]:
            out[conn.id] = topic
        else:
            LOG.warning(f"{bag}: {conn.topic} is {conn.msgtype} there; the bridge reads {MSG_TYPES[topic]}: left out")
    # The instruction is optional (start events carry it); without any other, no episode can commit.
    missing = sorted(f for f, topic in full.items() if topic != INSTRUCTION_TOPIC and topic not in out.values())
    if missing:
        have = sorted({f"{c.topic} ({c.msgtype})" for c in reader.connections})
        raise BagTopicError(f"{bag} has no {', '.join(f'{m} ({MSG_TYPES[full[m]]})' for m in missing)} for robot "
                            f"{robot.name!r} under namespace {namespace}; it has {', '.join(have[:12]) or 'no topics'}"
                            + (f" and {len(have) - 12} more" if len(have) > 12 else ""))
    return out


def _messages(reader: Reader, bag: str, connections: dict[int, str]) -> Iterator[tuple[str, int, Any]]:
    """(topic, receive timestamp ns, decoded message) of ``connections``, in recorded order."""
    chosen: list[Connection] = [c for c in reader.connections if c.id in connections]
    try:
        for conn, timestamp, raw in reader.messages(connections=chosen):
            # rosbags decodes float64[] and uint8[] as numpy arrays where rclpy gives array.array:
            # the description's parsers read both to the same values (np.asarray, np.frombuffer).
            yield connections[conn.id], timestamp, TYPESTORE.deserialize_cdr(raw, conn.msgtype)
    # rosbags reports damage as ReaderError, SerdeError, apsw's sqlite errors, struct.error, zstd
    # or lz4 errors, ...: whatever fails while reading this bag is the bag's.
    except Exception as e:
        raise BagReadError(f"{bag} is damaged (truncated or corrupted): {_one_line(e)}") from None


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
