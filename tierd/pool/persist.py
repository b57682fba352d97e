"""Warm restart: the pool's index saved next to its segment files, a journal, and recovery.

Hazard: a restarted daemon that trusts the folder serves whatever bytes lie at the recorded
offsets. A stale index (other settings, other files, a crash in between), a flipped or torn
byte, or a slot reused after the index was written would hand out another object's bytes as a
hit, silently corrupting generation. So recovery trusts only what it checks: the index and
every journal record carry checksums; the settings that shape objects must be equal; every
segment file has its recorded size; slabs lie inside their segment without overlapping; every
object sits in a slot of its own size class; no (namespace, key, group, rank) is held twice.
Any failure removes every pool file and starts cold, with one line saying why.

On disk (normative; file names in tierd.pool.pooldir, the journal's framing in tierd.pool.journal):
- ``index``: 56-byte header: b"TIERDIX1", u32 FORMAT, u32 0, u64 body length, blake2b-256 of
  the first 24 bytes and the body; then the body, a msgpack map: generation (the journal that
  follows it), settings (format, pool_dir, align, segment_bytes, and "meta.<key>" for each
  key of the caller's meta; any difference is a cold start), segments
  ([nbytes] of segment-00000...), slabs ([segment, offset, slot_bytes, nslots]), namespaces
  ([bytes]), spans ([[group, shift, offset, ...]]), labels ([str]), objects ([ns index, key,
  span index, rank, nbytes, mask (bytes, little endian), label index, slab index, slot], least
  recently used first), levels ([object index, level] for each object above level 0 of the
  eviction policy's: tierd.pool.policy; absent from older indexes), policy (the policy's learned
  state, its ``state()``, or nil), extra (the caller's blob).
- ``journal`` records, applied in order on top of the index: ["G", segment, nbytes] grown;
  ["S", segment, offset, slot_bytes, nslots] slab carved; ["R", segment, offset] released;
  ["C", ns, key, [group, shift, offset, ...], rank, nbytes, mask, label, segment, slab offset,
  slot] committed; ["D", segment, slab offset, slot] dropped; ["X", extra]. Touches are not
  journaled: after a crash the LRU order and the levels are the index's, then commit order
  (objects committed since start at level 0).
- A checkpoint (``save``, a cold start, or the journal past COMPACT_MIN records and
  COMPACT_PER_OBJECT per object) flushes the journal, writes ``index.tmp`` (generation g + 1)
  and ``journal.tmp`` (its empty journal), then renames the index, then the journal. A journal
  of an older generation than the index is ignored (a kill between the renames: the index
  holds everything); a newer one is corruption.
"""

from __future__ import annotations

import heapq
import logging
import os
import time

import msgpack

from tierd.pool import journal
from tierd.pool.model import FORMAT, Cold, Model, decode_index, encode_index, flat_span, mask_bytes
from tierd.pool.pooldir import PoolDir
from tierd.pool.segments import SegmentSet

log = logging.getLogger("tierd.pool")

COMPACT_MIN = 1 << 18  # journal records before an automatic checkpoint, at least...
COMPACT_PER_OBJECT = 2  # ...and this many per live object (amortised O(1) per record)
KEEP = object()  # save(): keep the extra last given


class Persist:
    """The pool folder's bookkeeping: recovery at start, the journal, checkpoints."""

    def __init__(
        self,
        pool_dir: str,
        index_dir: str | None,
        align: int,
        segment_bytes: int,
        meta: dict | None,
        grow_bytes: int | None = None,
        ahead: bool = False,
    ):
        """``grow_bytes``: the pool's smallest segment grown on demand, ``ahead``: whether the next
        one is backed before it is needed (tierd.pool.segments); not settings a restart compares:
        recovered segments keep their recorded sizes."""
        self.folder = PoolDir(pool_dir, index_dir)
        self.align, self.segment_bytes, self.grow_bytes = align, segment_bytes, grow_bytes
        self.ahead = ahead
        settings = {
            "format": FORMAT,
            "pool_dir": self.folder.path,
            "align": align,
            "segment_bytes": segment_bytes,
        }
        settings.update((f"meta.{k}", v) for k, v in (meta or {}).items())
        self.settings = msgpack.unpackb(msgpack.packb(settings), raw=False)  # as stored, to compare
        self.generation = 0
        self.journal: journal.Journal | None = None
        self.extra = None
        self.error: str | None = None  # why the journal stopped (the next start is then cold)
        self.report: dict = {}
        self._resume: tuple[int, int] | None = None  # (generation, journal bytes) to append to

    # ---- start -----------------------------------------------------------------------------
    def recover(self, align: int, ceiling: int) -> Model | None:
        """The checked model of what the folder holds, or None after removing it (cold)."""
        try:
            model = self._read(align)
            self._check_files(model, ceiling)
        except Cold as exc:
            self.cold(str(exc))
            return None
        self.extra = model.extra
        objs = model.objects.values()
        self.report = {
            "warm": True,
            "reason": None,
            "objects": len(objs),
            "bytes": sum(r[4] for r in objs),
            "journal_records": model.replayed,
            "torn_bytes": model.torn_bytes,
            "seconds": 0.0,
            "pool_dir": self.folder.path,
        }
        return model

    def open(self, pool, ceiling: int, initial: int, pinner) -> None:
        """Build ``pool`` from what the folder holds, or cold; then journal every change and
        back ``initial`` bytes. ``report["seconds"]``: all of it but the initial backing."""
        t0 = time.perf_counter()
        model = self.recover(self.align, ceiling)
        segments = lambda restore: SegmentSet(
            ceiling,
            0,
            self.segment_bytes,
            self.align,
            pinner,
            self.folder,
            restore,
            self.grow_bytes,
            self.ahead,
        )
        try:
            pool.build(segments(model.segments if model else ()), model)
        except (OSError, ValueError) as exc:
            if model is None:
                raise
            self.cold(f"the recovered files could not be mapped: {exc}")
            pool.build(segments(()), None)
        self.start(pool)
        self.report["seconds"] = time.perf_counter() - t0
        pool.segments.watch = pool.slabs.watch = self
        pool.segments.grow_to(initial)
        self.flush(pool)

    def cold(self, reason: str) -> None:
        self.folder.wipe()
        self.extra, self._resume = None, None
        self.report = {
            "warm": False,
            "reason": reason,
            "objects": 0,
            "bytes": 0,
            "journal_records": 0,
            "torn_bytes": 0,
            "seconds": 0.0,
            "pool_dir": self.folder.path,
        }
        log.info("pool %s starts cold: %s", self.folder.path, reason)

    def start(self, pool) -> None:
        """After the pool is built: append to the recovered journal, or write a first index."""
        if self._resume is None:
            self.checkpoint(pool)
        else:
            gen, end = self._resume
            path = self.folder.file("journal")
            if end:
                os.truncate(path, end)  # drop a torn tail before appending
            else:  # no journal, or one older than the index: start this generation's
                self.folder.write_tmp("journal", journal.header(gen))
                self.folder.publish("journal")
            self.generation, self.journal = gen, journal.Journal(path, gen)
            self.journal.records = self.report["journal_records"]

    def _read(self, align: int) -> Model:
        data = self.folder.read("index")
        if data is None:
            raise Cold("no index (first start, or the last run could not write one)")
        body = decode_index(data)
        try:
            stored, gen = body["settings"], body["generation"]
        except (KeyError, TypeError):
            raise Cold("index body lacks settings/generation") from None
        if not isinstance(stored, dict):
            raise Cold("index settings unreadable")
        if stored != self.settings:
            raise Cold("settings changed: " + _diff(stored, self.settings))
        model = Model(align)
        model.load(body)
        jdata = self.folder.read("journal")
        try:
            jgen, records, end = journal.read(jdata) if jdata is not None else (gen - 1, [], 0)
        except journal.Corrupt as exc:
            raise Cold(str(exc)) from None
        if jgen > gen:
            raise Cold(f"journal generation {jgen} is newer than the index's {gen}")
        if jgen == gen:
            model.replay(records)
            model.torn_bytes = len(jdata) - end
        self._resume = (gen, end if jgen == gen else 0)
        return model

    def _check_files(self, model: Model, ceiling: int) -> None:
        for i, nbytes in enumerate(model.segments):
            have = self.folder.segment_size(i)
            if have != nbytes:
                raise Cold(
                    f"segment-{i:05d} {'is missing' if have is None else f'holds {have} bytes'}, "
                    f"the index says {nbytes}"
                )
        if sum(model.segments) > ceiling:
            raise Cold(f"the pool ceiling ({ceiling} bytes) is below the {sum(model.segments)} bytes held")
        self.folder.remove_segments_from(len(model.segments))  # created, never journaled: a crash

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint(self, pool, extra=KEEP) -> None:
        """Write a new index of the pool as it is and start its journal; raises OSError (the
        folder is then left so that the next start is cold)."""
        if extra is not KEEP:
            self.extra = extra
        try:
            if self.journal is not None:
                self.journal.flush()  # the old pair stays complete until the renames
            gen = self.generation + 1
            objs = heapq.merge(*pool.lru.values(), key=lambda o: o.tick)
            slabs = [s for c in pool.slabs.classes.values() for s in c.slabs]
            data = encode_index(
                gen, self.settings, pool.segments.segments, slabs, objs, self.extra, pool.policy.state()
            )
            self.folder.write_tmp("index", data)
            self.folder.write_tmp("journal", journal.header(gen))
            self.folder.publish("index")  # a kill here leaves an older journal: ignored, the index has it all
            self.folder.publish("journal")
            fresh = journal.Journal(self.folder.file("journal"), gen)
        except OSError as exc:
            self.disable(f"checkpoint failed: {exc}")
            raise
        if self.journal is not None:
            self.journal.close()
        self.generation, self.journal, self.error = gen, fresh, None

    def disable(self, reason: str) -> None:
        """Stop journaling; removing the index makes the next start cold, never stale."""
        self.folder.remove("index")
        self.folder.remove("journal")
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        self.error = reason
        log.error("pool %s: %s; the next start will be cold", self.folder.path, reason)

    def flush(self, pool) -> None:
        """Write buffered records: before any slot is handed out or object made visible."""
        j = self.journal
        if j is None:
            return
        try:
            j.flush()
        except OSError as exc:
            self.disable(f"journal write failed: {exc}")
            return
        if j.records > max(COMPACT_MIN, COMPACT_PER_OBJECT * pool.objects):
            try:
                self.checkpoint(pool)
            except OSError:
                pass  # disabled, logged

    def close(self) -> None:
        if self.journal is not None:
            try:
                self.journal.flush()
            except OSError as exc:
                self.disable(f"journal write failed: {exc}")
            if self.journal is not None:
                self.journal.close()
                self.journal = None
        self.folder.close()

    # ---- journal hooks (pool lock held) ------------------------------------------------------
    def grew(self, seg) -> None:
        self._add(("G", seg.index, seg.nbytes))

    def carved(self, slab) -> None:
        self._add(("S", slab.segment.index, slab.offset, slab.cls.slot_bytes, slab.nslots))

    def released(self, slab) -> None:
        self._add(("R", slab.segment.index, slab.offset))

    def committed(self, o) -> None:
        self._add(
            (
                "C",
                o.ns,
                o.key,
                flat_span(o.span),
                o.rank,
                o.nbytes,
                mask_bytes(o.mask),
                o.label,
                o.slab.segment.index,
                o.slab.offset,
                o.slot,
            )
        )

    def dropped(self, o) -> None:
        self._add(("D", o.slab.segment.index, o.slab.offset, o.slot))

    def noted(self, extra) -> None:
        self.extra = extra
        self._add(("X", extra))

    def _add(self, record: tuple) -> None:
        if self.journal is not None:
            self.journal.add(record)


def _diff(old: dict, new: dict) -> str:
    for k in sorted(set(old) | set(new), key=str):
        if old.get(k) != new.get(k):
            return f"{k} {old.get(k)!r} -> {new.get(k)!r}"
    return "?"
