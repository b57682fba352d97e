"""STORE and RETRIEVE planning: from a typed request, a rank's layout and the pool, decide per
chunk what happens, which objects are written or read, and which blocks are copied where.

These are functions of (chunks, geometry, pool): they allocate and look up in the pool, never
touch engine memory and never block, so tests pin every decision with exact ids without a
daemon. The copies themselves run later on a transfer lane (``tierd.transfer``).

Hazards handled here:
- Block ids come from the client: each is checked against the layout (null or in range) before
  anything is allocated, so a copy can never address memory outside a registered tensor.
- A chunk's groups are stored all or none: a chunk that cannot get room for one of its objects
  releases the others (``rejected``), and in a layout with a full-attention group nothing past
  a rejected chunk is stored (LOOKUP could never reach it; keep the room).
- A retrieve of blocks the pool does not hold reports exactly those block ids as failed and
  still restores the ones it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from tierd.pool.index import Obj, Span
from tierd.pool.pool import EXISTS, Pool
from tierd.protocol import MAX_REQUEST_PARTS
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import GroupKind, PageLayout
from tierd.protocol.messages import Chunk
from tierd.transfer.items import CopyItem, split_nulls

# Bump with any change to the bytes of an object: the order of groups, layers, blocks and runs in
# it, its size or its mask bits. A warm restart (--pool-dir) compares it and starts cold on a change.
OBJECT_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class ObjectShape:
    """One object a chunk writes: the groups it holds as (group, mask shift, byte offset).
    ``present``: those parts whose group has blocks in a chunk; ``whole_mask``: the mask of a
    chunk that names every block of every group (Geometry fills both)."""

    parts: tuple[tuple[int, int, int], ...]
    nbytes: int
    label: str
    present: tuple[tuple[int, int, int], ...] = ()
    whole_mask: int = 0

    @property
    def span(self) -> dict[int, tuple[int, int]]:
        return {g: (shift, off) for g, shift, off in self.parts}


class Geometry:
    """Per registered layout, what every STORE/RETRIEVE of it needs, computed once."""

    def __init__(self, layout: PageLayout, separate_objects: bool, null: int):
        groups, chunk_tokens = layout.groups, layout.chunk_tokens
        self.null = null
        self.blocks_per_chunk = [g.spec.blocks_per_chunk(chunk_tokens) for g in groups]
        self.group_bytes = [g.object_bytes(chunk_tokens) for g in groups]  # one chunk of one group
        self.num_blocks = [g.num_blocks for g in groups]
        self.full_masks = [(1 << n) - 1 for n in self.blocks_per_chunk]
        self.positions = [np.arange(n, dtype=np.int64) for n in self.blocks_per_chunk]
        for p in self.positions:
            p.flags.writeable = False
        self.has_full = any(g.kind is GroupKind.FULL for g in groups)
        # a chunk in a staging buffer (cuda): its groups' parts back to back, the combined object layout
        self.group_offsets = [sum(self.group_bytes[:g]) for g in range(len(groups))]
        self.chunk_bytes = sum(self.group_bytes)
        self.staging_bytes = layout.staging.nbytes if layout.staging is not None else 0
        if separate_objects:
            self.objects = [
                ObjectShape(((g, 0, 0),), self.group_bytes[g], f"g{g}/{groups[g].kind.value}")
                for g in range(len(groups))
            ]
        else:
            parts, shift, off = [], 0, 0
            for g in range(len(groups)):
                parts.append((g, shift, off))
                shift += self.blocks_per_chunk[g]
                off += self.group_bytes[g]
            self.objects = [ObjectShape(tuple(parts), off, "all")]
        self.objects = [
            replace(
                o,
                present=present,
                whole_mask=sum(self.full_masks[g] << shift for g, shift, _ in present),
            )
            for o in self.objects
            for present in [tuple(p for p in o.parts if self.blocks_per_chunk[p[0]])]
        ]
        # shared by every object of this layout; with block counts, so LOOKUP knows a whole object
        self.spans = [
            Span(o.span, {g: self.blocks_per_chunk[g] for g, _, _ in o.parts}) for o in self.objects
        ]

    def check_staging(self, staged_at: int | None, n_chunks: int) -> None:
        """A staged layout (cuda) names where its chunks lie in staging, and they fit; others name nothing."""
        if not self.staging_bytes:
            if staged_at is not None:
                raise _bad("staged_at", "only a cuda instance with a staging buffer copies through staging")
            return
        if staged_at is None:
            raise _bad(
                "staged_at", "this instance copies through its staging buffer: say where the chunks lie"
            )
        end = staged_at + n_chunks * self.chunk_bytes
        if end > self.staging_bytes:
            raise _bad(
                "staged_at",
                f"{n_chunks} chunks of {self.chunk_bytes} bytes from {staged_at} end at {end}, "
                f"past the staging buffer's {self.staging_bytes} bytes",
            )

    def staged(self, staged_at: int | None, chunk: int, group: int) -> int:
        return -1 if staged_at is None else staged_at + chunk * self.chunk_bytes + self.group_offsets[group]

    def check(self, chunks: list[Chunk]) -> list[np.ndarray]:
        """Every chunk names one block list per group, of the group's length, each id null or in
        range. Returns, per group, the chunks' ids as one (chunks, blocks per chunk) int64 array
        (what ``plan_store``/``plan_retrieve`` take as ``blocks``). Raises BAD_REQUEST naming the
        first bad id."""
        ngroups = len(self.blocks_per_chunk)
        if len(chunks) * ngroups > MAX_REQUEST_PARTS:
            raise _bad(
                "chunks",
                f"{len(chunks)} chunks x {ngroups} groups is more than {MAX_REQUEST_PARTS} parts "
                "in one request: split it (tierd_client does)",
            )
        try:
            blocks = self.block_arrays(chunks)
        except (ValueError, OverflowError):  # ragged, a wrong count or an id past int64
            blocks = None
        if blocks is not None:
            null = self.null
            for a, limit in zip(blocks, self.num_blocks):
                if a.size and (int(a.min()) < 0 or int(a.max()) >= limit):
                    if bool(((a != null) & ((a < 0) | (a >= limit))).any()):
                        blocks = None  # a bad id: the walk below names the first one
                        break
            if blocks is not None:
                return blocks
        self._name_first_bad(chunks)
        raise AssertionError("block_arrays refused what the walk accepts")  # pragma: no cover

    def block_arrays(self, chunks: list[Chunk]) -> list[np.ndarray]:
        """Per group, the chunks' block ids as one (chunks, blocks per chunk) int64 array, unchecked
        beyond its shape (ValueError when a chunk names another count of groups or of ids)."""
        ngroups = len(self.blocks_per_chunk)
        if any(len(c.blocks) != ngroups for c in chunks):
            raise ValueError("a chunk names another count of groups")
        out = []
        for g, n in enumerate(self.blocks_per_chunk):
            a = (
                np.array([c.blocks[g] for c in chunks], dtype=np.int64)
                if chunks
                else np.empty((0, n), np.int64)
            )
            if a.shape != (len(chunks), n):
                raise ValueError("a chunk names another count of block ids")
            out.append(a)
        return out

    def _name_first_bad(self, chunks: list[Chunk]) -> None:
        """Raise BAD_REQUEST naming the first bad group count, id count or id of ``chunks``."""
        ngroups, null = len(self.blocks_per_chunk), self.null
        for i, c in enumerate(chunks):
            if len(c.blocks) != ngroups:
                raise _bad(f"chunks[{i}].blocks", f"{len(c.blocks)} groups, the layout has {ngroups}")
            for g, ids in enumerate(c.blocks):
                n, limit = self.blocks_per_chunk[g], self.num_blocks[g]
                if len(ids) != n:
                    raise _bad(
                        f"chunks[{i}].blocks[{g}]", f"{len(ids)} block ids, the group has {n} per chunk"
                    )
                for j, b in enumerate(ids):
                    if b != null and not 0 <= b < limit:
                        raise _bad(
                            f"chunks[{i}].blocks[{g}][{j}]",
                            f"block id {b} is neither null ({null}) nor in [0, {limit})",
                        )


def _bad(path: str, what: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, f"{path}: {what}")


@dataclass
class CopyPlan:
    """What a STORE or RETRIEVE does: results per chunk, objects it writes or reads, copies per group."""

    results: list = field(default_factory=list)  # STORE: "stored"|"exists"|"empty"|"rejected"; RETRIEVE: bool
    objs: list[Obj] = field(default_factory=list)
    copies: dict[int, list[CopyItem]] = field(default_factory=dict)  # group -> items
    failed: list[tuple[int, int]] = field(default_factory=list)  # RETRIEVE: (group, block id) not restored
    nbytes: int = 0

    def add(self, group: int, item: CopyItem, nbytes: int) -> None:
        self.copies.setdefault(group, []).append(item)
        self.nbytes += nbytes


def plan_store(
    geo: Geometry,
    chunks: list[Chunk],
    pool: Pool,
    ns: bytes,
    rank: int,
    staged_at: int | None = None,
    blocks: list[np.ndarray] | None = None,
) -> CopyPlan:
    """Reserve room for the chunks' objects; the plan's objects are pinned and not yet visible
    (``pool.commit`` once copied, ``pool.abort`` otherwise). ``blocks``: ``geo.check(chunks)``'s
    arrays, when the caller has them."""
    if blocks is None:
        blocks = geo.block_arrays(chunks)
    plan = CopyPlan()
    # chunks without a null id in any group (the common case) take the short path below
    clean = np.ones(len(chunks), dtype=bool)
    for a in blocks:
        if a.shape[1]:
            clean &= ~(a == geo.null).any(axis=1)
    holed = False  # a chunk was rejected (a flag: a scan of the results per chunk made this quadratic)
    results, whole = plan.results, clean.tolist()
    # one object per chunk (the default layout): a run of whole chunks is allocated in one call
    single = geo.objects[0] if len(geo.objects) == 1 and geo.objects[0].present else None
    n, i = len(chunks), 0
    with pool.writes() as w:
        while i < n:
            if holed:
                results.append("rejected")  # past a hole LOOKUP never reaches: keep the room
                i += 1
                continue
            if whole[i] and single is not None:
                j = i + 1
                while j < n and whole[j]:
                    j += 1
                keys = [c.key for c in chunks[i:j]]
                got = w.begin_many(
                    ns, keys, geo.spans[0], rank, single.nbytes, single.whole_mask, single.label
                )
                for k, obj in enumerate(got, i):
                    if obj is EXISTS:
                        results.append("exists")
                    elif obj is None:
                        results.append("rejected")
                        holed = geo.has_full
                    else:
                        _add_whole(geo, obj, single, k, blocks, staged_at, plan)
                        results.append("stored")
                i += len(got)
                continue
            if whole[i]:
                status = _store_whole(geo, w, chunks[i].key, i, blocks, ns, rank, staged_at, plan)
            else:
                status = _store_with_nulls(geo, w, chunks[i], i, ns, rank, staged_at, plan)
            if status == "rejected":
                holed = geo.has_full
            results.append(status)
            i += 1
    return plan


def _store_whole(geo, w, key, i, blocks, ns, rank, staged_at, plan) -> str:
    """A chunk holding every block of every group: each object's mask is its shape's whole mask."""
    new = []
    for shape, span in zip(geo.objects, geo.spans):
        if not shape.present:
            continue
        obj = w.begin(ns, key, span, rank, shape.nbytes, shape.whole_mask, shape.label)
        if obj is EXISTS:
            continue
        if obj is None:
            w.abort([o for o, _ in new])  # all groups of a chunk or none
            return "rejected"
        new.append((obj, shape))
    for obj, shape in new:
        _add_whole(geo, obj, shape, i, blocks, staged_at, plan)
    if new:
        return "stored"
    return "exists" if any(shape.present for shape in geo.objects) else "empty"


def _add_whole(geo, obj: Obj, shape: ObjectShape, i: int, blocks, staged_at, plan: CopyPlan) -> None:
    """Plan the copy of a whole chunk ``i`` into its new object ``obj``: every part, every block."""
    plan.objs.append(obj)
    view = obj.view()
    for g, _, off in shape.present:
        gbytes = geo.group_bytes[g]
        item = CopyItem(
            blocks[g][i],
            geo.positions[g],
            geo.blocks_per_chunk[g],
            view[off : off + gbytes],
            geo.staged(staged_at, i, g),
        )
        plan.add(g, item, gbytes)


def _store_with_nulls(geo, w, c: Chunk, i, ns, rank, staged_at, plan) -> str:
    """A chunk with null ids: each object's mask holds the blocks it names."""
    split = [split_nulls(ids, geo.null, geo.positions[g]) for g, ids in enumerate(c.blocks)]
    if not any(len(ids) for ids, _ in split):
        return "empty"  # an all-null chunk is not stored
    new: list[Obj] = []
    items: list[tuple[int, CopyItem, int]] = []
    status = "exists"
    for shape, span in zip(geo.objects, geo.spans):
        present = [(g, shift, off) for g, shift, off in shape.parts if len(split[g][0])]
        if not present:
            continue
        mask = 0
        for g, shift, _ in present:
            ids, pos = split[g]
            if len(ids) == geo.blocks_per_chunk[g]:
                mask |= geo.full_masks[g] << shift
            else:
                for p in pos.tolist():
                    mask |= 1 << (shift + p)
        obj = w.begin(ns, c.key, span, rank, shape.nbytes, mask, shape.label)
        if obj is EXISTS:
            continue
        if obj is None:
            w.abort(new)  # all groups of a chunk or none
            return "rejected"
        status = "stored"
        new.append(obj)
        view = obj.view()
        for g, _, off in present:
            ids, pos = split[g]
            bpc = geo.blocks_per_chunk[g]
            item = CopyItem(ids, pos, bpc, view[off : off + geo.group_bytes[g]], geo.staged(staged_at, i, g))
            items.append((g, item, geo.group_bytes[g] * len(ids) // bpc))
    plan.objs.extend(new)
    for g, item, nbytes in items:
        plan.add(g, item, nbytes)
    return status


def plan_retrieve(
    geo: Geometry,
    chunks: list[Chunk],
    pool: Pool,
    ns: bytes,
    rank: int,
    staged_at: int | None = None,
    blocks: list[np.ndarray] | None = None,
) -> CopyPlan:
    """Find each chunk's objects; the caller pins ``plan.objs`` for the copy. ``blocks``:
    ``geo.check(chunks)``'s arrays, when the caller has them."""
    if blocks is None:
        blocks = geo.block_arrays(chunks)
    plan = CopyPlan()
    reads: dict[Obj, None] = {}
    null = geo.null
    whole = [(~(a == null).any(axis=1)).tolist() if a.shape[1] else [False] * len(a) for a in blocks]
    for i, c in enumerate(chunks):
        ok = True
        for g, ids in enumerate(c.blocks):
            if whole[g][i]:
                ids_arr, pos = blocks[g][i], geo.positions[g]
            else:
                ids_arr, pos = split_nulls(ids, null, geo.positions[g])
                if not len(ids_arr):
                    continue
            obj = pool.find_ready(ns, c.key, g, rank)
            have = 0 if obj is None else obj.mask >> obj.span[g][0]
            full = geo.full_masks[g]
            if have & full != full:
                present = np.array([bool(have >> p & 1) for p in pos.tolist()], dtype=bool)
                if not present.all():
                    # Report exactly the blocks not restored; still restore the ones held.
                    ok = False
                    plan.failed.extend((g, int(b)) for b in ids_arr[~present].tolist())
                    ids_arr, pos = ids_arr[present], pos[present]
                    if not len(ids_arr):
                        continue
            _, off = obj.span[g]
            gbytes, bpc = geo.group_bytes[g], geo.blocks_per_chunk[g]
            reads[obj] = None
            plan.add(
                g,
                CopyItem(ids_arr, pos, bpc, obj.view()[off : off + gbytes], geo.staged(staged_at, i, g)),
                gbytes * len(ids_arr) // bpc,
            )
        plan.results.append(ok)
    plan.objs = list(reads)
    return plan
