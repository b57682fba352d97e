"""The registry without a daemon: sessions, instances, namespaces and leases, each decision pinned
with exact ids (a real pool and a real transfer engine; the rank memory is a stand-in that
records when it is closed)."""

from __future__ import annotations

import time

import pytest

from tierd.pool.pool import Pool
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.keys import namespace_id
from tierd.protocol.layout import PageLayout
from tierd.state.registry import Registry
from tierd.transfer.engine import TransferEngine


class Memory:
    closed = 0

    def close(self):
        Memory.closed += 1


def layout(rank=0, world=1, fingerprint="f") -> PageLayout:
    return PageLayout.from_wire(
        {
            "namespace": {"model": "m", "fingerprint": fingerprint, "world_size": world},
            "rank": rank,
            "chunk_tokens": 16,
            "tensors": [{"handle": {"kind": "shm", "path": "/dev/shm/x"}, "nbytes": 4096}],
            "groups": [
                {
                    "kind": "full",
                    "block_tokens": 4,
                    "layers": [
                        {"tensor": 0, "offset": 0, "block_stride": 256, "num_blocks": 16, "run_bytes": 256}
                    ],
                }
            ],
        }
    )


@pytest.fixture
def reg():
    pool = Pool(ceiling=1 << 20, initial=0, align=256, segment_bytes=1 << 20)
    lanes = TransferEngine(0)
    r = Registry(pool, lanes, lease_ttl_s=60.0, heartbeat_timeout_s=30.0)
    yield r
    lanes.close()
    pool.close()


def objects(reg, n):
    out = []
    for i in range(n):
        obj = reg.pool.begin_write(b"ns", b"key-%04d" % i, {0: (0, 0)}, 0, 256, 1, "g0")
        reg.pool.commit([obj])
        out.append(obj)
    return out


def test_a_lease_pins_its_objects_until_every_rank_has_retrieved(reg):
    s = reg.open_session(b"a", "sched", 1)
    objs = objects(reg, 3)
    lease = reg.grant(s, objs, world_size=2)
    reg.pool.settle()  # the pins wait for the reply (the daemon settles after each one)
    assert lease == 1 and s.leases == {1} and [o.pins for o in objs] == [1, 1, 1]
    reg.consume(lease, 0)
    assert lease in reg.leases and [o.pins for o in objs] == [1, 1, 1]
    reg.consume(lease, 1)
    assert lease not in reg.leases and s.leases == set() and [o.pins for o in objs] == [0, 0, 0]
    assert not reg.release(lease)  # gone: a second release finds nothing


def test_leases_expire_by_ttl_and_die_with_their_session(reg):
    s = reg.open_session(b"a", "sched", 1)
    objs = objects(reg, 2)
    first = reg.grant(s, objs[:1], 1)
    second = reg.grant(s, objs[1:], 1)
    reg.leases[first].expires = time.monotonic() - 1
    assert reg.reap(time.monotonic()) == (0, 1)
    assert list(reg.leases) == [second] and objs[0].pins == 0 and objs[1].pins == 1
    s.last_seen -= 31
    assert reg.reap(time.monotonic()) == (1, 1)  # the silent session and its lease
    assert not reg.sessions and not reg.leases and objs[1].pins == 0


def test_unknown_session_and_instance_are_typed_errors(reg):
    with pytest.raises(ProtocolError) as err:
        reg.session(b"nobody")
    assert err.value.code is ErrorCode.UNKNOWN_SESSION
    with pytest.raises(ProtocolError) as err:
        reg.instance("nothing")
    assert err.value.code is ErrorCode.UNKNOWN_INSTANCE


def test_register_is_idempotent_moves_on_reconnect_and_refuses_another_live_clients_layout(reg):
    a = reg.open_session(b"a", "w0", 1)
    inst = reg.register(a, "r0", layout(), lambda lay, peer: Memory())
    assert inst.ns == namespace_id(layout().namespace) and a.instances == {"r0"}
    b = reg.open_session(b"b", "w0-again", 1)
    assert (
        reg.register(b, "r0", layout(), lambda lay, peer: Memory()) is inst
    )  # same layout: moves, not re-mapped
    assert a.instances == set() and b.instances == {"r0"} and inst.session == b"b"
    c = reg.open_session(b"c", "other", 2)
    with pytest.raises(ProtocolError) as err:
        reg.register(c, "r0", layout(fingerprint="other"), lambda lay, peer: Memory())
    assert err.value.code is ErrorCode.LAYOUT_MISMATCH and reg.instances["r0"] is inst


def test_closing_a_session_unregisters_its_instances_and_closes_their_memory(reg):
    Memory.closed = 0
    s = reg.open_session(b"a", "w", 1)
    reg.register(s, "r0", layout(0, 2), lambda lay, peer: Memory())
    reg.register(s, "r1", layout(1, 2), lambda lay, peer: Memory())
    assert sorted(reg.instances) == ["r0", "r1"]
    reg.close_session(b"a", reason="BYE")
    assert not reg.instances and not reg.sessions
    reg.lanes.close()  # the memory goes once the lanes' queued copies ran
    assert Memory.closed == 2


def test_namespaces_are_forgotten_once_nothing_names_them(reg):
    s = reg.open_session(b"a", "w", 1)
    reg.register(s, "r0", layout(), lambda lay, peer: Memory())
    ns = namespace_id(layout().namespace)
    assert ns in reg.namespaces
    reg.unregister("r0")
    reg.reap(time.monotonic())
    assert ns not in reg.namespaces  # no instance, no object


# ---- per-client caps (LIMIT): nothing of a refused request takes effect ---------------------------
def limited(pool, lanes, **kw):
    from tierd.state.registry import Limits

    return Registry(pool, lanes, lease_ttl_s=60.0, heartbeat_timeout_s=30.0, limits=Limits(**kw))


class Files(Memory):
    def __init__(self, n):
        self.files = n


def test_sessions_past_the_per_peer_cap_are_refused_and_a_closed_one_makes_room(reg):
    from tierd.state.tenants import Principal

    r = limited(reg.pool, reg.lanes, sessions_per_peer=2)
    alice, bob = Principal("uid:1", False, "uid:1"), Principal("uid:2", False, "uid:2")
    r.open_session(b"a1", "x", 1, alice)
    r.open_session(b"a2", "x", 1, alice)
    with pytest.raises(ProtocolError) as e:
        r.open_session(b"a3", "x", 1, alice)
    assert e.value.code is ErrorCode.LIMIT and "--max-sessions-per-peer 2" in e.value.message
    assert sorted(r.sessions) == [b"a1", b"a2"]
    r.open_session(b"b1", "x", 1, bob)  # another peer has its own count
    r.open_session(b"a1", "x", 1, alice)  # a re-HELLO on a live identity is not one more
    r.close_session(b"a2", reason="test")
    r.open_session(b"a3", "x", 1, alice)
    assert sorted(r.sessions) == [b"a1", b"a3", b"b1"]


def test_instances_and_files_past_the_tenant_caps_are_refused_with_their_memory_closed(reg):
    r = limited(reg.pool, reg.lanes, instances_per_tenant=2, files_per_tenant=5)
    s = r.open_session(b"a", "x", 1)
    r.register(s, "i0", layout(fingerprint="0"), lambda lay, peer: Files(2))
    with pytest.raises(ProtocolError) as e:
        r.register(s, "i1", layout(fingerprint="1"), lambda lay, peer: Files(4))
    assert e.value.code is ErrorCode.LIMIT and "--max-files-per-tenant 5" in e.value.message
    closed = Memory.closed
    r.register(s, "i1", layout(fingerprint="1"), lambda lay, peer: Files(3))
    assert Memory.closed == closed
    opened = []
    with pytest.raises(ProtocolError) as e:
        r.register(s, "i2", layout(fingerprint="2"), lambda lay, peer: opened.append(1) or Files(0))
    assert e.value.code is ErrorCode.LIMIT and "--max-instances-per-tenant 2" in e.value.message
    assert opened == [], "memory was opened for a rank past the instance cap"
    assert sorted(r.instances) == ["i0", "i1"]
    r.unregister("i0")
    r.register(s, "i2", layout(fingerprint="2"), lambda lay, peer: Files(2))
    assert sorted(r.instances) == ["i1", "i2"]


def test_leases_past_the_session_cap_are_refused(reg):
    r = limited(reg.pool, reg.lanes, leases_per_session=2, lease_share=1.0)
    s = r.open_session(b"a", "x", 1)
    objs = objects(reg, 3)
    r.grant(s, objs[:1], 1)
    r.grant(s, objs[1:2], 1)
    with pytest.raises(ProtocolError) as e:
        r.grant(s, objs[2:], 1)
    assert e.value.code is ErrorCode.LIMIT and "--max-leases-per-session 2" in e.value.message
    r.pool.settle()
    assert [o.pins for o in objs] == [1, 1, 0]


def test_the_lease_share_counts_each_object_once_and_a_refused_lease_pins_nothing(reg):
    # pool ceiling 1 MiB, share 0.001: 1048 bytes, four 256-byte slots
    r = limited(reg.pool, reg.lanes, lease_share=0.001)
    s = r.open_session(b"a", "x", 1)
    objs = objects(reg, 6)
    r.grant(s, objs[:3], 1)
    r.grant(s, objs[:3] + objs[:1], 1)  # the same objects again (a shared prefix): no new bytes
    assert r.leased_bytes[""] == 3 * 256
    with pytest.raises(ProtocolError) as e:
        r.grant(s, objs[2:5], 1)  # two new objects: 5 x 256 > 1048
    assert e.value.code is ErrorCode.LIMIT and "--max-lease-share" in e.value.message
    assert [o.pins for o in objs] == [3, 2, 2, 0, 0, 0], "the refused lease left pins behind"
    assert r.leased_bytes[""] == 3 * 256
    lease = r.grant(s, objs[3:4], 1)  # one more fits exactly
    r.pool.settle()
    assert r.leased_bytes[""] == 4 * 256
    r.release(lease)
    assert r.leased_bytes[""] == 3 * 256 and objs[3].pins == 0


def test_a_leases_pins_left_for_after_the_reply_are_applied_by_whoever_takes_the_pool_lock(reg):
    s = reg.open_session(b"a", "sched", 1)
    objs = objects(reg, 4)
    reg.grant(s, objs[:3], 1)  # well within the cap: its pins wait for the reply
    assert [o.pins for o in objs] == [0, 0, 0, 0]
    assert reg.pool.clear() == 1  # an eviction takes the lock: the pins are applied first
    assert [o.pins for o in objs[:3]] == [1, 1, 1] and [o.ready for o in objs] == [True] * 3 + [False]
    assert reg.leased_bytes[""] == 3 * 256


def test_a_lease_released_before_its_pins_are_applied_leaves_none_behind(reg):
    s = reg.open_session(b"a", "sched", 1)
    objs = objects(reg, 2)
    lease = reg.grant(s, objs, 1)
    assert reg.release(lease)  # the same loop turn: no settle in between
    assert [(o.pins, o.leases) for o in objs] == [(0, 0), (0, 0)] and not reg.leased_bytes
    reg.pool.settle()
    assert [(o.pins, o.leases) for o in objs] == [(0, 0), (0, 0)]


def test_a_grant_counts_the_pins_another_grant_left_for_after_its_reply(reg):
    # four 256-byte slots fit the share (1048 bytes); two grants in one loop turn (L2 answers
    # delivered together), no settle between: 3 + 2 objects must not both be granted
    r = limited(reg.pool, reg.lanes, lease_share=0.001)
    s = r.open_session(b"a", "x", 1)
    objs = objects(reg, 5)
    r.grant(s, objs[:3], 1)
    with pytest.raises(ProtocolError) as e:
        r.grant(s, objs[3:], 1)
    assert e.value.code is ErrorCode.LIMIT
    assert [o.pins for o in objs] == [1, 1, 1, 0, 0] and r.leased_bytes[""] == 3 * 256


def test_no_instance_name_of_one_tenant_reaches_another_tenants_instance(reg):
    """Registry keys once joined name and tenant with '@': the default tenant's 'r0@uid:5' was
    tenant uid:5's 'r0', which that tenant could then unregister or store through."""
    from tierd.state.registry import instance_key
    from tierd.state.tenants import Principal

    owner = reg.open_session(b"o", "x", 1)
    other = reg.open_session(b"u", "x", 1, Principal("uid:5", False, "uid:5"))
    mine = reg.register(owner, "r0@uid:5", layout(fingerprint="a"), lambda lay, peer: Memory())
    theirs = reg.register(other, "r0", layout(fingerprint="b"), lambda lay, peer: Memory())
    assert mine is not theirs and mine.tenant == "" and theirs.tenant == "uid:5"
    assert reg.instance("r0", "uid:5") is theirs and reg.instance("r0@uid:5") is mine
    with pytest.raises(ProtocolError) as e:
        reg.instance("r0", "uid:5@")  # nor by spelling the tenant another way
    assert e.value.code is ErrorCode.UNKNOWN_INSTANCE
    assert reg.unregister(instance_key("uid:5", "r0"))
    assert reg.instance("r0@uid:5") is mine and set(reg.instances) == {"r0@uid:5"}


def test_a_token_files_tenant_names_hold_no_control_character(tmp_path):
    """A tenant name is part of registry keys, which set a name apart from its tenant with a NUL."""
    from tierd.state.tenants import TokenFileError, load_tokens

    path = tmp_path / "tokens"
    path.write_text("bob\x00x bob-token-0123456789ab\n")
    path.chmod(0o600)
    with pytest.raises(TokenFileError, match="control character"):
        load_tokens(str(path))
    path.write_text("bob bob-token-0123456789ab\n")  # control: a plain name
    assert load_tokens(str(path)) == {"bob-token-0123456789ab": "bob"}
