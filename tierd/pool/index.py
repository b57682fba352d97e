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
        "label",
    )

    def __init__(
        self,
        ns: bytes,
        key: bytes,
        span: dict[int, tuple[int, int]],
        rank: int,
        nbytes: int,
        mask: int,
        label: str,
    ):
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
        self.leases = 0  # of the pins, how many are leases (tierd.registry counts leased bytes by it)
        self.tick = 0

    @property
    def offset(self) -> int:
        return self.slab.slot_offset(self.slot)

    @property
    def addr(self) -> int:
        """Where the object's bytes start in this process (its segment's mapping never moves)."""
        return self.slab.segment.addr + self.slab.slot_offset(self.slot)

    def view(self):
        off = self.offset
        return self.slab.segment.view[off : off + self.nbytes]


class Index:
    def __init__(self):
        self.spaces: dict[bytes, dict[bytes, ChunkEntry]] = {}
        # namespace -> (group, rank) -> key -> committed Obj: the columns LOOKUP reads, one dict
        # lookup a part (no chunk entry, no object being written in between)
        self.columns: dict[bytes, dict[tuple[int, int], dict[bytes, Obj]]] = {}

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

    def committed(self, obj: Obj) -> None:
        """An inserted object became ready: LOOKUP sees it from now on."""
        columns = self.columns.get(obj.ns)
        if columns is None:
            columns = self.columns[obj.ns] = {}
        for group in obj.span:
            pk = part_key(group, obj.rank)
            column = columns.get(pk)
            if column is None:
                column = columns[pk] = {}
            column[obj.key] = obj

    def remove(self, obj: Obj) -> None:
        if obj.ready:
            columns = self.columns[obj.ns]
            for group in obj.span:
                column = columns[group, obj.rank]
                del column[obj.key]
                if not column:
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
