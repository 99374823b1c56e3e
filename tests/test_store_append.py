"""Append-only shard layout: sealed zarr chunks in shard files (and skipping Blosc on
incompressible ones), pre-release layouts refused, array capacity, the two-slot
commit record, crash recovery between chunk writes and commit, and sampler windows."""

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import zarr

import test_store
from robo_post.store import ArraySpec, Store, StoreSchema, UnsupportedFormatError, WindowSampler
from robo_post.store import chunks as chunks_module
from robo_post.store import writer as writer_module
from robo_post.store.commit import read_commit
from robo_post.store.integrity import validate_store

SCHEMA = StoreSchema(
    observations={"proprio": ArraySpec("float32", (3,)), "image": ArraySpec("uint8", (4, 4, 3))},
    action=ArraySpec("float32", (2,), low=-1.0, high=1.0),
)
LENGTHS = (7, 20, 3, 16, 33, 1, 15)  # with 16-row chunks: episodes end before, on and across boundaries


@pytest.fixture
def small_chunks(monkeypatch):
    """16-row chunks for every array (the minimum), so a few episodes cross many boundaries."""
    monkeypatch.setattr(writer_module, "CHUNK_BYTES", 1)


def episode(i, T):
    """Episode ``i``: every value encodes (episode, step), so any misplaced row shows."""
    rows = i * 1000 + np.arange(T + 1)
    obs = {
        "proprio": np.stack([rows, rows + 0.5, -rows], axis=1).astype(np.float32),
        "image": (rows[:, None, None, None] + np.arange(48).reshape(4, 4, 3)).astype(np.uint8),
    }
    actions = np.stack([np.linspace(-1, 1, T), np.full(T, i / 100)], axis=1).astype(np.float32)
    return obs, actions, (rows[:T] % 7).astype(np.float32)


def noisy_episode(i, T):
    """``episode`` with camera noise Blosc cannot compress."""
    obs, actions, rewards = episode(i, T)
    obs["image"] = np.random.default_rng(i).integers(0, 256, obs["image"].shape, np.uint8)
    return obs, actions, rewards


def mixed_episode(i, T):
    """Every third episode noisy: the image array keeps switching between sealing in
    place and compressing."""
    return noisy_episode(i, T) if i % 3 == 0 else episode(i, T)


def write(w, i, T, make=episode):
    obs, actions, rewards = make(i, T)
    return w.write_episode(obs, actions, rewards=rewards, truncated=np.arange(T) == T - 1, attrs={"i": i})


def assert_episodes(snap, expected, make=episode):
    """``snap`` holds exactly the episodes ``expected`` (list of (i, T)), with the values
    ``make`` gives them."""
    assert [(e.attrs["i"], e.length) for e in snap] == expected
    for e, (i, T) in zip(snap, expected):
        obs, actions, rewards = make(i, T)
        got = snap.load(e)
        for k in obs:
            np.testing.assert_array_equal(got["obs"][k], obs[k])
        np.testing.assert_array_equal(got["action"], actions)
        np.testing.assert_array_equal(got["reward"], rewards)


def shard_chunk(directory, index):
    """Bytes of chunk ``index`` of the array at ``directory``, read straight from its
    shard file by the zarr sharding layout (bare index of (offset, nbytes) u64 pairs at
    the start); None if the chunk was never written."""
    shard, slot = divmod(index, chunks_module.CHUNKS_PER_SHARD)
    names = [f for f in os.listdir(directory) if f.split(".")[:2] == ["c", str(shard)]]
    if not names:
        return None
    with open(os.path.join(directory, *names), "rb") as f:
        data = f.read()
    offset, nbytes = np.frombuffer(data, "<u8", 2, 16 * slot)
    return None if offset == 2**64 - 1 else data[offset : offset + nbytes]


def clear_chunk(directory, index):
    """Mark chunk ``index`` as never written in its shard file's index."""
    shard, slot = divmod(index, chunks_module.CHUNKS_PER_SHARD)
    (name,) = [f for f in os.listdir(directory) if f.split(".")[:2] == ["c", str(shard)]]
    with open(os.path.join(directory, name), "r+b") as f:
        f.seek(16 * slot)
        f.write(b"\xff" * 16)


def pending_files(root, shard="a"):
    d = os.path.join(root, "shards", shard, "pending")
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


def region_chunks(root, shard="a"):
    """Array -> index of the chunk whose shard-file entry points at a raw region."""
    data = os.path.join(root, "shards", shard, "data")
    out = {}
    for name in ("action", "obs/image", "obs/proprio", "step"):
        for index in range(chunks_module.CHUNKS_PER_SHARD):
            chunk = shard_chunk(os.path.join(data, name), index)
            if chunk is not None and chunk.startswith(b"RPTAIL"):
                assert int.from_bytes(chunk[8:16], "little") == index
                out.setdefault(name, []).append(index)
    return out


@pytest.mark.parametrize("image", ["compressible", "noise"])
def test_readers_see_partial_chunks_and_close_seals_them(tmp_path, small_chunks, image):
    """Partial chunks live raw in their shard file; every snapshot, old ones too,
    reads its rows while the writer seals those chunks (in place, or compressed
    elsewhere with the region reused) and moves on."""
    make = noisy_episode if image == "noise" else episode  # noise: chunks are sealed in place
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    expected, snapshots = [], []
    w = store.writer("a")
    for i, T in enumerate(LENGTHS):
        write(w, i, T, make)
        expected.append((i, T))
        snapshots.append((store.snapshot(), list(expected)))
        for snap, seen in snapshots:
            assert_episodes(snap, seen, make)
        obs_rows, steps = sum(t + 1 for _, t in expected), sum(t for _, t in expected)
        want = {"obs/image": [obs_rows // 16], "obs/proprio": [obs_rows // 16], "action": [steps // 16], "step": [steps // 16]}
        assert region_chunks(store.root) == {k: v for k, v in want.items() if v[0] * 16 < (obs_rows if "obs" in k else steps)}
    assert pending_files(store.root) == []  # no sidecar files in a sharded shard
    w.close()
    assert region_chunks(store.root) == {}
    # A closed shard is a plain zarr group holding every committed row.
    steps = sum(LENGTHS)
    proprio = zarr.open_array(os.path.join(store.root, "shards", "a", "data", "obs", "proprio"), mode="r")
    np.testing.assert_array_equal(proprio[: steps + len(LENGTHS)], np.concatenate([episode(i, T)[0]["proprio"] for i, T in expected]))
    # Reopen: the tail comes back from zarr, and the partial chunk gets a region again.
    with store.writer("a") as w:
        for i, T in enumerate((5, 40), start=len(LENGTHS)):
            write(w, i, T, make)
            expected.append((i, T))
            assert_episodes(store.snapshot(), expected, make)
            for snap, seen in snapshots:
                assert_episodes(snap, seen, make)
    assert validate_store(store.root) == (len(expected), [])


# The writer strikes after the reader's first pread (the index entry: the header it
# then reads is the next chunk's) or its second (the header: the rows it then reads
# are the next chunk's, and only the header read after them shows it).
@pytest.mark.parametrize("strike_after", [1, 2])
def test_a_region_read_overtaken_by_the_writer_retries(tmp_path, small_chunks, monkeypatch, strike_after):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    w = store.writer("a", fsync=False)
    write(w, 0, 7)  # 8 observation rows: chunk 0 of the image array is partial, in a region
    snap = store.snapshot()
    image = os.path.join(store.root, "shards", "a", "data", "obs", "image")
    region = np.frombuffer(open(os.path.join(image, "c.0.0.0.0"), "rb").read(16), "<u8")[0]
    calls, pread = [], os.pread

    def overtaken(fd, n, offset):
        data = pread(fd, n, offset)
        calls.append(offset)
        if len(calls) == strike_after:
            write(w, 1, 20)  # seals chunk 0 compressed elsewhere and reuses its region for chunk 1
        return data

    monkeypatch.setattr(os, "pread", overtaken)
    got = snap._read("a", "obs/image", 0, 8)
    monkeypatch.undo()
    np.testing.assert_array_equal(got, episode(0, 7)[0]["image"])
    assert len(calls) > 3  # it did read the region again, or went to zarr
    # The strike did reuse the region (the case the header check exists for).
    assert shard_chunk(image, 1)[:16] == b"RPTAIL\0\0" + (1).to_bytes(8, "little")
    assert np.frombuffer(open(os.path.join(image, "c.0.0.0.0"), "rb").read(32), "<u8")[2] == region
    assert_episodes(store.snapshot(), [(0, 7), (1, 20)])
    w.close()


LIVE_WRITER = """
import os, sys, time
sys.path.insert(0, {tests!r})
import test_store_append as t
from robo_post.store import Store
from robo_post.store import writer as writer_module
writer_module.CHUNK_BYTES = 1
root, n, ticks = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with Store.open(root).writer("a", fsync=False) as w:
    for i in range(n):
        obs, actions, rewards = t.mixed_episode(i, t.LENGTHS[i % len(t.LENGTHS)])
        w.write_episode(obs, actions, rewards=rewards, attrs={{"i": i}})
        # Wait until the reader starts another pass (at most 10 s), so that each write
        # overlaps a pass of reads however the two processes are scheduled.
        deadline = time.monotonic() + 10
        seen = os.path.getsize(ticks)
        while os.path.getsize(ticks) == seen and time.monotonic() < deadline:
            time.sleep(0.001)
"""


def test_snapshots_read_what_was_committed_while_another_process_writes(tmp_path):
    """A reader racing a live writer process (regions filled, sealed in place,
    sealed compressed and reused) reads exactly the committed rows, from the newest
    snapshot and from older ones whose partial chunks were sealed since."""
    root, n, ticks = str(tmp_path / "s"), 60, tmp_path / "ticks"
    store = Store.create(root, SCHEMA)
    ticks.write_bytes(b"")
    code = LIVE_WRITER.format(tests=os.path.dirname(__file__))
    writer = subprocess.Popen([sys.executable, "-c", code, root, str(n), str(ticks)])
    snapshots, sizes, checked = [], set(), 0
    try:
        while True:
            finished = writer.poll() is not None
            with open(ticks, "ab") as f:  # a new pass starts: the writer may go on
                f.write(b".")
            snapshots.append(store.snapshot())
            sizes.add(len(snapshots[-1]))
            for snap in snapshots[-1:-8:-3]:  # the newest, and two older ones
                for e in list(snap)[-2:]:  # the last episodes end in partial chunks
                    obs, actions, rewards = mixed_episode(e.attrs["i"], e.length)
                    got = snap.load(e)
                    for k in obs:
                        np.testing.assert_array_equal(got["obs"][k], obs[k])
                    np.testing.assert_array_equal(got["action"], actions)
                    np.testing.assert_array_equal(got["reward"], rewards)
                    checked += 1
            if finished:
                break
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 0 and len(store.snapshot()) == n
    assert len(sizes) > n // 2 and checked > n  # the reader did interleave with the writer
    assert validate_store(root) == (n, [])


def test_sealed_chunk_bytes_equal_zarrs_own_encoding(tmp_path, small_chunks):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    with store.writer("a") as w:
        write(w, 0, 40)  # 41 observation rows: chunks 0 and 1 sealed, 2 written at close
    data = os.path.join(store.root, "shards", "a", "data")
    for name in ("obs/image", "obs/proprio", "step"):
        ours = zarr.open_array(os.path.join(data, name), mode="r")
        assert ours.chunks[0] == 16 and ours.shards[0] == 16 * chunks_module.CHUNKS_PER_SHARD
        twin = zarr.create_array(str(tmp_path / "twin" / name), shape=ours.shape, chunks=ours.shards, dtype=ours.dtype,
                                 serializer=ours.metadata.codecs[0], compressors=None, fill_value=0,
                                 chunk_key_encoding={"name": "default", "separator": "."})
        twin[:32] = ours[:32]  # zarr writes the whole shard file, in its own order
        for index in (0, 1):
            assert shard_chunk(os.path.join(data, name), index) == shard_chunk(str(tmp_path / "twin" / name), index)
        assert shard_chunk(str(tmp_path / "twin" / name), 2) is None
        np.testing.assert_array_equal(ours[:41], zarr.open_array(os.path.join(data, name), mode="r")[:41])


def test_arrays_of_the_unsharded_pre_release_format_are_refused(tmp_path, small_chunks):
    """No released version wrote one file per chunk (with pending/ sidecars): such a
    shard is refused by writers and readers, and nothing in it is touched."""
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    with store.writer("a") as w:
        write(w, 0, 5)
    data = os.path.join(store.root, "shards", "a", "data")
    shutil.rmtree(os.path.join(data, "action"))
    zarr.open_group(data, mode="a").create_array(
        "action", shape=(64, 2), chunks=(16, 2), dtype="float32", fill_value=0,
        compressors=zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
    )
    snap = store.snapshot()
    before = test_store.tree_hash(store.root)
    for _ in range(2):  # a refused writer releases the shard (no ShardLockedError the second time)
        with pytest.raises(UnsupportedFormatError, match="unsharded array of a pre-release"):
            store.writer("a")
    with pytest.raises(UnsupportedFormatError):
        snap.load(snap.episodes()[0])
    assert test_store.tree_hash(store.root) == before
    checked, problems = validate_store(store.root)
    assert checked == 0 and "a/0: arrays unreadable" in problems[0] and "pre-release" in problems[0]


FRAMES = StoreSchema(observations={"image": ArraySpec("uint8", (32, 32, 3))}, action=ArraySpec("float32", (1,)))
FRAME_LENGTHS = (40, 57, 23, 90, 130, 151)  # 497 observation rows: 31 chunks sealed while writing, 1 at close
RAW_CHUNK = 16 + 16 * 32 * 32 * 3  # Blosc's header + the chunk's bytes


def noise(rng, n):
    return rng.integers(0, 256, (n, 32, 32, 3), np.uint8)


def gradient(n, offset=0):
    t = np.arange(offset, offset + n)[:, None, None, None]
    y, x, c = np.ogrid[:32, :32, :3]
    return ((t + 2 * x + 3 * y + 40 * c) % 256).astype(np.uint8)


def write_frames(root, frames, monkeypatch):
    """Write ``frames`` (497 rows) as the observations of episodes of ``FRAME_LENGTHS``;
    return the image array's directory and the chunks Blosc was tried on, in order."""
    tried, sealed = [], []
    encode, encode_chunk = chunks_module._encode, chunks_module._Appender._encode_chunk

    def counted_encode(codec, block):
        if block.dtype == np.uint8:  # the image array's, not the action's or step's
            tried.append(len(sealed))
        return encode(codec, block)

    def counted_encode_chunk(self, rows):
        # The image array's chunks are encoded in index order, once each: 0, 1, ...
        result = encode_chunk(self, rows)
        if self.dtype == np.uint8:
            sealed.append(len(sealed))
        return result

    monkeypatch.setattr(chunks_module, "_encode", counted_encode)
    monkeypatch.setattr(chunks_module._Appender, "_encode_chunk", counted_encode_chunk)
    store = Store.create(root, FRAMES)
    with store.writer("a") as w:
        row = 0
        for T in FRAME_LENGTHS:
            w.write_episode({"image": frames[row : row + T + 1]}, np.zeros((T, 1), np.float32))
            row += T + 1
    monkeypatch.undo()
    assert row == len(frames) and sealed == list(range(32))
    return os.path.join(root, "shards", "a", "data", "obs", "image"), tried


def test_incompressible_chunks_skip_blosc_yet_keep_its_bytes(tmp_path, small_chunks, monkeypatch):
    frames = noise(np.random.default_rng(0), 497)
    image, tried = write_frames(str(tmp_path / "s"), frames, monkeypatch)
    # Blosc gave up on chunk 0, then was skipped for 8 chunks, 16, then 32: 29 of the 32
    # chunks went out as header + raw rows; one that completes an earlier episode's rows
    # was sealed in place, by writing Blosc's header over its region's.
    assert tried == [0, 9, 26]
    arr = zarr.open_array(image, mode="r")
    blosc = chunks_module.blosc_encoder(arr)
    for index in range(31):
        data = shard_chunk(image, index)
        # What Blosc itself writes for the block: its header (flagged "stored raw") + the rows.
        assert data == blosc.encode(frames[16 * index : 16 * (index + 1)]), index
        assert data[2] & 0x02 and len(data) == RAW_CHUNK
    assert len(shard_chunk(image, 31)) == RAW_CHUNK  # written at close, zero padded
    np.testing.assert_array_equal(arr[: len(frames)], frames)  # plain zarr, after close()


def test_chunks_blosc_barely_shrinks_are_stored_raw(tmp_path, small_chunks, monkeypatch):
    frames = noise(np.random.default_rng(2), 497)
    frames[:, 0, :21] = 0  # 63 of each frame's 3072 bytes: Blosc saves ~2%, under 1/MIN_SAVING
    image, tried = write_frames(str(tmp_path / "s"), frames, monkeypatch)
    arr = zarr.open_array(image, mode="r")
    compressed = chunks_module.blosc_encoder(arr).encode(frames[:16])
    assert not compressed[2] & 0x02 and len(compressed) < RAW_CHUNK  # Blosc alone would compress it
    # Handled as incompressible, so skipped after each try; a try encodes twice, the
    # second time in Blosc's raw layout.
    assert tried == [0, 0, 9, 9, 26, 26]
    for index in range(31):
        data = shard_chunk(image, index)
        assert data[2] & 0x02 and len(data) == RAW_CHUNK, index
        assert data[16:] == frames[16 * index : 16 * (index + 1)].tobytes(), index
    np.testing.assert_array_equal(arr[: len(frames)], frames)


@pytest.mark.parametrize("frames", [np.zeros((497, 32, 32, 3), np.uint8), gradient(497)], ids=["zeros", "gradient"])
def test_compressible_chunks_are_compressed(tmp_path, small_chunks, monkeypatch, frames):
    image, tried = write_frames(str(tmp_path / "s"), frames, monkeypatch)
    assert tried == list(range(32))
    for index in range(32):
        assert len(shard_chunk(image, index)) < RAW_CHUNK / 4, index
    np.testing.assert_array_equal(zarr.open_array(image, mode="r")[: len(frames)], frames)


def test_compression_resumes_and_skips_restart_short(tmp_path, small_chunks, monkeypatch):
    rng = np.random.default_rng(1)
    noisy = [0] + list(range(14, 31))  # chunks of noise; the others are a gradient
    frames = np.concatenate([noise(rng, 16) if c in noisy else gradient(16, 16 * c) for c in range(31)] + [gradient(1)])
    image, tried = write_frames(str(tmp_path / "s"), frames, monkeypatch)
    # Chunk 0 fails (skip 8); chunk 9 compresses, so every chunk is tried until chunk 14
    # fails again, and the skip starts over at 8 (not 16).
    assert tried == [0, 9, 10, 11, 12, 13, 14, 23]
    for index in range(31):
        assert (len(shard_chunk(image, index)) == RAW_CHUNK) == (index in noisy or 1 <= index <= 8), index
    np.testing.assert_array_equal(zarr.open_array(image, mode="r")[: len(frames)], frames)


def test_new_arrays_start_with_room_and_grow_geometrically(tmp_path, small_chunks, monkeypatch):
    resizes = []
    resize = zarr.Array.resize
    monkeypatch.setattr(zarr.Array, "resize", lambda self, shape: resizes.append((self.path, shape[0])) or resize(self, shape))
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    rows = 16 * chunks_module.MIN_GROWTH_CHUNKS  # 16-row chunks
    with store.writer("a") as w:
        write(w, 0, rows - 2)  # rows - 1 observation rows: the first resize is still ahead
        assert resizes == []
        write(w, 1, 3)  # action rows + 1 and observation rows + 3 reach past it
    assert sorted(resizes) == [(name, 2 * rows) for name in ("action", "obs/image", "obs/proprio", "step")]
    assert_episodes(store.snapshot(), [(0, rows - 2), (1, 3)])  # the capacity past them is not data


CRASH_WRITER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_store_append import episode
from robo_post.store import Store
from robo_post.store import writer as writer_module
from robo_post.store.commit import CommitRecord
writer_module.CHUNK_BYTES = 1
root, n_done, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
w = Store.open(root).writer("a")
for i in range(n_done):
    obs, actions, rewards = episode(i, 20)
    w.write_episode(obs, actions, rewards=rewards, attrs={{"i": i}})
# Die after every chunk and sidecar of the next episode is on disk, before its commit record.
CommitRecord.write = lambda self, counts: os.kill(os.getpid(), signal.SIGKILL)
obs, actions, rewards = episode(n_done, T)
w.write_episode(obs, actions, rewards=rewards, attrs={{"i": n_done}})
"""


# The killed episode's actions stay inside a chunk / seal several / reach the next shard file.
@pytest.mark.parametrize("T", [2, 45, 1000])
def test_kill_between_chunk_writes_and_commit_record(tmp_path, small_chunks, T):
    root = str(tmp_path / "s")
    store = Store.create(root, SCHEMA)
    code = CRASH_WRITER.format(tests=os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", code, root, "3", str(T)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    expected = [(i, 20) for i in range(3)]
    assert store.read_commit("a")["episodes"] == 3
    # The killed episode did reach the disk. Images: 63 committed rows (15 in chunk 3), T + 1
    # more seal chunk 3 and beyond. Actions: 60 committed (12 in chunk 3), T more.
    image = os.path.join(root, "shards", "a", "data", "obs", "image")
    last_sealed = (63 + T + 1) // 16 - 1
    assert shard_chunk(image, last_sealed) is not None
    if T == 2:  # actions stay in chunk 3: appended to its region
        region = shard_chunk(os.path.join(root, "shards", "a", "data", "action"), 3)
        assert region.startswith(b"RPTAIL")
        on_disk = np.frombuffer(region[16:], np.float32).reshape(-1, 2)  # written up to row 14 of 16
        np.testing.assert_array_equal(on_disk[12:14], episode(3, T)[1])
    assert_episodes(store.snapshot(), expected)  # the killed episode's rows are on disk but invisible
    assert validate_store(root) == (3, [])
    with store.writer("a") as w:  # reopen after the crash: leftovers are dropped, not trusted
        if last_sealed > 3:  # index entries (and shard files) past the committed rows' chunks are dropped
            assert shard_chunk(image, last_sealed) is None
        assert (last_sealed >= chunks_module.CHUNKS_PER_SHARD) == (T == 1000)
        assert write(w, 3, 30) == 3
    expected.append((3, 30))
    assert_episodes(store.snapshot(), expected)
    assert validate_store(root) == (4, []) and pending_files(root) == []


def test_failed_commit_record_write_leaves_writer_in_step(tmp_path, small_chunks, monkeypatch):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    w = store.writer("a")
    write(w, 0, 10)
    first = store.snapshot()
    monkeypatch.setattr(w._commit, "write", lambda counts: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        write(w, 1, 30)
    assert store.snapshot().id == first.id
    assert_episodes(store.snapshot(), [(0, 10)])
    monkeypatch.undo()
    assert write(w, 1, 25) == 1  # retried with other data: nothing of the failed attempt shows
    w.close()
    assert_episodes(store.snapshot(), [(0, 10), (1, 25)])
    assert validate_store(store.root) == (2, [])


def test_commit_record_survives_a_torn_slot(tmp_path):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    with store.writer("a") as w:
        write(w, 0, 5)
        write(w, 1, 6)
    shard = os.path.join(store.root, "shards", "a")
    assert read_commit(shard)["episodes"] == 2
    # Seq 0 (creation) went to slot 0, seq 1 to slot 1, seq 2 to slot 0: tear slot 0.
    with open(os.path.join(shard, "commit.bin"), "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    c = read_commit(shard)
    assert (c["episodes"], c["steps"]) == (1, 5)
    assert len(store.snapshot()) == 1


def test_shards_with_the_pre_release_commit_json_are_refused(tmp_path):
    """commit.json (no commit.bin) came before any release: refused, not read as an
    empty shard that a writer would start over."""
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    with store.writer("a") as w:
        write(w, 0, 5)
    shard = os.path.join(store.root, "shards", "a")
    os.unlink(os.path.join(shard, "commit.bin"))
    with open(os.path.join(shard, "commit.json"), "w") as f:
        json.dump({"episodes": 1, "steps": 5, "meta_bytes": os.path.getsize(os.path.join(shard, "episodes.jsonl"))}, f)
    before = test_store.tree_hash(store.root)
    for open_it in (store.snapshot, lambda: store.writer("a")):
        with pytest.raises(UnsupportedFormatError, match="commit.json of a pre-release"):
            open_it()
    assert test_store.tree_hash(store.root) == before
    assert validate_store(store.root)[1][0].startswith("cannot open store: ")


def test_sampler_windows_match_direct_formula_across_incremental_adds(tmp_path):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    H, n, g = 3, 2, 0.9
    K = n * H
    with store.writer("a") as w:
        for i, T in enumerate((4, 9, 1)):
            obs, actions, rewards = episode(i, T)
            w.write_episode(obs, actions, rewards=rewards, terminated=(np.arange(T) == T - 1) & (i != 1),
                            truncated=(np.arange(T) == T - 1) & (i == 1))
    first = store.snapshot()
    sampler = WindowSampler.from_snapshot(first, horizon=H, n_step=n, gamma=g)
    with store.writer("a") as w:
        write(w, 3, 8)  # truncated
    second = store.snapshot()
    sampler.add_episodes(second, second.new_since(first))  # grows every buffer after the first build
    starts, step = [], 0
    for e in second:
        starts += [(step + t, e, t) for t in range(e.length)]
        step += e.length
    batch = sampler.sample(0, starts=np.array([s for s, _, _ in starts]))
    for b, (_, e, t) in enumerate(starts):
        data, T = second.load(e), e.length
        window = [min(t + j, T - 1) for j in range(H)]
        np.testing.assert_array_equal(batch["actions"][b].numpy(), data["action"][window])
        assert batch["action_mask"][b].tolist() == [t + j < T for j in range(H)]
        ret = sum(g**j * data["reward"][t + j] for j in range(K) if t + j < T)
        assert batch["rewards"][b].item() == pytest.approx(ret, rel=1e-6)
        taken = min(K, T - t)
        assert batch["discounts"][b].item() == pytest.approx(0.0 if t + K >= T and e.terminated else g**taken)
        np.testing.assert_array_equal(batch["obs"]["image"][b].numpy(), data["obs"]["image"][t])
        np.testing.assert_array_equal(batch["next_obs"]["proprio"][b].numpy(), data["obs"]["proprio"][t + taken])
    assert batch["actions"].dtype == torch.float32 and batch["obs"]["image"].dtype == torch.uint8


# --- durability: what fsync=True syncs, and in which order ------------------------------
def record_syncs(monkeypatch):
    """Patch os.fdatasync / os.fsync to log (call, path of the fd) before syncing for real."""
    calls = []

    def recorder(kind, real):
        def sync(fd):
            calls.append((kind, os.readlink(f"/proc/self/fd/{fd}")))
            return real(fd)

        return sync

    monkeypatch.setattr(os, "fdatasync", recorder("fdatasync", os.fdatasync))
    monkeypatch.setattr(os, "fsync", recorder("fsync", os.fsync))
    return calls


def scan(directory):
    """path -> (inode, size, mtime) of every file and directory under ``directory``."""
    out = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(parent, name)
            st = os.stat(path)
            out[path] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def test_fsync_syncs_every_written_file_and_new_directory_before_the_commit_record(tmp_path, small_chunks, monkeypatch):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    shard = os.path.join(store.root, "shards", "a")
    record = os.path.join(shard, "commit.bin")
    calls = record_syncs(monkeypatch)
    w = store.writer("a")  # the default: durable
    # Lengths: inside a chunk, sealing several, and 1100 steps to outgrow the initial
    # 1024-row capacity (zarr rewrites zarr.json). Then close (the partial chunks go
    # into zarr) and reopen, so the next commit gives those chunks regions again.
    lengths = [3, 5, 40, 1100, 2]
    for n, T in enumerate(lengths + ["reopen", 7, 30]):
        if T == "reopen":
            w.close()
            w = store.writer("a", fsync=True)
            continue
        before = scan(shard)
        calls.clear()
        write(w, n, T)
        after = scan(shard)
        written = {p for p in after if os.path.isfile(p) and after[p] != before.get(p)} - {record}
        new_dirs = {os.path.dirname(p) for p in after if p not in before}
        assert written and calls[-1] == ("fdatasync", record), (T, calls[-3:])
        synced = [(kind, path.removesuffix(".partial")) for kind, path in calls[:-1]]
        assert len(set(synced)) == len(synced), "a file or directory synced twice"
        missing_files = written - {path for kind, path in synced if kind == "fdatasync"}
        missing_dirs = new_dirs - {path for kind, path in synced if kind == "fsync"}
        assert not missing_files and not missing_dirs, (T, missing_files, missing_dirs)
        assert record not in {path for _, path in synced}  # the record is synced after the data only
    w.close()
    assert validate_store(store.root) == (len(lengths) + 2, [])


def test_without_fsync_commits_make_no_sync_call(tmp_path, small_chunks, monkeypatch):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    calls = record_syncs(monkeypatch)
    w = store.writer("a", fsync=False)
    # Creating a shard syncs its fresh commit.bin once, so a power cut cannot leave it empty.
    assert calls == [("fsync", os.path.join(store.root, "shards", "a", "commit.bin.partial"))]
    calls.clear()
    for i, T in enumerate((3, 40, 1100)):
        write(w, i, T)
    w.close()
    with store.writer("a", fsync=False) as w:
        write(w, 3, 30)
    assert calls == []
    assert validate_store(store.root) == (4, [])


def test_validate_names_trailing_episodes_whose_data_was_lost(tmp_path, small_chunks):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    with store.writer("a", fsync=False) as w:  # the writer whose data a power cut can lose
        for i in range(5):
            write(w, i, 20)
    # A power cut after the commit record reached the disk but not the last writes to
    # the shard file: the image chunks of episodes 3 and 4 (rows 63..104) are gone.
    image = os.path.join(store.root, "shards", "a", "data", "obs", "image")
    for chunk in (4, 5, 6):
        clear_chunk(image, chunk)
    checked, problems = validate_store(store.root)
    assert checked == 3 and len(problems) == 1
    assert problems[0].startswith("a/3: checksum mismatch; so do all the shard's last 2 episodes (3..4)")
    assert "fsync=False" in problems[0]
    # Damage that is not at the end is reported per episode, as a change after commit.
    action = zarr.open_array(os.path.join(store.root, "shards", "a", "data", "action"), mode="r+")
    action[5, 0] = 0.5  # episode 0
    checked, problems = validate_store(store.root)
    assert checked == 2 and problems[0].startswith("a/0: checksum mismatch (data changed after commit;")
    assert problems[1].startswith("a/3: ")


def test_validate_names_episodes_of_an_unreadable_shard(tmp_path, small_chunks):
    store = Store.create(str(tmp_path / "s"), SCHEMA)
    w = store.writer("a")  # never closed, like a killed writer
    for i in range(3):
        write(w, i, 10)
    # Not closed: the last 14 action rows are in the region of chunk 1. A power cut
    # that lost the shard file's last writes leaves no index entry for it.
    clear_chunk(os.path.join(store.root, "shards", "a", "data", "action"), 1)
    checked, problems = validate_store(store.root)
    assert checked == 1 and len(problems) == 1
    assert problems[0].startswith("a/1: arrays unreadable") and "last 2 episodes (1..2)" in problems[0]
