"""A robot description: what a robot publishes on ROS 2 and what of it is recorded.

``RobotDescription`` (``robot=NAME|PATH.yaml``) names the joints and the JointState fields
recorded, the action names and bounds, the camera, the task vocabulary and the episode
limit; the store schema is derived from it. Its parsers turn a decoded JointState or Image
(rclpy's, or one a bag reader decoded) into the recorded arrays, or raise
``MalformedMessage`` naming the check. Nothing here needs rclpy: a recording can be imported
without ROS installed. Only the message builders (``joint_msg``, ``image_msg``) import ROS
message classes, when called.
"""

from __future__ import annotations

import importlib.resources
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from gymnasium import spaces

from robo_post.store import StoreSchema

if typing.TYPE_CHECKING:  # the parsers read any message with these fields: rclpy's or a bag reader's
    from sensor_msgs.msg import Image, JointState

DEFAULT_ROBOT = "tabletop"  # description shipped in configs/robots/
JOINT_FIELDS = ("position", "velocity", "effort")
IMAGE_CHANNELS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}


def _stamp_msg(ns: int) -> Any:
    from builtin_interfaces.msg import Time  # ROS message classes: only the builders need the ros extra

    sec, nanosec = divmod(ns, 1_000_000_000)
    return Time(sec=sec, nanosec=nanosec)


def joint_msg(ns: int, names: typing.Sequence[str], values: np.ndarray, **fields: np.ndarray) -> JointState:
    """A JointState carrying ``values`` as ``position`` (and ``fields``, e.g. ``velocity``), stamped ``ns``."""
    from sensor_msgs.msg import JointState

    msg = JointState(name=list(names), position=np.asarray(values, dtype=np.float64).tolist())
    for name, array in fields.items():
        setattr(msg, name, np.asarray(array, dtype=np.float64).tolist())
    msg.header.stamp = _stamp_msg(ns)
    return msg


def image_msg(ns: int, image: np.ndarray, encoding: str = "rgb8") -> Image:
    """An Image from an (H, W) or (H, W, C) uint8 array, stamped ``ns``."""
    from sensor_msgs.msg import Image

    h, w = image.shape[:2]
    c = image.shape[2] if image.ndim == 3 else 1
    msg = Image(height=h, width=w, encoding=encoding, is_bigendian=0, step=w * c)
    msg.header.stamp = _stamp_msg(ns)
    msg.header.frame_id = "camera"
    msg.data = np.ascontiguousarray(image, dtype=np.uint8).tobytes()
    return msg


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
        max_steps: longest episode in steps; sizes the bridge's topic queues (see
            ``robo_post.fleet.ros2``, Bursts).
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

