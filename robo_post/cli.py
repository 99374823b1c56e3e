"""`robo-post` command line.

Jobs (``collect``, ``run``, ...) take hydra overrides composed over ``configs/``,
e.g. ``robo-post collect fleet.n_clients=4 env=tabletop``. Tools that act on a
path (``store info PATH``) take ordinary flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from typing import Callable

from omegaconf import DictConfig

from robo_post.store.schema import StoreError


# --- store ----------------------------------------------------------------------
def _store_info(args: argparse.Namespace) -> int:
    from collections import Counter

    from robo_post.store import ROLES, PolicyRegistry, Store
    from robo_post.store.integrity import lost_since_snapshots
    from robo_post.store.store import describe_lost

    store = Store.open(args.path)
    snap = store.snapshot()
    episodes = snap.episodes()
    # info reads records, not rows: a shard whose array folder is gone would pass for whole
    lost = {shard: describe_lost(gone) for shard in snap.counts if (gone := store.lost_arrays(shard))
            and snap.counts[shard]["episodes"]}
    judged = [e for e in episodes if e.success is not None]
    tasks: dict[str, list] = {}
    for e in episodes:
        tasks.setdefault(e.task_id, []).append(e)
    roles = Counter(e.role for e in episodes)
    # How imported episodes got their success label (import-minari --success-from).
    rules = Counter(e.attrs["success_rule"] for e in episodes if "success_rule" in e.attrs)
    info = {
        "path": store.root,
        "snapshot": snap.id,
        "schema_version": store.schema.schema_version,
        "episodes": len(episodes),
        "steps": snap.num_steps,
        "shards": len(snap.counts),
        "success_rate": (sum(bool(e.success) for e in judged) / len(judged)) if judged else None,
        "tasks": {
            t: {"episodes": len(es), "success_rate": _rate(es)} for t, es in sorted(tasks.items())
        },
        "roles": {r: roles[r] for r in ROLES if roles[r]},
        "success_rules": dict(sorted(rules.items())),
        "policy_versions": PolicyRegistry(store.root).versions(),
        "size_bytes": store.size_bytes(),
        "lost": lost,
        "lost_shards": lost_since_snapshots(store),
    }
    for shard, what in lost.items():
        print(f"warning: shard {shard}: {what} (`robo-post store repair {args.path}` leaves its episodes out)",
              file=sys.stderr)
    for problem in info["lost_shards"]:
        print(f"warning: {problem}: the figures below leave them out", file=sys.stderr)
    damaged = bool(lost or info["lost_shards"])
    if args.json:
        print(json.dumps(info, indent=1))
        return 1 if damaged else 0
    from rich.table import Table

    from robo_post.eval.rollout import report_console

    console = report_console()
    console.print(f"[bold]{info['path']}[/]  snapshot {info['snapshot']}")
    rate = "n/a" if info["success_rate"] is None else f"{info['success_rate']:.1%}"
    console.print(
        f"episodes {info['episodes']}  steps {info['steps']}  shards {info['shards']}  "
        f"success {rate}  size {info['size_bytes'] / 1e6:.2f} MB  policies {info['policy_versions'] or 'none'}"
    )
    console.print("roles  " + ("  ".join(f"{r} {n}" for r, n in info["roles"].items()) or "none"))
    if info["success_rules"]:
        rules_used = "  ".join(f"{r} ({n})" for r, n in info["success_rules"].items())
        console.print(f"success rules of imported episodes  {rules_used}")
    table = Table("task", "episodes", "success")
    for t, d in info["tasks"].items():
        table.add_row(t or "(none)", str(d["episodes"]), "n/a" if d["success_rate"] is None else f"{d['success_rate']:.1%}")
    console.print(table)
    return 1 if damaged else 0


def _rate(episodes) -> float | None:
    judged = [e for e in episodes if e.success is not None]
    return sum(bool(e.success) for e in judged) / len(judged) if judged else None


def _store_validate(args: argparse.Namespace) -> int:
    from robo_post.store.integrity import validate_store

    checked, problems = validate_store(args.path)
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    # checked: episodes whose data verified; one problem line may cover several episodes (a damaged tail)
    print(f"{checked} episodes verified, {len(problems)} problem{'' if len(problems) == 1 else 's'}")
    return 1 if problems else 0


def _store_repair(args: argparse.Namespace) -> int:
    from robo_post.store.integrity import Unrepairable, repair_store

    actions = repair_store(args.path, apply=args.apply)
    for line in actions:
        print(line)
    unrepairable = [line for line in actions if isinstance(line, Unrepairable)]
    if not actions:
        # Arrays whose metadata is damaged are out of repair's reach: validate names them.
        print("every commit record agrees with its episode index, every committed episode verifies and every "
              f"snapshot record reads: nothing to repair (`robo-post store validate {args.path}` checks the rest)")
    elif not args.apply and len(unrepairable) < len(actions):
        print("nothing changed: run again with --apply to do this")
    return 1 if unrepairable else 0  # the store is not whole yet: the lines above say what the user can do


def _store_export_minari(args: argparse.Namespace) -> int:
    from robo_post.store import Store
    from robo_post.store.minari_io import export_minari

    snap = Store.open(args.store).snapshot()
    episodes = snap.episodes(task=args.task, success=args.success, role=args.role)
    path = export_minari(snap, args.dataset_id, episodes, minari_root=args.minari_root)
    print(f"exported {len(episodes)} episodes ({sum(e.length for e in episodes)} steps) to {path}")
    return 0


def _store_import_minari(args: argparse.Namespace) -> int:
    from robo_post.store.minari_io import import_minari

    done = import_minari(args.dataset_id, args.store, args.client, minari_root=args.minari_root, task_id=args.task,
                         success_from=args.success_from, skip_invalid=args.skip_invalid)
    rule = args.success_from or "as exported"
    held = f"; {done.skipped} the store already held were skipped" if done.skipped else ""
    for index, reason in done.invalid:
        print(f"skipped invalid episode {index}: {reason}", file=sys.stderr)
    invalid = f"; {len(done.invalid)} invalid skipped (listed above)" if done.invalid else ""
    print(f"imported {done.imported} episode{'' if done.imported == 1 else 's'} from {args.dataset_id} into "
          f"{args.store} (shard {args.client}, success: {rule}){held}{invalid}")
    return 0


def _store_export_lerobot(args: argparse.Namespace) -> int:
    from robo_post.store import Store
    from robo_post.store.lerobot_io import export_lerobot

    snap = Store.open(args.store).snapshot()
    episodes = snap.episodes(task=args.task, success=args.success, role=args.role)
    path = export_lerobot(snap, args.path, episodes, fps=args.fps, images=args.images)
    print(f"exported {len(episodes)} episodes ({sum(e.length for e in episodes)} steps) to {path}")
    return 0


def _store_import_lerobot(args: argparse.Namespace) -> int:
    from robo_post.store.lerobot_io import import_lerobot

    done = import_lerobot(args.path, args.store, args.client, task_id=args.task, success_from=args.success_from,
                          skip_invalid=args.skip_invalid)
    rule = args.success_from or "as exported"
    held = f"; {done.skipped} the store already held were skipped" if done.skipped else ""
    for index, reason in done.invalid:
        print(f"skipped invalid episode {index}: {reason}", file=sys.stderr)
    if done.ignored:
        print(f"left out features the store cannot hold (neither numeric nor a camera): {', '.join(done.ignored)}",
              file=sys.stderr)
    invalid = f"; {len(done.invalid)} invalid skipped (listed above)" if done.invalid else ""
    print(f"imported {done.imported} episode{'' if done.imported == 1 else 's'} from {args.path} into "
          f"{args.store} (shard {args.client}, success: {rule}){held}{invalid}")
    return 0


def _store_import_rosbag(args: argparse.Namespace) -> int:
    from robo_post.fleet.rosbag import BagImportConfig, import_rosbag
    from robo_post.fleet.settings import parse_config

    try:
        cfg = parse_config(BagImportConfig, args.settings)
    except ValueError as e:  # a bad setting is a usage error, as in `robo-post fleet`
        print(f"robo-post store import-rosbag: {e}", file=sys.stderr)
        return 2
    done = import_rosbag(args.bag, args.store, cfg)
    malformed = ", ".join(f"{kind}={n}" for kind, n in sorted(done.malformed.items()))
    print(f"imported {done.committed} episode{'' if done.committed == 1 else 's'} ({done.steps} steps) from "
          f"{args.bag} into {args.store} (shard {cfg.client_id}); {done.discard_summary}"
          + (f"; malformed messages: {malformed}" if malformed else ""))
    return 0


def _store_view(args: argparse.Namespace) -> int:
    from robo_post.store import Store
    from robo_post.store.view import default_path, find_episode, write_recording

    try:
        import rerun  # noqa: F401
    except ImportError as e:  # rerun-sdk comes with the optional `view` extra
        print(f"robo-post store: Rerun is not available ({e}); install robo-post[view]", file=sys.stderr)
        return 1
    store = Store.open(args.store)
    snap = store.snapshot(record=False)  # looking must not write into the store
    episode = find_episode(snap, args.episode)
    path = write_recording(snap, episode, args.out or default_path(store.root, episode))
    print(f"wrote {path}: episode {episode.key} ({episode.length} steps, task {episode.task_id or '(none)'})")
    print(f"open it with: rerun {path}")
    return 0


def _import_arguments(p: argparse.ArgumentParser, client: str, task_default: str, key_rule: str) -> None:
    """The options every dataset import takes (the rule reading a dataset's own key: ``key_rule``)."""
    p.add_argument("--client", metavar="ID", default=client, help=f"shard to write (default: {client})")
    p.add_argument("--task", metavar="T", help=f"task id of every episode (default: exported task, else {task_default})")
    p.add_argument(
        "--success-from", metavar="RULE",
        help=f"how each episode's success is decided: termination | truncation | {key_rule} | return>=X | none "
        "(required for datasets not exported by robo-post; default for those: the exported success)",
    )
    p.add_argument("--skip-invalid", action="store_true",
                   help="import the other episodes when one fails validation (NaN, an action out of bounds), "
                   "listing each skipped one; by default it stops the import")


_STORE_PATH = "the store: a folder, or a URL on object storage (s3://BUCKET/PREFIX, gs://, az://, file:///PATH)"


def _store_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="robo-post store", description="Inspect, check, convert a trajectory store.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="episodes, steps, shards, tasks, roles, success rate, size on disk")
    p.add_argument("path", help=_STORE_PATH)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(fn=_store_info)
    p = sub.add_parser("validate", help="full integrity scan; non-zero exit on any problem")
    p.add_argument("path", help=_STORE_PATH)
    p.set_defaults(fn=_store_validate)
    p = sub.add_parser("repair", help="rebuild missing or damaged commit records (prints the plan; --apply writes)")
    p.add_argument("path", help=_STORE_PATH)
    p.add_argument("--apply", action="store_true", help="rewrite the commit records (default: only print the plan)")
    p.set_defaults(fn=_store_repair)
    p = sub.add_parser("export-minari", help="write a snapshot's episodes as a new Minari dataset")
    p.add_argument("store")
    p.add_argument("dataset_id", help="Minari id, (namespace/)name-vN")
    p.add_argument("--minari-root", metavar="DIR", help="datasets directory (default: Minari's)")
    p.add_argument("--task", metavar="T", help="only episodes of this task")
    p.add_argument("--success", action=argparse.BooleanOptionalAction, help="only (un)successful episodes")
    p.add_argument("--role", metavar="R", help="only episodes of this role (demo, play, deploy, online, eval, ...)")
    p.set_defaults(fn=_store_export_minari)
    p = sub.add_parser("import-minari", help="append a Minari dataset's episodes to a store (created if absent)")
    p.add_argument("dataset_id")
    p.add_argument("store")
    p.add_argument("--minari-root", metavar="DIR", help="datasets directory (default: Minari's)")
    _import_arguments(p, "minari", "the dataset id", "info:KEY")
    p.set_defaults(fn=_store_import_minari)
    p = sub.add_parser("export-lerobot", help="write a snapshot's episodes as a new LeRobot v3.0 dataset folder")
    p.add_argument("store")
    p.add_argument("path", help="the dataset folder to create")
    p.add_argument("--task", metavar="T", help="only episodes of this task")
    p.add_argument("--success", action=argparse.BooleanOptionalAction, help="only (un)successful episodes")
    p.add_argument("--role", metavar="R", help="only episodes of this role (demo, play, deploy, online, eval, ...)")
    p.add_argument("--fps", type=int, metavar="N",
                   help="frames per second (default: the imported LeRobot dataset's, else 30)")
    p.add_argument("--images", action="store_true",
                   help="camera frames as PNG images in the data files (exact) instead of mp4 videos (lossy)")
    p.set_defaults(fn=_store_export_lerobot)
    p = sub.add_parser("import-lerobot", help="append a LeRobot v3.0 dataset's episodes to a store (created if absent)")
    p.add_argument("path", help="the dataset folder (meta/info.json, data/, videos/)")
    p.add_argument("store")
    _import_arguments(p, "lerobot", "the folder name", "feature:KEY")
    p.set_defaults(fn=_store_import_lerobot)
    p = sub.add_parser("import-rosbag", help="record a robot's rosbag2 recording (MCAP or sqlite3) into a store "
                       "shard as the ROS 2 bridge would (store created if absent)")
    p.add_argument("bag", help="the bag folder (metadata.yaml), or one .mcap or .db3 file")
    p.add_argument("store")
    p.add_argument("settings", nargs="*", metavar="key=value",
                   help="the bridge's settings: robot=NAME|PATH.yaml (default tabletop), client_id=ID (shard, default "
                   "rosbag), namespace=NS (of the robot's topics, default /robot), timeout=S (an open episode's "
                   "silence, default 5), max_steps=N (0: the description's)")
    p.set_defaults(fn=_store_import_rosbag)
    p = sub.add_parser("view", help="write one episode as a Rerun recording (.rrd) to open with `rerun FILE`")
    p.add_argument("store")
    p.add_argument("episode", nargs="?",
                   help="its key SHARD/N, or an index into the store's episodes (-1: the last); default: the newest")
    p.add_argument("--out", metavar="FILE.rrd", help="where to write it (default: STORE-episode-SHARD-N.rrd here)")
    p.set_defaults(fn=_store_view)
    args = parser.parse_args(argv)
    return args.fn(args)


# --- hydra jobs -------------------------------------------------------------------
def _cfg_flags(args: list[str]) -> tuple[list[str], bool, bool]:
    """(overrides, print the config, resolve it) from ``--cfg job`` / ``--cfg=job`` / ``-c job`` and ``--resolve``
    (hydra's own flags for printing the composed config instead of running)."""
    overrides, show, resolve, i = [], False, False, 0
    while i < len(args):
        if args[i] in ("--cfg", "-c"):
            if i + 1 == len(args) or args[i + 1] not in ("job", "all"):
                raise ValueError(f"{args[i]} takes job or all (`--cfg job` prints the composed config)")
            show, i = True, i + 2
            continue
        if args[i] in ("--cfg=job", "--cfg=all"):
            show = True
        elif args[i] == "--resolve":
            resolve = True
        else:
            overrides.append(args[i])
        i += 1
    return overrides, show, resolve


def _one_line(error: Exception) -> str:
    """A hydra error on one line: its text without the caret marker, key dumps and doc links."""
    lines = [line.strip() for line in str(error).splitlines()]
    keep = [line for line in lines if line and set(line) != {"^"}
            and not line.startswith(("full_key:", "object_type=", "See https://"))]
    return " ".join(keep)


def _hydra_job(config_name: str, run: Callable[[DictConfig], object]) -> Callable[[list[str]], int]:
    """A command that composes ``configs/<config_name>.yaml`` with CLI overrides and runs."""

    def main(overrides: list[str]) -> int:
        from hydra.errors import HydraException

        from robo_post.cli_config import ConfigError, config_yaml, job_help, validate

        try:
            overrides, show_config, resolve = _cfg_flags(overrides)
        except ValueError as e:
            print(f"robo-post {config_name}: {e}", file=sys.stderr)
            return 2
        try:
            if "-h" in overrides or "--help" in overrides:
                print(job_help(config_name, COMMANDS[config_name][0],
                               [o for o in overrides if o not in ("-h", "--help")]))
                return 0
            if show_config:
                print(config_yaml(config_name, overrides, resolve=resolve), end="")
                return 0
            cfg = validate(config_name, overrides)  # before anything is written
        except ConfigError as e:
            print(f"robo-post {config_name}: {e}", file=sys.stderr)
            return 2
        except HydraException as e:
            print(f"robo-post {config_name}: bad override: {_one_line(e)}", file=sys.stderr)
            return 2
        run(cfg)
        return 0

    return main


def _collect(cfg: DictConfig) -> None:
    from robo_post.fleet.collect import collect

    collect(cfg)
    _store_main(["info", cfg.store])


def _train(cfg: DictConfig) -> None:
    from robo_post.learner.train import train

    summary = train(cfg)
    print(json.dumps(summary, indent=1))


def _eval(cfg: DictConfig) -> None:
    from robo_post.eval.rollout import eval_from_config

    eval_from_config(cfg)


def _report(cfg: DictConfig) -> None:
    from robo_post.eval.report import report_from_config

    print(f"report: {report_from_config(cfg)}")


# --- fleet ----------------------------------------------------------------------
def _fleet_main(argv: list[str]) -> int:
    try:
        from robo_post.fleet import ros2
    except ImportError as e:  # rclpy comes with the optional `ros` extra
        print(f"robo-post fleet: ROS 2 is not available ({e}); install robo-post[ros]", file=sys.stderr)
        return 1
    return ros2.main(argv)


def _run(cfg: DictConfig) -> None:
    from robo_post.pipelines.run import run

    print(json.dumps(run(cfg), indent=1))


def _steer(cfg: DictConfig) -> None:
    from robo_post.pipelines.steer import steer

    print(json.dumps(steer(cfg), indent=1))


def _steer_eval(cfg: DictConfig) -> None:
    from robo_post.pipelines.steer import steer_eval

    print(json.dumps(steer_eval(cfg), indent=1))


# --- dispatch -------------------------------------------------------------------
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "run": ("the main job: demos -> flow BC -> eval -> report (embedded defaults)", _hydra_job("run", _run)),
    "collect": ("run a fleet of clients that record episodes into the store", _hydra_job("collect", _collect)),
    "train": ("train a policy on a store snapshot (algo=bc_flow) and publish it", _hydra_job("train", _train)),
    "eval": ("success rates (95% CI) of pinned policy versions on eval-only seeds", _hydra_job("eval", _eval)),
    "report": ("Markdown/HTML report: success tables, learning curves, rollout frames", _hydra_job("report", _report)),
    "steer": ("deploy a frozen actor steered by a goal-conditioned prior (PoE, KL-budget selector)",
              _hydra_job("steer", _steer)),
    "steer-eval": ("steering grid vs the frozen actor: HELP / FROZEN / HURT, selector vs oracle, heat maps",
                   _hydra_job("steer-eval", _steer_eval)),
    "store": ("info | validate | repair | view | export-minari | import-minari | export-lerobot | import-lerobot | "
              "import-rosbag: inspect, check, repair, view, convert a store", _store_main),
    "fleet": ("ros2-bridge | ros2-sim | ros2-status: ROS 2 bridge to a robot, a simulated robot, bridge liveness",
              _fleet_main),
}
JOBS = ("run", "collect", "train", "eval", "report", "steer", "steer-eval")


def _config_main(argv: list[str]) -> int:
    """``robo-post config JOB [overrides]``: the job's composed config, checked, without running it."""
    if not argv or argv[0] not in JOBS:
        print(f"usage: robo-post config {{{','.join(JOBS)}}} [--resolve] [overrides]", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return COMMANDS[argv[0]][1](["--cfg", "job", *argv[1:]])


COMMANDS["config"] = ("print a job's composed config without running it (same as JOB --cfg job)", _config_main)


def _usage() -> str:
    lines = ["usage: robo-post COMMAND [ARGS | hydra overrides]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (help_, _) in COMMANDS.items()]
    lines += ["", "`robo-post COMMAND --help` for a command's own help; `robo-post --version`.",
              "A failure prints one line; `robo-post --debug COMMAND ...` (or ROBO_POST_DEBUG=1) adds its traceback."]
    return "\n".join(lines)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Our own warnings (a damaged commit slot, ...) as one ``warning:`` line like the others;
    a library's keep Python's format, which says where they come from."""
    if category.__module__.startswith("robo_post."):
        print(f"warning: {message}", file=file or sys.stderr)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = os.environ.get("ROBO_POST_DEBUG", "") not in ("", "0")
    if argv[:1] == ["--debug"]:
        debug, argv = True, argv[1:]
    if argv[:1] in (["--version"], ["-V"]):
        from importlib.metadata import version

        print(f"robo-post {version('robo-post')}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"robo-post: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    previous, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        return COMMANDS[name][1](rest)
    # Expected failures: a clear message, no traceback. OSError: a read-only or full disk,
    # a path that is a file, an unreadable dataset file; the message names the path.
    except (StoreError, RuntimeError, ValueError, OSError) as e:
        if debug:
            traceback.print_exc()
        print(f"robo-post {name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # store commits are atomic: an interrupted episode is simply not committed
        print(f"\nrobo-post {name}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = previous


if __name__ == "__main__":
    sys.exit(main())
