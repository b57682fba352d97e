"""Every request type of the protocol, sent by one tenant with what another tenant holds, is refused
or touches only the sender's own state (docs/protocol.md section 21).

The walk takes the request types from the protocol's own list (``messages.REQUESTS``): a new
request type fails here until it has a case. Tenant B names tenant A's instances in every spelling
a registry key could be made of (A's plain name, and name@tenant either way round), A's lease,
namespace and keys; then B speaks on A's routing identity. Afterwards A's instances, lease, objects
and bytes must be as A left them, seen through A's own requests. Three pairs: two local users; the
daemon's own user (an operator) as A; and as B."""

from __future__ import annotations

import os

import numpy as np
import pytest
from kv import FakeRank, keys
from tenancy import GEOM, NS_FP, SPECS, ns, store_body
from test_tenants import call, hello, identity_of, kv_bytes, register, users, xdaemon  # noqa: F401
from users import User, make_user  # noqa: F401 - fixture
from wire import Raw

from tierd.protocol import messages

GONE_NS = {"model": "test-model", "fingerprint": "evicted-fingerprint", "world_size": 1, "salt": ""}


class Owner:
    """The daemon's own user (the default tenant, an operator), run in this process like a
    ``UserProcess``: ``call(fn, *args)`` runs ``fn(state, *args)``."""

    def __init__(self):
        self.user = User("owner", os.getuid(), os.getgid())
        self.state: dict = {}

    def call(self, fn, *args):
        return fn(self.state, *args)

    def close(self):
        for v in self.state.values():
            close = getattr(v, "close", None)
            if close is not None:
                close()


def tenant_of(p) -> str:
    return "" if isinstance(p, Owner) else f"uid:{p.user.uid}"


def spellings(name: str, a_tenant: str, b_tenant: str) -> list[str]:
    """How B might name A's instance ``name``: as A does, and qualified by either tenant."""
    return sorted({name, f"{name}@{a_tenant}", f"{name}@{b_tenant}", name.split("@")[0]})


def on_identity(state, endpoint, identity, op, body):
    """``op`` on a new connection that uses ``identity`` (another user's session) as its own."""
    raw = Raw(endpoint, identity)
    try:
        return raw.call(op, body)
    finally:
        raw.sock.close()


def register_as(state, inst, fingerprint=NS_FP, fill=0xAB):
    """REGISTER rank ``inst`` of this user (its KV all ``fill``, or random): ``(ok, reply)``."""
    rank = state[f"rank-{inst}"] = FakeRank([GEOM], fingerprint=fingerprint)
    if fill is not None:
        rank.kv[0][:] = fill
    return state["c"].call("REGISTER", {"instance": inst, "layout": rank.layout()})


def reconnect(state, endpoint, identity):
    """This user's own new connection with its session's identity (the first may have lost its route)."""
    state["c"] = Raw(endpoint, identity)


def cases(op: str, a: dict, b_is_operator: bool) -> list[tuple[str, dict]]:
    """What B sends as ``op`` (bodies) with A's state ``a``: instances, lease, namespace, keys."""
    inst_names = [s for name in a["instances"] for s in spellings(name, a["tenant"], a["b_tenant"])]
    chunks = store_body(a["keys"])["chunks"]
    into = store_body(a["keys"], base=40)["chunks"]  # a RETRIEVE lands in blocks nobody stored from
    table = {
        "HELLO": [{"protocol": 1, "client": "b-again"}],
        "BYE": [{}],
        "REGISTER": [{"instance": n} for n in inst_names],  # the layout is added by the walk
        "UNREGISTER": [{"instance": n} for n in inst_names],
        "LOOKUP": [{"namespace": ns(), "keys": a["keys"], "chunk_tokens": 16, "groups": SPECS}],
        "RELEASE": [{"lease": a["lease"]}],
        "STORE": [{"instance": n, "chunks": chunks} for n in inst_names + ["rb"]],
        "RETRIEVE": [{"instance": n, "chunks": into, "lease": a["lease"]} for n in inst_names + ["rb"]]
        + [{"instance": n, "chunks": into} for n in inst_names + ["rb"]],
        "PING": [{}],
        "STATUS": [{}],
        # an operator clearing everything, or another tenant's namespace by naming it, is an operator
        # action by design: B as operator sends only the spelling that must stay within its own tenant
        "CLEAR": [{"namespace": ns()}]
        + ([] if b_is_operator else [{}, {"namespace": ns(), "tenant": a["tenant"]}]),
        "EVICTED": [{"namespace": ns(), "since": 0}, {"namespace": GONE_NS, "since": 0}],
    }
    missing = set(messages.REQUESTS) - set(table)
    assert not missing, f"no cross-tenant case for request types {sorted(missing)}: add one here"
    return table[op]


@pytest.mark.parametrize("pair", ["user-user", "owner-user", "user-owner"])
def test_every_request_type_of_another_tenant_is_refused_or_touches_only_its_own_state(xdaemon, users, pair):
    a = Owner() if pair.startswith("owner") else users()
    b = Owner() if pair.endswith("owner") else users()
    try:
        _walk(xdaemon, a, b)
    finally:
        for p in (a, b):
            if isinstance(p, Owner):
                p.close()


def _walk(xdaemon, a, b):
    ep = xdaemon.endpoint
    a_tenant, b_tenant = tenant_of(a), tenant_of(b)
    # A's second rank is named as B's own registry key of "r1" was spelt before keys held the
    # tenant apart (r1@uid:B); B names it "r1", its own r1
    a_names = ("r0", f"r1@{b_tenant}" if b_tenant else "r1")
    ks = keys(2)
    a.call(hello, ep)
    for name in a_names:
        a.call(register, None, name)
        assert a.call(call, "STORE", store_body(ks, name))[1]["results"] in (["stored"] * 2, ["exists"] * 2)
    original = a.call(kv_bytes, "r0", 0, 8)
    ok, reply = a.call(call, "LOOKUP", {"namespace": ns(), "keys": ks, "chunk_tokens": 16, "groups": SPECS})
    assert ok and reply["chunks"] == 2
    lease = reply["lease"]
    a_identity = a.call(identity_of)
    # an eviction record in a namespace of A's: A stores one chunk there, an operator clears it
    gone = keys(1)
    a.call(register_as, "gone", GONE_NS["fingerprint"], None)
    assert a.call(call, "STORE", store_body(gone, "gone"))[1]["results"] == ["stored"]
    assert a.call(call, "UNREGISTER", {"instance": "gone"}) == (True, {})
    op = Raw(ep)
    try:
        op.ok("HELLO", {"protocol": 1})
        assert op.ok("CLEAR", {"namespace": GONE_NS, "tenant": a_tenant})["evicted"] == 1
    finally:
        op.sock.close()
    assert a.call(call, "EVICTED", {"namespace": GONE_NS, "since": 0})[1]["keys"] == gone  # control
    a_state = {"instances": a_names, "lease": lease, "keys": ks, "tenant": a_tenant, "b_tenant": b_tenant}
    objects = _objects_of(xdaemon.status(), a_tenant)
    assert objects == 2

    b.call(hello, ep)
    b.call(register, 0xAB, "rb")
    b_operator = isinstance(b, Owner)
    for op in messages.REQUESTS:
        bodies = cases(op, a_state, b_operator)  # KeyError: a request type without a case
        for body in bodies:
            if op == "REGISTER":
                ok, reply = b.call(register_as, body["instance"])  # B's own rank of that name
                assert ok and reply["instance"] == body["instance"], f"REGISTER {body}: {reply}"
                continue
            ok, reply = b.call(call, op, body)
            where = f"{op} {body} as {b_tenant or 'the daemon user'}"
            if op == "LOOKUP":
                assert ok and reply["chunks"] == 0, f"{where} hit the other tenant's objects: {reply}"
            elif op == "STATUS" and not b_operator:
                assert {n["tenant"] for n in reply["namespaces"]} <= {b_tenant}, (
                    f"{where}: {reply['namespaces']}"
                )
                assert {i["tenant"] for i in reply["instances"]} <= {b_tenant}, (
                    f"{where}: {reply['instances']}"
                )
            elif op == "EVICTED" and body["namespace"] == GONE_NS:  # only A ever stored there
                assert ok and reply["keys"] == [], f"{where} shows the other tenant's evictions: {reply}"
            elif op == "RETRIEVE" and ok:  # from B's own objects (its STOREs above): B's bytes only
                assert "lease" not in body, f"{where} used the other tenant's lease: {reply}"
                got = b.call(kv_bytes, body["instance"], 40, 8)
                assert (got == 0xAB).all(), f"{where} wrote the other tenant's bytes into B's blocks"
            elif op == "RELEASE" or (op == "CLEAR" and not b_operator):
                assert not ok and reply["code"] == "FORBIDDEN", f"{where}: {reply}"
            if op in ("HELLO", "BYE"):  # B's own session ended or restarted: carry on with a new one
                b.call(hello, ep)
                b.call(register, 0xAB, "rb")
        _assert_a_untouched(xdaemon, a, a_state, objects, f"after B's {op}")

    # B on A's routing identity: every request type is refused, HELLO included
    for op in messages.REQUESTS:
        body = cases(op, a_state, b_operator)[0]
        if op == "REGISTER":
            body = {**body, "layout": b.call(_layout_of, "rb")}
        ok, reply = b.call(on_identity, ep, a_identity, op, body)
        assert not ok and reply["code"] == "FORBIDDEN", f"{op} on A's identity: {reply}"
    a.call(reconnect, ep, a_identity)
    _assert_a_untouched(xdaemon, a, a_state, objects, "after B used A's routing identity")

    # A's own requests: its lease still serves its bytes, and its eviction record is still there
    ok, reply = a.call(call, "RETRIEVE", {**store_body(ks, "r0", base=40), "lease": lease})
    assert ok and reply["ok"] == [True, True]
    np.testing.assert_array_equal(a.call(kv_bytes, "r0", 40, 8), original)
    assert a.call(call, "EVICTED", {"namespace": GONE_NS, "since": 0})[1]["keys"] == gone


def _layout_of(state, inst):
    return state[f"rank-{inst}"].layout()


def _objects_of(status: dict, tenant: str) -> int:
    return sum(n["objects"] for n in status["namespaces"] if n["tenant"] == tenant)


def _assert_a_untouched(xdaemon, a, a_state, objects, when):
    st = xdaemon.status()
    mine = sorted(i["instance"] for i in st["instances"] if i["tenant"] == a_state["tenant"])
    assert mine == sorted(a_state["instances"]), f"{when}: the first tenant's instances are {mine}"
    assert _objects_of(st, a_state["tenant"]) == objects, f"{when}: the first tenant's objects changed"
    assert st["leases_active"] >= 1, f"{when}: the first tenant's lease is gone"
    for name in a_state["instances"]:  # each instance still A's: A's STORE through it finds its objects
        ok, reply = a.call(call, "STORE", store_body(a_state["keys"], name))
        assert ok and reply["results"] == ["exists", "exists"], f"{when}: A's STORE through {name}: {reply}"
