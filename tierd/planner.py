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

from dataclasses import dataclass, field

import numpy as np

from tierd.pool.index import Obj
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
    """One object a chunk writes: the groups it holds as (group, mask shift, byte offset)."""

    parts: tuple[tuple[int, int, int], ...]
    nbytes: int
    label: str

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
        self.spans = [o.span for o in self.objects]

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

    def check(self, chunks: list[Chunk]) -> None:
        """Every chunk names one block list per group, of the group's length, each id null or in
        range. Raises BAD_REQUEST naming the first bad id."""
        ngroups, null = len(self.blocks_per_chunk), self.null
        if len(chunks) * ngroups > MAX_REQUEST_PARTS:
            raise _bad(
                "chunks",
                f"{len(chunks)} chunks x {ngroups} groups is more than {MAX_REQUEST_PARTS} parts "
                "in one request: split it (tierd_client does)",
            )
        for i, c in enumerate(chunks):
            if len(c.blocks) != ngroups:
                raise _bad(f"chunks[{i}].blocks", f"{len(c.blocks)} groups, the layout has {ngroups}")
            for g, ids in enumerate(c.blocks):
                n, limit = self.blocks_per_chunk[g], self.num_blocks[g]
                if len(ids) != n:
                    raise _bad(
                        f"chunks[{i}].blocks[{g}]", f"{len(ids)} block ids, the group has {n} per chunk"
                    )
                if ids and (min(ids) < 0 or max(ids) >= limit):
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
    geo: Geometry, chunks: list[Chunk], pool: Pool, ns: bytes, rank: int, staged_at: int | None = None
) -> CopyPlan:
    """Reserve room for the chunks' objects; the plan's objects are pinned and not yet visible
    (``pool.commit`` once copied, ``pool.abort`` otherwise)."""
    plan = CopyPlan()
    holed = False  # a chunk was rejected (a flag: a scan of the results per chunk made this quadratic)
    for i, c in enumerate(chunks):
        if holed:
            plan.results.append("rejected")  # past a hole LOOKUP never reaches: keep the room
            continue
        split = [split_nulls(ids, geo.null, geo.positions[g]) for g, ids in enumerate(c.blocks)]
        if not any(len(ids) for ids, _ in split):
            plan.results.append("empty")  # an all-null chunk is not stored
            continue
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
            obj = pool.begin_write(ns, c.key, span, rank, shape.nbytes, mask, shape.label)
            if obj is EXISTS:
                continue
            if obj is None:
                status = "rejected"
                break
            status = "stored"
            new.append(obj)
            view = obj.view()
            for g, _, off in present:
                ids, pos = split[g]
                bpc = geo.blocks_per_chunk[g]
                items.append(
                    (
                        g,
                        CopyItem(
                            ids, pos, bpc, view[off : off + geo.group_bytes[g]], geo.staged(staged_at, i, g)
                        ),
                        geo.group_bytes[g] * len(ids) // bpc,
                    )
                )
        if status == "rejected":
            holed = geo.has_full
            pool.abort(new)  # all groups of a chunk or none
        else:
            plan.objs.extend(new)
            for g, item, nbytes in items:
                plan.add(g, item, nbytes)
        plan.results.append(status)
    return plan


def plan_retrieve(
    geo: Geometry, chunks: list[Chunk], pool: Pool, ns: bytes, rank: int, staged_at: int | None = None
) -> CopyPlan:
    """Find each chunk's objects; the caller pins ``plan.objs`` for the copy."""
    plan = CopyPlan()
    reads: dict[Obj, None] = {}
    for i, c in enumerate(chunks):
        ok = True
        for g, ids in enumerate(c.blocks):
            ids_arr, pos = split_nulls(ids, geo.null, geo.positions[g])
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
