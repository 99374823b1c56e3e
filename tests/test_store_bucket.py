"""The store on object storage (``bucket.py``) against a real S3 server (moto, on loopback):
commits, the writer lease, snapshots under a live writer, validate and repair, SIGKILLed
writers, typed errors on bad URLs and credentials, and no credentials in anything written.
The round trips, bad input and one-writer tests of ``test_store.py`` run on S3 too (``BOTH``)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import obstore
import pytest
from helpers import run_cli

from robo_post.store import ShardLockedError, Store, StoreError, StoreNotFoundError, StoreSchema, ArraySpec
from robo_post.store.bucket import BucketStore, validate_bucket
from robo_post.eval.rollout import load_results
from robo_post.store.integrity import repair_store, validate_store
from robo_post.store.registry import PolicyRegistry
from robo_post.store.schema import StoreAccessError, StoreURLError

SCHEMA = StoreSchema(
    observations={"proprio": ArraySpec("float32", (4,)), "image": ArraySpec("uint8", (16, 16, 3))},
    action=ArraySpec("float32", (2,), low=-1.0, high=1.0),
)


def _episode(rng, T=6, mark=0.0):
    obs = {"proprio": rng.normal(size=(T + 1, 4)).astype(np.float32),
           "image": rng.integers(0, 256, (T + 1, 16, 16, 3), dtype=np.uint8)}
    obs["proprio"][:, 0] = mark
    return obs, rng.uniform(-1, 1, (T, 2)).astype(np.float32)


def _write(writer, rng, n, T=6):
    for i in range(n):
        obs, act = _episode(rng, T, mark=writer.n_episodes)
        writer.write_episode(obs, act, truncated=np.arange(T) == T - 1, task_id="t", attrs={"i": i})


@pytest.fixture
def url(s3_server):
    return f"s3://{s3_server.bucket()}/runs/a"


def test_file_url_is_the_same_layer(tmp_path):
    root = f"file://{tmp_path}/store"
    store = Store.create(root, SCHEMA)
    assert isinstance(store, BucketStore)
    with store.writer("a") as w:
        _write(w, np.random.default_rng(0), 3)
    snap = Store.open(root).snapshot()
    assert len(snap) == 3 and snap.load_shard("a")["action"].shape == (18, 2)
    assert validate_store(root) == (3, [])
    assert os.path.exists(tmp_path / "store" / "shards" / "a" / "commits" / "000000002.json")


def test_commit_layout_and_snapshot_reopen(url):
    store = Store.create(url, SCHEMA)
    rng = np.random.default_rng(1)
    w = store.writer("a")
    _write(w, rng, 2)
    first = store.snapshot()
    _write(w, rng, 1)
    w.close()
    again = Store.open(url).snapshot(first.id)  # another process's view: from the snapshot record
    assert [e.key for e in again] == ["a/0", "a/1"]
    np.testing.assert_array_equal(again.load(again.episodes()[1])["obs"]["image"],
                                  first.load(first.episodes()[1])["obs"]["image"])
    keys = {m["path"] for m in store.objects.list("shards/a/commits/")}
    assert keys == {f"shards/a/commits/{i:09d}.json" for i in range(3)}
    with pytest.raises(StoreError, match="already exists"):
        Store.create(url, SCHEMA)


def test_lease_refuses_a_second_writer_and_fences_a_late_one(url):
    store = Store.create(url, SCHEMA)
    rng = np.random.default_rng(2)
    stale = {shard: store.writer(shard, lease_s=0.5) for shard in ("a", "b")}
    for w in stale.values():
        _write(w, rng, 1)
    with pytest.raises(ShardLockedError, match="already open for writing"):
        store.writer("a")
    time.sleep(0.6)  # both writers stall past their lease; others take the shards
    fresh = {shard: Store.open(url).writer(shard) for shard in ("a", "b")}
    for w in fresh.values():
        _write(w, rng, 1)
    with pytest.raises(ShardLockedError, match="took it after this writer's lease expired"):
        _write(stale["a"], rng, 1)  # its renewal finds the newer lease
    stale["b"].lease.renew_at = float("inf")  # a writer whose clock lags renews nothing: the commit record fences it
    with pytest.raises(ShardLockedError, match="committed episode 1 first .* not committed"):
        _write(stale["b"], rng, 1)
    for w in fresh.values():
        _write(w, rng, 1)
        w.close()
    snap = store.snapshot()
    assert [e.attrs for e in snap] == [{"i": 0}] * 6
    assert validate_store(url)[1] == []
    store.writer("a").close()  # closing released it: no wait
    store.writer("c", lease_s=0.5)  # a writer that dies without closing
    with pytest.raises(ShardLockedError):
        store.writer("c", lease_s=0.5)
    store.writer("c", lease_s=0.5, takeover=True).close()  # its restart waits the lease out


def test_bad_urls_and_missing_bucket_are_typed_errors(s3_server, monkeypatch):
    for bad, match in [("s3://", "names no bucket"), ("s3://ab/x", "not an S3 bucket name"),
                       ("s3://Upper/x", "not an S3 bucket name"), ("s3://bucket/a/../b", "'..'"),
                       ("s3://bucket/x?versionId=1", "query"), ("file://host/x", "absolute path")]:
        with pytest.raises(StoreURLError, match=match):
            Store.open(bad)
    with pytest.raises(StoreURLError, match="holds credentials") as err:
        Store.create(f"s3://{s3_server.access_key}:{s3_server.secret_key}@bucket/x", SCHEMA)
    assert s3_server.secret_key not in str(err.value)
    with pytest.raises(StoreNotFoundError, match="bucket does not exist"):
        Store.create("s3://no-such-bucket-here/x", SCHEMA)
    with pytest.raises(StoreNotFoundError, match="missing store.json"):
        Store.open(f"s3://{s3_server.bucket()}/nothing")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    with pytest.raises(StoreAccessError, match="no credentials"):
        Store.open(f"s3://{s3_server.bucket()}/x")


def test_policy_registry_on_s3_publishes_whole_versions_once_and_checks_them(url):
    import threading

    import torch

    from robo_post.store.registry import PolicyArtifactError, PolicyVersionExistsError

    Store.create(url, SCHEMA)
    reg = PolicyRegistry(url)
    assert reg.latest() is None and reg.location == f"{url}/policies"
    reg.check_writable()
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    assert [reg.publish({"w": weights["w"] * k}, {"arch": "mlp"}) for k in (1, 2)] == [1, 2]
    w, config = reg.load(2)
    assert torch.equal(w["w"], weights["w"] * 2) and config == {"arch": "mlp", "version": 2}
    with pytest.raises(PolicyVersionExistsError):
        reg.publish(weights, {}, version=2)
    raw = reg._files.objects.store
    # a publisher killed after uploading its files, before its record: no version, nothing read
    obstore.put(raw, "v000003-deadbeef/model.safetensors", b"half")
    assert PolicyRegistry(url).versions() == [1, 2]
    # eight publishers race for version 3: exactly one wins, the others' uploads are gone
    results, barrier = [], threading.Barrier(8)

    def publish(k):
        barrier.wait()
        try:
            results.append(PolicyRegistry(url).publish({"w": weights["w"] + k}, {"k": k}, version=3))
        except PolicyVersionExistsError:
            results.append(None)

    threads = [threading.Thread(target=publish, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [3] + [None] * 7
    w, config = reg.load(3)
    assert torch.equal(w["w"], weights["w"] + config["k"])
    folders = {m["path"].split("/")[0] for m in obstore.list(raw).collect()} - {"v000003-deadbeef"}
    assert sum(f.startswith("v000003-") for f in folders) == 1, folders
    # a byte of version 1's weights changed after publishing: named, and validate reports it
    record = json.loads(bytes(obstore.get(raw, "v000001.json").bytes()))
    key = f"{record['folder']}/model.safetensors"
    data = bytearray(bytes(obstore.get(raw, key).bytes()))
    data[-1] ^= 0xFF
    obstore.put(raw, key, bytes(data))
    with pytest.raises(PolicyArtifactError, match=r"policy version 1: .*model.safetensors does not match"):
        reg.load(1)
    assert validate_store(url)[1] == [str(pytest.raises(PolicyArtifactError, reg.load, 1).value)]
    assert json.loads(run_cli("store", "info", url, "--json").stdout)["policy_versions"] == [1, 2, 3]


def test_validate_and_repair_find_and_cut_damage(url):
    store = Store.create(url, SCHEMA)
    with store.writer("a") as w:
        _write(w, np.random.default_rng(3), 6)
    store.snapshot()  # a record that saw 6 episodes
    assert validate_bucket(url) == (6, [])
    raw = store.objects.store
    # episode 2's action rows change after commit; episode 4's commit record is deleted
    _, name = store.record("a", 2)
    obstore.put(raw, f"shards/a/episodes/{name}/action/c/0/0", b"garbage")
    obstore.delete(raw, "shards/a/commits/000000004.json")
    checked, problems = validate_bucket(url)
    text = "\n".join(problems)
    assert "a/2: data unreadable" in text and "record of episode 4 is missing, yet records 5" in text
    assert "saw 6: episodes were lost" in text
    assert "would cut the shard back to 2 episodes" in "\n".join(repair_store(url))
    assert validate_bucket(url)[1] == problems  # without --apply nothing changed
    r = run_cli("store", "repair", url, "--apply")
    assert "copied 2 later episodes that verify (3, 5) into shard a-salvaged" in r.stdout, r.stdout
    assert run_cli("store", "validate", url).stdout.startswith("4 episodes verified, 0 problems")
    snap = Store.open(url).snapshot()
    assert [e.key for e in snap] == ["a/0", "a/1", "a-salvaged/0", "a-salvaged/1"]
    assert [e.attrs["salvaged_from"] for e in snap.episodes(client="a-salvaged")] == ["a/3", "a/5"]
    info = json.loads(run_cli("store", "info", url, "--json").stdout)
    assert info["episodes"] == 4 and info["path"] == url
    with Store.open(url).writer("a") as w:  # the cut shard takes new episodes after its intact ones
        _write(w, np.random.default_rng(4), 1)
    assert validate_bucket(url)[0] == 5


def test_repair_waits_for_a_live_writer_and_cuts_a_damaged_record(url):
    store = Store.create(url, SCHEMA)
    w = store.writer("a")
    _write(w, np.random.default_rng(6), 3)
    key = "shards/a/commits/000000001.json"
    record = store.objects.get(key)
    obstore.put(store.objects.store, key, record.replace(b'"task_id": "t"', b'"task_id": "x"'))
    assert "a/1: " in "\n".join(validate_bucket(url)[1]) and "record fails its checksum" in "\n".join(validate_bucket(url)[1])
    r = run_cli("store", "repair", url, "--apply", ok=False)
    assert r.returncode == 1 and "cannot repair shard a now" in r.stdout, r.stdout
    w.close()
    (line,) = repair_store(url, apply=True)
    assert "cut the shard back to 1 episodes; copied 1 later episodes that verify (2)" in line, line
    assert validate_bucket(url) == (2, [])


# A writer process: episodes forever, announcing each commit before and after it.
WRITER = """
import sys, numpy as np
from robo_post.store import Store
url, client = sys.argv[1], sys.argv[2]
w = Store.open(url).writer(client, lease_s=1.0)
rng = np.random.default_rng(0)
T = 20
obs = {"proprio": rng.normal(size=(T + 1, 4)).astype(np.float32),
       "image": rng.integers(0, 256, (T + 1, 16, 16, 3), dtype=np.uint8)}
act = rng.uniform(-1, 1, (T, 2)).astype(np.float32)
print("ready", w.n_episodes, flush=True)
while True:
    i = w.n_episodes
    obs["proprio"][:, 0] = i
    print("begin", i, flush=True)
    w.write_episode(obs, act, truncated=np.arange(T) == T - 1, task_id="t", attrs={"n": i})
    print("done", i, flush=True)
"""


def test_sigkill_mid_episode_loses_only_that_episode(s3_server, url, tmp_path):
    Store.create(url, SCHEMA)
    rnd = random.Random(0)
    done = rounds = 0
    log = tmp_path / "writer.log"
    while done < 6 or rounds < 4:  # several kills at random points, over several commits
        with open(log, "a") as out:
            proc = subprocess.Popen([sys.executable, "-c", WRITER, url, "victim"], stdout=subprocess.PIPE,
                                    stderr=out, text=True)
            first = proc.stdout.readline().split()
            assert first and first[0] == "ready", f"writer did not start: {log.read_text()[-2000:]}"
            assert int(first[1]) >= done  # every commit announced before survives
            reader = Store.open(url)
            t_end = time.monotonic() + rnd.uniform(0.3, 1.5)
            while time.monotonic() < t_end:  # readers under a live writer: whole, verified episodes only
                snap = reader.snapshot(record=False)
                for ep in snap:
                    assert snap.load(ep)["obs"]["proprio"][0, 0] == ep.episode
            proc.send_signal(signal.SIGKILL)
            lines = proc.communicate()[0].split()
            out.write(" ".join(lines) + "\n")
        announced = [int(x) for tag, x in zip(lines[::2], lines[1::2]) if tag == "done"]
        done = max([done - 1, *announced]) + 1
        checked, problems = validate_bucket(url)
        assert problems == [] and checked >= done, problems
        rounds += 1
        time.sleep(1.1)  # the killed writer's lease expires
    # what the kills left behind: data of episodes in flight, which repair removes
    actions = repair_store(url, apply=True)
    assert all("uncommitted episodes" in a for a in actions), actions
    store = Store.open(url)
    n = len(store.snapshot())
    named = {store.record("victim", i)[1] for i in range(n)}
    assert {m["path"].split("/")[3] for m in store.objects.list("shards/victim/episodes/")} == named
    assert validate_bucket(url) == (n, [])
    assert not any(key in log.read_text() for key in (s3_server.access_key, s3_server.secret_key))


def test_no_credentials_in_store_or_logs(s3_server, url, tmp_path):
    store = Store.create(url, SCHEMA)
    with store.writer("a") as w:
        _write(w, np.random.default_rng(5), 2)
    store.snapshot()
    outputs = [run_cli(*args) for args in (("store", "info", url, "--json"), ("store", "validate", url),
                                           ("store", "repair", url))]
    failed = run_cli("store", "info", f"s3://{s3_server.bucket()}/none", ok=False)  # an error message too
    assert failed.returncode != 0 and "missing store.json" in failed.stderr
    secrets = [s3_server.access_key, s3_server.secret_key]
    for m in store.objects.list(""):
        data = store.objects.get(m["path"])
        assert not any(s.encode() in data or s in m["path"] for s in secrets), m["path"]
    for r in [*outputs, failed]:
        assert not any(s in r.stdout + r.stderr for s in secrets)


def test_collect_train_follow_and_eval_with_the_store_on_s3(s3_server, url, tmp_path, monkeypatch):
    """A user's loop on an S3 store: the fleet records, training publishes to the bucket's
    registry, a following client picks the version up between episodes, eval reads it and saves
    its results in the bucket; host-local fleet state (status, logs, locks) stays on this host."""
    monkeypatch.setenv("ROBO_POST_STATE_DIR", str(tmp_path / "state"))
    quiet = ("env.tasks=[reach]", "env.kwargs.render_images=false", "fleet.n_clients=1", "show=false")
    run_cli("collect", f"store={url}", "episodes=3", "fleet.client_prefix=demo", *quiet)
    run_cli("train", f"store={url}", "algo=bc_flow", "updates=20", f"run_dir={tmp_path / 'bc'}", "show=false")
    assert PolicyRegistry(url).versions() == [1]
    run_cli("collect", f"store={url}", "episodes=1", "fleet.client_prefix=follow", "fleet.follow_registry=true", *quiet)
    r = run_cli("eval", f"store={url}", "version=latest", "tasks=[reach]", "episodes_per_task=1",
                "env_kwargs={render_images: false}", "show=false")
    snap = Store.open(url).snapshot()
    assert [e.policy_version for e in snap.episodes(client="follow-0")] == [1]
    (result,) = load_results(f"{url}-eval")
    assert result["policy"]["version"] == 1 and result["results_path"].startswith(f"{url}-eval/evals/")
    assert result["results_path"] in r.stdout
    assert validate_store(url) == (4, [])
    bucket, prefix = url[len("s3://"):].split("/", 1)
    state = tmp_path / "state" / "s3" / bucket / prefix / "fleet"
    assert (state / "follow-0.json").exists() and not os.path.exists("s3:")  # no folder named by the URL
    written = [p.read_text() for p in state.rglob("*") if p.is_file()]
    assert not any(s in text for text in written for s in (s3_server.access_key, s3_server.secret_key))
