"""Faults under two ``tierd serve`` daemons (tests/l2_daemons.py): a master killed under a fetch,
a master that hangs, no master at all. Run by tests/l2_harness.py inside its network namespace.

Hazard first: a fault must never reach the engine as an error or a hang. Every wait here is
timed, so each scenario reports how long the daemon took to answer, not just what it answered.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from l2_daemons import URL, Daemon, Rank, keys, start


def master_killed(workdir: Path, started: list) -> dict:
    """B's RETRIEVE waits on its get while the master hangs, and the master is killed under it:
    exactly the L2 chunks' blocks come back failed, by the deadline; B stays healthy and answers
    from L1 at once; with a new master both daemons use L2 again; a hung master makes LOOKUPs
    late (answered from L1 by --l2-lookup-timeout-ms), never stuck."""
    master, a, b = start(workdir, started, ("a", ("--l2-policy", "write-through")), ("b", ()))
    ra, rb = Rank(a, "a0", "fp-kill", seed=5), Rank(b, "b0", "fp-kill", seed=6)
    started += [ra, rb]
    ks = keys("kill", 8)
    out = {"store_a": ra.store(ks), "src_a": ra.digests(8), "src_b": rb.digests(2)}
    a.drained()
    out["store_b"] = rb.store(ks[:2])  # B holds the first two chunks itself
    out["lookup"] = rb.lookup(ks, lease=False)  # no lease: nothing fetched before the RETRIEVE
    out["before"] = rb.digests(8, first_block=32)
    master.pause()
    t0 = time.monotonic()
    fut = b.client.retrieve_async(rb.inst, rb.chunks(ks, first_block=32), timeout=10)
    time.sleep(0.3)
    out["status_mid"] = b.status()["l2"]
    out["t_kill"] = master.kill() - t0
    out["retrieve"] = msgspec.to_builtins(fut.result())
    out["retrieve_s"] = time.monotonic() - t0
    out["dst"] = rb.digests(8, first_block=32)
    out["ping"] = msgspec.to_builtins(b.client.ping())
    t0 = time.monotonic()
    out["lookup_down"] = rb.lookup(ks, lease=False)
    out["lookup_down_s"] = time.monotonic() - t0
    out["status_down"] = b.status()
    master.start()
    out["reconnect"] = [b.connected(60)["l2"]["reconnects"], a.connected(60)["l2"]["reconnects"]]
    for attempt in range(40):  # a new master has no segment until every client mounted its own again
        new = keys(f"kill/after/{attempt}", 4)
        puts = a.status()["l2"]["writeback_puts"]
        ra.store(new, first_block=32)
        if a.drained()["l2"]["writeback_puts"] == puts + 4:
            break
        time.sleep(0.5)
    out["attempts"] = attempt + 1
    out["src_new"] = ra.digests(4, first_block=32)
    out["lookup_new"] = rb.lookup(new)
    out["retrieve_new"] = rb.retrieve(new, lease=out["lookup_new"]["lease"], first_block=48)
    out["dst_new"] = rb.digests(4, first_block=48)
    # b's link must be up when the master stops answering (on a loaded machine it was seen down,
    # and the LOOKUP was answered from L1 at once: lookups_skipped, not late)
    out["status_before_hung"] = b.connected(60)["l2"]
    master.pause()
    t0 = time.monotonic()
    out["lookup_hung"] = rb.lookup(keys("kill/hung", 4), lease=False)
    out["lookup_hung_s"] = time.monotonic() - t0
    master.resume()
    out["status_b"] = b.status()
    return out


def unreachable(workdir: Path, started: list) -> dict:
    """No master ever: the daemon serves L1 as without --l2-url; L2 says degraded, nothing fails."""
    d = Daemon(workdir, "a", url=URL + "&setup_timeout_s=1")
    started.append(d)
    d.wait(lambda s: s["l2"]["state"] == "degraded", 30, "degraded state")
    r = Rank(d, "a0", "fp-none", seed=7)
    started.append(r)
    ks = keys("none", 4)
    out = {"store": r.store(ks), "src": r.digests(4)}
    t0 = time.monotonic()
    out["lookup"] = r.lookup(ks + keys("none/miss", 2))
    out["lookup_s"] = time.monotonic() - t0
    out["retrieve"] = r.retrieve(ks, lease=out["lookup"]["lease"], first_block=32)
    out["dst"] = r.digests(4, first_block=32)
    out["status"] = d.status()
    return out
