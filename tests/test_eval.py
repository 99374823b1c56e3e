"""Evaluation and reports: Wilson intervals, expert sanity eval, pinned-version flow
eval through the fleet, and the Markdown/HTML report with its plots.

State-only tabletop envs on the short reach/push tasks keep the file well under
90 s on two cores; the two fleet evaluations run once and are shared.
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # headless rendering; must precede importing mujoco

import dataclasses
import json
import math
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from PIL import Image

from robo_post.cli import main
from robo_post.envs.tabletop import PROPRIO_DIM
from robo_post.eval import EVAL_SEED, evaluate, load_results, wilson_interval, write_report
from robo_post.envs import env_spec
from robo_post.eval import report as report_mod
from robo_post.eval.rollout import _save_result, _step_limit, _summarise, format_mean, mean_interval
from robo_post.fleet.client import episode_seed, recorded_env_kwargs, store_schema
from robo_post.models.features import state_features
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig
from robo_post.store import ArraySpec, EpisodeInfo, PolicyRegistry, Store, StoreSchema
from robo_post.utils.io import read_metrics

ENV: dict[str, Any] = {"name": "tabletop", "render_images": False}
TASKS = ["reach", "push"]


@pytest.mark.parametrize(
    "k, n, expected",
    [
        # Hand-computed from (2k + z² ± z·sqrt(z² + 4k(n-k)/n)) / (2(n + z²)), z = 1.959964;
        # 7/10 -> [0.3968, 0.8922] is the textbook example.
        (7, 10, (0.396778, 0.892209)),
        (0, 10, (0.0, 0.277533)),  # upper = z² / (n + z²)
        (10, 10, (0.722467, 1.0)),  # lower = n / (n + z²)
        (1, 2, (0.094531, 0.905469)),
        (0, 0, (0.0, 1.0)),  # no data: no information
    ],
)
def test_wilson_interval_matches_hand_computed_values(k, n, expected):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(expected[0], abs=1e-6) and hi == pytest.approx(expected[1], abs=1e-6)


def test_wilson_interval_rejects_impossible_counts():
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_wilson_bounds_at_no_and_all_successes_are_exact():
    """0/7 had a lower bound of 2.8e-17 and 10/10 an upper bound of 0.9999999999999999 (rounding noise)."""
    for n in range(1, 200):
        assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0
    assert wilson_interval(0, 7) == (0.0, pytest.approx(0.354330, abs=1e-6))  # upper = z² / (n + z²)


def test_mean_intervals_stay_inside_known_bounds():
    """A t interval of a few skewed values reached below 0 for a length (or a fraction) that cannot."""
    assert mean_interval([1, 1, 1, 30]) == pytest.approx([-14.823, 31.323], abs=1e-3)  # unbounded: as computed
    assert mean_interval([1, 1, 1, 30], low=0) == pytest.approx([0.0, 31.323], abs=1e-3)
    assert mean_interval([0.0, 0.0, 0.1, 0.9], low=0, high=1) == pytest.approx([0.0, 0.944], abs=1e-3)
    assert mean_interval([0.9, 1.0, 1.0, 1.0], low=0, high=1) == pytest.approx([0.895, 1.0], abs=1e-3)
    episodes = [_episode(i, length=n, ret=r) for i, (n, r) in enumerate([(1, -3.0), (1, 0.0), (1, 1.0), (30, 9.0)])]
    stats = _summarise(episodes, ["reach"])["tasks"]["reach"]
    assert stats["length_ci95"] == pytest.approx([0.0, 31.323], abs=1e-3)  # a length is never negative
    # nor longer than the step limit the episodes ran under (eval passes it where the env kwargs name it)
    assert _summarise(episodes, ["reach"], bounds={"length": (0, 30)})["tasks"]["reach"]["length_ci95"] == pytest.approx(
        [0.0, 30.0])
    # without max_episode_steps in the kwargs, the limit each client's env reported (it was unbounded)
    reported = [dataclasses.replace(e, attrs={"step_limit": 30}) for e in episodes]
    assert (_step_limit({}, reported), _step_limit({"max_episode_steps": 40}, reported), _step_limit({}, episodes),
            _step_limit({}, reported[:3] + episodes[3:])) == (30, 40, None, None)
    assert stats["return_ci95"][0] < -5  # a return has no known bound: left as computed
    # Where the env's registry entry knows a range (tabletop's 0/1 return gave [-0.07, 1.07]):
    episodes = [dataclasses.replace(_episode(i, ret=float(i == 0)), attrs={"metrics": {"usefulness": u, "other": u}})
                for i, u in enumerate([0.0, 0.0, 0.1, 0.95])]
    stats = _summarise(episodes, ["reach"], bounds=env_spec("tabletop").bounds | {"usefulness": (0.0, 1.0)})
    stats = stats["tasks"]["reach"]
    assert stats["return_ci95"] == [0.0, 1.0]  # unclipped [-0.546, 1.046]
    assert stats["metrics"]["usefulness"]["ci95"][0] == 0.0 and stats["metrics"]["other"]["ci95"][0] < 0


def test_saved_result_writes_null_not_nan(tmp_path):
    """A NaN or infinite return was saved as bare NaN / Infinity, which strict JSON parsers reject."""
    result = _summarise([_episode(0, ret=float("nan")), _episode(1, ret=float("inf"))], ["reach"])
    result["results_path"] = str(tmp_path / "evals" / "r.json")
    saved = _save_result(result)

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    with open(result["results_path"]) as f:
        loaded = json.loads(f.read(), parse_constant=refuse)
    assert loaded == saved
    reach = loaded["tasks"]["reach"]
    assert (reach["mean_return"], reach["return_ci95"]) == (None, [None, None])
    assert [e["return"] for e in loaded["episodes"]] == [None, None]
    assert reach["mean_length"] == 10.0  # finite values stay as they were
    assert format_mean(1.0, [None, None]) == "1.00"  # a saved bound that was not finite: no interval, no crash


def test_report_counts_are_singular_for_one(tmp_path):
    """The report said '1 episodes on 1 clients' and '1 eval layouts also occur'."""
    def text(n):
        result = {**_summarise([_episode(i, success=True) for i in range(n)], ["reach"]),
                  "policy": {"version": 0, "label": "expert", "store": "s", "config": {}}, "split": "train",
                  "created": "now", "episodes_per_task": n, "n_clients": n, "wall_s": 1.0, "seed": 0,
                  "train_seed_overlap": n, "env": {"name": "tabletop"}, "results_path": "r.json"}
        return open(write_report(str(tmp_path / str(n)), [result], frames=False)).read()

    assert "1 episode on 1 client in 1 s, base seed 0; 1 eval layout also occurs in the training store." in text(1)
    assert "2 episodes on 2 clients in 1 s, base seed 0; 2 eval layouts also occur in the training store." in text(2)


def test_a_report_into_a_file_is_refused_naming_it(tmp_path):
    (tmp_path / "a_file").write_text("x")  # was FileExistsError: [Errno 17]
    with pytest.raises(ValueError, match=r"out_dir=.*a_file is a file, not a directory"):
        write_report(str(tmp_path / "a_file"), [])
    assert (tmp_path / "a_file").read_text() == "x"


def _episode(i: int, success: bool | None = None, length: int = 10, ret: float = 0.0) -> EpisodeInfo:
    return EpisodeInfo(f"eval-c{i}", 0, "reach", "", i, success, length, 0, 0, 0, True, 0.0, 0.0, {}, 0, ret, "eval")


def test_eval_keeps_the_env_kwargs_all_episodes_agree_on(tmp_path, capsys):
    """Episodes recorded with different kwargs made eval drop all of them silently: a goal
    every episode shared ran at the env's default."""
    schema = StoreSchema({"observation": ArraySpec("float32", (3,))}, ArraySpec("float32", (1,), -2.0, 2.0),
                         attrs={"env": "Pendulum-v1"})
    store = Store.create(str(tmp_path / "s"), schema)
    spec = env_spec("Pendulum-v1")
    with store.writer("c") as w:
        for kwargs in ({"g": 5.0, "max_episode_steps": 10}, {"g": 5.0, "max_episode_steps": 20}):
            w.write_episode({"observation": np.zeros((3, 3), np.float32)}, np.zeros((2, 1), np.float32),
                            attrs={"env_kwargs": kwargs})
    assert recorded_env_kwargs(store.root, spec) == {"g": 5.0}
    assert "different values of env kwargs ['max_episode_steps']" in capsys.readouterr().err
    with store.writer("d") as w:  # an episode at the env's default g
        w.write_episode({"observation": np.zeros((3, 3), np.float32)}, np.zeros((2, 1), np.float32),
                        attrs={"env_kwargs": {}})
    assert recorded_env_kwargs(store.root, spec) == {}
    assert "['g', 'max_episode_steps']" in capsys.readouterr().err


@pytest.fixture(scope="module")
def evals(tmp_path_factory) -> dict[str, Any]:
    """A training store with a tiny untrained flow policy (v1) and an expert artifact (v2)
    published after it, plus one expert eval and one pinned v1 eval into an eval store."""
    root = tmp_path_factory.mktemp("eval")
    store = Store.create(str(root / "store"), store_schema(ENV, "reach"))
    model = FlowPolicy(FlowPolicyConfig(
        features=state_features(PROPRIO_DIM, "proprio"), action_dim=4, horizon=4, use_text=False, embed_dim=16, hidden_dim=32,
        flow_steps=2, action_low=[-1.0] * 4, action_high=[1.0] * 4,
    ))
    registry = PolicyRegistry(store.root)
    assert registry.publish(*model.artifact(algorithm="untrained")) == 1
    # A newer version exists: a client following the registry would run v2, a pinned one must not.
    assert registry.publish({}, {"kind": "expert"}) == 2
    out = str(root / "store-eval")
    expert = evaluate(store.root, None, TASKS, 3, split="train", n_clients=2, out_store=out)
    flow = evaluate(store.root, 1, ["reach"], 2, split="heldout", n_clients=2, out_store=out)
    return {"root": root, "store": store, "out": out, "expert": expert, "flow": flow}


@pytest.mark.slow
@pytest.mark.fleet
def test_expert_eval_succeeds_everywhere_and_saves_json(evals):
    r = evals["expert"]
    assert r["policy"]["label"] == "expert" and r["policy"]["version"] == 0
    for task in TASKS:
        s = r["tasks"][task]
        assert (s["episodes"], s["successes"], s["success_rate"]) == (3, 3, 1.0)
        assert s["ci95"] == pytest.approx(list(wilson_interval(3, 3)))
    assert r["mean_success_rate"] == 1.0 and r["overall"]["episodes"] == 6
    with open(r["results_path"]) as f:
        assert json.load(f)["tasks"] == r["tasks"]
    assert {x["tag"] for x in load_results(evals["out"])} == {r["tag"], evals["flow"]["tag"]}

    # Eval episodes went to the eval store only, with layouts training never used.
    assert evals["store"].shards() == []
    eval_seeds = {e["seed"] for e in r["episodes"]}
    train_seeds = {episode_seed(0, f"client-{i}", j) for i in range(4) for j in range(100)}
    assert r["seed"] == EVAL_SEED and not eval_seeds & train_seeds and r["train_seed_overlap"] == 0


@pytest.mark.slow
@pytest.mark.fleet
def test_pinned_flow_version_is_the_only_policy_that_ran(evals):
    r = evals["flow"]
    assert r["policy"]["label"] == "v1" and r["split"] == "heldout" and r["env"]["instruction_split"] == "heldout"
    episodes = Store.open(evals["out"]).snapshot().episodes(client=r["shards"])
    assert len(episodes) == 2
    assert {e.policy_version for e in episodes} == {1}  # v2 was newer; a pinned client never swaps
    assert {e.attrs["policy"] for e in episodes} == {"v1"}
    reach = r["tasks"]["reach"]
    assert reach["successes"] == sum(bool(e.success) for e in episodes)
    assert reach["ci95"] == pytest.approx(list(wilson_interval(reach["successes"], 2)))


@pytest.mark.slow
@pytest.mark.fleet
def test_identical_eval_reuses_its_shards(evals):
    again = evaluate(evals["store"].root, 1, ["reach"], 2, split="heldout", n_clients=2, out_store=evals["out"])
    assert again["tag"] == evals["flow"]["tag"] and again["episodes"] == evals["flow"]["episodes"]


@pytest.mark.slow
def test_eval_refuses_to_write_into_the_training_store(evals):
    with pytest.raises(ValueError, match="out_store"):
        evaluate(evals["store"].root, None, TASKS, 1, out_store=evals["store"].root)


@pytest.mark.slow
@pytest.mark.fleet
def test_replay_reproduces_recorded_episode(evals):
    snap = Store.open(evals["out"]).snapshot()
    episode = snap.episodes(client=evals["expert"]["shards"], task="push")[0]
    replayer = report_mod._Replayer()
    try:
        idx, frames, note = report_mod._frames(snap, episode, evals["expert"]["env"], replayer)
    finally:
        replayer.close()
    assert "DIVERGED" not in note and idx[0] == 0 and idx[-1] == episode.length
    assert len(frames) == len(idx) and frames[0].shape == (256, 256, 3) and frames[0].std() > 0


class _NoRender(gym.Env):
    """A user's env whose constructor takes no render_mode (and which renders nothing)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}


gym.register("robo_post_test/NoRender-v0", entry_point=_NoRender)


@pytest.mark.slow
def test_a_report_on_an_env_that_cannot_render_leaves_out_only_its_frames(evals, capsys, monkeypatch):
    """`robo-post report` stopped at an env without `render_mode` (EnvMakeError), leaving two plots and no report."""
    replayer = report_mod._Replayer()
    episode = dataclasses.replace(Store.open(evals["out"]).snapshot().episodes()[0], task_id="robo_post_test/NoRender-v0")
    with pytest.raises(report_mod.NoFramesError, match="env 'robo_post_test/NoRender-v0' cannot be made with kwargs {'render_mode': 'rgb_array'}"):
        replayer.replay(episode, {"name": "robo_post_test/NoRender-v0"}, np.zeros(2, np.int64), np.arange(3))
    replayer.close()

    def no_frames(*args):
        raise report_mod.NoFramesError("env 'mine' renders no frames (render() returned None)")

    monkeypatch.setattr(report_mod, "_frames", no_frames)
    md = open(write_report(str(evals["root"] / "no_frames"), [evals["flow"], evals["expert"]],
                           eval_store=evals["out"])).read()
    assert "| expert · train | 3 | 100% [44%–100%] | 100% [44%–100%] | **100%** [61%–100%] |" in md
    assert "No frames for push (expert · train): env 'mine' renders no frames (render() returned None)." in md
    assert capsys.readouterr().err.count("warning: no rollout frames: env 'mine' renders no frames") == 1


def test_every_run_of_the_learning_curves_is_in_the_legend():
    """The legend sat in the first panel, which held only the BC run: the DIVL+QAM curves had no label."""
    runs = {"bc": [{"update": u, "bc_loss": 1.0 / u} for u in (1, 2)],
            "divl_qam": [{"update": u, "value_loss": 2.0 / u, "q": float(u)} for u in (1, 2)]}
    fig = report_mod._curves_figure(runs)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["bc", "divl_qam"]
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["bc_loss", "value_loss", "q"]


@pytest.mark.slow
def test_report_has_tables_plots_and_html(evals):
    run = evals["root"] / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for u in range(50, 501, 50):
            f.write(json.dumps({"update": u, "bc_loss": 3.0 / math.sqrt(u), "updates_per_s": 40.0 + u % 3,
                                "data_wait": 0.02}) + "\n")
    (run / "summary.json").write_text(json.dumps({"version": 1, "episodes": 8, "wall_s": 12.0,
                                                  "final": {"update": 500, "bc_loss": 0.13}}))
    out = evals["root"] / "report"
    md_path = write_report(str(out), [evals["flow"], evals["expert"]], [str(run)], eval_store=evals["out"])
    md = open(md_path).read()
    assert "| policy · split | episodes/task | reach | push | mean |" in md
    assert "| expert · train | 3 | 100% [44%–100%] | 100% [44%–100%] | **100%** [61%–100%] |" in md
    assert "| v1 · heldout | 2 | 0% [0%–66%] | – | **0%** [0%–66%] |" in md
    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    assert {"success_rates.png", "learning_curves.png", "rollouts_expert-train_push.png",
            "rollouts_v1-heldout_reach.png"} <= set(pngs)
    for name in pngs:
        assert f"]({name})" in md and os.path.getsize(out / name) > 10_000
        with Image.open(out / name) as im:
            assert im.width >= 600 and im.height >= 200
    html = (out / "index.html").read_text()
    assert html.count("data:image/png;base64,") == len(pngs) and "<table>" in html
    with Image.open(out / "rollouts_expert-train_push.png") as im:
        strip = np.asarray(im)
    assert strip.shape[1] > 3 * strip.shape[0]  # 8 frames side by side, one successful row (no failures)


def test_report_lists_the_online_phase_run_goes_on_with(tmp_path):
    """`robo-post run`'s online phase logs into the offline phase's run_dir: the learning-curves
    table has a row for it (its versions, fleet episodes and last update), unfinished when killed."""
    run, out = tmp_path / "lwd", str(tmp_path / "report")
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"update": u, "bc_loss": 1.0 / u}) + "\n"
                                               for u in (10, 20, 30)))
    (run / "summary.json").write_text(json.dumps({"version": 2, "episodes": 11, "wall_s": 5.0,
                                                  "final": {"update": 20, "bc_loss": 0.05}}))
    md = open(write_report(out, [], [str(run)])).read()
    assert f"| `{run}` | v2 | 11 | 20 | 5 s | 0.0500 (bc_loss) |" in md
    assert f"| `{run}` (online) | – (not finished) | – | 30 (10 online) | – | 0.0333 (bc_loss) |" in md
    (run / "online.json").write_text(json.dumps({"versions": [3, 4], "online_episodes": 2, "wall_s": 7.0,
                                                 "final": {"update": 30, "bc_loss": 1 / 30}}))
    md = open(write_report(out, [], [str(run)])).read()
    assert f"| `{run}` (online) | v3, v4 | 2 | 30 (10 online) | 7 s | 0.0333 (bc_loss) |" in md and "not finished" not in md
    # a method logging another loss shows it, named (categorical_bc's nll showed as "–")
    (run / "summary.json").write_text(json.dumps({"version": 2, "episodes": 11, "wall_s": 5.0,
                                                  "final": {"update": 20, "nll": 0.25}}))
    assert f"| `{run}` | v2 | 11 | 20 | 5 s | 0.2500 (nll) |" in open(write_report(out, [], [str(run)])).read()


def test_report_reads_a_killed_runs_log_and_names_a_damaged_file(tmp_path, capsys):
    run, out = tmp_path / "run", str(tmp_path / "report")
    run.mkdir()
    rows = [{"update": u, "bc_loss": 1.0 / u} for u in (50, 100)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"update": 150, "bc_lo')
    md = open(write_report(out, [], [str(run)])).read()  # the row a kill cut short is left out
    assert "learning_curves.png" in md and read_metrics(str(run / "metrics.jsonl")) == rows
    (run / "summary.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"run/summary.json is not a run summary \(a JSON list, not an object\)"):
        write_report(out, [], [str(run)])
    evals = tmp_path / "eval" / "evals"
    evals.mkdir(parents=True)
    (evals / "v1-train.json").write_text("{}")
    with pytest.raises(ValueError, match=r"evals/v1-train.json is not an eval result \(no created, policy"):
        load_results(str(tmp_path / "eval"))
    for bad in ("run_dir", "eval_store"):  # a mistyped path: one line naming it, no empty report
        args = {"run_dir": str(run), "eval_store": str(tmp_path / "eval"), bad: str(tmp_path / "typo")}
        assert main(["report", *(f"{k}={v}" for k, v in args.items()), f"out_dir={out}"]) == 1
        assert capsys.readouterr().err.strip() == (f"robo-post report: FileNotFoundError: {bad}={tmp_path / 'typo'}: "
                                                   "no such folder (null to leave it out of the report)")


@pytest.mark.slow
@pytest.mark.parametrize("versions, error, more", [
    ("[1,5,7]", "PolicyNotFoundError: policy version(s) [5, 7] not found in", []),
    ("[1,0]", "NoExpertError: env 'Pendulum-v1' has no scripted expert", []),  # version 0 runs the expert by default
    # OmegaConf's "Input cfg is not an OmegaConf config object (int)" named neither the setting nor the fix
    ("[1]", "ValueError: env_kwargs=5: a mapping of env kwargs, e.g. 'env_kwargs={duration: 20}'", ["env_kwargs=5"]),
])
def test_eval_checks_every_listed_version_before_running_any(tmp_path, versions, error, more):
    """A missing version (or an expert the env lacks) later in the list failed after the earlier evals had run."""
    from helpers import run_cli

    store = Store.create(str(tmp_path / "s"), store_schema({"name": "Pendulum-v1"}, None))
    assert PolicyRegistry(store.root).publish({}, {"kind": "random"}) == 1
    r = run_cli("eval", f"store={store.root}", f"version={versions}", "episodes_per_task=1", "n_clients=1",
                *more, "show=false", ok=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert error in r.stderr.strip().splitlines()[-1]
    assert not os.path.exists(str(tmp_path / "s-eval"))  # nothing was evaluated


@pytest.mark.slow
@pytest.mark.fleet
def test_eval_prints_whole_intervals_when_its_output_is_piped(tmp_path):
    """Piped or redirected, rich cut the table to 80 columns: "[935.31–214…" read as another number."""
    from helpers import run_cli

    from robo_post.eval.rollout import format_mean, load_results

    store = Store.create(str(tmp_path / "s"), store_schema({"name": "Pendulum-v1"}, None))
    assert PolicyRegistry(store.root).publish({}, {"kind": "random"}) == 1
    r = run_cli("eval", f"store={store.root}", "version=1", "episodes_per_task=2", "n_clients=1", "show=false")
    (stats,) = load_results(store.root + "-eval")[-1]["tasks"].values()
    printed = format_mean(stats["mean_return"], stats["return_ci95"])
    assert len(printed) > 20 and printed in r.stdout, r.stdout


def test_report_of_a_killed_run_without_an_eval_store(tmp_path, capsys):
    """eval_store=null, which the report's own error suggests, was refused as 'not a non-empty string'; and
    the table showed '–' for the updates and loss a killed run had logged."""
    run, out = tmp_path / "bc", str(tmp_path / "report")
    run.mkdir()
    rows = [{"update": u, "bc_loss": 1.0 / u} for u in (50, 100)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", f"run_dir={run}", "eval_store=null", f"out_dir={out}"]) == 0, capsys.readouterr().err
    md = open(os.path.join(out, "report.md")).read()
    assert f"| `{run}` | – (not finished) | – | 100 | – | 0.0100 (bc_loss) |" in md
    # A `robo-post run` folder (no log of its own) stands for its phases' runs, not for one empty row.
    assert main(["report", f"run_dir={tmp_path}", "eval_store=null", f"out_dir={out}"]) == 0, capsys.readouterr().err
    md = open(os.path.join(out, "report.md")).read()
    assert f"| `{run}` | – (not finished) | – | 100 | – | 0.0100 (bc_loss) |" in md and f"| `{tmp_path}` |" not in md
