"""The commit record of a shard: how many episodes, steps and metadata bytes exist.

It is the only thing readers trust, so replacing it must be atomic. Writing a new
file and renaming it over the old one does that but costs a journal commit on
every episode (ext4 flushes a file renamed over an existing one). Instead
``commit.bin`` has two fixed 512-byte slots, overwritten in place in turn::

    magic "RPC1" | seq u64 | episodes u64 | steps u64 | meta_bytes u64 | crc32c u32   (little-endian)

A commit writes the slot *not* holding the latest record. The valid slot with the
higher ``seq`` is the current record: a torn or concurrent write fails its
checksum, and the other slot still holds the previous commit.

Durability: the record is visible to readers (and survives a killed writer) as
soon as it is written. Only with ``fsync`` is it ``fdatasync``'d (the file never
changes size, so that is a single data-block write), and the writer then syncs
the episode's data *before* writing the record (``writer.py``). Without
``fsync``, after an OS crash or power loss the on-disk record may be older than
the last commit, or newer than the data that reached the disk.

A shard holding the pre-release ``commit.json`` instead is refused
(``UnsupportedFormatError``) rather than read as empty.
"""

from __future__ import annotations

import os
import struct

import crc32c

from robo_post.store.schema import StoreIntegrityError, UnsupportedFormatError

EMPTY = {"episodes": 0, "steps": 0, "meta_bytes": 0}
_RECORD = struct.Struct("<4sQQQQ")
_MAGIC = b"RPC1"
_SLOT = 512  # one disk sector per slot, so a torn write cannot reach the other one


def _pack(seq: int, counts: dict[str, int]) -> bytes:
    body = _RECORD.pack(_MAGIC, seq, counts["episodes"], counts["steps"], counts["meta_bytes"])
    return body + struct.pack("<I", crc32c.crc32c(body))


def _unpack(slot: bytes) -> tuple[int, dict[str, int]] | None:
    body, crc = slot[: _RECORD.size], slot[_RECORD.size : _RECORD.size + 4]
    if len(crc) < 4 or struct.unpack("<I", crc)[0] != crc32c.crc32c(body):
        return None
    magic, seq, episodes, steps, meta_bytes = _RECORD.unpack(body)
    if magic != _MAGIC:
        return None
    return seq, {"episodes": episodes, "steps": steps, "meta_bytes": meta_bytes}


def read_commit(shard_dir: str) -> dict[str, int]:
    """The committed counts of a shard (zeros for a shard never committed)."""
    try:
        with open(os.path.join(shard_dir, "commit.bin"), "rb") as f:
            data = f.read(2 * _SLOT)
    except FileNotFoundError:
        # A writer would start the shard over and overwrite its episodes.
        if os.path.exists(os.path.join(shard_dir, "commit.json")):
            raise UnsupportedFormatError(
                f"{shard_dir}: commit.json of a pre-release robo-post store; this version reads only commit.bin"
            ) from None
        return dict(EMPTY)
    slots = [r for r in (_unpack(data[:_SLOT]), _unpack(data[_SLOT:])) if r is not None]
    if not slots:
        raise StoreIntegrityError(f"{shard_dir}/commit.bin: no valid commit record")
    return max(slots, key=lambda r: r[0])[1]


class CommitRecord:
    """Writer side of ``commit.bin`` (the caller holds the shard lock).

    Args:
        shard_dir: the shard directory.
        counts: the current committed counts (written as the first record if the
            file does not exist yet).
        fsync: make ``sync`` ``fdatasync`` the record.
    """

    def __init__(self, shard_dir: str, counts: dict[str, int], fsync: bool = False):
        path = os.path.join(shard_dir, "commit.bin")
        self.fsync = fsync
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read(2 * _SLOT)
            slots = [_unpack(data[:_SLOT]), _unpack(data[_SLOT:])]
            self._seq = max(r[0] for r in slots if r is not None)
            self._next_slot = 0 if slots[1] is not None and slots[1][0] == self._seq else 1
        else:  # created whole (tmp + rename) so readers never see a file without a record
            tmp = f"{path}.partial"
            with open(tmp, "wb") as f:
                f.write(_pack(0, counts).ljust(2 * _SLOT, b"\0"))
                # Once per shard, whatever ``fsync``: after a power cut an empty commit.bin
                # would make the whole shard unreadable.
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._seq, self._next_slot = 0, 1
        self._fd = os.open(path, os.O_WRONLY)

    def write(self, counts: dict[str, int]) -> None:
        """Make ``counts`` the committed record: visible to readers on return; call
        ``sync`` to make it durable."""
        os.pwrite(self._fd, _pack(self._seq + 1, counts), self._next_slot * _SLOT)
        self._seq += 1
        self._next_slot ^= 1

    def sync(self) -> None:
        """With ``fsync``, wait until the last record is on disk."""
        if self.fsync:
            os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)
