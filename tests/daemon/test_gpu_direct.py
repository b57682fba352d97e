"""The direct CUDA data path through a real daemon: a rank registered without a staging buffer,
whose blocks the ``tierd serve`` subprocess copies straight to and from its pool as pitched
copies (tierd.transfer.cuda, direct ranks; tierd_client.direct_rank.DirectRank). Round trips in
vLLM 0.33's layer-outermost and block-outermost orders with shuffled block ids, typed errors for
a layout the copy engines cannot take, and the two fences, each with its negative control: a
store is sent only once the forward's writes are done, and restored blocks are read only once
the daemon's copies into them are."""

import uuid

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tierd.protocol.layout import PageLayout  # noqa: E402
from tierd_client import TierdError  # noqa: E402
from tierd_client.cuda_ipc import share_cuda_tensors  # noqa: E402
from tierd_client.direct_rank import DirectRank, direct_layout  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = 0
CHUNK = 64  # tokens per chunk
BLOCK = 16  # tokens per block
BPC = CHUNK // BLOCK
SPIN = 1_000_000_000  # torch.cuda._sleep cycles: about 0.5 s


class Engine:
    """vLLM 0.33-style KV: one buffer, per-layer [B, H, N, C] views in physical order ``kind``."""

    def __init__(self, kind="LBNHC", layers=4, blocks=64, heads=2, c=64):
        dims = {"L": layers, "B": blocks, "H": heads, "N": BLOCK, "C": c}
        n = 1
        for ch in kind:
            n *= dims[ch]
        self.buf = torch.randint(0, 256, (n * 2,), dtype=torch.uint8, device=f"cuda:{DEV}")
        logical = self.buf.view(torch.bfloat16).view([dims[ch] for ch in kind])
        self.views = list(logical.permute([kind.index(ch) for ch in "LBHNC"]))
        refs, where = share_cuda_tensors(self.views)
        spans = [
            block_span(tuple(v.shape), tuple(v.stride()), 2, 0, tensor=w[0], offset=w[1])
            for v, w in zip(self.views, where)
        ]
        self.layout = layout(
            namespace("gpu-direct", uuid.uuid4().hex),
            0,
            CHUNK,
            refs,
            [group("full", BLOCK, spans)],
            device="cuda",
        )

    def rank(self, client, instance="r0") -> DirectRank:
        client.register(instance, self.layout)
        return DirectRank(client, instance, torch.device("cuda", DEV), timeout_s=60)

    def blocks(self, ids, buf=None):
        """[layers, len(ids), block bytes] of the KV, or of ``buf``, a copy of its buffer"""
        views = self.views
        if buf is not None:
            flat = buf.view(torch.bfloat16)
            views = [flat.as_strided(v.shape, v.stride(), v.storage_offset()) for v in views]
        return torch.stack(
            [torch.stack([v[b].contiguous().view(torch.uint8).flatten() for b in ids]) for v in views]
        )

    def zero(self, ids):
        for v in self.views:
            for b in ids:
                v[b].zero_()


def chunks(keys, ids):
    return [{"key": k, "blocks": [ids[i * BPC : (i + 1) * BPC]]} for i, k in enumerate(keys)]


def keys(n):
    return [uuid.uuid4().bytes[:16] for _ in range(n)]


def shuffled(lo, n, seed):
    return (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + lo).tolist()


def after_now():
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(DEV))
    return ev


@pytest.mark.parametrize("kind", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
@pytest.mark.parametrize("ids", ["shuffled", "consecutive"])
@pytest.mark.parametrize("layers", [4, 1])  # one layer: a small hybrid's group (no pitch between layers)
def test_direct_round_trip_through_the_daemon(daemon_factory, client_factory, kind, ids, layers):
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    eng = Engine(kind, layers=layers, blocks=96)
    assert direct_layout(PageLayout.from_wire(eng.layout), [eng.buf])
    rank = eng.rank(c)
    n = 6
    src = shuffled(0, n * BPC, 1) if ids == "shuffled" else list(range(n * BPC))
    dst = shuffled(40, n * BPC, 2) if ids == "shuffled" else list(range(40, 40 + n * BPC))
    ks = keys(n)
    assert rank.store(chunks(ks, src), after=after_now()).result().results == ["stored"] * n
    expect = eng.blocks(src)
    eng.zero(dst)
    # after the zeroing, as the connector orders a load after the engine's forward: on a busy GPU
    # the daemon's copies could otherwise land first and be zeroed
    got = rank.retrieve(chunks(ks, dst), after=after_now()).result()
    assert (got.ok, got.failed) == ([True] * n, [])
    torch.cuda.current_stream(DEV).wait_event(got.done)
    assert torch.equal(eng.blocks(dst), expect)
    lanes = d.status()["cuda_detail"]["lanes"]
    assert lanes["store"]["bytes"] == lanes["retrieve"]["bytes"] == n * layers * BPC * eng.views[0][0].nbytes
    # one copy per block (pitched, or one span for block-outermost), one per chunk where blocks lie
    # side by side in the tensor and ids run on
    assert lanes["store"]["dmas"] == (n if ids == "consecutive" else n * BPC)


@pytest.mark.parametrize("kind", ["BLNHC", "LBNHC"])
def test_objects_mean_the_same_bytes_through_staging_and_direct(daemon_factory, client_factory, kind):
    """Two ranks of one namespace, one staged (the engine's gather kernel lays objects out) and
    one direct (the daemon's copies do): what either stores, the other restores exactly. For a
    block-outermost layout both lay objects out block by block (GroupLayout.block_major)."""
    from tierd_client import native
    from tierd_client.cuda_stage import Stager
    from tierd_client.staged_rank import StagedRank

    assert native.load(timeout=900) is not None, native.state()  # the gather kernel, not the fallback
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    eng = Engine(kind, blocks=96)
    assert PageLayout.from_wire(eng.layout).groups[0].block_major is kind.startswith("B")
    direct = eng.rank(c, "direct")
    stager = Stager(PageLayout.from_wire(eng.layout), [eng.buf], 8 << 20, "kernel")
    c.register("staged", {**eng.layout, "staging": stager.ref})
    staged = StagedRank(c, "staged", stager, timeout_s=60)
    n = 4
    for writer, reader, seed in ((staged, direct, 1), (direct, staged, 2)):
        src, dst = shuffled(0, n * BPC, seed), shuffled(40, n * BPC, seed + 10)
        ks = keys(n)
        assert writer.store(chunks(ks, src), after=after_now()).result().results == ["stored"] * n
        expect = eng.blocks(src)
        eng.zero(dst)
        got = reader.retrieve(chunks(ks, dst), after=after_now()).result()
        assert (got.ok, got.failed) == ([True] * n, [])
        torch.cuda.current_stream(DEV).wait_event(got.done)
        assert torch.equal(eng.blocks(dst), expect), f"{type(writer).__name__} -> {type(reader).__name__}"
    staged.close()
    direct.close()


def test_a_missing_chunk_fails_exactly_its_blocks_and_leaves_them_untouched(daemon_factory, client_factory):
    d = daemon_factory(pool_mb=128)
    c = client_factory(d, timeout_s=60)
    eng = Engine("BLNHC")
    rank = eng.rank(c)
    ks = keys(2)
    rank.store(chunks(ks[:1], list(range(BPC))), after=after_now()).result()
    dst = list(range(40, 40 + 2 * BPC))
    eng.zero(dst)
    before = eng.blocks(dst)
    got = rank.retrieve(chunks(ks, dst), after=after_now()).result()
    got.done.synchronize()
    assert got.ok == [True, False] and got.failed == [(0, b) for b in dst[BPC:]]
    assert torch.equal(eng.blocks(dst[BPC:]), before[:, BPC:])
    assert torch.equal(eng.blocks(dst[:BPC]), eng.blocks(list(range(BPC))))


def test_a_layout_the_copy_engines_cannot_take_without_staging_is_layout_invalid(
    daemon_factory, client_factory
):
    """LHBNC keeps a layer's block in one run per head: without a staging buffer it is refused, and
    the client's own check agrees."""
    d = daemon_factory(pool_mb=128)
    c = client_factory(d)
    eng = Engine("LHBNC")
    assert not direct_layout(PageLayout.from_wire(eng.layout), [eng.buf])
    with pytest.raises(TierdError) as err:
        c.register("bad", eng.layout)
    assert err.value.code == "LAYOUT_INVALID" and "staging buffer" in err.value.message
    Engine("BLNHC").rank(c, "good")  # the daemon is fine after it


def test_a_direct_store_reads_only_what_the_forward_wrote_negative_control(daemon_factory, client_factory):
    """The engine rewrites blocks behind a long kernel on its forward stream. A store without the
    forward's event copies the old bytes; with it (sent once the event completed), the new ones."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is gone")
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    eng = Engine("BLNHC", layers=4, blocks=64)
    rank = eng.rank(c)
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
            res = rank.store(chunks(ks, src), after=ev if fenced else None).result()
            assert res.results == ["stored"] * 4
            forward.synchronize()
            new = eng.blocks(src)
            got = rank.retrieve(chunks(ks, dst)).result()
            got.done.synchronize()
            stale.append(torch.equal(eng.blocks(dst), old))
            if fenced:
                assert torch.equal(eng.blocks(dst), new), "a fenced store copied stale bytes"
        outcome[fenced] = stale
    assert any(outcome[False]), "control: without the forward's event the store should copy the old bytes"
    assert not any(outcome[True])


@pytest.mark.parametrize("kind", ["LBNHC", "BLNHC"])
def test_a_restore_into_memory_the_engine_is_still_filling_lands_after_the_fill(
    daemon_factory, client_factory, kind
):
    """An engine fills the KV it allocates (vLLM zeroes it) on its current stream and shares it at
    once. torch's opening of the IPC handle makes the daemon's current stream wait for that fill;
    the copy lanes must follow it too. Regression: their own streams did not wait, so a restore
    sent right after registering could land before the fill and be overwritten by it."""
    d = daemon_factory(pool_mb=256)
    c = client_factory(d, timeout_s=60)
    first = Engine(kind, blocks=96)
    n = 4
    src, ks = list(range(n * BPC)), keys(n)
    stored = first.rank(c, "writer").store(chunks(ks, src), after=after_now()).result()
    assert stored.results == ["stored"] * n
    want = first.blocks(src)
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # the engine's stream is busy: the new KV's fill queues behind it
    late = Engine(kind, blocks=96)  # filled with random bytes on that stream, shared at once
    late.layout["namespace"] = first.layout["namespace"]  # the same model: it finds what first stored
    got = late.rank(c, "reader").retrieve(chunks(ks, src)).result()  # no ``after``: sent now
    assert got.ok == [True] * n
    torch.cuda.current_stream(DEV).wait_event(got.done)
    assert torch.equal(late.blocks(src), want), "the engine's fill overwrote the restored blocks"


def test_restored_blocks_are_read_only_after_the_daemons_copies_negative_control(
    daemon_factory, client_factory
):
    """A large restore is answered as soon as its copies are queued. A reader that does not wait
    for ``done`` reads blocks the copy engines have not written yet; one that waits (on the GPU)
    reads the restored bytes."""
    d = daemon_factory(pool_mb=1024)
    c = client_factory(d, timeout_s=60)
    eng = Engine("BLNHC", layers=8, blocks=512, heads=8, c=256)  # 64 KiB per block per layer
    rank = eng.rank(c)
    n = 64  # 256 blocks, 128 MiB: milliseconds of copies
    src, dst = list(range(0, n * BPC)), list(range(n * BPC, 2 * n * BPC))
    ks = keys(n)
    assert rank.store(chunks(ks, src), after=after_now()).result().results == ["stored"] * n
    want = eng.blocks(src)
    seen = {}
    for fenced in (False, True):
        ok = []
        for _ in range(3):
            eng.zero(dst)
            torch.cuda.synchronize()
            got = rank.retrieve(chunks(ks, dst)).result()
            reader = torch.cuda.current_stream(DEV)
            if fenced:
                reader.wait_event(got.done)
            snapshot = eng.buf.clone()  # what a forward launched now reads (one kernel)
            torch.cuda.synchronize()
            ok.append(torch.equal(eng.blocks(dst, snapshot), want))
        seen[fenced] = ok
    assert not all(seen[False]), "control: without waiting for the copies the reader should see old bytes"
    assert all(seen[True])
