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

Modules: the settings and the topics' QoS (``ros2_settings``), the simulated robot
(``ros2_sim``), the bridge node (``ros2_bridge``), a bridge's liveness (``bridge_status``);
this one runs them as processes and is the ``robo-post fleet`` command.

Environment: importing this module defaults ``RMW_IMPLEMENTATION=rmw_fastrtps_cpp`` (the
middleware the ``ros`` extra installs) and ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``
(discovery stays on loopback). Export ``ROS_AUTOMATIC_DISCOVERY_RANGE=SUBNET`` to reach
a robot on the network. The domain comes from ``domain_id=`` (default ``$ROS_DOMAIN_ID``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

import rclpy
from rclpy.context import Context
from rclpy.exceptions import InvalidNamespaceException
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from rclpy.validate_namespace import validate_namespace

from robo_post.fleet.bridge_status import BridgeStatusError, bridge_statuses, read_bridge_status
from robo_post.fleet.robot import RobotDescription, RobotDescriptionError
from robo_post.fleet.ros2_bridge import BridgeNode
from robo_post.fleet.ros2_settings import BridgeConfig, SimConfig, StatusConfig, parse_faults
from robo_post.fleet.ros2_sim import SimRobotNode
from robo_post.fleet.settings import parse_config


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
