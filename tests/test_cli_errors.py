"""The command line on user errors: one line naming the option, the value and what is allowed,
a non-zero exit and nothing written; Ctrl-C; help, `--cfg job`, `config`, `--version`; a
finished `train` re-run publishes nothing."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from robo_post.fleet.client import read_status
from robo_post.store import PolicyRegistry, Store

from helpers import cli_in_process
from test_store import tree_hash


def _cli(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "robo_post.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


BAD = [  # (command, overrides, what the error line must name)
    ("collect", ["episodes=abc"], ["episodes='abc'", "integer >= 1"]),
    ("collect", ["fleet.n_clients=0"], ["fleet.n_clients=0", "integer >= 1"]),
    ("collect", ["+framez=false"], ["framez", "known keys at the top level", "episodes"]),
    # hydra's "Could not override 'policy.noise'", naming no setting of the chosen policy
    ("collect", ["policy=random", "policy.noise=0"], ["policy has no setting 'noise' (its settings: kind); "
                                                      "+policy.noise=0 adds one"]),
    ("collect", ["fleet.overseer.deadline=2"], ["fleet.overseer.deadline=2", "(0, 1]"]),
    ("collect", ["env=gym"], ["env.name='???'", "non-empty string"]),
    ("collect", ["episodes=[1,"], ["episodes=[1,"]),  # hydra's own parse error, on one line
    ("eval", ["episodes_per_task=abc"], ["episodes_per_task='abc'", "integer >= 1"]),
    ("eval", ["version=newest"], ["version='newest'", "latest"]),
    ("train", ["algo=nope"], ["algo='nope'", "divl_qam"]),
    ("train", ["updates=1.5"], ["updates=1.5", "integer >= 1"]),
    # numpy's "expected non-negative integer" (eval: from every client) and torch's overflow, naming no key
    ("train", ["seed=-1"], ["seed=-1", "an integer in [0, 2**63)"]),
    ("train", ["seed=99999999999999999999"], ["seed=99999999999999999999", "[0, 2**63)"]),
    ("eval", ["seed=-1"], ["seed=-1", "an integer in [0, 2**63)"]),
    ("train", ["+algo.critic_warmpu=3", "algo=divl_qam"], ["algo.critic_warmpu", "critic_warmup"]),
    ("report", ["frames=maybe"], ["frames='maybe'", "true | false"]),
    ("run", ["+bc.model.hiden=3"], ["bc.model.hiden", "hidden_dim"]),
    ("run", ["lwd.algo=bc_flow"], ["lwd.algo='bc_flow'", "divl_qam"]),
    ("train", ["algo=drest", "algo.lam=-1"], ["algo.lam=-1", "(0, 1]"]),
    ("train", ["algo=drest", "algo.eval_every=-1"], ["algo.eval_every=-1", "integer >= 0"]),
    ("steer", ["actor.kind=registry", "actor.version=-1"], ["actor.version=-1", "latest | a version number >= 1"]),
    ("steer-eval", ["actor.kind=registry", "prior.version=abc"], ["prior.version='abc'", "latest"]),
    # inf passed the range check and failed after the deployment store was created
    ("steer", ["actor.kind=registry", "selector.kl_budget=inf"], ["selector.kl_budget=inf", "[0, inf) or null"]),
    ("steer", ["actor.kind=registry", "prior.std=inf"], ["prior.std=inf", "(0, inf) or null"]),
    # one episode per arm labelled arms HELP/HURT from a zero-width bootstrap CI
    ("steer-eval", ["actor.kind=registry", "episodes=1"], ["episodes=1", "integer >= 2"]),
    # alpha 1 passed as "in [0, 1)" and failed at the klreg arms, after the poe arms had run
    ("steer-eval", ["actor.kind=registry", "alpha_grid=[0.5,1.0]"], ["alpha_grid=[0.5, 1.0]", "item 1 is 1.0"]),
    # a repeated point of the sweep was run and reported twice
    ("steer-eval", ["actor.kind=registry", "alpha_grid=[0.5,0.3,0.5]"], ["each once; item 2 repeats item 0"]),
    ("steer-eval", ["actor.kind=registry", "rules=[poe,poe]"], ["each once; item 1 repeats item 0"]),
    pytest.param("train", ["device=cuda"], ["device=cuda but CUDA is not available; use device=cpu or auto"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
]


@pytest.mark.parametrize("command,overrides,names", BAD, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_a_bad_value_is_one_line_naming_it_and_writes_nothing(tmp_path, command, overrides, names):
    paths = {"collect": ["store=s"], "eval": ["store=s", "out_store=e"], "train": ["store=s", "run_dir=r"],
             "report": ["run_dir=r", "eval_store=e", "out_dir=o"], "run": ["run_dir=r"], "steer": ["store=s"],
             "steer-eval": ["out_dir=o"]}[command]
    r = cli_in_process(command, *paths, *overrides, cwd=tmp_path)  # the checks run before any work
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"robo-post {command}: "), r.stderr
    assert all(name in lines[0] for name in names), lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert os.listdir(tmp_path) == []  # no store, run dir or report was created


@pytest.mark.slow
def test_the_ray_launcher_without_its_settings_is_one_line_and_writes_nothing(tmp_path):
    """A ConfigAttributeError traceback, after the store had been created."""
    r = _cli("collect", "store=s", "fleet.launcher=ray", "episodes=1", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "fleet.launcher=ray alone lacks the Ray settings (fleet.address, fleet.num_cpus): select the Ray fleet " \
           "with fleet=ray" in r.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.fleet
def test_collect_env_store_runs_the_env_the_store_was_recorded_in(tmp_path):
    """`collect --help` listed env=store, which only eval took ("env.name=null is not allowed")."""
    first = _cli("collect", "store=s", "env=point_mass", "+env.kwargs.goal=[0.5,0.5]", "episodes=1",
                 "fleet.n_clients=1", "show=false", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    more = _cli("collect", "store=s", "env=store", "episodes=1", "fleet.n_clients=1", "show=false", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    episodes = Store.open(str(tmp_path / "s")).snapshot().episodes()
    assert [e.attrs["env_kwargs"] for e in episodes] == [{"goal": [0.5, 0.5]}] * 2
    r = _cli("collect", "store=t", "env=store", "episodes=1", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.strip().endswith("env=store collects in the env the store was recorded "
                                                           "in, but t does not exist: give env=NAME")
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_help_anywhere_composes_the_overrides_and_lists_the_group_choices():
    late = cli_in_process("train", "store=x", "--help", "algo=divl_qam")  # --help among the overrides, before one
    assert late.returncode == 0, late.stderr
    assert "algo     bc_flow | categorical_bc | craft | divl_qam | drest | fql | gaussian_bc | iql_qam | sb3   (now: divl_qam)" in late.stdout
    # divl_qam's settings with their comments, not bc_flow's; the other overrides are listed.
    assert "critic_warmup: null      # critic-only updates before the actor moves; null = half of the updates" in late.stdout
    assert "configs/algo/bc_flow.yaml" not in late.stdout and late.stdout.rstrip().endswith("store=x")
    collect = cli_in_process("collect", "-h").stdout
    assert "env      driving | gym | highway_meta | point_mass | reacher | store | tabletop | any gymnasium id   (now: tabletop)" in collect
    assert "episodes: 24           # total new episodes across the fleet" in collect


def test_cfg_job_and_config_print_the_composed_config_without_running(tmp_path):
    r = cli_in_process("collect", "--cfg", "job", "store=s", "episodes=3", "env=CartPole-v1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert (cfg["episodes"], cfg["store"], cfg["env"]["name"]) == (3, "s", "CartPole-v1")
    cfg = yaml.safe_load(cli_in_process("config", "train", "algo=sb3", "--resolve", cwd=tmp_path).stdout)
    assert cfg["algo"]["name"] == "sb3" and cfg["checkpoint_every"] == 10000
    assert cli_in_process("config", "train", "updates=0", cwd=tmp_path).returncode == 2  # checked like a run
    # a setting the job needs and nobody gave prints as ??? (printing refused it), a wrong one is still refused
    r = cli_in_process("config", "steer", cwd=tmp_path)
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["actor"]["kind"] == "???", r.stderr
    assert cli_in_process("config", "steer", "actor.kind=foo", cwd=tmp_path).returncode == 2
    # hydra's grammar refused an unquoted non-ASCII path ("token recognition error at: 'é'")
    r = cli_in_process("collect", "--cfg", "job", "store=runs/données", "+env.kwargs.note=é,x", cwd=tmp_path)
    assert r.returncode == 2 and "cannot parse '+env.kwargs.note=é,x'" in r.stderr  # not a plain value: not quoted
    r = cli_in_process("collect", "--cfg", "job", "store=runs/données", cwd=tmp_path)
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["store"] == "runs/données", r.stderr
    r = cli_in_process("train", "--cfg", cwd=tmp_path)  # was "cannot parse '--cfg'"
    assert r.returncode == 2 and r.stderr.strip() == ("robo-post train: --cfg takes job or all (`--cfg job` prints the "
                                                      "composed config)")
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_version():
    from importlib.metadata import version

    r = _cli("--version")
    assert r.returncode == 0 and r.stdout == f"robo-post {version('robo-post')}\n"


@pytest.mark.parametrize("how", ["flag", "env", "off"])
def test_debug_adds_the_traceback_to_the_one_line(tmp_path, capsys, monkeypatch, how):
    from robo_post.cli import main

    missing = str(tmp_path / "nowhere")
    monkeypatch.setenv("ROBO_POST_DEBUG", "1" if how == "env" else "0")
    assert main((["--debug"] if how == "flag" else []) + ["store", "info", missing]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("robo-post store: ") and missing in err.strip().splitlines()[-1]
    assert ("Traceback (most recent call last)" in err) == (how != "off")
    assert not os.path.exists(missing)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A `robo-post collect` sent Ctrl-C (SIGINT to its process group, as a terminal does) once its
    client has committed two episodes: (the store, the exit code, stderr). It asks for far more
    episodes than it can finish before the signal (the reach expert collects ~60 episodes/s)."""
    store = str(tmp_path_factory.mktemp("ctrl_c") / "store")
    proc = subprocess.Popen(
        [sys.executable, "-m", "robo_post.cli", "collect", f"store={store}", "episodes=100000", "env.tasks=[reach]",
         "env.kwargs.render_images=false", "fleet.n_clients=1", "show=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        # a terminal's Ctrl-C: the default disposition, even when pytest itself runs where SIGINT
        # is ignored (a background job of a non-interactive shell), which a child would inherit
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300  # generous: on loaded cores MuJoCo's start-up alone can take a minute
    while ((read_status(store, "client-0") or {}).get("episodes", 0) < 2 and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    return store, proc.returncode, stderr


@pytest.mark.slow
def test_ctrl_c_is_a_clean_message_and_leaves_a_valid_store(interrupted):
    store, returncode, stderr = interrupted
    assert returncode == 130 and stderr.strip() == "robo-post collect: interrupted", stderr
    r = _cli("store", "validate", store)
    assert r.returncode == 0 and r.stdout.strip().endswith(" episodes verified, 0 problems"), r.stdout + r.stderr
    assert int(r.stdout.split()[0]) >= 2  # the committed episodes survived


@pytest.mark.slow
def test_rerunning_a_finished_train_publishes_nothing(interrupted, tmp_path):
    store = interrupted[0]
    args = ["train", f"store={store}", f"run_dir={tmp_path / 'run'}", "updates=4", "batch_size=4", "log_every=2",
            "model.use_images=false", "model.use_text=false", "model.hidden_dim=16", "model.embed_dim=8",
            "model.flow_steps=2", "prefetch=0", "device=cpu", "show=false", "data.success=null"]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr
    again = _cli(*args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == json.loads(first.stdout) and json.loads(first.stdout)["version"] == 1
    assert "already done (update 4 of 4, published version 1)" in again.stderr
    assert PolicyRegistry(store).versions() == [1]
    weights = PolicyRegistry(store).load(1)[0]
    with open(os.path.join(store, "policies", "v000001", "model.safetensors"), "r+b") as f:  # damaged since
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))
    repaired = _cli(*args)  # the way back: the finished run publishes its final weights again
    assert repaired.returncode == 0 and json.loads(repaired.stdout)["version"] == 2, repaired.stderr
    assert "finished, but policy version 1: " in repaired.stderr and "published again" in repaired.stderr
    assert all(torch.equal(PolicyRegistry(store).load(2)[0][k], v) for k, v in weights.items())
    more = _cli(*args[:3], "updates=6", *args[4:])  # a larger target continues the run and publishes
    assert more.returncode == 0 and json.loads(more.stdout)["version"] == 3, more.stderr


@pytest.mark.slow
def test_a_run_dir_of_another_method_is_refused_and_left_as_it_was(interrupted, tmp_path):
    """Two trains at one run_dir (e.g. the default): the second loaded the first's checkpoint and
    failed calling it damaged, after overwriting the run's config.yaml with its own settings."""
    store, run_dir = str(tmp_path / "store"), tmp_path / "run"
    shutil.copytree(interrupted[0], store)
    common = [f"store={store}", f"run_dir={run_dir}", "batch_size=4", "log_every=2", "prefetch=0",
              "device=cpu", "show=false", "data.success=null", "model.use_images=false", "model.use_text=false",
              "model.hidden_dim=16", "model.embed_dim=8"]
    first = _cli("train", "algo=gaussian_bc", *common, "updates=4")
    assert first.returncode == 0, first.stderr
    before, published = tree_hash(str(run_dir)), PolicyRegistry(store).versions()
    for updates in ("updates=4", "updates=8"):  # as if finished, and as if to be continued
        other = _cli("train", "algo=bc_flow", *common, updates, "model.flow_steps=2")
        assert other.returncode == 1 and other.stderr.strip() == (
            f"robo-post train: RunResumeError: {run_dir} holds a run of algo=gaussian_bc (store {store}), not of "
            "algo=bc_flow; nothing was changed. Give this run its own run_dir, e.g. run_dir=runs/bc_flow"), other.stderr
    assert tree_hash(str(run_dir)) == before and PolicyRegistry(store).versions() == published


@pytest.mark.slow
def test_a_run_dir_in_use_or_not_a_run_dir_is_refused_and_nothing_is_written(interrupted, tmp_path):
    """Two trains at once in one run_dir wrote one checkpoint and one metrics log over each
    other (a traceback from the checkpoint's temp dir, duplicate metric rows)."""
    store, run_dir = str(tmp_path / "store"), tmp_path / "run"
    shutil.copytree(interrupted[0], store)
    common = [f"store={store}", "algo=gaussian_bc", "updates=4", "batch_size=4", "prefetch=0", "device=cpu",
              "show=false", "data.success=null", "model.use_images=false", "model.use_text=false",
              "model.hidden_dim=16"]
    run_dir.mkdir()
    held = os.open(run_dir, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # what a training process holds while it runs
    busy = _cli("train", *common, f"run_dir={run_dir}")
    assert busy.returncode == 1 and busy.stderr.strip() == (
        f"robo-post train: RunLockedError: run_dir={run_dir} is in use by another training process: wait for it "
        "to finish, or give this run its own run_dir"), busy.stderr
    assert os.listdir(run_dir) == []
    os.close(held)
    (tmp_path / "a_file").write_text("x")
    stored = tree_hash(store)
    for bad, what in ((store, "is a trajectory store"), (tmp_path / "a_file", "is a file, not a directory")):
        refused = _cli("train", *common, f"run_dir={bad}")
        assert refused.returncode == 1 and f"robo-post train: ValueError: run_dir={bad} {what}" in refused.stderr
    assert tree_hash(store) == stored and (tmp_path / "a_file").read_text() == "x"
    refused = _cli("run", f"run_dir={tmp_path / 'a_file'}")  # was FileExistsError: [Errno 17]
    assert refused.returncode == 1 and f"robo-post run: ValueError: run_dir={tmp_path / 'a_file'} is a file" in refused.stderr
    nothing = _cli("train", *common, f"run_dir={tmp_path / 'new'}", "data.tasks=[nope]")
    assert nothing.returncode == 1 and "NoEpisodesError" in nothing.stderr
    assert not (tmp_path / "new").exists()  # the run dir the refused run created is gone again
    assert _cli("train", *common, f"run_dir={run_dir}").returncode == 0  # released when its holder ends
