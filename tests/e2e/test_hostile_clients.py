"""Hostile clients against a real ``tierd serve`` (docs/security.md): what each is answered, what
it costs the daemon (its peak RSS, from /proc/PID/status), and that another client is served after.

Frames built to exhaust the decoder are refused at its limits; a frame over ZeroMQ's part cap is
never held; memory truncated under a registered rank fails that rank's copies with a typed error;
the largest layout the limits allow registers; each per-user, per-tenant and per-session cap is
answered LIMIT (or ``er`` at the descriptor inbox) through the wire with its flag named. What other
files already hold is listed in docs/security.md.
"""

from __future__ import annotations

import os
import uuid

import msgpack
import pytest
import zmq
from conftest import DaemonProcess  # noqa: F401 - fixtures from conftest
from kv import GroupGeom, keys
from util import chunk, ids, ranks, raw  # noqa: F401 - fixtures
from wire import Raw, pack

from tierd_client import fdpass
from tierd_client.layouts import block_span, group, layout, namespace

MIB = 1 << 20
FRAME_CAP = 16 * MIB  # a default daemon's --max-frame-mb
PART_CAP = 2 * FRAME_CAP  # its message cap


def kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def reset_peak(pid: int) -> int:
    """VmHWM starts again from VmRSS (the kernel's clear_refs 5); returns it, KiB."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return kib(pid, "VmHWM:")


def peak_rise_mib(d, send) -> float:
    before = reset_peak(d.proc.pid)
    send()
    return (kib(d.proc.pid, "VmHWM:") - before) / 1024


def serves_on(d) -> bool:
    """Another client says HELLO and PINGs, and is answered."""
    r = Raw(d.endpoint)
    try:
        r.hello()
        return r.ok("PING", {}, timeout=10)["boot_id"] == d.status()["boot_id"]
    finally:
        r.close()


# ---- frames ---------------------------------------------------------------------------------------
def array32(n: int, item: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def fixmap1(key: str, value: bytes) -> bytes:
    return b"\x81" + pack(key) + value


N = FRAME_CAP - 256  # elements of one byte each: a frame just under the cap
UNKNOWN_FIELD = "empty maps as an unknown field of a PING"  # refused by its name, its value unbuilt
FRAMES = {
    UNKNOWN_FIELD: (
        b"\x93" + pack("PING") + b"\x07" + fixmap1("x", array32(N, b"\x80")),
        7,
    ),
    "empty maps as LOOKUP keys": (
        b"\x93" + pack("LOOKUP") + b"\x08" + fixmap1("keys", array32(N, b"\x80")),
        8,
    ),
    "a STORE chunk whose block list holds 16M ints": (
        b"\x93"
        + pack("STORE")
        + b"\x09"
        + b"\x82"
        + pack("instance")
        + pack("x")
        + pack("chunks")
        + b"\x91\x82"
        + pack("key")
        + pack(b"k" * 16)
        + pack("blocks")
        + b"\x91"
        + array32(N - 64, b"\x00"),
        9,
    ),
    "nesting depth 1,000,000 in a PING body": (
        b"\x93" + pack("PING") + b"\x0a" + fixmap1("x", b"\x91" * 1_000_000 + b"\xc0"),
        10,
    ),
}


@pytest.mark.parametrize("what", list(FRAMES))
def test_a_frame_built_to_exhaust_the_decoder_costs_about_its_size_and_is_refused_at_its_limits(
    daemon, raw, what
):
    frame, req_id = FRAMES[what]
    assert len(frame) <= FRAME_CAP
    r = raw(daemon)
    r.hello()
    got = []
    rise = peak_rise_mib(daemon, lambda: (r.send(frame), got.append(r.recv(10))))
    (reply,) = got
    assert reply[:2] == [req_id, False] and reply[2]["code"] == "BAD_REQUEST", reply
    assert rise < 2 * len(frame) / MIB + 4, f"+{rise:.0f} MiB for a {len(frame) / MIB:.0f} MiB frame"
    assert serves_on(daemon)


def test_pipelined_frames_at_the_cap_are_each_answered_and_others_served(daemon, raw):
    frame, req_id = FRAMES["a STORE chunk whose block list holds 16M ints"]
    r = raw(daemon)
    r.hello()
    for _ in range(8):
        r.send(frame)
    assert [r.recv(30)[:2] for _ in range(8)] == [[req_id, False]] * 8
    assert serves_on(daemon)


def test_a_frame_over_the_part_cap_is_never_held_and_only_its_sender_is_dropped(daemon, raw):
    """The daemon reads the frame's size first and closes the connection before it allocates; a
    frame within the part cap but over the frame cap is held once and answered
    TOO_LARGE (the control: the measurement sees a frame that is held)."""
    r = raw(daemon)
    r.hello()
    over = zmq.Frame(b"\0" * (200 * MIB))
    rise = peak_rise_mib(daemon, lambda: (r.sock.send(over, copy=False), r.quiet(2.0)))
    assert r.quiet(0.5), "a frame over the message cap was answered: it was read"
    assert rise < 16, f"+{rise:.0f} MiB for a 200 MiB frame over the part cap"

    within = raw(daemon)
    within.hello()
    held = zmq.Frame(b"\x93" + b"\0" * (PART_CAP - 2 * MIB))
    replies = []
    rise_within = peak_rise_mib(
        daemon, lambda: (within.sock.send(held, copy=False), replies.append(within.recv(20)))
    )
    assert replies[0][2]["code"] == "TOO_LARGE", replies
    assert rise_within > 20, f"+{rise_within:.0f} MiB: the measurement does not see a held frame"
    assert serves_on(daemon)


def test_a_message_of_many_parts_over_the_cap_is_refused_and_its_sender_served_again(daemon):
    """What libzmq holds for such a message is its whole size (measured in test_message_cap.py);
    the daemon answers TOO_LARGE and the same connection is served on."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    try:
        part = zmq.Frame(b"\0" * (4 * MIB))
        s.send_multipart([part] * 9 + [pack(["PING", 3, {}])], copy=False)
        assert s.poll(20_000)
        reply = msgpack.unpackb(s.recv(), raw=False)
        assert reply[:2] == [0, False] and reply[2]["code"] == "TOO_LARGE", reply
        s.send(pack(["PING", 4, {}]))
        assert s.poll(10_000) and msgpack.unpackb(s.recv(), raw=False)[0] == 4
    finally:
        s.close()


# ---- memory under a registered rank ---------------------------------------------------------------
BLOCKS, BLOCK = 64, 256


def memfd_layout(ticket: bytes, nbytes: int) -> dict:
    spans = [
        block_span((BLOCKS, BLOCK), (BLOCK, 1), 1, 0, tensor=0, offset=layer * BLOCKS * BLOCK)
        for layer in range(2)
    ]
    tensors = [{"handle": {"kind": "fd", "ticket": ticket, "index": 0, "offset": 0}, "nbytes": nbytes}]
    return layout(
        namespace("m", "truncated-" + uuid.uuid4().hex[:6]), 0, 16, tensors, [group("full", 4, spans)]
    )


def test_a_memfd_truncated_under_its_registered_rank_fails_its_copies_with_a_typed_error(daemon, raw, ranks):
    bystander = ranks(GroupGeom("full"))
    b = raw(daemon)
    b.hello()
    b.ok("REGISTER", {"instance": "b", "layout": bystander.layout()})
    kb = keys(2)
    assert b.ok("STORE", {"instance": "b", "chunks": [chunk(kb[0], ids(0))]})["results"] == ["stored"]
    full = 2 * BLOCKS * BLOCK
    fd = os.memfd_create("kv", os.MFD_CLOEXEC)
    a = raw(daemon)
    a.hello()
    k = keys(3)
    try:
        for op in ("STORE", "RETRIEVE"):
            os.ftruncate(fd, full)
            ticket = fdpass.new_ticket()
            fdpass.send_fds(daemon.endpoint, ticket, [fd])
            a.ok("REGISTER", {"instance": "a", "layout": memfd_layout(ticket, full)})
            a.ok("STORE", {"instance": "a", "chunks": [chunk(k[0], ids(0))]})
            os.ftruncate(fd, full // 4)  # the second layer, and the end of the first, are gone
            key = k[0] if op == "RETRIEVE" else k[1]
            ok, reply = a.call(op, {"instance": "a", "chunks": [chunk(key, ids(40))]}, timeout=5)
            assert not ok and reply["code"] == "DEVICE_ERROR", reply
            assert f"has {full // 4} bytes" in reply["message"], reply
            assert os.fstat(fd).st_size == full // 4, "the daemon grew the client's memory"
            assert daemon.proc.poll() is None
            b.ok("STORE", {"instance": "b", "chunks": [chunk(kb[1], ids(4))]})  # another client goes on
            assert b.ok("RETRIEVE", {"instance": "b", "chunks": [chunk(kb[0], ids(40))]})["ok"] == [True]
    finally:
        os.close(fd)
    assert daemon.status()["errors_by_code"].get("INTERNAL", 0) == 0


def test_the_largest_layout_the_limits_allow_registers_and_the_daemon_serves_on(daemon, raw, tmp_path):
    """4096 tensors (layout.MAX_TENSORS), 64 groups (MAX_GROUPS) of 1024 layers each, one file."""
    per = 16 * 64
    path = f"/dev/shm/tierd-test-largest-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4096 * per)
        tensors = [
            {"handle": {"kind": "shm", "path": path, "offset": t * per}, "nbytes": per} for t in range(4096)
        ]
        layers = lambda g: [  # noqa: E731
            {
                "tensor": (g * 1024 + li) % 4096,
                "offset": 0,
                "block_stride": 64,
                "num_blocks": 16,
                "run_bytes": 64,
            }
            for li in range(1024)
        ]
        lay = {
            "namespace": {"model": "m", "fingerprint": "largest", "world_size": 1},
            "rank": 0,
            "chunk_tokens": 16,
            "tensors": tensors,
            "groups": [{"kind": "full", "block_tokens": 4, "layers": layers(g)} for g in range(64)],
        }
        r = raw(daemon)
        r.hello()
        reply = r.ok("REGISTER", {"instance": "largest", "layout": lay}, timeout=30)
        assert len(reply["object_bytes"]) == 64, reply.keys()
        assert serves_on(daemon)
    finally:
        os.close(fd)
        os.unlink(path)


# ---- caps, through the wire -----------------------------------------------------------------------
def test_descriptors_past_a_users_cap_are_refused_at_the_inbox(daemon_factory):
    d = daemon_factory("--max-files-per-tenant", "300")
    fd = os.memfd_create("kv", os.MFD_CLOEXEC)
    try:
        fdpass.send_fds(d.endpoint, fdpass.new_ticket(), [fd] * 250)
        with pytest.raises(
            OSError, match=r"already has 250 unclaimed descriptors.*--max-files-per-tenant 300"
        ):
            fdpass.send_fds(d.endpoint, fdpass.new_ticket(), [fd] * 250)
    finally:
        os.close(fd)
    assert d.status()["fd_inbox"] | {"received": 250, "refused": 1} == d.status()["fd_inbox"]
    assert d.status()["fd_inbox"]["waiting"] == 250
    assert serves_on(d)


def files_layout(paths: list[str], per: int) -> dict:
    spans = [
        {"tensor": t, "offset": 0, "block_stride": 64, "num_blocks": 16, "run_bytes": 64}
        for t in range(len(paths))
    ]
    return {
        "namespace": {"model": "m", "fingerprint": uuid.uuid4().hex, "world_size": 1},
        "rank": 0,
        "chunk_tokens": 16,
        "tensors": [{"handle": {"kind": "shm", "path": p, "offset": 0}, "nbytes": per} for p in paths],
        "groups": [{"kind": "full", "block_tokens": 4, "layers": spans}],
    }


def test_files_past_the_tenants_cap_are_refused_and_closed(daemon_factory, raw, tmp_path):
    d = daemon_factory("--max-files-per-tenant", "8")
    folder = f"/dev/shm/tierd-test-files-{uuid.uuid4().hex[:8]}"
    os.mkdir(folder, 0o700)
    per = 16 * 64
    try:
        ranks_paths = []
        for i in range(2):
            paths = [f"{folder}/r{i}-{t}" for t in range(5)]
            for p in paths:
                with open(p, "wb") as f:
                    f.truncate(per)
            ranks_paths.append(paths)
        r = raw(d)
        r.hello()
        r.ok("REGISTER", {"instance": "f0", "layout": files_layout(ranks_paths[0], per)})
        fds_before = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        ok, reply = r.call("REGISTER", {"instance": "f1", "layout": files_layout(ranks_paths[1], per)})
        assert not ok and reply["code"] == "LIMIT" and "--max-files-per-tenant 8" in reply["message"], reply
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) <= fds_before, "a refused rank's files stay open"
        r.ok("UNREGISTER", {"instance": "f0"})
        r.ok("REGISTER", {"instance": "f1", "layout": files_layout(ranks_paths[1], per)})  # room again
    finally:
        for name in os.listdir(folder):
            os.unlink(f"{folder}/{name}")
        os.rmdir(folder)


def test_instances_past_the_tenants_cap_are_refused(daemon_factory, raw, ranks):
    d = daemon_factory("--max-instances-per-tenant", "4")
    rank = ranks(GroupGeom("full"))
    r = raw(d)
    r.hello()
    codes = [
        r.call("REGISTER", {"instance": f"n{i}", "layout": rank.layout()})[1].get("code", "ok")
        for i in range(6)
    ]
    assert codes == ["ok"] * 4 + ["LIMIT"] * 2
    assert len(d.status()["instances"]) == 4
    assert serves_on(d)


def stored(d, raw, rank, n: int):
    r = raw(d)
    r.hello()
    r.ok("REGISTER", {"instance": "a", "layout": rank.layout()})
    ks = keys(n)
    r.ok("STORE", {"instance": "a", "chunks": [chunk(k, ids(4 * i)) for i, k in enumerate(ks)]})
    return r, ks


def test_leases_past_the_sessions_cap_are_refused(daemon_factory, raw, ranks):
    d = daemon_factory("--max-leases-per-session", "3")
    rank = ranks(GroupGeom("full"))
    r, ks = stored(d, raw, rank, 1)
    look = {"namespace": rank.ns, "keys": ks, "chunk_tokens": 16, "groups": rank.specs(), "lease": True}
    got = [r.call("LOOKUP", look) for _ in range(5)]
    assert [reply.get("code", "ok") for _, reply in got] == ["ok"] * 3 + ["LIMIT"] * 2
    assert "--max-leases-per-session 3" in got[3][1]["message"]
    assert d.status()["leases_active"] == 3
    r.ok("RELEASE", {"lease": got[0][1]["lease"]})
    assert r.ok("LOOKUP", look)["lease"] > 0  # a released one makes room
    assert serves_on(d)


def test_a_lease_over_the_tenants_share_of_the_pool_is_refused_and_pins_nothing(daemon_factory, raw, ranks):
    d = daemon_factory("--max-lease-share", "0.5", pool_mb=2)
    rank = ranks(GroupGeom("full", layers=2, block_bytes=16 << 10), num_blocks=64)  # 128 KiB objects
    r, ks = stored(d, raw, rank, 12)  # 1.5 MiB of the 2 MiB pool
    look = {"namespace": rank.ns, "chunk_tokens": 16, "groups": rank.specs(), "lease": True}
    ok, reply = r.call("LOOKUP", {**look, "keys": ks})
    assert not ok and reply["code"] == "LIMIT" and "--max-lease-share 0.5" in reply["message"], reply
    assert (d.status()["leases_active"], d.status()["leased_bytes"]) == (0, 0)
    assert r.ok("LOOKUP", {**look, "keys": ks[:2]})["lease"] > 0  # within the share
    assert serves_on(d)


def test_sessions_past_a_users_cap_are_refused(daemon_factory):
    d = daemon_factory("--max-sessions-per-peer", "3")
    clients = [Raw(d.endpoint) for _ in range(4)]
    try:
        for c in clients[:3]:
            c.hello()
        code = clients[3].error("HELLO", {"protocol": 1, "client": "one-too-many", "pid": os.getpid()})
        assert code == "LIMIT"
        assert d.status()["sessions"] == 3
        clients[0].ok("BYE", {})
        clients[3].hello()  # a closed one makes room
    finally:
        for c in clients:
            c.close()
