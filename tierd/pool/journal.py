"""The commit journal: an append-only log of every change to what a crash restart may serve.

Hazard: after SIGKILL or an OOM kill nothing runs at exit, yet the segment files keep whatever
the dead daemon last wrote: committed objects, objects half written, slots whose old object was
evicted and that a new one was already being copied into. A restart must know, for every slot,
whether its bytes are a committed object. So the pool appends a record (one ``write``, into the
page cache of tmpfs/hugetlbfs, which outlives the process) before the change it describes can
matter (tierd.pool.persist names the kinds):

- commit: after every byte of the object is written, before it becomes visible;
- drop (evict, replace, clear) of a committed object: before its slot is handed out again;
- slab carved / released, segment grown: before a slot in it is handed out.

A slot's bytes change only after the drop record of its last committed object is written, so
replaying the complete records yields only objects whose bytes are intact. A kill can cut only
the last write short: a record that runs past the end of the file is a torn tail and is ignored
(with the rest of its batch); anything else that fails a check is corruption, and the restart
is cold. Power loss empties tmpfs: no files, a cold start.

Format (little endian). Header, 24 bytes: ``b"TIERDJ01"``, u64 generation (the index's it
follows), blake2b-8 of those 16 bytes. Records, back to back: u32 body length, u32 body crc
(crc32 of the body, started from the generation's low 32 bits), u32 head crc (crc32 of the
length, body crc and generation as <IIQ), then the body: a msgpack array, its first item the
kind. CRC32, not a cryptographic digest: it guards against torn and flipped bytes (anyone who
can write the folder can write any bytes anyway), at a fraction of a digest's cost per record
(``benchmarks/pool_restart.py`` measures the journal's cost per commit).
"""

from __future__ import annotations

import os
import struct
import zlib
from hashlib import blake2b

import msgpack

MAGIC = b"TIERDJ01"
HEADER_BYTES = 24
_HEAD = struct.Struct("<III")  # length, body crc, head crc
_CHECKED = struct.Struct("<IIQ")  # what the head crc covers: length, body crc, generation
MAX_RECORD = 1 << 20


class Corrupt(ValueError):
    """The journal does not check: the restart must be cold."""


def header(generation: int) -> bytes:
    fields = MAGIC + struct.pack("<Q", generation)
    return fields + blake2b(fields, digest_size=8).digest()


def frame(body: bytes, generation: int) -> bytes:
    crc = zlib.crc32(body, generation & 0xFFFFFFFF)
    return _HEAD.pack(len(body), crc, zlib.crc32(_CHECKED.pack(len(body), crc, generation))) + body


class Journal:
    """The writer: records are buffered by ``add`` and written by ``flush`` in one call."""

    def __init__(self, path: str, generation: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.generation = generation
        self.records = 0  # since the index this journal follows
        self._buf = bytearray()
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def add(self, record: tuple) -> None:
        body = self._pack(record)
        if len(body) > MAX_RECORD:
            raise ValueError(f"a journal record of {len(body)} bytes (at most {MAX_RECORD})")
        self._buf += frame(body, self.generation)
        self.records += 1

    def flush(self) -> None:
        """Write what ``add`` buffered; raises OSError (ENOSPC on a full tmpfs)."""
        if not self._buf:
            return
        view = memoryview(self._buf)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        finally:
            view.release()
        self._buf.clear()

    def discard(self) -> None:
        self._buf.clear()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read(data: bytes) -> tuple[int, list[list], int]:
    """(generation, complete records, end offset of the last complete one) from a journal's
    bytes; a torn tail is left out; raises Corrupt."""
    if len(data) < HEADER_BYTES or data[:HEADER_BYTES] != header(int.from_bytes(data[8:16], "little")):
        raise Corrupt("journal header does not check")
    generation = int.from_bytes(data[8:16], "little")
    records, pos, end = [], HEADER_BYTES, len(data)
    while pos < end:
        if end - pos < _HEAD.size:
            break  # torn inside a head
        length, crc, head = _HEAD.unpack_from(data, pos)
        if head != zlib.crc32(_CHECKED.pack(length, crc, generation)) or length > MAX_RECORD:
            raise Corrupt(f"journal record at byte {pos}: its head does not check")
        body = data[pos + _HEAD.size : pos + _HEAD.size + length]
        if len(body) < length:
            break  # torn inside a body
        if zlib.crc32(body, generation & 0xFFFFFFFF) != crc:
            raise Corrupt(f"journal record at byte {pos}: its body does not check")
        try:
            rec = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError) as exc:  # msgpack's errors derive from ValueError
            raise Corrupt(f"journal record at byte {pos}: {exc}") from None
        if not isinstance(rec, list) or not rec:
            raise Corrupt(f"journal record at byte {pos} is not a record")
        records.append(rec)
        pos += _HEAD.size + length
    return generation, records, pos
