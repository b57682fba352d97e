"""LOOKUP latency with a large index, and the daemon's metadata cost per million objects.

    python benchmarks/lookup_latency.py [--objects 1000000] [--prompt-tokens 32768] [--json]

A private ``tierd serve`` is filled through the real protocol with ``--objects`` tiny objects
(one 64-byte block each), then a 32k-token prompt is looked up over and over, as its keys would
arrive from an engine: with 16-token chunks (2048 keys a LOOKUP) and with 256-token chunks (128
keys), hit and miss. Latency is client-side round trip (socket, msgpack, the fold), p50/p99.
Metadata overhead is the daemon's RSS growth minus the pool memory backed meanwhile. This
process plays the engine's scheduler: once the daemon is filled its heap is frozen (``gc.freeze``)
as vLLM's EngineCore freezes its startup heap (``--no-freeze-gc``: not).

Every round trip is measured three ways, alternately request by request: on the lookup channel
(docs/protocol.md section 2.1; a default TierdClient), on ZeroMQ alone
(``TierdClient(lookup_channel=False)``, the ``zmq`` figures) and on the channel by a caller that
sleeps in poll() at once (``TierdClient(spin_s=0)``, the ``no_spin`` figures; the default reads its
reply spinning for up to tierd_client.transport.SPIN_S first). ``--busy-poll-us`` is passed to the
daemon (its main loop polls without sleeping that long after each request). Baselines of the same
run, to read the latencies against: ``floor_echo_*``, a bare pyzmq ROUTER that polls and echoes each frame
(another process, the same ipc transport, a frame of the LOOKUP's size; what any Python daemon's
round trip costs before it does anything), ``floor_channel_echo_*``, the same over a Unix
seqpacket socket, and ``ping``, TierdClient.ping() to this daemon. ``daemon_mean_ms`` next to
each LOOKUP figure is the daemon's own time per LOOKUP, both ways together (its
``tierd_op_seconds`` histogram, from the request's receipt to its reply's send), and
``daemon_over_0.3ms``/``daemon_over_1ms`` the share of them that histogram put over 0.3 ms and
1 ms (its tail, against the round trip's p99): the rest of the round trip is the wire and the two
event loops.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import queue
import re
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tierd.protocol import codec  # noqa: E402
from tierd.tools.bench.common import private_daemon  # noqa: E402
from tierd_client import TierdClient  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.shm import SharedBuffer  # noqa: E402

BLOCK_BYTES = 64


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def percentiles(samples: list[float]) -> dict:
    a = np.asarray(samples) * 1e3
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 4),
        "p99_ms": round(float(np.percentile(a, 99)), 4),
        "mean_ms": round(float(a.mean()), 4),
        "n": len(samples),
    }


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def op_seconds(port: int, op: str) -> tuple[float, int, dict[float, int]]:
    """(sum, count, {bucket bound: count at or under it}) of the daemon's tierd_op_seconds
    histogram for ``op``, from /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    total, count, under = 0.0, 0, {}
    for line in text.splitlines():
        if f'op="{op}"' not in line:
            continue
        if line.startswith("tierd_op_seconds_sum{"):
            total = float(line.split()[-1])
        elif line.startswith("tierd_op_seconds_count{"):
            count = int(float(line.split()[-1]))
        elif line.startswith("tierd_op_seconds_bucket{"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            if le != "+Inf":
                under[float(le)] = int(float(line.split()[-1]))
    return total, count, under


def _echo(endpoint: str, ready) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    ready.set()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        poller.poll(1000)
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if parts[-1].bytes == b"stop":
                return
            sock.send_multipart([parts[0].bytes, parts[-1]], zmq.NOBLOCK)


def _channel_echo(sock) -> None:
    buf = bytearray(1 << 20)
    while True:
        n = sock.recv_into(buf)
        if n <= 4 and bytes(buf[:n]) == b"stop":
            return
        sock.send(memoryview(buf)[:n])


def round_trips(send, recv, frame: bytes, repeats: int, warmup: int = 50) -> dict:
    """Percentiles of ``send(frame); recv()`` timed ``repeats`` times, after ``warmup`` untimed."""
    lat = []
    for i in range(repeats + warmup):
        t = time.perf_counter()
        send(frame)
        recv()
        if i >= warmup:
            lat.append(time.perf_counter() - t)
    return percentiles(lat)


def channel_echo_floor(frame_bytes: int, repeats: int) -> dict:
    """Round trips of a ``frame_bytes`` frame through a seqpacket echo in another process."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = multiprocessing.get_context("fork").Process(target=_channel_echo, args=(theirs,), daemon=True)
    proc.start()
    theirs.close()
    buf = bytearray(1 << 20)
    try:
        figures = round_trips(ours.send, lambda: ours.recv_into(buf), os.urandom(frame_bytes), repeats)
        ours.send(b"stop")
    finally:
        ours.close()
        proc.join(5)
    return figures


def echo_floor(frame_bytes: int, repeats: int) -> dict:
    """Round trips of a ``frame_bytes`` frame through a bare pyzmq ROUTER echo in another process."""
    import zmq

    folder = tempfile.mkdtemp(prefix="tierd-echo-")
    endpoint = f"ipc://{folder}/echo.sock"
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_echo, args=(endpoint, ready), daemon=True)
    proc.start()
    if not ready.wait(10):
        proc.kill()
        raise RuntimeError(f"the echo process did not bind {endpoint} in 10 s (exit {proc.exitcode})")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        figures = round_trips(sock.send, sock.recv, os.urandom(frame_bytes), repeats)
        sock.send(b"stop")
    finally:
        sock.close()
        proc.join(5)
        shutil.rmtree(folder, ignore_errors=True)
    return figures


NBLOCKS = 4096
SPECS = [{"kind": "full", "block_tokens": 16, "window_tokens": 0}]


def _engine(endpoint: str, ns: dict, keys: list, chunk_tokens: int, repeats: int, go, out) -> None:
    """One of ``--engines`` processes: leased LOOKUPs (as the connector's) back to back once ``go``
    is set, each lease released, alternately on a default client and on one that sleeps at once
    (``spin_s=0``); both clients' round trips go to ``out``."""
    gc.freeze()
    clients = [
        TierdClient(endpoint, timeout_s=120, name="lookup-bench-engine"),
        TierdClient(endpoint, timeout_s=120, name="lookup-bench-engine-asleep", spin_s=0),
    ]
    try:
        for client in clients:
            client.wait_ready(30)
            client.lookup(ns, keys, SPECS, chunk_tokens, lease=False)
        go.wait()
        lat: list[list[float]] = [[], []]
        for _ in range(repeats):
            for client, times in zip(clients, lat):
                t = time.perf_counter()
                r = client.lookup(ns, keys, SPECS, chunk_tokens, lease=True)
                times.append(time.perf_counter() - t)
                client.release(r.lease)
        out.put(lat)
    finally:
        for client in clients:
            client.close()


def engines(endpoint: str, ns: dict, keys: list, chunk_tokens: int, n: int, repeats: int) -> dict:
    """``n`` engine processes looking up the same prompt at once (``_engine``): the LOOKUP round
    trip while the daemon serves the others' requests too (``no_spin``: of the clients that sleep
    at once, alternated with the default ones in each process)."""
    mp = multiprocessing.get_context("spawn")
    go, out = mp.Event(), mp.Queue()
    args = (endpoint, ns, keys, chunk_tokens, repeats, go, out)
    procs = [mp.Process(target=_engine, args=args) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    go.set()
    got = []
    deadline = time.monotonic() + 600
    while len(got) < n:  # an engine that fails is an error now, not a wait of 600 s
        try:
            got.append(out.get(timeout=1))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(
                    f"engine processes failed (exit codes {dead}) or gave no figures in 600 s"
                ) from None
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"engine processes exited with {[p.exitcode for p in procs]}")
    spun = [x for lat in got for x in lat[0]]
    slept = percentiles([x for lat in got for x in lat[1]])
    return {**percentiles(spun), "lookups_per_s": round(2 * len(spun) / wall), "no_spin": tails(slept)}


def tails(figures: dict) -> dict:
    """The p50 and p99 of ``percentiles``' figures: a baseline printed next to the main ones."""
    return {k: figures[k] for k in ("p50_ms", "p99_ms")}


def _span():
    return block_span((NBLOCKS, BLOCK_BYTES), (BLOCK_BYTES, 1), 1, 0, tensor=0, offset=0)


def fill(client, buf, ns, prompt_keys: list, objects: int, batch: int, show: bool = True) -> None:
    """Register a layout of 16-token chunks (one block each) in ``ns`` and store ``objects``
    objects through the protocol: the prompt's keys first, then random ones."""
    client.register("fill", layout(ns, 0, 16, [buf.ref()], [group("full", 16, [_span()])]))
    stored = 0
    while stored < objects:
        n = min(batch, objects - stored)
        if stored == 0:
            ks = prompt_keys + [uuid.uuid4().bytes for _ in range(n - len(prompt_keys))]
        else:
            ks = [uuid.uuid4().bytes for _ in range(n)]
        chunks = [{"key": k, "blocks": [[(stored + j) % NBLOCKS]]} for j, k in enumerate(ks)]
        res = client.store("fill", chunks)
        assert res.results.count("stored") == n, res.results[:4]
        stored += n
        if show:
            print(f"\rfilled {stored:,}/{objects:,} objects", end="", file=sys.stderr, flush=True)
    if show:
        print(file=sys.stderr)


def fill_256(client, buf, ns, keys: list) -> None:
    """The same prompt in 256-token chunks (16 blocks each), in a second namespace."""
    client.register("fill256", layout(ns, 0, 256, [buf.ref()], [group("full", 16, [_span()])]))
    res = client.store("fill256", [{"key": k, "blocks": [list(range(16))]} for k in keys])
    assert res.results.count("stored") == len(keys), res.results[:4]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8192, help="chunks per STORE while filling")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--engines",
        type=int,
        default=4,
        help="then this many engine processes look up the 2048-key prompt at once, leased (0: not)",
    )
    ap.add_argument(
        "--no-freeze-gc",
        dest="freeze_gc",
        action="store_false",
        help="leave this (the engine's) process's startup heap to Python's cyclic GC; by default it "
        "is frozen once the daemon is filled, as vLLM's EngineCore freezes its own at start "
        "(a full collection of this process's ~29k objects takes ~7 ms)",
    )
    ap.add_argument(
        "--busy-poll-us",
        type=int,
        default=None,
        help="the daemon's --busy-poll-us (default: its own default)",
    )
    args = ap.parse_args()

    pool = args.objects * BLOCK_BYTES * 2 + (64 << 20)
    results: dict = {"objects": args.objects, "prompt_tokens": args.prompt_tokens}
    port = free_port()
    extra = ("--l1-align-bytes", "64", "--l1-segment-mb", "256", "--http-port", str(port))
    if args.busy_poll_us is not None:
        extra += ("--busy-poll-us", str(args.busy_poll_us))
    results["daemon_busy_poll_us"] = args.busy_poll_us
    with private_daemon(pool, extra) as endpoint:
        client = TierdClient(endpoint, timeout_s=120, name="lookup-bench")
        client.wait_ready(30)
        plain = TierdClient(endpoint, timeout_s=120, name="lookup-bench-zmq", lookup_channel=False)
        plain.wait_ready(30)
        asleep = TierdClient(endpoint, timeout_s=120, name="lookup-bench-asleep", spin_s=0)
        asleep.wait_ready(30)
        pid = client.server.pid
        buf = SharedBuffer(NBLOCKS * BLOCK_BYTES)
        try:
            ns = namespace("lookup-bench", uuid.uuid4().hex[:8])
            specs = SPECS
            rss0, backed0 = rss_bytes(pid), client.status()["memory_total_bytes"]
            keys_prompt = [uuid.uuid4().bytes for _ in range(args.prompt_tokens // 16)]
            t0 = time.perf_counter()
            fill(client, buf, ns, keys_prompt, args.objects, args.batch, show=not args.json)
            fill_s = time.perf_counter() - t0
            status = client.status()
            time.sleep(0.5)
            rss1 = rss_bytes(pid)
            results["fill_s"] = round(fill_s, 2)
            results["fill_objects_per_s"] = round(args.objects / fill_s)
            results["daemon_rss_growth_bytes"] = rss1 - rss0
            results["pool_used_bytes"] = status["memory_used_bytes"]
            results["pool_backed_growth_bytes"] = status["memory_total_bytes"] - backed0
            # the pool's backed segments are resident too (pre-touched shared memory): not metadata
            overhead = max(0, rss1 - rss0 - (status["memory_total_bytes"] - backed0))
            results["metadata_bytes_per_object"] = round(overhead / args.objects, 1)
            results["metadata_mib_per_million_objects"] = round(overhead / args.objects * 1e6 / 2**20, 1)
            if args.freeze_gc:
                gc.collect()
                gc.freeze()
            results["client_gc_frozen"] = args.freeze_gc

            def alternate(call, after=None) -> dict:
                """``call(c)`` on the channel's client, the plain one and the sleeping one in turn,
                timed; then ``after(c, result)``, not timed."""
                lat: dict = {client: [], plain: [], asleep: []}
                for _ in range(args.repeats):
                    for c in (client, plain, asleep):
                        t = time.perf_counter()
                        r = call(c)
                        lat[c].append(time.perf_counter() - t)
                        if after is not None:
                            after(c, r)
                return {
                    **percentiles(lat[client]),
                    "zmq": tails(percentiles(lat[plain])),
                    "no_spin": tails(percentiles(lat[asleep])),
                }

            def measure(keys, chunk_tokens, lease, space=ns):
                got = []

                def done(c, r):
                    got.append(r.chunks)
                    if r.lease:
                        c.release(r.lease)

                s0, n0, u0 = op_seconds(port, "LOOKUP")
                figures = alternate(lambda c: c.lookup(space, keys, specs, chunk_tokens, lease=lease), done)
                s1, n1, u1 = op_seconds(port, "LOOKUP")
                assert len(set(got)) == 1, set(got)  # both ways, the same answer
                n = max(1, n1 - n0)
                daemon = round((s1 - s0) / n * 1e3, 4)
                # the daemon's own tail, to read the round trip's p99 against: the share of these
                # LOOKUPs its histogram put over 0.3 ms and over 1 ms (receipt to reply)
                over = {
                    f"daemon_over_{label}": round(1 - (u1.get(le, 0) - u0.get(le, 0)) / n, 4)
                    for le, label in ((3e-4, "0.3ms"), (1e-3, "1ms"))
                }
                return got[0], {**figures, "daemon_mean_ms": daemon, **over}

            hit, results["lookup_2048_keys_hit"] = measure(keys_prompt, 16, False)
            assert hit == len(keys_prompt), hit
            results["lookup_2048_keys_hit"]["chunks"] = hit
            miss_keys = [uuid.uuid4().bytes for _ in keys_prompt]
            _, results["lookup_2048_keys_miss"] = measure(miss_keys, 16, False)
            _, results["lookup_2048_keys_hit_with_lease"] = measure(keys_prompt, 16, True)
            # 256-token chunks: 128 keys for the same prompt (a second namespace of 16-block chunks)
            ns2 = namespace("lookup-bench-256", uuid.uuid4().hex[:8])
            keys128 = [uuid.uuid4().bytes for _ in range(args.prompt_tokens // 256)]
            fill_256(client, buf, ns2, keys128)
            hit, results["lookup_128_keys_hit"] = measure(keys128, 256, False, ns2)
            assert hit == len(keys128)
            t = time.perf_counter()
            n = 0
            while time.perf_counter() - t < 2.0:
                client.lookup(ns2, keys128, specs, 256, lease=False)
                n += 1
            results["lookups_per_s_128_keys_sequential"] = round(n / (time.perf_counter() - t))
            if args.engines:
                results[f"lookup_2048_keys_hit_with_lease_{args.engines}_engines"] = engines(
                    endpoint, ns, keys_prompt, 16, args.engines, args.repeats
                )
            results["ping"] = alternate(lambda c: c.ping())
            results["requests_on_the_channel"] = client.status()["lookup_channel"]["requests"]
            for name, keys in (("128", keys128), ("2048", keys_prompt)):
                size = len(
                    codec.encode_request(
                        "LOOKUP",
                        1,
                        {"namespace": ns, "keys": keys, "groups": specs, "chunk_tokens": 16, "lease": False},
                    )
                )
                results[f"floor_echo_{name}_keys"] = {**echo_floor(size, args.repeats), "frame_bytes": size}
                results[f"floor_channel_echo_{name}_keys"] = channel_echo_floor(size, args.repeats)
        finally:
            asleep.close()
            plain.close()
            client.close()
            buf.close()
    if args.json:
        print(json.dumps(results))
    else:
        for k, v in results.items():
            print(f"{k:40} {v}")


if __name__ == "__main__":
    main()
