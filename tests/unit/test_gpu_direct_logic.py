"""The direct CUDA path's planning and the transfer engine's inline lanes, as pure logic on the
CPU: which layouts are pitched, the exact copies a chunk becomes, and where a job runs."""

import threading
import types
from concurrent.futures import Future

import msgspec
import numpy as np
import pytest

from tierd.protocol import messages
from tierd.protocol.layout import GroupLayout
from tierd.transfer import dma
from tierd.transfer.dma import DmaLane
from tierd.transfer.engine import INLINE_ANY, INLINE_MAX_BYTES, DeviceWork, TransferEngine
from tierd.transfer.items import (
    MAX_PITCH,
    CopyItem,
    Pitched,
    events_order_processes,
    pitched,
    pitched_copies,
    row_pitches,
    span_copies,
)
from tierd_client.direct_rank import DirectRank
from tierd_client.layouts import block_span, group
from tierd_client.rank_jobs import RankJob
from tierd_client.staged_rank import StagedRank

BB = 1024  # bytes per block per layer


def spans(kind: str, layers: int = 3, blocks: int = 10, heads: int = 2):
    """Byte spans of a vLLM 0.33 [B, H, N, C] view per layer, physical order ``kind`` (N*C = 512)."""
    dims = {"L": layers, "B": blocks, "H": heads, "N": 4, "C": 128}
    strides, acc = {}, 1
    for ch in reversed(kind):
        strides[ch] = acc
        acc *= dims[ch]
    shape = tuple(dims[ch] for ch in "BHNC")
    st = tuple(strides[ch] for ch in "BHNC")
    return [block_span(shape, st, 1, 0, tensor=0, offset=i * strides["L"]) for i in range(layers)]


def geometry(kind: str, base: int = 1 << 20) -> Pitched | None:
    g = GroupLayout.from_wire(group("full", 4, spans(kind)))
    return pitched(g, [base + s.offset for s in g.layers])


def test_layer_and_block_outermost_orders_are_pitched():
    assert geometry("LBNHC") == Pitched(1 << 20, 10 * BB, BB, BB, 3)
    assert geometry("LBHNC") == Pitched(1 << 20, 10 * BB, BB, BB, 3)
    assert geometry("BLNHC") == Pitched(1 << 20, BB, 3 * BB, BB, 3)
    assert geometry("BLHNC") == Pitched(1 << 20, BB, 3 * BB, BB, 3)


def test_orders_with_a_block_in_several_runs_are_not():
    assert geometry("LHBNC") is None  # one run per head
    assert geometry("BHLNC") is None


def test_a_pitch_past_the_copy_engines_limit_is_not():
    g = GroupLayout.from_wire(group("full", 4, spans("LBNHC")))
    assert pitched(g, [s.offset for s in g.layers], max_pitch=10 * BB - 1) is None
    assert pitched(g, [s.offset for s in g.layers], max_pitch=10 * BB) is not None


def test_unevenly_spaced_layers_are_not():
    g = GroupLayout.from_wire(group("full", 4, spans("LBNHC")))
    assert pitched(g, [0, 10 * BB, 30 * BB]) is None


def test_block_outermost_groups_lay_objects_out_block_by_block():
    for kind, block_major in [
        ("BLNHC", True),
        ("BLHNC", True),
        ("LBNHC", False),
        ("LBHNC", False),
        ("LHBNC", False),
        ("BHLNC", False),  # a layer's block is one run per head: not one span
    ]:
        g = GroupLayout.from_wire(group("full", 4, spans(kind)))
        assert g.block_major is block_major, kind
        # (layer stride, block stride) inside a part of 4 blocks per chunk (chunk of 16 tokens)
        assert g.object_strides(16) == ((BB, 3 * BB) if block_major else (4 * BB, BB)), kind
    one = GroupLayout.from_wire(group("full", 4, spans("BLNHC", layers=1)))
    assert not one.block_major  # one layer: both orders are the same bytes


def test_block_outermost_copies_are_one_span_per_block_at_exact_addresses():
    p = geometry("BLNHC", base=0)
    obj = np.zeros(2 * 4 * 3 * BB, dtype=np.uint8)  # two objects of 4 blocks x 3 layers, back to back
    first, second = obj[: 12 * BB], obj[12 * BB :]
    at = obj.ctypes.data
    items = [
        CopyItem(np.array([7, 2, 3, 9]), np.arange(4), 4, first),
        CopyItem(np.array([2, 3]), np.array([1, 3]), 4, second),  # a null between: positions 1 and 3
        CopyItem(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 4, second),
    ]
    devs, hosts, sizes = span_copies(p, items)
    # engine block b at b*3*BB, its 3 layers one span; host position k at k*3*BB ([block][layer]);
    # blocks 2 and 3 of the first item are adjacent on both sides: one copy; block 9 follows the
    # first item's last host byte and 2 of the second lies right after 9 in neither
    assert list(zip(devs.tolist(), (hosts - at).tolist(), sizes.tolist())) == [
        (7 * 3 * BB, 0, 3 * BB),
        (2 * 3 * BB, 3 * BB, 6 * BB),
        (9 * 3 * BB, 9 * BB, 3 * BB),
        (2 * 3 * BB, 12 * BB + 3 * BB, 3 * BB),
        (3 * 3 * BB, 12 * BB + 9 * BB, 3 * BB),
    ]


def test_block_outermost_copies_never_merge_across_objects():
    """Two objects may lie in different pinned ranges: a copy never spans both, even where the
    second object's first block continues the first's last on both sides."""
    p = geometry("BLNHC", base=0)
    obj = np.zeros(2 * 2 * 3 * BB, dtype=np.uint8)
    items = [
        CopyItem(np.array([4, 5]), np.arange(2), 2, obj[: 6 * BB]),
        CopyItem(np.array([6, 7]), np.arange(2), 2, obj[6 * BB :]),
    ]
    _, hosts, sizes = span_copies(p, items)
    assert (hosts - obj.ctypes.data).tolist() == [0, 6 * BB] and sizes.tolist() == [6 * BB, 6 * BB]
    assert [len(x) for x in span_copies(p, items[:0])] == [0, 0, 0]


def test_block_outermost_copies_match_one_copy_per_block_merged_where_adjacent():
    """Against a per-block reference, over random ids: shuffled (nothing merges, the usual case),
    runs of neighbours (some merge), with nulls, one block."""
    p = geometry("BLNHC", base=0)
    unit = 3 * BB
    rng = np.random.default_rng(5)
    for trial in range(60):
        n_items = int(rng.integers(1, 5))
        bpc = int(rng.integers(1, 7))
        obj = np.zeros(n_items * bpc * unit, dtype=np.uint8)
        items = []
        for i in range(n_items):
            if trial % 3 == 0:
                ids = rng.permutation(64)[:bpc]
            else:
                ids = int(rng.integers(0, 50)) + np.arange(bpc)
            keep = rng.random(bpc) < (0.7 if trial % 2 else 1.0)
            view = obj[i * bpc * unit : (i + 1) * bpc * unit]
            items.append(CopyItem(ids[keep].astype(np.int64), np.flatnonzero(keep), bpc, view))
        want = []
        for it in items:
            last = None
            for b, k in zip(it.ids.tolist(), it.pos.tolist()):
                d, h = b * unit, it.view.ctypes.data + k * unit
                if last is not None and last[0] + last[2] == d and last[1] + last[2] == h:
                    last[2] += unit
                else:
                    last = [d, h, unit]
                    want.append(last)
        devs, hosts, sizes = span_copies(p, items)
        assert [list(x) for x in zip(devs.tolist(), hosts.tolist(), sizes.tolist())] == want, trial


def test_layer_outermost_runs_of_ids_merge_into_one_wider_copy():
    p = geometry("LBNHC", base=0)
    ops = pitched_copies(p, 0, np.array([4, 5, 6, 9]), np.array([0, 1, 2, 3]))
    assert ops == [(4 * BB, 0, 3 * BB), (9 * BB, 3 * BB, BB)]
    # consecutive ids at positions that are not consecutive (a null between) do not merge
    assert pitched_copies(p, 0, np.array([4, 5]), np.array([0, 2])) == [
        (4 * BB, 0, BB),
        (5 * BB, 2 * BB, BB),
    ]


class RecordingDriver:
    """The driver calls a lane makes, recorded, each held to what the copy engines accept: a 2D
    copy's pitches at least its width and within their largest (CUDA_ERROR_INVALID_VALUE else)."""

    ok = True

    def __init__(self):
        self.copies2d = []

    def current(self, device):
        pass

    def copy2d(self, host, host_pitch, dev, dev_pitch, width, rows, d2h, stream):
        assert width <= host_pitch <= MAX_PITCH and width <= dev_pitch <= MAX_PITCH, (
            f"the copy engines refuse {rows} rows of {width} bytes at pitches {dev_pitch}/{host_pitch}"
        )
        self.copies2d.append((dev, host, width, rows, dev_pitch, host_pitch))

    def event(self):
        return 1

    def record(self, event, stream):
        pass


def lane_with(driver, monkeypatch) -> DmaLane:
    """A DmaLane over ``driver`` (no GPU here: only its planning and driver calls run)."""
    monkeypatch.setattr(dma, "_DRIVER", driver)
    lane = object.__new__(DmaLane)
    lane.device, lane.d2h, lane.cu_stream, lane._done = 0, True, 0, []
    lane.stats = {"calls": 0, "bytes": 0, "dmas": 0, "host_s": 0.0, "sync_s": 0.0}
    return lane


@pytest.mark.parametrize("kind", ["LBNHC", "LBHNC"])
def test_a_single_layer_groups_adjacent_blocks_go_as_copies_the_copy_engines_accept(kind, monkeypatch):
    """A group of one layer (a small hybrid model's attention or state group) has no pitch between
    layers; its adjacent blocks merge into one row wider than a block, which the driver refused
    (cuMemcpy2DAsync: CUDA driver error 1) for every direct store and restore of such a chunk."""
    g = GroupLayout.from_wire(group("full", 4, spans(kind, layers=1)))
    p = pitched(g, [(1 << 20) + s.offset for s in g.layers])
    assert p == Pitched(1 << 20, BB, BB, BB, 1)
    ops = pitched_copies(p, 1 << 30, np.array([2, 3, 4, 5, 8]), np.arange(5))
    assert ops == [((1 << 20) + 2 * BB, 1 << 30, 4 * BB), ((1 << 20) + 8 * BB, (1 << 30) + 4 * BB, BB)]
    driver = RecordingDriver()
    lane_with(driver, monkeypatch).copy_pitched(ops, p.layers, p.pitch, 8 * BB, None)
    assert [(d, h, w, rows) for d, h, w, rows, _, _ in driver.copies2d] == [(d, h, w, 1) for d, h, w in ops]


def test_rows_wider_than_their_pitch_are_refused_before_any_copy():
    assert row_pitches(1, 4 * BB, BB, 2 * BB) == (4 * BB, 4 * BB)
    assert row_pitches(3, BB, 10 * BB, 4 * BB) == (10 * BB, 4 * BB)
    with pytest.raises(ValueError, match="3 rows of 4096 bytes"):
        row_pitches(3, 4 * BB, 2 * BB, 8 * BB)


def test_dmas_whose_destinations_overlap_go_one_by_one_in_order():
    """A batch's copies have no order among themselves: a request naming one block twice keeps
    the one-by-one order (the last one wins); disjoint destinations go as one batch."""
    from tierd.transfer import cudriver

    driver = object.__new__(cudriver.Driver)  # (no libcuda here)
    driver._attrs = {}
    calls = []
    driver.batch = (lambda *args: calls.append("batch") or 0, False)
    driver.copy = lambda h, d, n, d2h, stream: calls.append((h, d, n))

    def copies(runs, d2h):
        hosts, devs, sizes = (np.array(x, dtype=np.int64) for x in zip(*runs))
        driver.copies(hosts, devs, sizes, d2h, 0, 0)

    copies([(0, 100, 10), (20, 105, 10)], False)  # host -> device, overlapping at 105
    assert calls == [(0, 100, 10), (20, 105, 10)]
    calls.clear()
    copies([(0, 100, 10), (20, 110, 10)], False)
    assert calls == ["batch"]
    calls.clear()
    copies([(0, 100, 10), (20, 100, 10)], True)  # device -> host: one source read twice
    assert calls == ["batch"]
    calls.clear()
    copies([(30, 100, 10), (20, 200, 10), (25, 300, 10)], True)  # host ranges overlap out of order
    assert calls == [(30, 100, 10), (20, 200, 10), (25, 300, 10)]
    calls.clear()
    copies([(0, 100, 10)], True)  # one copy: no batch
    assert calls == [(0, 100, 10)]


class FakeJob:
    def __init__(self, nbytes=1):
        self.nbytes = nbytes


def run_one(engine, lane, nbytes=1):
    where = []
    engine.submit(lane, lambda: where.append(threading.current_thread()), FakeJob(nbytes))
    assert engine.wait_idle(5)
    engine.drain()
    return where[0]


def test_an_idle_inline_lane_runs_a_small_job_on_the_submitting_thread():
    engine = TransferEngine(2)
    try:
        engine.attach("cuda-rank", duplex=True, inline=INLINE_MAX_BYTES)  # a direct rank's
        engine.attach("staged-rank", duplex=True, inline=INLINE_ANY)
        engine.attach("cpu-rank")
        me = threading.current_thread()
        assert run_one(engine, "cuda-rank") is me
        assert run_one(engine, "cuda-rank\x00read") is me  # its retrieve lane too
        assert run_one(engine, "cpu-rank") is not me
        assert run_one(engine, "cuda-rank", INLINE_MAX_BYTES) is me
        assert run_one(engine, "cuda-rank", INLINE_MAX_BYTES + 1) is not me  # too large: a copy thread
        assert run_one(engine, "staged-rank", 1 << 40) is me  # any size: a few whole-object DMAs
    finally:
        engine.close()


def test_an_inline_lanes_device_work_is_still_waited_for_off_the_main_loop():
    engine = TransferEngine(2)
    try:
        engine.attach("cuda-rank", inline=INLINE_MAX_BYTES)
        waited = []
        engine.submit(
            "cuda-rank",
            lambda: DeviceWork([lambda: waited.append(threading.current_thread())]),
            FakeJob(),
        )
        assert engine.wait_idle(5)
        [(job, result, exc)] = engine.drain()
        assert result is None and exc is None
        assert waited and waited[0] is not threading.current_thread()
    finally:
        engine.close()


def test_a_job_for_a_busy_inline_lane_waits_its_turn_on_a_copy_thread():
    engine = TransferEngine(2)
    try:
        engine.attach("cuda-rank", inline=INLINE_MAX_BYTES)
        order, release = [], threading.Event()

        def first():
            order.append("first")
            release.wait(5)

        t = threading.Thread(target=engine.submit, args=("cuda-rank", first, FakeJob()))
        t.start()
        while not order:
            pass
        engine.submit("cuda-rank", lambda: order.append(threading.current_thread()), FakeJob())
        assert order == ["first"]  # queued behind the running job, not run here
        release.set()
        t.join(5)
        assert engine.wait_idle(5)
        assert order[1] is not threading.current_thread()
    finally:
        engine.close()


@pytest.mark.parametrize("inline", [0, INLINE_MAX_BYTES])
def test_jobs_of_one_lane_finish_in_order(inline):
    engine = TransferEngine(4)
    try:
        engine.attach("r", inline=inline)
        for i in range(50):
            engine.submit("r", lambda i=i: i, FakeJob())
        assert engine.wait_idle(5)
        assert [r for _, r, _ in engine.drain()] == list(range(50))
    finally:
        engine.close()


# ---- where the engine side sends from (StagedRank, DirectRank) with stand-ins for the GPU --------------
class Event:
    def __init__(self, done=True):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        while not self.done:
            threading.Event().wait(0.001)


class Stager:
    """Stands in for cuda_stage.Stager: gathers complete at once unless ``slow``."""

    def __init__(self, chunk_bytes=100, nbytes=2000, slow=False):
        self.chunk_bytes, self.nbytes, self.groups, self.slow = chunk_bytes, nbytes, [None], slow
        self.gathered: list[Event] = []
        self.prepared: list[tuple] = []  # (chunks, at) of every scatter prepared
        self.scattered: list = []  # what each scatter was handed as prepared
        self.released: list = []

    def gather(self, chunks, at, after=None, null=-1, fence=True):
        return None

    def recorded(self, scatter=False):
        self.gathered.append(Event(done=not self.slow))
        return self.gathered[-1]

    def prepare_scatter(self, chunks, at, null=-1):
        self.prepared.append((chunks, at))
        return ("prepared", len(self.prepared))

    def release(self, prepared):
        self.released.append(prepared)

    def scatter(self, chunks, at, null=-1, skip=None, after=None, ready=None, prepared=None):
        self.scattered.append(prepared)
        return Event()


class Client:
    """Records (op, body, thread) per call; answers when told."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.futs: list[Future] = []

    def call_async(self, op, body, timeout=None):
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(body))  # the body as the daemon reads it
        self.calls.append((op, wire, threading.current_thread()))
        self.futs.append(Future())
        return self.futs[-1]

    def answer(self, i, body):
        self.futs[i].set_result(body)


def stored(n):
    return messages.StoreReply(["stored"] * n)


def chunk(key, ids):
    return {"key": key, "blocks": [ids]}


def test_an_idle_staged_store_of_written_blocks_is_sent_on_the_callers_thread():
    client, stager = Client(), Stager()
    rank = StagedRank(client, "e/0", stager)
    try:
        fut = rank.store([chunk(b"k" * 16, [1, 2])])
        assert [(op, t) for op, _, t in client.calls] == [("STORE", threading.current_thread())]
        assert client.calls[0][1]["staged_at"] == 0
        client.answer(0, stored(1))
        assert fut.result(1) == stored(1)
    finally:
        rank.close()


def test_a_store_whose_gather_waits_for_the_forward_is_sent_by_another_thread():
    client, stager = Client(), Stager()
    rank = StagedRank(client, "e/0", stager)
    try:
        forward = Event(done=False)
        stager.slow = True  # the gather waits for the forward on the GPU
        fut = rank.store([chunk(b"k" * 16, [1, 2])], after=forward)
        assert client.calls == []  # not sent: its gather has not run
        forward.done = stager.gathered[0].done = True
        for _ in range(1000):
            if client.calls:
                break
            threading.Event().wait(0.001)
        assert client.calls[0][2] is not threading.current_thread()
        client.answer(0, stored(1))
        assert fut.result(1) == stored(1)
    finally:
        rank.close()


def test_jobs_of_one_direction_go_out_in_order_when_one_had_to_queue():
    """A job that could not run on the caller's thread (no room yet) is queued, and every job after
    it queues behind it, though the next one would find room at once."""
    client, stager = Client(), Stager(chunk_bytes=100, nbytes=200)  # one chunk's room each way
    rank = StagedRank(client, "e/0", stager, inline=True)
    try:
        first = rank.retrieve([chunk(b"a" * 16, [1])])  # fills the room
        second = rank.retrieve([chunk(b"c" * 16, [3])])  # no room: queued for the submitter
        third = rank.retrieve([chunk(b"d" * 16, [4])])
        assert [c[1]["chunks"][0]["key"] for c in client.calls] == [b"a" * 16]
        for i, fut in enumerate((first, second, third)):
            for _ in range(1000):
                if len(client.calls) > i:
                    break
                threading.Event().wait(0.001)
            client.answer(i, messages.RetrieveReply([True], [], event=None))
            assert fut.result(1).ok == [True]
        assert [c[1]["chunks"][0]["key"] for c in client.calls] == [b"a" * 16, b"c" * 16, b"d" * 16]
    finally:
        rank.close()


def test_without_inline_every_job_goes_through_the_submitter():
    client, stager = Client(), Stager()
    rank = StagedRank(client, "e/0", stager, inline=False)
    try:
        rank.retrieve([chunk(b"a" * 16, [1])])
        for _ in range(1000):
            if client.calls:
                break
            threading.Event().wait(0.001)
        assert client.calls[0][2] is not threading.current_thread()
    finally:
        rank.close()


def test_direct_requests_wait_for_their_event_and_keep_their_order():
    client = Client()
    rank = DirectRank(client, "e/0", device=None)
    try:
        forward = Event(done=False)
        a = rank.store([chunk(b"a" * 16, [1])], after=forward)
        b = rank.store([chunk(b"b" * 16, [2])])  # its blocks are written, but a store is ahead of it
        assert client.calls == []
        forward.done = True
        for _ in range(1000):
            if len(client.calls) == 2:
                break
            threading.Event().wait(0.001)
        assert [c[1]["chunks"][0]["key"] for c in client.calls] == [b"a" * 16, b"b" * 16]
        assert all("staged_at" not in c[1] for c in client.calls)
        client.answer(0, stored(1))
        client.answer(1, stored(1))
        assert a.result(1) == b.result(1) == stored(1)
        c = rank.store([chunk(b"c" * 16, [3])], after=Event(done=True))
        assert client.calls[2][2] is threading.current_thread()  # nothing ahead: sent right here
        client.answer(2, stored(1))
        assert c.result(1) == stored(1)
    finally:
        rank.close()


def test_a_large_direct_job_goes_as_requests_of_at_most_request_bytes_so_copies_overlap_planning():
    """The daemon starts a request's copies once it has planned all of it: a job is cut into
    requests of at most ``request_bytes`` (never less than one chunk), answered as one."""
    client = Client()
    rank = DirectRank(client, "e/0", device=None, chunk_bytes=10, request_bytes=25)
    try:
        job = rank.store([chunk(bytes([i]) * 16, [i]) for i in range(5)])
        assert [len(c[1]["chunks"]) for c in client.calls] == [2, 2, 1]
        for i in range(3):
            client.answer(i, stored(len(client.calls[i][1]["chunks"])))
        assert job.result(1).results == ["stored"] * 5
        one = DirectRank(Client(), "e/1", device=None, chunk_bytes=100, request_bytes=25)
        assert one.per_request == 1  # a chunk larger than request_bytes: one per request
        one.close()
    finally:
        rank.close()


class CountingReply(Future):
    """Stands in for a client Reply: counts the waits that would read the socket."""

    def __init__(self):
        super().__init__()
        self.pumped = 0

    def exception(self, timeout=None):
        self.pumped += 1
        return super().exception(timeout)


@pytest.mark.parametrize("alone", [False, True])
def test_a_waiting_caller_reads_the_answer_itself_only_for_a_job_alone_in_flight(alone):
    """Reading the socket on the caller's thread holds it for milliseconds: only worth it (and
    harmless) when no other request of the rank needs it meanwhile."""
    job = RankJob()
    job.sent(CountingReply())
    job.alone = lambda: alone
    with pytest.raises(TimeoutError):
        job.result(0.01)
    assert job.reply.pumped == (1 if alone else 0)


def test_a_retrieves_scatter_is_prepared_while_the_daemon_copies_and_let_go_when_the_answer_fails():
    """The scatter's plan and descriptors are made right after the RETRIEVE is sent, so the answer
    only launches it; an answer that fails lets the prepared plan go (its upload-ring place)."""
    client, stager = Client(), Stager()
    rank = StagedRank(client, "e/0", stager)
    try:
        fut = rank.retrieve([chunk(b"a" * 16, [1, 2])])
        assert [c for c, _ in stager.prepared] == [[[[1, 2]]]] and stager.scattered == []
        client.answer(0, messages.RetrieveReply([True], []))
        assert fut.result(1).ok == [True]
        assert stager.scattered == [("prepared", 1)] and stager.released == []
        failing = rank.retrieve([chunk(b"b" * 16, [3])])
        client.futs[1].set_exception(RuntimeError("the daemon went away"))
        with pytest.raises(RuntimeError):
            failing.result(1)
        assert stager.released == [("prepared", 2)] and stager.scattered == [("prepared", 1)]
    finally:
        rank.close()


class SocketHeldReply(Future):
    """Stands in for a client Reply whose answer is on the socket: only a read (``poll``) on the
    calling thread delivers it (the I/O thread would, at its next turn)."""

    def __init__(self):
        super().__init__()
        self.answer = None

    def poll(self):
        if self.answer is not None and not self.done():
            self.set_result(self.answer)
        return self.done()


class HeldClient(Client):
    def call_async(self, op, body, timeout=None):
        super().call_async(op, body, timeout)
        self.futs[-1] = SocketHeldReply()
        return self.futs[-1]

    def answer(self, i, body):
        self.futs[i].answer = body


def test_a_polled_job_split_in_several_requests_reads_every_answer_on_the_polling_thread():
    """An engine loop polls its loads once a step; a load cut into several requests (a large
    prompt: a 32k-token 8B prompt is 64 of them) ends when the last answer is read, so a poll
    reads each request's answer, not only the last request's."""
    client = HeldClient()
    rank = DirectRank(client, "e/0", device=None, chunk_bytes=10, request_bytes=25)
    try:
        # a store: a retrieve's merged answer takes a CUDA event, which this machine lacks; both
        # are the same RankJob
        job = rank.store([chunk(bytes([i]) * 16, [i]) for i in range(5)])
        assert len(client.calls) == 3
        assert not job.poll()  # nothing answered yet
        for i in range(3):
            client.answer(i, stored(len(client.calls[i][1]["chunks"])))
        assert job.poll()
        assert job.result(0).results == ["stored"] * 5
    finally:
        rank.close()


class FakeStream:
    def __init__(self, name):
        self.name, self.cuda_stream, self.waited = name, id(self), []

    def wait_event(self, ev):
        self.waited.append(ev)


class FakeEvent:
    def __init__(self):
        self.on = None

    def record(self, stream):
        self.on = stream


class FakeCudaTorch:
    """What lanes_after_open asks of torch.cuda, recorded (no GPU here)."""

    def __init__(self):
        import contextlib
        import types

        self.current = FakeStream("current")  # the stream torch's IPC opening made wait
        self.cuda = types.SimpleNamespace(
            device=lambda d: contextlib.nullcontext(),
            Event=FakeEvent,
            Stream=lambda device: FakeStream("lane"),
            current_stream=lambda device: self.current,
        )


def test_a_ranks_copy_lanes_wait_for_what_its_memory_was_shared_after():
    """torch's opening of a CUDA IPC handle makes the opening thread's current stream wait for the
    sharing process's fill; the lanes copy on streams of their own, so each waits for that stream
    first (tests/daemon/test_gpu_direct.py shows the bytes on a GPU)."""
    from tierd.transfer.cuda import lanes_after_open

    torch = FakeCudaTorch()
    d2h, h2d = lanes_after_open(torch, 0, host=None)
    assert d2h.d2h and not h2d.d2h
    for lane in (d2h, h2d):
        assert lane.stream is not torch.current and len(lane.stream.waited) == 1
        assert lane.stream.waited[0].on is torch.current


class FakeGpuMemory:
    """A rank's GPU memory as a RETRIEVE job sees it: its copies queued as device work, and
    ``signals``: whether its interprocess events order the engine's work (not on ROCm)."""

    duplex = True

    def __init__(self, signals: bool):
        self.signals, self.signalled = signals, 0

    def retrieve(self, group, items):
        return DeviceWork([lambda: None])

    def signal(self):
        self.signalled += 1
        return b"\x01" * 64


def retrieve_job(memory, event=None):
    from tierd.core.jobs import Call, RetrieveJob

    inst = types.SimpleNamespace(id="r0", memory=memory, label="engine/0")
    plan = types.SimpleNamespace(copies={0: ["an item"]}, results=[True], failed=[], objs=[])
    return RetrieveJob(None, Call(b"x", None, [b"x"], 1, 0.0), inst, plan, 0.0, 0, event)


def test_a_retrieve_is_answered_early_only_where_interprocess_events_order_the_engines_work():
    """CUDA: the reply goes once the copies are queued, with the event the engine waits for. ROCm
    answers a query of an interprocess event as complete once it is recorded (ROCm/hip#3778): an
    engine told to wait for one would read its blocks before the copies landed, so the reply
    waits for the copies there."""
    cuda, rocm = FakeGpuMemory(signals=True), FakeGpuMemory(signals=False)
    early = retrieve_job(cuda)
    assert early.run().early == {"event": b"\x01" * 64} and early.queued(None).event == b"\x01" * 64
    late = retrieve_job(rocm)
    assert late.run().early is None and rocm.signalled == 0


# every request type whose message can carry an event for the daemon's copies to wait for
EVENT_OPS = sorted(op for op, t in messages.REQUESTS.items() if "event" in t.__struct_fields__)


def test_the_requests_that_carry_an_engine_event_are_store_and_retrieve():
    assert EVENT_OPS == ["RETRIEVE", "STORE"]  # a new one is refused below as soon as it is listed


@pytest.mark.parametrize("op", EVENT_OPS)
def test_a_request_that_asks_the_daemon_to_wait_for_an_engine_event_is_refused_on_rocm(op):
    """Refused before anything is checked, reserved or pinned: its bytes are not ready by any
    measure the daemon can trust there."""
    from tierd.core import handlers
    from tierd.core.jobs import Call
    from tierd.protocol.errors import ProtocolError

    inst = types.SimpleNamespace(memory=FakeGpuMemory(signals=False), label="engine/0")
    tier = types.SimpleNamespace(registry=types.SimpleNamespace(instance=lambda name, tenant: inst))
    call = Call(b"x", types.SimpleNamespace(tenant="default"), [b"x"], 1, 0.0)
    body = messages.REQUESTS[op]("engine", [messages.Chunk(b"k" * 16, [[1, 2]])], event=b"\x02" * 64)
    with pytest.raises(ProtocolError) as err:
        handlers.HANDLERS[op](tier, call, body)
    assert err.value.code.name == "BAD_REQUEST" and "host order" in err.value.message
    # what else may carry an event: a rank whose events order the engine's work, a CPU rank
    for memory in (FakeGpuMemory(signals=True), object()):
        handlers._check_event(types.SimpleNamespace(memory=memory, label="e/0"), b"\x02" * 64)
    handlers._check_event(inst, None)  # host order: nothing to wait for


@pytest.mark.parametrize("hip", [None, "6.4.43482"])
def test_interprocess_events_are_trusted_on_cuda_builds_of_torch_only(hip, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    assert events_order_processes(torch) is (hip is None)


@pytest.mark.parametrize("hip", [None, "6.4.43482"])
def test_status_says_whether_restores_are_answered_when_their_copies_are_queued(hip, monkeypatch):
    """An operator on ROCm sees why restores answer later there (/status ``cuda_detail``)."""
    torch = pytest.importorskip("torch")
    from tierd.transfer.cuda import CudaSupport

    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    assert CudaSupport().status()["interprocess_events"] is (hip is None)
