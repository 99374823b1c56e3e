"""ROS 2 bridge: record a robot's episodes from standard topics into a store shard and
serve the registry's policy back to it; plus a simulated robot that speaks the same topics.

What is recorded comes from a robot description (``robot=NAME|PATH.yaml``;
``RobotDescription``): joint names and order, which JointState fields are recorded,
action names and bounds, camera size and encoding (or no camera), task vocabulary, the
episode limit ``max_steps``, and the simulator ``ros2-sim`` runs for it. The store
schema is derived from it and keeps the robot's name and layout (joint, field, action and
task names in order): a store recorded from another robot, or with another layout, is
refused. ``configs/robots/tabletop.yaml`` is the default.

Topics, relative to the node namespace (default ``/robot``); all reliable, volatile,
keep-last ``burst_episodes * (max_steps + 1)`` (see Bursts):

==================  =======================  ================  ==========================================
topic               type                     direction         content
==================  =======================  ================  ==========================================
``joint_states``    sensor_msgs/JointState   robot -> bridge   the described joints (any order, by name;
                                                               other joints it names are ignored); the
                                                               described fields (position, velocity,
                                                               effort) are recorded
``camera/image``    sensor_msgs/Image        robot -> bridge   camera frame in the described size and
                                                               encoding (absent without a camera)
``instruction``     std_msgs/String          robot -> bridge   the episode's language instruction (the
                                                               bridge prefers the start event's copy,
                                                               which cannot race the episode)
``action``          sensor_msgs/JointState   either way        the action taken in the obs with the same
                                                               stamp, as ``position`` by action name;
                                                               JointState because it has a header
``episode``         std_msgs/String          robot -> bridge   JSON episode events, below
``bridge/status``   std_msgs/String          bridge -> robot   JSON heartbeat every 0.25 s: counters and
                                                               ``matched`` (topic -> robots the bridge
                                                               itself is matched with)
==================  =======================  ================  ==========================================

A robot starts only once a heartbeat shows the bridge matched on all its topics: DDS
matches the two ends of a topic separately, and a sample sent before the receiving end
has matched is lost for good on a volatile topic.

Per episode the robot publishes the instruction, then the event
``{"event": "start", "episode", "seed", "task", "instruction", "stamp"}``, then for
t = 0..T one JointState (and one Image) sharing the header stamp s_t (strictly
increasing), and for t < T the action executed at s_t, stamped s_t: its own when it acts
locally, otherwise the one the bridge served. Last comes ``{"event": "end", "episode",
"seed", "task", "length": T, "rewards": [T floats], "success", "terminated",
"truncated", "aborted", "stamp": s_T, "final"}``; ``final`` marks the robot's last episode.

Alignment: every message, valid or not, is attributed by its stamp (whatever order
topics arrive in; events may overtake data, so several episodes can be open at once): an
episode owns the stamps in [start.stamp, end.stamp]. An episode commits once it holds
T + 1 observations and T actions. A malformed message (a described joint missing, action
names other than the described ones, field lengths that differ from the names, NaN/inf, an
action out of bounds, wrong image encoding or size, an unset (zero) stamp, a stamp not
after the previous message's on its topic or one that topic already delivered, a bad
event, an ``end`` without a ``start``) is counted by kind in ``malformed``, logged and
dropped, and the episode that owns its stamp (if any) is discarded at its end (a stamp far
ahead, from a node on another clock, thus costs its own episode and the next message's,
never the later ones); a bad end event (even one without a stamp) discards its own
episode; ``success``, ``terminated`` and ``truncated`` (and ``aborted``, ``final`` if
given) must be JSON booleans, ``rewards`` finite JSON numbers (not strings or booleans),
and ``episode``, ``seed``, ``length`` and ``stamp`` JSON integers: ``stamp`` is the header
stamp in integer nanoseconds, which a JSON float cannot hold exactly (beyond 2**53 ns,
i.e. any wall-clock stamp), so a float stamp is refused rather than rounded onto a
neighbouring message's. An
episode is discarded as ``timeout`` once every data topic has delivered stamps ``timeout``
seconds (of the robot's clock) past its newest message, or when the bridge receives nothing
at all for ``timeout`` seconds; an episode whose messages still queue behind the bridge's own
backlog is never timed out. One still awaiting
its end when a start of the same index comes (the robot restarted) is discarded as
``abandoned``; one awaiting its end whose start is after a newer start event and after every
stamp received (a start stamped far ahead) is discarded as ``malformed`` at that start. A start
or end event received twice is recorded once (a second end unlike the first discards its
episode); a refused start counts its episode in ``discarded`` (``malformed``), so committed +
discarded is every episode started. A discarded episode never touches the store, nor any other episode. A
robot that restarts with its clock behind (sim time reset) is recognised by its new
publisher's first start event: the bridge forgets the stamps seen so far.

Bursts: a robot may publish up to ``burst_episodes`` whole episodes of up to
``max_steps`` steps back to back, as fast as it can, without anything being dropped:
both ends keep that many messages per topic (the sim sizes its queues the same way).
Beyond it DDS drops the oldest queued messages; the bridge sees the gap in each
publisher's sequence numbers, counts the messages in ``lost`` (topic -> count) and
discards every episode whose stamps the gap spans as ``overflow`` (a publisher's
first message numbered n > 1 counts as n - 1 lost since the last closed episode). An episode longer
than ``max_steps`` is discarded as ``too_long``. Neither is ever reported as ``timeout``.

Liveness: the status file ``STORE/fleet/<client_id>.json`` carries ``pid``, ``host``
and a ``heartbeat`` time refreshed every second; ``read_bridge_status`` (and
``robo-post fleet ros2-status store=PATH``) reports ``dead`` for a bridge whose status
says running but whose process is gone or whose heartbeat is older than ``stale_s``.

Environment: importing this module defaults ``RMW_IMPLEMENTATION=rmw_fastrtps_cpp`` (the
middleware the ``ros`` extra installs) and ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``
(discovery stays on loopback). Export ``ROS_AUTOMATIC_DISCOVERY_RANGE=SUBNET`` to reach
a robot on the network. The domain comes from ``domain_id=`` (default ``$ROS_DOMAIN_ID``).
"""

from __future__ import annotations

import os

# Must precede the first rclpy call that loads the middleware.
os.environ.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

import importlib.resources
import json
import math
import signal
import socket
import sys
import threading
import time
import typing
from collections import Counter
from dataclasses import MISSING, dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import rclpy
import yaml
from builtin_interfaces.msg import Time
from gymnasium import spaces
from rclpy.context import Context
from rclpy.duration import Duration
from rclpy.exceptions import InvalidNamespaceException
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from rclpy.validate_namespace import validate_namespace
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from robo_post.fleet.client import episode_seed, make_env
from robo_post.fleet.policies import Policy, build_policy
from robo_post.store import (EpisodeValidationError, PolicyRegistry, ShardLockedError, Store, StoreNotFoundError,
                             StoreSchema)
from robo_post.store.writer import try_lock, write_json_atomic

JOINT_TOPIC, IMAGE_TOPIC, INSTRUCTION_TOPIC, ACTION_TOPIC, EPISODE_TOPIC, STATUS_TOPIC = (
    "joint_states", "camera/image", "instruction", "action", "episode", "bridge/status",
)
HEARTBEAT_S = 0.25  # bridge status topic period
STATUS_FILE_S = 1.0  # status file refresh period (its heartbeat)
STALE_S = 10.0  # a running bridge whose status file heartbeat is older than this is dead
STATUS_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.VOLATILE,
)
SIM_SHARD = "ros2-sim"  # name mixed into the sim's episode seeds
DEFAULT_ROBOT = "tabletop"  # description shipped in configs/robots/
JOINT_FIELDS = ("position", "velocity", "effort")
END_FLAGS = ("success", "terminated", "truncated", "aborted", "final")  # booleans of an end event
REQUIRED_END_FLAGS = ("success", "terminated", "truncated")  # the rest default to false
IMAGE_CHANNELS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}


def topic_qos(depth: int) -> QoSProfile:
    """Reliable, volatile, keep-last ``depth``: the QoS of every robot topic."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST, depth=depth, reliability=ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.VOLATILE,
    )


def stamp_ns(header: Any) -> int:
    """A header's stamp as integer nanoseconds (the bridge's alignment key)."""
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


def _stamp_msg(ns: int) -> Time:
    sec, nanosec = divmod(ns, 1_000_000_000)
    return Time(sec=sec, nanosec=nanosec)


def joint_msg(ns: int, names: typing.Sequence[str], values: np.ndarray, **fields: np.ndarray) -> JointState:
    """A JointState carrying ``values`` as ``position`` (and ``fields``, e.g. ``velocity``), stamped ``ns``."""
    msg = JointState(name=list(names), position=np.asarray(values, dtype=np.float64).tolist())
    for name, array in fields.items():
        setattr(msg, name, np.asarray(array, dtype=np.float64).tolist())
    msg.header.stamp = _stamp_msg(ns)
    return msg


def image_msg(ns: int, image: np.ndarray, encoding: str = "rgb8") -> Image:
    """An Image from an (H, W) or (H, W, C) uint8 array, stamped ``ns``."""
    h, w = image.shape[:2]
    c = image.shape[2] if image.ndim == 3 else 1
    msg = Image(height=h, width=w, encoding=encoding, is_bigendian=0, step=w * c)
    msg.header.stamp = _stamp_msg(ns)
    msg.header.frame_id = "camera"
    msg.data = np.ascontiguousarray(image, dtype=np.uint8).tobytes()
    return msg


# --- robot description ------------------------------------------------------------------
class RobotDescriptionError(ValueError):
    """A robot description file is invalid, or does not match a store or a simulator."""


class MalformedMessage(ValueError):
    """A message that does not fit the robot description; ``kind`` names the check."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


@dataclass(frozen=True)
class CameraSpec:
    """The camera: observation ``key``, image size and ROS ``encoding``."""

    key: str
    height: int
    width: int
    encoding: str

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, IMAGE_CHANNELS[self.encoding])


@dataclass(frozen=True)
class RobotDescription:
    """What a robot publishes and what of it is recorded (a YAML/JSON file, see
    ``configs/robots/tabletop.yaml``).

    Attributes:
        name: robot name (the store schema's ``robot`` attr).
        max_steps: longest episode in steps; sizes the topic queues (see Bursts).
        joint_key: observation key of the recorded joint vector.
        joint_fields: JointState fields recorded, concatenated in this order, each with
            one value per joint in ``joints`` order.
        joints: joint names in recorded order (required: the store's columns are fixed by
            them). A JointState may name other joints too; they are not recorded.
        camera: the camera, or None.
        action_names: JointState names of the action dims, in order.
        action_low, action_high: action bounds per dim.
        task_key: observation key of the task index.
        tasks: task vocabulary.
        env: simulator of the robot for ``ros2-sim`` (env registry ``name`` + kwargs; the
            schema's ``env`` attr), or None: the sim drives ``KinematicRobotEnv``.
    """

    name: str
    max_steps: int
    joint_key: str
    joint_fields: tuple[str, ...]
    joints: tuple[str, ...]
    camera: CameraSpec | None
    action_names: tuple[str, ...]
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    task_key: str
    tasks: tuple[str, ...]
    env: dict[str, Any] | None = None

    @classmethod
    def load(cls, robot: str) -> "RobotDescription":
        """Load ``robot``: a file path, or the name of a description in ``configs/robots/``.

        Raises:
            RobotDescriptionError: missing file, or an invalid description (naming the field).
        """
        path = robot_path(robot)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise RobotDescriptionError(f"cannot read robot description {str(path)!r}: {e}") from None
        except yaml.YAMLError as e:
            raise RobotDescriptionError(f"robot description {str(path)!r} is not YAML/JSON: {e}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "RobotDescription":
        """Build and check a description from its parsed file contents."""

        def need(d: Any, key: str, where: str) -> Any:
            if not isinstance(d, dict) or key not in d:
                raise RobotDescriptionError(f"{source}: missing {where}{key}")
            return d[key]

        def names(values: Any, where: str) -> tuple[str, ...]:
            if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
                raise RobotDescriptionError(f"{source}: {where} must be a non-empty list of names")
            if len(set(values)) != len(values):
                raise RobotDescriptionError(f"{source}: {where} repeats a name: {values}")
            return tuple(values)

        try:
            joints, action, tasks = need(data, "joints", ""), need(data, "action", ""), need(data, "tasks", "")
            fields = names(need(joints, "fields", "joints."), "joints.fields")
            if not set(fields) <= set(JOINT_FIELDS):
                raise RobotDescriptionError(f"{source}: joints.fields {list(fields)} not all in {list(JOINT_FIELDS)}")
            action_names = names(need(action, "names", "action."), "action.names")
            low = tuple(float(v) for v in need(action, "low", "action."))
            high = tuple(float(v) for v in need(action, "high", "action."))
            if not (len(low) == len(high) == len(action_names)) or not all(lo < hi for lo, hi in zip(low, high)):
                raise RobotDescriptionError(
                    f"{source}: action.low {list(low)} and action.high {list(high)} must give "
                    f"{len(action_names)} bounds (one per action name) with low < high"
                )
            camera_data = data.get("camera")
            camera = None
            if camera_data is not None:
                camera = CameraSpec(
                    str(need(camera_data, "key", "camera.")), int(need(camera_data, "height", "camera.")),
                    int(need(camera_data, "width", "camera.")), str(need(camera_data, "encoding", "camera.")),
                )
                if camera.encoding not in IMAGE_CHANNELS or camera.height < 1 or camera.width < 1:
                    raise RobotDescriptionError(
                        f"{source}: camera {camera_data} needs a positive size and an encoding in {list(IMAGE_CHANNELS)}"
                    )
            desc = cls(
                name=str(need(data, "name", "")), max_steps=int(need(data, "max_steps", "")),
                joint_key=str(need(joints, "key", "joints.")), joint_fields=fields,
                joints=names(need(joints, "names", "joints."), "joints.names"), camera=camera,
                action_names=action_names, action_low=low, action_high=high,
                task_key=str(need(tasks, "key", "tasks.")), tasks=names(need(tasks, "names", "tasks."), "tasks.names"),
                env=dict(data["env"]) if data.get("env") is not None else None,
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, RobotDescriptionError):
                raise
            raise RobotDescriptionError(f"{source}: {e}") from None
        keys = [desc.joint_key, desc.task_key] + ([camera.key] if camera else [])
        if len(set(keys)) != len(keys):
            raise RobotDescriptionError(f"{source}: observation keys {keys} must differ")
        if desc.max_steps < 1:
            raise RobotDescriptionError(f"{source}: max_steps must be positive, got {desc.max_steps}")
        if desc.env is not None and "name" not in desc.env:
            raise RobotDescriptionError(f"{source}: env needs a registry name, got {desc.env}")
        return desc

    @property
    def joint_dim(self) -> int:
        return len(self.joints) * len(self.joint_fields)

    def observation_space(self) -> spaces.Dict:
        """The recorded observation: joint vector, task index, camera image (if any)."""
        obs: dict[str, spaces.Space] = {
            self.joint_key: spaces.Box(-np.inf, np.inf, (self.joint_dim,), np.float32),
            self.task_key: spaces.Discrete(len(self.tasks)),
        }
        if self.camera is not None:
            obs[self.camera.key] = spaces.Box(0, 255, self.camera.shape, np.uint8)
        return spaces.Dict(obs)

    def action_space(self) -> spaces.Box:
        return spaces.Box(np.array(self.action_low, np.float32), np.array(self.action_high, np.float32),
                          dtype=np.float32)

    def layout(self) -> dict[str, list[str]]:
        """What each recorded element means: shapes alone cannot tell two joint orders or
        two task vocabularies apart, so a store keeps this in its schema ``attrs``."""
        return {"joints": list(self.joints), "joint_fields": list(self.joint_fields),
                "actions": list(self.action_names), "tasks": list(self.tasks)}

    def schema(self) -> StoreSchema:
        """The store schema of this robot's episodes."""
        attrs = {"robot": self.name, "layout": self.layout()}
        if self.env is not None:
            attrs["env"] = self.env["name"]
        return StoreSchema.from_spaces(self.observation_space(), self.action_space(), **attrs)

    def check_store(self, schema: StoreSchema, what: str) -> None:
        """``check_schema``, then refuse a store recorded from another robot (by name) or with
        another layout (joint, field, action or task order), which would mix meanings in one
        column. A store without a robot (e.g. collected from the simulator) only needs matching shapes."""
        self.check_schema(schema, what)
        name, layout = schema.attrs.get("robot"), schema.attrs.get("layout")
        if name is not None and name != self.name:
            raise RobotDescriptionError(f"robot {self.name!r}: {what} was recorded from robot {name!r}")
        if layout is not None and layout != self.layout():  # stores made before layouts were kept have none
            diff = {k: {"store": layout.get(k), "robot": v} for k, v in self.layout().items() if layout.get(k) != v}
            raise RobotDescriptionError(f"robot {self.name!r}: {what} was recorded with another layout: {diff}")

    def check_spaces(self, observation_space: spaces.Dict, action_space: spaces.Space, what: str) -> None:
        """Raise ``RobotDescriptionError`` if an env's spaces differ from this description's."""
        self.check_schema(StoreSchema.from_spaces(observation_space, action_space), what)

    def check_schema(self, schema: StoreSchema, what: str) -> None:
        """Raise ``RobotDescriptionError`` naming the first observation key (or the action)
        whose dtype, shape or bounds differ between ``schema`` and this description's."""
        ours = self.schema()
        for key, spec in ours.observations.items():
            other = schema.observations.get(key)
            if other is None or (other.dtype, other.shape) != (spec.dtype, spec.shape):
                raise RobotDescriptionError(
                    f"robot {self.name!r}: observation {key!r} is {spec.dtype}{spec.shape}, but {what} has "
                    f"{'none' if other is None else f'{other.dtype}{other.shape}'} (keys {sorted(schema.observations)})"
                )
        act, other = ours.action, schema.action
        if (other.dtype, other.shape, other.low, other.high) != (act.dtype, act.shape, act.low, act.high):
            raise RobotDescriptionError(
                f"robot {self.name!r}: action {act.dtype}{act.shape} in [{act.low}, {act.high}], but {what} "
                f"has {other.dtype}{other.shape} in [{other.low}, {other.high}]"
            )

    def parse_joints(self, msg: JointState) -> np.ndarray:
        """The recorded joint vector of a JointState (reordered by name), as float32.

        Joints the description does not name are ignored (a robot's joint_states often
        also carries e.g. gripper fingers or wheels that are not recorded).

        Raises:
            MalformedMessage: ``joint_length`` (a field's length differs from the names'),
                ``joint_names`` (a described joint missing or repeated), ``nan``.
        """
        return _by_name(msg, self.joints, self.joint_fields, "joint", extra_ok=True)

    def parse_action(self, msg: JointState) -> np.ndarray:
        """The action of a JointState (positions reordered by action name), as float32.

        Raises:
            MalformedMessage: ``action_length``, ``action_names``, ``nan``, ``action_bounds``.
        """
        # Strict, unlike joints: an action dim the robot executed but we did not record
        # would leave a stored action that cannot reproduce what the robot did.
        action = _by_name(msg, self.action_names, ("position",), "action", extra_ok=False)
        low, high = np.float32(self.action_low), np.float32(self.action_high)
        if (action < low).any() or (action > high).any():
            raise MalformedMessage("action_bounds", f"action {action.tolist()} outside [{low.tolist()}, {high.tolist()}]")
        return action

    def parse_image(self, msg: Image) -> np.ndarray:
        """The camera image of an Image message.

        Raises:
            MalformedMessage: ``image_encoding``, ``image_size``.
        """
        assert self.camera is not None
        h, w, c = self.camera.shape
        if msg.encoding != self.camera.encoding:
            raise MalformedMessage("image_encoding", f"encoding {msg.encoding!r}, expected {self.camera.encoding!r}")
        # ROS lets rows be padded (step > width * channels, e.g. aligned camera buffers).
        if (msg.height, msg.width) != (h, w) or msg.step < w * c or len(msg.data) != h * msg.step:
            raise MalformedMessage(
                "image_size", f"{msg.height}x{msg.width} (step {msg.step}, {len(msg.data)} bytes), expected {h}x{w}x{c}"
            )
        rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(h, msg.step)
        return rows[:, : w * c].reshape(h, w, c).copy()

    def joint_msg(self, ns: int, values: np.ndarray) -> JointState:
        """The JointState of a recorded joint vector (the inverse of ``parse_joints``);
        fields that are not recorded stay empty."""
        parts = dict(zip(self.joint_fields, np.split(np.asarray(values, dtype=np.float64), len(self.joint_fields))))
        return joint_msg(ns, self.joints, parts.pop("position", np.zeros(0)), **parts)

    def action_msg(self, ns: int, action: np.ndarray) -> JointState:
        """The JointState of an action (the inverse of ``parse_action``)."""
        return joint_msg(ns, self.action_names, action)


def _by_name(msg: JointState, names: tuple[str, ...], fields: tuple[str, ...], what: str,
             extra_ok: bool) -> np.ndarray:
    """``fields`` of the entries ``names`` of ``msg``, in that order; ``extra_ok``: ignore other names."""
    got = list(msg.name)
    for f in fields:
        n = len(getattr(msg, f))
        if n != len(got):
            raise MalformedMessage(
                f"{what}_length", f"{what} message has {len(got)} names but {n} {f} values (names {got[:40]})"
            )
    missing = [x for x in names if x not in got]
    unknown = [] if extra_ok else [x for x in got if x not in names]
    # A repeated name we record has no one value to record.
    dups = sorted({x for x in got if got.count(x) > 1 and (x in names or not extra_ok)})
    if missing or unknown or dups:
        problems = {"missing": missing, "unknown": unknown, "repeated": dups}
        raise MalformedMessage(
            f"{what}_names", f"{what} names do not match the description: "
            + ", ".join(f"{k} {v}" for k, v in problems.items() if v) + f" (names {got[:40]})"
        )
    order = [got.index(x) for x in names]
    values = np.concatenate([np.asarray(getattr(msg, f), dtype=np.float64)[order] for f in fields])
    out = values.astype(np.float32)
    if not np.isfinite(out).all():
        raise MalformedMessage("nan", f"{what} message holds NaN/inf (or values beyond float32)")
    return out


def robot_path(robot: str) -> Path:
    """The file of ``robot``: a path as given, or a bare name of a description shipped
    in ``configs/robots/`` (e.g. ``tabletop``)."""
    if os.sep in robot or robot.endswith((".yaml", ".yml", ".json")):
        return Path(robot)
    return Path(str(importlib.resources.files("robo_post.configs") / "robots" / f"{robot}.yaml"))


class KinematicRobotEnv(gym.Env):
    """The sim's stand-in for a robot whose description names no simulator: joints move
    by a fixed random linear response to the action (no physics, reward 0, never a
    success); the camera, if any, shows noise. It exercises the protocol, nothing more.
    """

    def __init__(self, robot: RobotDescription, task: str, max_steps: int):
        self.robot, self.task, self.max_steps = robot, task, max_steps
        self.observation_space = robot.observation_space()
        self.action_space = robot.action_space()
        self._gain = np.random.default_rng(len(robot.joints)).normal(
            size=(len(robot.joints), len(robot.action_names))) / np.sqrt(len(robot.action_names))

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        n = len(self.robot.joints)
        self._pos, self._vel, self._steps = self.np_random.uniform(-0.5, 0.5, n), np.zeros(n), 0
        return self._obs(np.zeros(n)), {"instruction": self.task, "success": False}

    def step(self, action: np.ndarray):
        effort = self._gain @ np.asarray(action, dtype=np.float64)
        self._vel = 0.8 * self._vel + 0.2 * effort
        self._pos = self._pos + 0.04 * self._vel
        self._steps += 1
        return self._obs(effort), 0.0, False, self._steps >= self.max_steps, {"instruction": self.task, "success": False}

    def _obs(self, effort: np.ndarray) -> dict[str, Any]:
        r = self.robot
        values = {"position": self._pos, "velocity": self._vel, "effort": effort}
        obs: dict[str, Any] = {
            r.joint_key: np.concatenate([values[f] for f in r.joint_fields]).astype(np.float32),
            r.task_key: np.int64(r.tasks.index(self.task)),
        }
        if r.camera is not None:
            obs[r.camera.key] = self.np_random.integers(0, 256, r.camera.shape, dtype=np.uint8)
        return obs


# --- configs ----------------------------------------------------------------------
@dataclass
class SimConfig:
    """``robo-post fleet ros2-sim key=value ...``: a simulated robot on ROS 2.

    Attributes:
        robot: robot description (a name in ``configs/robots/`` or a file path); the sim
            runs its ``env``, or ``KinematicRobotEnv`` if it names none.
        namespace: namespace of the robot's topics.
        domain_id: ROS domain id (None: ``$ROS_DOMAIN_ID``, else 0).
        task: task of every episode ("": the description's first task).
        episodes: episodes to run before exiting.
        seed: base seed; episode i runs with ``episode_seed(seed, "ros2-sim", i)``.
        act_locally: act with the local scripted ``policy`` (data collection) and publish
            the executed action; otherwise wait for the bridge's action every step.
        policy: local policy kind (``expert`` | ``random``).
        noise: action-noise std of the local expert.
        max_steps: truncation horizon (0: the env's default; the description's
            ``max_steps`` for the kinematic stand-in); also the episode limit its topic
            queues are sized for when larger than the description's.
        burst_episodes: whole episodes its topic queues hold (see Bursts).
        rate_hz: control rate (0: as fast as possible).
        action_timeout: seconds to wait for a served action before aborting the episode.
        discovery_timeout: seconds to wait for a bridge heartbeat showing every topic matched.
        subscribers: episode-topic subscribers (the bridge plus any monitors) to wait for.
        dump: if set, write everything published to this ``.npz`` (arrays + JSON metadata).
        faults: joint messages to corrupt, to exercise a bridge: ``EPISODE:STEP:KIND``
            items joined by ``+`` (STEP -1: the last; KIND ``nan``: NaN values, ``names``:
            the last joint name left out). The dump keeps the true values.
    """

    robot: str = DEFAULT_ROBOT
    namespace: str = "/robot"
    domain_id: int | None = None
    task: str = ""
    episodes: int = 3
    seed: int = 0
    act_locally: bool = True
    policy: str = "expert"
    noise: float = 0.0
    max_steps: int = 0
    burst_episodes: int = 2
    rate_hz: float = 25.0
    action_timeout: float = 5.0
    discovery_timeout: float = 60.0
    subscribers: int = 1
    dump: str = ""
    faults: str = ""


SIM_FAULTS = ("nan", "names")


def parse_faults(text: str) -> dict[tuple[int, int], str]:
    """``SimConfig.faults`` as {(episode, step): kind}."""
    out: dict[tuple[int, int], str] = {}
    for item in filter(None, text.split("+")):
        episode, step, kind = item.split(":") if item.count(":") == 2 else ("", "", "")
        if kind not in SIM_FAULTS or not episode.lstrip("-").isdigit() or not step.lstrip("-").isdigit():
            raise ValueError(f"fault {item!r}: expected EPISODE:STEP:KIND with KIND in {SIM_FAULTS}")
        out[int(episode), int(step)] = kind
    return out


@dataclass
class BridgeConfig:
    """``robo-post fleet ros2-bridge store=PATH key=value ...``: record a robot into a shard.

    Attributes:
        store: store root; created with the robot's schema if missing (an existing store
            must match the robot description).
        robot: robot description (a name in ``configs/robots/`` or a file path). Its
            ``joints.names`` are required and are what is recorded, selected by name from
            each JointState; other joints in it are ignored.
        client_id: shard this bridge writes (one writer per shard).
        namespace: namespace of the robot's topics.
        domain_id: ROS domain id (None: ``$ROS_DOMAIN_ID``, else 0).
        serve_policy: publish the policy's action for every observation.
        policy: artifact kind served while the registry is empty (version 0). Served
            policies see observations only (no simulator), so scripted experts cannot be served.
        follow_registry: load the newest registry version at every episode start.
        timeout: seconds of the robot's clock an open episode may receive nothing while the robot's
            data go on, or of wall time the bridge may receive nothing at all, before it is discarded.
        max_steps: episode limit (0: the description's ``max_steps``); longer episodes
            are discarded as ``too_long``.
        burst_episodes: whole episodes of ``max_steps`` steps a robot may publish back to
            back without loss; each topic queue holds ``burst_episodes * (max_steps + 1)``.
        exit_on_final: exit once the episode flagged ``final`` is committed or discarded.
    """

    store: str
    robot: str = DEFAULT_ROBOT
    client_id: str = "ros2-bridge"
    namespace: str = "/robot"
    domain_id: int | None = None
    serve_policy: bool = False
    policy: str = "random"
    follow_registry: bool = True
    timeout: float = 5.0
    max_steps: int = 0
    burst_episodes: int = 2
    exit_on_final: bool = False

    def __post_init__(self) -> None:
        # timeout <= 0 discarded every episode as it opened; the queue depth needs whole episodes
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout}: seconds an open episode may stay silent, must be > 0")
        if self.max_steps < 0:
            raise ValueError(f"max_steps={self.max_steps} must be >= 0 (0: the description's)")
        if self.burst_episodes < 1:
            raise ValueError(f"burst_episodes={self.burst_episodes}: whole episodes a topic queue holds, must be >= 1")


@dataclass
class StatusConfig:
    """``robo-post fleet ros2-status store=PATH key=value ...``: print the bridges' status
    (JSON, one line per bridge), ``dead`` for a bridge that is gone.

    Attributes:
        store: store root.
        client_id: one bridge ("": every bridge with a status file in the store).
        stale_s: a heartbeat older than this many seconds means dead.

    Exits 1 when a bridge shown is dead (so scripts can watch it), 0 otherwise.
    """

    store: str
    client_id: str = ""
    stale_s: float = STALE_S

    def __post_init__(self):
        if not self.stale_s > 0:
            raise ValueError(f"stale_s={self.stale_s}: a heartbeat age in seconds must be > 0")


def queue_depth(max_steps: int, burst_episodes: int) -> int:
    """Messages per topic queue: ``burst_episodes`` whole episodes of ``max_steps`` steps
    (T + 1 observations each, and one start and end event per episode)."""
    if max_steps < 1 or burst_episodes < 1:
        raise ValueError(f"max_steps and burst_episodes must be positive, got {max_steps}, {burst_episodes}")
    return burst_episodes * (max_steps + 1)


def parse_config(cls: type, argv: list[str]) -> Any:
    """Build a config dataclass from ``key=value`` strings, typed by its annotations."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not sep or key not in hints:
            raise ValueError(f"expected key=value with key in {sorted(hints)}, got {arg!r}")
        try:
            values[key] = _convert(text, hints[key])
        except ValueError as e:
            raise ValueError(f"{key}={text!r}: {e}") from None
    missing = [f.name for f in dataclass_fields(cls)
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:  # the dataclass would say "__init__() missing 1 required positional argument"
        raise ValueError(f"missing {', '.join(f'{k}=...' for k in missing)}")
    return cls(**values)


def _convert(text: str, tp: Any) -> Any:
    args = typing.get_args(tp)
    if args:  # `X | None`
        if text.lower() in ("null", "none", ""):
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in ("true", "1", "yes")
    return tp(text)


# --- simulated robot --------------------------------------------------------------
class SimRobotNode(Node):
    """A simulated robot behind ROS 2 topics (see the module docstring for the protocol).

    ``run()`` waits for a bridge, runs ``cfg.episodes`` episodes and keeps everything it
    published in ``self.records`` (one dict of arrays per observation key + metadata per episode).
    """

    def __init__(self, cfg: SimConfig, context: Context | None = None):
        # Whatever can refuse the config runs before the node exists: a node left half-built
        # is destroyed at context shutdown, and destroy_node() then fails on missing attributes.
        self.cfg = cfg
        self.robot = RobotDescription.load(cfg.robot)
        self.task = cfg.task or self.robot.tasks[0]
        if self.task not in self.robot.tasks:
            raise RobotDescriptionError(f"task {self.task!r} is not one of robot {self.robot.name!r}'s {self.robot.tasks}")
        if self.robot.env is not None:
            env_cfg = self.robot.env | ({"max_steps": cfg.max_steps} if cfg.max_steps else {})
            self.env = make_env(env_cfg, self.task)
        else:
            self.env = KinematicRobotEnv(self.robot, self.task, cfg.max_steps or self.robot.max_steps)
        try:
            env = self.env
            self.robot.check_spaces(env.observation_space, env.action_space, f"the sim's env {self.robot.env}")
            # Refused here, or it fails only once a bridge has matched.
            if cfg.act_locally and cfg.policy == "expert" and self.robot.env is None:
                raise RobotDescriptionError(f"robot {self.robot.name!r} names no simulator env, and its kinematic "
                                            "stand-in has no expert: use policy=random")
            self.policy: Policy | None = (
                build_policy({}, {"kind": cfg.policy, "noise": cfg.noise}) if cfg.act_locally else None
            )
        except Exception:
            self.env.close()
            raise
        super().__init__("sim_robot", namespace=cfg.namespace, context=context)
        qos = topic_qos(queue_depth(max(cfg.max_steps, self.robot.max_steps), cfg.burst_episodes))
        self.pubs = {
            JOINT_TOPIC: self.create_publisher(JointState, JOINT_TOPIC, qos),
            INSTRUCTION_TOPIC: self.create_publisher(String, INSTRUCTION_TOPIC, qos),
            EPISODE_TOPIC: self.create_publisher(String, EPISODE_TOPIC, qos),
        }
        if self.robot.camera is not None:
            self.pubs[IMAGE_TOPIC] = self.create_publisher(Image, IMAGE_TOPIC, qos)
        self._served: dict[int, np.ndarray] = {}
        self._heartbeat: dict[str, Any] = {}
        self.create_subscription(String, STATUS_TOPIC, self._on_heartbeat, STATUS_QOS)
        self._action_sub = None
        if cfg.act_locally:
            self.pubs[ACTION_TOPIC] = self.create_publisher(JointState, ACTION_TOPIC, qos)
        else:
            self._action_sub = self.create_subscription(JointState, ACTION_TOPIC, self._on_action, qos)
        self._executor = SingleThreadedExecutor(context=context)
        self._executor.add_node(self)
        self._last_stamp = 0
        self._faults = parse_faults(cfg.faults)
        self.records: list[dict[str, Any]] = []

    def _on_action(self, msg: JointState) -> None:
        try:
            self._served[stamp_ns(msg.header)] = self.robot.parse_action(msg)
        except MalformedMessage as e:
            self.get_logger().warning(f"ignoring malformed action: {e}")

    def _on_heartbeat(self, msg: String) -> None:
        self._heartbeat = json.loads(msg.data)

    def _stamp(self) -> int:
        # Strictly increasing even if the clock stalls or steps back.
        self._last_stamp = max(self.get_clock().now().nanoseconds, self._last_stamp + 1)
        return self._last_stamp

    def wait_for_bridge(self) -> None:
        """Block until both ends of every topic are matched (the bridge's end as its heartbeat
        reports it); raise ``TimeoutError`` otherwise."""
        t0 = time.monotonic()
        topics = set(self.pubs) | {ACTION_TOPIC}

        def matched() -> bool:
            bridge = self._heartbeat.get("matched", {})
            return (
                all(bridge.get(topic, 0) > 0 for topic in topics)
                and all(p.get_subscription_count() > 0 for p in self.pubs.values())
                and self.pubs[EPISODE_TOPIC].get_subscription_count() >= self.cfg.subscribers
                and (self._action_sub is None or self._action_sub.get_publisher_count() > 0)
            )

        while not matched():
            if time.monotonic() - t0 > self.cfg.discovery_timeout:
                raise TimeoutError(
                    f"no bridge matched on {self.get_namespace()} within {self.cfg.discovery_timeout} s "
                    f"(last heartbeat: {self._heartbeat.get('matched')})"
                )
            self._executor.spin_once(timeout_sec=0.05)
        self.get_logger().info(f"bridge matched after {time.monotonic() - t0:.1f} s")

    def _event(self, payload: dict[str, Any]) -> None:
        self.pubs[EPISODE_TOPIC].publish(String(data=json.dumps(payload)))

    def _publish_obs(self, obs: dict[str, Any], ns: int, fault: str | None = None) -> None:
        msg = self.robot.joint_msg(ns, obs[self.robot.joint_key])
        if fault == "nan":
            msg.position = [float("nan")] * len(msg.position)
        elif fault == "names":
            msg.name = msg.name[:-1]
        self.pubs[JOINT_TOPIC].publish(msg)
        if self.robot.camera is not None:
            self.pubs[IMAGE_TOPIC].publish(image_msg(ns, obs[self.robot.camera.key], self.robot.camera.encoding))

    def _act(self, obs: dict[str, Any], ns: int) -> np.ndarray | None:
        """The action to execute at stamp ``ns``, or None if the bridge never sent one."""
        if self.policy is not None:
            space = self.env.action_space
            action = np.clip(np.asarray(self.policy.act(obs, self.env), dtype=np.float32), space.low, space.high)
            self.pubs[ACTION_TOPIC].publish(self.robot.action_msg(ns, action))
            return action
        deadline = time.monotonic() + self.cfg.action_timeout
        while ns not in self._served and time.monotonic() < deadline:
            self._executor.spin_once(timeout_sec=0.05)
        action = self._served.pop(ns, None)
        self._served.clear()  # anything else is stale
        return action

    def run_episode(self, index: int, final: bool) -> dict[str, Any]:
        """Run and publish one episode; return what was published."""
        seed = episode_seed(self.cfg.seed, SIM_SHARD, index)
        obs, info = self.env.reset(seed=seed)
        if self.policy is not None:
            self.policy.reset(self.env, seed)
        keys = [self.robot.joint_key] + ([self.robot.camera.key] if self.robot.camera is not None else [])
        stamps = [self._stamp()]
        rec: dict[str, list] = {k: [obs[k]] for k in keys} | {"action": [], "reward": []}
        instruction = str(info.get("instruction", self.task))
        meta = {"episode": index, "seed": seed, "task": self.task, "instruction": instruction}
        self.pubs[INSTRUCTION_TOPIC].publish(String(data=instruction))
        self._event({"event": "start", **meta, "stamp": stamps[0]})
        terminated = truncated = aborted = False
        period = 1.0 / self.cfg.rate_hz if self.cfg.rate_hz > 0 else 0.0
        next_tick = time.monotonic()
        while True:
            t, last = len(stamps) - 1, terminated or truncated
            self._publish_obs(obs, stamps[-1], self._faults.get((index, -1 if last else t), self._faults.get((index, t))))
            if last:
                break
            action = self._act(obs, stamps[-1])
            if action is None:
                self.get_logger().warning(f"episode {index}: no action within {self.cfg.action_timeout} s, aborting")
                aborted = True
                break
            obs, reward, terminated, truncated, info = self.env.step(action)
            rec["action"].append(action)
            rec["reward"].append(reward)
            for k in keys:
                rec[k].append(obs[k])
            next_tick += period
            time.sleep(max(next_tick - time.monotonic(), 0.0))
            stamps.append(self._stamp())
        end = {
            **meta, "length": len(rec["action"]), "rewards": [float(r) for r in rec["reward"]],
            "success": bool(info.get("success", False)), "terminated": bool(terminated),
            "truncated": bool(truncated), "aborted": aborted, "stamp": stamps[-1], "final": final,
        }
        self._event({"event": "end", **end})
        record = {k: np.asarray(v) for k, v in rec.items()}
        record["stamp"] = np.asarray(stamps, dtype=np.int64)
        record["meta"] = end
        self.records.append(record)
        return record

    def run(self) -> list[dict[str, Any]]:
        """Wait for a bridge, run every episode, and wait until the bridge has received it all."""
        self.wait_for_bridge()
        for i in range(self.cfg.episodes):
            self.run_episode(i, final=i == self.cfg.episodes - 1)
        for pub in self.pubs.values():
            pub.wait_for_all_acked(Duration(seconds=self.cfg.discovery_timeout))
        if self.cfg.dump:
            self.dump(self.cfg.dump)
        return self.records

    def dump(self, path: str) -> None:
        """Write ``self.records`` as ``ep{i}_{KEY}`` arrays (each observation key, ``action``,
        ``reward``, ``stamp``) plus a ``meta`` JSON string (a list of end events)."""
        arrays = {f"ep{i}_{k}": v for i, r in enumerate(self.records) for k, v in r.items() if k != "meta"}
        arrays["meta"] = np.array(json.dumps([r["meta"] for r in self.records]))
        tmp = f"{path}.tmp.npz"
        np.savez(tmp, **arrays)
        os.replace(tmp, path)

    def destroy_node(self) -> None:
        self.env.close()
        self._executor.shutdown()
        super().destroy_node()


# --- bridge -------------------------------------------------------------------------
@dataclass
class RemoteRobot:
    """What a served policy sees in place of an env: the action space and the episode's
    instruction. There is no simulator state behind it."""

    action_space: spaces.Box
    instruction: str = ""
    task: str = ""

    @property
    def unwrapped(self) -> "RemoteRobot":
        return self


@dataclass
class _Episode:
    """An episode announced by a start event, open until committed or discarded."""

    index: int
    seed: int
    task: str
    task_index: int
    instruction: str
    start: int
    policy_version: int
    last_stamp: int  # newest data stamp that belonged to it
    end: dict[str, Any] | None = None
    policy_error: bool = False  # the served policy failed during it

    def owns(self, ns: int) -> bool:
        return self.start <= ns and (self.end is None or ns <= self.end["stamp"])


@dataclass
class _Fault:
    """Stamps [lo, hi] whose data were malformed (``reason`` "malformed") or lost ("overflow")."""

    lo: int
    hi: int
    reason: str


class BridgeNode(Node):
    """Records episodes from the robot's topics into one store shard; optionally serves actions.

    Several episodes can be open at once: the executor takes one message per topic per
    wake-up, so the few event messages overtake the many data messages. Every message,
    good or bad, belongs to the open episode with the latest start stamp at or before its
    own (and, once that episode's end is known, at or before its end stamp).

    Counters: ``malformed`` (message kind -> count), ``lost`` (topic -> messages DDS
    dropped) and ``discarded`` (reason -> episodes); all go to
    ``STORE/fleet/<client_id>.json`` and the heartbeat with the commit counts, as do
    ``wrong_type`` (topic -> other message types some node uses on it, which never reach
    the bridge) and ``other_bridges`` (bridges also recording this namespace).
    """

    def __init__(self, cfg: BridgeConfig, context: Context | None = None):
        super().__init__("ros2_bridge", namespace=cfg.namespace, context=context)
        self.cfg = cfg
        self.robot = RobotDescription.load(cfg.robot)
        self.max_steps = cfg.max_steps or self.robot.max_steps
        self.depth = queue_depth(self.max_steps, cfg.burst_episodes)
        try:
            self.store = Store.open(cfg.store)
        except StoreNotFoundError:
            self.store = Store.create(cfg.store, self.robot.schema(), exist_ok=True)
        self.robot.check_store(self.store.schema, f"the store {self.store.root}")
        # Every bridge on a namespace records every episode: a second one into the same store
        # (under another client_id) would store each twice.
        domain, where = self.context.get_domain_id(), "/" + cfg.namespace.strip("/")
        os.makedirs(os.path.join(self.store.root, "fleet"), exist_ok=True)
        self._namespace_lock = try_lock(
            os.path.join(self.store.root, "fleet", f".ros2-{domain}-{where.strip('/').replace('/', '.')}.lock"),
            lambda: ShardLockedError(f"another bridge records namespace {where} (ROS domain {domain}) into "
                                     f"{self.store.root}: each would store every episode; stop it, or record "
                                     "into another store"))
        self.writer = self.store.writer(cfg.client_id)
        self._action_space = self.robot.action_space()
        self._obs_keys = {self.robot.joint_key} | ({self.robot.camera.key} if self.robot.camera else set())
        self.malformed: Counter[str] = Counter()
        self.discarded: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()
        self.wrong_type: dict[str, list[str]] = {}  # topic -> foreign message types seen on it
        self.other_bridges = 0  # other bridges on this namespace: each records every episode
        self.committed = 0
        self.done = False
        self._pool: dict[int, dict[str, np.ndarray]] = {}  # stamp -> {observation keys, "action"}
        self._faults: list[_Fault] = []
        self._last: dict[str, int] = {}  # newest accepted stamp per topic
        self._seq: dict[tuple[str, bytes], tuple[int, int]] = {}  # (topic, publisher) -> (sequence, stamp)
        self._open: list[_Episode] = []  # by start stamp
        self._floor = 0  # every stamp up to here belongs to a closed episode (or none)
        self._newest = 0  # newest data stamp accepted: the floor never passes it
        self._closed: list[tuple[int, int]] = []  # stamp ranges of closed episodes above the floor
        # recent closed episodes by index, oldest first: (start stamp, seed, task) to know a start sent again
        self._closed_index: dict[int, tuple[int, int, str] | None] = {}
        self._final_seen = False
        self._instruction = ""
        self._last_rx = time.monotonic()
        self._started = time.time()
        self._status_path = os.path.join(self.store.root, "fleet", f"{cfg.client_id}.json")
        os.makedirs(os.path.dirname(self._status_path), exist_ok=True)

        qos = topic_qos(self.depth)
        self._subs = {
            INSTRUCTION_TOPIC: self.create_subscription(String, INSTRUCTION_TOPIC, self._on_instruction, qos),
            EPISODE_TOPIC: self.create_subscription(String, EPISODE_TOPIC, self._on_event, qos),
            JOINT_TOPIC: self.create_subscription(JointState, JOINT_TOPIC, self._on_joint, qos),
        }
        if self.robot.camera is not None:
            self._subs[IMAGE_TOPIC] = self.create_subscription(Image, IMAGE_TOPIC, self._on_image, qos)
        self.registry = PolicyRegistry(self.store.root)
        self.policy_version = 0
        self._robot = RemoteRobot(self._action_space)
        if cfg.serve_policy:
            self._policy: Policy = build_policy({}, {"kind": cfg.policy})
            self._action_pub = self.create_publisher(JointState, ACTION_TOPIC, qos)
        else:  # a served action is recorded when served, so only listen when the robot acts itself
            self._subs[ACTION_TOPIC] = self.create_subscription(JointState, ACTION_TOPIC, self._on_action, qos)
        self._status_pub = self.create_publisher(String, STATUS_TOPIC, STATUS_QOS)
        self._next_beat = self._next_file = 0.0
        self.write_status("running")

    def _owner(self, ns: int) -> _Episode | None:
        """The open episode that owns stamp ``ns`` (episodes never overlap), if any."""
        if self._is_closed(ns):
            return None
        ep = next((e for e in reversed(self._open) if e.start <= ns), None)
        return ep if ep is not None and ep.owns(ns) else None

    def _is_closed(self, ns: int) -> bool:
        return ns <= self._floor or any(lo <= ns <= hi for lo, hi in self._closed)

    # --- faults ---------------------------------------------------------------------
    def _fault(self, lo: int, hi: int, reason: str, detail: str) -> None:
        """Record that stamps [lo, hi] carried bad or lost data: the episode owning them is
        discarded (now if its end is known, else at its end)."""
        owners = sorted({ep.index for ep in self._open if ep.start <= hi and (ep.end is None or lo <= ep.end["stamp"])})
        if hi > self._floor:
            self._faults.append(_Fault(lo, hi, reason))
        where = f"episode {owners[0]}" if len(owners) == 1 else f"episodes {owners}" if owners else "no open episode"
        self.get_logger().warning(f"{detail} (stamps {lo}..{hi}: {where})")
        for ep in [e for e in self._open if e.end is not None]:
            self._try_finish(ep)
        self.write_status("running")

    def _reject(self, kind: str, ns: int | None, detail: str) -> None:
        self.malformed[kind] += 1
        detail = f"dropped malformed message ({kind}): {detail}"
        if ns is None:
            self.get_logger().warning(f"{detail} (no stamp: attributed to no episode)")
            self.write_status("running")
        else:
            self._fault(ns, ns, "malformed", detail)

    def _fault_of(self, ep: _Episode) -> str | None:
        assert ep.end is not None
        hit = [f.reason for f in self._faults if f.lo <= ep.end["stamp"] and ep.start <= f.hi]
        return "overflow" if "overflow" in hit else hit[0] if hit else None

    def _sequence(self, topic: str, ns: int | None, info: dict[str, Any]) -> None:
        """Detect messages DDS dropped (queue overflow) from gaps in each publisher's sequence
        numbers, which start at 1: a first message numbered n > 1 means n - 1 were lost
        (or sent before this bridge matched; either way they never arrived)."""
        seq, gid = info.get("publication_sequence_number"), info.get("publisher_gid")
        if seq is None or gid is None:
            return  # the middleware does not report them
        key = (topic, bytes(gid["data"]))
        previous_seq, previous_ns = self._seq.get(key, (0, self._floor))
        ns = previous_ns if ns is None else ns  # a message without a usable stamp
        self._seq[key] = (seq, ns)
        if seq > previous_seq + 1:
            n = seq - previous_seq - 1
            self.lost[topic] += n
            lo, hi = sorted((previous_ns + 1, ns - 1))
            self._fault(lo, hi, "overflow", f"{n} {topic} messages lost (a queue of {self.depth} overflowed, "
                        "or they were sent before this bridge matched)")

    # --- incoming messages ----------------------------------------------------------
    def _on_data(self, topic: str, msg: Any, info: dict[str, Any], parse: typing.Callable[[Any], np.ndarray],
                 key: str) -> None:
        ns = stamp_ns(msg.header)
        self._sequence(topic, ns, info)
        try:
            value = parse(msg)
        except MalformedMessage as e:
            self._reject(e.kind, ns, f"{topic}: {e}")
            return
        last = self._last.get(topic, 0)
        if ns == 0:  # the usual mistake behind it; "not after 0" would not say so
            self._reject("no_stamp", None, f"{topic}: header.stamp is unset (0); stamp every message")
            return
        if ns <= last or key in self._pool.get(ns, {}):
            # The next message is compared with this one, not with the newest stamp seen: one
            # stamp far ahead (a node on another clock) would otherwise refuse the topic for good.
            self._last[topic] = ns
            detail = f"stamp {ns} is not after {last}" if ns <= last else f"stamp {ns} came before, with other data"
            if ns <= last:
                self._drop_pooled(last, key)
            self._reject("out_of_order", ns, f"{topic} {detail}")
            return
        self._last[topic] = ns
        self._newest = max(self._newest, ns)
        self._last_rx = time.monotonic()
        if self._is_closed(ns):
            return  # straggler of an episode already closed
        self._pool.setdefault(ns, {})[key] = value
        ep = self._owner(ns)
        if ep is not None:  # else its start event has not arrived yet
            ep.last_stamp = max(ep.last_stamp, ns)
            self._serve(ep, ns)
            self._try_finish(ep)

    def _drop_pooled(self, ns: int, key: str) -> None:
        """Drop the ``key`` data stamped ``ns`` that a message of the same topic stamped before it
        has just followed. Either may be out of place; kept, a stamp far ahead (a node on another
        clock) would be attributed to every later episode, and one of them closed without its end
        would close every stamp the robot sends afterwards. The episode holding it loses it."""
        step = self._pool.get(ns)
        if step is None or key not in step:
            return
        del step[key]
        if not step:
            del self._pool[ns]
        for ep in self._open:
            if ep.last_stamp == ns:
                ep.last_stamp = max((n for n in self._pool if ep.owns(n)), default=ep.start)

    def _on_joint(self, msg: JointState, info: dict[str, Any]) -> None:
        self._on_data(JOINT_TOPIC, msg, info, self.robot.parse_joints, self.robot.joint_key)

    def _on_image(self, msg: Image, info: dict[str, Any]) -> None:
        assert self.robot.camera is not None
        self._on_data(IMAGE_TOPIC, msg, info, self.robot.parse_image, self.robot.camera.key)

    def _on_action(self, msg: JointState, info: dict[str, Any]) -> None:
        self._on_data(ACTION_TOPIC, msg, info, self.robot.parse_action, "action")

    def _on_instruction(self, msg: String) -> None:
        self._instruction = msg.data

    def _on_event(self, msg: String, info: dict[str, Any]) -> None:
        self._last_rx = time.monotonic()
        ev: Any = None
        try:
            ev = json.loads(msg.data)
            stamp = _event_int(ev, "stamp")  # int() would move 1000.7 onto stamp 1000's message
        except (ValueError, KeyError, TypeError) as e:
            self._sequence(EPISODE_TOPIC, None, info)  # it arrived: not lost, only malformed
            detail = f"bad episode event {msg.data[:200]!r}: {e!r}"
            ep = self._awaiting_end(ev)
            if ep is not None:  # an end naming its episode costs exactly that one, now
                self._bad_end(ep, ep.last_stamp, detail)
            else:
                self._reject("event", None, detail)
                self._refused_start(ev)
            return
        if ev.get("event") == "start" and self._clock_went_back(stamp, info):
            self._forget_stamps(stamp)
        self._sequence(EPISODE_TOPIC, stamp, info)
        try:
            kind = ev["event"]
            if kind == "start":
                self._on_start(ev, stamp)
            elif kind == "end":
                self._on_end(ev, stamp)
            else:
                raise ValueError(f"unknown event {kind!r}")
        except MalformedMessage as e:
            self._reject(e.kind, None, str(e))
        except (ValueError, KeyError, TypeError) as e:
            self._reject("event", stamp, f"bad episode event {msg.data[:200]!r}: {e!r}")
            self._refused_start(ev)

    def _refused_start(self, ev: Any) -> None:
        """Count the episode of a refused start event (if ``ev`` is one) as discarded, so that
        committed + discarded is every episode the robot started, and remember its index: its
        end is then no surprise, not a second malformed message (``end_without_start``)."""
        if not isinstance(ev, dict) or ev.get("event") != "start":
            return
        index = ev.get("episode")
        if isinstance(index, int) and not isinstance(index, bool):
            self._closed_index[index] = None  # a retry of it is refused again
        self._count_discard(index, "malformed")

    def _clock_went_back(self, stamp: int, info: dict[str, Any]) -> bool:
        """Whether a new publisher's first start event comes before stamps already seen: a
        robot restarted with its clock reset (sim time) or behind the old one."""
        gid = info.get("publisher_gid")
        if gid is None or (EPISODE_TOPIC, bytes(gid["data"])) in self._seq:
            return False
        # Episodes only: the new robot's own data may arrive before its first start event.
        seen = [self._floor, *(e.start for e in self._open), *(hi for _, hi in self._closed)]
        return stamp <= max(seen)

    def _forget_stamps(self, stamp: int) -> None:
        """Start stamp bookkeeping afresh, or every later message would be refused as out of
        order until the bridge restarts. The old robot's open episodes are abandoned; data
        of the new robot that arrived before this event were refused already."""
        self.get_logger().warning(f"a new robot publisher starts at stamp {stamp}, before stamps already seen "
                                  "(its clock restarted): forgetting the old stamps")
        for ep in list(self._open):
            self._discard(ep, "abandoned")
        self._floor, self._newest, self._closed, self._last, self._pool, self._faults = 0, 0, [], {}, {}, []

    def _on_start(self, ev: dict[str, Any], start: int) -> None:
        index, seed, task = _event_int(ev, "episode"), _event_int(ev, "seed"), str(ev["task"])
        if task not in self.robot.tasks:
            raise ValueError(f"unknown task {task!r}; robot {self.robot.name!r} has {list(self.robot.tasks)}")
        if self._closed_index.get(index) == (start, seed, task):
            self.get_logger().info(f"start of episode {index} (stamp {start}) received again after it closed; ignored")
            return
        # A robot runs one episode at a time and sends each end before the next start, so an
        # earlier episode of this index still awaiting its end was abandoned (the robot
        # restarted and counts from 0 again): without this the restarted robot's episode is lost.
        for ep in [e for e in self._open if e.index == index and e.end is None and e.start < start]:
            self._discard(ep, "abandoned")
        copy = next((e for e in self._open if e.index == index and e.start == start and e.seed == seed
                     and e.task == task), None)
        if copy is not None:  # the same event again (a retry): the episode is already open
            self.get_logger().info(f"start of episode {index} (stamp {start}) received again; ignored")
            return
        # Events arrive in order, so an episode still awaiting its end that starts after this
        # start, with nothing received at or after its stamp, was stamped far ahead (another
        # clock): it alone is dropped, or every later start would be refused until it times out.
        for ep in [e for e in self._open if e.end is None and e.start > max(start, self._newest)]:
            self.malformed["event"] += 1
            self.get_logger().warning(f"dropped malformed message (event): episode {ep.index} starts at {ep.start}, "
                                      f"after episode {index}'s start {start} and after every stamp received")
            self._discard(ep, "malformed")
        if self._is_closed(start) or any(ep.index == index or ep.start >= start for ep in self._open):
            raise ValueError(f"episode {index} starts at {start}, not after the episodes already seen")
        # The event's instruction is tied to this episode; the topic's latest one may not be yet.
        instruction = str(ev.get("instruction", self._instruction))
        version, policy_error = (_event_int(ev, "policy_version") if "policy_version" in ev else 0), False
        if self.cfg.serve_policy:
            try:
                version = self._prepare_policy(instruction, task, seed)
            except Exception as e:  # a broken artifact must not take the bridge down
                self.get_logger().error(f"cannot prepare a policy for episode {index}: {e!r}")
                version, policy_error = self.policy_version, True
        ep = _Episode(index, seed, task, self.robot.tasks.index(task), instruction, start, version, start,
                      policy_error=policy_error)
        # Data before this start that no open episode owns can never be used (e.g. we joined mid-episode).
        self._pool = {ns: v for ns, v in self._pool.items() if ns >= start or self._owner(ns)}
        self._open.append(ep)
        for ns in sorted(ns for ns in self._pool if ns >= start):  # data that overtook the event
            ep.last_stamp = ns
            self._serve(ep, ns)

    def _awaiting_end(self, ev: Any) -> _Episode | None:
        """The open episode an end event names, if it is one and that episode awaits its end."""
        if not isinstance(ev, dict) or ev.get("event") != "end":
            return None
        return next((e for e in self._open if e.index == ev.get("episode") and e.end is None), None)

    def _bad_end(self, ep: _Episode, stamp: int, detail: str) -> None:
        """A malformed end event of ``ep``: its own episode is known by index, discard exactly that one."""
        self.malformed["event"] += 1
        self.get_logger().warning(f"dropped malformed message (event): bad end of episode {ep.index}: {detail}")
        ep.end = {"stamp": max(stamp, ep.last_stamp)}
        self._discard(ep, "malformed")

    def _on_end(self, ev: dict[str, Any], stamp: int) -> None:
        if ev.get("final") is True:  # the robot's last episode, whether it commits, is discarded or was refused
            self._final_seen = True
            self.done = self.cfg.exit_on_final and not self._open
        index = _event_int(ev, "episode")
        ep = self._awaiting_end({**ev, "episode": index})
        ended = next((e for e in self._open if e.index == index and e.end is not None), None)
        if ended is not None:  # its end came before (its data are still in flight)
            assert ended.end is not None
            if stamp != ended.end["stamp"] or ev.get("length") != ended.end["length"]:
                self._bad_end(ended, max(stamp, ended.end["stamp"]), f"a second end (stamp {stamp}, length {ev.get('length')!r}) "
                                            f"unlike the first (stamp {ended.end['stamp']}, length {ended.end['length']})")
            else:
                self.get_logger().info(f"end of episode {index} (stamp {stamp}) received again; ignored")
            return
        if ep is None:
            if index in self._closed_index:
                self.get_logger().info(f"end of episode {index}, already closed; ignored")
                return
            raise MalformedMessage("end_without_start", f"end of episode {index} (stamp {stamp}), which never started")
        try:
            if not isinstance(ev["length"], int) or isinstance(ev["length"], bool):  # int(2.7) would be 2
                raise TypeError(f"length {ev['length']!r} must be a whole number")
            length, rewards = ev["length"], _event_rewards(ev)
            if len(rewards) != length:
                raise ValueError(f"{len(rewards)} rewards for {length} steps")
            if stamp < ep.start:
                raise ValueError(f"end stamp {stamp} < start {ep.start}")
            # Truthiness would record "false" as True: flags must be JSON booleans.
            flags = {k: ev[k] for k in END_FLAGS if k in ev or k in REQUIRED_END_FLAGS}
            if not all(isinstance(v, bool) for v in flags.values()):
                raise TypeError(f"flags {flags} must be true or false")
            ev = {**ev, "length": length, "rewards": rewards, "stamp": stamp}
        except (ValueError, KeyError, TypeError) as e:
            self._bad_end(ep, stamp, repr(e))
            return
        ep.end = ev
        self._try_finish(ep)

    # --- serving --------------------------------------------------------------------
    def _prepare_policy(self, instruction: str, task: str, seed: int) -> int:
        """Hot-swap to the newest registry version (only ever here, between episodes) and reset."""
        latest = self.registry.latest() if self.cfg.follow_registry else None
        if latest is not None and latest != self.policy_version:
            self._policy, self.policy_version = build_policy(*self.registry.load(latest)), latest
        self._robot.instruction, self._robot.task = instruction, task
        self._policy.reset(self._robot, seed)
        return self.policy_version

    def _serve(self, ep: _Episode, ns: int) -> None:
        step = self._pool[ns]
        if not self.cfg.serve_policy or "action" in step or not self._obs_keys <= step.keys():
            return
        try:
            action = np.asarray(self._policy.act(self._obs(step, ep), self._robot), dtype=np.float32)
            action = np.clip(action, self._action_space.low, self._action_space.high)
        except Exception as e:  # a broken policy must not take the bridge down
            self.get_logger().error(f"policy v{self.policy_version} failed: {e!r}")
            ep.policy_error = True
            return
        if action.shape != self._action_space.shape or not np.isfinite(action).all():
            ep.policy_error = True
            self.get_logger().error(f"policy v{self.policy_version} returned {action!r}; not served")
            return
        step["action"] = action
        self._action_pub.publish(self.robot.action_msg(ns, action))

    # --- episode completion -----------------------------------------------------------
    def _obs(self, step: dict[str, np.ndarray], ep: _Episode) -> dict[str, Any]:
        obs = {k: step[k] for k in self._obs_keys}
        obs[self.robot.task_key] = np.int64(ep.task_index)
        return obs

    def _try_finish(self, ep: _Episode) -> None:
        if ep.end is None:
            return
        fault = self._fault_of(ep)
        if ep.end.get("aborted"):
            self._discard(ep, "aborted")
        elif ep.end["length"] > self.max_steps:
            self._discard(ep, "too_long")
        elif fault is not None:
            self._discard(ep, fault)
        elif ep.policy_error:
            self._discard(ep, "policy_error")
        else:
            T = ep.end["length"]
            stamps = sorted(ns for ns in self._pool if ep.owns(ns))
            if len(stamps) > T + 1:
                self._discard(ep, "inconsistent")
            elif (
                # the end stamp is s_T: T + 1 stamps short of it are the head of a longer episode
                # whose tail is still in flight (it then holds too many: inconsistent)
                len(stamps) == T + 1 and stamps[-1] == ep.end["stamp"]
                and all(self._obs_keys <= self._pool[ns].keys() for ns in stamps)
                and all("action" in self._pool[ns] for ns in stamps[:T])
            ):
                self._commit(ep, stamps)
            # else stragglers are still in flight; the silence deadline bounds the wait

    def _commit(self, ep: _Episode, stamps: list[int]) -> None:
        end, steps = ep.end, [self._pool[ns] for ns in stamps]
        assert end is not None
        T = end["length"]
        for t in range(T):
            last = t == T - 1
            self.writer.add(
                self._obs(steps[t], ep), steps[t]["action"], end["rewards"][t],
                terminated=last and bool(end["terminated"]), truncated=last and bool(end["truncated"]),
                policy_version=ep.policy_version, timestamp=stamps[t] / 1e9,
            )
        try:
            self.writer.commit(
                final_obs=self._obs(steps[T], ep), task_id=ep.task, instruction=ep.instruction, seed=ep.seed,
                success=bool(end["success"]), policy_version=ep.policy_version, start_time=stamps[0] / 1e9,
                end_time=stamps[-1] / 1e9,
                attrs={"source": "ros2", "robot": self.robot.name, "namespace": self.get_namespace(),
                       "robot_episode": ep.index,
                       # step timestamps are float seconds (about 0.25 us apart at wall-clock
                       # magnitudes); the first and last stamps stay exact for matching a bag
                       "start_stamp_ns": stamps[0], "end_stamp_ns": stamps[-1]},
            )
        except EpisodeValidationError as e:
            self.get_logger().warning(f"episode {ep.index} rejected by the store: {e}")
            self._discard(ep, "invalid")
            return
        self.committed += 1
        self.get_logger().info(f"committed episode {ep.index} ({T} steps) to shard {self.cfg.client_id}")
        self._close(ep)

    def _discard(self, ep: _Episode, reason: str) -> None:
        self.writer.discard()
        self._count_discard(ep.index, reason)
        self._close(ep)

    def _count_discard(self, index: Any, reason: str) -> None:
        self.discarded[reason] += 1
        self.get_logger().warning(f"discarded episode {index} ({reason}); so far {self.discard_summary()}")

    def discard_summary(self) -> str:
        """The episodes discarded so far by reason, e.g. ``discarded 3 episodes: inconsistent=2, timeout=1``."""
        n = sum(self.discarded.values())
        reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(self.discarded.items()))
        return f"discarded {n} episode{'' if n == 1 else 's'}" + (f": {reasons}" if n else "")

    def _close(self, ep: _Episode) -> None:
        """Forget an episode and the messages it owns; no other episode's data are touched."""
        self._open.remove(ep)
        hi = ep.end["stamp"] if ep.end is not None else ep.last_stamp
        self._closed.append((ep.start, hi))
        self._closed_index[ep.index] = (ep.start, ep.seed, ep.task)
        while len(self._closed_index) > 10_000:
            del self._closed_index[next(iter(self._closed_index))]
        # The floor may only pass closed ranges below the earliest open episode.
        limit = min((e.start for e in self._open), default=None)
        below = [r for r in self._closed if limit is None or r[0] < limit]
        if below:
            # Capped by the data: an episode whose start or end stamp was far ahead (a node on
            # another clock) would otherwise close every stamp the robot sends afterwards.
            top = min(max(h for _, h in below), self._newest)
            self._floor = max(self._floor, top if limit is None else min(top, limit - 1))
        self._closed = [r for r in self._closed if r[1] > self._floor]
        self._pool = {ns: v for ns, v in self._pool.items() if not (ep.start <= ns <= hi) and ns > self._floor}
        self._faults = [f for f in self._faults if f.hi > self._floor]
        self.done = self.cfg.exit_on_final and self._final_seen and not self._open
        self.write_status("running")

    def tick(self) -> None:
        """Publish the heartbeat and refresh the status file when due, and enforce the
        silence deadline of every open episode; call periodically."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + HEARTBEAT_S
            matched = {topic: sub.get_publisher_count() for topic, sub in self._subs.items()}
            if self.cfg.serve_policy:
                matched[ACTION_TOPIC] = self._action_pub.get_subscription_count()
            self._status_pub.publish(String(data=json.dumps({**self._status("running"), "matched": matched})))
        if now >= self._next_file:
            self._check_graph()
            self.write_status("running")
        # Silence is measured on the robot's clock where the bridge can: each data topic is FIFO, so
        # once every topic has delivered stamps `timeout` past an open episode's newest one, the robot
        # sent nothing more for it. Wall time since the last message of any kind only decides when
        # nothing arrives at all: an episode whose messages still queue behind the bridge's own
        # backlog (a burst, a loaded machine) is never discarded as silent.
        silent = now - self._last_rx > self.cfg.timeout
        clock = self._data_clock()
        late = int(self.cfg.timeout * 1e9)
        for ep in [e for e in self._open if silent or (clock is not None and clock - e.last_stamp > late)]:
            self._discard(ep, "timeout")
        if not self._open and silent:
            self._pool.clear()  # data whose start event never came
            self._faults.clear()

    def _data_clock(self) -> int | None:
        """The stamp up to which every data topic has delivered (None until each has delivered one)."""
        stamps = [self._last.get(t) for t in self._subs if t not in (INSTRUCTION_TOPIC, EPISODE_TOPIC)]
        return None if None in stamps else min(stamps)

    def _check_graph(self) -> None:
        """Warn once per foreign message type on one of our topics: DDS never matches a
        publisher of another type, so its messages would vanish without a word. Warn when
        another bridge records this namespace: both store every episode, twice in one store."""
        others = self.count_publishers(self._status_pub.topic_name) - 1
        if others > self.other_bridges:
            self.get_logger().error(f"{others} other bridge(s) record {self.get_namespace()}: each stores "
                                    "every episode (duplicates when they share a store)")
        self.other_bridges = others
        types = dict(self.get_topic_names_and_types())
        for topic, sub in self._subs.items():
            ours = "/".join((sub.msg_type.__module__.split(".")[0], "msg", sub.msg_type.__name__))
            for other in types.get(sub.topic_name, []):
                if other != ours and other not in self.wrong_type.get(topic, []):
                    self.wrong_type[topic] = [*self.wrong_type.get(topic, []), other]
                    self.get_logger().error(f"a node uses {other} on {sub.topic_name}, which the bridge reads as "
                                            f"{ours}: none of its messages can reach the bridge")

    def _status(self, state: str) -> dict[str, Any]:
        return {
            "client_id": self.cfg.client_id, "kind": "ros2-bridge", "state": state, "pid": os.getpid(),
            "host": socket.gethostname(), "started": self._started, "heartbeat": time.time(),
            "robot": self.robot.name, "episodes": self.writer.n_episodes, "steps": self.writer.n_steps,
            "committed": self.committed, "malformed": dict(self.malformed), "discarded": dict(self.discarded),
            "lost": dict(self.lost), "wrong_type": self.wrong_type, "other_bridges": self.other_bridges,
            "policy_version": self.policy_version,
            "max_burst": {"episodes": self.cfg.burst_episodes, "max_steps": self.max_steps,
                          "messages_per_topic": self.depth},
        }

    def write_status(self, state: str) -> dict[str, Any]:
        """Write and return the bridge status (``STORE/fleet/<client_id>.json``)."""
        status = self._status(state)
        write_json_atomic(self._status_path, status, fsync=False)
        self._next_file = time.monotonic() + STATUS_FILE_S
        return status

    def close(self) -> dict[str, Any]:
        """Discard the episodes still open, release the shard and write the final status."""
        for ep in list(self._open):
            self._discard(ep, "shutdown")
        self.get_logger().info(f"stopping: committed={self.committed} to shard {self.cfg.client_id}; "
                               f"{self.discard_summary()}")
        status = self.write_status("stopped")
        self.writer.close()
        os.close(self._namespace_lock)
        self.destroy_node()
        return status


# --- status -------------------------------------------------------------------------
def _event_int(ev: dict[str, Any], key: str) -> int:
    """``ev[key]`` as a JSON integer: ``int()`` would record an episode 1.5 or "3" as 1 or 3."""
    value = ev[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be a JSON integer, got {value!r}")
    return value


def _event_rewards(ev: dict[str, Any]) -> list[float]:
    """``ev["rewards"]`` as finite floats. ``float()`` would record a reward "1.0" or true as 1.0
    (and a string "123" as three rewards), and raise OverflowError, which kills the bridge, on
    an integer beyond float64."""
    rewards = ev["rewards"]
    if not isinstance(rewards, list):
        raise TypeError(f"rewards must be a JSON list of numbers, got {type(rewards).__name__}")
    out = []
    for t, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"rewards[{t}] must be a JSON number, got {type(r).__name__} {r!r}")
        value = float(r) if isinstance(r, float) or abs(r) <= sys.float_info.max else math.inf
        if not math.isfinite(value):
            raise ValueError(f"rewards[{t}] is {value}: rewards must be finite")
        out.append(value)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a killed child not yet reaped is a zombie: gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class BridgeStatusError(ValueError):
    """A bridge's status file is damaged: not a JSON object, or its ``pid`` or ``heartbeat`` unreadable."""


def read_bridge_status(root: str, client_id: str, stale_s: float = STALE_S, now: float | None = None) -> dict[str, Any]:
    """A bridge's status file, with ``state`` set to ``dead`` (and ``dead_reason``) when it
    says ``running`` but its pid is gone (same host) or its heartbeat is older than ``stale_s``.

    Raises:
        FileNotFoundError: no status file for ``client_id``.
        BridgeStatusError: the file is damaged.
    """
    path = os.path.join(root, "fleet", f"{client_id}.json")
    try:
        with open(path) as f:
            status = json.load(f)
        if not isinstance(status, dict):
            raise TypeError(f"a JSON {type(status).__name__}, not an object")
        if status.get("state") != "running":
            return status
        pid, heartbeat = int(status["pid"]), float(status.get("heartbeat", 0.0))
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise BridgeStatusError(f"{path} is not a bridge status ({e!r})") from None
    now = time.time() if now is None else now
    age = now - heartbeat
    if status.get("host") == socket.gethostname() and not _pid_alive(pid):
        return {**status, "state": "dead", "dead_reason": f"process {status['pid']} is gone"}
    if age > stale_s:
        return {**status, "state": "dead", "dead_reason": f"no heartbeat for {age:.1f} s (> {stale_s} s)"}
    return status


def bridge_statuses(root: str, stale_s: float = STALE_S) -> list[dict[str, Any]]:
    """``read_bridge_status`` of every ROS 2 bridge with a status file under ``root``."""
    folder = Path(root) / "fleet"
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or not a status file
        if isinstance(status, dict) and status.get("kind") == "ros2-bridge":
            out.append(read_bridge_status(root, path.stem, stale_s))
    return out


# --- processes ------------------------------------------------------------------------
def _init(domain_id: int | None) -> Context:
    context = Context()
    # Our own SIGINT/SIGTERM handling below lets the bridge close its shard cleanly.
    rclpy.init(context=context, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
    return context


def run_bridge(cfg: BridgeConfig) -> dict[str, Any]:
    """Run a bridge until SIGINT/SIGTERM (or the final episode with ``exit_on_final``)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    context = _init(cfg.domain_id)
    try:
        node = BridgeNode(cfg, context)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        try:
            while not (node.done or stop.is_set()):
                executor.spin_once(timeout_sec=0.1)
                node.tick()
        finally:
            status = node.close()
            executor.shutdown()
    finally:
        context.try_shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


def run_sim(cfg: SimConfig) -> list[dict[str, Any]]:
    """Run a simulated robot for ``cfg.episodes`` episodes; return what it published."""
    context = _init(cfg.domain_id)
    try:
        node = SimRobotNode(cfg, context)
        try:
            return node.run()
        finally:
            node.destroy_node()
    finally:
        context.try_shutdown()


def run_status(cfg: StatusConfig) -> list[dict[str, Any]]:
    """The status of one bridge (``client_id``) or of every bridge in the store."""
    if cfg.client_id:
        return [read_bridge_status(cfg.store, cfg.client_id, cfg.stale_s)]
    return bridge_statuses(cfg.store, cfg.stale_s)


MAX_DOMAIN_ID = 232  # beyond it the DDS port numbers overflow


def check_ros_args(namespace: str, domain_id: int | None) -> None:
    """Raise ``ValueError`` for a namespace or domain id ROS would reject only once started
    (with a traceback, or a DDS log line and no message of ours)."""
    try:  # as the node constructor does, accept "" and relative namespaces
        validate_namespace("/" + namespace.lstrip("/") if namespace.strip("/") else "/")
    except InvalidNamespaceException as e:
        raise ValueError(f"namespace={namespace!r}: {str(e).splitlines()[0]}") from None
    if domain_id is not None and not 0 <= domain_id <= MAX_DOMAIN_ID:
        raise ValueError(f"domain_id={domain_id}: ROS domain ids are 0..{MAX_DOMAIN_ID}")


USAGE = """usage: robo-post fleet ros2-bridge store=PATH [robot=NAME|PATH.yaml] [key=value ...]
       robo-post fleet ros2-sim [robot=NAME|PATH.yaml] [key=value ...]
       robo-post fleet ros2-status store=PATH [client_id=ID]
`robo-post fleet ros2-bridge --help` (or ros2-sim, ros2-status) lists the keys."""


def main(argv: list[str]) -> int:
    """``robo-post fleet ros2-bridge|ros2-sim|ros2-status key=value ...``."""
    commands = {"ros2-bridge": (BridgeConfig, run_bridge), "ros2-sim": (SimConfig, run_sim),
                "ros2-status": (StatusConfig, run_status)}
    if not argv or argv[0] not in commands:
        print(USAGE, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    cls, run = commands[argv[0]]
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(cls.__doc__)
        return 0
    try:
        cfg = parse_config(cls, argv[1:])
        if argv[0] == "ros2-sim":
            parse_faults(cfg.faults)
        if argv[0] != "ros2-status":
            RobotDescription.load(cfg.robot)  # refuse a bad description in one line, before ROS starts
            check_ros_args(cfg.namespace, cfg.domain_id)
    except (TypeError, ValueError) as e:
        print(f"robo-post fleet {argv[0]}: {e}", file=sys.stderr)
        return 2
    if argv[0] == "ros2-bridge":
        try:
            status = run(cfg)
        except RobotDescriptionError as e:  # e.g. a store recorded from another robot
            print(f"robo-post fleet ros2-bridge: {e}", file=sys.stderr)
            return 2
        print(json.dumps(status), flush=True)
    elif argv[0] == "ros2-status":
        try:
            statuses = run(cfg)
        except FileNotFoundError as e:
            print(f"robo-post fleet ros2-status: no status file: {e.filename}", file=sys.stderr)
            return 1
        except BridgeStatusError as e:
            print(f"robo-post fleet ros2-status: {e}", file=sys.stderr)
            return 1
        if not statuses:  # printing nothing would read as "all fine"
            what = "no store" if not os.path.isdir(cfg.store) else "no ROS 2 bridge has run on the store"
            print(f"robo-post fleet ros2-status: {what} {cfg.store}", file=sys.stderr)
            return 1
        for status in statuses:
            print(json.dumps(status))
        if any(status["state"] == "dead" for status in statuses):
            return 1
    else:
        run(cfg)
    return 0
