"""Store torture test: real SIGKILLs of writer processes, checked against what they reported.

Run from the checkout root::

    .venv/bin/python benchmarks/store_torture.py            # 100 kills for 1 and for 4 writers, ~1 min
    .venv/bin/python benchmarks/store_torture.py --quick    # 10 kills each, ~10 s
    .venv/bin/python benchmarks/store_torture.py --quick --s3             # the same on S3 (a local moto server)
    .venv/bin/python benchmarks/store_torture.py --s3-url s3://BUCKET/PREFIX  # on a real bucket (credentials: env)

For each writer count W (``--writers``, default 1 and 4), in a fresh store:

* W writer processes, one per shard, append episodes forever through ``add`` and
  ``commit``, pausing a random few ms between episodes as a recording client
  stepping its env would. Every episode's content (length uniform in 1..``MAX_T``,
  a 32x32 RGB image and a state vector per observation, action, an extra, every
  step column, task id) is a function of (seed, shard, episode index), so anyone
  can recompute it; its ``attrs`` also name the writer incarnation that wrote it.
  A writer prints ``ready <n>`` once it has opened its shard (``n``: the committed
  episodes it resumes after), ``begin <i>`` before adding episode ``i``'s steps
  and ``committed <i>`` right after ``commit`` returns, flushed, to a FIFO the
  parent reads as the lines come. Writers alternate ``fsync=True`` and
  ``fsync=False`` from one incarnation of a shard to the next, so both commit
  paths are killed and every shard mixes both.
* ``--kills`` times: SIGKILL a random live writer at a random moment of an episode
  (``Torture.kill_one``: uniform over the usual ``begin``->``committed`` time of
  its fsync mode, after its 1st..8th next ``begin``; one kill in ten instead hits
  the writer just restarted, uniform over its usual start-up time), wait until it
  is gone, check its shard against everything its writers acknowledged (nothing
  acknowledged may be missing; at most the killed writer's in-flight episode may
  be visible beyond that), then start a new writer on the shard, which must resume
  exactly at the committed count. The last W kills end the run (no restart).
  Where each kill landed is told apart afterwards from what the writer printed
  and the shard's files: opening the shard, adding steps or writing data, index
  record written but not the commit record, commit record written but the
  ``committed`` line not printed, or between episodes.
* A reader process runs throughout: it takes snapshots, loads (checksum-verified)
  every episode new since its last snapshot plus the last few of each shard before
  it (those share chunks with the rows being appended), compares them with the
  recomputed content, and checks that no shard's committed count ever shrinks.
* At the end, a fresh snapshot of the store is compared with the writers' reports
  and every visible episode with its recomputed content (and writer incarnation),
  and ``robo-post store validate``'s checks (``validate_store``) run over the store.

Columns: ``commits`` = ``committed`` lines printed; ``lost`` = acknowledged but not
visible (at a kill or at the end); ``partial`` = visible with wrong length or
content; ``acked late`` = visible but never acknowledged, each the in-flight
episode of a killed writer whose commit record was written before it could print
its line (allowed); ``reader errors`` = snapshots that failed, loads that failed
(checksum or otherwise), wrong content, or a shrinking count seen by the reader;
``validate`` = problems ``validate_store`` reports. Any other surprise (a writer
resuming at the wrong index, an unexplained extra episode, a writer dying on its
own) is listed as an anomaly. Exit status 1 if lost, partial, reader errors,
validate problems or anomalies are non-zero; the scratch store is then kept.
``--seed`` fixes the content and the kill choices, not the exact kill moments.

Writer processes are forked from a server process that imported the store once
(``--fork-server``), so a restart costs milliseconds instead of the ~1.4 s of
importing ``robo_post.store`` (numpy, zarr, torch), and kills are not spent on
interpreter start-up. The forked writer is an ordinary process; the SIGKILL is real.

On object storage (``--s3``: moto's S3 server on loopback, started for the run; ``--s3-url``: a
bucket of yours) the same checks run against a ``BucketStore``. A killed writer holds its shard's
lease until it expires, so writers there take a short lease (``S3_LEASE_S``) and a restarted one
waits for it; there is no index record apart from the commit record, so no kill lands "before
the record".
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field

import numpy as np

MAX_T = 24  # steps per episode: uniform in 1..MAX_T
IMAGE_SIDE, STATE_DIM, ACTION_DIM, AUX_DIM = 32, 7, 3, 2
READER_TAIL = 3  # episodes per shard the reader re-reads from its previous snapshot
DEATH_TIMEOUT_S = 10.0
SILENT_WRITER_S = 10.0  # a live writer that begins no episode for this long is a failure of the run
# Writers pause between episodes, mean PAUSE_PER_WRITER_S x writers (about 125 episodes/s in all),
# like a recording client stepping its env: the reader can load every episode, and the store
# stays small. Kills aim at the active part instead (see Torture.kill_one).
PAUSE_PER_WRITER_S = 0.008
KILL_SLACK = 1.0  # kill windows span the usual duration; scheduling delays put some kills just after a commit
OPEN_KILL_SHARE = 0.1  # kills aimed at a writer still opening its shard
EPISODES_BEFORE_KILL = 8  # a targeted writer is killed in its 1st..8th next episode, so shards grow
# Writers yield the CPU to the reader and the parent, so the reader keeps up with them on
# 2 cores and kills come on time; being preempted more often only adds interleavings.
WRITER_NICE = 5
PHASES = (
    ("opening", "opening the shard"),
    ("data", "adding steps or writing data"),
    ("before_record", "index record written, commit record not"),
    ("acked_late", "commit record written, ack not printed"),
    ("between", "between episodes"),
)
S3_LEASE_S = 1.0  # writer lease on object storage: how long a killed writer's shard stays taken


# --- the synthetic episodes, recomputable from (seed, shard, index) -----------------------
def make_schema():
    from robo_post.store import ArraySpec, StoreSchema

    return StoreSchema(
        observations={
            "image": ArraySpec("uint8", (IMAGE_SIDE, IMAGE_SIDE, 3)),
            "state": ArraySpec("float32", (STATE_DIM,)),
        },
        action=ArraySpec("float32", (ACTION_DIM,), -1.0, 1.0),
        extras={"aux": ArraySpec("float32", (AUX_DIM,))},
    )


def make_episode(seed: int, shard: str, index: int) -> dict:
    """Every stored value of episode ``index`` of ``shard``; observations have T + 1 rows."""
    rng = np.random.default_rng([seed, zlib.crc32(shard.encode()), index])
    T = int(rng.integers(1, MAX_T + 1))
    terminated = bool(rng.random() < 0.5)
    return {
        "T": T,
        "image": rng.integers(0, 256, (T + 1, IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8),
        "state": rng.standard_normal((T + 1, STATE_DIM)).astype(np.float32),
        "action": rng.uniform(-1, 1, (T, ACTION_DIM)).astype(np.float32),
        "aux": rng.standard_normal((T, AUX_DIM)).astype(np.float32),
        "reward": rng.standard_normal(T),
        "terminated": np.arange(T) == (T - 1 if terminated else T),
        "truncated": np.arange(T) == (T if terminated else T - 1),
        "policy_version": np.full(T, index % 7),
        "intervention": rng.random(T) < 0.1,
        "timestamp": 1.7e9 + index + 0.01 * np.arange(T),
        "behavior_logprob": rng.standard_normal(T),
        "task_id": f"task{index % 3}",
    }


def content_errors(expected: dict, loaded: dict, attrs: dict) -> list[str]:
    """What differs between an episode as recomputed and as loaded from a snapshot."""
    info = loaded["info"]
    if info.length != expected["T"]:
        return [f"length {info.length}, expected {expected['T']}"]
    errors = []
    arrays = {"image": loaded["obs"]["image"], "state": loaded["obs"]["state"], "action": loaded["action"],
              "aux": loaded["extras"]["aux"]}
    arrays.update({name: loaded[name] for name in ("reward", "terminated", "truncated", "policy_version",
                                                     "intervention", "timestamp", "behavior_logprob")})
    errors += [f"{name} differs" for name, values in arrays.items() if not np.array_equal(values, expected[name])]
    if info.task_id != expected["task_id"]:
        errors.append(f"task_id {info.task_id!r}, expected {expected['task_id']!r}")
    if any(info.attrs.get(k) != v for k, v in attrs.items()):
        errors.append(f"attrs {info.attrs}, expected {attrs}")
    return errors


# --- the child processes ---------------------------------------------------------------------
def run_writer(root: str, shard: str, seed: int, incarnation: int, fsync: bool, pause_s: float) -> None:
    """Append this shard's episodes forever, from its committed count on, pausing uniform
    in [0, 2 x ``pause_s``] before each, and print what it does."""
    from robo_post.store import ShardLockedError, Store
    from robo_post.utils.io import is_object_url

    lease = {"lease_s": S3_LEASE_S} if is_object_url(root) else {}
    while True:
        try:
            writer = Store.open(root).writer(shard, fsync=fsync, **lease)
            break
        except ShardLockedError:
            if not lease:
                raise
            time.sleep(0.05)  # on object storage: until the killed writer's lease runs out
    index = writer.n_episodes
    print(f"ready {index}", flush=True)
    while True:
        time.sleep(random.uniform(0.0, 2 * pause_s))
        ep = make_episode(seed, shard, index)
        print(f"begin {index}", flush=True)
        for t in range(ep["T"]):  # the step-wise path a recording client uses
            writer.add(
                {"image": ep["image"][t], "state": ep["state"][t]}, ep["action"][t], float(ep["reward"][t]),
                terminated=bool(ep["terminated"][t]), truncated=bool(ep["truncated"][t]),
                policy_version=int(ep["policy_version"][t]), intervention=bool(ep["intervention"][t]),
                timestamp=float(ep["timestamp"][t]), behavior_logprob=float(ep["behavior_logprob"][t]),
                extras={"aux": ep["aux"][t]},
            )
        committed = writer.commit(
            {"image": ep["image"][-1], "state": ep["state"][-1]}, task_id=ep["task_id"],
            attrs={"shard": shard, "index": index, "incarnation": incarnation},
        )
        print(f"committed {committed}", flush=True)
        index = committed + 1


def fork_server(root: str, seed: int) -> None:
    """Import the store once, then fork one writer per JSON request line on stdin
    (``{"shard", "incarnation", "fsync", "pause_s", "out", "err"}``: ``out`` a FIFO for its
    stdout, ``err`` a file for its stderr), answering each with the child's pid."""
    import robo_post.store  # noqa: F401  (the import every forked writer then shares)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel: a dead pid vanishes
    print("warm", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.nice(WRITER_NICE)
                for fd, path, flags in ((1, request["out"], os.O_WRONLY), (2, request["err"], os.O_WRONLY | os.O_CREAT)):
                    target = os.open(path, flags, 0o644)
                    os.dup2(target, fd)
                    os.close(target)
                run_writer(root, request["shard"], seed, request["incarnation"], request["fsync"], request["pause_s"])
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)  # a writer ends only by an error or a kill; never fall back into the server loop
        print(pid, flush=True)


def run_reader(root: str, seed: int, stop_path: str) -> None:
    """Snapshot and load episodes until ``stop_path`` exists; print ``warm`` when started,
    then a JSON summary line."""
    from robo_post.store import Store

    store = Store.open(root)
    loaded: dict[str, int] = {}  # shard -> episodes its snapshots held so far
    stats = {"snapshots": 0, "loads": 0, "errors": 0, "first_errors": []}

    def error(what: str) -> None:
        stats["errors"] += 1
        if len(stats["first_errors"]) < 10:
            stats["first_errors"].append(what)

    print("warm", flush=True)
    while not os.path.exists(stop_path):
        try:
            snap = store.snapshot(record=False)
            stats["snapshots"] += 1
            for shard, counts in snap.counts.items():
                if counts["episodes"] < loaded.get(shard, 0):
                    error(f"{shard}: {counts['episodes']} committed episodes after {loaded[shard]}")
            for ep in snap:
                if ep.episode < loaded.get(ep.client_id, 0) - READER_TAIL:
                    continue
                stats["loads"] += 1
                data = snap.load(ep)  # verifies the checksum
                wrong = content_errors(make_episode(seed, ep.client_id, ep.episode), data,
                                       {"shard": ep.client_id, "index": ep.episode})
                if wrong:
                    error(f"{ep.key}: {'; '.join(wrong)}")
            loaded.update({shard: max(c["episodes"], loaded.get(shard, 0)) for shard, c in snap.counts.items()})
        except Exception as e:  # any failure to read committed data is what this test looks for
            error(repr(e))
        time.sleep(0.005)
    stats["covered"] = sum(loaded.values())
    print(json.dumps(stats), flush=True)


# --- the parent ---------------------------------------------------------------------------------
@dataclass
class Incarnation:
    """One writer process of a shard, and the lines it printed so far (with arrival times)."""

    shard: str
    number: int
    fsync: bool
    pid: int
    base: str  # path prefix of its stdout FIFO (.out) and stderr file (.err)
    fd: int  # read end of its stdout
    keep_open: int  # a write end held by the parent, so the read end never sees EOF
    start_count: int  # committed episodes of the shard when it was started
    started: float
    lines: list[tuple[float, str, int]] = field(default_factory=list)
    begins: int = 0
    partial: bytes = b""


@dataclass
class ShardBook:
    """What the writers of one shard reported, and what was seen on disk."""

    acked: dict[int, int] = field(default_factory=dict)  # episode -> incarnation that printed "committed"
    late: dict[int, int] = field(default_factory=dict)  # episode -> killed incarnation it was in flight in
    lost: set[int] = field(default_factory=set)
    incarnations: int = 0


class Torture:
    """One run for one writer count: start, kill, restart, check."""

    def __init__(self, root: str, n_writers: int, seed: int, rnd: random.Random, work: str):
        from robo_post.store import Store

        self.store = Store.create(root, make_schema())
        self.root, self.seed, self.rnd = root, seed, rnd
        self.work = work
        os.makedirs(self.work)
        self.shards = [f"w{i}" for i in range(n_writers)]
        self.pause_s = PAUSE_PER_WRITER_S * n_writers
        self.books = {s: ShardBook() for s in self.shards}
        self.phases = {key: 0 for key, _ in PHASES}
        self.anomalies: list[str] = []
        self.live: dict[str, Incarnation] = {}
        # Recent begin->committed times per fsync mode, and start->ready times: the kill windows.
        self.durations = {mode: collections.deque(maxlen=50) for mode in (False, True)}
        self.open_durations: collections.deque = collections.deque(maxlen=50)
        here = os.path.abspath(__file__)
        self.server = subprocess.Popen([sys.executable, here, "--fork-server", root, str(seed)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.reader = None
        if self.server.stdout.readline().strip() != "warm":
            raise RuntimeError("the writer fork server failed to start")
        self.stop_path = os.path.join(self.work, "stop-reader")
        self.reader = subprocess.Popen([sys.executable, here, "--reader", root, str(seed), self.stop_path],
                                       stdout=subprocess.PIPE, text=True)
        if self.reader.stdout.readline().strip() != "warm":
            raise RuntimeError("the reader process failed to start")

    # --- writers ----------------------------------------------------------------------------
    def start(self, shard: str) -> Incarnation:
        """Fork a new writer of ``shard``."""
        book = self.books[shard]
        number = book.incarnations
        book.incarnations += 1
        base = os.path.join(self.work, f"{shard}-{number}")
        os.mkfifo(base + ".out")
        fd = os.open(base + ".out", os.O_RDONLY | os.O_NONBLOCK)
        keep_open = os.open(base + ".out", os.O_WRONLY)
        fsync = number % 2 == 0
        request = {"shard": shard, "incarnation": number, "fsync": fsync, "out": base + ".out",
                   "err": base + ".err", "pause_s": self.pause_s}
        start_count = self.store.read_commit(shard)["episodes"]
        started = time.perf_counter()
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        pid = int(self.server.stdout.readline())
        inc = Incarnation(shard, number, fsync, pid, base, fd, keep_open, start_count, started)
        self.live[shard] = inc
        return inc

    def pump(self, until: float, done=lambda: False) -> bool:
        """Read what the live writers print until ``until`` (perf_counter) or ``done()``."""
        by_fd = {inc.fd: inc for inc in self.live.values()}
        while not done():
            timeout = until - time.perf_counter()
            if timeout <= 0:
                return False
            readable, _, _ = select.select(list(by_fd), [], [], timeout)
            now = time.perf_counter()
            for fd in readable:
                self._feed(by_fd[fd], now)
        return True

    def _feed(self, inc: Incarnation, now: float) -> None:
        try:
            data = os.read(inc.fd, 1 << 16)
        except BlockingIOError:
            return
        *complete, inc.partial = (inc.partial + data).split(b"\n")
        for raw in complete:
            word, _, value = raw.decode(errors="replace").partition(" ")
            if word not in ("ready", "begin", "committed") or not value.isdigit():
                self.anomalies.append(f"{inc.shard} writer {inc.number} printed {raw!r}")
                continue
            index = int(value)
            inc.lines.append((now, word, index))
            if word == "ready":
                self.open_durations.append(now - inc.started)
            elif word == "begin":
                inc.begins += 1
            else:
                began = [t for t, w, i in inc.lines if w == "begin" and i == index]
                if began:
                    self.durations[inc.fsync].append(now - began[-1])

    def kill_one(self, fresh: Incarnation | None) -> str:
        """SIGKILL a writer at a random moment; return its shard.

        With chance ``OPEN_KILL_SHARE``, the writer just started (``fresh``) within its
        usual start-up time; otherwise a random writer, uniform in [0, ``KILL_SLACK`` x the usual
        begin->committed time of its fsync mode] after it prints ``begin`` for the
        n-th time from now, n uniform in 1..``EPISODES_BEFORE_KILL``.
        """
        if fresh is not None and self.rnd.random() < OPEN_KILL_SHARE:
            inc = fresh
            until = inc.started + self.rnd.uniform(0.0, KILL_SLACK * _median(self.open_durations, 0.03))
        else:
            inc = self.live[self.rnd.choice(sorted(self.live))]
            begins = inc.begins + self.rnd.randint(1, EPISODES_BEFORE_KILL)
            if not self.pump(time.perf_counter() + SILENT_WRITER_S, lambda: inc.begins >= begins):
                raise RuntimeError(f"{inc.shard} writer {inc.number} began no episode in {SILENT_WRITER_S} s: "
                                   f"{self._stderr(inc)}")
            until = time.perf_counter() + self.rnd.uniform(0.0, KILL_SLACK * _median(self.durations[inc.fsync], 0.002))
        self.pump(until)
        try:
            os.kill(inc.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.anomalies.append(f"{inc.shard} writer {inc.number} died on its own: {self._stderr(inc)}")
        deadline = time.perf_counter() + DEATH_TIMEOUT_S
        while _alive(inc.pid):  # the kernel reaps it (fork server): gone means its files are closed
            if time.perf_counter() > deadline:
                raise RuntimeError(f"writer pid {inc.pid} still alive {DEATH_TIMEOUT_S} s after SIGKILL")
            self.pump(time.perf_counter() + 0.001)
        self._feed(inc, time.perf_counter())  # what it printed last
        del self.live[inc.shard]
        self._close(inc)
        self._account(inc)
        return inc.shard

    def _close(self, inc: Incarnation) -> None:
        os.close(inc.fd)
        os.close(inc.keep_open)
        os.unlink(inc.base + ".out")

    def _stderr(self, inc: Incarnation) -> str:
        with open(inc.base + ".err") as f:
            return f.read().strip()[-500:] or "(no stderr)"

    def _account(self, inc: Incarnation) -> None:
        """Check the shard of a killed writer against everything its writers acknowledged,
        and tell where the kill landed."""
        from robo_post.utils.io import is_object_url

        book = self.books[inc.shard]
        ready = next((i for _, w, i in inc.lines if w == "ready"), None)
        acked = [i for _, w, i in inc.lines if w == "committed"]
        began = next((i for _, w, i in reversed(inc.lines) if w == "begin"), None)
        if ready is not None and ready != inc.start_count:
            self.anomalies.append(f"{inc.shard} writer {inc.number} resumed at {ready}, {inc.start_count} were committed")
        if ready is not None and acked != list(range(ready, ready + len(acked))):
            self.anomalies.append(f"{inc.shard} writer {inc.number} acknowledged {acked[:5]}... after ready {ready}")
        for index in acked:
            book.acked[index] = inc.number
        counts = self.store.read_commit(inc.shard)
        visible = counts["episodes"]
        book.lost.update(i for i in book.acked if i >= visible)
        in_flight = began if began is not None and began not in book.acked else None
        extra = [i for i in range(visible) if i not in book.acked and i not in book.late]
        meta = None if is_object_url(self.root) else os.path.join(self.root, "shards", inc.shard, "episodes.jsonl")
        if extra and extra == [in_flight]:
            book.late[in_flight] = inc.number
            phase = "acked_late"
        elif extra:
            self.anomalies.append(f"{inc.shard}: episodes {extra} visible, never acknowledged, "
                                  f"writer {inc.number} had {in_flight} in flight")
            phase = None
        elif ready is None:
            phase = "opening"
        elif meta is not None and os.path.getsize(meta) > counts["meta_bytes"]:
            phase = "before_record"
        elif in_flight is not None:
            phase = "data"
        else:
            phase = "between"
        if phase is not None:
            self.phases[phase] += 1

    # --- the end ----------------------------------------------------------------------------
    def finish(self) -> dict:
        """Stop the reader and the server, then check the whole store."""
        from robo_post.store import Store
        from robo_post.store.integrity import validate_store

        open(self.stop_path, "w").close()
        out, _ = self.reader.communicate(timeout=120)
        reader = json.loads(out)
        self.server.stdin.close()
        self.server.wait(timeout=30)

        snap = Store.open(self.root).snapshot(record=False)
        partial = []
        visible = {s: 0 for s in self.shards}
        for ep in snap:
            book = self.books[ep.client_id]
            visible[ep.client_id] += 1
            incarnation = book.acked.get(ep.episode, book.late.get(ep.episode))
            attrs = {"shard": ep.client_id, "index": ep.episode, "incarnation": incarnation}
            try:
                wrong = content_errors(make_episode(self.seed, ep.client_id, ep.episode), snap.load(ep), attrs)
            except Exception as e:  # unreadable counts as wrong content here
                wrong = [repr(e)]
            if wrong:
                partial.append(f"{ep.key}: {'; '.join(wrong)}")
        for shard, book in self.books.items():
            book.lost.update(i for i in book.acked if i >= visible[shard])
            if visible[shard] != len(book.acked) + len(book.late) - len(book.lost):
                self.anomalies.append(f"{shard}: {visible[shard]} visible, {len(book.acked)} acknowledged, "
                                      f"{len(book.late)} acknowledged late, {len(book.lost)} lost")
        checked, problems = validate_store(self.root)
        if checked != sum(visible.values()):
            self.anomalies.append(f"validate checked {checked} episodes, {sum(visible.values())} are visible")
        durations = {f"fsync={mode}": round(1e3 * _median(d, float("nan")), 3) for mode, d in self.durations.items()}
        return {
            "commits": sum(len(b.acked) for b in self.books.values()),
            "visible": sum(visible.values()),
            "lost": sum(len(b.lost) for b in self.books.values()),
            "partial": len(partial),
            "acked_late": sum(len(b.late) for b in self.books.values()),
            "reader_errors": reader["errors"],
            "validate_problems": len(problems),
            "reader_snapshots": reader["snapshots"],
            "reader_loads": reader["loads"],
            "reader_covered": reader["covered"],
            "kill_phases": dict(self.phases),
            "median_commit_ms": durations,
            "median_open_ms": round(1e3 * _median(self.open_durations, float("nan")), 1),
            "anomalies": len(self.anomalies),
            "details": {
                "partial": partial[:10],
                "reader": reader["first_errors"],
                "validate": problems[:10],
                "anomalies": self.anomalies[:10],
                "lost": {s: sorted(b.lost)[:10] for s, b in self.books.items() if b.lost},
            },
        }

    def abort(self) -> None:
        """Kill every process this run started (after an error in the parent)."""
        for inc in self.live.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(inc.pid, signal.SIGKILL)
        for proc in (self.server, self.reader):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _median(values, default: float) -> float:
    return statistics.median(values) if values else default


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def torture(n_writers: int, kills: int, seed: int, scratch: str, target: str | None = None) -> dict:
    """``kills`` SIGKILLs over ``n_writers`` writers of a fresh store (in ``scratch``, or under the
    object store URL ``target``); the counts of the table row."""
    if kills < n_writers:
        raise ValueError(f"--kills {kills} is below the writer count {n_writers}: the last {n_writers} kills stop them")
    rnd = random.Random(seed * 1000 + n_writers)
    began = time.perf_counter()
    root = f"{target}/store-{n_writers}" if target else os.path.join(scratch, f"store-{n_writers}")
    run = Torture(root, n_writers, seed, rnd, os.path.join(scratch, f"work-{n_writers}"))
    try:
        fresh = None
        for shard in run.shards:
            fresh = run.start(shard)
        for k in range(kills):
            shard = run.kill_one(fresh)
            fresh = run.start(shard) if k < kills - n_writers else None  # the last n_writers kills end the run
        result = run.finish()
    except BaseException:
        run.abort()
        raise
    result.update(writers=n_writers, kills=kills, restarts=kills - n_writers, wall_s=time.perf_counter() - began)
    return result


def failed(row: dict) -> bool:
    return any(row[k] for k in ("lost", "partial", "reader_errors", "validate_problems", "anomalies"))


COLUMNS = (
    ("W", "writers", "{}"), ("kills", "kills", "{}"), ("commits", "commits", "{}"), ("visible", "visible", "{}"),
    ("lost", "lost", "{}"), ("partial", "partial", "{}"), ("extra (acked late)", "acked_late", "{}"),
    ("reader errors", "reader_errors", "{}"), ("validate", "validate_problems", "{}"), ("wall s", "wall_s", "{:.1f}"),
)


def print_report(rows: list[dict], args) -> None:
    cells = [[fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _, _) in enumerate(COLUMNS)]
    print("\n" + "  ".join(t.rjust(w) for (t, _, _), w in zip(COLUMNS, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
    print("\nextra: visible but never acknowledged, each the in-flight episode of a killed writer whose commit "
          "returned before it printed its ack (allowed; any other extra is an anomaly)")
    print(f"seed {args.seed}; episodes of 1..{MAX_T} steps, {IMAGE_SIDE}x{IMAGE_SIDE}x3 image + "
          f"{STATE_DIM}-float state per observation; writers alternate fsync=True/False per restart")
    print("where the kills landed (from what each killed writer printed and its shard's files):")
    for row in rows:
        landed = ", ".join(f"{label} {row['kill_phases'][key]}" for key, label in PHASES)
        commit = ", ".join(f"{mode} {ms} ms" for mode, ms in row["median_commit_ms"].items())
        print(f"  W={row['writers']}: {landed}")
        print(f"       (median begin->committed: {commit}; start->ready {row['median_open_ms']} ms)")
    for r in rows:
        print(f"reader, W={r['writers']}: {r['reader_snapshots']} snapshots and {r['reader_loads']} episode loads "
              f"while writers ran, covering {r['reader_covered']} of the {r['visible']} episodes")
    for row in rows:
        for what, lines in row["details"].items():
            if lines:
                print(f"W={row['writers']} {what}: {lines}")
    print("FAIL" if any(failed(r) for r in rows) else "PASS: nothing acknowledged lost, nothing partial, "
          "no reader error, validate clean")


@contextlib.contextmanager
def local_s3():
    """moto's S3 server on loopback (tests/s3_server.py), its fake credentials in this process's
    environment (which the writers and the reader inherit) while it runs."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from s3_server import running

    with running() as server:
        yield server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for details.")
    parser.add_argument("--kills", type=int, default=None, help="SIGKILLs per writer count (default 100)")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 4], help="writer counts to run (default 1 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="10 kills per writer count")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--scratch", default=None, help="parent directory for the stores (default: system temp)")
    parser.add_argument("--s3", action="store_true", help="run on S3: moto's server on loopback, started for the run")
    parser.add_argument("--s3-url", default=None, help="run on object storage under this URL (s3://BUCKET/PREFIX; "
                        "credentials from the environment); each run makes a new prefix below it")
    # Child process entries, started by the benchmark itself.
    parser.add_argument("--fork-server", nargs=2, metavar=("STORE", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--reader", nargs=3, metavar=("STORE", "SEED", "STOPFILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fork_server:
        fork_server(args.fork_server[0], int(args.fork_server[1]))
        return
    if args.reader:
        run_reader(args.reader[0], int(args.reader[1]), args.reader[2])
        return
    kills = args.kills if args.kills is not None else 10 if args.quick else 100

    if args.scratch:
        os.makedirs(args.scratch, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="store_torture-", dir=args.scratch)
    rows = []
    with contextlib.ExitStack() as stack:
        target = args.s3_url.rstrip("/") + f"/torture-{os.getpid()}-{int(time.time())}" if args.s3_url else None
        if args.s3:
            target = f"s3://{stack.enter_context(local_s3()).bucket()}/torture"
        try:
            for n_writers in args.writers:
                print(f"W={n_writers}: {kills} kills{' on ' + target if target else ''} ...", flush=True)
                rows.append(torture(n_writers, kills, args.seed, scratch, target))
        except BaseException:
            print(f"scratch kept at {scratch}", file=sys.stderr)
            raise
    print_report(rows, args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "seed": args.seed, "max_t": MAX_T,
                       "rows": rows}, f, indent=1)
    if any(failed(r) for r in rows):
        print(f"scratch kept at {scratch}", file=sys.stderr)
        sys.exit(1)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
