"""How long a growth of the pool holds the daemon's main loop: backed on demand, or ahead.

    python benchmarks/pool_growth.py [--ceiling-gb 2] [--fill-gbps 2] [--rounds 2]

The pool's segments (tierd.pool.segments, the steps of a default ``tierd serve``: 64 MiB, then as
large as the pool already is, up to 1 GiB) are filled with 16 MiB blocks, as a store's slabs are
carved, at ``--fill-gbps`` (a pause after each block), until the ceiling; every allocation is
timed on the calling thread, which in the daemon is its main loop: while it runs, no LOOKUP, PING
or STORE of any engine is answered. ``on-demand`` backs each step in the allocation that needs it
(``--no-l1-grow-ahead``); ``ahead`` takes over memory backed on a thread of its own after the
previous growth (the default). The two alternate, round by round. Prints per mode the growths,
the longest allocation and the sum of the allocations that grew the pool.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.pool.segments import SegmentSet  # noqa: E402

MIB = 1 << 20
BLOCK = 16 * MIB


def fill(ceiling: int, ahead: bool, gbps: float) -> dict:
    s = SegmentSet(ceiling, 0, 1024 * MIB, 4096, grow_bytes=64 * MIB, ahead=ahead)
    try:
        longest, grew, growths = 0.0, 0.0, 0
        while True:
            segments = len(s.segments)
            t0 = time.perf_counter()
            got = s.alloc(BLOCK)
            took = time.perf_counter() - t0
            if got is None:
                break
            longest = max(longest, took)
            if len(s.segments) > segments:
                growths, grew = growths + 1, grew + took
            time.sleep(BLOCK / (gbps * 1e9))
        return {"growths": growths, "longest_s": longest, "growth_s": grew}
    finally:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ceiling-gb", type=float, default=2.0)
    ap.add_argument("--fill-gbps", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    ceiling = int(args.ceiling_gb * 1024) * MIB
    print(f"{args.ceiling_gb:g} GiB ceiling, filled with 16 MiB blocks at {args.fill_gbps:g} GB/s:")
    for r in range(args.rounds):
        for ahead in (False, True) if r % 2 == 0 else (True, False):
            f = fill(ceiling, ahead, args.fill_gbps)
            mode = "ahead" if ahead else "on-demand"
            print(
                f"  round {r + 1} {mode:9s}: {f['growths']} growths, longest allocation "
                f"{f['longest_s'] * 1e3:8.1f} ms, allocations that grew {f['growth_s'] * 1e3:8.1f} ms"
            )


if __name__ == "__main__":
    main()
