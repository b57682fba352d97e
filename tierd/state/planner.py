"""STORE and RETRIEVE planning: from a typed request and a rank's layout, decide per chunk which
objects a STORE asks the pool for (``plan_store``, without the pool: tierd.pool.reserve reserves
them, tierd.transfer.plans binds the copies of its blocks into them), and which objects a
RETRIEVE reads and which blocks it copies where (``plan_retrieve``, from what the pool holds).

Neither touches engine memory or blocks, so tests pin every decision with exact ids without a
daemon. The copies themselves run later on a transfer lane (``tierd.transfer``).

Hazards handled here:
- Block ids come from the client: each is checked against the layout (null or in range) before
  anything is allocated, so a copy can never address memory outside a registered tensor.
- A chunk's masks name exactly the blocks it holds: a null id's block is in no object's mask.
- A retrieve of blocks the pool does not hold reports exactly those block ids as failed and
  still restores the ones it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np

from tierd.pool.index import Obj, Span
from tierd.pool.pool import Pool
from tierd.protocol import MAX_REQUEST_PARTS
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import GroupKind, PageLayout
from tierd.protocol.messages import Chunk
from tierd.transfer.items import CopyItem, split_nulls
from tierd.transfer.plans import CopyPlan, staged_offset

# Bump with any change to the bytes of an object: the order of groups, layers, blocks and runs in
# it, its size or its mask bits. A warm restart (--pool-dir) compares it and starts cold on a change.
OBJECT_LAYOUT_VERSION = 2  # 2: block-major groups (GroupLayout.block_major) laid out [block][layer]


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
        # the objects a whole chunk writes, and how Writes.begin_fresh makes them
        self.present_objects = [o for o in self.objects if o.present]
        self.fresh_shapes = [
            (span, o.nbytes, o.whole_mask, o.label) for o, span in zip(self.objects, self.spans) if o.present
        ]
        self.fresh_parts = [o.present for o in self.present_objects]

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
        return staged_offset(staged_at, chunk, self.chunk_bytes, self.group_offsets[group])

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
            rows = [c.blocks[g] for c in chunks]
            if rows and set(map(len, rows)) != {n}:
                raise ValueError("a chunk names another count of block ids")
            # one flat list: numpy converts it several times faster than the nested one
            flat = list(chain.from_iterable(rows))
            out.append(np.array(flat, dtype=np.int64).reshape(len(chunks), n))
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


@dataclass(slots=True)
class NullObject:
    """An object of a chunk that names null ids: its groups' parts with blocks, and for each the
    ids and their positions in the chunk (its mask holds exactly those blocks)."""

    span: dict
    nbytes: int
    mask: int
    label: str
    parts: list[tuple[int, int, np.ndarray, np.ndarray]]  # (group, byte offset, ids, positions)


@dataclass(slots=True)
class StoreRequest:
    """A STORE as the planner decided it, before the pool: the objects each chunk asks for
    (tierd.pool.reserve) and what the copies of its blocks need (tierd.transfer.plans.bind). A
    whole chunk asks for ``geo.fresh_shapes`` (``geo.fresh_parts``: their parts with blocks)."""

    keys: list[bytes]
    whole: list[bool]  # per chunk: no null id in any group
    nulls: dict[int, list[NullObject] | None]  # chunks with null ids: their objects (None: all null)
    blocks: list[np.ndarray]  # per group, (chunks, blocks per chunk) ids
    staged_at: int | None  # cuda: where the chunks lie in staging, back to back
    geo: Geometry  # (read, never called: its fields are plain data)


def plan_store(
    geo: Geometry, chunks: list[Chunk], staged_at: int | None = None, blocks: list[np.ndarray] | None = None
) -> StoreRequest:
    """What each chunk asks the pool for, decided without it. ``blocks``: ``geo.check(chunks)``'s
    arrays, when the caller has them."""
    if blocks is None:
        blocks = geo.block_arrays(chunks)
    whole = _without_nulls(blocks, geo.null, len(chunks))
    nulls = {} if all(whole) else {i: _null_objects(geo, c) for i, c in enumerate(chunks) if not whole[i]}
    return StoreRequest([c.key for c in chunks], whole, nulls, blocks, staged_at, geo)


def _without_nulls(blocks: list[np.ndarray], null: int, n: int) -> list[bool]:
    """Per chunk, whether none of its ids is ``null``. A null below every block id (the default,
    -1) is absent from a group whose smallest id is not negative: one reduction for the group."""
    if all(null < 0 and (not a.size or int(a.min()) >= 0) for a in blocks):
        return [True] * n
    clean = np.ones(n, dtype=bool)
    for a in blocks:
        if a.shape[1]:
            clean &= ~(a == null).any(axis=1)
    return clean.tolist()


def _null_objects(geo: Geometry, c: Chunk) -> list[NullObject] | None:
    """A chunk with null ids: each object's mask holds the blocks it names; None when it names none."""
    split = [split_nulls(ids, geo.null, geo.positions[g]) for g, ids in enumerate(c.blocks)]
    if not any(len(ids) for ids, _ in split):
        return None  # an all-null chunk is not stored
    out = []
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
        parts = [(g, off, *split[g]) for g, _, off in present]
        out.append(NullObject(span, shape.nbytes, mask, shape.label, parts))
    return out


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
    clean = _without_nulls(blocks, null, len(chunks))  # (a chunk with a null anywhere: split per group)
    whole = [clean if a.shape[1] else [False] * len(a) for a in blocks]
    keys = [c.key for c in chunks]
    found = [pool.find_ready_many(ns, keys, g, rank) for g in range(len(blocks))]
    for i, c in enumerate(chunks):
        ok = True
        for g, ids in enumerate(c.blocks):
            if whole[g][i]:
                ids_arr, pos = blocks[g][i], geo.positions[g]
            else:
                ids_arr, pos = split_nulls(ids, null, geo.positions[g])
                if not len(ids_arr):
                    continue
            obj = found[g][i]
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
            item = CopyItem(ids_arr, pos, bpc, obj.part(off, gbytes), geo.staged(staged_at, i, g))
            plan.add(g, item, gbytes * len(ids_arr) // bpc)
        plan.results.append(ok)
    plan.objs = list(reads)
    return plan
