"""Warm restart of a real ``tierd serve --pool-dir``: restart-to-first-hit and recovered objects.

    python benchmarks/daemon_restart.py [--pool-gib 4] [--object-mib 2] [--dir /dev/shm/tierd-bench-restart]
        [--json]

Fills the pool through the protocol (STORE of a synthetic 32-layer layout; object bytes a function
of the key for a sample of chunks, checked after each restart), then: a planned restart (SIGTERM,
index written, new process) after a crash restart (SIGKILL, journal replayed). Each reports the
stop time, the new process's time to a LOOKUP hit measured from its exec (interpreter start,
recovery, socket bind, HELLO, REGISTER, LOOKUP), the daemon's own ``warm_restart.seconds``, and
the objects and bytes it recovered. The per-GiB and per-object parts are extrapolated to 1 TiB.
A restart that does not serve the probe within --hit-timeout-s, a daemon that exits, or a sample
chunk that comes back missing or with other bytes ends the run with the error and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.tools.testing import ServeProcess  # noqa: E402
from tierd_client import TierdClient  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
LAYERS, BLOCKS_PER_CHUNK, BATCH, SAMPLE = 32, 16, 8, 8


class Daemon(ServeProcess):
    """``tierd serve --pool-dir`` (tierd/tools/testing.py's launcher); ``start`` returns its exec time."""

    def __init__(self, folder: str, pool_gib: float, tmp: str):
        super().__init__(
            tmp, "--pool-dir", folder, "--cuda", "off", pool_mb=pool_gib * 1024, log_level=None, start=False
        )

    def start(self, wait: bool = False) -> float:
        t0 = time.perf_counter()
        super().start(wait=wait)
        return t0

    def stop(self, sig: int) -> float:
        t0 = time.perf_counter()
        super().stop(sig, timeout=600)
        return time.perf_counter() - t0


def chunk(key: bytes, slot: int) -> dict:
    return {"key": key, "blocks": [list(range(slot * BLOCKS_PER_CHUNK, (slot + 1) * BLOCKS_PER_CHUNK))]}


def first_hit(d: Daemon, t0: float, lay: dict, probe: bytes, spec: list, timeout_s: float) -> float:
    """Seconds from ``t0`` (exec) until a fresh client's LOOKUP of ``probe`` hits; an error once the
    daemon has exited or ``timeout_s`` has passed without a hit."""
    deadline = time.perf_counter() + timeout_s

    def alive() -> None:
        if d.proc.poll() is not None:
            raise RuntimeError(f"the restarted daemon exited ({d.proc.returncode}) before a LOOKUP hit")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"no LOOKUP hit of the probe {timeout_s:.0f} s after the restart")

    while True:
        c = None
        try:
            c = TierdClient(d.endpoint, timeout_s=30, name="bench-restart", connect_timeout_s=0.5)
            c.wait_ready(60)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if c is not None:
                c.close()
            alive()
            time.sleep(0.01)
    try:
        c.register("bench", lay)
        while not c.lookup(lay["namespace"], [probe], spec, BLOCKS_PER_CHUNK * 16, lease=False).chunks:
            alive()
            time.sleep(0.01)
        return time.perf_counter() - t0
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--object-mib", type=float, default=2.0)
    ap.add_argument("--dir", default="/dev/shm/tierd-bench-restart")
    ap.add_argument("--hit-timeout-s", type=float, default=600.0, help="restart to first hit, at most")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    block_bytes = int(args.object_mib * MIB) // (LAYERS * BLOCKS_PER_CHUNK)
    nblocks = BATCH * BLOCKS_PER_CHUNK
    shutil.rmtree(args.dir, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix="tierd-bench-restart-")
    buf = SharedBuffer(LAYERS * nblocks * block_bytes)
    kv = buf.array.reshape(LAYERS, nblocks, block_bytes)
    spans = [
        block_span((nblocks, block_bytes), (block_bytes, 1), 1, 0, tensor=0, offset=l * nblocks * block_bytes)
        for l in range(LAYERS)
    ]
    ns = namespace("bench-restart", "f0", 1)
    lay = layout(ns, 0, BLOCKS_PER_CHUNK * 16, [buf.ref()], [group("full", 16, spans)])
    spec = [{"kind": "full", "block_tokens": 16, "window_tokens": 0}]
    d = Daemon(args.dir, args.pool_gib, tmp)
    out = {"pool_gib": args.pool_gib, "object_bytes": block_bytes * LAYERS * BLOCKS_PER_CHUNK}
    try:
        d.start()
        c = TierdClient(d.endpoint, timeout_s=60)
        c.wait_ready(60)
        c.register("bench", lay)
        i, t0, sample = 0, time.perf_counter(), {}
        rng = np.random.default_rng(1)
        while True:
            ks = [b"bench-key-%08d" % (i + j) for j in range(BATCH)]
            if i < SAMPLE * BATCH and i % BATCH == 0:  # distinct bytes for the sample checked later
                kv[:] = rng.integers(0, 255, kv.shape, dtype=np.uint8)
                sample[i] = (ks, kv.copy())
            res = c.store("bench", [chunk(k, s) for s, k in enumerate(ks)]).results
            i += BATCH
            st = d.status()
            if (
                "rejected" in res
                or st["memory_used_bytes"] + BATCH * out["object_bytes"] > st["memory_configured_bytes"]
            ):
                break  # full, nothing evicted: every sample chunk is still held
        out["fill_s"] = time.perf_counter() - t0
        c.close()
        st = d.status()
        out["objects"], out["used_gib"] = st["objects"], st["memory_used_bytes"] / GIB
        probe = sample[max(sample)][0][-1]  # recent: never evicted
        for kind, sig in (("crash", signal.SIGKILL), ("planned", signal.SIGTERM)):  # crash first: all journal
            r = {"stop_s": d.stop(sig)}
            t0 = d.start()
            r["first_hit_s"] = first_hit(d, t0, lay, probe, spec, args.hit_timeout_s)
            wr = d.status()["warm_restart"]
            r.update(
                warm=wr["warm"],
                objects=wr["objects"],
                gib=wr["bytes"] / GIB,
                recover_s=wr["seconds"],
                journal_records=wr["journal_records"],
            )
            c = TierdClient(d.endpoint, timeout_s=60)
            c.wait_ready(60)
            c.register("bench", lay)
            wrong = missing = 0
            for ks, data in sample.values():
                kv[:] = 0
                got = c.retrieve("bench", [chunk(k, s) for s, k in enumerate(ks)])
                for s, ok in enumerate(got.ok):
                    blk = slice(s * BLOCKS_PER_CHUNK, (s + 1) * BLOCKS_PER_CHUNK)
                    missing += not ok
                    wrong += ok and not np.array_equal(kv[:, blk], data[:, blk])
            c.close()
            if wrong or missing:  # the sample was held when the daemon stopped: all of it comes back
                raise RuntimeError(
                    f"after the {kind} restart, of {SAMPLE * BATCH} sample chunks {missing} were not "
                    f"served and {wrong} came back with other bytes"
                )
            r["sample_wrong"] = wrong
            out[kind] = r
        obj = out["planned"]["objects"]
        per_gib = out["planned"]["recover_s"] / max(out["planned"]["gib"], 1e-9)
        out["extrapolated_1tib_recover_s"] = per_gib * 1024
        out["extrapolated_1tib_objects"] = int(obj * 1024 / max(out["planned"]["gib"], 1e-9))
    finally:
        if d.proc and d.proc.poll() is None:
            d.stop(signal.SIGTERM)
        buf.close()
        shutil.rmtree(args.dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(
        f"pool {out['pool_gib']:g} GiB filled with {out['objects']} objects of "
        f"{out['object_bytes'] / MIB:g} MiB ({out['used_gib']:.2f} GiB) in {out['fill_s']:.1f} s"
    )
    for kind in ("crash", "planned"):
        r = out[kind]
        print(
            f"{kind:8s}: stop {r['stop_s']:.2f} s; exec to first LOOKUP hit {r['first_hit_s']:.2f} s "
            f"(recovery {r['recover_s']:.3f} s: {r['objects']} objects, {r['gib']:.2f} GiB, "
            f"{r['journal_records']} journal records); sample chunks wrong: {r['sample_wrong']}"
        )
    print(
        f"1 TiB at this object size: ~{out['extrapolated_1tib_objects']} objects, "
        f"recovery ~{out['extrapolated_1tib_recover_s']:.0f} s (linear in GiB and objects)"
    )


if __name__ == "__main__":
    main()
