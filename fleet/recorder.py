"""Episodes from a robot's messages: stamp alignment, validation, discard counts, commits.

``EpisodeRecorder`` is the one code path from messages to store episodes. The live ROS 2
bridge (``robo_post.fleet.ros2_bridge.BridgeNode``) feeds it from its subscription callbacks;
``robo-post store import-rosbag`` (``robo_post.fleet.rosbag``) feeds it a recording's
messages in recorded order. Each message comes as its topic (relative to the robot's
namespace), the decoded message (rclpy's, or a bag reader's with the same fields), the
middleware's message info (publisher sequence numbers; empty from a bag) and the time it
was received on a monotonic clock in seconds (``time.monotonic()`` live, the bag's
receive timestamps when importing). The rules (which stamps an episode owns, what is
malformed, when an episode is discarded and why) are the bridge protocol's: see the
docstring of ``robo_post.fleet.ros2``, Alignment and Bursts.

Nothing here needs rclpy.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from robo_post.fleet.robot import MalformedMessage, RobotDescription
from robo_post.store import EpisodeValidationError, ShardWriter

JOINT_TOPIC, IMAGE_TOPIC, INSTRUCTION_TOPIC, ACTION_TOPIC, EPISODE_TOPIC = (
    "joint_states", "camera/image", "instruction", "action", "episode",
)
END_FLAGS = ("success", "terminated", "truncated", "aborted", "final")  # booleans of an end event
REQUIRED_END_FLAGS = ("success", "terminated", "truncated")  # the rest default to false


def stamp_ns(header: Any) -> int:
    """A header's stamp as integer nanoseconds (the alignment key)."""
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


class Log(Protocol):
    """Where the recorder says what it did: an rclpy node's logger or a ``logging.Logger``."""

    def info(self, message: str) -> Any: ...

    def warning(self, message: str) -> Any: ...

    def error(self, message: str) -> Any: ...


class ActionServer(Protocol):
    """A policy the live bridge serves to the robot: the recorder asks it for each episode's
    policy version and, once an observation is complete, for the action to record there."""

    def prepare(self, index: int, instruction: str, task: str, seed: int) -> tuple[int, bool]:
        """The policy version episode ``index`` runs, and whether preparing the policy failed."""
        ...

    def act(self, obs: dict[str, Any], ns: int) -> np.ndarray | None:
        """The action served at stamp ``ns`` for ``obs``, or None if the policy failed."""
        ...


@dataclass
class OpenEpisode:
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


class EpisodeRecorder:
    """Assembles a robot's messages into episodes, validates them and commits each complete
    one to ``writer``'s shard; anything malformed or missing discards only the episode that
    owns its stamp.

    Several episodes can be open at once: topics are delivered independently, so the few
    event messages overtake the many data messages. Every message, good or bad, belongs to
    the open episode with the latest start stamp at or before its own (and, once that
    episode's end is known, at or before its end stamp).

    Counters: ``malformed`` (message kind -> count), ``lost`` (topic -> messages the
    middleware dropped, from gaps in publisher sequence numbers) and ``discarded`` (reason ->
    episodes), with ``committed``.

    Args:
        robot: what is recorded and how messages are checked.
        writer: the shard the episodes are committed to.
        max_steps: longer episodes are discarded as ``too_long``.
        depth: messages per topic queue (named when messages were lost).
        attrs: episode attrs of every commit (``source``, ``namespace``, ...), besides the
            robot's name, the robot's episode index and the first and last stamps.
        log: where each commit, discard and dropped message is said.
        now: the receive clock's reading at the start (seconds).
        on_change: called after each change of the counters (the bridge writes its status).
        server: the policy the bridge serves, which then provides the actions (None: they
            come as ``ACTION_TOPIC`` messages).
    """

    def __init__(self, robot: RobotDescription, writer: ShardWriter, *, max_steps: int, depth: int,
                 attrs: Mapping[str, Any], log: Log, now: float, on_change: Callable[[], None] = lambda: None,
                 server: ActionServer | None = None):
        self.robot, self.writer, self.max_steps, self.depth = robot, writer, max_steps, depth
        self.attrs, self.log, self.on_change, self.server = dict(attrs), log, on_change, server
        self._obs_keys = {robot.joint_key} | ({robot.camera.key} if robot.camera else set())
        # data topic -> (parser, key of its value in a pooled step)
        self._parsers: dict[str, tuple[Callable[[Any], np.ndarray], str]] = {
            JOINT_TOPIC: (robot.parse_joints, robot.joint_key)}
        if robot.camera is not None:
            self._parsers[IMAGE_TOPIC] = (robot.parse_image, robot.camera.key)
        if server is None:  # a served action is recorded when served
            self._parsers[ACTION_TOPIC] = (robot.parse_action, "action")
        self.malformed: Counter[str] = Counter()
        self.discarded: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()
        self.committed = 0
        self.final_seen = False  # an end event flagged the robot's last episode
        self._pool: dict[int, dict[str, np.ndarray]] = {}  # stamp -> {observation keys, "action"}
        self._faults: list[_Fault] = []
        self._last: dict[str, int] = {}  # newest accepted stamp per topic
        self._seq: dict[tuple[str, bytes], tuple[int, int]] = {}  # (topic, publisher) -> (sequence, stamp)
        self._open: list[OpenEpisode] = []  # by start stamp
        self._floor = 0  # every stamp up to here belongs to a closed episode (or none)
        self._newest = 0  # newest data stamp accepted: the floor never passes it
        self._closed: list[tuple[int, int]] = []  # stamp ranges of closed episodes above the floor
        # recent closed episodes by index, oldest first: (start stamp, seed, task) to know a start sent again
        self._closed_index: dict[int, tuple[int, int, str] | None] = {}
        self._instruction = ""
        self._last_rx = now

    @property
    def open_episodes(self) -> list[OpenEpisode]:
        """The episodes started and not yet committed or discarded, by start stamp."""
        return list(self._open)

    def on_instruction(self, text: str) -> None:
        """An ``INSTRUCTION_TOPIC`` message: the instruction of an episode whose start event has none."""
        self._instruction = text

    def on_event(self, text: str, info: Mapping[str, Any], now: float) -> None:
        """An ``EPISODE_TOPIC`` message (a JSON start or end event) received at ``now``."""
        self._last_rx = now
        ev: Any = None
        try:
            ev = json.loads(text)
            stamp = _event_int(ev, "stamp")  # int() would move 1000.7 onto stamp 1000's message
        except (ValueError, KeyError, TypeError) as e:
            self._sequence(EPISODE_TOPIC, None, info)  # it arrived: not lost, only malformed
            detail = f"bad episode event {text[:200]!r}: {e!r}"
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
            self._reject("event", stamp, f"bad episode event {text[:200]!r}: {e!r}")
            self._refused_start(ev)

    def expire(self, now: float, timeout: float) -> None:
        """Discard as ``timeout`` each open episode the robot has left: every data topic has
        delivered stamps ``timeout`` seconds past its newest message, or nothing at all was
        received for ``timeout`` seconds up to ``now``. Call it between messages."""
        # Silence is measured on the robot's clock where the recorder can: each data topic is FIFO, so
        # once every topic has delivered stamps `timeout` past an open episode's newest one, the robot
        # sent nothing more for it. Receive time since the last message of any kind only decides when
        # nothing arrives at all: an episode whose messages still queue behind the bridge's own
        # backlog (a burst, a loaded machine) is never discarded as silent.
        silent = now - self._last_rx > timeout
        clock = self._data_clock()
        late = int(timeout * 1e9)
        for ep in [e for e in self._open if silent or (clock is not None and clock - e.last_stamp > late)]:
            self._discard(ep, "timeout")
        if not self._open and silent:
            self._pool.clear()  # data whose start event never came
            self._faults.clear()

    def shutdown(self) -> None:
        """Discard the episodes still open (as ``shutdown``): no more messages will come."""
        for ep in list(self._open):
            self._discard(ep, "shutdown")

    def _owner(self, ns: int) -> OpenEpisode | None:
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
        self.log.warning(f"{detail} (stamps {lo}..{hi}: {where})")
        for ep in [e for e in self._open if e.end is not None]:
            self._try_finish(ep)
        self.on_change()

    def _reject(self, kind: str, ns: int | None, detail: str) -> None:
        self.malformed[kind] += 1
        detail = f"dropped malformed message ({kind}): {detail}"
        if ns is None:
            self.log.warning(f"{detail} (no stamp: attributed to no episode)")
            self.on_change()
        else:
            self._fault(ns, ns, "malformed", detail)

    def _fault_of(self, ep: OpenEpisode) -> str | None:
        assert ep.end is not None
        hit = [f.reason for f in self._faults if f.lo <= ep.end["stamp"] and ep.start <= f.hi]
        return "overflow" if "overflow" in hit else hit[0] if hit else None

    def _sequence(self, topic: str, ns: int | None, info: Mapping[str, Any]) -> None:
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
    def on_data(self, topic: str, msg: Any, info: Mapping[str, Any], now: float) -> None:
        """A joint, image or action message (``topic``: ``JOINT_TOPIC``, ``IMAGE_TOPIC`` or
        ``ACTION_TOPIC``) received at ``now``: validated, attributed by its stamp, pooled."""
        parse, key = self._parsers[topic]
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
        self._last_rx = now
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

    def _clock_went_back(self, stamp: int, info: Mapping[str, Any]) -> bool:
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
        self.log.warning(f"a new robot publisher starts at stamp {stamp}, before stamps already seen "
                                  "(its clock restarted): forgetting the old stamps")
        for ep in list(self._open):
            self._discard(ep, "abandoned")
        self._floor, self._newest, self._closed, self._last, self._pool, self._faults = 0, 0, [], {}, {}, []

    def _on_start(self, ev: dict[str, Any], start: int) -> None:
        index, seed, task = _event_int(ev, "episode"), _event_int(ev, "seed"), str(ev["task"])
        if task not in self.robot.tasks:
            raise ValueError(f"unknown task {task!r}; robot {self.robot.name!r} has {list(self.robot.tasks)}")
        if self._closed_index.get(index) == (start, seed, task):
            self.log.info(f"start of episode {index} (stamp {start}) received again after it closed; ignored")
            return
        # A robot runs one episode at a time and sends each end before the next start, so an
        # earlier episode of this index still awaiting its end was abandoned (the robot
        # restarted and counts from 0 again): without this the restarted robot's episode is lost.
        for ep in [e for e in self._open if e.index == index and e.end is None and e.start < start]:
            self._discard(ep, "abandoned")
        copy = next((e for e in self._open if e.index == index and e.start == start and e.seed == seed
                     and e.task == task), None)
        if copy is not None:  # the same event again (a retry): the episode is already open
            self.log.info(f"start of episode {index} (stamp {start}) received again; ignored")
            return
        # Events arrive in order, so an episode still awaiting its end that starts after this
        # start, with nothing received at or after its stamp, was stamped far ahead (another
        # clock): it alone is dropped, or every later start would be refused until it times out.
        for ep in [e for e in self._open if e.end is None and e.start > max(start, self._newest)]:
            self.malformed["event"] += 1
            self.log.warning(f"dropped malformed message (event): episode {ep.index} starts at {ep.start}, "
                                      f"after episode {index}'s start {start} and after every stamp received")
            self._discard(ep, "malformed")
        if self._is_closed(start) or any(ep.index == index or ep.start >= start for ep in self._open):
            raise ValueError(f"episode {index} starts at {start}, not after the episodes already seen")
        # The event's instruction is tied to this episode; the topic's latest one may not be yet.
        instruction = str(ev.get("instruction", self._instruction))
        version, policy_error = (_event_int(ev, "policy_version") if "policy_version" in ev else 0), False
        if self.server is not None:
            version, policy_error = self.server.prepare(index, instruction, task, seed)
        ep = OpenEpisode(index, seed, task, self.robot.tasks.index(task), instruction, start, version, start,
                      policy_error=policy_error)
        # Data before this start that no open episode owns can never be used (e.g. we joined mid-episode).
        self._pool = {ns: v for ns, v in self._pool.items() if ns >= start or self._owner(ns)}
        self._open.append(ep)
        for ns in sorted(ns for ns in self._pool if ns >= start):  # data that overtook the event
            ep.last_stamp = ns
            self._serve(ep, ns)

    def _awaiting_end(self, ev: Any) -> OpenEpisode | None:
        """The open episode an end event names, if it is one and that episode awaits its end."""
        if not isinstance(ev, dict) or ev.get("event") != "end":
            return None
        return next((e for e in self._open if e.index == ev.get("episode") and e.end is None), None)

    def _bad_end(self, ep: OpenEpisode, stamp: int, detail: str) -> None:
        """A malformed end event of ``ep``: its own episode is known by index, discard exactly that one."""
        self.malformed["event"] += 1
        self.log.warning(f"dropped malformed message (event): bad end of episode {ep.index}: {detail}")
        ep.end = {"stamp": max(stamp, ep.last_stamp)}
        self._discard(ep, "malformed")

    def _on_end(self, ev: dict[str, Any], stamp: int) -> None:
        if ev.get("final") is True:  # the robot's last episode, whether it commits, is discarded or was refused
            self.final_seen = True
        index = _event_int(ev, "episode")
        ep = self._awaiting_end({**ev, "episode": index})
        ended = next((e for e in self._open if e.index == index and e.end is not None), None)
        if ended is not None:  # its end came before (its data are still in flight)
            assert ended.end is not None
            if stamp != ended.end["stamp"] or ev.get("length") != ended.end["length"]:
                self._bad_end(ended, max(stamp, ended.end["stamp"]), f"a second end (stamp {stamp}, length {ev.get('length')!r}) "
                                            f"unlike the first (stamp {ended.end['stamp']}, length {ended.end['length']})")
            else:
                self.log.info(f"end of episode {index} (stamp {stamp}) received again; ignored")
            return
        if ep is None:
            if index in self._closed_index:
                self.log.info(f"end of episode {index}, already closed; ignored")
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
    def _serve(self, ep: OpenEpisode, ns: int) -> None:
        """Record the served action at ``ns`` once its observation is complete."""
        step = self._pool[ns]
        if self.server is None or "action" in step or not self._obs_keys <= step.keys():
            return
        action = self.server.act(self._obs(step, ep), ns)
        if action is None:
            ep.policy_error = True
        else:
            step["action"] = action

    def _obs(self, step: dict[str, np.ndarray], ep: OpenEpisode) -> dict[str, Any]:
        obs = {k: step[k] for k in self._obs_keys}
        obs[self.robot.task_key] = np.int64(ep.task_index)
        return obs

    def _try_finish(self, ep: OpenEpisode) -> None:
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

    def _commit(self, ep: OpenEpisode, stamps: list[int]) -> None:
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
                attrs={**self.attrs, "robot": self.robot.name, "robot_episode": ep.index,
                       # step timestamps are float seconds (about 0.25 us apart at wall-clock
                       # magnitudes); the first and last stamps stay exact for matching a bag
                       "start_stamp_ns": stamps[0], "end_stamp_ns": stamps[-1]},
            )
        except EpisodeValidationError as e:
            self.log.warning(f"episode {ep.index} rejected by the store: {e}")
            self._discard(ep, "invalid")
            return
        self.committed += 1
        self.log.info(f"committed episode {ep.index} ({T} steps) to shard {self.writer.client_id}")
        self._close(ep)

    def _discard(self, ep: OpenEpisode, reason: str) -> None:
        self.writer.discard()
        self._count_discard(ep.index, reason)
        self._close(ep)

    def _count_discard(self, index: Any, reason: str) -> None:
        self.discarded[reason] += 1
        self.log.warning(f"discarded episode {index} ({reason}); so far {self.discard_summary()}")

    def discard_summary(self) -> str:
        """The episodes discarded so far by reason, e.g. ``discarded 3 episodes: inconsistent=2, timeout=1``."""
        n = sum(self.discarded.values())
        reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(self.discarded.items()))
        return f"discarded {n} episode{'' if n == 1 else 's'}" + (f": {reasons}" if n else "")

    def _close(self, ep: OpenEpisode) -> None:
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
        self.on_change()

    def _data_clock(self) -> int | None:
        """The stamp up to which every data topic has delivered (None until each has delivered one)."""
        stamps = [self._last.get(t) for t in self._parsers]
        return None if None in stamps else min(stamps)


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
