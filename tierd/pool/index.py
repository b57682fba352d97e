"""Object index: (namespace, PAGE hash) -> chunk entry -> one object per (engine group, rank).

LOOKUP folds across groups and ranks: the answer is the longest boundary ``b`` (in chunks) such
that every rank has, committed, every block every group needs at ``b``: all chunks before ``b``
for full attention, the blocks inside the window for sliding groups, and the state of chunk
``b - 1`` for recurrent groups (tierd.pool.fold).
"""

from __future__ import annotations

from collections.abc import Sequence

from tierd.pool import fold
from tierd.pool.fold import ChunkEntry, part_key
from tierd.protocol.layout import GroupSpec


class Span(dict):
    """An object's engine group -> (bit shift of its blocks in ``mask``, byte offset of its part),
    one dict shared by every object of a layout, with ``blocks``: each group's blocks per chunk
    (None: not known, as for objects restored from disk or written by a caller that did not say).
    An object whose mask holds every block of a group's part is *whole* there: LOOKUP finds it in
    that part's whole column and reads nothing of it (tierd.pool.fold)."""

    __slots__ = ("blocks",)

    def __init__(self, items=(), blocks: dict[int, int] | None = None):
        super().__init__(items)
        self.blocks = blocks


def column_of(span: dict, group: int, mask: int) -> int:
    """The column of an object of ``span`` with ``mask`` in ``group``'s part: the group's blocks
    per chunk when the object holds them all, else 0 (a partial object, or one of a plain span
    dict, whose block counts nobody told)."""
    blocks = span.blocks if type(span) is Span else None
    n = blocks.get(group, 0) if blocks is not None else 0
    full = (1 << n) - 1
    return n if n and (mask >> span[group][0]) & full == full else 0


class Obj:
    """One stored object: a chunk's bytes of one engine group (or all groups) on one rank."""

    __slots__ = (
        "ns",
        "key",
        "span",
        "rank",
        "slab",
        "slot",
        "nbytes",
        "mask",
        "ready",
        "pins",
        "leases",
        "tick",
        "hits",
        "label",
    )

    def __init__(
        self,
        ns: bytes,
        key: bytes,
        span: Span,
        rank: int,
        nbytes: int,
        mask: int,
        label: str,
        slab=None,
        slot: int = -1,
    ):
        self.ns = ns
        self.key = key
        # engine group -> (bit shift of its blocks in ``mask``, byte offset of its part): a Span.
        # One group per object with --separate-object-groups, all of a rank's groups without.
        self.span = span
        self.rank = rank
        self.nbytes = nbytes
        self.mask = mask  # bit (shift + i) set: block i of that group's part holds data
        self.label = label  # "g<index>/<kind>" (or "all"), for per-group counts
        self.slab = slab  # its slot: set by the pool once allocated
        self.slot = slot
        self.ready = False  # committed: every byte written
        self.pins = 1  # in flight while being written; leases and reads add pins
        self.leases = 0  # of the pins, how many are leases (tierd.state.registry counts leased bytes by it)
        self.tick = 0  # the pool's clock at its last use (tierd.pool.policy)
        self.hits = 0  # eviction level: LOOKUPs that found it, capped (tierd.pool.policy)

    @property
    def offset(self) -> int:
        return self.slab.slot_offset(self.slot)

    @property
    def addr(self) -> int:
        """Where the object's bytes start in this process (its segment's mapping never moves)."""
        return self.slab.segment.addr + self.slab.slot_offset(self.slot)

    def view(self):
        return self.part(0, self.nbytes)

    def part(self, off: int, nbytes: int):
        """The ``nbytes`` of the object's bytes from ``off`` on (one group's part of it)."""
        at = self.slab.slot_offset(self.slot) + off
        return self.slab.segment.view[at : at + nbytes]


class Index:
    def __init__(self):
        self.spaces: dict[bytes, dict[bytes, ChunkEntry]] = {}
        # namespace -> (group, rank) -> column -> key -> committed Obj: what LOOKUP reads, one dict
        # lookup a part (no chunk entry, no object being written in between). The column is
        # column_of: the group's blocks per chunk for objects holding all of them (whole), 0 for
        # the rest; a LOOKUP takes a whole column's objects as complete without reading them.
        self.columns: dict[bytes, dict[tuple[int, int], dict[int, dict[bytes, Obj]]]] = {}

    def get(self, ns: bytes, key: bytes) -> ChunkEntry | None:
        space = self.spaces.get(ns)
        return None if space is None else space.get(key)

    def find(self, ns: bytes, key: bytes, group: int, rank: int) -> Obj | None:
        entry = self.get(ns, key)
        return None if entry is None else entry.get((group, rank))

    def insert(self, obj: Obj) -> None:
        space = self.spaces.get(obj.ns)
        if space is None:
            space = self.spaces[obj.ns] = {}
        entry = space.get(obj.key)
        if entry is None:
            entry = space[obj.key] = {}
        for group in obj.span:
            assert (group, obj.rank) not in entry
            entry[part_key(group, obj.rank)] = obj
        if obj.ready:
            self.committed(obj)

    def insert_fresh(self, ns: bytes, rank: int, made: Sequence[Sequence[Obj]]) -> None:
        """``insert`` for objects being written (not ready) of keys ``ns`` does not hold yet: per
        shape a list of objects of ``rank``, one per key, the same keys in the same order."""
        space = self.spaces.get(ns)
        if space is None:
            space = self.spaces[ns] = {}
        parts = [[part_key(group, rank) for group in objs[0].span] for objs in made if objs]
        for objs in zip(*made):
            space[objs[0].key] = {pk: obj for obj, pks in zip(objs, parts) for pk in pks}

    def committed(self, obj: Obj) -> None:
        """An inserted object became ready: LOOKUP sees it from now on."""
        columns = self.columns.get(obj.ns)
        if columns is None:
            columns = self.columns[obj.ns] = {}
        span = obj.span
        for group in span:
            pk = part_key(group, obj.rank)
            part = columns.get(pk)
            if part is None:
                part = columns[pk] = {}
            w = column_of(span, group, obj.mask)
            column = part.get(w)
            if column is None:
                column = part[w] = {}
            column[obj.key] = obj

    def remove(self, obj: Obj) -> None:
        if obj.ready:
            columns, span = self.columns[obj.ns], obj.span
            for group in span:
                part = columns[group, obj.rank]
                w = column_of(span, group, obj.mask)
                column = part[w]
                del column[obj.key]
                if not column:
                    del part[w]
                    if not part:
                        del columns[group, obj.rank]
            if not columns:
                del self.columns[obj.ns]
        space = self.spaces[obj.ns]
        entry = space[obj.key]
        for group in obj.span:
            del entry[(group, obj.rank)]
        if not entry:
            del space[obj.key]
            if not space:
                del self.spaces[obj.ns]

    def lookup(
        self,
        ns: bytes,
        keys: Sequence[bytes],
        specs: Sequence[GroupSpec],
        chunk_tokens: int,
        ranks: Sequence[int],
    ) -> tuple[int, list[Obj]]:
        """Longest servable boundary, and the objects a retrieve at that boundary reads
        (tierd.pool.fold: linear in the keys)."""
        space = self.spaces.get(ns)
        if space is None or not keys:
            return 0, []
        columns = fold.column_parts(self.columns.get(ns, fold.EMPTY))
        return fold.lookup(space, keys, specs, chunk_tokens, ranks, columns)
