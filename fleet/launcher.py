"""Launch N fleet clients as local processes or Ray actors, restart crashes, show progress.

Both launchers run the same ``run_client`` code and read the same per-client
status files, so what works locally works on a Ray cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from robo_post.fleet.client import LAUNCHER_PID_ENV, ClientConfig, read_status, run_client
from robo_post.store import Store, StoreError
from robo_post.utils.io import host_dir


# A status query to a Ray client's actor waits this long; past it the launcher reads this host's file.
STATUS_TIMEOUT_S = 5.0
# Free bytes under which a client's unexplained exit is put down to a full disk.
_FULL_BYTES = 1 << 20


class FleetError(RuntimeError):
    """Some clients gave up (crashed more than ``max_restarts`` times)."""


def raise_unfinished(statuses: list[dict[str, Any]], what: str, store_root: str) -> None:
    """Raise ``FleetError`` naming each client that did not finish and its last error line.

    The full tracebacks stay in the clients' logs; the message carries one line per client.
    """
    failed = [s for s in statuses if s.get("state") != "done"]
    if failed:
        reasons = "; ".join(f"{s['client_id']}: {_last_line(s.get('last_error')) or s.get('state')}" for s in failed)
        raise FleetError(f"{what} did not finish ({reasons}); logs in {host_dir(store_root, 'fleet')}/")


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""


class _Launcher:
    """Shared supervision loop; subclasses provide start/poll/statuses/stop."""

    def run(self, show: bool = True, poll_s: float = 0.5) -> list[dict[str, Any]]:
        """Start, supervise until every client is done (or gave up), return statuses."""
        self.before = {client_id: _committed(cfg) for client_id, cfg in self.configs.items()}
        self.start()
        try:
            _supervise(self.poll, self.statuses, show, poll_s)
        finally:
            self.stop()
        return self.statuses()

    def statuses(self) -> list[dict[str, Any]]:
        """Each client's status file (its shard's totals), with ``restarts``, ``target`` and
        ``before``: the episodes, successes and judged episodes its shard held before this run."""
        out = []
        for client_id, cfg in self.configs.items():
            status = self._status(cfg) or {"client_id": client_id, "state": "starting", "episodes": 0}
            status["restarts"] = self.restarts.get(client_id, 0)
            status["target"] = cfg.episodes
            status["before"] = self.before.get(client_id, _NOTHING)
            out.append(status)
        return out

    def _status(self, cfg: ClientConfig) -> dict[str, Any] | None:
        """The last status ``cfg``'s client wrote (on this host), None before its first."""
        return read_status(cfg.store, cfg.client_id)


class LocalLauncher(_Launcher):
    """One OS process per client (``python -m robo_post.fleet.client <json>``).

    A client that exits non-zero (crash, SIGKILL) is restarted up to
    ``max_restarts`` times; it resumes from its shard's committed episodes. One that
    crashes again with the error of its last crash and no episode committed in between
    (a policy the env cannot serve, a missing version) is given up at once: a restart
    would only repeat it.
    """

    def __init__(self, configs: list[ClientConfig], max_restarts: int = 3):
        self.configs = {c.client_id: c for c in configs}
        self.max_restarts = max_restarts
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = {c: 0 for c in self.configs}
        self.failed: dict[str, int] = {}
        self.crashes: dict[str, tuple[Any, Any]] = {}  # client -> (last error, episodes) at its last crash
        self.before: dict[str, dict[str, int]] = {}  # client -> its shard's counts when run() started

    def _spawn(self, client_id: str) -> None:
        cfg = self.configs[client_id]
        log = open(os.path.join(host_dir(cfg.store, "fleet"), f"{client_id}.log"), "ab")
        self.procs[client_id] = subprocess.Popen(
            [sys.executable, "-m", "robo_post.fleet.client", json.dumps(asdict(cfg))],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=os.environ | {LAUNCHER_PID_ENV: str(os.getpid())},  # the client exits when we die
        )
        log.close()

    def start(self) -> None:
        for cfg in self.configs.values():
            os.makedirs(host_dir(cfg.store, "fleet"), exist_ok=True)
        for client_id in self.configs:
            self._spawn(client_id)

    def poll(self) -> bool:
        """Restart crashed clients; return True while any client is still running."""
        running = False
        for client_id, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0 and client_id not in self.failed:
                status = read_status(self.configs[client_id].store, client_id) or {}
                crash = (status.get("last_error"), status.get("episodes"))
                repeated = crash[0] is not None and self.crashes.get(client_id) == crash
                self.crashes[client_id] = crash
                if self.restarts[client_id] < self.max_restarts and not repeated:
                    self.restarts[client_id] += 1
                    self._spawn(client_id)
                    running = True
                else:
                    self.failed[client_id] = code
        return running

    def statuses(self) -> list[dict[str, Any]]:
        """As ``_Launcher.statuses``; a client given up that could not record its crash (a full
        disk fails the status write too) reads as exited, not as still running."""
        out = super().statuses()
        for status in out:
            code = self.failed.get(status["client_id"])
            if code is not None and status.get("state") not in ("crashed", "done"):
                store = self.configs[status["client_id"]].store
                full = shutil.disk_usage(store).free < _FULL_BYTES
                status.update(state=f"exited with code {code}", last_error=(
                    f"OSError: no space left on the disk holding {store}" if full else status.get("last_error")))
        return out

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            proc.wait()



class RayLauncher(_Launcher):
    """One Ray actor per client; Ray restarts a dead actor and retries its run, on any node.

    Clients may run on other machines than the launcher: each reports its status (and the
    node it runs on) through its actor, and a client restarted elsewhere resumes from its
    shard's committed episodes. On a store in a bucket the restart waits out the dead
    writer's lease (``LEASE_S``) before it takes the shard.

    Args:
        address: Ray cluster address; ``None`` starts a local Ray instance.
        num_cpus: CPUs for a local instance.
    """

    def __init__(self, configs: list[ClientConfig], max_restarts: int = 3, address: str | None = None,
                 num_cpus: int | None = None):
        import ray

        self.ray = ray
        if not ray.is_initialized():
            # Ray rejects num_cpus when joining an existing cluster; it only sizes a local one.
            local_cpus = num_cpus if address is None else None
            ray.init(address=address, num_cpus=local_cpus, include_dashboard=False, log_to_driver=False)
        self.configs = {c.client_id: c for c in configs}
        self.restarts = {c: 0 for c in self.configs}
        # A dead actor is restarted max_restarts times, and its run waits for the restart (-1: a
        # restart can wait for a free CPU longer than a counted retry lasts). Two threads per
        # actor: the client's run, and the status queries answered beside it.
        self.actor_cls = ray.remote(num_cpus=1, max_restarts=max_restarts, max_task_retries=-1,
                                    max_concurrency=2)(_ClientActor)
        self.actors: dict[str, Any] = {}
        self.futures: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.final: dict[str, dict[str, Any]] = {}  # client -> the status its finished run returned
        self.before: dict[str, dict[str, int]] = {}  # client -> its shard's counts when run() started

    def start(self) -> None:
        for client_id, cfg in self.configs.items():
            os.makedirs(host_dir(cfg.store, "fleet"), exist_ok=True)
            self.actors[client_id] = self.actor_cls.remote()
            self.futures[client_id] = self.actors[client_id].run.remote(json.dumps(asdict(cfg)))

    def poll(self) -> bool:
        pending = [f for c, f in self.futures.items() if c not in self.errors]
        done, _ = self.ray.wait(pending, num_returns=len(pending), timeout=0)
        for client_id, fut in self.futures.items():
            if fut in done and client_id not in self.errors:
                try:
                    self.final[client_id] = self.ray.get(fut)
                    self.errors[client_id] = ""
                except Exception as e:  # the actor gave up after max_restarts
                    self.errors[client_id] = str(e)
                # a live actor keeps its CPU: free it for a client rescheduled from a lost node
                self.ray.kill(self.actors[client_id], no_restart=True)
        return len(self.errors) < len(self.futures)

    def _status(self, cfg: ClientConfig) -> dict[str, Any] | None:
        """The client's status from the node it runs on: its finished run's, else as its actor
        reads it there; this host's file while the actor does not answer (restarting, or its node gone)."""
        if cfg.client_id in self.final:
            return dict(self.final[cfg.client_id])
        if self.errors.get(cfg.client_id):  # given up: the error its run raised on its node
            status = super()._status(cfg) or {"client_id": cfg.client_id, "episodes": 0}
            return {**status, "state": "crashed", "last_error": self.errors[cfg.client_id]}
        actor = self.actors.get(cfg.client_id)
        if actor is not None:
            try:
                query = actor.status.options(max_task_retries=0).remote(cfg.store, cfg.client_id)
                return self.ray.get(query, timeout=STATUS_TIMEOUT_S)
            except Exception:  # GetTimeoutError, RayActorError: it is being restarted
                pass
        return super()._status(cfg)

    def stop(self) -> None:
        for actor in self.actors.values():
            self.ray.kill(actor)


class _ClientActor:
    """Ray actor body: runs one client; configs arrive as JSON strings."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, cfg_json: str) -> dict[str, Any]:
        """The client's final status, with the node it ran on."""
        return {**run_client(ClientConfig(**json.loads(cfg_json))), "node": _node_id()}

    def status(self, store: str, client_id: str) -> dict[str, Any] | None:
        """The client's last status on this node, with the node it runs on."""
        status = read_status(store, client_id)
        return None if status is None else {**status, "node": _node_id()}


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


_NOTHING = {"episodes": 0, "successes": 0, "judged": 0}


def _committed(cfg: ClientConfig) -> dict[str, int]:
    """What a client's shard holds now (episodes, successes, judged); nothing for a shard the
    store cannot read (the client itself then reports why)."""
    try:
        done = Store.open(cfg.store).shard_episodes(cfg.client_id)
    except StoreError:
        return dict(_NOTHING)
    return {"episodes": len(done), "successes": sum(bool(e.success) for e in done),
            "judged": sum(e.success is not None for e in done)}


def _supervise(poll, statuses, show: bool, poll_s: float) -> None:
    if not show:
        while poll():
            time.sleep(poll_s)
        return
    from rich.live import Live

    with Live(status_table(statuses()), refresh_per_second=4) as live:
        while poll():
            live.update(status_table(statuses()))
            time.sleep(poll_s)
        live.update(status_table(statuses()))


def status_table(statuses: list[dict[str, Any]]):
    """A rich table of per-client progress in this run (episodes, success, steps/s, version, errors):
    a shard's earlier episodes (``before``) count in neither its episodes nor its success rate."""
    from rich.table import Table

    table = Table("client", "state", "episodes", "success", "steps/s", "policy", "restarts", "last error")
    for s in statuses:
        before = s.get("before", _NOTHING)
        n = s.get("episodes", 0) - before["episodes"]
        judged = s.get("judged", 0) - before["judged"]  # episodes whose env defines success
        rate = f"{(s.get('successes', 0) - before['successes']) / judged:.0%}" if judged > 0 else "-"
        err = _last_line(s.get("last_error"))
        target = s.get("target")
        table.add_row(
            s["client_id"], s.get("state", "?"), f"{max(n, 0)}/{'?' if target is None else target - before['episodes']}", rate,
            f"{s.get('steps_per_s', 0):.0f}", f"v{s.get('policy_version', 0)}", str(s.get("restarts", 0)),
            err[:60],
        )
    return table
