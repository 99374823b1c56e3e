"""Append-only writing of a zarr v3 array, and reading it back with its pending tail.

Why not ``zarr.Array.__setitem__``: zarr's write path costs about a millisecond
per call even for a few kB (event-loop round trips, reading the partial chunk
back). And why never rewrite a chunk file: every commit ends inside a chunk, and
replacing a file that already exists makes ext4 flush the new file's data to
disk before the rename (``auto_da_alloc``), milliseconds per file.

So a shard's array grows append-only:

* a chunk is encoded and written only once it is full, with the array's own
  codecs (raw little-endian bytes, then Blosc), the bytes zarr itself would
  write; when Blosc could not compress a chunk (it then stores it raw behind
  its 16-byte header), the next full chunks of that array are written the same way
  without trying, as that header plus the raw rows: ``SKIP_AFTER_INCOMPRESSIBLE``
  of them, twice as many after each further failed try, at most
  ``MAX_SKIP_AFTER_INCOMPRESSIBLE``;
* arrays are zarr-sharded: ``CHUNKS_PER_SHARD`` chunks share one file, whose
  index (zarr's ``sharding_indexed`` codec, at the start, without a checksum so
  single entries can change) says where each chunk's bytes are. A sealed chunk is
  appended past every byte a committed index entry refers to, then its entry is
  set; all the chunks one commit seals in a shard file take one ``pwritev`` and
  one index write. Why: creating a file costs ext4 about as much as writing
  100 kB into one (a per-chunk-file layout made 5 new files per 64x64 camera
  episode). Arrays of stores made before sharding keep one file per chunk;
* the rows of the partly filled last chunk sit raw in a sidecar file,
  ``pending/<array path>/<chunk index>``, and a commit only appends to it;
* readers take rows below the last chunk boundary from zarr and the rest from the
  sidecar, or from zarr once the chunk has been written there (``read_rows``);
* ``close()`` writes the partial last chunk into zarr and drops the sidecar, so a
  closed shard is a plain zarr group.

Rows that a commit record covers are never rewritten in place: a sidecar only
grows past them, a chunk file that already exists is replaced atomically, a
shard file only grows past them, and while a chunk is being written its
committed rows are also in a sidecar. The one index entry that can change while
it refers to committed rows is that of a closed shard's zero-padded last chunk,
once a reopened writer fills that chunk: the entry then moves (16 bytes, one
``pwrite``) from the old bytes to the new ones, both of which hold those rows.

Durability (``ShardWriter(fsync=True)``): ``write`` records in a ``SyncSet``
every file it wrote or appended to and every directory that gained an entry;
the writer syncs them all before its commit record. A file that replaces an
existing one is fdatasync'd before the rename, as the file it replaces may hold
the only copy of committed rows.
"""

from __future__ import annotations

import os

import numcodecs.blosc
import numpy as np
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec, BytesCodec, ShardingCodec

from robo_post.store.schema import StoreIntegrityError

_SHUFFLE = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
MIN_GROWTH_CHUNKS = 64  # new arrays hold, and grow by at least, this many chunks: resizing rewrites zarr.json
CHUNKS_PER_SHARD = 64  # chunks per shard file of a new array; capacity grows in whole shards
_EMPTY = 2**64 - 1  # zarr's shard index entry (offset and size) of a chunk never written
# Noisy camera frames do not compress with LZ4; the failed attempt cost as much as
# writing the chunk. After one, skip the attempt for this many chunks, then try again;
# each further failure doubles the skip, up to the maximum (one try in 65 chunks).
SKIP_AFTER_INCOMPRESSIBLE = 8
MAX_SKIP_AFTER_INCOMPRESSIBLE = 64
_BLOSC_HEADER = 16
_BLOSC_MEMCPYED = 0x02  # flags bit: the chunk's data is stored uncompressed


def new_array(group: zarr.Group, name: str, dtype: str, row_shape: tuple[int, ...], chunk_rows: int) -> zarr.Array:
    """Create the sharded, Blosc-compressed array ``name`` that ``ChunkAppender`` appends to."""
    blosc = BloscCodec(
        # Byte-shuffle only helps multi-byte types; bit-shuffling images costs more
        # CPU than it saves bytes.
        cname="lz4", clevel=5, shuffle="shuffle" if np.dtype(dtype).itemsize > 1 else "noshuffle"
    )
    shard_rows = CHUNKS_PER_SHARD * chunk_rows
    return group.create_array(
        name,
        # Capacity, not committed rows (the commit record has those): starting with
        # room saves the first resize, ~1 ms, of every array of a new shard.
        shape=(max(MIN_GROWTH_CHUNKS * chunk_rows, shard_rows), *row_shape),
        chunks=(shard_rows, *row_shape),
        serializer=ShardingCodec(
            chunk_shape=(chunk_rows, *row_shape),
            codecs=[BytesCodec(), blosc],
            index_codecs=[BytesCodec()],  # no crc32c: the writer sets one entry at a time
            index_location="start",
        ),
        compressors=None,
        dtype=dtype,
        fill_value=0,
        # Shard files c.<i>.0... side by side: nested c/<i>/0/... costs mkdirs.
        chunk_key_encoding={"name": "default", "separator": "."},
    )


def _chunk_codecs(arr: zarr.Array) -> tuple[tuple, ShardingCodec | None]:
    """The codec chain of one chunk of ``arr``, and its sharding codec (None if unsharded)."""
    codecs = arr.metadata.codecs
    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec):
        sharding = codecs[0]
        if sharding.index_location.value != "start" or len(sharding.index_codecs) != 1:
            raise ValueError(f"unsupported shard index {sharding}: expected a bare index at the start")
        return sharding.codecs, sharding
    return codecs, None


def blosc_encoder(arr: zarr.Array) -> Blosc:
    """The numcodecs Blosc that produces the same chunk bytes as ``arr``'s own codecs.

    Raises ``ValueError`` for any codec chain other than bytes -> blosc (in a
    shard file or not), the only one the store creates.
    """
    codecs, _ = _chunk_codecs(arr)
    if len(codecs) != 2 or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[1], BloscCodec):
        raise ValueError(f"unsupported codec chain {codecs}: expected bytes -> blosc")
    if codecs[0].endian is not None and codecs[0].endian.value != "little":
        raise ValueError("only little-endian arrays are supported")
    c = codecs[1]
    return Blosc(cname=c.cname.value, clevel=c.clevel, shuffle=_SHUFFLE[c.shuffle.value], blocksize=c.blocksize, typesize=c.typesize)


def pending_path(pending_dir: str, arr: zarr.Array, index: int) -> str:
    """Sidecar file holding the raw rows of chunk ``index`` while it is partly filled."""
    return os.path.join(pending_dir, *arr.path.split("/"), str(index))


def read_rows(arr: zarr.Array, pending_dir: str, lo: int, hi: int, end: int) -> np.ndarray:
    """Rows ``lo..hi`` of an array with ``end`` committed rows.

    Rows of the partly filled last chunk come from its sidecar while one exists.
    Sidecars are removed only after the chunk reached zarr, so when none is found
    zarr has the rows; a sidecar removed while open stays readable.
    """
    c = arr.chunks[0]
    sealed = end - end % c
    if hi <= sealed:
        return arr[lo:hi]
    tail = _read_pending(pending_path(pending_dir, arr, sealed // c), end - sealed, arr)
    if tail is None:
        tail = arr[sealed:end]
    if lo >= sealed:
        return tail[lo - sealed : hi - sealed]
    return np.concatenate([arr[lo:sealed], tail[: hi - sealed]])


def _read_pending(path: str, n_rows: int, arr: zarr.Array) -> np.ndarray | None:
    dtype, row_shape = arr.dtype.newbyteorder("<"), arr.shape[1:]
    count = n_rows * int(np.prod(row_shape, dtype=np.int64))
    try:
        with open(path, "rb") as f:
            rows = np.fromfile(f, dtype=dtype, count=count)
    except FileNotFoundError:
        return None
    if len(rows) != count:
        raise StoreIntegrityError(f"{path}: sidecar holds fewer rows than committed ({len(rows)} of {count} values)")
    return rows.reshape(n_rows, *row_shape)


class SyncSet:
    """What one commit wrote, to make durable before its commit record is written.

    Holds open descriptors of written files (fdatasync'd, then closed), files
    written by zarr (by path) and directories that gained an entry (fsync'd,
    each once).
    """

    def __init__(self):
        self.fds: list[int] = []
        self.paths: dict[str, None] = {}  # ordered sets
        self.dirs: dict[str, None] = {}

    def add_fd(self, fd: int) -> None:
        """Take ownership of ``fd``: it is synced and closed by ``sync``."""
        self.fds.append(fd)

    def add_path(self, path: str) -> None:
        self.paths[path] = None

    def add_dir(self, directory: str) -> None:
        self.dirs[directory] = None

    def sync(self) -> None:
        """fdatasync every file, then fsync every directory; closes the descriptors."""
        try:
            for fd in self.fds:
                os.fdatasync(fd)
            for path in self.paths:
                _sync_path(path, os.O_RDONLY, os.fdatasync)
            for directory in self.dirs:
                _sync_path(directory, os.O_RDONLY | os.O_DIRECTORY, os.fsync)
        finally:
            self.close()

    def close(self) -> None:
        """Close the descriptors without syncing (after a failed commit)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _sync_path(path: str, flags: int, sync) -> None:
    fd = os.open(path, flags)
    try:
        sync(fd)
    finally:
        os.close(fd)


class ChunkAppender:
    """Appends rows to one zarr array (see the module docstring for the layout).

    The committed rows of the partly filled last chunk (the "tail") are also kept
    in memory, so sealing a chunk never reads anything back.

    Args:
        arr: the array (axis 0 is time), opened read-write.
        pending_dir: directory of this shard's sidecar files.
        end: number of committed rows.
        fsync: make ``flush`` durable before it drops a sidecar.
    """

    def __init__(self, arr: zarr.Array, pending_dir: str, end: int, fsync: bool = False):
        self.arr = arr
        self.fsync = fsync
        self.pending_dir = pending_dir
        self.dir = os.path.join(str(arr.store.root), arr.path)
        self.chunk = arr.chunks[0]
        self.row_shape = arr.shape[1:]
        self.dtype = arr.dtype.newbyteorder("<")
        self.row_nbytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.codec = blosc_encoder(arr)
        sharding = _chunk_codecs(arr)[1]
        self.shard_chunks = arr.shards[0] // self.chunk if sharding is not None else None
        self._shard: ShardFile | None = None  # the shard file last appended to, kept open
        # Header of the last full chunk that Blosc stored raw, chunks left to skip, and
        # the skip that the next failed try sets.
        self._raw_header: bytes | None = None
        self._skip = 0
        self._next_skip = SKIP_AFTER_INCOMPRESSIBLE
        self.capacity = arr.shape[0]
        self.tail_start = end - end % self.chunk
        self.tail = read_rows(arr, pending_dir, self.tail_start, end, end)
        index = self.tail_start // self.chunk
        self._drop_sidecars(keep=index if len(self.tail) else None)
        # Index of the sidecar holding the committed tail; None while zarr holds it.
        self.sidecar = index if os.path.exists(pending_path(pending_dir, arr, index)) else None
        if self.shard_chunks is not None:  # drop what a crashed writer left past the committed rows
            self._open_shard(index // self.shard_chunks, None)
            for name in os.listdir(self.dir):
                parts = name.split(".")
                if parts[0] == "c" and len(parts) == 1 + len(arr.shape) and int(parts[1]) > self._shard.index:
                    os.unlink(os.path.join(self.dir, name))

    @property
    def end(self) -> int:
        """Number of committed rows."""
        return self.tail_start + len(self.tail)

    def write(self, values: np.ndarray, sync: SyncSet | None = None) -> tuple[int, np.ndarray, int | None]:
        """Write ``values`` as rows ``end..end+len(values)``.

        Returns the new state, to hand to ``advance`` once the commit record covering
        these rows is written. Until then nothing in memory changes, so after a
        failure the next ``write`` starts again from the committed end. With
        ``sync``, every file and directory written is recorded there.
        """
        values = values.astype(self.dtype, copy=False)
        c, k, start = self.chunk, len(self.tail), self.tail_start
        n = k + len(values)
        n_full = n // c
        if start + n > self.capacity:  # cover the partial chunk too, for zarr reads once it is sealed
            self._grow(start + n, sync)
        sealed = []
        for j in range(n_full):
            lo, hi = j * c, (j + 1) * c
            if lo >= k:
                rows = [values[lo - k : hi - k]]  # only new rows: encode them in place
            else:
                rows = [self.tail[lo:], values[: hi - k]]  # joined only if Blosc is tried
            sealed.append(self._encode_chunk(rows))
        if sealed:
            self._write_chunks(start // c, sealed, sync)
        if n_full:
            new_start = start + n_full * c
            # Copied: the caller may overwrite its buffer once the episode is committed.
            tail = values[new_start - start - k :].copy()
            sidecar = new_start // c if len(tail) else None
            if sidecar is not None:
                self._write_sidecar(sidecar, tail, False, sync)  # no committed rows in it yet
        else:
            new_start, tail, sidecar = start, np.concatenate([self.tail, values]), start // c
            if self.sidecar == sidecar:  # append after the committed rows, touching none of them
                fd = os.open(pending_path(self.pending_dir, self.arr, sidecar), os.O_WRONLY)
                try:
                    pwrite_all(fd, np.ascontiguousarray(values).data, k * self.row_nbytes)
                except BaseException:
                    os.close(fd)
                    raise
                _keep_or_close(fd, sync)
            else:  # the committed tail (if any) is in zarr, written by close()
                self._write_sidecar(sidecar, tail, k > 0, sync)
        return new_start, tail, sidecar

    def advance(self, state: tuple[int, np.ndarray, int | None]) -> None:
        """Accept the rows of the last ``write`` as committed; drop a sealed chunk's sidecar."""
        if self.sidecar is not None and self.sidecar != state[2]:
            os.unlink(pending_path(self.pending_dir, self.arr, self.sidecar))
        self.tail_start, self.tail, self.sidecar = state

    def flush(self) -> None:
        """Write the partial last chunk into zarr (zero padded) and drop its sidecar,
        so the zarr array alone holds every committed row."""
        if self.sidecar is None:  # no partial chunk, or zarr holds it already
            return
        sync = SyncSet() if self.fsync else None
        try:
            if self.tail_start + self.chunk > self.capacity:
                self._grow(self.tail_start + self.chunk, sync)
            block = np.zeros((self.chunk, *self.row_shape), self.dtype)
            block[: len(self.tail)] = self.tail
            self._write_chunks(self.tail_start // self.chunk, [self._encode_chunk([block])], sync)
            if sync is not None:  # the sidecar holds the only durable copy of these rows until then
                sync.sync()
        finally:
            if sync is not None:
                sync.close()
        os.unlink(pending_path(self.pending_dir, self.arr, self.sidecar))
        self.sidecar = None

    def close(self) -> None:
        """Release the open shard file (after ``flush``, if the rows should reach zarr)."""
        if self._shard is not None:
            self._shard.close()
            self._shard = None

    # --- files ---------------------------------------------------------------------
    def _encode_chunk(self, rows: list[np.ndarray]) -> list:
        """The bytes of a full chunk holding the concatenation of ``rows``, as buffers."""
        if self._skip > 0:
            # Every full chunk has the same size, so Blosc's header for the raw chunk
            # is the same too: these are the bytes Blosc writes when it gives up, and
            # writev gathers the rows without joining them first.
            self._skip -= 1
            return [self._raw_header, *(np.ascontiguousarray(r).data for r in rows)]
        block = np.ascontiguousarray(rows[0] if len(rows) == 1 else np.concatenate(rows))
        data = _encode(self.codec, block)
        if data[2] & _BLOSC_MEMCPYED:
            self._raw_header, self._skip = bytes(data[:_BLOSC_HEADER]), self._next_skip
            self._next_skip = min(2 * self._next_skip, MAX_SKIP_AFTER_INCOMPRESSIBLE)
        else:
            self._next_skip = SKIP_AFTER_INCOMPRESSIBLE
        return [data]

    def _write_chunks(self, first: int, chunks: list[list], sync: SyncSet | None) -> None:
        """Write full chunks ``first, first + 1, ...`` from their encoded buffers."""
        # No tmp file needed for a new chunk: its committed rows (if any) are still in
        # the sidecar, which readers prefer and which outlives this write.
        if self.shard_chunks is None:  # one file per chunk
            for index, parts in enumerate(chunks, start=first):
                key = self.arr.metadata.encode_chunk_key((index,) + (0,) * len(self.row_shape))
                _write_file(os.path.join(self.dir, key), parts, False, sync)
            return
        while chunks:
            shard, slot = divmod(first, self.shard_chunks)
            n = min(len(chunks), self.shard_chunks - slot)
            if self._shard is None or self._shard.index != shard:
                self._open_shard(shard, sync)
            self._shard.append(slot, chunks[:n], sync)
            first, chunks = first + n, chunks[n:]

    def _open_shard(self, shard: int, sync: SyncSet | None) -> None:
        """Make shard file ``shard`` the open one (creating it if missing)."""
        self.close()
        # Slots up to the one holding the last committed row may be referenced by a
        # reader; later ones are leftovers of an uncommitted write.
        committed = -(-self.end // self.chunk) - shard * self.shard_chunks
        key = self.arr.metadata.encode_chunk_key((shard,) + (0,) * len(self.row_shape))
        self._shard = ShardFile(os.path.join(self.dir, key), shard, self.shard_chunks, committed, sync)

    def _write_sidecar(self, index: int, rows: np.ndarray, atomic: bool, sync: SyncSet | None) -> None:
        _write_file(pending_path(self.pending_dir, self.arr, index), [np.ascontiguousarray(rows).data], atomic, sync)

    def _drop_sidecars(self, keep: int | None) -> None:
        """Remove sidecars left by a crash: of sealed chunks, or holding no committed row."""
        directory = os.path.dirname(pending_path(self.pending_dir, self.arr, 0))
        if not os.path.isdir(directory):
            return
        for name in os.listdir(directory):
            if name != str(keep):
                os.unlink(os.path.join(directory, name))

    def _grow(self, rows: int, sync: SyncSet | None) -> None:
        # zarr rewrites zarr.json atomically; growing geometrically keeps that rare.
        capacity = max(rows, 2 * self.capacity, MIN_GROWTH_CHUNKS * self.chunk)
        unit = self.chunk * (self.shard_chunks or 1)
        capacity = -(-capacity // unit) * unit
        self.arr.resize((capacity, *self.row_shape))
        self.capacity = capacity
        if sync is not None:  # readers check row ranges against the shape in zarr.json
            sync.add_path(os.path.join(self.dir, "zarr.json"))
            sync.add_dir(self.dir)


class ShardFile:
    """One shard file of an array, open for appending chunks (zarr ``sharding_indexed``
    layout: an index of ``(offset, nbytes)`` per chunk at the start, then chunk bytes).

    Args:
        path: the file; created with an empty index if missing.
        index: the shard's index along time.
        n_chunks: chunks per shard.
        committed: leading slots that may hold committed rows. Entries past them are
            leftovers of an uncommitted write and are cleared, and new chunks go after
            every byte the others refer to.
        sync: records the new file's directory (the file itself is synced per append).
    """

    def __init__(self, path: str, index: int, n_chunks: int, committed: int, sync: SyncSet | None):
        self.path, self.index = path, index
        committed = min(max(committed, 0), n_chunks)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self.fd = os.open(path, os.O_RDWR)
            entries = np.frombuffer(os.pread(self.fd, n_chunks * 16, 0), "<u8").reshape(-1, 2)
            if len(entries) != n_chunks:
                os.close(self.fd)
                raise StoreIntegrityError(f"{path}: shard index is truncated") from None
            if (entries[committed:] != _EMPTY).any():
                pwrite_all(self.fd, memoryview(np.full(2 * (n_chunks - committed), _EMPTY, "<u8")), committed * 16)
            held = entries[:committed][entries[:committed, 0] != _EMPTY]
            self.end = int((held[:, 0] + held[:, 1]).max(initial=n_chunks * 16))
        else:
            pwrite_all(self.fd, memoryview(np.full(2 * n_chunks, _EMPTY, "<u8")), 0)
            self.end = n_chunks * 16
            if sync is not None:
                sync.add_dir(os.path.dirname(path))

    def append(self, slot: int, chunks: list[list], sync: SyncSet | None) -> None:
        """Write ``chunks`` (each a list of buffers) after the last byte in use, then
        point index slots ``slot, slot + 1, ...`` at them."""
        views = [memoryview(p).cast("B") for parts in chunks for p in parts]
        sizes = [sum(len(memoryview(p).cast("B")) for p in parts) for parts in chunks]
        offsets = self.end + np.cumsum([0, *sizes[:-1]])
        offset = self.end
        while views:  # pwritev may write less than asked
            n = os.pwritev(self.fd, views, offset)
            offset += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views:
                views[0] = views[0][n:]
        # Never rewound, even if this commit fails: the bytes may be referenced now.
        self.end = offset
        entries = np.stack([offsets, sizes], axis=1).astype("<u8")
        pwrite_all(self.fd, memoryview(entries).cast("B"), slot * 16)
        if sync is not None:
            sync.add_fd(os.dup(self.fd))

    def close(self) -> None:
        os.close(self.fd)


def _encode(codec: Blosc, block: np.ndarray) -> bytes:
    # Blosc's own threads cost more than they save on chunks of <= 512 KB: on 2 cores
    # a threaded encode took ~3x as long (benchmarks/store_ingest.py). Writers get their
    # parallelism from processes instead. The bytes are the same either way.
    previous = numcodecs.blosc.use_threads
    numcodecs.blosc.use_threads = False
    try:
        return codec.encode(block)
    finally:
        numcodecs.blosc.use_threads = previous


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` all of ``data`` at ``offset``."""
    view = data.cast("B")
    while view:  # pwrite may write less than asked
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _keep_or_close(fd: int, sync: SyncSet | None) -> None:
    """Hand a written file's ``fd`` to ``sync`` to be synced before the commit, or close it."""
    if sync is None:
        os.close(fd)
    else:
        sync.add_fd(fd)


def _makedirs(directory: str, sync: SyncSet | None) -> None:
    """``os.makedirs``; with ``sync``, record each parent that gained a directory."""
    missing = []
    d = directory
    while sync is not None and not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    os.makedirs(directory, exist_ok=True)
    for d in missing:
        sync.add_dir(os.path.dirname(d))


def _write_file(path: str, parts: list, atomic: bool, sync: SyncSet | None = None) -> None:
    """Write a whole file from the buffers ``parts``. A file that exists is always
    replaced atomically (tmp file + rename), so readers see the old or the new bytes;
    a new one only with ``atomic`` (needed when readers may open it before it is
    complete). Renaming onto a new name is cheap; replacing an existing file is what
    costs an ext4 data flush. With ``sync``, the file and its directory are recorded
    there (a renamed file is fdatasync'd before the rename instead)."""
    target = f"{path}.partial" if atomic else path
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if atomic else os.O_EXCL)
    try:
        fd = os.open(target, flags, 0o644)
    except FileExistsError:  # left behind by a crash, or a chunk written by close()
        return _write_file(path, parts, True, sync)
    except FileNotFoundError:
        _makedirs(os.path.dirname(path), sync)
        return _write_file(path, parts, atomic, sync)
    try:
        views = [memoryview(p).cast("B") for p in parts]
        while views:  # writev may write less than asked
            n = os.writev(fd, views)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views:
                views[0] = views[0][n:]
        if atomic and sync is not None:
            os.fdatasync(fd)  # the file it replaces may hold the only copy of committed rows
    except BaseException:
        os.close(fd)
        raise
    if atomic:
        os.close(fd)
        os.replace(target, path)
    else:
        _keep_or_close(fd, sync)
    if sync is not None:
        sync.add_dir(os.path.dirname(path))
