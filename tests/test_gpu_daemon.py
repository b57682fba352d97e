"""The CUDA data path through a real daemon: this test process is the engine, registering CUDA
tensors over IPC with a ``tierd serve`` subprocess. Round trips per layout and implementation, no
CUDA context before a registration, pinned pool, typed errors for bad handles, both directions
at once, and the STORE fence (negative control: without the event a store reads stale bytes)."""

import copy
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tierd.transfer import native  # noqa: E402
from tierd_client import TierdError  # noqa: E402
from tierd_client.cuda_ipc import StoreFence, share_cuda_tensors  # noqa: E402
from tierd_client.layouts import block_span, group, layout, namespace  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = 0
CHUNK = 64  # tokens per chunk
BLOCK = 16  # tokens per block
BPC = CHUNK // BLOCK


@pytest.fixture(scope="module", autouse=True)
def built():
    """Build the extension once here so every daemon loads it from the cache."""
    assert native.load(timeout=900) is not None, native.state()


class Engine:
    """vLLM 0.33-style KV: one buffer, per-layer [B, H, N, C] views in physical order ``kind``."""

    def __init__(self, kind="LBNHC", layers=4, blocks=64, heads=2, c=64, r=1):
        dims = {"L": layers, "B": blocks * r, "H": heads, "N": BLOCK // r, "C": c}
        phys = [dims[ch] for ch in kind]
        n = 1
        for d in phys:
            n *= d
        self.buf = torch.randint(0, 256, (n * 2,), dtype=torch.uint8, device=f"cuda:{DEV}")
        logical = self.buf.view(torch.bfloat16).view(phys).permute([kind.index(ch) for ch in "LBHNC"])
        self.views = [logical[i] for i in range(layers)]
        refs, where = share_cuda_tensors(self.views)
        spans = [block_span(tuple(v.shape), tuple(v.stride()), 2, 0, tensor=w[0], offset=w[1], blocks_per_block=r)
                 for v, w in zip(self.views, where)]
        self.r = r
        self.layout = layout(namespace("gpu-test", uuid.uuid4().hex), 0, CHUNK, refs, [group("full", BLOCK, spans)],
                             device="cuda")

    def blocks(self, ids):
        """[layers, len(ids)] manager blocks as bytes (kernel blocks folded)."""
        out = []
        for v in self.views:
            out.append(torch.stack([v[b * self.r : (b + 1) * self.r].contiguous().view(torch.uint8).flatten() for b in ids]))
        return torch.stack(out)

    def zero(self, ids):
        for v in self.views:
            for b in ids:
                v[b * self.r : (b + 1) * self.r].zero_()


def chunks(keys, ids):
    return [{"key": k, "blocks": [ids[i * BPC : (i + 1) * BPC]]} for i, k in enumerate(keys)]


def keys(n):
    return [uuid.uuid4().bytes[:16] for _ in range(n)]


def wait_native(d, timeout=300):
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        st = d.status()["cuda_detail"]["native"]["state"]
        if st != "building":
            return st
        time.sleep(0.2)
    return "building"


def test_no_context_before_registration_then_pinned_pool(daemon_factory, client_factory):
    d = daemon_factory("--l1-init-size-gb", "0.125", pool_mb=256)
    st = d.status()
    assert st["cuda"] is True
    assert st["cuda_detail"]["contexts"] == [], "the daemon made a CUDA context before anyone registered"
    assert st["memory_pinned_bytes"] == 0 and st["cuda_detail"]["pin_pending_bytes"] == st["memory_total_bytes"] > 0
    wait_native(d)
    assert d.status()["cuda_detail"]["contexts"] == [], "building/loading the extension made a context"
    c = client_factory(d)
    eng = Engine()
    c.register("r0", eng.layout)
    st = d.status()
    assert st["cuda_detail"]["contexts"] == [DEV] and st["cuda_detail"]["devices_open"] == [DEV]
    assert st["memory_pinned_bytes"] == st["memory_total_bytes"]
    assert st["memory_configured_bytes"] == 256 << 20 and st["memory_total_bytes"] > 0


@pytest.mark.parametrize("impl", ["kernel", "torch"])
@pytest.mark.parametrize("kind,r", [("LBNHC", 1), ("LHBNC", 1), ("BHLNC", 2), ("BLNHC", 1)])
def test_round_trip_through_the_daemon(daemon_factory, client_factory, monkeypatch, impl, kind, r):
    monkeypatch.setenv("TIERD_CUDA_IMPL", impl)
    d = daemon_factory(pool_mb=256)
    assert wait_native(d) == "ready"
    c = client_factory(d, timeout_s=60)
    eng = Engine(kind, r=r)
    c.register("r0", eng.layout)
    ks = keys(6)
    src = list(range(0, 6 * BPC))
    dst = list(range(32, 32 + 6 * BPC))
    fence = StoreFence(DEV)
    assert c.store("r0", chunks(ks, src), event=fence.mark())["results"] == ["stored"] * 6
    expect = eng.blocks(src)
    eng.zero(dst)
    torch.cuda.synchronize()
    got = c.retrieve("r0", chunks(ks, dst))
    assert got == {"ok": [True] * 6, "failed": []}
    assert torch.equal(eng.blocks(dst), expect)  # on the device once RETRIEVE answered: no sync here


def test_store_and_retrieve_of_one_rank_run_at_once(daemon_factory, client_factory):
    d = daemon_factory(pool_mb=512)
    wait_native(d)
    c = client_factory(d, timeout_s=60)
    eng = Engine(layers=8, blocks=256, heads=4, c=128)
    c.register("r0", eng.layout)
    ka, kb = keys(20), keys(20)
    a, b, into = list(range(0, 80)), list(range(80, 160)), list(range(160, 240))
    assert all(x == "stored" for x in c.store("r0", chunks(ka, a))["results"])
    futs = [c.store_async("r0", chunks(kb[i : i + 4], b[i * BPC : (i + 4) * BPC])) for i in range(0, 20, 4)]
    futs += [c.retrieve_async("r0", chunks(ka[i : i + 4], into[i * BPC : (i + 4) * BPC])) for i in range(0, 20, 4)]
    for f in futs:
        res = f.result()
        assert all(x == "stored" for x in res.get("results", [])) and all(res.get("ok", []))
    assert torch.equal(eng.blocks(into), eng.blocks(a))
    c.retrieve("r0", chunks(kb, into))
    assert torch.equal(eng.blocks(into), eng.blocks(b))


def test_bad_handles_are_layout_invalid(daemon_factory, client_factory):
    d = daemon_factory(pool_mb=128)
    c = client_factory(d)
    eng = Engine()

    def bad(mutate, match):
        lay = copy.deepcopy(eng.layout)
        mutate(lay)
        with pytest.raises(TierdError) as err:
            c.register(f"bad-{uuid.uuid4().hex[:6]}", lay)
        assert err.value.code == "LAYOUT_INVALID", err.value
        assert match in err.value.message, err.value.message

    def corrupt(lay):
        h = lay["tensors"][0]["handle"]["ipc"]
        h[1] = bytes(len(h[1]))

    def flip(lay):
        h = lay["tensors"][0]["handle"]["ipc"]
        h[1] = bytes(x ^ 0x5A for x in h[1])

    bad(corrupt, "cannot open the CUDA IPC handle")
    bad(flip, "cannot open the CUDA IPC handle")
    bad(lambda lay: lay["tensors"][0]["handle"].update(device_uuid="GPU-00000000-0000-0000-0000-000000000000"),
        "not visible")
    bad(lambda lay: lay["tensors"][0]["handle"]["ipc"].pop(), "ipc must be")
    bad(lambda lay: lay["tensors"][0]["handle"]["ipc"].__setitem__(2, "big"), "ipc.storage_bytes")
    bad(lambda lay: lay["tensors"][0].update(nbytes=lay["tensors"][0]["nbytes"] * 2), "bytes")
    bad(lambda lay: lay["tensors"][0].update(handle={"kind": "shm", "path": "/dev/shm/x", "offset": 0}), "cuda_ipc")
    c.register("good", eng.layout)  # the daemon is fine after all that
    assert d.status()["errors_by_code"]["LAYOUT_INVALID"] == 7


def test_store_fence_negative_control(daemon_factory, client_factory):
    """The engine rewrites blocks behind a long kernel on its stream. A STORE sent right after,
    without the event, copies the old bytes; with the event it always copies the new ones."""
    d = daemon_factory(pool_mb=256)
    wait_native(d)
    c = client_factory(d, timeout_s=60)
    eng = Engine(layers=4, blocks=64)
    c.register("r0", eng.layout)
    src, dst = list(range(0, 4 * BPC)), list(range(32, 32 + 4 * BPC))
    warm = keys(4)
    c.store("r0", chunks(warm, src))
    c.retrieve("r0", chunks(warm, dst))
    fence = StoreFence(DEV)
    side = torch.cuda.Stream(DEV)
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is gone")
    spin = 1_000_000_000  # cycles: about 0.5 s at the H200's 1.98 GHz, longer when clocked lower
    outcome = {}
    for fenced in (False, True):
        stale = []
        for trial in range(3):
            old = eng.blocks(src)
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                torch.cuda._sleep(spin)  # the "forward pass" still running
                for v in eng.views:
                    v[: 4 * BPC].random_(0, 127)  # the new KV it writes
            handle = fence.mark(side) if fenced else None
            ks = keys(4)
            t = time.perf_counter()
            assert c.store("r0", chunks(ks, src), event=handle)["results"] == ["stored"] * 4
            waited = time.perf_counter() - t
            side.synchronize()
            new = eng.blocks(src)
            assert not torch.equal(old, new)
            c.retrieve("r0", chunks(ks, dst))
            got = eng.blocks(dst)
            stale.append(torch.equal(got, old))
            if fenced:
                assert torch.equal(got, new), f"fenced store copied stale bytes (trial {trial})"
                assert waited > 0.2, "the fenced store did not wait for the engine's kernel"
            print(f"fenced={fenced} trial {trial}: store answered in {waited * 1e3:.1f} ms, stale={stale[-1]}")
        outcome[fenced] = stale
    assert any(outcome[False]), "control: without the event the store should have read the old bytes"
    assert not any(outcome[True])
