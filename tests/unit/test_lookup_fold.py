"""LOOKUP's fold is linear in the keys and answers exactly what the old quadratic fold answered.

``old_lookup`` below is the fold as it was (in tierd/pool/index.py, before tierd/pool/fold.py):
it walked the boundary down from the full-attention hit and re-checked every chunk of each
sliding or state group's lookback at every step, O(keys x lookback). The new one must give the
same boundary and the same objects in the same order on every input: random presence patterns
(absent keys, absent, unwritten or partly written parts), windows from 1 token to past the whole
prompt, blocks that do or do not divide a chunk (or are larger than one), several ranks, several
groups of each kind, and combined objects (one object spanning every group of a rank,
--no-separate-object-groups)"""

from __future__ import annotations

import random

import pytest

from tierd.pool import fold
from tierd.pool.index import Index, Obj
from tierd.protocol.layout import GroupKind, GroupSpec

NS = b"ns"


# ---- the old fold, verbatim but for names ------------------------------------------------------
def _has(entry, group, ranks, need) -> bool:
    if entry is None:
        return False
    for r in ranks:
        o = entry.get((group, r))
        if o is None or not o.ready or (o.mask >> o.span[group][0]) & need != need:
            return False
    return True


def _others_ok(entries, other, boundary, chunk_tokens, ranks) -> bool:
    for gi, spec in other:
        first = max(0, boundary - spec.lookback_chunks(chunk_tokens))
        for j in range(first, boundary):
            need = spec.needed_mask(j, boundary, chunk_tokens)
            if need and not _has(entries[j], gi, ranks, need):
                return False
    return True


def old_lookup(index: Index, ns, keys, specs, chunk_tokens, ranks):
    space = index.spaces.get(ns)
    if space is None or not keys:
        return 0, []
    full = [
        ((gi, r), gi, (1 << s.blocks_per_chunk(chunk_tokens)) - 1)
        for gi, s in enumerate(specs)
        if s.kind is GroupKind.FULL
        for r in ranks
    ]
    other = [(gi, s) for gi, s in enumerate(specs) if s.kind is not GroupKind.FULL]
    entries, objs = [], []
    if full:
        for key in keys:
            entry = space.get(key)
            if entry is None:
                break
            for part, gi, need in full:
                o = entry.get(part)
                if o is None or not o.ready or (o.mask >> o.span[gi][0]) & need != need:
                    break
                objs.append(o)
            else:
                entries.append(entry)
                continue
            del objs[len(entries) * len(full) :]
            break
    else:
        entries = [space.get(key) for key in keys]
    boundary = len(entries)
    while boundary > 0 and not _others_ok(entries, other, boundary, chunk_tokens, ranks):
        boundary -= 1
    if boundary == 0:
        return 0, []
    del objs[boundary * len(full) :]
    for gi, spec in other:
        for j in range(max(0, boundary - spec.lookback_chunks(chunk_tokens)), boundary):
            if spec.needed_mask(j, boundary, chunk_tokens):
                objs.extend(entries[j][(gi, r)] for r in ranks)
    if any(len(o.span) > 1 for o in objs[: len(full) + 1]):
        objs = list(dict.fromkeys(objs))
    return boundary, objs


# ---- random indexes --------------------------------------------------------------------------
def key(i: int) -> bytes:
    return b"key-%06d" % i


def obj(k: bytes, span: dict, rank: int, mask: int, ready: bool) -> Obj:
    o = Obj(NS, k, span, rank, 64, mask, "g")
    o.ready, o.pins = ready, 0
    return o


def part_mask(rnd: random.Random, bpc: int, p_partial: float) -> int:
    full = (1 << bpc) - 1
    if bpc == 0 or rnd.random() >= p_partial:
        return full
    kind = rnd.random()
    if kind < 0.35:  # the last blocks only (what a sliding window keeps)
        return full & ~((1 << rnd.randrange(bpc + 1)) - 1)
    if kind < 0.6:  # the first blocks only
        return (1 << rnd.randrange(bpc + 1)) - 1
    return rnd.getrandbits(bpc)


def random_case(rnd: random.Random):
    chunk = rnd.choice((1, 2, 4, 6, 8, 12, 16))
    nspecs = rnd.randint(1, 5)
    specs = []
    for _ in range(nspecs):
        kind = rnd.choice((GroupKind.FULL, GroupKind.SLIDING, GroupKind.SLIDING, GroupKind.STATE))
        divisors = [b for b in range(1, chunk + 1) if chunk % b == 0]
        block = rnd.choice(divisors) if rnd.random() < 0.85 else rnd.randint(1, 2 * chunk + 1)
        window = 0
        if kind is GroupKind.SLIDING:
            window = rnd.choice(
                (
                    1,
                    2,
                    3,
                    max(1, block - 1),
                    block,
                    block + 1,
                    chunk,
                    chunk + 1,
                    2 * chunk + rnd.randint(0, chunk),
                    rnd.randint(1, 12 * chunk),
                    1 << 30,
                )
            )
        specs.append(GroupSpec(kind, block, window))
    n = rnd.choice((0, 1, 2, 3, 5, 8, 13, 30, 47, 48, 49, 80, 200))
    ranks = rnd.choice(([0], [0], [0, 1], [0, 1, 2], [2, 5], []))
    combined = rnd.random() < 0.3
    p_key = rnd.choice((0.0, 0.02, 0.1, 0.4))  # a key absent altogether
    p_part = rnd.choice((0.0, 0.02, 0.1, 0.3))  # a part (or a combined object) absent
    p_unready = rnd.choice((0.0, 0.02, 0.1))
    p_partial = rnd.choice((0.0, 0.05, 0.2, 0.6))
    tail_gone = rnd.random() < 0.3  # the prompt's end was never stored
    index = Index()
    bpcs = [s.blocks_per_chunk(chunk) for s in specs]
    for i in range(n):
        if rnd.random() < p_key or (tail_gone and i > n // 2):
            continue
        k = key(i)
        for r in ranks:
            if combined:
                if rnd.random() < p_part:
                    continue
                span, mask, shift = {}, 0, 0
                for gi, bpc in enumerate(bpcs):
                    span[gi] = (shift, 64 * gi)
                    mask |= part_mask(rnd, bpc, p_partial) << shift
                    shift += bpc
                index.insert(obj(k, span, r, mask, rnd.random() >= p_unready))
                continue
            for gi, bpc in enumerate(bpcs):
                if rnd.random() < p_part:
                    continue
                mask = part_mask(rnd, bpc, p_partial)
                index.insert(obj(k, {gi: (0, 0)}, r, mask, rnd.random() >= p_unready))
    for i in range(n):  # an entry holding nothing (as tierd.tier2's overlay may pass): present, empty
        if rnd.random() < 0.03:
            index.spaces.setdefault(NS, {}).setdefault(key(i), {})
    keys = [key(i) for i in range(n)]
    return index, keys, specs, chunk, ranks


@pytest.mark.parametrize(
    ("vector_min", "first_run"), [(1, 1), (48, 64), (1 << 30, 3)], ids=["numpy", "default", "scalar"]
)
def test_fold_equals_the_old_fold_on_random_indexes(monkeypatch, vector_min, first_run):
    monkeypatch.setattr(fold, "VECTOR_MIN", vector_min)  # boundaries at once, or one by one
    monkeypatch.setattr(fold, "FIRST_RUN", first_run)  # the full-attention walk's runs
    rnd = random.Random(20261201 + vector_min)
    hits = 0
    for case in range(1500):
        index, keys, specs, chunk, ranks = random_case(rnd)
        want = old_lookup(index, NS, keys, specs, chunk, ranks)
        got = index.lookup(NS, keys, specs, chunk, ranks)
        assert got[0] == want[0], (case, specs, chunk, ranks)
        assert [id(o) for o in got[1]] == [id(o) for o in want[1]], (case, specs, chunk, ranks)
        hits += 0 < want[0] < len(keys)
    assert hits > 200  # most cases end inside the prompt: the fold had work to do


def test_fold_of_a_namespace_or_prompt_not_there():
    index = Index()
    spec = [GroupSpec(GroupKind.SLIDING, 4, 8)]
    assert index.lookup(NS, [key(0)], spec, 16, [0]) == (0, [])
    index.insert(obj(key(0), {0: (0, 0)}, 0, 0b1111, True))
    assert index.lookup(NS, [], spec, 16, [0]) == (0, [])
    assert index.lookup(NS, [key(0)], spec, 16, [0])[0] == 1


def test_huge_window_with_a_short_hit_is_linear():
    """A hostile LOOKUP: window 2^30, 65536 keys of which the first 200 are held. The old fold
    re-checked all 200 chunks at each of 65336 boundaries (``benchmarks/lookup_fold.py`` times both)."""
    index = Index()
    for i in range(200):
        index.insert(obj(key(i), {0: (0, 0)}, 0, 0b1111, True))
    keys = [key(i) for i in range(1 << 16)]
    spec = [GroupSpec(GroupKind.SLIDING, 4, 1 << 30)]
    hit, objs = index.lookup(NS, keys, spec, 16, [0])
    assert hit == 200 and [o.key for o in objs] == keys[:200]
