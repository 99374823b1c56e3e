"""ROS 2 bridge: record a robot's episodes from standard topics into a store shard and
serve the registry's policy back to it; plus a simulated robot that speaks the same topics.

Topics, relative to the node namespace (default ``/robot``); every one is reliable,
volatile, keep-last 1000, so a burst of a whole episode is never dropped:

==================  =======================  ================  ==========================================
topic               type                     direction         content
==================  =======================  ================  ==========================================
``joint_states``    sensor_msgs/JointState   robot -> bridge   proprio as ``position`` (``PROPRIO_NAMES``)
``camera/image``    sensor_msgs/Image        robot -> bridge   camera frame, encoding ``rgb8``
``instruction``     std_msgs/String          robot -> bridge   the episode's language instruction (the
                                                               bridge prefers the start event's copy,
                                                               which cannot race the episode)
``action``          sensor_msgs/JointState   either way        the action taken in the obs with the same
                                                               stamp (``ACTION_NAMES``); JointState, not
                                                               Float32MultiArray, because it has a header
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
t = 0..T one JointState and one Image sharing the header stamp s_t (strictly increasing),
and for t < T the action executed at s_t, stamped s_t: its own when it acts locally,
otherwise the one the bridge served. Last comes ``{"event": "end", "episode", "seed",
"task", "length": T, "rewards": [T floats], "success", "terminated", "truncated",
"aborted", "stamp": s_T, "final"}``; ``final`` marks the robot's last episode.

Alignment: the bridge files every valid message by its stamp, whatever order topics
arrive in (events may overtake data, so several episodes can be open at once), and an
episode is the set of stamps in [start.stamp, end.stamp]. It commits once that set is
complete (T + 1 observations, T actions). A malformed message (wrong length, NaN/inf,
wrong image encoding or size, a stamp not after the previous one on its topic, a bad
event) is counted by kind, logged and dropped, and the episode in progress (the latest
started) is discarded at its end instead of committed. An episode that receives nothing
for ``timeout`` seconds is discarded too. A discarded episode never touches the store.

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

import json
import signal
import sys
import threading
import time
import typing
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import rclpy
from builtin_interfaces.msg import Time
from gymnasium import spaces
from rclpy.context import Context
from rclpy.duration import Duration
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from robo_post.envs.tabletop import PROPRIO_FIELDS, TASKS, TabletopEnv
from robo_post.fleet.client import episode_seed, store_schema
from robo_post.fleet.policies import Policy, build_policy
from robo_post.store import EpisodeValidationError, PolicyRegistry, Store, StoreNotFoundError
from robo_post.store.writer import write_json_atomic

JOINT_TOPIC, IMAGE_TOPIC, INSTRUCTION_TOPIC, ACTION_TOPIC, EPISODE_TOPIC, STATUS_TOPIC = (
    "joint_states", "camera/image", "instruction", "action", "episode", "bridge/status",
)
HEARTBEAT_S = 0.25  # bridge status period
PROPRIO_NAMES: tuple[str, ...] = tuple(f"{name}.{i}" for name, size in PROPRIO_FIELDS for i in range(size))
ACTION_NAMES: tuple[str, ...] = ("dx", "dy", "dz", "gripper")
QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST, depth=1000, reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.VOLATILE,
)
SIM_SHARD = "ros2-sim"  # name mixed into the sim's episode seeds


def stamp_ns(header: Any) -> int:
    """A header's stamp as integer nanoseconds (the bridge's alignment key)."""
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


def _stamp_msg(ns: int) -> Time:
    sec, nanosec = divmod(ns, 1_000_000_000)
    return Time(sec=sec, nanosec=nanosec)


def joint_msg(ns: int, names: tuple[str, ...], values: np.ndarray) -> JointState:
    """A JointState carrying ``values`` as ``position``, stamped ``ns``."""
    msg = JointState(name=list(names), position=np.asarray(values, dtype=np.float64).tolist())
    msg.header.stamp = _stamp_msg(ns)
    return msg


def image_msg(ns: int, image: np.ndarray, encoding: str = "rgb8") -> Image:
    """An Image from an (H, W, 3) uint8 array, stamped ``ns``."""
    h, w = image.shape[:2]
    msg = Image(height=h, width=w, encoding=encoding, is_bigendian=0, step=w * 3)
    msg.header.stamp = _stamp_msg(ns)
    msg.header.frame_id = "front_camera"
    msg.data = np.ascontiguousarray(image, dtype=np.uint8).tobytes()
    return msg


# --- configs ----------------------------------------------------------------------
@dataclass
class SimConfig:
    """``robo-post fleet ros2-sim key=value ...``: a simulated tabletop robot on ROS 2.

    Attributes:
        namespace: namespace of the robot's topics.
        domain_id: ROS domain id (None: ``$ROS_DOMAIN_ID``, else 0).
        task: tabletop task of every episode.
        episodes: episodes to run before exiting.
        seed: base seed; episode i runs with ``episode_seed(seed, "ros2-sim", i)``.
        act_locally: act with the local scripted ``policy`` (data collection) and publish
            the executed action; otherwise wait for the bridge's action every step.
        policy: local policy kind (``expert`` | ``random``).
        noise: action-noise std of the local expert.
        image_size: camera image side in pixels.
        max_steps: truncation horizon (0: the task's default).
        rate_hz: control rate (0: as fast as possible).
        action_timeout: seconds to wait for a served action before aborting the episode.
        discovery_timeout: seconds to wait for a bridge heartbeat showing every topic matched.
        subscribers: episode-topic subscribers (the bridge plus any monitors) to wait for.
        dump: if set, write everything published to this ``.npz`` (arrays + JSON metadata).
    """

    namespace: str = "/robot"
    domain_id: int | None = None
    task: str = "reach"
    episodes: int = 3
    seed: int = 0
    act_locally: bool = True
    policy: str = "expert"
    noise: float = 0.0
    image_size: int = 64
    max_steps: int = 0
    rate_hz: float = 25.0
    action_timeout: float = 5.0
    discovery_timeout: float = 60.0
    subscribers: int = 1
    dump: str = ""


@dataclass
class BridgeConfig:
    """``robo-post fleet ros2-bridge store=PATH key=value ...``: record a robot into a shard.

    Attributes:
        store: store root; created with the tabletop schema if missing.
        client_id: shard this bridge writes (one writer per shard).
        namespace: namespace of the robot's topics.
        domain_id: ROS domain id (None: ``$ROS_DOMAIN_ID``, else 0).
        serve_policy: publish the policy's action for every observation.
        policy: artifact kind served while the registry is empty (version 0). Served
            policies see observations only (no simulator), so scripted experts cannot be served.
        follow_registry: load the newest registry version at every episode start.
        timeout: seconds an open episode may receive nothing before it is discarded.
        image_size: camera image side used when creating a new store.
        exit_on_final: exit once the episode flagged ``final`` is committed or discarded.
    """

    store: str
    client_id: str = "ros2-bridge"
    namespace: str = "/robot"
    domain_id: int | None = None
    serve_policy: bool = False
    policy: str = "random"
    follow_registry: bool = True
    timeout: float = 5.0
    image_size: int = 64
    exit_on_final: bool = False


def parse_config(cls: type, argv: list[str]) -> Any:
    """Build a config dataclass from ``key=value`` strings, typed by its annotations."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not sep or key not in hints:
            raise ValueError(f"expected key=value with key in {sorted(hints)}, got {arg!r}")
        values[key] = _convert(text, hints[key])
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
    """A TabletopEnv behind ROS 2 topics (see the module docstring for the protocol).

    ``run()`` waits for a bridge, runs ``cfg.episodes`` episodes and keeps everything it
    published in ``self.records`` (one dict of arrays + metadata per episode).
    """

    def __init__(self, cfg: SimConfig, context: Context | None = None):
        super().__init__("sim_robot", namespace=cfg.namespace, context=context)
        self.cfg = cfg
        self.env = TabletopEnv(task=cfg.task, image_size=cfg.image_size, max_steps=cfg.max_steps or None)
        self.policy: Policy | None = (
            build_policy({}, {"kind": cfg.policy, "noise": cfg.noise}) if cfg.act_locally else None
        )
        self.pubs = {
            JOINT_TOPIC: self.create_publisher(JointState, JOINT_TOPIC, QOS),
            IMAGE_TOPIC: self.create_publisher(Image, IMAGE_TOPIC, QOS),
            INSTRUCTION_TOPIC: self.create_publisher(String, INSTRUCTION_TOPIC, QOS),
            EPISODE_TOPIC: self.create_publisher(String, EPISODE_TOPIC, QOS),
        }
        self._served: dict[int, np.ndarray] = {}
        self._heartbeat: dict[str, Any] = {}
        self.create_subscription(String, STATUS_TOPIC, self._on_heartbeat, QOS)
        self._action_sub = None
        if cfg.act_locally:
            self.pubs[ACTION_TOPIC] = self.create_publisher(JointState, ACTION_TOPIC, QOS)
        else:
            self._action_sub = self.create_subscription(JointState, ACTION_TOPIC, self._on_action, QOS)
        self._executor = SingleThreadedExecutor(context=context)
        self._executor.add_node(self)
        self._last_stamp = 0
        self.records: list[dict[str, Any]] = []

    def _on_action(self, msg: JointState) -> None:
        action = np.asarray(msg.position, dtype=np.float32)
        if action.shape != self.env.action_space.shape or not np.isfinite(action).all():
            self.get_logger().warning(f"ignoring malformed action {list(msg.position)}")
            return
        self._served[stamp_ns(msg.header)] = action

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

    def _publish_obs(self, obs: dict[str, Any], ns: int) -> None:
        self.pubs[JOINT_TOPIC].publish(joint_msg(ns, PROPRIO_NAMES, obs["proprio"]))
        self.pubs[IMAGE_TOPIC].publish(image_msg(ns, obs["image"]))

    def _act(self, obs: dict[str, Any], ns: int) -> np.ndarray | None:
        """The action to execute at stamp ``ns``, or None if the bridge never sent one."""
        if self.policy is not None:
            space = self.env.action_space
            action = np.clip(np.asarray(self.policy.act(obs, self.env), dtype=np.float32), space.low, space.high)
            self.pubs[ACTION_TOPIC].publish(joint_msg(ns, ACTION_NAMES, action))
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
        stamps = [self._stamp()]
        rec: dict[str, list] = {"proprio": [obs["proprio"]], "image": [obs["image"]], "action": [], "reward": []}
        meta = {"episode": index, "seed": seed, "task": self.cfg.task, "instruction": info["instruction"]}
        self.pubs[INSTRUCTION_TOPIC].publish(String(data=info["instruction"]))
        self._event({"event": "start", **meta, "stamp": stamps[0]})
        terminated = truncated = aborted = False
        period = 1.0 / self.cfg.rate_hz if self.cfg.rate_hz > 0 else 0.0
        next_tick = time.monotonic()
        while True:
            self._publish_obs(obs, stamps[-1])
            if terminated or truncated:
                break
            action = self._act(obs, stamps[-1])
            if action is None:
                self.get_logger().warning(f"episode {index}: no action within {self.cfg.action_timeout} s, aborting")
                aborted = True
                break
            obs, reward, terminated, truncated, info = self.env.step(action)
            rec["action"].append(action)
            rec["reward"].append(reward)
            rec["proprio"].append(obs["proprio"])
            rec["image"].append(obs["image"])
            next_tick += period
            time.sleep(max(next_tick - time.monotonic(), 0.0))
            stamps.append(self._stamp())
        end = {
            **meta, "length": len(rec["action"]), "rewards": [float(r) for r in rec["reward"]],
            "success": bool(info["success"]), "terminated": bool(terminated), "truncated": bool(truncated),
            "aborted": aborted, "stamp": stamps[-1], "final": final,
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
        """Write ``self.records`` as ``ep{i}_{proprio,image,action,reward,stamp}`` arrays plus
        a ``meta`` JSON string (a list of end events)."""
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
    last_rx: float  # monotonic time of the last message that belonged to it
    last_stamp: int  # newest data stamp that belonged to it
    end: dict[str, Any] | None = None
    tainted: str | None = None  # kind of the first malformed message seen during it

    def owns(self, ns: int) -> bool:
        return self.start <= ns and (self.end is None or ns <= self.end["stamp"])


class BridgeNode(Node):
    """Records episodes from the robot's topics into one store shard; optionally serves actions.

    Several episodes can be open at once: the executor takes one message per topic per
    wake-up, so the few event messages overtake the many data messages. Every message
    belongs to the open episode with the latest start stamp at or before its own.

    Counters: ``malformed`` (message kind -> count) and ``discarded`` (reason -> count);
    both also go to ``STORE/fleet/<client_id>.json`` and the heartbeat with the commit counts.
    """

    def __init__(self, cfg: BridgeConfig, context: Context | None = None):
        super().__init__("ros2_bridge", namespace=cfg.namespace, context=context)
        self.cfg = cfg
        try:
            self.store = Store.open(cfg.store)
        except StoreNotFoundError:
            env = {"name": "tabletop", "image_size": cfg.image_size}
            self.store = Store.create(cfg.store, store_schema(env, TASKS[0]), exist_ok=True)
        self.writer = self.store.writer(cfg.client_id)
        schema = self.store.schema
        self._proprio_dim = schema.observations["proprio"].shape[0]
        image = schema.observations.get("image")
        self._image_shape = image.shape if image is not None else None
        self._obs_keys = {"proprio"} | ({"image"} if image is not None else set())
        act = schema.action
        self._action_space = spaces.Box(
            np.float32(act.low if act.low is not None else -np.inf),
            np.float32(act.high if act.high is not None else np.inf), act.shape, np.float32,
        )
        self.malformed: Counter[str] = Counter()
        self.discarded: Counter[str] = Counter()
        self.committed = 0
        self.done = False
        self._pool: dict[int, dict[str, np.ndarray]] = {}  # stamp -> {proprio, image, action}
        self._last: dict[str, int] = {}  # newest accepted stamp per topic
        self._open: list[_Episode] = []  # by start stamp
        self._closed_until = 0  # newest stamp of a closed episode; older data are stragglers
        self._final_seen = False
        self._instruction = ""
        self._last_rx = time.monotonic()
        self._status_path = os.path.join(self.store.root, "fleet", f"{cfg.client_id}.json")
        os.makedirs(os.path.dirname(self._status_path), exist_ok=True)

        self._subs = {
            INSTRUCTION_TOPIC: self.create_subscription(String, INSTRUCTION_TOPIC, self._on_instruction, QOS),
            EPISODE_TOPIC: self.create_subscription(String, EPISODE_TOPIC, self._on_event, QOS),
            JOINT_TOPIC: self.create_subscription(JointState, JOINT_TOPIC, self._on_joint, QOS),
        }
        if self._image_shape is not None:
            self._subs[IMAGE_TOPIC] = self.create_subscription(Image, IMAGE_TOPIC, self._on_image, QOS)
        self.registry = PolicyRegistry(self.store.root)
        self.policy_version = 0
        self._robot = RemoteRobot(self._action_space)
        if cfg.serve_policy:
            self._policy: Policy = build_policy({}, {"kind": cfg.policy})
            self._action_pub = self.create_publisher(JointState, ACTION_TOPIC, QOS)
        else:  # a served action is recorded when served, so only listen when the robot acts itself
            self._subs[ACTION_TOPIC] = self.create_subscription(JointState, ACTION_TOPIC, self._on_action, QOS)
        self._status_pub = self.create_publisher(String, STATUS_TOPIC, QOS)
        self._next_beat = 0.0
        self.write_status("running")

    def _owner(self, ns: int) -> _Episode | None:
        return next((ep for ep in reversed(self._open) if ep.owns(ns)), None)

    # --- incoming messages ----------------------------------------------------------
    def _reject(self, kind: str, detail: str) -> None:
        self.malformed[kind] += 1
        ep = self._open[-1] if self._open else None  # the episode in progress
        if ep is not None and ep.tainted is None:
            ep.tainted = kind
        where = f"; discarding episode {ep.index}" if ep is not None else ""
        self.get_logger().warning(f"dropped malformed message ({kind}): {detail}{where}")
        self.write_status("running")

    def _accept(self, topic: str, ns: int, key: str, value: np.ndarray) -> None:
        last = self._last.get(topic, 0)
        if ns <= last:
            self._reject("out_of_order", f"{topic} stamp {ns} is not after {last}")
            return
        self._last[topic] = ns
        self._last_rx = time.monotonic()
        if ns <= self._closed_until:
            return  # straggler of an episode already closed
        self._pool.setdefault(ns, {})[key] = value
        ep = self._owner(ns)
        if ep is not None:  # else its start event has not arrived yet
            ep.last_rx, ep.last_stamp = self._last_rx, max(ep.last_stamp, ns)
            self._serve(ep, ns)
            self._try_finish(ep)

    def _on_joint(self, msg: JointState) -> None:
        proprio = np.asarray(msg.position, dtype=np.float64)
        if proprio.shape != (self._proprio_dim,) or (msg.name and len(msg.name) != len(msg.position)):
            self._reject("joint_length", f"{len(msg.position)} positions, expected {self._proprio_dim}")
        elif not np.isfinite(proprio.astype(np.float32)).all():
            self._reject("nan", f"{JOINT_TOPIC} holds NaN/inf")
        else:
            self._accept(JOINT_TOPIC, stamp_ns(msg.header), "proprio", proprio.astype(np.float32))

    def _on_image(self, msg: Image) -> None:
        h, w, c = self._image_shape
        if msg.encoding != "rgb8":
            self._reject("image_encoding", f"encoding {msg.encoding!r}, expected 'rgb8'")
        elif (msg.height, msg.width, msg.step, len(msg.data)) != (h, w, w * c, h * w * c):
            self._reject("image_size", f"{msg.height}x{msg.width} (step {msg.step}), expected {h}x{w}")
        else:
            image = np.frombuffer(msg.data, dtype=np.uint8).reshape(h, w, c).copy()
            self._accept(IMAGE_TOPIC, stamp_ns(msg.header), "image", image)

    def _on_action(self, msg: JointState) -> None:
        action = np.asarray(msg.position, dtype=np.float32)
        space = self._action_space
        if action.shape != space.shape:
            self._reject("action_length", f"{len(msg.position)} values, expected {space.shape}")
        elif not np.isfinite(action).all():
            self._reject("nan", f"{ACTION_TOPIC} holds NaN/inf")
        elif not space.contains(action):
            self._reject("action_bounds", f"action {action.tolist()} outside [{space.low}, {space.high}]")
        else:
            self._accept(ACTION_TOPIC, stamp_ns(msg.header), "action", action)

    def _on_instruction(self, msg: String) -> None:
        self._instruction = msg.data

    def _on_event(self, msg: String) -> None:
        self._last_rx = time.monotonic()
        try:
            ev = json.loads(msg.data)
            kind = ev["event"]
            if kind == "start":
                self._on_start(ev)
            elif kind == "end":
                self._on_end(ev)
            else:
                raise ValueError(f"unknown event {kind!r}")
        except (ValueError, KeyError, TypeError) as e:
            self._reject("event", f"bad episode event {msg.data[:200]!r}: {e}")

    def _on_start(self, ev: dict[str, Any]) -> None:
        start, index, seed, task = int(ev["stamp"]), int(ev["episode"]), int(ev["seed"]), str(ev["task"])
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}")
        if start <= self._closed_until or any(ep.index == index or ep.start >= start for ep in self._open):
            raise ValueError(f"episode {index} starts at {start}, not after the episodes already seen")
        # The event's instruction is tied to this episode; the topic's latest one may not be yet.
        instruction = str(ev.get("instruction", self._instruction))
        version, tainted = int(ev.get("policy_version", 0)), None
        if self.cfg.serve_policy:
            try:
                version = self._prepare_policy(instruction, task, seed)
            except Exception as e:  # a broken artifact must not take the bridge down
                self.get_logger().error(f"cannot prepare a policy for episode {index}: {e!r}")
                version, tainted = self.policy_version, "policy_error"
        ep = _Episode(index, seed, task, TASKS.index(task), instruction, start, version, time.monotonic(), start,
                      tainted=tainted)
        # Data before this start that no open episode owns can never be used (e.g. we joined mid-episode).
        self._pool = {ns: v for ns, v in self._pool.items() if ns >= start or self._owner(ns)}
        self._open.append(ep)
        for ns in sorted(ns for ns in self._pool if ns >= start):  # data that overtook the event
            ep.last_stamp = ns
            self._serve(ep, ns)

    def _on_end(self, ev: dict[str, Any]) -> None:
        ep = next((e for e in self._open if e.index == int(ev["episode"]) and e.end is None), None)
        if ep is None:
            self.get_logger().info(f"end of episode {ev['episode']}, which is not open; ignored")
            return
        length, rewards, stamp = int(ev["length"]), [float(r) for r in ev["rewards"]], int(ev["stamp"])
        if len(rewards) != length or stamp < ep.start:
            raise ValueError(f"{len(rewards)} rewards for {length} steps, end stamp {stamp}")
        ep.end = {**ev, "length": length, "rewards": rewards, "stamp": stamp}
        ep.last_rx = time.monotonic()
        self._final_seen |= bool(ev.get("final"))
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
            ep.tainted = ep.tainted or "policy_error"
            return
        if action.shape != self._action_space.shape or not np.isfinite(action).all():
            ep.tainted = ep.tainted or "policy_error"
            self.get_logger().error(f"policy v{self.policy_version} returned {action!r}; not served")
            return
        step["action"] = action
        self._action_pub.publish(joint_msg(ns, ACTION_NAMES, action))

    # --- episode completion -----------------------------------------------------------
    def _obs(self, step: dict[str, np.ndarray], ep: _Episode) -> dict[str, Any]:
        obs = {k: step[k] for k in self._obs_keys}
        obs["task_id"] = np.int64(ep.task_index)
        return obs

    def _try_finish(self, ep: _Episode) -> None:
        if ep.end is None:
            return
        if ep.end.get("aborted"):
            self._discard(ep, "aborted")
            return
        if ep.tainted:
            self._discard(ep, "policy_error" if ep.tainted == "policy_error" else "malformed")
            return
        T = ep.end["length"]
        stamps = sorted(ns for ns in self._pool if ep.owns(ns))
        if len(stamps) > T + 1:
            self._discard(ep, "inconsistent")
            return
        complete = (
            len(stamps) == T + 1
            and all(self._obs_keys <= self._pool[ns].keys() for ns in stamps)
            and all("action" in self._pool[ns] for ns in stamps[:T])
        )
        if complete:  # else stragglers are still in flight; the silence deadline bounds the wait
            self._commit(ep, stamps)

    def _commit(self, ep: _Episode, stamps: list[int]) -> None:
        end, steps = ep.end, [self._pool[ns] for ns in stamps]
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
                attrs={"source": "ros2", "namespace": self.get_namespace(), "robot_episode": ep.index},
            )
        except EpisodeValidationError as e:
            self.get_logger().warning(f"episode {ep.index} rejected by the store: {e}")
            self._discard(ep, "invalid")
            return
        self.committed += 1
        self.get_logger().info(f"committed episode {ep.index} ({T} steps) to shard {self.cfg.client_id}")
        self._close(ep)

    def _discard(self, ep: _Episode, reason: str) -> None:
        self.discarded[reason] += 1
        self.writer.discard()
        self.get_logger().warning(f"discarded episode {ep.index} ({reason}{': ' + ep.tainted if ep.tainted else ''})")
        self._close(ep)

    def _close(self, ep: _Episode) -> None:
        """Forget an episode and every message up to its last stamp."""
        self._open.remove(ep)
        self._closed_until = max(self._closed_until, ep.end["stamp"] if ep.end is not None else ep.last_stamp)
        self._pool = {ns: v for ns, v in self._pool.items() if ns > self._closed_until}
        self.done = self.cfg.exit_on_final and self._final_seen and not self._open
        self.write_status("running")

    def tick(self) -> None:
        """Publish the heartbeat when due and enforce the silence deadline of every open
        episode; call periodically."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + HEARTBEAT_S
            matched = {topic: sub.get_publisher_count() for topic, sub in self._subs.items()}
            if self.cfg.serve_policy:
                matched[ACTION_TOPIC] = self._action_pub.get_subscription_count()
            self._status_pub.publish(String(data=json.dumps({**self._status("running"), "matched": matched})))
        for ep in [e for e in self._open if now - e.last_rx > self.cfg.timeout]:
            self._discard(ep, "timeout")
        if not self._open and now - self._last_rx > self.cfg.timeout:
            self._pool.clear()  # data whose start event never came

    def _status(self, state: str) -> dict[str, Any]:
        return {
            "client_id": self.cfg.client_id, "pid": os.getpid(), "state": state, "kind": "ros2-bridge",
            "episodes": self.writer.n_episodes, "steps": self.writer.n_steps, "committed": self.committed,
            "malformed": dict(self.malformed), "discarded": dict(self.discarded),
            "policy_version": self.policy_version,
        }

    def write_status(self, state: str) -> dict[str, Any]:
        """Write and return the bridge status (``STORE/fleet/<client_id>.json``)."""
        status = self._status(state)
        write_json_atomic(self._status_path, status, fsync=False)
        return status

    def close(self) -> dict[str, Any]:
        """Discard the episodes still open, release the shard and write the final status."""
        for ep in list(self._open):
            self._discard(ep, "shutdown")
        status = self.write_status("stopped")
        self.writer.close()
        self.destroy_node()
        return status


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


USAGE = """usage: robo-post fleet ros2-bridge store=PATH [key=value ...]
       robo-post fleet ros2-sim [key=value ...]
`robo-post fleet ros2-bridge --help` (or ros2-sim) lists the keys."""


def main(argv: list[str]) -> int:
    """``robo-post fleet ros2-bridge|ros2-sim key=value ...``."""
    commands = {"ros2-bridge": (BridgeConfig, run_bridge), "ros2-sim": (SimConfig, run_sim)}
    if not argv or argv[0] not in commands:
        print(USAGE, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    cls, run = commands[argv[0]]
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(cls.__doc__)
        return 0
    try:
        cfg = parse_config(cls, argv[1:])
    except (TypeError, ValueError) as e:
        print(f"robo-post fleet {argv[0]}: {e}", file=sys.stderr)
        return 2
    if argv[0] == "ros2-bridge":
        print(json.dumps(run(cfg)), flush=True)
    else:
        run(cfg)
    return 0
