"""ROS 2 bridge: record a robot's episodes from standard topics into a store shard and
serve the registry's policy back to it; plus a simulated robot that speaks the same topics.

What is recorded comes from a robot description (``robot=NAME|PATH.yaml``;
``RobotDescription``): joint names and order, which JointState fields are recorded,
action names and bounds, camera size and encoding (or no camera), task vocabulary, the
episode limit ``max_steps``, and the simulator ``ros2-sim`` runs for it. The store
schema is derived from it and keeps the robot's name and layout (joint, field, action and
task names in order): a store recorded from another robot, or with another layout, is
refused. ``configs/robots/tabletop.yaml`` is the default (``robo_post.fleet.robot``).

The bridge's subscription callbacks hand every message to an ``EpisodeRecorder``
(``robo_post.fleet.recorder``), which does what Alignment and Bursts below say; ``robo-post
store import-rosbag`` (``robo_post.fleet.rosbag``) feeds a recording of these topics to the same
recorder, so a bag is recorded as the bridge records the robot live.

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

import json
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import rclpy
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
from robo_post.fleet.recorder import (ACTION_TOPIC, EPISODE_TOPIC, IMAGE_TOPIC, INSTRUCTION_TOPIC, JOINT_TOPIC,
                                      EpisodeRecorder, stamp_ns)
from robo_post.fleet.robot import (DEFAULT_ROBOT, MalformedMessage, RobotDescription, RobotDescriptionError,
                                   image_msg)
from robo_post.fleet.robot import joint_msg  # noqa: F401  (re-exported: the message builders live beside the topics)
from robo_post.fleet.settings import parse_config
from robo_post.store import PolicyRegistry, ShardLockedError, Store, StoreNotFoundError
from robo_post.utils.io import try_lock, write_json_atomic

STATUS_TOPIC = "bridge/status"
HEARTBEAT_S = 0.25  # bridge status topic period
STATUS_FILE_S = 1.0  # status file refresh period (its heartbeat)
STALE_S = 10.0  # a running bridge whose status file heartbeat is older than this is dead
STATUS_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.VOLATILE,
)
SIM_SHARD = "ros2-sim"  # name mixed into the sim's episode seeds


def topic_qos(depth: int) -> QoSProfile:
    """Reliable, volatile, keep-last ``depth``: the QoS of every robot topic."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST, depth=depth, reliability=ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.VOLATILE,
    )



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


class BridgeNode(Node):
    """Records episodes from the robot's topics into one store shard; optionally serves actions.

    Its subscription callbacks hand every message to an ``EpisodeRecorder``
    (``self.recorder``), which aligns, validates, commits and discards; ``robo-post store
    import-rosbag`` feeds a recording to the same recorder. Several episodes can be open at
    once: the executor takes one message per topic per wake-up, so the few event messages
    overtake the many data messages.

    Counters (the recorder's): ``malformed`` (message kind -> count), ``lost`` (topic ->
    messages DDS dropped) and ``discarded`` (reason -> episodes); all go to
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
        self.recorder = EpisodeRecorder(
            self.robot, self.writer, max_steps=self.max_steps, depth=self.depth,
            attrs={"source": "ros2", "namespace": self.get_namespace()}, log=self.get_logger(), now=time.monotonic(),
            on_change=lambda: self.write_status("running"), server=self if cfg.serve_policy else None)
        self.wrong_type: dict[str, list[str]] = {}  # topic -> foreign message types seen on it
        self.other_bridges = 0  # other bridges on this namespace: each records every episode
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

    # --- the recorder's state ---------------------------------------------------------
    @property
    def done(self) -> bool:
        """With ``exit_on_final``: the final episode is committed or discarded, and none is open."""
        return self.cfg.exit_on_final and self.recorder.final_seen and not self.recorder.open_episodes

    # --- subscription callbacks ---------------------------------------------------------
    def _on_joint(self, msg: JointState, info: dict[str, Any]) -> None:
        self.recorder.on_data(JOINT_TOPIC, msg, info, time.monotonic())

    def _on_image(self, msg: Image, info: dict[str, Any]) -> None:
        self.recorder.on_data(IMAGE_TOPIC, msg, info, time.monotonic())

    def _on_action(self, msg: JointState, info: dict[str, Any]) -> None:
        self.recorder.on_data(ACTION_TOPIC, msg, info, time.monotonic())

    def _on_instruction(self, msg: String) -> None:
        self.recorder.on_instruction(msg.data)

    def _on_event(self, msg: String, info: dict[str, Any]) -> None:
        self.recorder.on_event(msg.data, info, time.monotonic())

    # --- serving (the recorder's ActionServer) -----------------------------------------
    def prepare(self, index: int, instruction: str, task: str, seed: int) -> tuple[int, bool]:
        """The policy version episode ``index`` runs, and whether preparing it failed."""
        try:
            return self._prepare_policy(instruction, task, seed), False
        except Exception as e:  # a broken artifact must not take the bridge down
            self.get_logger().error(f"cannot prepare a policy for episode {index}: {e!r}")
            return self.policy_version, True

    def _prepare_policy(self, instruction: str, task: str, seed: int) -> int:
        """Hot-swap to the newest registry version (only ever here, between episodes) and reset."""
        latest = self.registry.latest() if self.cfg.follow_registry else None
        if latest is not None and latest != self.policy_version:
            self._policy, self.policy_version = build_policy(*self.registry.load(latest)), latest
        self._robot.instruction, self._robot.task = instruction, task
        self._policy.reset(self._robot, seed)
        return self.policy_version

    def act(self, obs: dict[str, Any], ns: int) -> np.ndarray | None:
        """Publish the policy's action for ``obs`` stamped ``ns`` and return it (None if the policy failed)."""
        try:
            action = np.asarray(self._policy.act(obs, self._robot), dtype=np.float32)
            action = np.clip(action, self._action_space.low, self._action_space.high)
        except Exception as e:  # a broken policy must not take the bridge down
            self.get_logger().error(f"policy v{self.policy_version} failed: {e!r}")
            return None
        if action.shape != self._action_space.shape or not np.isfinite(action).all():
            self.get_logger().error(f"policy v{self.policy_version} returned {action!r}; not served")
            return None
        self._action_pub.publish(self.robot.action_msg(ns, action))
        return action

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
        self.recorder.expire(now, self.cfg.timeout)

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
            "committed": self.recorder.committed, "malformed": dict(self.recorder.malformed),
            "discarded": dict(self.recorder.discarded), "lost": dict(self.recorder.lost), "wrong_type": self.wrong_type, "other_bridges": self.other_bridges,
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
        self.recorder.shutdown()
        self.get_logger().info(f"stopping: committed={self.recorder.committed} to shard {self.cfg.client_id}; "
                               f"{self.recorder.discard_summary()}")
        status = self.write_status("stopped")
        self.writer.close()
        os.close(self._namespace_lock)
        self.destroy_node()
        return status


# --- status -------------------------------------------------------------------------
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
