"""A STORE's room: every object its plan asks for (tierd.state.planner.StoreRequest), reserved in one
hold of the pool's lock, all of a chunk's objects or none, and what became of each chunk.

Hazards handled here:
- A chunk's groups are stored all or none: a chunk that cannot get room for one of its objects
  releases the others (``rejected``), and in a layout with a full-attention group nothing past
  a rejected chunk is stored (LOOKUP could never reach it; keep the room).
- The objects are pinned and not yet visible: ``Pool.commit`` once their bytes are copied,
  ``Pool.abort`` otherwise (tierd.core.jobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierd.pool.pool import EXISTS, Pool
from tierd.transfer.plans import NullChunk, WholeChunks


@dataclass(slots=True)
class Reserved:
    """Per chunk its result ("stored", "exists", "empty", "rejected"), and the objects made, in
    chunk order: a WholeChunks for chunks with every block, a NullChunk for the others."""

    results: list[str] = field(default_factory=list)
    made: list[WholeChunks | NullChunk] = field(default_factory=list)


def reserve(pool: Pool, ns: bytes, rank: int, req) -> Reserved:
    """Reserve the objects ``req`` (a StoreRequest) asks for in ``pool``, for rank ``rank``."""
    out = Reserved()
    results, made = out.results, out.made
    whole, fresh, keys = req.whole, req.geo.fresh_shapes, req.keys
    holed = False  # a chunk was rejected (a flag: a scan of the results per chunk made this quadratic)
    n, i, j = len(keys), 0, 0
    with pool.writes() as w:
        while i < n:
            if holed:
                results.append("rejected")  # past a hole LOOKUP never reaches: keep the room
                i += 1
                continue
            if whole[i] and fresh:
                # a run of whole chunks of new keys (a prefill's) is allocated in one go
                j = max(j, i + 1)
                while j < n and whole[j]:
                    j += 1
                objs = w.begin_fresh(ns, keys, i, j, rank, fresh)
                if objs:
                    made.append(WholeChunks(i, None, objs))
                    results += ["stored"] * len(objs[0])
                    i += len(objs[0])
                    continue
            if whole[i]:
                status = _whole(w, ns, keys[i], i, rank, fresh, made)
            else:
                status = _with_nulls(w, ns, keys[i], i, rank, req.nulls[i], made)
            if status == "rejected":
                holed = req.geo.has_full  # LOOKUP stops at a chunk a full-attention group lacks
            results.append(status)
            i += 1
    return out


def _whole(w, ns, key, i, rank, fresh, made) -> str:
    """A chunk holding every block of every group: each object's mask is its shape's whole mask."""
    new = _begin_all(w, ns, key, rank, ((shape, s) for s, shape in enumerate(fresh)))
    if new is None:
        return "rejected"
    if new:
        made.append(WholeChunks(i, [s for _, s in new], [[o] for o, _ in new]))
        return "stored"
    return "exists" if fresh else "empty"


def _with_nulls(w, ns, key, i, rank, objects, made) -> str:
    """A chunk with null ids: its objects as the planner masked them; None: all null."""
    if objects is None:
        return "empty"  # an all-null chunk is not stored
    new = _begin_all(w, ns, key, rank, (((o.span, o.nbytes, o.mask, o.label), o) for o in objects))
    if new is None:
        return "rejected"
    if new:
        made.append(NullChunk(i, new))
        return "stored"
    return "exists"


def _begin_all(w, ns, key, rank, wants) -> list | None:
    """Begin each ``((span, nbytes, mask, label), tag)`` of ``wants`` for ``key``: the new objects
    with their tags (EXISTS ones left out), or None when one finds no room: all of a chunk's
    objects or none, so the others are released."""
    new = []
    for (span, nbytes, mask, label), tag in wants:
        obj = w.begin(ns, key, span, rank, nbytes, mask, label)
        if obj is EXISTS:
            continue
        if obj is None:
            w.abort([o for o, _ in new])
            return None
        new.append((obj, tag))
    return new
