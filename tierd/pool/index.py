"""Object index: (namespace, PAGE hash) -> chunk entry -> one object per (engine group, rank).

LOOKUP folds across groups and ranks: the answer is the longest boundary ``b`` (in chunks) such
that every rank has, committed, every block every group needs at ``b``: all chunks before ``b``
for full attention, the blocks inside the window for sliding groups, and the state of chunk
``b - 1`` for recurrent groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierd.protocol.layout import GroupKind, GroupSpec


class Obj:
    """One stored object: a chunk's bytes of one engine group (or all groups) on one rank."""

    __slots__ = ("ns", "key", "span", "rank", "slab", "slot", "nbytes", "mask", "ready", "pins", "tick", "label")

    def __init__(self, ns: bytes, key: bytes, span: dict[int, tuple[int, int]], rank: int, nbytes: int, mask: int, label: str):
        self.ns = ns
        self.key = key
        # engine group -> (bit shift of its blocks in ``mask``, byte offset of its part). One
        # group per object with --separate-object-groups, all of a rank's groups without.
        self.span = span
        self.rank = rank
        self.nbytes = nbytes
        self.mask = mask  # bit (shift + i) set: block i of that group's part holds data
        self.label = label  # "g<index>/<kind>" (or "all"), for per-group counts
        self.slab = None
        self.slot = -1
        self.ready = False  # committed: every byte written
        self.pins = 1  # in flight while being written; leases and reads add pins
        self.tick = 0

    @property
    def offset(self) -> int:
        return self.slab.slot_offset(self.slot)

    def view(self):
        off = self.offset
        return self.slab.segment.view[off : off + self.nbytes]


# A chunk entry is a plain dict: (engine group, rank) -> Obj (one object may fill several keys).
ChunkEntry = dict

_PART_KEYS: dict[tuple[int, int], tuple[int, int]] = {}


def part_key(group: int, rank: int) -> tuple[int, int]:
    """The shared (group, rank) tuple: a million entries do not each need their own."""
    key = (group, rank)
    return _PART_KEYS.setdefault(key, key)


def _has(entry: ChunkEntry | None, group: int, ranks: Sequence[int], need: int) -> bool:
    if entry is None:
        return False
    parts = entry
    for r in ranks:
        o = parts.get((group, r))
        if o is None or not o.ready or (o.mask >> o.span[group][0]) & need != need:
            return False
    return True


class Index:
    def __init__(self):
        self.spaces: dict[bytes, dict[bytes, ChunkEntry]] = {}

    def get(self, ns: bytes, key: bytes) -> ChunkEntry | None:
        space = self.spaces.get(ns)
        return None if space is None else space.get(key)

    def find(self, ns: bytes, key: bytes, group: int, rank: int) -> Obj | None:
        entry = self.get(ns, key)
        return None if entry is None else entry.get((group, rank))

    def insert(self, obj: Obj) -> None:
        space = self.spaces.setdefault(obj.ns, {})
        entry = space.get(obj.key)
        if entry is None:
            entry = space[obj.key] = {}
        for group in obj.span:
            assert (group, obj.rank) not in entry
            entry[part_key(group, obj.rank)] = obj

    def remove(self, obj: Obj) -> None:
        space = self.spaces[obj.ns]
        entry = space[obj.key]
        for group in obj.span:
            del entry[(group, obj.rank)]
        if not entry:
            del space[obj.key]
            if not space:
                del self.spaces[obj.ns]

    def lookup(
        self, ns: bytes, keys: Sequence[bytes], specs: Sequence[GroupSpec], chunk_tokens: int, ranks: Sequence[int]
    ) -> tuple[int, list[Obj]]:
        """Longest servable boundary, and the objects a retrieve at that boundary reads."""
        space = self.spaces.get(ns)
        if space is None or not keys:
            return 0, []
        # full-attention parts, checked for every chunk: ((group, rank) key, group, needed mask)
        full = [((gi, r), gi, (1 << s.blocks_per_chunk(chunk_tokens)) - 1)
                for gi, s in enumerate(specs) if s.kind is GroupKind.FULL for r in ranks]
        other = [(gi, s) for gi, s in enumerate(specs) if s.kind is not GroupKind.FULL]
        entries: list[ChunkEntry | None] = []
        objs: list[Obj] = []  # what a retrieve reads, in chunk order
        if full:
            get = space.get
            for key in keys:
                entry = get(key)
                if entry is None:
                    break
                parts = entry
                for part, gi, need in full:
                    o = parts.get(part)
                    if o is None or not o.ready or (o.mask >> o.span[gi][0]) & need != need:
                        break
                    objs.append(o)
                else:
                    entries.append(entry)
                    continue
                del objs[len(entries) * len(full):]  # the partly matched chunk's parts
                break
        else:
            entries = [space.get(key) for key in keys]
        boundary = len(entries)
        while boundary > 0 and not self._others_ok(entries, other, boundary, chunk_tokens, ranks):
            boundary -= 1
        if boundary == 0:
            return 0, []
        del objs[boundary * len(full):]
        for gi, spec in other:
            for j in range(max(0, boundary - spec.lookback_chunks(chunk_tokens)), boundary):
                if spec.needed_mask(j, boundary, chunk_tokens):
                    objs.extend(entries[j][(gi, r)] for r in ranks)
        if any(len(o.span) > 1 for o in objs[: len(full) + 1]):  # combined objects: once each
            objs = list(dict.fromkeys(objs))
        return boundary, objs

    @staticmethod
    def _others_ok(entries, other, boundary: int, chunk_tokens: int, ranks) -> bool:
        for gi, spec in other:
            first = max(0, boundary - spec.lookback_chunks(chunk_tokens))
            for j in range(first, boundary):
                need = spec.needed_mask(j, boundary, chunk_tokens)
                if need and not _has(entries[j], gi, ranks, need):
                    return False
        return True
