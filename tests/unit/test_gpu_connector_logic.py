"""The CUDA worker path's logic that needs no GPU (tests/e2e/test_gpu_connector.py runs it on one): the
staging buffer's size, the knob that sets it, when a load may be reported (only once its scatter
is complete, a failed one once every scatter queued for it is), and a staged job that fails
part-way failing only after the requests it already sent are done."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from tierd.protocol import MAX_REQUEST_PARTS
from tierd.protocol.layout import GroupKind, PageLayout
from tierd.protocol.messages import StoreReply
from tierd_client.futures import join, merge_stores
from tierd_client.layouts import block_span, group, layout, namespace
from tierd_client.rank_jobs import Loaded
from tierd_client.staged_rank import StagedRank
from tierd_client.vllm_connector.config import STAGING_AUTO_CAP_MB, STAGING_AUTO_CHUNKS, ConnectorConfig
from tierd_client.vllm_connector.geometry import EngineGeometry, Group
from tierd_client.vllm_connector.registration import staging_bytes
from tierd_client.vllm_connector.worker import WorkerSide

MiB = 1 << 20


def two_group_layout() -> PageLayout:
    """A full-attention group (3 layers, 4-token blocks of 256 bytes) and a state group (2 layers,
    one 96-byte state per 16-token chunk)."""

    def spans(layers, blocks, block_bytes, base):
        return [
            block_span(
                (blocks, block_bytes),
                (block_bytes, 1),
                1,
                0,
                tensor=0,
                offset=base + i * blocks * block_bytes,
            )
            for i in range(layers)
        ]

    full = spans(3, 32, 256, 0)
    state = spans(2, 32, 96, 3 * 32 * 256)
    ref = {"handle": {"kind": "shm", "path": "/dev/shm/x"}, "nbytes": 3 * 32 * 256 + 2 * 32 * 96}
    st = group("state", 16, state)
    return PageLayout.from_wire(layout(namespace("m", "fp"), 0, 16, [ref], [group("full", 4, full), st]))


def test_a_chunk_in_staging_is_every_groups_part():
    lay = two_group_layout()
    assert [g.kind for g in lay.groups] == [GroupKind.FULL, GroupKind.STATE]
    assert lay.chunk_bytes == 3 * 4 * 256 + 2 * 1 * 96


@pytest.mark.parametrize(
    "mb,chunk,expect",
    [
        (
            0,
            128 << 10,
            2 * STAGING_AUTO_CHUNKS * (128 << 10),
        ),  # auto: 8 chunks each way (the GPU test's 2 MiB)
        (
            0,
            32 * MiB,
            2 * (STAGING_AUTO_CAP_MB // 32) * 32 * MiB,
        ),  # auto, capped: 4 chunks of 32 MiB each way
        (0, 200 * MiB, 2 * 200 * MiB),  # auto, a chunk over the cap: still one each way
        (10, MiB, 10 * MiB),  # explicit: 5 chunks each way
        (10.5, 3 * MiB, 2 * MiB * 3),  # explicit, rounded down to whole chunks each way
        (1, MiB, 2 * MiB),  # explicit but too small: one chunk each way
    ],
)
def test_staging_size(mb, chunk, expect):
    got = staging_bytes(mb, chunk)
    assert got == expect
    assert got % (2 * chunk) == 0


def test_staging_knob():
    assert ConnectorConfig.from_extra({}).staging_mb == 0
    assert ConnectorConfig.from_extra({"tierd.staging_mb": "64"}).staging_mb == 64.0
    with pytest.raises(ValueError, match="tierd.staging_mb"):
        ConnectorConfig.from_extra({"tierd.staging_mb": -1})


# ---- when a CUDA load is reported --------------------------------------------------------------------
class Event:
    """Stands in for a CUDA event: ``query()`` is what the worker polls."""

    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


class Staged:
    """Stands in for the rank's StagedRank: only what the worker asks of it when a load ends."""

    def __init__(self):
        self.marks: list[Event] = []

    def scatters_done(self) -> Event:
        self.marks.append(Event())
        return self.marks[-1]


def cuda_worker() -> WorkerSide:
    g = Group(0, GroupKind.FULL, 16, 0, "FullAttentionSpec", ("l0",), 512, False)
    geo = EngineGeometry((g,), 64, "m", 1, "fp")
    client = SimpleNamespace(server=SimpleNamespace(null_block_id=-1))
    w = WorkerSide(ConnectorConfig(url="ipc:///nowhere"), geo, client, "e/0", num_blocks=64)
    w.gpu = Staged()
    return w


def test_a_load_is_reported_only_once_its_scatter_is_complete():
    w = cuda_worker()
    ev = Event()
    fut: Future = Future()
    w.loads["a"] = (fut, [[[4, 5, 6, 7]]])
    assert w.transfer_results() == (set(), set())  # not answered
    fut.set_result(Loaded([True], [], ev))
    assert w.transfer_results() == (set(), set())  # scatter queued, not done
    assert w.transfer_results() == (set(), set())
    ev.done = True
    assert w.transfer_results() == ({"a"}, set())
    assert not w.loads and not w._landing


def test_a_partly_failed_load_waits_for_its_scatter_then_names_exactly_the_missed_blocks():
    w = cuda_worker()
    ev = Event()
    fut: Future = Future()
    w.loads["a"] = (fut, [[[4, 5, 6, 7]], [[8, 9, 10, 11]]])
    fut.set_result(Loaded([True, False], [(0, 8), (0, 9), (0, 10), (0, 11)], ev))
    assert w.transfer_results() == (set(), set())  # chunk 0 is still being scattered
    ev.done = True
    assert w.transfer_results() == ({"a"}, {"a"})
    assert w.take_invalid_blocks() == {8, 9, 10, 11}


def test_a_failed_load_waits_for_every_scatter_queued_before_vllm_recomputes_its_blocks():
    w = cuda_worker()
    fut: Future = Future()
    w.loads["a"] = (fut, [[[4, 5, 6, 7]], [[8, 9, 10, 11]]])
    fut.set_exception(TimeoutError("RETRIEVE deadline"))
    assert w.transfer_results() == (set(), set())
    assert len(w.gpu.marks) == 1  # one event after the scatters queued so far, polled from then on
    assert w.transfer_results() == (set(), set())
    assert len(w.gpu.marks) == 1
    w.gpu.marks[0].done = True
    assert w.transfer_results() == ({"a"}, {"a"})
    assert w.take_invalid_blocks() == {4, 5, 6, 7, 8, 9, 10, 11}


def test_without_the_load_fence_a_load_is_reported_on_its_answer():
    """The private switch the GPU test's negative control turns off."""
    w = cuda_worker()
    w._load_fence = False
    fut: Future = Future()
    w.loads["a"] = (fut, [[[4, 5, 6, 7]]])
    fut.set_result(Loaded([True], [], Event()))
    assert w.transfer_results() == ({"a"}, set())


# ---- a staged job failing part-way -------------------------------------------------------------------
def test_a_job_failing_part_way_fails_only_once_the_requests_sent_are_done():
    parts = [Future(), Future()]
    out: Future = Future()
    join(parts, out, merge_stores, error=RuntimeError("no room in staging"))
    parts[0].set_result(StoreReply(["stored"]))
    assert not out.done()  # part 1 may still be read by the daemon / scattered
    parts[1].set_result(StoreReply(["stored"]))
    with pytest.raises(RuntimeError, match="no room"):
        out.result(0)


def test_a_job_that_failed_before_sending_anything_fails_at_once():
    out: Future = Future()
    join([], out, merge_stores, error=RuntimeError("closed"))
    with pytest.raises(RuntimeError, match="closed"):
        out.result(0)


def test_a_whole_job_merges_its_requests_in_order():
    parts = [Future(), Future()]
    out: Future = Future()
    join(parts, out, merge_stores)
    parts[1].set_result(StoreReply(["exists"]))
    parts[0].set_result(StoreReply(["stored", "stored"]))
    assert out.result(0) == StoreReply(["stored", "stored", "exists"])


@pytest.mark.parametrize(
    "groups,chunk,staging,expect",
    [
        (1, 128 << 10, 2 * MiB, 2),  # the connector's auto size for the GPU test: a quarter of a half
        (1, 1024, 64 * MiB, MAX_REQUEST_PARTS),  # tiny chunks: the daemon's bound on a request
        (3, 1024, 64 * MiB, MAX_REQUEST_PARTS // 3),
    ],
)
def test_staged_requests_stay_within_the_daemons_bound(groups, chunk, staging, expect):
    stager = SimpleNamespace(nbytes=staging, chunk_bytes=chunk, groups=[None] * groups)
    rank = StagedRank(SimpleNamespace(), "e/0", stager)
    try:
        assert rank.per_request == expect
    finally:
        rank.close()
