"""Helpers shared by the wire-level tests: chunk builders and fixtures that clean up after
themselves (shared-memory ranks, raw sockets, clients in either object-grouping mode)."""

from __future__ import annotations

import pytest
from kv import FakeRank, GroupGeom
from wire import Raw

NULL = -1


def chunk(key: bytes, *per_group) -> dict:
    return {"key": key, "blocks": [list(ids) for ids in per_group]}


def ids(start: int, n: int = 4) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def ranks():
    """``ranks(GroupGeom(...), ..., **FakeRank kwargs)``; buffers are unlinked at teardown."""
    made: list[FakeRank] = []

    def make(*groups: GroupGeom, **kw) -> FakeRank:
        r = FakeRank(list(groups), **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def raw():
    """``raw(daemon)``: a raw DEALER on the daemon's socket, closed at teardown."""
    made: list[Raw] = []

    def make(d, identity: bytes | None = None) -> Raw:
        r = Raw(d.endpoint, identity)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture(params=["separate", "combined"])
def grouping(request):
    """Daemon flags for both object groupings: one object per engine group per chunk, or one
    object per chunk per rank holding every group (--no-separate-object-groups)."""
    return () if request.param == "separate" else ("--no-separate-object-groups",)


@pytest.fixture
def gdaemon(grouping, daemon_factory):
    return daemon_factory(*grouping)


@pytest.fixture
def gclient(gdaemon, client_factory):
    return client_factory(gdaemon)
