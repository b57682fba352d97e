"""A file-backed pool under store-heavy load, for the warm-restart tests, and its checker.

Every object's bytes, size, span and mask are a function of (namespace, key, rank, version),
and its label carries the version, so a checker that knows nothing of the writer's history can
tell whether a recovered object is exactly what was committed for it.

Run as a child: ``python pool_writer.py random DIR SEED`` stores, evicts, replaces, aborts,
touches, pins, saves and clears until it is killed; ``python pool_writer.py script DIR``
does a fixed sequence, prints what a restart must recover, and waits to be killed.
"""

from __future__ import annotations

import json
import random
import sys
import time
from hashlib import blake2b

import numpy as np

from tierd.pool import persist, slabs
from tierd.pool.pool import EXISTS, Pool

KIB = 1 << 10
CEILING = 3 << 20
SEGMENT = 1 << 20
ALIGN = 4 * KIB
META = {"separate_object_groups": True, "writer": 1}
NAMESPACES = (b"ns-model-a", b"ns-model-b")
KEYS = 120  # the writer's keys; tests add objects under KEYS..KEYS + SPARE - 1
SPARE = 16
RANKS = (0, 1)
# Object sizes come in phases of PHASE versions: each phase wants other size classes, so whole
# slabs move between classes (evicting theirs) at every phase change.
SIZES = ((12 * KIB, 20 * KIB, 36 * KIB), (36 * KIB, 64 * KIB, 100 * KIB), (100 * KIB, 300 * KIB, 12 * KIB))
PHASE = 400
SLAB_BYTES = 256 * KIB  # as pool_dirs.SLAB_BYTES: several size classes share 3 MiB


def open_pool(folder: str) -> Pool:
    """The writer's pool; callers shrink slabs to SLAB_BYTES first (tests: the small_slabs fixture)."""
    assert slabs.SLAB_TARGET_BYTES == SLAB_BYTES
    return Pool(CEILING, 0, ALIGN, SEGMENT, pool_dir=folder, meta=META)


def key(i: int) -> bytes:
    return b"page-hash-%06d" % i


def span_of(ns: bytes, k: bytes) -> dict:
    """A key's span: fixed per key, so a fuller copy can replace a partial one."""
    r = random.Random(ns + k)
    if r.random() < 0.3:  # one object for two groups (--no-separate-object-groups)
        return {0: (0, 0), 1: (4, 4 * KIB)}
    return {r.choice((0, 1, 2)): (0, 0)}


def size_of(ns: bytes, k: bytes, version: int) -> int:
    return random.Random(b"%s/%s/%d" % (ns, k, version // PHASE)).choice(SIZES[version // PHASE % len(SIZES)])


def mask_of(ns: bytes, k: bytes, rank: int, version: int, span: dict) -> int:
    r = random.Random(b"%s/%s/%d/%d" % (ns, k, rank, version))
    return sum(r.choice((0b1111, 0b1111, 0b0011, 0b0111)) << sh for sh, _ in span.values())


def pattern(ns: bytes, k: bytes, rank: int, version: int, nbytes: int) -> np.ndarray:
    seed = blake2b(b"%s/%s/%d/%d" % (ns, k, rank, version), digest_size=64).digest()
    return np.resize(np.frombuffer(seed, dtype=np.uint8), nbytes)


def check(pool: Pool) -> tuple[int, list[str]]:
    """(objects served, what is wrong with them): every (ns, key, group, rank) is looked up."""
    seen, wrong = set(), []
    for ns in NAMESPACES:
        for i in range(KEYS + SPARE):
            k = key(i)
            span = span_of(ns, k)
            for rank in RANKS:
                for g in span:
                    o = pool.find_ready(ns, k, g, rank)
                    if o is None or id(o) in seen:
                        continue
                    seen.add(id(o))
                    v = int(o.label[1:])
                    nbytes = size_of(ns, k, v)
                    if (o.nbytes, o.span, o.mask) != (nbytes, span, mask_of(ns, k, rank, v, span)):
                        wrong.append(f"{k!r} r{rank} v{v}: shape {o.nbytes}/{o.span}/{o.mask:b}")
                    elif not np.array_equal(o.view(), pattern(ns, k, rank, v, nbytes)):
                        wrong.append(f"{k!r} r{rank} v{v}: bytes differ")
    if len(seen) != pool.objects:
        wrong.append(f"{pool.objects} objects held, {len(seen)} reachable")
    return len(seen), wrong


def store(pool: Pool, ns: bytes, k: bytes, rank: int, version: int, pieces: int = 1):
    """begin_write + fill; the caller commits or aborts. None when not stored."""
    nbytes, span = size_of(ns, k, version), span_of(ns, k)
    obj = pool.begin_write(ns, k, span, rank, nbytes, mask_of(ns, k, rank, version, span), f"v{version}")
    if obj is None or obj is EXISTS:
        return None
    data, view = pattern(ns, k, rank, version, nbytes), obj.view()
    step = -(-nbytes // pieces)
    for at in range(0, nbytes, step):
        view[at : at + step] = data[at : at + step]
        if pieces > 1:
            time.sleep(0)  # let a kill land with the object half written
    return obj


def run_random(folder: str, seed: int) -> None:
    persist.COMPACT_MIN = 300  # checkpoints every few hundred records: kills land in them too
    print("opening", flush=True)
    pool = open_pool(folder)
    print("ready", json.dumps(pool.warm_restart), flush=True)
    r, version, pinned = random.Random(seed), seed * 10**7, []
    while True:
        op = r.random()
        ns = r.choice(NAMESPACES)
        keys = [key(r.randrange(KEYS)) for _ in range(r.randint(1, 4))]
        if op < 0.80:
            objs = []
            for k in keys:
                version += 1
                obj = store(pool, ns, k, r.choice(RANKS), version, pieces=r.choice((1, 2, 4)))
                if obj is not None:
                    objs.append(obj)
            (pool.commit if r.random() < 0.9 else pool.abort)(objs)
        elif op < 0.90:
            pool.touch(ns, keys)
        elif op < 0.96:
            pool.unpin(pinned)
            pinned = [o for k in keys if (o := pool.find_ready(ns, k, 0, 0)) is not None]
            pool.pin(pinned)
        elif op < 0.985:
            pool.save({"seed": seed, "version": version})
        elif op < 0.998:
            pool.note_extra({"seed": seed, "noted": version})
        else:
            pool.clear()


def run_script(folder: str) -> None:
    """Fill past the ceiling (evictions), replace a partial copy, leave writes in flight over
    evicted slots; print the (ns, key, rank, version) a restart must serve, least recent first."""
    pool = open_pool(folder)
    ns, version, live = NAMESPACES[0], 0, {}
    for i in range(KEYS):
        version += 1
        obj = store(pool, ns, key(i), 0, version)
        if obj is not None:
            pool.commit([obj])
            live[key(i)] = version
    stored = sorted(live, key=live.get)
    for k in stored:
        if pool.find_ready(ns, k, next(iter(span_of(ns, k))), 0) is None:
            del live[k]  # evicted
    in_flight = [o for i in range(KEYS, KEYS + 4) if (o := store(pool, NAMESPACES[1], key(i), 1, 10**6 + i))]
    for o in in_flight:
        o.view()[:] = 0xEE  # never committed: must not come back
    for k in stored:
        if k in live and pool.find_ready(ns, k, next(iter(span_of(ns, k))), 0) is None:
            del live[k]  # evicted by the in-flight writes
    order = sorted(live.items(), key=lambda kv: kv[1])
    print(json.dumps({"live": [[k.decode(), v] for k, v in order], "in_flight": len(in_flight)}), flush=True)
    time.sleep(60)


if __name__ == "__main__":
    slabs.SLAB_TARGET_BYTES = SLAB_BYTES
    if sys.argv[1] == "random":
        run_random(sys.argv[2], int(sys.argv[3]))
    else:
        run_script(sys.argv[2])
