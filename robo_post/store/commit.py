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

Damage (``inspect_commit``): a slot that is neither a valid record nor never
written (all zero, beside the creation record) may have held the newest commit,
and a missing ``commit.bin`` beside a non-empty ``episodes.jsonl`` hides every
episode. Readers still use the newest valid slot (what a torn write leaves) and warn
(``CommitDamageWarning``), ``validate`` reports the damage and a writer refuses the
shard (``ShardDamagedError``) until ``robo-post store repair`` rewrites the record.
"""

from __future__ import annotations

import os
import struct
import time
import warnings
from dataclasses import dataclass

import crc32c

from robo_post.store.schema import ShardDamagedError, UnsupportedFormatError

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


@dataclass(frozen=True)
class CommitStatus:
    """What ``commit.bin`` of a shard says, and any damage found in it.

    Attributes:
        counts: the record readers use (newest valid slot; zeros for a shard never
            committed), or None when there is none.
        problem: the damage, or None for a healthy record.
        seq: sequence number of ``counts`` (-1 when there is no record).
    """

    counts: dict[str, int] | None
    problem: str | None
    seq: int


def inspect_commit(shard_dir: str) -> CommitStatus:
    """Read and check the commit record of a shard (``UnsupportedFormatError`` for the
    pre-release ``commit.json``)."""
    try:
        with open(os.path.join(shard_dir, "commit.bin"), "rb") as f:
            data = f.read(2 * _SLOT)
    except FileNotFoundError:
        if os.path.exists(os.path.join(shard_dir, "commit.json")):
            raise UnsupportedFormatError(
                f"{shard_dir}: commit.json of a pre-release robo-post store; this version reads only commit.bin"
            ) from None
        # A writer creates commit.bin before its first commit; killed earlier, it
        # leaves an empty index. Records without a commit record are damage.
        meta = os.path.join(shard_dir, "episodes.jsonl")
        size = os.path.getsize(meta) if os.path.exists(meta) else 0
        if size:
            return CommitStatus(None, f"commit.bin is missing, yet episodes.jsonl holds {size} bytes of records", -1)
        return CommitStatus(dict(EMPTY), None, 0)
    raw = [data[:_SLOT], data[_SLOT:]]
    slots = [_unpack(r) for r in raw]
    valid = [r for r in slots if r is not None]
    if not valid:
        return CommitStatus(None, "commit.bin holds no valid commit record", -1)
    seq, counts = max(valid, key=lambda r: r[0])
    problem = None
    for i, (r, slot) in enumerate(zip(slots, raw)):
        never_written = len(slot) == _SLOT and not slot.strip(b"\0") and seq == 0
        if r is None and not never_written:
            problem = (
                f"commit.bin slot {i} is damaged; the other holds commit {seq} ({counts['episodes']} episodes), "
                "which is older than the damaged one if that held the newest commit"
            )
    return CommitStatus(counts, problem, seq)


class CommitDamageWarning(UserWarning):
    """A reader fell back to the older commit slot because the other one is damaged: the
    shard may hold one more committed episode than it shows (``robo-post store repair``)."""


def read_commit(shard_dir: str) -> dict[str, int]:
    """The committed counts of a shard (zeros for a shard never committed); raises
    ``ShardDamagedError`` when there is no record to read.

    A damaged slot beside a valid one is what a concurrent commit looks like for the few
    microseconds of its write, so it is read again; still damaged, the reader uses the
    valid slot and warns (``CommitDamageWarning``) rather than shrink the shard silently.
    """
    status = inspect_commit(shard_dir)
    if status.problem is not None and status.counts is not None:
        time.sleep(0.01)
        status = inspect_commit(shard_dir)
        if status.problem is not None and status.counts is not None:
            warnings.warn(f"shard {os.path.basename(shard_dir)}: {status.problem}; reading the valid one "
                          "(`robo-post store validate` / `store repair`)", CommitDamageWarning, stacklevel=2)
    if status.counts is None:
        raise ShardDamagedError(os.path.basename(shard_dir), status.problem)
    return status.counts


def write_commit_file(shard_dir: str, seq: int, counts: dict[str, int], both_slots: bool = False) -> None:
    """Create or replace ``commit.bin`` whole (temporary file, fsync, rename) with one
    record in slot 0, and in slot 1 too with ``both_slots`` (else slot 1 is zeros, which
    ``inspect_commit`` accepts only beside the creation record, seq 0)."""
    path = os.path.join(shard_dir, "commit.bin")
    tmp = f"{path}.partial"
    record = _pack(seq, counts).ljust(_SLOT, b"\0")
    with open(tmp, "wb") as f:
        f.write(record + (record if both_slots else bytes(_SLOT)))
        # Whatever ``fsync``: after a power cut an empty commit.bin would make the
        # whole shard unreadable.
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
            write_commit_file(shard_dir, 0, counts)
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
