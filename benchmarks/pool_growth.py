"""How long a growth of the pool holds the daemon's main loop: backed on demand, or ahead.

    python benchmarks/pool_growth.py [--ceiling-gb 2] [--fill-gbps 2] [--rounds 2]
    python benchmarks/pool_growth.py --daemon [--ceiling-gb 2] [--rounds 2]
    python benchmarks/pool_growth.py --ceiling-gb 12 --burst-mb 4096 --gap-s 3 [--rounds 2]

The pool's segments (tierd.pool.segments, the steps of a default ``tierd serve``: 64 MiB, then as
large as the pool already is, up to 1 GiB) are filled with 16 MiB blocks, as a store's slabs are
carved, at ``--fill-gbps`` (a pause after each block), until the ceiling; every allocation is
timed on the calling thread, which in the daemon is its main loop: while it runs, no LOOKUP, PING
or STORE of any engine is answered. ``on-demand`` backs each step in the allocation that needs it
(``--no-l1-grow-ahead``); ``ahead`` takes over memory backed on a thread of its own after the
previous growth (the default). The two alternate, round by round. Prints per mode the growths,
the longest allocation and the sum of the allocations that grew the pool.

``--burst-mb``: the pool is filled in bursts (a large model's prompt stores GiBs at once), with
``--gap-s`` of rest between them (the next prompt's prefill); ``ahead-1`` backs one step ahead (as
tierd did before the look-ahead deepened), ``ahead`` one more step each time a growth found its
step still being backed. Prints besides what the allocations of every burst after the first took:
the main loop's time, which the engine's stores wait through.

``--daemon``: what an engine sees instead. A private ``tierd serve`` (``--no-l1-grow-ahead`` or
not) is filled to its ceiling over the wire at ``--fill-gbps``, STOREs of 16 one-MiB chunks from
shared memory, while a second client PINGs it every 2 ms; prints the PINGs' p50, p99 and longest
round trip. A PING or STORE that fails, or a fill that stops storing, ends the run with the error:
the PINGs answered before it would leave out the very stall measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.pool.segments import SegmentSet  # noqa: E402

MIB = 1 << 20
BLOCK = 16 * MIB


MODES = {"on-demand": (False, 1), "ahead-1": (True, 1), "ahead": (True, None)}  # (ahead, max steps)


def fill(ceiling: int, mode: str, gbps: float, burst: int = 0, gap_s: float = 0.0) -> dict:
    """Blocks allocated until the ceiling, each timed; ``burst``: that many bytes at once, then
    ``gap_s`` of rest (a prompt's stores, then the next prompt's prefill), else one block at a time
    at ``gbps``. ``later_bursts_s``: what the allocations of every burst after the first spent."""
    ahead, steps = MODES[mode]
    kw = {} if steps is None else {"max_ahead": steps}
    s = SegmentSet(ceiling, 0, 1024 * MIB, 4096, grow_bytes=64 * MIB, ahead=ahead, **kw)
    try:
        longest, grew, growths, later, done = 0.0, 0.0, 0, 0.0, 0
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
            done += BLOCK
            if burst:
                later += took if done > burst else 0.0
                if done % burst == 0:
                    time.sleep(gap_s)
            else:
                time.sleep(BLOCK / (gbps * 1e9))
        return {"growths": growths, "longest_s": longest, "growth_s": grew, "later_bursts_s": later}
    finally:
        s.close()


def serve(ceiling: int, ahead: bool, gbps: float) -> dict:
    """PING round trips while a real daemon's pool is filled to ``ceiling`` (module doc)."""
    from tierd.tools.testing import ServeProcess
    from tierd_client import TierdClient
    from tierd_client.layouts import block_span, group, layout, namespace
    from tierd_client.shm import SharedBuffer

    nb, bb = 16, MIB
    with tempfile.TemporaryDirectory(prefix="tierd-pg-") as folder:
        args = ["--l1-grow-mb", "64"] + ([] if ahead else ["--no-l1-grow-ahead"])
        d = ServeProcess(folder, *args, pool_mb=ceiling / MIB, http_port=-1, log_level="warning")
        buf = SharedBuffer(nb * bb)
        writer, pinger = TierdClient(d.endpoint, timeout_s=30), TierdClient(d.endpoint, timeout_s=30)
        try:
            writer.wait_ready(10)
            pinger.wait_ready(10)
            spans = [block_span((nb, bb), (bb, 1), 1, 0, tensor=0, offset=0)]
            ns = namespace("growth", uuid.uuid4().hex)
            writer.register("w", layout(ns, 0, 16, [buf.ref()], [group("full", 16, spans)]))
            pings, done, failed = [], threading.Event(), []

            def ping() -> None:
                try:
                    while not done.is_set():
                        t0 = time.perf_counter()
                        pinger.ping()
                        pings.append(time.perf_counter() - t0)
                        time.sleep(0.002)
                except BaseException as exc:  # noqa: BLE001 - raised again below, after the join
                    failed.append(exc)

            th = threading.Thread(target=ping)
            th.start()
            try:
                stored = 0
                while stored < ceiling and not failed:
                    chunks = [{"key": uuid.uuid4().bytes, "blocks": [[j]]} for j in range(nb)]
                    t0 = time.perf_counter()
                    res = writer.store("w", chunks)
                    if "stored" not in res.results:
                        got = res.results
                        raise RuntimeError(f"a STORE stored nothing at {stored / MIB:.0f} MiB: {got}")
                    stored += bb * res.results.count("stored")
                    time.sleep(max(0.0, nb * bb / (gbps * 1e9) - (time.perf_counter() - t0)))
            finally:
                done.set()
                th.join()
            if failed:
                raise RuntimeError(f"a PING failed after {len(pings)} answered: {failed[0]!r}") from failed[0]
        finally:
            writer.close()
            pinger.close()
            buf.close()
            d.kill()
    pings.sort()
    return {
        "pings": len(pings),
        "p50": statistics.median(pings),
        "p99": pings[int(len(pings) * 0.99)],
        "max": pings[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ceiling-gb", type=float, default=2.0)
    ap.add_argument("--fill-gbps", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--daemon", action="store_true", help="PINGs to a real daemon while it fills")
    ap.add_argument(
        "--burst-mb",
        type=int,
        default=0,
        help="without --daemon: fill in bursts of this many MiB at once (a prompt's stores), --gap-s apart "
        "(the next prompt's prefill), and compare the look-ahead of one step (ahead-1) with the one that "
        "deepens after a burst outran it (ahead)",
    )
    ap.add_argument("--gap-s", type=float, default=1.0)
    args = ap.parse_args()
    if args.burst_mb % (BLOCK // MIB):
        ap.error(f"--burst-mb is a multiple of {BLOCK // MIB}")
    ceiling = int(args.ceiling_gb * 1024) * MIB
    if args.daemon:
        head = (
            f"tierd serve, {args.ceiling_gb:g} GiB ceiling filled by STOREs of 16 MiB at {args.fill_gbps:g} "
            "GB/s; PINGs every 2 ms:"
        )
    elif args.burst_mb:
        head = (
            f"{args.ceiling_gb:g} GiB ceiling, filled in bursts of {args.burst_mb} MiB of 16 MiB blocks, "
            f"{args.gap_s:g} s apart:"
        )
    else:
        head = f"{args.ceiling_gb:g} GiB ceiling, filled with 16 MiB blocks at {args.fill_gbps:g} GB/s:"
    print(head)
    modes = list(MODES) if args.burst_mb else ["on-demand", "ahead"]
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            if args.daemon:
                f = serve(ceiling, MODES[mode][0], args.fill_gbps)
                line = (
                    f"{f['pings']} PINGs, p50 {f['p50'] * 1e3:.2f} ms, p99 {f['p99'] * 1e3:.1f} ms, "
                    f"longest {f['max'] * 1e3:.1f} ms"
                )
            else:
                f = fill(ceiling, mode, args.fill_gbps, args.burst_mb * MIB, args.gap_s)
                line = (
                    f"{f['growths']} growths, longest allocation {f['longest_s'] * 1e3:8.1f} ms, "
                    f"allocations that grew {f['growth_s'] * 1e3:8.1f} ms"
                )
                if args.burst_mb:
                    line += f", bursts after the first {f['later_bursts_s'] * 1e3:8.1f} ms"
            print(f"  round {r + 1} {mode:9s}: {line}")


if __name__ == "__main__":
    main()
