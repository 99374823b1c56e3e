"""Append-only writing of a zarr v3 array, and reading it back with its partial last chunk.

Why not ``zarr.Array.__setitem__``: zarr's write path costs about a millisecond
per call even for a few kB (event-loop round trips, reading the partial chunk
back, rewriting a whole shard). And why never rewrite a file: every commit ends
inside a chunk, and replacing a file that already exists makes ext4 flush the
new file's data to disk before the rename (``auto_da_alloc``), milliseconds per
file. Creating a file costs about as much as writing 100 kB into one, too.

So a shard's array grows append-only, in zarr's sharded layout: ``CHUNKS_PER_SHARD``
chunks share one file, whose index (``sharding_indexed`` codec, at the start,
without a checksum so single entries can change) holds each chunk's (offset,
nbytes). ``ShardAppender`` writes it:

* a chunk is encoded only once it is full, with the array's own codecs (raw
  little-endian bytes, then Blosc), the bytes zarr itself would write; when Blosc
  could not compress a chunk (it then stores it raw behind its 16-byte header),
  the next full chunks of that array are written the same way without trying, as
  that header plus the raw rows: ``SKIP_AFTER_INCOMPRESSIBLE`` of them, twice as
  many after each further failed try, at most ``MAX_SKIP_AFTER_INCOMPRESSIBLE``;
* the partly filled last chunk has a *region* in the shard file, sized for the
  raw chunk: a 16-byte header naming the chunk (``_region_header``), then its rows,
  which each commit appends; the chunk's index entry points at the region;
* when the chunk fills and is stored raw, Blosc's header overwrites the region's:
  the region is the sealed chunk, and no row was written twice. When it
  compresses, the compressed bytes are appended, the entry moves to them, and the
  region is reused for the next partial chunk (header first, then rows);
* new bytes always go past every byte an index entry refers to; all the chunks one
  commit seals in a shard file take one ``pwritev`` and one index write;
* readers take sealed rows from zarr and the partial chunk's rows from its region
  (``read_rows``), as a seqlock: the rows count only if the region's header still
  names their chunk after they were read. Otherwise the chunk was sealed, and
  zarr has it;
* ``close()`` seals the partial last chunk zero padded, so a closed shard is a
  plain zarr group.

Rows that a commit record covers are never rewritten in place. The one index
entry that can change while it refers to committed rows is that of a partial
chunk whose region is gone (sealed by ``close()``, or by a writer killed after
sealing it in place): when a reopened writer appends to that chunk, the entry
moves (16 bytes, one ``pwrite``) from the sealed chunk to a new region, both of
which hold those rows.

Arrays of pre-release stores (one file per chunk, the partial last chunk in a
``pending/`` sidecar) are refused with ``UnsupportedFormatError``: no released
version wrote them.

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

from robo_post.store.schema import StoreIntegrityError, UnsupportedFormatError

_SHUFFLE = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
MIN_GROWTH_CHUNKS = 64  # new arrays hold, and grow by at least, this many chunks: resizing rewrites zarr.json
CHUNKS_PER_SHARD = 64  # chunks per shard file of a new array; capacity grows in whole shards
_EMPTY = 2**64 - 1  # zarr's shard index entry (offset and size) of a chunk never written
# Noisy camera frames do not compress with LZ4; the failed attempt cost as much as
# writing the chunk. After one, skip the attempt for this many chunks, then try again;
# each further failure doubles the skip, up to the maximum (one try in 65 chunks).
SKIP_AFTER_INCOMPRESSIBLE = 8
MAX_SKIP_AFTER_INCOMPRESSIBLE = 64
# A chunk that Blosc shrinks by less than 1/MIN_SAVING counts as incompressible and is
# stored raw: the few bytes saved do not pay for a second write of its rows and a
# decode on every read (noisy frames came out 0.04% smaller).
MIN_SAVING = 16
_BLOSC_HEADER = 16
_BLOSC_MEMCPYED = 0x02  # flags bit: the chunk's data is stored uncompressed
_REGION_MAGIC = b"RPTAIL\0\0"  # a partial chunk's region, then the chunk index as u64


def new_array(group: zarr.Group, name: str, dtype: str, row_shape: tuple[int, ...], chunk_rows: int) -> zarr.Array:
    """Create the sharded, Blosc-compressed array ``name`` that ``ShardAppender`` appends to."""
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


def blosc_encoder(arr: zarr.Array, clevel: int | None = None) -> Blosc:
    """The numcodecs Blosc that produces the same chunk bytes as ``arr``'s own codecs
    (at compression level ``clevel`` instead of the array's, if given).

    Raises ``ValueError`` for any codec chain other than bytes -> blosc (in a
    shard file or not), the only one the store creates.
    """
    codecs, _ = _chunk_codecs(arr)
    if len(codecs) != 2 or not isinstance(codecs[0], BytesCodec) or not isinstance(codecs[1], BloscCodec):
        raise ValueError(f"unsupported codec chain {codecs}: expected bytes -> blosc")
    if codecs[0].endian is not None and codecs[0].endian.value != "little":
        raise ValueError("only little-endian arrays are supported")
    c = codecs[1]
    clevel = c.clevel if clevel is None else clevel
    return Blosc(cname=c.cname.value, clevel=clevel, shuffle=_SHUFFLE[c.shuffle.value], blocksize=c.blocksize, typesize=c.typesize)


def _check_sharded(arr: zarr.Array) -> None:
    if _chunk_codecs(arr)[1] is None:
        raise UnsupportedFormatError(
            f"{arr.store.root}/{arr.path}: unsharded array of a pre-release robo-post store; "
            "this version reads only the sharded layout"
        )


def read_rows(arr: zarr.Array, lo: int, hi: int, end: int) -> np.ndarray:
    """Rows ``lo..hi`` of an array with ``end`` committed rows.

    Rows of the partly filled last chunk come from its region in the shard file
    while there is one: a region is sealed in place or reused only after its chunk
    reached zarr, so when none is found zarr has the rows.
    """
    _check_sharded(arr)
    c = arr.chunks[0]
    sealed = end - end % c
    if hi <= sealed:
        return arr[lo:hi]
    tail = _read_region(arr, sealed // c, end - sealed)
    if tail is None:
        tail = arr[sealed:end]
    if lo >= sealed:
        return tail[lo - sealed : hi - sealed]
    return np.concatenate([arr[lo:sealed], tail[: hi - sealed]])


def _region_header(index: int) -> bytes:
    """First 16 bytes of the region of partial chunk ``index``; never a Blosc header
    (whose first byte is its format version, 2)."""
    return _REGION_MAGIC + index.to_bytes(8, "little")


def _read_region(arr: zarr.Array, index: int, n_rows: int) -> np.ndarray | None:
    """The first ``n_rows`` rows of partial chunk ``index`` from its region in the
    shard file, or None once the chunk is sealed (zarr then decodes it)."""
    per_shard = arr.shards[0] // arr.chunks[0]
    key = arr.metadata.encode_chunk_key((index // per_shard,) + (0,) * (arr.ndim - 1))
    path = os.path.join(str(arr.store.root), arr.path, key)
    dtype, row_shape = arr.dtype.newbyteorder("<"), arr.shape[1:]
    rows = np.empty((n_rows, *row_shape), dtype)
    header = _region_header(index)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreIntegrityError(f"{path}: missing, yet chunk {index} holds committed rows") from None
    try:
        # Seqlock: the rows count only if the header still names this chunk after
        # they were read (the writer changes the header before any row).
        for _ in range(100):
            offset = int(np.frombuffer(os.pread(fd, 8, 16 * (index % per_shard)), "<u8")[0])
            if offset == _EMPTY:
                raise StoreIntegrityError(f"{path}: no index entry for chunk {index}, which holds committed rows")
            head = os.pread(fd, _BLOSC_HEADER, offset)
            if head[: len(_REGION_MAGIC)] != _REGION_MAGIC:
                return None  # sealed
            if head != header:
                continue  # reused by a later chunk, so this one was sealed: read its entry again
            if os.preadv(fd, [rows], offset + _BLOSC_HEADER) != rows.nbytes:
                raise StoreIntegrityError(f"{path}: chunk {index} holds fewer rows than committed")
            if os.pread(fd, _BLOSC_HEADER, offset) == header:
                return rows
        raise StoreIntegrityError(f"{path}: chunk {index} kept changing while read")
    finally:
        os.close(fd)


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


def open_appender(arr: zarr.Array, end: int, fsync: bool = False) -> "ShardAppender":
    """The appender for ``arr`` (``UnsupportedFormatError`` for an unsharded array).
    Args as for ``ShardAppender``."""
    _check_sharded(arr)
    return ShardAppender(arr, end, fsync)


class _Appender:
    """The committed tail in memory, encoding full chunks (skipping Blosc after
    incompressible ones), and the array's capacity.

    The committed rows of the partly filled last chunk (the "tail") are kept in
    memory, so sealing a chunk never reads anything back.
    """

    def __init__(self, arr: zarr.Array, end: int, fsync: bool):
        self.arr = arr
        self.fsync = fsync
        self.dir = os.path.join(str(arr.store.root), arr.path)
        self.chunk = arr.chunks[0]
        self.row_shape = arr.shape[1:]
        self.dtype = arr.dtype.newbyteorder("<")
        self.row_nbytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.codec = blosc_encoder(arr)
        self.raw_codec = blosc_encoder(arr, clevel=0)  # stores every chunk raw
        # Header of the last full chunk that Blosc stored raw, chunks left to skip, and
        # the skip that the next failed try sets.
        self._raw_header: bytes | None = None
        self._skip = 0
        self._next_skip = SKIP_AFTER_INCOMPRESSIBLE
        self.capacity = arr.shape[0]
        self.tail_start = end - end % self.chunk
        self.tail = np.empty((0, *self.row_shape), self.dtype)
        self._grow_unit = self.chunk

    @property
    def end(self) -> int:
        """Number of committed rows."""
        return self.tail_start + len(self.tail)

    def close(self) -> None:
        """Release open files (after ``flush``, if the rows should reach zarr)."""

    def _encode_chunk(self, rows: list[np.ndarray]) -> tuple[list, bytes | None]:
        """The bytes of a full chunk holding the concatenation of ``rows``, as buffers,
        and Blosc's header if it stores the chunk raw (header + rows), else None."""
        if self._skip > 0:
            # Every full chunk has the same size, so Blosc's header for the raw chunk
            # is the same too: these are the bytes Blosc writes when it gives up, and
            # writev gathers the rows without joining them first.
            self._skip -= 1
            return [self._raw_header, *(np.ascontiguousarray(r).data for r in rows)], self._raw_header
        block = np.ascontiguousarray(rows[0] if len(rows) == 1 else np.concatenate(rows))
        data = _encode(self.codec, block)
        if not data[2] & _BLOSC_MEMCPYED and len(data) > block.nbytes - block.nbytes // MIN_SAVING:
            data = _encode(self.raw_codec, block)  # Blosc's raw layout, as if it had given up
        if data[2] & _BLOSC_MEMCPYED:
            self._raw_header, self._skip = bytes(data[:_BLOSC_HEADER]), self._next_skip
            self._next_skip = min(2 * self._next_skip, MAX_SKIP_AFTER_INCOMPRESSIBLE)
            return [data], self._raw_header
        self._next_skip = SKIP_AFTER_INCOMPRESSIBLE
        return [data], None

    def _grow(self, rows: int, sync: SyncSet | None) -> None:
        # zarr rewrites zarr.json atomically; growing geometrically keeps that rare.
        capacity = max(rows, 2 * self.capacity, MIN_GROWTH_CHUNKS * self.chunk)
        capacity = -(-capacity // self._grow_unit) * self._grow_unit
        self.arr.resize((capacity, *self.row_shape))
        self.capacity = capacity
        if sync is not None:  # readers check row ranges against the shape in zarr.json
            sync.add_path(os.path.join(self.dir, "zarr.json"))
            sync.add_dir(self.dir)


class ShardAppender(_Appender):
    """Appends rows to a sharded zarr array (see the module docstring for the layout).

    Args:
        arr: the array (axis 0 is time), opened read-write.
        end: number of committed rows.
        fsync: make ``flush`` durable.
    """

    def __init__(self, arr: zarr.Array, end: int, fsync: bool = False):
        super().__init__(arr, end, fsync)
        self.per_shard = arr.shards[0] // self.chunk
        self._grow_unit = arr.shards[0]
        index = self.tail_start // self.chunk
        key = arr.metadata.encode_chunk_key((index // self.per_shard,) + (0,) * len(self.row_shape))
        _check_not_cut(os.path.join(self.dir, key), self.per_shard, index, end - self.tail_start, self.row_nbytes)
        self.tail = read_rows(arr, self.tail_start, end, end)
        self._shard: ShardFile | None = None
        # Opening the shard file of the partial chunk drops what a crashed writer left
        # past the committed rows; later shard files hold none of them.
        self._open_shard(index // self.per_shard, None)
        for name in os.listdir(self.dir):
            parts = name.split(".")
            if parts[0] == "c" and len(parts) == 1 + len(arr.shape) and int(parts[1]) > self._shard.index:
                os.unlink(os.path.join(self.dir, name))
        # Offset of the region holding the partial last chunk's rows; None when there
        # is no partial chunk, or close() sealed it.
        self.region = self._shard.region(index % self.per_shard, index) if len(self.tail) else None

    def write(self, values: np.ndarray, sync: SyncSet | None = None) -> tuple[int, np.ndarray, int | None]:
        """Write ``values`` as rows ``end..end+len(values)``.

        Returns the new state, to hand to ``advance`` once the commit record covering
        these rows is written. Until then nothing in memory changes but the skip
        state, so after a failure the next ``write`` starts again from the committed
        end. With ``sync``, every file and directory written is recorded there.
        """
        values = values.astype(self.dtype, copy=False)
        c, k, start, row = self.chunk, len(self.tail), self.tail_start, self.row_nbytes
        n = k + len(values)
        n_full = n // c
        if start + n > self.capacity:
            self._grow(start + n, sync)
        index = start // c
        if n_full == 0:  # every new row goes to the partial chunk's region
            tail = np.concatenate([self.tail, values])
            if self.region is None:
                return start, tail, self._new_region(index, [self.tail, values], None, sync)
            self._shard_of(index, sync).write([values], self.region + _BLOSC_HEADER + k * row, sync)
            return start, tail, self.region
        first, sealed, spare = index, [], self.region
        parts, raw_header = self._encode_chunk([self.tail, values[: c - k]])
        if raw_header is not None and self.region is not None:
            self._seal_in_place(index, values[: c - k], raw_header, sync)
            first, spare = index + 1, None
        else:
            sealed.append(parts)
        for j in range(1, n_full):
            sealed.append(self._encode_chunk([values[j * c - k : (j + 1) * c - k]])[0])
        if sealed:
            self._write_chunks(first, sealed, sync)
        new_start = start + n_full * c
        if new_start == start + n:
            return new_start, values[:0], None
        new_index = new_start // c
        if spare is not None and new_index // self.per_shard != index // self.per_shard:
            spare = None  # a region is reused only inside its own shard file
        # Copied: the caller may overwrite its buffer once the episode is committed.
        tail = values[new_start - start - k :].copy()
        return new_start, tail, self._new_region(new_index, [tail], spare, sync)

    def advance(self, state: tuple[int, np.ndarray, int | None]) -> None:
        """Accept the rows of the last ``write`` as committed."""
        self.tail_start, self.tail, self.region = state

    def flush(self) -> None:
        """Seal the partial last chunk (zero padded), so that zarr alone holds every
        committed row."""
        if self.region is None:  # no partial chunk, or sealed already
            return
        sync = SyncSet() if self.fsync else None
        try:
            k, index = len(self.tail), self.tail_start // self.chunk
            padding = np.zeros((self.chunk - k, *self.row_shape), self.dtype)
            parts, raw_header = self._encode_chunk([self.tail, padding])
            if raw_header is not None:
                self._seal_in_place(index, padding, raw_header, sync)
            else:
                self._write_chunks(index, [parts], sync)
            if sync is not None:
                sync.sync()
        finally:
            if sync is not None:
                sync.close()
        self.region = None

    def close(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None

    def _seal_in_place(self, index: int, rest: np.ndarray, raw_header: bytes, sync: SyncSet | None) -> None:
        """Seal partial chunk ``index``, which Blosc stores raw: write its ``rest`` rows
        into the region, then Blosc's header over the region's. The region is now the
        chunk, with no row written twice."""
        shard = self._shard_of(index, sync)
        shard.write([rest], self.region + _BLOSC_HEADER + len(self.tail) * self.row_nbytes, sync)
        shard.write([raw_header], self.region, sync)

    def _new_region(self, index: int, rows: list[np.ndarray], spare: int | None, sync: SyncSet | None) -> int:
        """Give partial chunk ``index`` a region holding ``rows``: ``spare`` (the region
        of a chunk just sealed elsewhere) or new space; point its index entry there."""
        shard = self._shard_of(index, sync)
        header = _region_header(index)
        if spare is None:
            offset = shard.allocate(_BLOSC_HEADER + self.chunk * self.row_nbytes)
            shard.write([header, *rows], offset, sync)
        else:
            # The header first: a reader of the chunk sealed away from here sees it
            # change before any of its rows do, and reads the sealed chunk instead.
            offset = spare
            shard.write([header], offset, sync)
            shard.write(rows, offset + _BLOSC_HEADER, sync)
        shard.set_entries(index % self.per_shard, [(offset, _BLOSC_HEADER + self.chunk * self.row_nbytes)], sync)
        return offset

    def _write_chunks(self, first: int, chunks: list[list], sync: SyncSet | None) -> None:
        """Append full chunks ``first, first + 1, ...`` (encoded buffers) to their shard
        files and point the index entries at them: one write of each per shard file."""
        while chunks:
            slot = first % self.per_shard
            n = min(len(chunks), self.per_shard - slot)
            shard = self._shard_of(first, sync)
            entries = []
            for parts in chunks[:n]:
                nbytes = sum(memoryview(p).nbytes for p in parts)
                entries.append((shard.allocate(nbytes), nbytes))
            shard.write([p for parts in chunks[:n] for p in parts], entries[0][0], sync)
            shard.set_entries(slot, entries, sync)
            first, chunks = first + n, chunks[n:]

    def _shard_of(self, index: int, sync: SyncSet | None) -> "ShardFile":
        """The open shard file holding chunk ``index``."""
        if self._shard is None or self._shard.index != index // self.per_shard:
            self._open_shard(index // self.per_shard, sync)
        return self._shard

    def _open_shard(self, shard: int, sync: SyncSet | None) -> None:
        self.close()
        # Slots up to the one holding the last committed row may be referenced by a
        # reader; later ones are leftovers of an uncommitted write.
        committed = -(-self.end // self.chunk) - shard * self.per_shard
        key = self.arr.metadata.encode_chunk_key((shard,) + (0,) * len(self.row_shape))
        self._shard = ShardFile(os.path.join(self.dir, key), shard, self.per_shard, committed, sync)


def _check_not_cut(path: str, per_shard: int, index: int, tail_rows: int, row_nbytes: int) -> None:
    """Refuse the shard file of partial chunk ``index`` when it was cut short after commit (a
    full disk, a copy cut off): zarr reads missing bytes as zeros, so a writer would append
    to it silently and seal those zeros into the chunk."""
    if index % per_shard == 0 and tail_rows == 0:
        return  # no committed row lives in this shard file: the writer starts it anew (ShardFile)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return  # read_rows names a missing file that holds committed rows
    try:
        size, slot = os.fstat(fd).st_size, index % per_shard
        raw = os.pread(fd, per_shard * 16, 0)
        if len(raw) != per_shard * 16:
            raise StoreIntegrityError(f"{path}: {size} bytes, shorter than its shard index (cut short after commit)")
        entries = np.frombuffer(raw, "<u8").reshape(-1, 2)
        needed = [int(o + n) for o, n in entries[:slot] if o != _EMPTY]
        offset, nbytes = (int(v) for v in entries[slot])
        if tail_rows and offset != _EMPTY:
            # A region holds only the rows committed so far; a sealed chunk all its bytes.
            in_region = os.pread(fd, _BLOSC_HEADER, offset) == _region_header(index)
            needed.append(offset + (_BLOSC_HEADER + tail_rows * row_nbytes if in_region else nbytes))
    finally:
        os.close(fd)
    if needed and size < max(needed):
        raise StoreIntegrityError(f"{path}: {size} bytes, but its committed chunks reach byte {max(needed)} "
                                  "(cut short after commit)")


class ShardFile:
    """One shard file of an array, open for appending (zarr ``sharding_indexed`` layout:
    an index of ``(offset, nbytes)`` per chunk at the start, then chunk bytes).

    Args:
        path: the file; created with an empty index if missing.
        index: the shard's index along time.
        n_chunks: chunks per shard.
        committed: leading slots that may hold committed rows. Entries past them are
            leftovers of an uncommitted write and are cleared, and new bytes go after
            every byte the others refer to.
        sync: records the new file's directory.
    """

    def __init__(self, path: str, index: int, n_chunks: int, committed: int, sync: SyncSet | None):
        self.path, self.index = path, index
        self._synced_by: SyncSet | None = None  # the commit whose SyncSet has this file
        committed = min(max(committed, 0), n_chunks)
        if committed and os.path.exists(path):
            self.fd = os.open(path, os.O_RDWR)
            self.entries = np.frombuffer(os.pread(self.fd, n_chunks * 16, 0), "<u8").reshape(-1, 2).copy()
            if len(self.entries) != n_chunks:
                os.close(self.fd)
                raise StoreIntegrityError(f"{path}: shard index is truncated") from None
            if (self.entries[committed:] != _EMPTY).any():
                self.entries[committed:] = _EMPTY
                pwrite_all(self.fd, [self.entries[committed:]], committed * 16)
            held = self.entries[:committed][self.entries[:committed, 0] != _EMPTY]
            self.end = int((held[:, 0] + held[:, 1]).max(initial=n_chunks * 16))
        else:  # a file holding no committed chunk is all leftovers (an uncommitted write, or what
            # `store repair` cut off, perhaps damaged): it is started anew
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self.entries = np.full((n_chunks, 2), _EMPTY, "<u8")
            pwrite_all(self.fd, [self.entries], 0)
            self.end = n_chunks * 16
            if sync is not None:
                sync.add_dir(os.path.dirname(path))

    def region(self, slot: int, index: int) -> int | None:
        """Offset of the region that slot ``slot`` (chunk ``index``) points at, or None
        if it points at a sealed chunk."""
        offset = int(self.entries[slot, 0])
        if offset != _EMPTY and os.pread(self.fd, _BLOSC_HEADER, offset) == _region_header(index):
            return offset
        return None

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` after every byte in use. Never given back, even if the
        commit fails: an index entry may refer to them by then."""
        offset, self.end = self.end, self.end + nbytes
        return offset

    def write(self, parts: list, offset: int, sync: SyncSet | None) -> None:
        """Write the buffers ``parts`` one after another at ``offset``."""
        pwrite_all(self.fd, parts, offset)
        if sync is not None and self._synced_by is not sync:
            sync.add_fd(os.dup(self.fd))
            self._synced_by = sync

    def set_entries(self, slot: int, entries: list[tuple[int, int]], sync: SyncSet | None) -> None:
        """Point index slots ``slot, slot + 1, ...`` at ``entries`` (offset, nbytes)."""
        self.entries[slot : slot + len(entries)] = entries
        self.write([self.entries[slot : slot + len(entries)]], slot * 16, sync)

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


def pwrite_all(fd: int, parts: list, offset: int) -> None:
    """Write the buffers ``parts`` one after another at ``offset`` (``os.pwritev``,
    again for whatever a short write left)."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]
