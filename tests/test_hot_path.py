"""The learner's hot path on CPU, through the code a GPU run takes: prefetched batches are the
synchronous sampler's, resume stays exact with prefetch on, bf16 autocast trains, compiled
networks train, and an update never reads a value back to the host."""

import contextlib
import json
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from robo_post.algos.registry import method_spec
from robo_post.config import compose
from robo_post.learner.data import measure
from robo_post.learner.loop import train_loop
from robo_post.models.critic import EnsembleMLP
from robo_post.learner.prefetch import Prefetcher
from robo_post.learner.train import train
from robo_post.store import ArraySpec, PolicyRegistry, Store, StoreSchema, WindowSampler

INSTRUCTIONS = ("go left", "go right")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("hot") / "store"
    schema = StoreSchema({"state": ArraySpec("float32", (4,)), "camera": ArraySpec("uint8", (32, 32, 3))},
                         ArraySpec("float32", (2,), -1.0, 1.0))
    store = Store.create(str(root), schema)
    rng = np.random.default_rng(0)
    with store.writer("demo-0") as w:
        for i in range(6):
            T = 12
            obs = {"state": rng.normal(size=(T + 1, 4)).astype(np.float32),
                   "camera": rng.integers(0, 256, (T + 1, 32, 32, 3), dtype=np.uint8)}
            w.write_episode(obs, rng.uniform(-1, 1, (T, 2)).astype(np.float32), rewards=np.eye(T)[-1] * (i % 2),
                            terminated=np.arange(T) == T - 1, success=bool(i % 2), role="demo",
                            instruction=INSTRUCTIONS[i % 2])
    return str(root)


def _cfg(store, run_dir, method, updates, **extra):
    cfg = OmegaConf.merge(compose("train", [f"algo={method}"]), {
        "store": store, "run_dir": run_dir, "updates": updates, "batch_size": 8, "log_every": 2,
        "checkpoint_every": 4, "show": False, "device": "cpu", "data": {"success": None},
        "model": {"hidden_dim": 16, "embed_dim": 8, "flow_steps": 2, "horizon": 3, "execute_steps": 1},
    })
    OmegaConf.set_struct(cfg, False)
    return OmegaConf.merge(cfg, extra)


def test_prefetched_batches_are_the_synchronous_samplers(store):
    snap = Store.open(store).snapshot()
    sync = WindowSampler.from_snapshot(snap, horizon=3, seed=5)
    ahead = WindowSampler.from_snapshot(snap, horizon=3, seed=5)
    prefetcher = Prefetcher(lambda: ahead.sample(8), {"sampler": ahead.rng}, depth=3)
    try:
        for _ in range(6):
            want, got = sync.sample(8), prefetcher()
            for key in ("actions", "rewards", "discounts", "indices"):
                assert torch.equal(want[key], got[key])
            assert torch.equal(want["obs"]["camera"], got["obs"]["camera"])
            assert want["obs"]["instruction"] == got["obs"]["instruction"]
        # The worker runs ahead; the checkpointable state is the one after the last batch taken.
        deadline = time.monotonic() + 10
        while not prefetcher.queue.full() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefetcher.consumed_rngs()["sampler"].bit_generator.state == sync.rng.bit_generator.state
        assert ahead.rng.bit_generator.state != sync.rng.bit_generator.state
    finally:
        prefetcher.close()


def test_a_sampling_error_reaches_the_learner():
    def broken():
        raise RuntimeError("disk gone")

    prefetcher = Prefetcher(broken, {}, depth=1)
    with pytest.raises(RuntimeError, match="disk gone"):
        prefetcher()
    prefetcher.close()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["bc_flow", "divl_qam"])
def test_resume_with_prefetch_matches_an_uninterrupted_run(store, tmp_path, algo):
    if algo != "bc_flow":
        train(_cfg(store, str(tmp_path / "bc"), "bc_flow", 4, prefetch=0))
    extra = {"prefetch": 3} | ({"algo": {"critic_warmup": 0}} if algo != "bc_flow" else {})
    train(_cfg(store, str(tmp_path / "full"), algo, 8, **extra))
    train(_cfg(store, str(tmp_path / "split"), algo, 4, **extra))
    train(_cfg(store, str(tmp_path / "split"), algo, 8, **extra))
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    full, split = read("full"), read("split")
    assert [r["update"] for r in split] == [2, 4, 6, 8]
    key = "bc_loss" if algo == "bc_flow" else "loss_q"
    assert [r[key] for r in full] == pytest.approx([r[key] for r in split], rel=1e-6, abs=1e-9)
    registry = PolicyRegistry(store)
    version = lambda d: json.loads((tmp_path / d / "summary.json").read_text())["version"]  # noqa: E731
    a, b = registry.load(version("full"))[0], registry.load(version("split"))[0]
    assert all(torch.equal(a[k], b[k]) for k in a)  # the two runs published the same weights


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["bc_flow", "divl_qam"])
def test_bf16_autocast_trains_with_finite_losses(store, tmp_path, algo):
    if algo != "bc_flow":
        train(_cfg(store, str(tmp_path / "bc"), "bc_flow", 2))
    train(_cfg(store, str(tmp_path / "run"), algo, 6, amp="bf16", **({"algo": {"critic_warmup": 0}} if algo != "bc_flow" else {})))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [v for r in rows for k, v in r.items() if "loss" in k]
    assert losses and all(np.isfinite(losses))
    with pytest.raises(ValueError, match="amp"):
        train(_cfg(store, str(tmp_path / "bad"), "bc_flow", 2, amp="fp8"))


HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def count_host_reads():
    """Count every tensor read back to Python (on a GPU each is a device sync)."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name):
        original = originals[name]

        def counted(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return counted

    for name in HOST_READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_the_guard_sees_a_host_read():
    with count_host_reads() as calls:
        torch.ones(2).sum().item()
        float(torch.ones(()))
    assert calls == ["item", "__float__"]


@pytest.mark.parametrize("algo", ["bc_flow", "divl_qam", "iql_qam", "fql"])
def test_an_update_never_reads_back_to_the_host(store, tmp_path, algo):
    """Metrics stay on the device and the text embeddings are cached there: after a warm-up
    update (which encodes the instructions once) an update performs no host read."""
    torch.manual_seed(0)
    cfg = _cfg(store, str(tmp_path), algo, 1, model={"use_text": True})
    spec = method_spec(algo)
    snap = Store.open(store).snapshot()
    sampler = WindowSampler.from_snapshot(snap, horizon=3, seed=0)
    reference = None
    if spec.needs_reference:
        bc = method_spec("bc_flow")
        bc_cfg = bc.make_config({"model": {"hidden_dim": 16, "embed_dim": 8, "flow_steps": 2}})
        reference = bc.build(bc_cfg, measure(Store.open(store).schema, sampler, cfg.model, 0.99, None), "cpu", None).policy
    values = {"model": {"hidden_dim": 16, "embed_dim": 8, "flow_steps": 2}} if algo == "bc_flow" else {"critic_warmup": 0}
    method = spec.build(spec.make_config(values), measure(Store.open(store).schema, sampler, cfg.model, 0.99, reference),
                        torch.device("cpu"), reference)
    batches = [sampler.sample(8) for _ in range(3)]
    method.update(batches[0])
    with count_host_reads() as calls:
        for batch in batches[1:]:
            metrics = method.update(batch)
    assert calls == []
    assert all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in metrics.values())


def _compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here (no dynamo on this Python, no C++ compiler for inductor), or None."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as e:  # noqa: BLE001 - any failure means the platform cannot compile
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


@pytest.mark.slow
def test_compiled_networks_train_with_finite_losses_and_keep_their_weights_names(store, tmp_path):
    reason = _compile_unavailable()
    if reason:
        pytest.skip(f"torch.compile is unavailable on this platform: {reason}")
    torch.manual_seed(0)
    spec, bc = method_spec("divl_qam"), method_spec("bc_flow")
    sampler = WindowSampler.from_snapshot(Store.open(store).snapshot(), horizon=3, seed=0)
    model = _cfg(store, str(tmp_path), "divl_qam", 1, model={"use_text": False}).model
    reference = bc.build(bc.make_config({"model": {"hidden_dim": 16, "embed_dim": 8, "flow_steps": 2}}),
                         measure(Store.open(store).schema, sampler, model, 0.99, None), "cpu", None).policy
    method = spec.build(spec.make_config({"critic_warmup": 0}), measure(Store.open(store).schema, sampler, model, 0.99,
                                                                          reference), torch.device("cpu"), reference)
    keys = {name: sorted(m.state_dict()) for name, m in method.modules.items()}
    rows = train_loop(method, lambda: sampler.sample(8), str(tmp_path / "run"), 3, {"sampler": sampler.rng},
                      log_every=1, show=False, tracking={"tensorboard": False}, compile=True)
    compiled = [m for module in method.modules.values() for m in module.modules() if m._compiled_call_impl is not None]
    assert {type(m) for m in compiled} <= {torch.nn.Sequential, EnsembleMLP} and len(compiled) >= 8
    losses = [r[k] for r in rows for k in ("loss_q", "loss_v", "loss_am")]
    assert len(rows) == 3 and all(np.isfinite(losses))
    assert {name: sorted(m.state_dict()) for name, m in method.modules.items()} == keys  # checkpoints unchanged
