"""The ROS 2 bridge's and simulated robot's settings (``key=value`` on the command line,
``robo-post fleet ros2-bridge|ros2-sim|ros2-status --help``) and the QoS of their topics.

Importing it sets the middleware defaults (``robo_post.fleet.ros2``, Environment).
"""

from __future__ import annotations

import os

# Must precede the first rclpy call that loads the middleware.
os.environ.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

from dataclasses import dataclass  # noqa: E402

from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402

from robo_post.fleet.bridge_status import STALE_S  # noqa: E402
from robo_post.fleet.robot import DEFAULT_ROBOT  # noqa: E402

STATUS_TOPIC = "bridge/status"
HEARTBEAT_S = 0.25  # bridge status topic period
STATUS_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.VOLATILE,
)


def topic_qos(depth: int) -> QoSProfile:
    """Reliable, volatile, keep-last ``depth``: the QoS of every robot topic."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST, depth=depth, reliability=ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.VOLATILE,
    )


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
