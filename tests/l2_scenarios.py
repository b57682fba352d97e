"""Scenarios ``tests/l2_harness.py`` runs inside its network namespace; each returns a JSON-able dict.

Nodes A and B stand in for two daemons on two hosts: separate processes, separate memory,
separate Mooncake clients, each contributing a segment. Bytes are random per chunk (seeded), and
B's destination is filled with other bytes first, so a get that wrote nothing cannot match.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from l2_harness import Master, Node

from tierd.tier2.keys import chunk_key

MIB = 1 << 20
NS = hashlib.blake2b(b"tierd-l2-test-namespace", digest_size=16).digest()


def keys(tag: str, n: int) -> list[str]:
    """Chunk keys as the daemon would derive them (namespace, PAGE hash, group, rank), in hex."""
    return [
        chunk_key(NS, hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest(), 0, 0).hex()
        for i in range(n)
    ]


def layout(sizes: list[int], base: int = 0) -> list[int]:
    offsets, at = [], base
    for s in sizes:
        offsets.append(at)
        at += -(-s // 4096) * 4096
    return offsets


def fill(node: Node, offsets: list[int], sizes: list[int], seed: int) -> list[str]:
    return [
        node("fill", offset=o, size=s, seed=seed + i)["digest"]
        for i, (o, s) in enumerate(zip(offsets, sizes))
    ]


def digests(node: Node, offsets: list[int], sizes: list[int]) -> list[str]:
    return [node("digest", offset=o, size=s)["digest"] for o, s in zip(offsets, sizes)]


def two_nodes(workdir: Path, started: list, url: str) -> tuple[Master, Node, Node]:
    master = Master(workdir).start()
    started.append(master)
    a = Node(workdir, "a", url)
    started.append(a)
    b = Node(workdir, "b", url)
    started.append(b)
    return master, a, b


def until_stored(node: Node, ks: list[str], offsets: list[int], sizes: list[int], seconds: float) -> dict:
    """Put until every key is stored (a restarted master has no segment until clients remount)."""
    t0, tries = time.monotonic(), 0
    while True:
        tries += 1
        r = node("put", keys=ks, offsets=offsets, sizes=sizes)
        if all(r["ok"]) or time.monotonic() - t0 > seconds:
            return {
                **r,
                "tries": tries,
                "after": time.monotonic() - t0,
                "codes": node("status")["status"]["put_full"],
            }
        time.sleep(0.1)


def share(workdir: Path, started: list) -> dict:
    """A puts, B (another process, its own memory) reads byte-exact; misses, sizes, remove."""
    _, a, b = two_nodes(workdir, started, "mooncake://127.0.0.1?segment_gb=0.25&timeout_ms=5000")
    sizes = [2 * MIB] * 8 + [123457]
    ks, absent = keys("share", len(sizes)), keys("absent", 2)
    src, dst = layout(sizes), layout(sizes, base=64 * MIB)
    out = {"ready": [a.ready, b.ready], "sizes": sizes, "src": fill(a, src, sizes, seed=1)}
    out["before"] = fill(b, dst, sizes, seed=1000)
    out["put"] = a("put", keys=ks, offsets=src, sizes=sizes)
    out["exists"] = b("exists", keys=ks + absent)
    spare = layout([MIB, MIB], base=100 * MIB)
    out["get"] = b("get", keys=ks + absent, offsets=dst + spare, sizes=sizes + [MIB, MIB])
    out["dst"] = digests(b, dst, sizes)
    out["get_larger"] = b("get", keys=ks[:1], offsets=spare[:1], sizes=[2 * MIB + 4096])
    out["get_smaller"] = b("get", keys=ks[:1], offsets=spare[:1], sizes=[MIB])
    extra = keys("extra", 1)
    out["put_extra"] = a("put", keys=extra, offsets=src[:1], sizes=[4096])
    out["remove"] = a("remove", keys=extra + keys("never", 1))
    out["exists_removed"] = b("exists", keys=extra)
    out["status_a"], out["status_b"] = a("status")["status"], b("status")["status"]
    return out


def master_dies(workdir: Path, started: list) -> dict:
    """B reads in a loop; the master is SIGKILLed mid-loop, then restarted."""
    master, a, b = two_nodes(
        workdir, started, "mooncake://127.0.0.1?segment_gb=0.25&timeout_ms=1500&retry_s=0.5&fail_after=2"
    )
    sizes = [2 * MIB] * 16
    ks = keys("dies", len(sizes))
    src, dst = layout(sizes), layout(sizes, base=64 * MIB)
    out = {"src": fill(a, src, sizes, seed=1), "put": a("put", keys=ks, offsets=src, sizes=sizes)["ok"]}
    b.send(
        "loop",
        call="get",
        keys=ks,
        offsets=dst,
        sizes=sizes,
        seconds=6.0,
        timeout_s=1.5,
        tail=20,
        most_seconds=60,
    )
    time.sleep(2.0)
    out["t_kill"] = master.kill()
    out["calls"] = b.reply(wait_s=90)["calls"]
    master.start()
    out["restarted"] = time.monotonic()
    out["wait_b"] = b("wait_state", state="connected", timeout=30)
    out["wait_a"] = a("wait_state", state="connected", timeout=30)
    new = keys("after-restart", 4)
    out["src_new"] = fill(a, src[:4], sizes[:4], seed=50)
    out["put_new"] = until_stored(a, new, src[:4], sizes[:4], seconds=20)
    out["get_new"] = b("get", keys=new, offsets=dst[:4], sizes=sizes[:4])
    out["dst_new"] = digests(b, dst[:4], sizes[:4])
    out["exists_old"] = b("exists", keys=ks)["ok"]
    out["get_old"] = b("get", keys=ks, offsets=dst, sizes=sizes)["ok"]
    out["status_b"] = b("status")["status"]
    return out


def master_hangs(workdir: Path, started: list) -> dict:
    """The master stops answering (SIGSTOP): a get fails by its deadline, not Mooncake's 30 s."""
    master, a, b = two_nodes(
        workdir, started, "mooncake://127.0.0.1?segment_gb=0.25&timeout_ms=1000&retry_s=0.5"
    )
    sizes = [2 * MIB] * 4
    ks = keys("hangs", len(sizes))
    src, dst = layout(sizes), layout(sizes, base=64 * MIB)
    out = {"src": fill(a, src, sizes, seed=7), "put": a("put", keys=ks, offsets=src, sizes=sizes)["ok"]}
    master.pause()
    out["paused"] = time.monotonic()
    out["get_hung"] = b("get", keys=ks, offsets=dst, sizes=sizes, timeout_s=1.0)
    out["get_fast"] = b("get", keys=ks, offsets=dst, sizes=sizes)
    out["exists_fast"] = b("exists", keys=ks)
    time.sleep(1.0)
    out["still_degraded"] = b("status")["status"]["state"]
    master.resume()
    out["wait_finished"] = b("wait_finished", timeout=45)
    out["wait_state"] = b("wait_state", state="connected", timeout=30)
    out["get_after"] = b("get", keys=ks, offsets=dst, sizes=sizes)
    out["dst"] = digests(b, dst, sizes)
    out["status_b"] = b("status")["status"]
    return out


def no_master(workdir: Path, started: list) -> dict:
    """A node set up while no master runs: degraded by its setup deadline, connected once one starts."""
    url = "mooncake://127.0.0.1?segment_gb=0.25&timeout_ms=2000&setup_timeout_s=2&retry_s=0.5"
    t0 = time.monotonic()
    b = Node(workdir, "b", url)
    started.append(b)
    out = {"ready": b.ready, "ready_after": b.ready["t"] - t0}
    sizes = [MIB] * 2
    ks, dst = keys("late", 2), layout(sizes, base=64 * MIB)
    out["put_rejected"] = b("put", keys=ks, offsets=dst, sizes=sizes)
    master = Master(workdir).start()
    started.insert(0, master)
    out["wait_state"] = b("wait_state", state="connected", timeout=60)
    a = Node(workdir, "a", url)
    started.append(a)
    src = layout(sizes)
    out["src"] = fill(a, src, sizes, seed=3)
    out["put"] = a("put", keys=ks, offsets=src, sizes=sizes)
    out["get"] = b("get", keys=ks, offsets=dst, sizes=sizes)
    out["dst"] = digests(b, dst, sizes)
    out["status_b"] = b("status")["status"]
    return out


def agent_dies(workdir: Path, started: list) -> dict:
    """B's Mooncake process is killed (as a crash in Mooncake would end it): B degrades, not the daemon.

    B contributes no segment (segment_gb=0), so every object lives in A's: a dead client's own
    segment takes its objects along (until client_ttl they even fail as transfer errors)."""
    url = "mooncake://127.0.0.1?segment_gb=0.25&timeout_ms=2000&retry_s=0.5"
    started.append(Master(workdir).start())
    a = Node(workdir, "a", url)
    started.append(a)
    b = Node(workdir, "b", url.replace("segment_gb=0.25", "segment_gb=0"))
    started.append(b)
    sizes = [2 * MIB] * 4
    ks = keys("agent", len(sizes))
    src, dst = layout(sizes), layout(sizes, base=64 * MIB)
    out = {"src": fill(a, src, sizes, seed=11), "put": a("put", keys=ks, offsets=src, sizes=sizes)["ok"]}
    out["killed"] = b("kill_agent")
    out["get_lost"] = b("get", keys=ks, offsets=dst, sizes=sizes)
    out["wait_state"] = b("wait_state", state="connected", timeout=30)
    out["get_after"] = b("get", keys=ks, offsets=dst, sizes=sizes)
    out["dst"] = digests(b, dst, sizes)
    out["status_b"] = b("status")["status"]
    return out


def full(workdir: Path, started: list) -> dict:
    """Two 64 MiB segments, 96 x 2 MiB put: refusals per key ("full"), no degradation, room again."""
    url = "mooncake://127.0.0.1?segment_gb=0.0625&timeout_ms=5000&retry_s=0.5"
    _, a, b = two_nodes(workdir, started, url)
    sizes = [2 * MIB] * 16
    src = layout(sizes)
    fill(a, src, sizes, seed=21)
    out = {"puts": []}
    for r in range(6):
        out["puts"].append(a("put", keys=keys(f"full{r}", 16), offsets=src, sizes=sizes)["ok"])
    out["status_full"] = a("status")["status"]
    out["later"] = until_stored(a, keys("room", 4), src[:4], sizes[:4], seconds=10)
    out["too_big"] = a("put", keys=keys("big", 1), offsets=[0], sizes=[96 * MIB])
    out["status_a"] = a("status")["status"]
    return out
