"""The ROS 2 bridge node (``robo-post fleet ros2-bridge``): records a robot's episodes from its
topics into one store shard and optionally serves the registry's policy back to it (the
protocol: ``robo_post.fleet.ros2``)."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces
from rclpy.context import Context
from rclpy.node import Node
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from robo_post.fleet.policies import Policy, build_policy
from robo_post.fleet.recorder import (ACTION_TOPIC, EPISODE_TOPIC, IMAGE_TOPIC, INSTRUCTION_TOPIC, JOINT_TOPIC,
                                      EpisodeRecorder)
from robo_post.fleet.robot import RobotDescription
from robo_post.fleet.ros2_settings import (HEARTBEAT_S, STATUS_QOS, STATUS_TOPIC, BridgeConfig, queue_depth,
                                           topic_qos)
from robo_post.store import PolicyRegistry, ShardLockedError, Store, StoreNotFoundError
from robo_post.utils.io import host_dir
from robo_post.utils.io import try_lock, write_json_atomic

STATUS_FILE_S = 1.0  # status file refresh period (its heartbeat)


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
        os.makedirs(host_dir(self.store.root, "fleet"), exist_ok=True)
        self._namespace_lock = try_lock(
            os.path.join(host_dir(self.store.root, "fleet"), f".ros2-{domain}-{where.strip('/').replace('/', '.')}.lock"),
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
        self._status_path = os.path.join(host_dir(self.store.root, "fleet"), f"{cfg.client_id}.json")
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
