"""What a restart would serve: the index and journal replayed into plain data, every step checked.

Hazard: a record that does not fit the state it is applied to (a slot already taken, a slab
outside its segment or over another, an object in a slot of another size, a key held twice, a
drop of nothing) means the files do not describe the bytes; serving from them could hand out
wrong bytes. Every such record raises Cold, and nothing is mapped or served. No memory is
touched here: the pool maps the files and places the objects only once the model checks.
"""

from __future__ import annotations

import bisect
import struct
from hashlib import blake2b

import msgpack

FORMAT = 2  # 2: slabs are buddy blocks of their segment (tierd.pool.slabs); an older index starts cold
MAGIC = b"TIERDIX1"
_HEAD = struct.Struct("<8sIIQ")  # magic, FORMAT, 0, body length; then blake2b-256, then the body


class Cold(Exception):
    """The folder cannot be trusted: start cold, for this reason."""


def flat_span(span: dict) -> list[int]:
    return [x for g, (shift, off) in span.items() for x in (g, shift, off)]


def mask_bytes(mask: int) -> bytes:
    return mask.to_bytes((mask.bit_length() + 7) // 8, "little")


def encode_index(generation: int, settings: dict, segments, slabs, objs, extra, policy=None) -> bytes:
    """``objs``: committed objects, least recently used first. ``policy``: the eviction policy's
    learned state (tierd.pool.policy ``state``), kept beside the objects' levels."""
    slab_ids = {id(s): i for i, s in enumerate(slabs)}
    nss, spans, labels, rows, levels = {}, {}, {}, [], []
    for o in objs:
        if o.hits:
            levels.append((len(rows), o.hits))
        span = spans.setdefault(id(o.span), (len(spans), o.span))[0]
        rows.append(
            (
                nss.setdefault(o.ns, len(nss)),
                o.key,
                span,
                o.rank,
                o.nbytes,
                mask_bytes(o.mask),
                labels.setdefault(o.label, len(labels)),
                slab_ids[id(o.slab)],
                o.slot,
            )
        )
    body = msgpack.packb(
        {
            "generation": generation,
            "settings": settings,
            "segments": [s.nbytes for s in segments],
            "slabs": [(s.segment.index, s.offset, s.cls.slot_bytes, s.nslots) for s in slabs],
            "namespaces": list(nss),
            "spans": [flat_span(sp) for _, sp in spans.values()],
            "labels": list(labels),
            "objects": rows,
            "levels": levels,
            "policy": policy,
            "extra": extra,
        },
        use_bin_type=True,
    )
    head = _HEAD.pack(MAGIC, FORMAT, 0, len(body))
    return head + blake2b(head + body, digest_size=32).digest() + body


def decode_index(data: bytes) -> dict:
    if len(data) < _HEAD.size + 32:
        raise Cold(f"index truncated ({len(data)} bytes)")
    magic, fmt, _, length = _HEAD.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT:
        raise Cold(f"index format {magic!r}/{fmt}, this tierd reads {MAGIC!r}/{FORMAT}")
    if len(data) != _HEAD.size + 32 + length:
        raise Cold(f"index holds {len(data)} bytes, its header says {_HEAD.size + 32 + length}")
    body = data[_HEAD.size + 32 :]
    if blake2b(data[: _HEAD.size] + body, digest_size=32).digest() != data[_HEAD.size : _HEAD.size + 32]:
        raise Cold("index checksum mismatch")
    try:
        return msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError) as exc:
        raise Cold(f"index body unreadable: {exc}") from None


def _is_int(x, low: int = 0) -> bool:
    return type(x) is int and x >= low


class Model:
    def __init__(self, align: int):
        self.align = align
        self.segments: list[int] = []  # nbytes of segment i
        self.slabs: dict[tuple[int, int], list] = {}  # (segment, offset) -> [slot_bytes, nslots, live count]
        self._extents: list[list[tuple[int, int]]] = []  # per segment: sorted (offset, end) of its slabs
        # (segment, slab offset, slot) -> (ns, key, span items, rank, nbytes, mask, label), oldest first
        self.objects: dict[tuple[int, int, int], tuple] = {}
        # (segment, slab offset, slot) -> the object's eviction level, where above 0 (an index's
        # "levels"; objects committed after it start at 0), and the policy's learned state
        self.levels: dict[tuple[int, int, int], int] = {}
        self.policy: dict | None = None
        self._parts: set[tuple] = set()  # (ns, key, group, rank) held
        self._shapes: set[tuple] = set()  # (span, nbytes, slot bytes) found consistent
        self.extra = None
        self.replayed = 0  # journal records applied
        self.torn_bytes = 0  # a torn tail ignored

    # ---- building ------------------------------------------------------------------------
    def load(self, body: dict) -> None:
        """The index's state, through the same checks as journal records."""
        try:
            for i, nbytes in enumerate(body["segments"]):
                self.grow(i, nbytes)
            slabs = [tuple(s) for s in body["slabs"]]
            for s in slabs:
                self.carve(*s)
            nss, labels = body["namespaces"], body["labels"]
            spans = [self._span(f) for f in body["spans"]]
            wheres = []
            for ns, key, span, rank, nbytes, mask, label, slab, slot in body["objects"]:
                seg, off = slabs[slab][:2]
                self._commit(nss[ns], key, spans[span], rank, nbytes, mask, labels[label], seg, off, slot)
                wheres.append((seg, off, slot))
            self.extra = body["extra"]
            self._levels(body.get("levels"), wheres)  # (absent from an index of an older tierd)
            policy = body.get("policy")
            self.policy = policy if isinstance(policy, dict) else None
        except Cold:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise Cold(f"index body malformed: {type(exc).__name__}: {exc}") from None

    def replay(self, records: list[list]) -> None:
        verbs = {
            "G": self.grow,
            "S": self.carve,
            "R": self.release,
            "C": self.commit,
            "D": self.drop,
            "X": self.note,
        }
        for i, rec in enumerate(records):
            try:
                verbs[rec[0]](*rec[1:])
            except Cold as exc:
                raise Cold(f"journal record {i}: {exc}") from None
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise Cold(f"journal record {i} malformed: {type(exc).__name__}: {exc}") from None
            self.replayed += 1

    # ---- verbs (one per record kind) -----------------------------------------------------------
    def grow(self, seg, nbytes) -> None:
        if seg != len(self.segments) or not _is_int(nbytes, 1) or nbytes % self.align:
            raise Cold(
                f"segment {seg} of {nbytes} bytes does not follow the {len(self.segments)} before it "
                f"in multiples of {self.align}"
            )
        self.segments.append(nbytes)
        self._extents.append([])

    def carve(self, seg, off, slot_bytes, nslots) -> None:
        if (
            not (
                _is_int(seg)
                and seg < len(self.segments)
                and _is_int(off)
                and _is_int(slot_bytes, 1)
                and _is_int(nslots, 1)
            )
            or off % self.align
            or slot_bytes % self.align
        ):
            raise Cold(f"slab {seg}/{off}/{slot_bytes}x{nslots} is not an aligned slab of a known segment")
        end = off + slot_bytes * nslots
        exts = self._extents[seg]
        i = bisect.bisect(exts, (off, end))
        if end > self.segments[seg] or (i and exts[i - 1][1] > off) or (i < len(exts) and exts[i][0] < end):
            raise Cold(f"slab {seg}/{off}..{end} overlaps another or its segment's end")
        exts.insert(i, (off, end))
        self.slabs[seg, off] = [slot_bytes, nslots, 0]

    def release(self, seg, off) -> None:
        slab = self.slabs.get((seg, off))
        if slab is None or slab[2]:
            raise Cold(f"release of slab {seg}/{off}: {'unknown' if slab is None else 'it holds objects'}")
        del self.slabs[seg, off]
        exts = self._extents[seg]
        exts.pop(bisect.bisect_left(exts, (off,)))

    def commit(self, ns, key, flat, rank, nbytes, mask, label, seg, off, slot) -> None:
        self._commit(ns, key, self._span(flat), rank, nbytes, mask, label, seg, off, slot)

    def drop(self, seg, off, slot) -> None:
        rec = self.objects.pop((seg, off, slot), None)
        if rec is None:
            raise Cold(f"drop of an empty slot {seg}/{off}/{slot}")
        self.slabs[seg, off][2] -= 1
        self.levels.pop((seg, off, slot), None)
        ns, key, span, rank = rec[:4]
        for g, _ in span:
            self._parts.discard((ns, key, g, rank))

    def note(self, extra) -> None:
        self.extra = extra

    # ---- checks ------------------------------------------------------------------------------
    def _levels(self, pairs, wheres: list) -> None:
        """Levels only order evictions (they never decide which bytes are served): a pair that
        does not fit is left out, not a reason to start cold."""
        if not isinstance(pairs, list):
            return
        for pair in pairs:
            if isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0]) and _is_int(pair[1], 1):
                if pair[0] < len(wheres):
                    self.levels[wheres[pair[0]]] = pair[1]

    def _span(self, flat) -> tuple:
        if not isinstance(flat, list) or not flat or len(flat) % 3 or not all(_is_int(x) for x in flat):
            raise Cold(f"span {flat!r} is not [group, shift, offset, ...]")
        items = tuple((flat[i], (flat[i + 1], flat[i + 2])) for i in range(0, len(flat), 3))
        if len({g for g, _ in items}) != len(items):
            raise Cold(f"span {flat!r} names a group twice")
        return items

    def _commit(self, ns, key, span, rank, nbytes, mask, label, seg, off, slot) -> None:
        where = (seg, off, slot)
        slab = self.slabs.get((seg, off))
        if slab is None or type(slot) is not int or not 0 <= slot < slab[1] or where in self.objects:
            raise Cold(f"commit into slot {seg}/{off}/{slot}: no such free slot")
        if (span, nbytes, slab[0]) not in self._shapes:  # checked once per distinct shape
            self._shape(span, nbytes, slab[0])
        if (
            type(ns) is not bytes
            or type(key) is not bytes
            or type(rank) is not int
            or rank < 0
            or type(mask) is not bytes
            or type(label) is not str
        ):
            raise Cold(f"commit into slot {seg}/{off}/{slot} has fields of the wrong type")
        parts = self._parts
        for g, _ in span:
            if (ns, key, g, rank) in parts:
                raise Cold(f"key {key.hex()[:16]} group {g} rank {rank} is held twice")
        for g, _ in span:
            parts.add((ns, key, g, rank))
        slab[2] += 1
        self.objects[where] = (ns, key, span, rank, nbytes, int.from_bytes(mask, "little"), label)

    def _shape(self, span: tuple, nbytes, slot_bytes: int) -> None:
        if not (_is_int(nbytes, 1) and -(-nbytes // self.align) * self.align == slot_bytes):
            raise Cold(f"an object of {nbytes!r} bytes in a slot of {slot_bytes}")
        if not all(o < nbytes for _, (_, o) in span):
            raise Cold(f"span {span!r} reaches past the object's {nbytes} bytes")
        self._shapes.add((span, nbytes, slot_bytes))
