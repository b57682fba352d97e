"""The order the main loop handles waiting requests in (tierd.core.backlog): arrival order, except
that a RETRIEVE goes before the STOREs ahead of it, the two kinds then taking turns, and never
past any other op."""

from tierd.core.backlog import OTHER, RETRIEVE, STORE, Backlog, kind
from tierd.protocol import codec


def frame(op: str, n: int) -> bytes:
    return codec.encode_request(op, n, {})


def order(*ops: str) -> list[str]:
    b = Backlog()
    for i, op in enumerate(ops):
        b.put(frame(op, i), f"{op}{i}")
    out = []
    while b:
        _, name = b.take()
        out.append(name)
    assert (b.stores, b.retrieves) == (0, 0)
    return out


def test_the_kind_of_a_request_is_read_from_its_head():
    assert kind(frame("STORE", 1)) == STORE and kind(bytearray(frame("RETRIEVE", 2))) == RETRIEVE
    assert kind(memoryview(frame("LOOKUP", 3))) == OTHER and kind(b"") == OTHER
    assert kind(codec.encode_request("STOREX", 4, {})) == OTHER  # another op, a prefix alike


def test_a_retrieve_goes_before_the_stores_ahead_of_it_then_the_kinds_take_turns():
    assert order("STORE", "STORE", "RETRIEVE", "STORE", "RETRIEVE") == [
        "RETRIEVE2",
        "STORE0",
        "RETRIEVE4",
        "STORE1",
        "STORE3",
    ]
    burst = ["STORE"] * 4 + ["RETRIEVE"] * 4
    assert order(*burst) == [
        "RETRIEVE4",
        "STORE0",
        "RETRIEVE5",
        "STORE1",
        "RETRIEVE6",
        "STORE2",
        "RETRIEVE7",
        "STORE3",
    ]
    assert order("RETRIEVE", "RETRIEVE", "STORE") == ["RETRIEVE0", "RETRIEVE1", "STORE2"]  # none ahead


def test_no_request_moves_past_another_op():
    assert order("STORE", "LOOKUP", "RETRIEVE") == ["STORE0", "LOOKUP1", "RETRIEVE2"]
    assert order("REGISTER", "STORE", "RETRIEVE", "RELEASE", "STORE", "RETRIEVE") == [
        "REGISTER0",
        "RETRIEVE2",
        "STORE1",
        "RELEASE3",
        "RETRIEVE5",
        "STORE4",
    ]
    assert order("RETRIEVE", "STORE", "PING", "STORE") == ["RETRIEVE0", "STORE1", "PING2", "STORE3"]


def test_a_reorder_is_possible_only_while_a_store_waits():
    b = Backlog()
    b.put(frame("RETRIEVE", 0), "r")
    b.put(frame("LOOKUP", 1), "l")
    assert not b.may_reorder()
    b.put(frame("STORE", 2), "s")
    assert b.may_reorder()
    assert [b.take()[1] for _ in range(3)] == ["r", "l", "s"] and not b.may_reorder()
