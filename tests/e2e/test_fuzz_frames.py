"""Hypothesis fuzzing of raw frames against one long-lived daemon: random bytes, random msgpack
shapes, and valid requests with one field replaced by a random value. Every frame gets exactly
one reply; errors are typed and never INTERNAL; the daemon serves a real client afterwards."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from conftest import DaemonProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv import FakeRank, GroupGeom, keys
from util import chunk
from wire import Raw, pack

from tierd.protocol import PROTOCOL_VERSION
from tierd.protocol.errors import ErrorCode
from tierd_client import TierdClient

CODES = {c.name for c in ErrorCode} - {"INTERNAL"}
OPS = ["HELLO", "REGISTER", "UNREGISTER", "LOOKUP", "RELEASE", "STORE", "RETRIEVE", "PING", "STATUS", "CLEAR"]
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
_sentinels = itertools.count(1 << 62)


@pytest.fixture(scope="module")
def fuzzd(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("fuzz"), "--max-frame-mb", "1", pool_mb=16)
    rank = FakeRank(
        [GroupGeom("full"), GroupGeom("sliding", window_tokens=8), GroupGeom("state", block_tokens=16)],
        num_blocks=16,
    )
    r = Raw(d.endpoint)
    r.hello()
    r.ok("REGISTER", {"instance": "fz", "layout": rank.layout()})
    ks = keys(4)
    r.ok(
        "STORE",
        {"instance": "fz", "chunks": [chunk(k, range(4), [-1, -1, 2, 3], [i]) for i, k in enumerate(ks)]},
    )
    yield d, r, rank, ks
    r.close()
    rank.close()
    d.kill()


def exchange(r: Raw, frame: bytes) -> list:
    """Send ``frame`` then a PING sentinel; return every reply that is not the sentinel's, having
    waited for the sentinel and at least one other reply (a copy may answer after the PING)."""
    sentinel = next(_sentinels)
    r.send(frame)
    r.send(pack(["PING", sentinel, {}]))
    got, seen = [], False
    while not (seen and got):
        msg = r.recv(10)
        if msg[0] == sentinel:
            seen = True
        else:
            got.append(msg)
    return got


def check(replies):
    assert len(replies) == 1, replies
    _, ok, body = replies[0]
    if not ok:
        assert body["code"] in CODES, body


def test_fuzz_random_bytes(fuzzd):
    d, r, *_ = fuzzd

    @FUZZ
    @given(st.binary(max_size=300))
    def run(frame):
        check(exchange(r, frame))

    run()
    assert r.quiet(0.2)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)


def test_fuzz_msgpack_shapes(fuzzd):
    """[op, req_id, body] with any op (known or not), any req_id, any body; on its own session."""
    d, _, *__ = fuzzd
    r = Raw(d.endpoint)
    try:
        r.hello()

        @FUZZ
        @given(
            st.sampled_from(OPS) | st.text(max_size=10) | msgpack_values,
            st.integers(-5, 2**64 - 1) | msgpack_values,
            st.dictionaries(
                st.sampled_from(
                    [
                        "protocol",
                        "instance",
                        "layout",
                        "keys",
                        "namespace",
                        "chunks",
                        "groups",
                        "chunk_tokens",
                        "lease",
                        "deadline",
                        "touch",
                    ]
                )
                | st.text(max_size=8),
                msgpack_values,
                max_size=6,
            )
            | msgpack_values,
        )
        def run(op, req_id, body):
            check(exchange(r, pack([op, req_id, body])))

        run()
        assert r.quiet(0.2)
    finally:
        r.close()


def _templates(rank, ks):
    ns, specs = rank.ns, rank.specs()
    lay = rank.layout()
    return {
        "REGISTER": {"instance": "fz2", "layout": lay},
        "UNREGISTER": {"instance": "ghost"},
        "LOOKUP": {
            "namespace": ns,
            "keys": ks,
            "groups": specs,
            "chunk_tokens": 16,
            "replicated": False,
            "lease": False,
        },
        "RELEASE": {"lease": 12345},
        "STORE": {"instance": "fz", "chunks": [chunk(ks[0], range(4), [-1, -1, 2, 3], [0])], "touch": ks[:1]},
        "RETRIEVE": {
            "instance": "fz",
            "chunks": [chunk(k, range(8, 12), [-1] * 4, [-1]) for k in ks[:2]],
            "lease": 0,
        },
        "HELLO": {"protocol": PROTOCOL_VERSION, "client": "fuzz", "pid": 1},
    }


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _replace(obj, path, value):
    if not path:
        return value
    obj = copy.deepcopy(obj)
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


def test_fuzz_one_bad_field(fuzzd):
    """A valid request with one field, anywhere in it, replaced by a random value (or removed)."""
    d, r, rank, ks = fuzzd
    templates = _templates(rank, ks)
    # HELLO is fuzzed on its own connection: a re-HELLO drops the session's registrations
    paths = [(op, p) for op, body in templates.items() for p in _paths(body) if op != "HELLO"]
    hello_paths = [p for p in _paths(templates["HELLO"])]
    side = Raw(d.endpoint)

    @FUZZ
    @given(
        st.sampled_from(paths),
        msgpack_values | st.just(KeyError),
        st.sampled_from(hello_paths),
        msgpack_values,
    )
    def run(where, value, hello_path, hello_value):
        op, path = where
        body = templates[op]
        if value is KeyError and path:
            body = copy.deepcopy(body)
            cur = body
            for p in path[:-1]:
                cur = cur[p]
            del cur[path[-1]]
        elif value is not KeyError:
            body = _replace(body, path, value)
        if not isinstance(body, dict):
            body = {"x": body}
        check(exchange(r, pack([op, 9, body])))
        check(exchange(side, pack(["HELLO", 10, _replace(templates["HELLO"], hello_path, hello_value)])))

    try:
        run()
    finally:
        side.close()
    assert r.quiet(0.2)
    st_ = d.status()
    assert st_["errors_by_code"].get("INTERNAL", 0) == 0, st_["errors_by_code"]


def test_daemon_serves_after_fuzzing(fuzzd):
    d, r, *_ = fuzzd
    assert r.ok("PING", {})
    rank = FakeRank([GroupGeom("full")])
    try:
        with TierdClient(d.endpoint, timeout_s=10) as c:
            c.wait_ready(10)
            c.register("after", rank.layout())
            k = keys(1)[0]
            assert c.store("after", [chunk(k, range(4))]).results == ["stored"]
            assert c.retrieve("after", [chunk(k, range(8, 12))]).ok == [True]
            np.testing.assert_array_equal(rank.kv[0][:, 8:12], rank.kv[0][:, 0:4])
    finally:
        rank.close()
    assert d.status()["errors_by_code"].get("INTERNAL", 0) == 0
