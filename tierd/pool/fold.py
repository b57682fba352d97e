"""LOOKUP's fold: the longest boundary ``b`` (in chunks) such that every rank has, committed,
every block every group needs at ``b`` (all chunks before ``b`` for full attention, the blocks
inside the window for sliding groups, the state of chunk ``b - 1`` for recurrent groups), and
the objects a retrieve at ``b`` reads.

Hazard: a client picks the keys (up to MAX_CHUNKS) and the window (up to 2^30 tokens). Checking
a window's chunks anew at every candidate boundary costs keys x window: it froze the daemon for
32 s. Here the cost is linear in the keys (times groups and ranks): the full-attention prefix is
walked once, in growing runs so a short hit costs little (``_full_prefix``); every other group's
chunks are checked once (``_Fold``), first only those the longest boundary needs, and each
boundary is then decided in O(1).

The objects read are Obj of tierd.pool.index, or anything with their ``ready``, ``mask`` and
``span`` (tierd.tier2 folds over L1 and L2 stand-ins together).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, repeat

import numpy as np

from tierd.protocol.layout import GroupKind, GroupSpec

# A chunk entry is a plain dict: (engine group, rank) -> Obj (one object may fill several keys).
ChunkEntry = dict

EMPTY: ChunkEntry = {}  # the entry of a key not held (never written to)
_PART_KEYS: dict[tuple[int, int], tuple[int, int]] = {}


def part_key(group: int, rank: int) -> tuple[int, int]:
    """The shared (group, rank) tuple: a million entries do not each need their own."""
    key = (group, rank)
    return _PART_KEYS.setdefault(key, key)


PartsOf = Callable[[int, int, Sequence[bytes], int, int], tuple[list, "list[bool] | None"]]
"""``parts_of(group, rank, keys, blocks, need)``: per key, its object of that (group, rank) part or
None, and per key whether that object holds every block of ``need`` (the group's mask of a chunk
of ``blocks`` blocks, or of the blocks a STATE group needs); None for the second when all do."""


def entry_parts(space: dict[bytes, ChunkEntry]) -> PartsOf:
    """Parts read from chunk entries (key -> (group, rank) -> object), each object checked."""

    def parts_of(gi: int, r: int, keys: Sequence[bytes], blocks: int, need: int):
        got = map(space.get, keys, repeat(EMPTY))
        parts = list(map(dict.get, got, repeat(part_key(gi, r))))
        ok = _complete(parts, gi, need)
        return parts, ok if False in ok else None

    return parts_of


def column_parts(columns: dict[tuple[int, int], dict[int, dict[bytes, object]]]) -> PartsOf:
    """Parts read from per-part columns ((group, rank) -> column -> key -> committed object; see
    tierd.pool.index): one dict lookup a part. An object of the whole column of ``blocks``
    (tierd.pool.index.column_of) holds every block of the chunk, so it is not read; only objects
    of the part's other columns (partial ones, or whole for another chunk size) are checked."""

    def parts_of(gi: int, r: int, keys: Sequence[bytes], blocks: int, need: int):
        if not keys:
            return [], None
        part = columns.get(part_key(gi, r))
        if part is None:
            return [None] * len(keys), [False] * len(keys)
        whole = part.get(blocks)
        got = list(map(whole.get, keys)) if whole is not None else [None] * len(keys)
        if None not in got:
            return got, None
        others = [c for w, c in part.items() if w != blocks]
        if not others:
            return got, [o is not None for o in got]
        parts = got
        for column in others:  # a key is in at most one column of a part
            parts = [o if o is not None else c for o, c in zip(parts, map(column.get, keys))]
        rest = [None if w is not None else o for w, o in zip(got, parts)]  # the whole ones go unread
        ok = [w is not None or c for w, c in zip(got, _complete(rest, gi, need))]
        return parts, ok if False in ok else None

    return parts_of


def lookup(
    space: dict[bytes, ChunkEntry],
    keys: Sequence[bytes],
    specs: Sequence[GroupSpec],
    chunk_tokens: int,
    ranks: Sequence[int],
    parts_of: PartsOf | None = None,
) -> tuple[int, list]:
    """The longest servable boundary over ``keys`` in one namespace's entries, and what a retrieve
    at that boundary reads, chunk by chunk (full-attention parts, then each other group's).
    ``parts_of`` reads the parts (default: from ``space``'s entries); ``space`` itself is read only
    for which keys are there at all, when ``ranks`` is empty."""
    if parts_of is None:
        parts_of = entry_parts(space)
    # full-attention parts, checked for every chunk: (group, rank, blocks per chunk)
    full = [
        (gi, r, spec.blocks_per_chunk(chunk_tokens))
        for gi, spec in enumerate(specs)
        if spec.kind is GroupKind.FULL
        for r in ranks
    ]
    if full:
        n, objs = _full_prefix(parts_of, keys, full)
        keys = keys[:n] if n < len(keys) else keys
    else:
        n, objs = len(keys), []
    other = [(gi, spec) for gi, spec in enumerate(specs) if spec.kind is not GroupKind.FULL]
    # first only what the longest boundary needs (a window's worth); every chunk only if it fails
    folds = _folds(space, parts_of, keys, other, chunk_tokens, ranks, top=True)
    if all(f.top_ok(n) for f in folds):
        boundary = n
    else:  # (a fold whose window is the whole prompt has seen every chunk already)
        folds = [
            f if not f.lo else _Fold(space, parts_of, keys, f.gi, f.spec, chunk_tokens, ranks) for f in folds
        ]
        boundary = _boundary(n, folds)
    if boundary == 0:
        return 0, []
    del objs[boundary * len(full) :]
    for f in folds:
        f.collect(boundary, objs)
    if any(len(o.span) > 1 for o in objs[: len(full) + 1]):  # combined objects: once each
        objs = list(dict.fromkeys(objs))
    return boundary, objs


VECTOR_MIN = 48  # from this many chunks a fold with misses is evaluated with numpy, all boundaries at once
FIRST_RUN = 64  # keys of the full-attention walk's first run; each next run is twice as long


def _folds(
    space: dict,
    parts_of: PartsOf,
    keys: Sequence[bytes],
    other: list,
    chunk_tokens: int,
    ranks: Sequence[int],
    top: bool = False,
) -> list[_Fold]:
    folds = (_Fold(space, parts_of, keys, gi, spec, chunk_tokens, ranks, top) for gi, spec in other)
    return [f for f in folds if f.bpc]  # a sliding group of blocks larger than a chunk needs nothing


def _complete(parts: list, gi: int, need: int) -> list[bool]:
    """Per part: held, written, and holding every block of ``need`` in group ``gi``'s part."""
    span = next((o.span for o in parts if o is not None), None)
    if span is None:
        return [False] * len(parts)
    shifted = need << span[gi][0]  # objects of one layout share one span dict
    return [
        o is not None
        and o.ready
        and (o.mask & shifted == shifted if o.span is span else (o.mask >> o.span[gi][0]) & need == need)
        for o in parts
    ]


def _full_prefix(parts_of: PartsOf, keys: Sequence[bytes], full: list) -> tuple[int, list]:
    """The length of the longest prefix of ``keys`` whose full-attention parts are all there, and
    those parts chunk by chunk in ``full``'s order."""
    cols: list[list] = [[] for _ in full]
    pos, run = 0, FIRST_RUN
    while pos < len(keys):
        ks = keys[pos : pos + run]
        n = len(ks)
        parts = []
        for gi, r, blocks in full:
            col, ok = parts_of(gi, r, ks[:n] if n < len(ks) else ks, blocks, (1 << blocks) - 1)
            if ok is not None:
                n = ok.index(False)
            parts.append(col)
        for col, part in zip(cols, parts):
            col += part if n == len(part) else part[:n]
        pos += n
        if n < len(ks):
            break
        run *= 2
    objs = cols[0] if len(cols) == 1 else list(chain.from_iterable(zip(*cols)))
    return pos, objs


class _Fold:
    """One sliding-window or state group's chunks, checked once for every rank.

    Sliding: a boundary ``b`` needs blocks ``[first(b), bpc)`` of chunk ``js(b)`` and every block of
    the chunks after it up to ``b`` (GroupSpec.needed_mask, in closed form). Per chunk ``tail[j]``
    is the lowest block from which every rank holds the chunk's blocks (0: all; bpc: absent), so
    ``b`` is servable iff the last chunk before ``b`` with ``tail != 0`` comes before ``js(b)``, or
    is ``js(b)`` itself with ``tail <= first(b)``: O(1) per boundary once the nearest such chunk
    is known. State: ``b`` needs bit 0 of chunk ``b - 1`` (``tail`` 0 or 1). With ``top`` only the
    chunks the longest boundary needs are checked (``lo`` on; lists are indexed from there). A
    window that covers the whole prompt needs every chunk whole: ``cap``, the first chunk that is
    not, bounds the boundary, and no tails are needed."""

    def __init__(
        self,
        space: dict,
        parts_of: PartsOf,
        keys: Sequence[bytes],
        gi: int,
        spec: GroupSpec,
        chunk_tokens: int,
        ranks: Sequence[int],
        top: bool = False,
    ):
        self.gi, self.spec, self.state = gi, spec, spec.kind is GroupKind.STATE
        self.chunk, self.block = chunk_tokens, spec.block_tokens
        self.bpc = bpc = spec.blocks_per_chunk(chunk_tokens)
        self.before = spec.window_tokens - 1  # tokens before the next one that it attends to
        self.tail: list[int] = []
        self.clean = True
        self.lo = 0
        self.cap: int | None = None  # for a window over the whole prompt: boundaries <= cap
        if not bpc:
            return
        if not self.state and ranks and len(keys) * chunk_tokens <= self.before:
            self.cap = len(keys)
        if top and keys:
            self.lo = min(len(keys), len(keys) - 1 if self.state else self.window(len(keys))[0])
            keys = keys[self.lo :]
        need = 1 if self.state else (1 << bpc) - 1
        read = [parts_of(gi, r, keys, bpc, need) for r in ranks]
        self.parts = [parts for parts, _ in read]
        if not ranks:  # an entry, whatever it holds
            self.tail = [0 if k in space else bpc for k in keys]
            self.clean = not any(self.tail)
            return
        tails = []
        for parts, ok in read:
            if ok is None:
                continue
            if self.cap is not None:
                self.cap = min(self.cap, ok.index(False))
                self.clean = False
            else:
                tails.append(
                    [0 if g else bpc if o is None else _tail(o, gi, need, bpc) for g, o in zip(ok, parts)]
                )
        if tails:
            self.clean = False
            self.tail = tails[0] if len(tails) == 1 else list(map(max, *tails))

    def window(self, b: int) -> tuple[int, int]:
        """(js, first): the first chunk a boundary ``b`` needs and its first needed block."""
        start = max(0, b * self.chunk - self.before)
        js = max(0, (start - self.bpc * self.block) // self.chunk + 1)
        return js, max(0, (start - js * self.chunk) // self.block)

    def top_ok(self, n: int) -> bool:
        """Whether the boundary ``n`` is servable (built with ``top``)."""
        if self.clean or self.lo >= n:
            return True
        if self.cap is not None:
            return self.cap >= n
        if self.state:
            return not self.tail[0]
        return not any(self.tail[1:]) and self.tail[0] <= self.window(n)[1]

    def ok(self, b: int, last_bad: list[int]) -> bool:
        if self.state:
            return not self.tail[b - 1]
        js, first = self.window(b)
        if js >= b:
            return True
        m = last_bad[b - 1]
        return m < js or (m == js and self.tail[js] <= first)

    def ok_all(self, n: int) -> np.ndarray:
        """``ok(b)`` for every boundary 1..n at once."""
        tail = np.asarray(self.tail, dtype=np.int64)
        if self.state:
            return tail == 0
        b = np.arange(1, n + 1, dtype=np.int64)
        last_bad = np.maximum.accumulate(np.where(tail != 0, b - 1, -1))
        start = np.maximum(b * self.chunk - self.before, 0)
        js = np.maximum((start - self.bpc * self.block) // self.chunk + 1, 0)
        first = np.maximum((start - js * self.chunk) // self.block, 0)
        return (js >= b) | (last_bad < js) | ((last_bad == js) & (tail[np.minimum(js, n - 1)] <= first))

    def collect(self, b: int, objs: list) -> None:
        """Append what a retrieve at ``b`` reads of this group: chunk by chunk, rank by rank."""
        js = b - 1 if self.state else self.window(b)[0]
        if js >= b:
            return
        lo, hi = js - self.lo, b - self.lo
        if len(self.parts) == 1:
            objs += self.parts[0][lo:hi]
        else:
            objs += chain.from_iterable(zip(*(p[lo:hi] for p in self.parts)))


def _tail(o, gi: int, need: int, bpc: int) -> int:
    """The lowest block from which ``o`` holds every block of ``need`` (bpc: unwritten)."""
    if not o.ready:
        return bpc
    return (~(o.mask >> o.span[gi][0]) & need).bit_length()


def _boundary(n: int, folds: list[_Fold]) -> int:
    """The largest boundary in 1..n every fold serves, else 0."""
    folds = [f for f in folds if not f.clean]  # a clean fold serves every boundary
    limit = min((f.cap for f in folds if f.cap is not None), default=n)
    folds = [f for f in folds if f.cap is None]
    if not folds or not limit:
        return limit
    if n >= VECTOR_MIN:
        ok = folds[0].ok_all(n)
        for f in folds[1:]:
            ok &= f.ok_all(n)
        hits = np.flatnonzero(ok[:limit])
        return int(hits[-1]) + 1 if hits.size else 0
    lasts = []
    for f in folds:
        last, lb = -1, []
        for j, t in enumerate(f.tail):
            if t:
                last = j
            lb.append(last)
        lasts.append(lb)
    for b in range(limit, 0, -1):
        if all(f.ok(b, lb) for f, lb in zip(folds, lasts)):
            return b
    return 0
