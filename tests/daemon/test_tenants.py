"""Tenants (docs/protocol.md section 21), against a real daemon with real local users: what one
user stores is invisible to another and cannot be overwritten, read, released, unregistered or
cleared by them; /status shows no salt; a routing identity taken over by another uid is refused;
tcp:// clients are told apart by token. Each refusal has its control: the owner (or a second
process of the same user) doing the same thing succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, free_port
from kv import FakeRank, GroupGeom, keys
from tenancy import GEOM, NS_FP, SPECS, ns, store_body, tokens_file
from users import UserProcess, make_user, shared_socket_dir  # noqa: F401 - fixture
from util import chunk
from wire import Raw

from tierd.tools.testing import serve_argv


@pytest.fixture
def xdaemon(daemon_factory):
    """A daemon whose socket other local users can reach (folder 0711, socket 0666)."""
    folder = shared_socket_dir()
    endpoint = f"ipc://{folder}/tierd.sock"
    d = daemon_factory("--socket", endpoint, "--socket-mode", "0666")
    d.endpoint = endpoint
    yield d
    d.kill()
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)


@pytest.fixture
def users(make_user):
    procs: list[UserProcess] = []

    def make() -> UserProcess:
        p = UserProcess(make_user())
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.close()


# ---- code that runs as a throwaway user (state: what stays open between calls) ----------------
def hello(state, endpoint, name="c"):
    raw = state[name] = Raw(endpoint)
    return raw.ok("HELLO", {"protocol": 1, "client": f"test-{name}"})


def register(state, fill: int | None, inst="r0", salt="", name="c"):
    rank = state[f"rank-{inst}"] = FakeRank([GEOM], fingerprint=NS_FP)
    if fill is not None:
        rank.kv[0][:] = fill
    lay = rank.layout()
    lay["namespace"]["salt"] = salt
    return state[name].ok("REGISTER", {"instance": inst, "layout": lay})


def call(state, op, body, name="c"):
    return state[name].call(op, body)


def identity_of(state, name="c"):
    import zmq

    return state[name].sock.getsockopt(zmq.IDENTITY)


def store_as(state, endpoint, identity):
    """A STORE of r0 on a new connection that uses ``identity`` as its routing identity."""
    raw = state["hijack"] = Raw(endpoint, identity)
    return raw.call("STORE", store_body(keys(1)))


def kv_bytes(state, inst, start, n):
    return state[f"rank-{inst}"].kv[0][:, start : start + n].copy()


# ---- tests -----------------------------------------------------------------------------------
def test_another_tenant_never_hits_nor_overwrites_a_tenants_objects(xdaemon, users):
    a, b, a2 = users(), users(), None
    ks = keys(4)
    a.call(hello, xdaemon.endpoint)
    assert a.call(register, None)["instance"] == "r0"
    ok, reply = a.call(call, "STORE", store_body(ks))
    assert ok and reply["results"] == ["stored"] * 4
    original = a.call(kv_bytes, "r0", 0, 16)

    b.call(hello, xdaemon.endpoint)
    b.call(register, 0xAB)  # the same instance name and namespace, poisoned bytes
    ok, reply = b.call(call, "LOOKUP", {"namespace": ns(), "keys": ks, "chunk_tokens": 16, "groups": SPECS})
    assert ok and reply["chunks"] == 0, "another user's LOOKUP hit this user's objects"
    ok, reply = b.call(call, "STORE", store_body(ks))
    assert ok and reply["results"] == ["stored"] * 4  # into its own namespace

    # control: a second process of the first user hits, and gets the first user's bytes back
    a2 = UserProcess(a.user)
    try:
        a2.call(hello, xdaemon.endpoint)
        a2.call(register, 0x00, "r1")
        ok, reply = a2.call(
            call,
            "LOOKUP",
            {"namespace": ns(), "keys": ks, "chunk_tokens": 16, "groups": SPECS, "lease": False},
        )
        assert ok and reply["chunks"] == 4
        ok, reply = a2.call(call, "RETRIEVE", store_body(ks, "r1", base=32))
        assert ok and reply["ok"] == [True] * 4
        back = a2.call(kv_bytes, "r1", 32, 16)
    finally:
        a2.close()
    np.testing.assert_array_equal(back, original)
    assert not (back == 0xAB).all()
    tenants = {n["tenant"] for n in xdaemon.status()["namespaces"]}
    assert tenants == {f"uid:{a.user.uid}", f"uid:{b.user.uid}"}


def test_another_tenants_lease_and_instance_cannot_be_released_used_or_unregistered(xdaemon, users):
    a, b = users(), users()
    ks = keys(2)
    a.call(hello, xdaemon.endpoint)
    a.call(register, None)
    assert a.call(call, "STORE", store_body(ks))[1]["results"] == ["stored"] * 2
    ok, reply = a.call(call, "LOOKUP", {"namespace": ns(), "keys": ks, "chunk_tokens": 16, "groups": SPECS})
    lease = reply["lease"]
    assert ok and reply["chunks"] == 2 and lease > 0

    b.call(hello, xdaemon.endpoint)
    b.call(register, 0xAB)
    ok, err = b.call(call, "RELEASE", {"lease": lease})
    assert not ok and err["code"] == "FORBIDDEN"
    ok, err = b.call(call, "RETRIEVE", {**store_body(ks), "lease": lease})
    assert not ok and err["code"] == "FORBIDDEN"
    b.call(call, "UNREGISTER", {"instance": "r0"})  # its own r0, not the first user's
    ok, err = b.call(call, "STORE", store_body(ks))
    assert not ok and err["code"] == "UNKNOWN_INSTANCE"
    st = xdaemon.status()
    assert [(i["instance"], i["tenant"]) for i in st["instances"]] == [("r0", f"uid:{a.user.uid}")]
    assert st["leases_active"] == 1

    # control: the owner uses and releases them
    ok, reply = a.call(call, "RETRIEVE", {**store_body(ks, base=40)})
    assert ok and reply["ok"] == [True, True]
    assert a.call(call, "RELEASE", {"lease": lease}) == (True, {})
    assert xdaemon.status()["leases_active"] == 0


def test_clear_is_an_operator_action(xdaemon, users):
    a = users()
    a.call(hello, xdaemon.endpoint)
    a.call(register, None)
    a.call(call, "STORE", store_body(keys(3)))
    ok, err = a.call(call, "CLEAR", {})
    assert not ok and err["code"] == "FORBIDDEN"
    ok, err = a.call(call, "CLEAR", {"namespace": ns()})
    assert not ok and err["code"] == "FORBIDDEN"
    assert xdaemon.status()["objects"] == 3
    # control: the daemon's own user (an operator) clears that tenant's namespace by naming it
    op = Raw(xdaemon.endpoint)
    try:
        assert op.ok("HELLO", {"protocol": 1})["operator"] is True
        assert op.ok("CLEAR", {"namespace": ns()})["evicted"] == 0  # its own namespace of that name: empty
        assert op.ok("CLEAR", {"namespace": ns(), "tenant": f"uid:{a.user.uid}"})["evicted"] == 3
    finally:
        op.sock.close()
    assert xdaemon.status()["objects"] == 0


def test_status_never_shows_a_namespaces_salt(xdaemon, users):
    a, b = users(), users()
    a.call(hello, xdaemon.endpoint)
    assert a.call(register, None, "r0", "s3cret-salt-value")
    a.call(call, "STORE", store_body(keys(1)))
    b.call(hello, xdaemon.endpoint)
    ok, st = b.call(call, "STATUS", {})
    assert ok
    http = xdaemon.get("/status")[1].decode()
    for text in (json.dumps(st), http):
        assert "s3cret" not in text
    assert json.loads(http)["namespaces"][0]["salted"] is True


def test_a_sessions_identity_taken_over_by_another_uid_is_refused(xdaemon, users):
    a, b = users(), users()
    a.call(hello, xdaemon.endpoint)
    a.call(register, None)
    identity = a.call(identity_of)
    # the other user connects with the same routing identity (ROUTER_HANDOVER gives it the route)
    ok, err = b.call(store_as, xdaemon.endpoint, identity)
    assert not ok and err["code"] == "FORBIDDEN"
    assert xdaemon.status()["objects"] == 0
    # control: the owner's own new connection with that identity is its session
    ok, reply = a.call(store_as, xdaemon.endpoint, identity)
    assert ok and reply["results"] == ["stored"]


def test_tcp_clients_are_told_apart_by_token(daemon_factory, tmp_path):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    d = daemon_factory("--socket", endpoint, "--tcp-token-file", str(tokens_file(tmp_path)))
    d.endpoint = endpoint
    ks = keys(2)

    def session(token):
        raw = Raw(endpoint)
        body = {"protocol": 1} if token is None else {"protocol": 1, "token": token}
        return raw, raw.call("HELLO", body)

    for token in (None, "wrong-token-0123456789"):
        raw, (ok, err) = session(token)
        assert not ok and err["code"] == "FORBIDDEN"
        assert raw.call("PING", {})[1]["code"] == "UNKNOWN_SESSION"  # no session was opened
    alice, (ok, hi) = session("alice-token-0123456789")
    assert ok and hi["tenant"] == "tcp:alice" and hi["operator"] is False
    rank = FakeRank([GEOM], fingerprint=NS_FP)
    try:
        alice.ok("REGISTER", {"instance": "r0", "layout": rank.layout()})
        assert alice.ok("STORE", store_body(ks))["results"] == ["stored"] * 2
        bob, _ = session("bob-token-0123456789ab")
        assert (
            bob.ok("LOOKUP", {"namespace": ns(), "keys": ks, "chunk_tokens": 16, "groups": SPECS})["chunks"]
            == 0
        )
        assert bob.call("CLEAR", {})[1]["code"] == "FORBIDDEN"
        alice2, _ = session("alice-token-0123456789")  # control: the same tenant hits
        assert (
            alice2.ok(
                "LOOKUP", {"namespace": ns(), "keys": ks, "chunk_tokens": 16, "groups": SPECS, "lease": False}
            )["chunks"]
            == 2
        )
        admin, (_, hi) = session("admin-token-0123456789")
        assert hi["operator"] is True and admin.ok("CLEAR", {})["evicted"] == 2
    finally:
        rank.close()


def test_a_tcp_socket_needs_tokens_or_insecure_tcp_and_a_private_token_file(tmp_path):
    port = free_port()
    cmd = serve_argv(endpoint=f"tcp://127.0.0.1:{port}", http_port=-1)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert out.returncode == 2 and "--tcp-token-file" in out.stderr and "--insecure-tcp" in out.stderr
    out = subprocess.run(
        [*cmd, "--tcp-token-file", str(tokens_file(tmp_path, 0o644))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert out.returncode == 2 and "chmod 0600" in out.stderr


# ---- EVICTED (docs/protocol.md section 14), per tenant ----------------------------------------
def _evicted_hello(state, endpoint):
    state["c"] = Raw(endpoint)
    return state["c"].ok("HELLO", {"protocol": 1, "client": "evicted-test"})


def _evicted_store(state, n):
    rank = state["rank"] = FakeRank([GEOM], fingerprint=NS_FP)
    raw_ = state["c"]
    raw_.ok("REGISTER", {"instance": "r0", "layout": rank.layout()})
    ks = keys(n)
    chunks = [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(ks)]
    assert raw_.ok("STORE", {"instance": "r0", "chunks": chunks})["results"] == ["stored"] * n
    return ks


def _evicted_of(state, ns):
    return state["c"].ok("EVICTED", {"namespace": ns})


def test_a_tenant_sees_only_its_own_namespaces_evictions(xdaemon, make_user):
    a, b = UserProcess(make_user()), UserProcess(make_user())
    try:
        a.call(_evicted_hello, xdaemon.endpoint)
        b.call(_evicted_hello, xdaemon.endpoint)
        ks = a.call(_evicted_store, 3)
        ns = {"model": "test-model", "fingerprint": NS_FP, "world_size": 1, "salt": ""}
        op = Raw(xdaemon.endpoint)  # the daemon's own user: an operator
        try:
            op.hello()
            assert op.ok("CLEAR", {})["evicted"] == 3
            # the same namespace named by another tenant is another namespace: nothing of A's
            assert b.call(_evicted_of, ns)["keys"] == []
            mine = op.ok("EVICTED", {"namespace": ns})
            assert mine["keys"] == [] and mine["seq"] == 3  # the seq is daemon-wide; the keys are not
        finally:
            op.close()
        # control: A sees its own
        got = a.call(_evicted_of, ns)
        assert sorted(got["keys"]) == sorted(ks) and not got["missed"]
    finally:
        a.close()
        b.close()
