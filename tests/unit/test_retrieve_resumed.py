"""A RETRIEVE that waited for the second tier is planned from what was checked before it waited,
without a daemon (the handlers over a real registry and pool; rank memory a stand-in): its block
ids are not checked again, while what the wait may have changed is: its instance gone answers
UNKNOWN_INSTANCE, its instance registered anew is checked from the start against the new layout,
and its deadline passed answers EXPIRED."""

from __future__ import annotations

import time

import pytest
from test_registry import Memory

from tierd.base.config import Settings
from tierd.base.stats import Stats
from tierd.core import handlers
from tierd.core.jobs import Call, RetrieveNeeds, Tier
from tierd.pool.pool import Pool
from tierd.protocol import messages as m
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import PageLayout
from tierd.state.planner import Geometry
from tierd.state.registry import Registry
from tierd.transfer.engine import TransferEngine

KEY = bytes(range(16))


def layout(num_blocks: int = 16) -> PageLayout:
    """One rank of one full-attention group: 4-token blocks of 256 bytes, one layer."""
    span = {"tensor": 0, "offset": 0, "block_stride": 256, "num_blocks": num_blocks, "run_bytes": 256}
    return PageLayout.from_wire(
        {
            "namespace": {"model": "m", "fingerprint": "f", "world_size": 1},
            "rank": 0,
            "chunk_tokens": 16,
            "tensors": [{"handle": {"kind": "shm", "path": "/dev/shm/x"}, "nbytes": 256 * num_blocks}],
            "groups": [{"kind": "full", "block_tokens": 4, "layers": [span]}],
        }
    )


@pytest.fixture
def tier():
    pool = Pool(ceiling=1 << 20, initial=0, align=256, segment_bytes=1 << 20)
    lanes = TransferEngine(0)
    reg = Registry(pool, lanes, lease_ttl_s=60.0, heartbeat_timeout_s=30.0)
    yield Tier(reg, pool, Stats(), Settings(), "boot", lambda lay, peer: Memory(), dict, l2=object())
    lanes.close()
    pool.close()


def waited(tier: Tier, blocks: list[int], deadline: float = 0.0):
    """A session, its rank r0, and a RETRIEVE of ``blocks`` checked as it was before its wait."""
    session = tier.registry.open_session(b"a", "w", 1)
    tier.registry.register(session, "r0", layout(), tier.open_memory)
    call = Call(b"a", session, [b"a"], 1, time.monotonic())
    msg = m.Retrieve("r0", [m.Chunk(KEY, [blocks])], deadline=deadline)
    need = handlers.retrieve(tier, call, msg)  # with a second tier: what it needs first
    assert type(need) is RetrieveNeeds
    return session, call, need


def test_a_retrieve_back_from_its_wait_is_not_checked_again(tier, monkeypatch):
    _, call, need = waited(tier, [0, 1, 2, 3])

    def checked_again(self, chunks):
        raise AssertionError("the block ids were checked again")

    monkeypatch.setattr(Geometry, "check", checked_again)
    reply = handlers.retrieve_resumed(tier, call, need)
    assert reply.ok == [False] and reply.failed == [(0, b) for b in (0, 1, 2, 3)]  # L1 lacks it


def test_a_retrieve_whose_instance_left_while_it_waited_answers_unknown_instance(tier):
    _, call, need = waited(tier, [0, 1, 2, 3])
    tier.registry.close_session(b"a", reason="BYE")  # unregisters r0
    with pytest.raises(ProtocolError) as err:
        handlers.retrieve_resumed(tier, call, need)
    assert err.value.code is ErrorCode.UNKNOWN_INSTANCE


def test_a_retrieve_whose_instance_was_registered_anew_is_checked_against_the_new_one(tier):
    session, call, need = waited(tier, [12, 13, 14, 15])
    tier.registry.unregister(next(iter(tier.registry.instances)))
    # the same rank again, now with 8 blocks: ids 12-15 are out of its range
    tier.registry.register(session, "r0", layout(num_blocks=8), tier.open_memory)
    with pytest.raises(ProtocolError) as err:
        handlers.retrieve_resumed(tier, call, need)
    assert err.value.code is ErrorCode.BAD_REQUEST


def test_a_retrieve_whose_deadline_passed_while_it_waited_answers_expired(tier):
    _, call, need = waited(tier, [0, 1, 2, 3], deadline=time.time() + 0.05)
    time.sleep(0.06)
    with pytest.raises(ProtocolError) as err:
        handlers.retrieve_resumed(tier, call, need)
    assert err.value.code is ErrorCode.EXPIRED
