"""Flow policy: Gaussian flow-matching closed form, sampling, artifacts, training smoke + resume."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from robo_post.config import compose
from robo_post.learner.checkpoint import CheckpointError
from robo_post.learner.data import NoEpisodesError
from robo_post.learner.publish import NonFiniteWeightsError, publish_once
from robo_post.learner.runs import RunResumeError
from robo_post.learner.train import train
from robo_post.models.features import Feature, state_features
from robo_post.models.flow import FlowPolicy, FlowPolicyConfig, FlowPolicyRunner, densest
from robo_post.store import ArraySpec, PolicyRegistry, Store, StoreSchema
from test_store import tree_hash

MU, S = 0.3, 0.5


def exact_velocity(x, w, mu=MU, s=S):
    """The velocity of the linear path from N(0,1) to N(mu, s^2)."""
    d = (1 - w) ** 2 + w**2 * s**2
    k = (w * s**2 - (1 - w)) / d
    return mu + k * (x - w * mu)


def test_euler_sampling_of_exact_field_hits_target_moments():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    n = 1000
    for i in range(n):
        x = x + exact_velocity(x, i / n) / n
    assert x.mean().item() == pytest.approx(MU, abs=1e-2)
    assert x.std().item() == pytest.approx(S, abs=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("predicts", ["chunk", "velocity"])
def test_flow_matching_recovers_the_gaussian_flow(predicts):
    torch.manual_seed(0)
    # Bounds of +-3 map actions to a/3, so the data is N(0.1, (1/6)^2) in normalised
    # units and (almost) never clipped.
    cfg = FlowPolicyConfig(features=state_features(1, "proprio"), action_dim=1, horizon=1, use_text=False, embed_dim=8, hidden_dim=64,
                           action_low=[-3.0], action_high=[3.0], predicts=predicts)
    model = FlowPolicy(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    obs = {"proprio": torch.zeros(512, 1)}
    for _ in range(1500):
        actions = MU + S * torch.randn(512, 1, 1)
        loss = model.bc_loss(obs, actions)
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = torch.linspace(0.05, 0.95, 19).repeat_interleave(200)
    x = torch.randn(len(w), 1, 1)
    with torch.no_grad():
        pred = model.output(model.encode({"proprio": torch.zeros(len(w), 1)}), x, w).squeeze()
    # What the network regresses onto: the velocity, or the chunk it points to, E[x_1 | x_w].
    target = exact_velocity(x.squeeze(), w, MU / 3, S / 3)
    if predicts == "chunk":
        target = x.squeeze() + (1 - w) * target
    rel = (pred - target).norm() / target.norm()
    # A 5% error needs longer training; 1500 CPU steps reach ~10% on the velocity and ~20% on
    # the chunk (it varies less around its mean, so the same fit reads larger); untrained: ~100%.
    assert rel.item() < (0.3 if predicts == "chunk" else 0.15), rel
    model.config.flow_steps = 200  # 10 Euler steps shrink this narrow target's std to ~0.37 even with the exact field
    samples = model.sample({"proprio": torch.zeros(4000, 1)}, seed=1).squeeze()
    assert samples.mean().item() == pytest.approx(MU, abs=0.05)
    assert samples.std().item() == pytest.approx(S, abs=0.06)


def _image_model():
    cfg = FlowPolicyConfig(features=state_features(5, "proprio") | {"image": Feature("image", (32, 32, 3))}, action_dim=3, horizon=4, use_text=False, embed_dim=16,
                           hidden_dim=32, action_low=[-2.0, 0.0, -1.0], action_high=[2.0, 1.0, 1.0])
    torch.manual_seed(0)
    return FlowPolicy(cfg)


def _obs(b):
    g = torch.Generator().manual_seed(3)
    return {"proprio": torch.randn(b, 5, generator=g), "image": torch.randint(0, 256, (b, 32, 32, 3), generator=g, dtype=torch.uint8)}


def test_shapes_bounds_and_deterministic_sampling():
    model = _image_model()
    obs = _obs(6)
    a = model.sample(obs, seed=7)
    assert a.shape == (6, 4, 3)
    assert (a >= model.action_low).all() and (a <= model.action_high).all()
    assert torch.equal(a, model.sample(obs, seed=7))
    assert not torch.equal(a, model.sample(obs, seed=8))
    z = model.encode(obs)
    assert z.shape == (6, 32)
    assert model.velocity(z, torch.zeros(6, 4, 3), torch.rand(6)).shape == (6, 4, 3)
    x = torch.rand(10, 3) * (model.action_high - model.action_low) + model.action_low
    assert torch.allclose(model.unnormalize_actions(model.normalize_actions(x)), x, atol=1e-6)
    assert model.bc_loss(obs, a, torch.ones(6, 4, dtype=torch.bool)).ndim == 0


def test_registry_round_trip_gives_bit_identical_actions(tmp_path):
    model = _image_model()
    model.set_state_stats(np.arange(5.0), np.full(5, 2.0))
    store = Store.create(str(tmp_path / "s"), StoreSchema({"x": ArraySpec("float32", (1,))}, ArraySpec("float32", (1,))))
    registry = PolicyRegistry(store.root)
    version = registry.publish(*model.artifact(algorithm="test"))
    loaded = FlowPolicy.from_artifact(*registry.load(version))
    obs = _obs(3)
    assert torch.equal(model.eval().sample(obs, seed=11), loaded.sample(obs, seed=11))
    assert torch.equal(loaded.encoder.state_mean, torch.arange(5.0))
    assert registry.load(version)[1]["algorithm"] == "test"


def test_a_policy_published_before_chunk_prediction_acts_as_it_did():
    """Its network outputs the velocity; read as a chunk predictor it would act otherwise."""
    model = _image_model()
    model.config.predicts = "velocity"
    weights, config = model.artifact()
    del config["model"]["predicts"]  # what versions published before the setting existed hold
    loaded = FlowPolicy.from_artifact(weights, config)
    obs = _obs(3)
    assert loaded.config.predicts == "velocity"
    assert torch.equal(model.eval().sample(obs, seed=11), loaded.sample(obs, seed=11))
    model.config.predicts = "chunk"
    assert not torch.equal(model.sample(obs, seed=11), loaded.sample(obs, seed=11))
    with pytest.raises(ValueError, match="predicts must be one of"):
        FlowPolicyConfig(features=model.config.features, action_dim=3, predicts="noise")


def test_runner_executes_chunks_open_loop():
    model = _image_model()
    model.config.execute_steps = 2
    runner = FlowPolicyRunner(model)

    class Env:
        class unwrapped:
            instruction = "x"

    runner.reset(Env, seed=0)
    obs = {"proprio": np.zeros(5, np.float32), "image": np.zeros((32, 32, 3), np.uint8)}
    first = [runner.act(obs, Env) for _ in range(2)]
    chunk = model.sample({"proprio": torch.zeros(1, 5), "image": torch.zeros(1, 32, 32, 3, dtype=torch.uint8),
                          "instruction": ["x"]}, seed=0)[0].numpy()
    np.testing.assert_array_equal(np.stack(first), chunk[:2])


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A few scripted-expert reach episodes, state-only, recorded by the real fleet."""
    root = str(tmp_path_factory.mktemp("bc") / "store")
    r = subprocess.run(
        [sys.executable, "-m", "robo_post.cli", "collect", f"store={root}", "episodes=6", "env.tasks=[reach]",
         "env.kwargs.render_images=false", "fleet.n_clients=1", "show=false"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return root


def _train_cfg(store, run_dir, updates):
    return OmegaConf.merge(compose("train", []), {
        "store": store, "run_dir": run_dir, "updates": updates, "batch_size": 16, "log_every": 5,
        "checkpoint_every": 10, "show": False, "device": "cpu", "publish": False,
        "model": {"use_images": False, "use_text": False, "hidden_dim": 32, "embed_dim": 16},
    })


@pytest.mark.slow
def test_train_cli_smoke_publishes_a_version(tiny_store, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "robo_post.cli", "train", f"store={tiny_store}", f"run_dir={tmp_path / 'run'}",
         "updates=20", "log_every=10", "batch_size=8", "model.use_images=false", "model.use_text=false", "show=false",
         "eval.every=20", "eval.episodes_per_task=2"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["version"] == 1 and summary["episodes"] == 6
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["update"] for row in rows] == [10, 20] and all(np.isfinite(row["bc_loss"]) for row in rows)
    assert "eval/success/reach" not in rows[0] and 0.0 <= rows[1]["eval/success/reach"] <= 1.0
    _, config = PolicyRegistry(tiny_store).load(1)
    assert config["algorithm"] == "bc_flow" and config["snapshot"] == summary["snapshot"]


@pytest.mark.slow
def test_train_on_the_shards_of_named_clients_only(tiny_store, tmp_path):
    cfg = OmegaConf.merge(_train_cfg(tiny_store, str(tmp_path / "run"), 2), {"data": {"clients": ["client"]}})
    assert train(cfg)["episodes"] == 6  # shard client-0 of the fleet
    cfg = OmegaConf.merge(_train_cfg(tiny_store, str(tmp_path / "none"), 2), {"data": {"clients": ["demo", "clien"]}})
    with pytest.raises(NoEpisodesError, match=r"match the data filter .*; it holds 6 episodes of tasks \[reach\], "
                                              r"roles \[other\], clients \[client-0\]"):
        train(cfg)  # a prefix names whole client ids' stems: "clien" is not "client"
    cfg = OmegaConf.merge(_train_cfg(tiny_store, str(tmp_path / "exact"), 2), {"data": {"clients": ["client-0"]}})
    assert train(cfg)["episodes"] == 6  # one shard by its exact id


def test_a_store_without_successes_names_the_way_to_train_on_it(tmp_path):
    from robo_post.learner.data import select_episodes

    store = Store.create(str(tmp_path / "s"), StoreSchema({"observation": ArraySpec("float32", (2,))},
                                                          ArraySpec("float32", (1,), -1.0, 1.0)))
    with store.writer("x") as w:
        for _ in range(2):
            w.write_episode({"observation": np.zeros((3, 2), np.float32)}, np.zeros((2, 1), np.float32), success=False)
    data = OmegaConf.create({"tasks": None, "success": True, "roles": None, "clients": None})
    with pytest.raises(NoEpisodesError, match="; none of its 2 labelled episodes succeeded: data.success=null trains "
                                              "on them all; it holds 2 episodes"):
        select_episodes(store.snapshot(), data)


@pytest.mark.slow
def test_resume_matches_uninterrupted_run(tiny_store, tmp_path):
    train(_train_cfg(tiny_store, str(tmp_path / "full"), 30))
    train(_train_cfg(tiny_store, str(tmp_path / "split"), 20))  # "killed" after its update-20 checkpoint
    os.remove(tmp_path / "split" / "summary.json")
    train(_train_cfg(tiny_store, str(tmp_path / "split"), 30))  # resumes from update 20
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    full, split = read("full"), read("split")
    assert [r["update"] for r in split] == [5, 10, 15, 20, 25, 30]
    for a, b in zip(full, split):
        assert a["bc_loss"] == pytest.approx(b["bc_loss"], rel=1e-6, abs=1e-9)



@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_restarts_without_its_rows(tiny_store, tmp_path):
    import shutil

    train(_train_cfg(tiny_store, str(tmp_path / "full"), 20))
    train(_train_cfg(tiny_store, str(tmp_path / "split"), 5))  # "killed" after logging update 5, before update 10's
    shutil.rmtree(tmp_path / "split" / "checkpoint")           # first checkpoint: rows, no checkpoint
    os.remove(tmp_path / "split" / "summary.json")
    train(_train_cfg(tiny_store, str(tmp_path / "split"), 20))  # starts over
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    full, split = read("full"), read("split")
    assert [r["update"] for r in split] == [5, 10, 15, 20]
    assert [r["bc_loss"] for r in split] == pytest.approx([r["bc_loss"] for r in full], rel=1e-6, abs=1e-9)


def test_publish_once_marks_the_same_weights_under_another_config(tmp_path):
    registry = PolicyRegistry(str(tmp_path))
    w, other = {"w": torch.ones(3)}, {"w": torch.zeros(3)}
    assert publish_once(registry, w, {"kind": "x", "lr": 1}) == 1
    assert publish_once(registry, w, {"kind": "x", "lr": 1}) == 1  # killed after publishing: not again
    assert publish_once(registry, w, {"kind": "x", "lr": 2}) == 2
    assert registry.load(2)[1]["same_weights_as"] == 1
    assert publish_once(registry, w, {"kind": "x", "lr": 2}) == 2  # the marked version is found again too
    # back to the first settings: version 1 is that policy (a third copy was published)
    assert publish_once(registry, w, {"kind": "x", "lr": 1}) == 1
    assert publish_once(registry, w, {"kind": "x", "lr": 3}) == 3 and registry.load(3)[1]["same_weights_as"] == 1
    assert publish_once(registry, w, {"kind": "x", "lr": 2}) == 2
    assert publish_once(registry, other, {"kind": "x", "lr": 2}) == 4 and "same_weights_as" not in registry.load(4)[1]
    for diverged in (float("nan"), float("inf")):  # a fleet following the registry would run it
        with pytest.raises(NonFiniteWeightsError, match=r"non-finite weights in 1 tensors \(w, \.\.\.\): training "
                                                        "diverged"):
            publish_once(registry, {"w": torch.tensor([1.0, diverged]), "n": torch.tensor([1])}, {"kind": "x"})
    assert registry.versions() == [1, 2, 3, 4]


def test_a_damaged_newest_version_does_not_block_publishing(tmp_path, capsys):
    """The comparison with the newest version (a run killed after publishing) must not turn a
    version damaged since into a failure of every later publish, found only after training."""
    registry = PolicyRegistry(str(tmp_path))
    w = {"w": torch.ones(3)}
    assert publish_once(registry, w, {"kind": "x"}) == 1
    weights = tmp_path / "policies" / "v000001" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
    assert publish_once(registry, w, {"kind": "x"}) == 2
    assert "warning: policy version 1: " in capsys.readouterr().err
    assert torch.equal(registry.load(2)[0]["w"], w["w"]) and "same_weights_as" not in registry.load(2)[1]
    assert publish_once(registry, w, {"kind": "x"}) == 2  # the intact newest is compared again


@pytest.mark.slow
def test_a_run_killed_after_publishing_does_not_publish_again(tiny_store, tmp_path):
    cfg = OmegaConf.merge(_train_cfg(tiny_store, str(tmp_path / "run"), 10), {"publish": True})
    registry = PolicyRegistry(tiny_store)
    first = train(cfg)["version"]
    os.remove(tmp_path / "run" / "summary.json")  # killed after publishing, before its summary
    assert train(cfg)["version"] == first and registry.latest() == first
    larger = OmegaConf.merge(cfg, {"updates": 20})  # continuing it is a new version
    assert train(larger)["version"] == first + 1 and registry.latest() == first + 1
    with pytest.raises(CheckpointError, match=r"run has already trained update 20, more than updates=10: set "
                                              r"updates>=20 to continue it"):
        train(OmegaConf.merge(cfg, {"seed": 1}))  # not the finished run's settings: it would publish again
    assert registry.latest() == first + 1



@pytest.mark.slow
@pytest.mark.parametrize("record", ["config.yaml", "summary.json"])
def test_a_damaged_run_record_resumes_the_run_with_a_warning_naming_it(tiny_store, tmp_path, capsys, record):
    """A finished run's config.yaml or summary.json torn by a crash or a full disk: the rerun
    warns naming it and resumes from the checkpoint (publishing nothing new), instead of a YAML
    traceback or a JSONDecodeError that names no file."""
    cfg = OmegaConf.merge(_train_cfg(tiny_store, str(tmp_path / "run"), 10), {"publish": True})
    first = train(cfg)["version"]
    path = tmp_path / "run" / record
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2] + b"\n  - [\xff")
    capsys.readouterr()
    again = train(cfg)
    assert f"warning: {path} is damaged" in capsys.readouterr().err
    assert again["version"] == first == PolicyRegistry(tiny_store).latest()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["version"] == first
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").updates == 10


@pytest.mark.slow
def test_a_finished_run_rerun_on_another_store_or_model_is_refused(tiny_store, tmp_path):
    """It warned 'published again under the new ones' and then failed on the other store's
    snapshot id or the other model's shapes; a key set to null against an absent one (a
    dropped ``model.features`` override) was not a change at all: 'already done'."""
    from robo_post.config import changed_settings

    run_dir = tmp_path / "run"
    train(_train_cfg(tiny_store, str(run_dir), 10))
    before = tree_hash(str(run_dir))
    other_store = str(tmp_path / "other")
    shutil.copytree(tiny_store, other_store)
    for change in ({"store": other_store}, {"model": {"hidden_dim": 64}}):
        with pytest.raises(RunResumeError, match=rf"{run_dir} finished a run with other settings \(.*\) than these; "
                                                 "nothing was changed. Give this run its own run_dir"):
            train(OmegaConf.merge(_train_cfg(tiny_store, str(run_dir), 10), change))
    assert tree_hash(str(run_dir)) == before
    assert changed_settings({"model": {"features": {"goal": None}}}, {"model": {"features": None}}) == {
        "model.features": (None, None), "model.features.goal": (None, None)}


@pytest.mark.slow
def test_a_run_resumed_with_its_folders_spelled_otherwise_is_the_same_run(tiny_store, tmp_path, monkeypatch):
    """`store=s` then `store=./s`, or a run resumed from another directory, was refused as a run
    of "other settings (store: 's' -> './s')", so its documented rerun could not republish it."""
    run_dir = tmp_path / "run"

    def cfg(store, run):
        return OmegaConf.merge(_train_cfg(store, run, 10), {"publish": True})

    monkeypatch.chdir(os.path.dirname(tiny_store))
    first = train(cfg(os.path.basename(tiny_store), os.path.relpath(run_dir)))
    assert OmegaConf.load(run_dir / "config.yaml").store == tiny_store  # recorded absolute
    monkeypatch.chdir(tmp_path)
    again = train(cfg("./" + os.path.relpath(tiny_store), "run"))
    assert again["version"] == first["version"] == PolicyRegistry(tiny_store).latest()  # already done, not refused


@pytest.mark.slow
def test_a_republished_run_keeps_the_settings_its_weights_were_trained_with(tiny_store, tmp_path, capsys):
    """A finished run rerun with a changed setting publishes its weights again under it; that
    rewrote config.yaml, so a larger budget with the changed setting then resumed the weights
    as if they had been trained with it (refused when asked in one step)."""
    run_dir = tmp_path / "run"
    train(_train_cfg(tiny_store, str(run_dir), 10))
    recorded = (run_dir / "config.yaml").read_text()
    lr = {"algo": {"lr": 0.5}}
    first = json.loads((run_dir / "summary.json").read_text())
    train(OmegaConf.merge(_train_cfg(tiny_store, str(run_dir), 10), lr))  # published again, not trained
    assert (run_dir / "trained_config.yaml").read_text() == recorded and "lr: 0.5" in (run_dir / "config.yaml").read_text()
    # its summary keeps the training's final metrics (it held none, and a report then invented an unfinished phase)
    assert json.loads((run_dir / "summary.json").read_text())["final"] == first["final"] != {}
    assert train(_train_cfg(tiny_store, str(run_dir), 10))["version"] == first["version"]  # not a third copy
    with pytest.raises(RunResumeError, match=r"holds a run finished at update 10 \(its updates\), started with other "
                                             r"settings \(algo.lr: .* -> 0.5\)"):
        train(OmegaConf.merge(_train_cfg(tiny_store, str(run_dir), 20), lr))
    capsys.readouterr()
    train(_train_cfg(tiny_store, str(run_dir), 20))  # the settings it was trained with extend it
    assert f"resuming {run_dir} from its checkpoint at update 10 of 20" in capsys.readouterr().err
    assert "updates: 20" in (run_dir / "config.yaml").read_text() and not (run_dir / "trained_config.yaml").exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_an_unfinished_run_without_its_settings_record_is_not_resumed(tiny_store, tmp_path, damage):
    """With config.yaml removed (or damaged), a killed run resumed under another learning rate
    with no word, and the rewritten record named that rate as if the whole run used it."""
    run_dir = tmp_path / "run"
    train(_train_cfg(tiny_store, str(run_dir), 10))
    (run_dir / "summary.json").unlink()  # as if killed at its last checkpoint, short of a larger budget
    path = run_dir / "config.yaml"
    path.unlink() if damage == "missing" else path.write_text(": : [")
    before = tree_hash(str(run_dir))
    other = OmegaConf.merge(_train_cfg(tiny_store, str(run_dir), 20), {"algo": {"lr": 0.5}})
    with pytest.raises(RunResumeError, match=rf"holds an unfinished run \(update 10 of 20\), but {path}, the record of "
                                             rf"the settings it started with, is {damage}: resuming could go on under"):
        train(other)
    assert tree_hash(str(run_dir)) == before


@pytest.mark.slow
@pytest.mark.fleet
def test_a_resumed_run_trains_on_the_snapshot_it_started_on(tiny_store, tmp_path):
    import shutil

    store = str(tmp_path / "store")
    shutil.copytree(tiny_store, store)
    full = train(_train_cfg(store, str(tmp_path / "full"), 30))
    train(_train_cfg(store, str(tmp_path / "split"), 20))  # "killed" after its update-20 checkpoint
    os.remove(tmp_path / "split" / "summary.json")
    r = subprocess.run([sys.executable, "-m", "robo_post.cli", "collect", f"store={store}", "episodes=1",
                        "env.tasks=[reach]", "env.kwargs.render_images=false", "fleet.n_clients=1",
                        "fleet.client_prefix=later", "show=false"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(Store.open(store).snapshot()) == 7
    published = OmegaConf.merge(_train_cfg(store, str(tmp_path / "split"), 30), {"publish": True})
    split = train(published)  # resumes from update 20 on the 6 episodes it started with
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    assert [r["bc_loss"] for r in read("split")] == pytest.approx([r["bc_loss"] for r in read("full")], rel=1e-6)
    assert split["snapshot"] == full["snapshot"] and split["episodes"] == 6
    os.remove(tmp_path / "split" / "summary.json")  # killed after publishing, before its summary
    assert train(published)["version"] == split["version"] == PolicyRegistry(store).latest()
    assert train(_train_cfg(store, str(tmp_path / "fresh"), 5))["episodes"] == 7  # a new run sees the newest


def test_in_process_success_reports_each_episode_outcome_in_order():
    from robo_post.eval.rollout import in_process_success
    from robo_post.envs.tabletop import PROPRIO_DIM

    torch.manual_seed(0)
    model = FlowPolicy(FlowPolicyConfig(features=state_features(PROPRIO_DIM, "proprio"), action_dim=4, horizon=4, use_text=False,
                                        embed_dim=8, hidden_dim=16, flow_steps=2, execute_steps=4))
    outcomes: list[bool] = []
    rates = in_process_success(model, ["reach", "pick"], 2, seed=3, outcomes=outcomes)
    assert len(outcomes) == 4 and all(isinstance(o, bool) for o in outcomes)
    assert [rates["success/reach"], rates["success/pick"]] == [np.mean(outcomes[:2]), np.mean(outcomes[2:])]


def test_deterministic_flow_acts_from_the_noise_centre():
    """deterministic=True starts every chunk from x_0 = 0: the exact Gaussian field then lands on the
    target's mean (its central action); artifacts without the key stay stochastic."""
    torch.manual_seed(0)
    config = FlowPolicyConfig(features=state_features(2), action_dim=1, horizon=1, use_text=False, flow_steps=200,
                              deterministic=True)
    policy = FlowPolicy(config).eval()
    policy.velocity = lambda z, x, w: exact_velocity(x, w[:, None, None])  # the N(MU, S^2) target's field
    obs = {"state": torch.randn(4, 2)}
    first, again = policy.sample(obs), policy.sample(obs)
    assert torch.equal(first, again)
    assert first[:, 0, 0].tolist() == pytest.approx([MU] * 4, abs=1e-3)
    policy.config.deterministic = False
    drawn = policy.sample(obs)
    assert drawn.std().item() > 0.1 and not torch.equal(drawn, first)
    legacy = {k: v for k, v in config.to_json().items() if k != "deterministic"}
    assert FlowPolicyConfig.from_json(legacy).deterministic is False


def mixture_velocity(x, w, weights, means, s):
    """The velocity of the linear path from N(0,1) to a mixture of N(mean_k, s_k^2): each
    component's velocity weighted by its posterior at (x, w)."""
    post, vel = [], []
    for p, mu, sk in zip(weights, means, s):
        var = (1 - w) ** 2 + w**2 * sk**2
        post.append(p * torch.exp(-0.5 * (x - w * mu) ** 2 / var) / var.sqrt())
        vel.append(exact_velocity(x, w, mu, sk))
    post = torch.stack(post)
    return (post * torch.stack(vel)).sum(0) / post.sum(0)


def test_mode_draws_act_at_a_mode_where_the_centre_falls_between_modes():
    """Two behaviours and a diffuse third (expert, weak and random actions in one dataset): the
    noise's centre maps between the modes, to an action neither behaviour takes; the densest of
    the fixed draws is one of them. Old artifacts (no ``mode_draws``) act from the centre, the default."""
    weights, means, s = (0.4, 0.15, 0.45), (-0.6, 0.0, 0.6), (0.05, 0.3, 0.05)
    config = FlowPolicyConfig(features=state_features(2), action_dim=1, horizon=1, use_text=False, flow_steps=200,
                              deterministic=True, mode_draws=16)
    policy = FlowPolicy(config).eval()
    policy.velocity = lambda z, x, w: mixture_velocity(x, w[:, None, None], weights, means, s)
    obs = {"state": torch.randn(3, 2)}
    mode = policy.sample(obs)[:, 0, 0]
    assert torch.equal(mode, policy.sample(obs)[:, 0, 0])  # deterministic: fixed draws
    assert mode.abs().min().item() > 0.45 and mode.abs().max().item() < 0.65
    policy.config.mode_draws = 1
    assert policy.sample(obs)[:, 0, 0].abs().max().item() < 0.35  # the centre: between the modes
    assert FlowPolicyConfig(features=state_features(2), action_dim=1).mode_draws == 1
    weights_, artifact = FlowPolicy(config).artifact()
    del artifact["model"]["mode_draws"]
    assert FlowPolicy.from_artifact(weights_, artifact).config.mode_draws == 1
    with pytest.raises(ValueError, match="mode_draws must be >= 1"):
        FlowPolicyConfig(features=state_features(2), action_dim=1, mode_draws=0)


def test_densest_finds_the_dense_cluster_among_scattered_samples():
    g = torch.Generator().manual_seed(0)
    cluster = torch.tensor([0.7, -0.2, 0.1]) + 0.02 * torch.randn(10, 3, generator=g)
    scattered = torch.rand(6, 3, generator=g) * 2 - 1
    x = torch.cat([scattered, cluster])[None]
    assert torch.allclose(densest(x)[0], torch.tensor([0.7, -0.2, 0.1]), atol=0.05)
    assert torch.equal(densest(x[:, :1])[0], x[0, 0])  # one sample: itself
