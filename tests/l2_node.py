"""A daemon-like L2 node for the Mooncake tests and benchmark: ``python tests/l2_node.py MODE URL MB``.

It owns a memfd shared mapping of MB MiB (as tierd's pool segments are), registers it, and
answers one JSON command per stdin line with one JSON line on stdout. MODE ``tier`` moves bytes
through :class:`tierd.tier2.MooncakeTier`; MODE ``raw`` calls Mooncake's own client directly with
the same object names (the benchmark's baseline). Mooncake logs to stderr; the parent sends that
to a file. Keys travel as hex; memory is named by offsets into the mapping.

Commands: fill(offset,size,seed) digest(offset,size) put/get(keys,offsets,sizes[,timeout_s])
exists/remove(keys) loop(op,keys,offsets,sizes,seconds[,tail,most_seconds]) wait_finished(timeout)
wait_state(state,timeout) kill_agent status quit. Every reply carries ``t`` (the node's monotonic clock).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierd.base.l2url import parse_url, route_host  # noqa: E402
from tierd.tier2.client import advertise, load_store_class, open_store  # noqa: E402
from tierd.tier2.keys import object_name  # noqa: E402
from tierd.tier2.mooncake import MooncakeTier  # noqa: E402


class Memory:
    """One shared mapping, populated up front (as the pool's segments are)."""

    def __init__(self, nbytes: int):
        self.fd = os.memfd_create("tierd-l2-test", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.view = np.frombuffer(self.map, dtype=np.uint8)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.nbytes = nbytes

    def fill(self, offset: int, size: int, seed: int) -> str:
        self.view[offset : offset + size] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        return self.digest(offset, size)

    def digest(self, offset: int, size: int) -> str:
        return hashlib.blake2b(self.view[offset : offset + size].tobytes(), digest_size=16).hexdigest()


class Raw:
    """Mooncake's client called directly, synchronously: what MooncakeTier adds is measured against it."""

    def __init__(self, url: str, mem: Memory):
        self.url = parse_url(url)
        host = self.url.local_host or route_host(self.url.master_host, self.url.master_port)
        advertise(host)
        self.store = open_store(load_store_class(), self.url, host)
        assert self.store.register_buffer(mem.addr, mem.nbytes) == 0
        self.state = "connected"

    def call(self, op: str, names, addrs, sizes):
        if op == "put":
            return [c == 0 for c in self.store.batch_put_from(names, addrs, sizes)]
        return [c == s for c, s in zip(self.store.batch_get_into(names, addrs, sizes), sizes)]


def main() -> None:
    mode, url, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mem = Memory(mb << 20)
    tier = raw = None
    if mode == "tier":
        tier = MooncakeTier(url)
        tier.register(mem.addr, mem.nbytes, mem.fd)
        tier.connecting.done.result(tier.url.setup_timeout_s + 5)
    else:
        raw = Raw(url, mem)
    prefix = parse_url(url).prefix
    last = None
    reply({"ready": True, "state": tier.state if tier else raw.state})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            if tier:
                tier.close()
            else:
                raw.store.close()  # unmount now: a segment left behind fails others' puts for client_ttl
            reply({"closed": True})
            return
        keys = [bytes.fromhex(k) for k in cmd.get("keys", [])]
        addrs = [mem.addr + o for o in cmd.get("offsets", [])]
        sizes = cmd.get("sizes", [])
        if op == "fill":
            reply({"digest": mem.fill(cmd["offset"], cmd["size"], cmd["seed"])})
        elif op == "digest":
            reply({"digest": mem.digest(cmd["offset"], cmd["size"])})
        elif op in ("put", "get", "exists", "remove"):
            t0 = time.monotonic()
            if raw is not None:
                ok = raw.call(op, [object_name(k, prefix) for k in keys], addrs, sizes)
                reply({"ok": ok, "elapsed": time.monotonic() - t0, "finished": True})
                continue
            args = (keys, addrs, sizes) if op in ("put", "get") else (keys,)
            last = getattr(tier, op)(*args, timeout_s=cmd.get("timeout_s"))
            ok = last.done.result()
            reply(
                {
                    "ok": ok,
                    "elapsed": time.monotonic() - t0,
                    "finished": last.finished.done(),
                    "timed_out": last.timed_out,
                    "state": tier.state,
                }
            )
        elif op == "loop":
            reply({"calls": loop(tier, cmd, keys, addrs, sizes)})
        elif op == "wait_finished":
            t0 = time.monotonic()
            try:
                last.finished.result(cmd["timeout"])
            except TimeoutError:
                pass
            reply({"finished": last.finished.done(), "waited": time.monotonic() - t0})
        elif op == "wait_state":
            t0 = time.monotonic()
            while tier.state != cmd["state"] and time.monotonic() - t0 < cmd["timeout"]:
                time.sleep(0.02)
            reply({"state": tier.state, "waited": time.monotonic() - t0})
        elif op == "kill_agent":  # a Mooncake crash, as the daemon would meet it
            link = tier._relay.link
            link.proc.kill()
            link.proc.wait(10)
            reply({"killed": link.proc.pid})
        elif op == "status":
            reply({"status": tier.status() if tier else {}})
        else:
            reply({"error": f"unknown op {op}"})


def loop(tier: MooncakeTier, cmd: dict, keys, addrs, sizes) -> list[dict]:
    """Back-to-back calls for ``seconds``: per call its start, elapsed, keys ok, the state after and
    how long Mooncake held the memory past the call's answer. With ``tail``, the loop goes on past
    ``seconds`` (up to ``most_seconds``) until ``tail`` calls have started since the last one whose
    memory Mooncake held past its deadline: a read cut off by a dying master may keep it for
    seconds, and the calls after it are what a test asks about."""
    calls = []
    start = time.monotonic()
    end, last = start + cmd["seconds"], start + cmd.get("most_seconds", cmd["seconds"])
    tail, since_held = cmd.get("tail", 0), 0
    while (now := time.monotonic()) < end or (since_held < tail and now < last):
        t0 = time.monotonic()
        op = getattr(tier, cmd["call"])(keys, addrs, sizes, timeout_s=cmd.get("timeout_s"))
        ok = op.done.result()
        answered = time.monotonic()
        if not op.finished.done():
            op.finished.result()  # the memory is still Mooncake's: wait before reusing it
        held = time.monotonic() - answered
        calls.append(
            {
                "t": t0,
                "elapsed": answered - t0,
                "held": held,
                "ok": sum(ok),
                "timed_out": op.timed_out,
                "state": tier.state,
            }
        )
        since_held = 0 if held > (cmd.get("timeout_s") or 1.0) else since_held + 1
        if calls[-1]["elapsed"] < 1e-3 and not ok[0]:
            time.sleep(0.01)  # failing fast: do not spin
    return calls


def reply(obj: dict) -> None:
    obj["t"] = time.monotonic()
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
