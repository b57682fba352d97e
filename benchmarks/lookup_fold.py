"""LOOKUP's fold in Index.lookup, old (quadratic) vs new (linear), in the same run.

    python benchmarks/lookup_fold.py [--repeats 7] [--old-limit-s 120] [--json]

A hostile client's LOOKUP: a sliding-window group with window_tokens 2^30 and 3k / 20k / 65k keys
(65536 = MAX_CHUNKS), every chunk held or only the first 200; and the same with a full-attention
group in front (a hybrid model). One rank, 16-token chunks of 4 blocks, fresh key objects per
LOOKUP (as decoded from the wire), the garbage collector frozen as in the daemon. The old fold is
tests/unit/test_lookup_fold.py's ``old_lookup`` (the code this replaced); it runs once where it takes
seconds, and is skipped where its estimate passes --old-limit-s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests")]

from test_lookup_fold import old_lookup  # noqa: E402

from tierd.pool.index import Index, Obj  # noqa: E402
from tierd.protocol.layout import GroupKind, GroupSpec  # noqa: E402

NS = b"bench-namespace"
CHUNK = 16
SLIDE = GroupSpec(GroupKind.SLIDING, 4, 1 << 30)
FULL = GroupSpec(GroupKind.FULL, 4)


def build(nkeys: int, present: int, ngroups: int) -> tuple[Index, list[bytes]]:
    index = Index()
    keys = [os.urandom(16) for _ in range(nkeys)]
    spans = [{g: (0, 0)} for g in range(ngroups)]
    for k in keys[:present]:
        for g in range(ngroups):
            o = Obj(NS, k, spans[g], 0, 4096, 0b1111, f"g{g}")
            o.ready, o.pins = True, 0
            index.insert(o)
    return index, keys


def timed(fn, keys, repeats: int) -> tuple[list[float], tuple]:
    out, result = [], None
    for _ in range(repeats):
        fresh = [bytes(bytearray(k)) for k in keys]  # new objects, as a decoded request carries
        t = time.perf_counter()
        result = fn(fresh)
        out.append(time.perf_counter() - t)
    return out, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--old-limit-s", type=float, default=120.0, help="skip the old fold where it would take longer"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for specs, label in (([SLIDE], "sliding 2^30"), ([FULL, SLIDE], "full + sliding 2^30")):
        for nkeys in (3000, 20000, 65536):
            for present in (nkeys, 200):
                index, keys = build(nkeys, present, len(specs))
                gc.collect()
                gc.freeze()
                new = lambda ks, index=index, specs=specs: index.lookup(NS, ks, specs, CHUNK, [0])
                old = lambda ks, index=index, specs=specs: old_lookup(index, NS, ks, specs, CHUNK, [0])
                new_t, new_r = timed(new, keys, args.repeats)
                row = {
                    "groups": label,
                    "keys": nkeys,
                    "present": present,
                    "hit": new_r[0],
                    "new_ms_min": round(min(new_t) * 1e3, 2),
                    "new_ms_median": round(statistics.median(new_t) * 1e3, 2),
                }
                # the old fold: one pass over the lookback per boundary walked down
                walked = nkeys - present if len(specs) == 1 else 0
                estimate = 1.6e-6 * walked * present + 3e-6 * nkeys
                if estimate <= args.old_limit_s:
                    reps = 1 if estimate > 0.5 else args.repeats
                    old_t, old_r = timed(old, keys, reps)
                    assert old_r[0] == new_r[0] and [id(o) for o in old_r[1]] == [id(o) for o in new_r[1]]
                    row.update(
                        old_ms_min=round(min(old_t) * 1e3, 2),
                        old_runs=reps,
                        speedup=round(min(old_t) / min(new_t), 1),
                    )
                gc.unfreeze()
                rows.append(row)
                if not args.json:
                    old = f"old {row['old_ms_min']:>10.2f} ms" if "old_ms_min" in row else "old    skipped"
                    print(
                        f"{label:22} keys {nkeys:>6} present {present:>6} hit {row['hit']:>6}  "
                        f"new {row['new_ms_min']:>7.2f} ms (median {row['new_ms_median']:>7.2f})  {old}",
                        flush=True,
                    )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
