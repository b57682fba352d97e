"""Which L2 objects a chunk has, the names they go by, and the LOOKUP fold over L1 and L2 together.

Hazards first:

- An L2 object is one whole L1 object (a chunk's bytes of one group on one rank, or of all its
  groups with --no-separate-object-groups), and only a complete one: every block of every group
  it holds. Its bytes carry no presence mask, so a partial object (null blocks) never goes to L2,
  and whatever comes back is committed with every block present.
- Names come from the namespace id, the PAGE hash, the group (-1: all groups) and the rank
  (tierd.tier2.keys.chunk_key): every node derives the same name for the same chunk, and one
  namespace's objects can never answer another's (the id hashes model, layout fingerprint,
  world size and salt; Mooncake itself does not separate tenants).
- The fold is the L1 fold itself (tierd.pool.fold.lookup) run over an overlay in which
  objects L2 holds stand in for the ones L1 lacks, so the two tiers can never disagree on what a
  boundary needs (full chunks, the window's blocks, the state at the boundary, every rank).

Pure functions of (keys, geometry, pool, what L2 holds): tests pin every boundary exactly.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from tierd.pool.fold import lookup
from tierd.pool.pool import Pool
from tierd.protocol.layout import GroupSpec
from tierd.state.planner import Geometry
from tierd.tier2.keys import chunk_key


class Part(NamedTuple):
    """One L2 object of a namespace: a chunk's object ``shape`` (Geometry.objects) on ``rank``."""

    key: bytes  # the chunk's PAGE hash
    shape: int
    rank: int


class Remote:
    """An object L2 holds (or a fetch is bringing in), as the L1 fold reads an object."""

    __slots__ = ("part", "span", "mask")
    ready = True

    def __init__(self, part: Part, span: dict, mask: int):
        self.part, self.span, self.mask = part, span, mask


def l2_group(groups: Collection[int]) -> int:
    """The group number in an L2 name: the object's one group, or -1 for all of a rank's groups."""
    return next(iter(groups)) if len(groups) == 1 else -1


def part_name(ns: bytes, part: Part, geo: Geometry) -> bytes:
    return chunk_key(ns, part.key, l2_group(geo.objects[part.shape].span), part.rank)


def obj_name(obj) -> bytes:
    """The L2 name of an L1 object (tierd.pool.index.Obj): the same as its Part's."""
    return chunk_key(obj.ns, obj.key, l2_group(obj.span), obj.rank)


def full_mask(geo: Geometry, shape: int) -> int:
    """The presence mask of a complete object of ``shape``: every block of every group in it."""
    return sum(geo.full_masks[g] << shift for g, shift, _ in geo.objects[shape].parts)


def shape_of(geo: Geometry, group: int) -> int:
    """The object shape holding ``group``."""
    for i, shape in enumerate(geo.objects):
        if group in shape.span:
            return i
    raise ValueError(f"group {group} is in no object shape")


def shapes_for(geo: Geometry, ngroups: int) -> list[int]:
    """The shapes a LOOKUP of the first ``ngroups`` groups reads, in layout order."""
    return sorted({shape_of(geo, g) for g in range(ngroups)})


def missing(
    pool: Pool,
    ns: bytes,
    keys: Sequence[bytes],
    geo: Geometry,
    ngroups: int,
    ranks: Sequence[int],
    coming: Collection[Part],
    limit: int,
) -> list[Part]:
    """Parts of the prompt L1 does not hold committed, in chunk order (at most ``limit``): the ones
    worth asking L2 about. Parts already ``coming`` (being fetched) and parts a STORE is writing
    right now are left out."""
    shapes = [(s, next(iter(geo.objects[s].span))) for s in shapes_for(geo, ngroups)]
    out: list[Part] = []
    for key in keys:
        entry = pool.entry(ns, key) or {}
        for s, g0 in shapes:
            for r in ranks:
                if (g0, r) in entry:  # committed, or being written (a STORE's or a fetch's)
                    continue
                part = Part(key, s, r)
                if part not in coming:
                    out.append(part)
                    if len(out) >= limit:
                        return out
    return out


def fold(
    pool: Pool,
    ns: bytes,
    keys: Sequence[bytes],
    specs: Sequence[GroupSpec],
    chunk_tokens: int,
    ranks: Sequence[int],
    geo: Geometry,
    present: Collection[Part],
) -> tuple[int, list]:
    """The longest boundary L1 and L2 can serve together, and what a retrieve there reads: L1
    objects (tierd.pool.index.Obj) and, for what only L2 holds, Remote stand-ins. Touches nothing."""
    by_key: dict[bytes, list[Part]] = {}
    for part in present:
        by_key.setdefault(part.key, []).append(part)
    space = {}
    for key in keys:
        entry = pool.entry(ns, key) or {}
        for part in by_key.get(key, ()):
            span = geo.objects[part.shape].span
            stand = Remote(part, span, full_mask(geo, part.shape))
            for g in span:
                o = entry.get((g, part.rank))
                if o is None or not o.ready:
                    entry[(g, part.rank)] = stand
        space[key] = entry
    if not keys:
        return 0, []
    return lookup(space, keys, specs, chunk_tokens, ranks)  # the parts read from the overlay's entries
