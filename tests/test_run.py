"""Smoke test of the main job (`robo-post run`) on a tiny, state-only budget."""

import json
import fcntl
import os
import subprocess
import sys

import pytest

from robo_post.config import compose
from robo_post.store import PolicyRegistry, Store
from robo_post.store.writer import lock_shard


TINY = [
    "show=false", "env.tasks=[reach]", "env.kwargs.render_images=false",
    "preset.demo_episodes=6", "preset.play_episodes=3", "preset.deploy_episodes=2", "preset.bc_updates=30", "bc.eval.every=0",
    "+bc.model.use_text=false", "+bc.model.hidden_dim=32", "+bc.model.embed_dim=16", "bc.batch_size=16",
    "preset.critic_warmup=5", "preset.offline_updates=15", "preset.online_publish_every=10",
    "preset.online_episodes=2", "preset.online_updates=10", "preset.eval_episodes=2", "lwd.batch_size=16",
]


@pytest.mark.slow
@pytest.mark.fleet
def test_run_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}", *TINY, "fleet.n_clients=1",
        # The interventions recipe, with the overseer rescuing the fleet's own episodes from step 2 on; a
        # co-trained base imitates that.
        "recipe=interventions", "fleet.overseer.deadline=0.05",
    ]
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", "run", *overrides], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" not in r.stderr  # the online phase starts from the offline phase's checkpoint: no resume
    summary = json.loads((run_dir / "summary.json").read_text())
    # v1 = BC, v2 = offline DIVL+QAM, v3 = after the online round; each on both phrasings splits.
    assert sorted({(row["version"], row["split"]) for row in summary["results"]}) == [
        (v, s) for v in (1, 2, 3) for s in ("heldout", "train")]
    assert all(0.0 <= row["mean_success"] <= 1.0 for row in summary["results"])
    online = json.loads((run_dir / "lwd" / "online.json").read_text())
    assert online["versions"] == [3] and 1 <= online["online_episodes"] <= 2  # the learner ran beside the fleet
    _, config = PolicyRegistry(str(run_dir / "store")).load(3)
    assert (config["parent_version"], config["phase"], config["snapshot"]) == (2, "online-25", online["snapshot"])
    episodes = Store.open(str(run_dir / "store")).snapshot()
    assert sum(e.client_id.startswith("online") for e in episodes) == 2
    # BC's own rollouts (the deploy stage) are recorded before extraction and are part of its data.
    assert [e.policy_version for e in episodes if e.client_id.startswith("deploy")] == [1, 1]
    # Only the policy's episodes (deploy, online) are overseen; scripted demos and play are not.
    for e in episodes:
        assert (e.attrs["interventions"] > 0) == e.client_id.startswith(("deploy", "online")), e.client_id
    evaluated = Store.open(str(run_dir / "eval-store")).snapshot()
    assert len(evaluated) and all(e.attrs["interventions"] == 0 for e in evaluated)  # success is the policy's own
    offline = json.loads((run_dir / "lwd" / "summary.json").read_text())
    assert offline["episodes"] == 6 + 3 + 2
    rows = [json.loads(line) for line in (run_dir / "lwd" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["update"] == 25 and "loss_am" in rows[-1] and "tau_mean" in rows[-1] and "bc_loss_base" in rows[-1]
    report = (run_dir / "report" / "report.md").read_text()
    online = 25 - offline["final"]["update"]  # the online phase's counter goes on from the offline one's
    assert f"| `{run_dir / 'lwd'}` (online) | v3 | 2 | 25 ({online} online) |" in report
    assert "v3" in report and os.path.getsize(run_dir / "report" / "success_rates.png") > 0


@pytest.mark.slow
@pytest.mark.fleet
def test_run_with_the_store_on_s3_and_the_fleet_on_two_ray_nodes(s3_server, tmp_path, monkeypatch):
    """The whole loop with its episodes and policies in a bucket and its fleet stages on a Ray
    cluster of two nodes (Ray's cluster utilities on this machine): one client per node."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("ROBO_POST_STATE_DIR", str(tmp_path / "state"))
    url = f"s3://{s3_server.bucket()}/run"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})  # after the fixture's credentials
    cluster.add_node(num_cpus=1)
    try:
        r = subprocess.run([sys.executable, "-m", "robo_post.cli", "run", f"run_dir={tmp_path / 'run'}", f"store={url}",
                            "fleet.launcher=ray", f"fleet.address={cluster.address}", "fleet.n_clients=2", *TINY],
                           capture_output=True, text=True, timeout=900)
    finally:
        cluster.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sorted({(row["version"], row["split"]) for row in summary["results"]}) == [
        (v, s) for v in (1, 2, 3) for s in ("heldout", "train")]
    assert PolicyRegistry(url).versions() == [1, 2, 3] and not (tmp_path / "run" / "store").exists()
    snap = Store.open(url).snapshot()
    assert sorted(snap.counts) == [f"{stage}-{i}" for stage in ("demo", "deploy", "online", "play") for i in (0, 1)]
    assert sum(e.client_id.startswith("demo") for e in snap) == 6
    # no credentials in anything the run wrote: its folder, the host's fleet state, the bucket's objects
    import obstore

    from robo_post.store.bucket import Objects

    secrets = [s3_server.access_key.encode(), s3_server.secret_key.encode()]
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    objects = Objects(url)
    written += [objects.get(m["path"]) for batch in obstore.list(objects.store) for m in batch]
    assert len(written) > 50 and not any(key in data for data in written for key in secrets)


@pytest.mark.fleet
def test_run_recipes():
    """`robo-post run` runs the interventions recipe unless told ``recipe=none``; overrides still win."""
    cfg = compose("run", [])
    assert cfg.preset.deploy_episodes == 800 and cfg.fleet.overseer.enabled and cfg.fleet.overseer.deadline == 0.5
    assert cfg.lwd.actor.base == "ema_cotrained" and cfg.lwd.imitation.enabled
    plain = compose("run", ["recipe=none"])
    assert plain.preset.deploy_episodes == 0 and not plain.fleet.overseer.enabled and plain.fleet.overseer.deadline is None
    assert "base" not in plain.lwd.actor and not plain.lwd.imitation.enabled
    tuned = compose("run", ["preset.deploy_episodes=40", "fleet.overseer.deadline=0.3"])
    assert (tuned.preset.deploy_episodes, tuned.fleet.overseer.deadline) == (40, 0.3)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, error", [
    (["env=Pendulum-v1"], "NoExpertError: robo-post run records scripted demonstrations; env 'Pendulum-v1' has no "
                          "scripted expert"),
    # the play stage ran near misses the point mass's expert does not have: clients crashed after the demos
    (["env=point_mass", "recipe=none"], "UnknownExpertModeError: play.mode=near_miss: the expert of env "
                                        "'point_mass' has no such mode; modes: expert"),
    # the recipe's overseer watched deploy episodes only after the demos, play and BC training had run
    (["env=point_mass", "play.mode=expert"], "OverseerUnsupportedError: env 'point_mass' has no overseer"),
    # CRAFT found the env reports no events only after the demos had been recorded
    (["env=point_mass", "recipe=craft", "play.mode=expert"], "CraftDataError: env 'point_mass' reports no per-step `events`"),
    # the run trained every stage, then evaluated nothing and exited 0
    (["env=highway_meta", "recipe=craft", "play.mode=expert", "eval.splits=[heldout]"],
     "NoEvalSplitError: eval.splits=['heldout']: env 'highway_meta' has no instruction splits"),
])
def test_run_refuses_an_env_its_stages_cannot_run_in_before_any_stage(tmp_path, overrides, error):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", "run", f"run_dir={run_dir}", *overrides,
                        "demos.episodes=2", "play.episodes=1", "bc.updates=5", "deploy.episodes=1", "show=false"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"robo-post run: {error}"), r.stderr[-2000:]
    assert not run_dir.exists()


@pytest.mark.slow
def test_collect_refuses_an_expert_mode_the_env_lacks(tmp_path):
    """Every client crashed on the mode, restarted and crashed again before the fleet gave up."""
    store = tmp_path / "store"
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", "collect", "env=point_mass", "policy.mode=near_miss",
                        "episodes=2", f"store={store}", "show=false"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("robo-post collect: UnknownExpertModeError: env 'point_mass': its "
                                                 "expert has no mode 'near_miss'; modes: expert")
    assert not store.exists()


@pytest.mark.slow
@pytest.mark.parametrize("overrides, error", [
    (["seed=-1"], "CollectSettingsError: seed=-1: seeds must be >= 0"),
    (["policy=sb3"], "CollectSettingsError: policy=sb3 needs policy.path=AGENT.zip (the zip SB3's save wrote)"),
    (["policy=sb3", "policy.path=/nowhere/agent.zip"], "CollectSettingsError: policy.path=/nowhere/agent.zip: no such file"),
    (["fleet.policy_version=1"], "PolicyNotFoundError: fleet.policy_version=1 is not published in {store}/policies; "
                                 "published: none"),
])
def test_collect_refuses_settings_every_client_would_fail_on(tmp_path, overrides, error):
    """The clients failed on them (an SB3 path was even reported as '???.zip' or 'agent.zip.zip'; a pinned
    version that was never published created the store, then failed in every client)."""
    store = tmp_path / "store"
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", "collect", "env=point_mass", *overrides,
                        "episodes=2", f"store={store}", "show=false"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"robo-post collect: {error.format(store=store)}", r.stderr[-2000:]
    assert not store.exists()


def test_a_recipes_free_form_training_settings_are_taken_and_unknown_ones_refused_before_any_stage(tmp_path):
    """`+bc.algo.env_kwargs.duration=12` with recipe=craft failed with omegaconf's traceback after
    the demos were recorded; a misspelt bc key failed the same way."""
    from robo_post.config import compose
    from robo_post.pipelines.run import RunSettingsError, bc_stage_config, check_stages

    run_dir = tmp_path / "run"
    cfg = compose("run", ["env=highway_meta", "recipe=craft", "+bc.algo.env_kwargs.duration=12", f"run_dir={run_dir}"])
    train = bc_stage_config(cfg)
    assert (train.algo.name, dict(train.algo.env_kwargs), train.store) == ("craft", {"duration": 12}, f"{run_dir}/store")
    # (the CLI refuses a misspelt key first; composed otherwise, the stage's config names it)
    cfg = compose("run", ["+bc.updatse=1", f"run_dir={run_dir}"])
    with pytest.raises(RunSettingsError, match=r"^bc.updatse: `robo-post train` has no such setting"):
        check_stages(cfg)
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_run_dir_reused_with_other_settings_is_refused(tmp_path):
    """A rerun skipped the finished BC stage (v1 kept its 10 updates) while config.yaml recorded the new 20."""
    run_dir = tmp_path / "run"
    tiny = [f"run_dir={run_dir}", "env=point_mass", "recipe=none", "play.mode=expert", "demos.episodes=3",
            "play.episodes=0", "bc.eval.every=0", "lwd.enabled=false", "eval.episodes_per_task=1", "fleet.n_clients=1"]

    def run(*overrides):
        return subprocess.run([sys.executable, "-m", "robo_post.cli", "run", *tiny, *overrides], capture_output=True,
                              text=True, timeout=300)

    assert run("bc.updates=10", "show=false").returncode == 0
    changed = run("bc.updates=20", "show=false")
    assert changed.returncode == 1
    assert changed.stderr.strip().splitlines()[-1] == (
        f"robo-post run: RunSettingsChangedError: {run_dir} holds a run with other settings (bc.updates: 10 -> 20); "
        "its finished stages would be kept as they are. Rerun with the recorded settings to resume it, or use a new "
        "run_dir")
    assert "updates: 10" in (run_dir / "config.yaml").read_text()
    assert run("bc.updates=10", "show=true", "device=cpu").returncode == 0  # display and device settings may change
    assert PolicyRegistry(str(run_dir / "store")).versions() == [1]
    (run_dir / "config.yaml").write_text("bc: [updates: 10\n")  # damaged by hand: one line naming it
    damaged = run("bc.updates=10", "show=false")
    assert damaged.returncode == 1 and damaged.stderr.strip().splitlines()[-1] == (
        f"robo-post run: RunSettingsChangedError: {run_dir / 'config.yaml'} is damaged (ParserError); restore it, "
        "or use a new run_dir")


@pytest.mark.slow
def test_a_second_collect_into_shards_in_use_is_refused(tmp_path):
    """It exited 0 reporting its episodes done while recording none: its clients found the shards
    locked and the first collect's status files reporting its own target."""
    store = tmp_path / "store"
    cli = [sys.executable, "-m", "robo_post.cli", "collect", "env=point_mass", "episodes=2", "fleet.n_clients=1",
           f"store={store}", "show=false"]
    assert subprocess.run(cli, capture_output=True, text=True, timeout=120).returncode == 0

    def refused_while_held(held: int, message: str) -> None:
        try:
            r = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        finally:
            os.close(held)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == f"robo-post collect: {message}", r.stderr
        assert len(Store.open(str(store)).snapshot(record=False)) == 2

    refused_while_held(  # as the first collect's client, still running
        lock_shard(str(store / "shards" / "client-0"), "client-0"),
        f"ShardLockedError: shard 'client-0' is already open for writing by another process (another collect into "
        f"{store}?): nothing was recorded; give this one its own fleet.client_prefix")
    # Started within a second of each other, both read the same commits before either client
    # held a shard: the second exited 0 having recorded nothing. A running collect holds its ids.
    held = os.open(store / "fleet" / ".collect-client.lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    refused_while_held(held, f"ShardLockedError: another collect with fleet.client_prefix=client is running into "
                             f"{store}: nothing was recorded; wait for it, or give this one its own fleet.client_prefix")
    assert subprocess.run(cli, capture_output=True, text=True, timeout=120).returncode == 0  # released on exit
    assert len(Store.open(str(store)).snapshot(record=False)) == 4
