"""The CUDA data path through a real daemon: this test process is the engine. It gathers and
scatters in its own context (tierd_client.cuda_stage) and the ``tierd serve`` subprocess only
DMAs whole objects between the engine's staging buffer (CUDA IPC) and its pinned pool. Round
trips per layout and implementation, no daemon CUDA context before a registration, pinned pool,
typed errors for bad handles, both directions at once, and the two fences, each with its
negative control: a store gathers only once the forward's writes are done, and a forward reads
restored blocks only once their scatter is done."""

import copy
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tierd.protocol.layout import PageLayout  # noqa: E402
from tierd_client import TierdError, native  # noqa: E402
from tierd_client.cuda_ipc import share_cuda_tensors  # noqa: E402
from tierd_client.cuda_stage import Stager  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402
from tierd_client.staged_rank import StagedRank  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = 0
CHUNK = 64  # tokens per chunk
BLOCK = 16  # tokens per block
BPC = CHUNK // BLOCK
SPIN = 1_000_000_000  # torch.cuda._sleep cycles: about 0.5 s at 1.98 GHz


@pytest.fixture(scope="module", autouse=True)
def built():
    assert native.load(timeout=900) is not None, native.state()


class Engine:
    """vLLM 0.33-style KV: one buffer, per-layer [B, H, N, C] views in physical order ``kind``."""

    def __init__(
        self, kind="LBNHC", layers=4, blocks=64, heads=2, c=64, r=1, impl="auto", staging_mb=64, staging=0
    ):
        dims = {"L": layers, "B": blocks * r, "H": heads, "N": BLOCK // r, "C": c}
        phys = [dims[ch] for ch in kind]
        n = 1
        for d in phys:
            n *= d
        self.buf = torch.randint(0, 256, (n * 2,), dtype=torch.uint8, device=f"cuda:{DEV}")
        logical = self.buf.view(torch.bfloat16).view(phys).permute([kind.index(ch) for ch in "LBHNC"])
        self.views = [logical[i] for i in range(layers)]
        refs, where = share_cuda_tensors(self.views)
        spans = [
            block_span(tuple(v.shape), tuple(v.stride()), 2, 0, tensor=w[0], offset=w[1], blocks_per_block=r)
            for v, w in zip(self.views, where)
        ]
        self.r = r
        self.layout = layout(
            namespace("gpu-test", uuid.uuid4().hex),
            0,
            CHUNK,
            refs,
            [group("full", BLOCK, spans)],
            device="cuda",
        )
        self.stager = Stager(PageLayout.from_wire(self.layout), [self.buf], staging or staging_mb << 20, impl)
        self.layout["staging"] = self.stager.ref

    def rank(self, client, instance="r0", **kw) -> StagedRank:
        client.register(instance, self.layout)
        return StagedRank(client, instance, self.stager, timeout_s=60, **kw)

    def blocks(self, ids):
        """[layers, len(ids)] manager blocks as bytes (kernel blocks folded)."""
        out = []
        for v in self.views:
            out.append(
                torch.stack(
                    [v[b * self.r : (b + 1) * self.r].contiguous().view(torch.uint8).flatten() for b in ids]
                )
            )
        return torch.stack(out)

    def zero(self, ids):
        for v in self.views:
            for b in ids:
                v[b * self.r : (b + 1) * self.r].zero_()


def chunks(keys, ids):
    return [{"key": k, "blocks": [ids[i * BPC : (i + 1) * BPC]]} for i, k in enumerate(keys)]


def keys(n):
    return [uuid.uuid4().bytes[:16] for _ in range(n)]


def after_now():
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(DEV))
    return ev


def test_no_context_before_registration_then_pinned_pool(daemon_factory, client_factory):
    d = daemon_factory("--l1-init-size-gb", "0.125", pool_mb=256)
    st = d.status()
    assert st["cuda"] is True
    assert st["cuda_detail"]["contexts"] == [], "the daemon made a CUDA context before anyone registered"
    assert (
        st["memory_pinned_bytes"] == 0
        and st["cuda_detail"]["pin_pending_bytes"] == st["memory_total_bytes"] > 0
    )
    c = client_factory(d)
    Engine().rank(c)
    st = d.status()
    assert st["cuda_detail"]["contexts"] == [DEV] and st["cuda_detail"]["devices_open"] == [DEV]
    assert st["memory_pinned_bytes"] == st["memory_total_bytes"]


@pytest.mark.parametrize(
    "impl,host_order",
    [("kernel", False), ("torch", False), ("kernel", True)],
    ids=["kernel", "torch", "kernel-host-order"],
)
@pytest.mark.parametrize("kind,r", [("LBNHC", 1), ("LHBNC", 1), ("BHLNC", 2), ("BLNHC", 1)])
def test_round_trip_through_the_daemon(daemon_factory, client_factory, impl, host_order, kind, r):
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    eng = Engine(kind, r=r, impl=impl)
    # several requests per job
    rank = eng.rank(c, request_bytes=2 * eng.stager.chunk_bytes, host_order=host_order)
    ks = keys(6)
    src, dst = list(range(0, 6 * BPC)), list(range(32, 32 + 6 * BPC))
    assert rank.store(chunks(ks, src), after=after_now()).result().results == ["stored"] * 6
    expect = eng.blocks(src)
    eng.zero(dst)
    got = rank.retrieve(chunks(ks, dst)).result()
    assert (got.ok, got.failed) == ([True] * 6, [])
    torch.cuda.current_stream(DEV).wait_event(got.done)
    assert torch.equal(eng.blocks(dst), expect)
    lanes = d.status()["cuda_detail"]["lanes"]
    assert lanes["store"]["bytes"] > 0 and lanes["retrieve"]["bytes"] > 0


@pytest.mark.parametrize("host_order", [False, True], ids=["device", "host"])
def test_store_and_retrieve_of_one_rank_run_at_once(daemon_factory, client_factory, host_order):
    d = daemon_factory(pool_mb=512)
    c = client_factory(d, timeout_s=60)
    eng = Engine(layers=8, blocks=256, heads=4, c=128)
    rank = eng.rank(c, request_bytes=4 * eng.stager.chunk_bytes, host_order=host_order)
    ka, kb = keys(20), keys(20)
    a, b, into = list(range(0, 80)), list(range(80, 160)), list(range(160, 240))
    assert all(x == "stored" for x in rank.store(chunks(ka, a), after=after_now()).result().results)
    fs = rank.store(chunks(kb, b), after=after_now())
    fr = rank.retrieve(chunks(ka, into))
    assert all(x == "stored" for x in fs.result().results) and all(fr.result().ok)
    fr.result().done.synchronize()
    assert torch.equal(eng.blocks(into), eng.blocks(a))
    got = rank.retrieve(chunks(kb, into)).result()
    got.done.synchronize()
    assert torch.equal(eng.blocks(into), eng.blocks(b))


def test_a_missing_chunk_fails_exactly_its_blocks_and_leaves_them_untouched(daemon_factory, client_factory):
    d = daemon_factory(pool_mb=128)
    c = client_factory(d, timeout_s=60)
    eng = Engine()
    rank = eng.rank(c)
    ks = keys(2)
    rank.store(chunks(ks[:1], list(range(BPC))), after=after_now()).result()
    dst = list(range(40, 40 + 2 * BPC))
    eng.zero(dst)
    before = eng.blocks(dst)
    got = rank.retrieve(chunks(ks, dst)).result()
    got.done.synchronize()
    assert got.ok == [True, False] and got.failed == [(0, b) for b in dst[BPC:]]
    assert torch.equal(eng.blocks(dst[BPC:]), before[:, BPC:])  # not scattered over
    assert torch.equal(eng.blocks(dst[:BPC]), eng.blocks(list(range(BPC))))


def test_bad_handles_are_layout_invalid(daemon_factory, client_factory):
    d = daemon_factory(pool_mb=128)
    c = client_factory(d)
    eng = Engine()

    def refused() -> int:
        return d.status()["errors_by_code"]["LAYOUT_INVALID"]

    def bad(mutate, match, by="daemon"):
        """``by``: who refuses it, the daemon, or the client before sending (a layout whose types
        do not fit, checked with the daemon's own rules: tierd_client.wire.typed)."""
        lay = copy.deepcopy(eng.layout)
        mutate(lay)
        before = refused()
        with pytest.raises(TierdError) as err:
            c.register(f"bad-{uuid.uuid4().hex[:6]}", lay)
        assert err.value.code == "LAYOUT_INVALID", err.value
        assert match in err.value.message, err.value.message
        assert refused() - before == (by == "daemon"), f"refused by the {by}? {err.value.message}"

    def corrupt(lay):
        lay["staging"]["handle"]["ipc"][1] = bytes(len(lay["staging"]["handle"]["ipc"][1]))

    bad(corrupt, "cannot open the CUDA IPC handle")
    bad(
        lambda lay: lay["staging"]["handle"].update(device_uuid="GPU-00000000-0000-0000-0000-000000000000"),
        "not visible",
    )
    bad(lambda lay: lay["staging"]["handle"]["ipc"].pop(), "ipc", by="client")
    # without staging the daemon copies straight to and from the KV blocks (tests/daemon/test_gpu_direct.py),
    # which a layout keeping a layer's block in several runs (one per head) does not allow
    runs = copy.deepcopy(Engine("LHBNC").layout)
    runs.pop("staging")
    bad(lambda lay: (lay.clear(), lay.update(copy.deepcopy(runs))), "staging buffer")
    bad(
        lambda lay: lay["staging"].update(handle={"kind": "shm", "path": "/dev/shm/x", "offset": 0}),
        "cuda_ipc",
    )
    eng.rank(c, "good")  # the daemon is fine after all that
    assert refused() == 4


@pytest.mark.parametrize("host_order", [False, True], ids=["device", "host"])
def test_store_gathers_only_after_the_forward_wrote_the_blocks_negative_control(
    daemon_factory, client_factory, host_order
):
    """The engine rewrites blocks behind a long kernel on its forward stream. A store without the
    forward's event gathers the old bytes; with it, always the new ones (the daemon's DMA ordered
    after the gather on the GPU, or, in host order, the STORE sent once the gather is done)."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is gone")
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    eng = Engine(layers=4, blocks=64)
    rank = eng.rank(c, host_order=host_order)
    src, dst = list(range(0, 4 * BPC)), list(range(32, 32 + 4 * BPC))
    forward = torch.cuda.Stream(DEV)
    outcome = {}
    for fenced in (False, True):
        stale = []
        for _ in range(3):
            old = eng.blocks(src)
            torch.cuda.synchronize()
            with torch.cuda.stream(forward):
                torch.cuda._sleep(SPIN)  # the forward pass still running
                for v in eng.views:
                    v[: 4 * BPC].random_(0, 127)  # the new KV it writes
                ev = torch.cuda.Event()
                ev.record(forward)
            ks = keys(4)
            assert (
                rank.store(chunks(ks, src), after=ev if fenced else None).result().results == ["stored"] * 4
            )
            forward.synchronize()
            new = eng.blocks(src)
            got = rank.retrieve(chunks(ks, dst)).result()
            got.done.synchronize()
            stale.append(torch.equal(eng.blocks(dst), old))
            if fenced:
                assert torch.equal(eng.blocks(dst), new), "a fenced store gathered stale bytes"
        outcome[fenced] = stale
    assert any(outcome[False]), "control: without the forward's event the store should gather the old bytes"
    assert not any(outcome[True])


def test_forward_reads_restored_blocks_only_after_their_scatter_negative_control(
    daemon_factory, client_factory
):
    """The staging stream is busy (a long kernel) when the daemon answers: the scatter is queued
    behind it. A reader that does not wait for ``done`` sees the old bytes; one that waits
    (on the GPU) sees the restored ones."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is gone")
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    eng = Engine(layers=4, blocks=64)
    rank = eng.rank(c)
    src, dst = list(range(0, 4 * BPC)), list(range(32, 32 + 4 * BPC))
    ks = keys(4)
    rank.store(chunks(ks, src), after=after_now()).result()
    scatter = eng.stager.scatter

    def late_scatter(
        *args, **kw
    ):  # the scatter stream is busy when the reply comes: the scatter queues behind
        with torch.cuda.stream(eng.stager.scatter_stream):
            torch.cuda._sleep(SPIN)
        return scatter(*args, **kw)

    eng.stager.scatter = late_scatter
    seen = {}
    for fenced in (False, True):
        eng.zero(dst)
        torch.cuda.synchronize()
        got = rank.retrieve(chunks(ks, dst)).result()
        reader = torch.cuda.current_stream(DEV)
        if fenced:
            reader.wait_event(got.done)
        snapshot = eng.blocks(dst)  # what a forward launched now reads
        torch.cuda.synchronize()
        seen[fenced] = torch.equal(snapshot, eng.blocks(src))
    assert not seen[False], "control: without waiting for the scatter the reader should see the old bytes"
    assert seen[True]


def test_two_ranks_on_one_gpu_copy_through_one_daemon(daemon_factory, client_factory):
    """Two engine ranks (two staging buffers, two instances) on one daemon, at once, byte-exact."""
    d = daemon_factory(pool_mb=512)
    c = client_factory(d, timeout_s=60)
    engines = [Engine(layers=4, blocks=128) for _ in range(2)]
    ranks = [e.rank(c, f"r{i}") for i, e in enumerate(engines)]
    ks = [keys(16), keys(16)]
    src, dst = list(range(0, 64)), list(range(64, 128))
    futs = [r.store(chunks(k, src), after=after_now()) for r, k in zip(ranks, ks)]
    assert all(all(x == "stored" for x in f.result().results) for f in futs)
    t = time.perf_counter()
    got = [r.retrieve(chunks(k, dst)) for r, k in zip(ranks, ks)]
    for g in got:
        g.result().done.synchronize()
    print(f"\ntwo ranks restored {2 * 16} chunks in {(time.perf_counter() - t) * 1e3:.1f} ms")
    for e in engines:
        assert torch.equal(e.blocks(dst), e.blocks(src))


def test_host_order_retrieve_reuses_a_staging_room_only_after_its_scatter_negative_control(
    daemon_factory, client_factory
):
    """Host order: the daemon's DMA into a staging room does not wait on the GPU for the engine's
    scatter out of it, so the engine sends a RETRIEVE into a room only once the room's earlier
    scatter is complete. With one room each way and scatters queued behind a long kernel, two
    loads in a row: without that wait (control) the second load's bytes land in the room before
    the first scatter reads it, and the first load restores the second's bytes."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is gone")
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    probe = Engine(layers=4, blocks=64)
    eng = Engine(layers=4, blocks=64, staging=2 * probe.stager.chunk_bytes)  # one chunk's room each way
    rank = eng.rank(c, host_order=True)
    a, b = list(range(0, BPC)), list(range(BPC, 2 * BPC))
    into_a, into_b = list(range(32, 32 + BPC)), list(range(40, 40 + BPC))
    ka, kb = keys(1), keys(1)
    assert rank.store(chunks(ka, a), after=after_now()).result().results == ["stored"]
    assert rank.store(chunks(kb, b), after=after_now()).result().results == ["stored"]
    assert not torch.equal(eng.blocks(a), eng.blocks(b))
    scatter = eng.stager.scatter

    def late_scatter(*args, **kw):  # the staging stream is busy: each scatter queues behind a kernel
        with torch.cuda.stream(eng.stager.scatter_stream):
            torch.cuda._sleep(SPIN // 4)
        return scatter(*args, **kw)

    eng.stager.scatter = late_scatter
    wrong = {}
    for waits in (False, True):
        rank.rings["RETRIEVE"].device_done = waits
        bad = 0
        for _ in range(2):
            eng.zero(into_a + into_b)
            torch.cuda.synchronize()
            first = rank.retrieve(chunks(ka, into_a))
            second = rank.retrieve(chunks(kb, into_b))
            for f in (first, second):
                got = f.result()
                assert got.ok == [True]
                got.done.synchronize()
            bad += not torch.equal(eng.blocks(into_a), eng.blocks(a))
            assert torch.equal(eng.blocks(into_b), eng.blocks(b))
        wrong[waits] = bad
    assert wrong[False] > 0, "control: a room reused before its scatter ran should restore the wrong bytes"
    assert wrong[True] == 0
