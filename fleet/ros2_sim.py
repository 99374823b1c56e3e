"""The simulated robot (``robo-post fleet ros2-sim``): an env behind the same ROS 2 topics as
a real robot, for the bridge to record (the protocol: ``robo_post.fleet.ros2``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import gymnasium as gym
import numpy as np
from rclpy.context import Context
from rclpy.duration import Duration
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from robo_post.fleet.client import episode_seed, make_env
from robo_post.fleet.policies import Policy, build_policy
from robo_post.fleet.recorder import ACTION_TOPIC, EPISODE_TOPIC, IMAGE_TOPIC, INSTRUCTION_TOPIC, JOINT_TOPIC, stamp_ns
from robo_post.fleet.robot import MalformedMessage, RobotDescription, RobotDescriptionError, image_msg
from robo_post.fleet.ros2_settings import STATUS_QOS, STATUS_TOPIC, SimConfig, parse_faults, queue_depth, topic_qos

SIM_SHARD = "ros2-sim"  # name mixed into the sim's episode seeds


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
