"""What a STORE or RETRIEVE copies: results per chunk, the objects it writes or reads, and copy
items per group (CopyPlan); for a STORE, bound here from the planner's request and the objects
the pool reserved for it (``bind``), so the lanes copy exactly into those objects' bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierd.transfer.items import CopyItem


@dataclass(slots=True, frozen=True)
class WholeChunks:
    """Objects a STORE's reservation made (tierd.pool.reserve) for chunks ``first, first + 1, ...``
    holding every block: ``objs[s][k]`` is chunk ``first + k``'s object of the ``s``-th part set
    made, which is ``which[s]`` of the layout's fresh parts (None: all of them, in order)."""

    first: int
    which: list | None
    objs: list


@dataclass(slots=True, frozen=True)
class NullChunk:
    """Objects made for ``chunk``, a chunk with null block ids: ``(object, its NullObject)`` each
    (tierd.state.planner: the parts the object holds)."""

    chunk: int
    objs: list


@dataclass
class CopyPlan:
    """What a STORE or RETRIEVE does: results per chunk, objects it writes or reads, copies per group."""

    results: list = field(default_factory=list)  # STORE: "stored"|"exists"|"empty"|"rejected"; RETRIEVE: bool
    objs: list = field(default_factory=list)
    copies: dict[int, list[CopyItem]] = field(default_factory=dict)  # group -> items
    failed: list[tuple[int, int]] = field(default_factory=list)  # RETRIEVE: (group, block id) not restored
    nbytes: int = 0

    def add(self, group: int, item: CopyItem, nbytes: int) -> None:
        self.copies.setdefault(group, []).append(item)
        self.nbytes += nbytes


def bind(req, got) -> CopyPlan:
    """The copies of a STORE: ``req`` (tierd.state.planner.StoreRequest) into the objects ``got``
    (tierd.pool.reserve.Reserved) holds, chunk by chunk; the objects in the order they are
    committed (so touched) in."""
    plan = CopyPlan(got.results)
    fresh_parts = req.geo.fresh_parts
    for made in got.made:
        if type(made) is WholeChunks:
            present = fresh_parts if made.which is None else [fresh_parts[s] for s in made.which]
            _add_whole(req, made.objs, present, made.first, plan)
        else:
            _add_nulls(req, made.chunk, made.objs, plan)
    return plan


def staged_offset(staged_at: int | None, chunk: int, chunk_bytes: int, group_offset: int) -> int:
    """Where a chunk's group part lies in a rank's staging buffer (cuda): the request's chunks lie
    there back to back from ``staged_at``, each its groups' parts back to back; -1 unstaged."""
    return -1 if staged_at is None else staged_at + chunk * chunk_bytes + group_offset


def _add_whole(req, made, present, i: int, plan: CopyPlan) -> None:
    """Whole chunks ``i, i + 1, ...`` into their new objects: ``made[s][k]``, with parts
    ``present[s]``, is chunk ``i + k``'s. Every part, every block."""
    geo = req.geo
    plan.objs += made[0] if len(made) == 1 else [obj for objs in zip(*made) for obj in objs]
    for objs, parts in zip(made, present):
        for g, _, off in parts:
            gbytes, pos, bpc = geo.group_bytes[g], geo.positions[g], geo.blocks_per_chunk[g]
            items = plan.copies.setdefault(g, [])
            rows = req.blocks[g]
            at = staged_offset(req.staged_at, i, geo.chunk_bytes, geo.group_offsets[g])
            step = 0 if req.staged_at is None else geo.chunk_bytes  # unstaged: -1 throughout
            for k, obj in enumerate(objs, i):
                items.append(CopyItem(rows[k], pos, bpc, obj.part(off, gbytes), at))
                at += step
            plan.nbytes += gbytes * len(objs)


def _add_nulls(req, i: int, new, plan: CopyPlan) -> None:
    """Chunk ``i``'s new objects, each with the parts its NullObject names."""
    geo = req.geo
    for obj, want in new:
        plan.objs.append(obj)
        view = obj.view()
        for g, off, ids, pos in want.parts:
            gbytes, bpc = geo.group_bytes[g], geo.blocks_per_chunk[g]
            at = staged_offset(req.staged_at, i, geo.chunk_bytes, geo.group_offsets[g])
            plan.add(g, CopyItem(ids, pos, bpc, view[off : off + gbytes], at), gbytes * len(ids) // bpc)
