"""The CPU copy, both ways it copies (memcpy over a guarded mapping, and coalesced preadv/pwritev
where that guard is unavailable), moves exactly the bytes the old mmap + numpy gather moved, for
every layout geometry a layout can describe: block-contiguous, head-outer runs, K/V halves far
apart, block-outer (layers inside a block), several tensors in one file, partial chunks, repeated
block ids (last write wins) and chunk runs that merge across items. The reference below is the old
code's gather, indexing objects laid out block by block where the group is block-major. A file cut
short under either copy is a ShmCopyError, never SIGBUS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from tierd.protocol.layout import PageLayout
from tierd.transfer import cpu, mapcopy
from tierd.transfer.cpu import CpuRankMemory
from tierd.transfer.items import CopyItem


class ShmFile:
    def __init__(self, nbytes: int):
        self.path = f"/dev/shm/tierd-test-copy-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        self.nbytes = nbytes

    def read(self) -> np.ndarray:
        with open(self.path, "rb") as f:
            return np.frombuffer(f.read(), dtype=np.uint8).copy()

    def write(self, data: np.ndarray) -> None:
        with open(self.path, "r+b") as f:
            f.write(data.tobytes())


@pytest.fixture(params=["mapped", "syscalls"])
def copy_path(request, monkeypatch):
    """Which way CpuRankMemory copies: memcpy over the guarded mapping, or preadv/pwritev."""
    if request.param == "mapped":
        assert mapcopy.load() is not None, "the guarded copy did not build (is there a C compiler?)"
    else:
        monkeypatch.setattr(cpu.mapcopy, "armed", lambda: False)
    return request.param


def syscalls_only(monkeypatch) -> None:
    monkeypatch.setattr(cpu.mapcopy, "armed", lambda: False)


@pytest.fixture
def shm():
    made: list[ShmFile] = []

    def make(nbytes: int) -> ShmFile:
        made.append(ShmFile(nbytes))
        return made[-1]

    yield make
    for f in made:
        os.unlink(f.path)


def ref_views(data: list[np.ndarray], lay: PageLayout, group: int) -> list[np.ndarray]:
    out = []
    for s in lay.groups[group].layers:
        t = lay.tensors[s.tensor]
        view = data[s.tensor][t.handle.offset : t.handle.offset + t.nbytes]
        out.append(
            as_strided(
                view[s.offset :],
                shape=(s.num_blocks, s.runs, s.run_bytes),
                strides=(s.block_stride, s.run_stride, 1),
                writeable=True,
            )
        )
    return out


def object_view(layers, it, block_major: bool) -> np.ndarray:
    """An item's part as [layer][block][run][byte], whichever order its bytes are in."""
    nl, rest = len(layers), layers[0].shape[1:]
    if block_major:  # GroupLayout.block_major: [block][layer]
        return it.view.reshape(it.bpc, nl, *rest).swapaxes(0, 1)
    return it.view.reshape(nl, it.bpc, *rest)


def ref_store(layers, items, block_major=False):  # the old CpuRankMemory.store, in either order
    for it in items:
        dst = object_view(layers, it, block_major)
        for layer, src in enumerate(layers):
            dst[layer, it.pos] = src[it.ids]


def ref_retrieve(layers, items, block_major=False):  # the old CpuRankMemory.retrieve, in either order
    for it in items:
        src = object_view(layers, it, block_major)
        for layer, dst in enumerate(layers):
            dst[it.ids] = src[layer] if it.complete else src[layer, it.pos]


def geometries():
    """name -> (file bytes, tensors [(offset, nbytes)], layers [span dict]); 16 blocks, block 96 B."""
    nb, bb = 16, 96
    out = {}
    out["block-contiguous"] = (
        3 * nb * bb,
        [(0, 3 * nb * bb)],
        [dict(tensor=0, offset=l * nb * bb, block_stride=bb, num_blocks=nb, run_bytes=bb) for l in range(3)],
    )
    # K/V halves: 2 runs of 48 B, run_stride = half the layer
    out["kv halves"] = (
        2 * nb * bb,
        [(0, 2 * nb * bb)],
        [
            dict(
                tensor=0,
                offset=l * nb * bb,
                block_stride=48,
                num_blocks=nb,
                run_bytes=48,
                runs=2,
                run_stride=nb * 48,
            )
            for l in range(2)
        ],
    )
    # head-outer: 4 heads of 24 B each, heads far apart
    out["head-outer"] = (
        nb * bb,
        [(0, nb * bb)],
        [dict(tensor=0, offset=0, block_stride=24, num_blocks=nb, run_bytes=24, runs=4, run_stride=nb * 24)],
    )
    # block-outer: [block][layer] in one tensor
    out["block-outer"] = (
        nb * 2 * bb,
        [(0, nb * 2 * bb)],
        [dict(tensor=0, offset=l * bb, block_stride=2 * bb, num_blocks=nb, run_bytes=bb) for l in range(2)],
    )
    # two tensors at offsets of one file, padded blocks
    out["two tensors one file"] = (
        4096,
        [(64, 2000), (2100, 1900)],
        [
            dict(tensor=0, offset=8, block_stride=120, num_blocks=nb, run_bytes=96),
            dict(tensor=1, offset=0, block_stride=100, num_blocks=nb, run_bytes=96),
        ],
    )
    # runs with gaps between them (padded rows)
    out["padded runs"] = (
        2048,
        [(0, 2048)],
        [dict(tensor=0, offset=4, block_stride=110, num_blocks=nb, run_bytes=32, runs=3, run_stride=33)],
    )
    return out


def make_layout(files, tensors, spans) -> dict:
    return {
        "namespace": {"model": "m", "fingerprint": "f", "world_size": 1},
        "rank": 0,
        "chunk_tokens": 16,
        "tensors": [
            {"handle": {"kind": "shm", "path": files[i].path, "offset": off}, "nbytes": n}
            for i, (off, n) in enumerate(tensors)
        ],
        "groups": [{"kind": "full", "block_tokens": 4, "layers": spans}],
    }


def chunks(rng, n_blocks: int, bpc: int, case: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, pos) per item."""
    if case == "consecutive":
        return [(np.arange(i * bpc, (i + 1) * bpc), np.arange(bpc)) for i in range(n_blocks // bpc)]
    if case == "random":
        return [(rng.choice(n_blocks, bpc, replace=False), np.arange(bpc)) for _ in range(3)]
    if case == "partial":
        pos = np.array([0, 2, 3])
        return [(rng.choice(n_blocks, 3, replace=False), pos), (np.array([5]), np.array([1]))]
    if case == "repeated":  # the same block written by two items and twice in one
        return [(np.array([3, 3, 7, 1]), np.arange(bpc)), (np.array([7, 2, 3, 9]), np.arange(bpc))]
    raise AssertionError(case)


@pytest.mark.parametrize("batch", [cpu.BATCH_SEGMENTS, 5], ids=["one-batch", "batches-of-5-ranges"])
@pytest.mark.parametrize("case", ["consecutive", "random", "partial", "repeated"])
@pytest.mark.parametrize("geometry", list(geometries()))
def test_cpu_copies_the_same_bytes_as_the_old_gather(shm, geometry, case, batch, copy_path, monkeypatch):
    monkeypatch.setattr(cpu, "BATCH_SEGMENTS", batch)
    syscalls = []
    for name in ("preadv", "pwritev"):
        real = getattr(os, name)
        monkeypatch.setattr(cpu.os, name, lambda *a, real=real: syscalls.append(1) or real(*a))
    nbytes, tensors, spans = geometries()[geometry]
    f = shm(nbytes)
    files = [f] * len(tensors)
    lay = PageLayout.from_wire(make_layout(files, tensors, spans))
    rng = np.random.default_rng(abs(hash((geometry, case))) % 2**32)
    mem = CpuRankMemory(lay)
    try:
        assert mem.files == 1
        bpc = 4
        gbytes = len(spans) * bpc * lay.groups[0].block_bytes
        picks = chunks(rng, 16, bpc, case)
        # store: engine bytes -> objects, compared with the old gather over the same file bytes
        engine = rng.integers(0, 256, nbytes, dtype=np.uint8)
        f.write(engine)
        got = [CopyItem(ids.astype(np.int64), pos, bpc, np.zeros(gbytes, np.uint8)) for ids, pos in picks]
        want = [CopyItem(ids.astype(np.int64), pos, bpc, np.zeros(gbytes, np.uint8)) for ids, pos in picks]
        mem.store(0, got)
        block_major = lay.groups[0].block_major
        assert block_major == (geometry == "block-outer")
        ref_store(ref_views([engine.copy()] * len(tensors), lay, 0), want, block_major)
        for a, b in zip(got, want):
            assert np.array_equal(a.view, b.view)
        # retrieve: objects -> engine bytes
        objs = [rng.integers(0, 256, gbytes, dtype=np.uint8) for _ in picks]
        mem.retrieve(0, [CopyItem(ids.astype(np.int64), pos, bpc, o) for (ids, pos), o in zip(picks, objs)])
        expect = engine.copy()
        ref_retrieve(
            ref_views([expect] * len(tensors), lay, 0),
            [CopyItem(ids.astype(np.int64), pos, bpc, o) for (ids, pos), o in zip(picks, objs)],
            block_major,
        )
        assert np.array_equal(f.read(), expect)
        assert bool(syscalls) == (copy_path == "syscalls"), "the copy did not go the way asked"
    finally:
        mem.close()


def test_consecutive_blocks_of_a_request_are_one_memcpy_per_layer_and_chunk(shm, monkeypatch):
    """The mapped copy: three chunks of consecutive blocks, block-contiguous layers, one memcpy
    per layer and chunk (a range contiguous in both the file and the object), in file order."""
    assert mapcopy.load() is not None
    nbytes, tensors, spans = geometries()["block-contiguous"]
    f = shm(nbytes)
    lay = PageLayout.from_wire(make_layout([f], tensors, spans))
    real = mapcopy.copy
    mem = CpuRankMemory(lay)
    try:
        mem.store(0, [CopyItem(np.arange(1), np.arange(1), 4, np.zeros(3 * 4 * 96, np.uint8))])
        base = mem.groups[0][0].file.addr  # mapped at the first copy
        assert base
        items = [
            CopyItem(np.arange(i * 4, i * 4 + 4), np.arange(4), 4, np.zeros(3 * 4 * 96, np.uint8))
            for i in range(3)
        ]
        seen = []
        monkeypatch.setattr(
            cpu.mapcopy, "copy", lambda d, s, n: seen.append((d - base).tolist()) or real(d, s, n)
        )
        mem.store(0, items[:1])  # store: the file is the source
        seen.clear()
        mem.retrieve(0, items)
    finally:
        mem.close()
    layer, chunk = 16 * 96, 4 * 96
    assert seen == [[l * layer + c * chunk for l in range(3) for c in range(3)]]


def test_consecutive_blocks_of_a_request_are_one_syscall_per_layer(shm, monkeypatch):
    """Three chunks of consecutive blocks, block-contiguous layers: one preadv per layer with one
    iovec per chunk, and the same for pwritev (all 16 blocks would make the whole file one range)."""
    syscalls_only(monkeypatch)
    nbytes, tensors, spans = geometries()["block-contiguous"]
    f = shm(nbytes)
    lay = PageLayout.from_wire(make_layout([f], tensors, spans))
    calls = []
    for name, tag in (("preadv", "r"), ("pwritev", "w")):
        real = getattr(os, name)
        monkeypatch.setattr(
            cpu.os,
            name,
            lambda fd, b, at, real=real, tag=tag: calls.append((tag, len(b), at)) or real(fd, b, at),
        )
    mem = CpuRankMemory(lay)
    try:
        items = [
            CopyItem(np.arange(i * 4, i * 4 + 4), np.arange(4), 4, np.zeros(3 * 4 * 96, np.uint8))
            for i in range(3)
        ]
        mem.store(0, items)
        mem.retrieve(0, items)
    finally:
        mem.close()
    layer = 16 * 96
    assert calls == [
        ("r", 3, 0),
        ("r", 3, layer),
        ("r", 3, 2 * layer),
        ("w", 3, 0),
        ("w", 3, layer),
        ("w", 3, 2 * layer),
    ]


def test_iovecs_per_syscall_stay_within_iov_max(shm, monkeypatch):
    syscalls_only(monkeypatch)
    monkeypatch.setattr(cpu, "IOV_MAX", 3)
    nbytes, tensors, spans = geometries()["head-outer"]
    f = shm(nbytes)
    lay = PageLayout.from_wire(make_layout([f], tensors, spans))
    sizes = []
    real = os.preadv
    monkeypatch.setattr(cpu.os, "preadv", lambda fd, b, at: sizes.append(len(b)) or real(fd, b, at))
    engine = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    f.write(engine)
    mem = CpuRankMemory(lay)
    try:
        it = CopyItem(np.arange(4, 12), np.arange(8), 8, np.zeros(8 * 96, np.uint8))
        mem.store(0, [it])
        want = CopyItem(np.arange(4, 12), np.arange(8), 8, np.zeros(8 * 96, np.uint8))
        ref_store(ref_views([engine], lay, 0), [want])
        assert np.array_equal(it.view, want.view)
    finally:
        mem.close()
    assert max(sizes) <= 3 and sum(sizes) == 4 * 8  # 4 heads x 8 blocks (one file range per head)


def test_a_partial_transfer_goes_on_and_a_shrunk_file_is_an_error(shm, monkeypatch):
    """preadv/pwritev may move fewer bytes than asked: the copy goes on from there while the file
    is long enough; once it is shorter than the copy needs, ShmCopyError names the tensor and the
    sizes, and a retrieve never grows the file."""
    syscalls_only(monkeypatch)
    nbytes, tensors, spans = geometries()["kv halves"]
    f = shm(nbytes)
    engine = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
    f.write(engine)
    lay = PageLayout.from_wire(make_layout([f], tensors, spans))
    shrink_next = []  # a size to truncate the file to just before the next transfer (after the size check)
    for name in ("preadv", "pwritev"):  # at most 40 bytes per call: every iovec is cut somewhere
        real = getattr(os, name)

        def partial(fd, bufs, at, real=real):
            if shrink_next:
                os.truncate(f.path, shrink_next.pop())
            out, left = [], 40
            for b in bufs:
                out.append(b[:left])
                left -= len(out[-1])
                if not left:
                    break
            return real(fd, out, at)

        monkeypatch.setattr(cpu.os, name, partial)
    mem = CpuRankMemory(lay)
    try:
        picks = [(np.arange(0, 4), np.arange(4)), (np.arange(4, 8), np.arange(4))]
        got = [CopyItem(i, p, 4, np.zeros(2 * 4 * 96, np.uint8)) for i, p in picks]
        want = [CopyItem(i, p, 4, np.zeros(2 * 4 * 96, np.uint8)) for i, p in picks]
        mem.store(0, got)
        ref_store(ref_views([engine.copy()], lay, 0), want)
        assert all(np.array_equal(a.view, b.view) for a, b in zip(got, want))
        mem.retrieve(0, [CopyItem(np.arange(8, 12), np.arange(4), 4, got[0].view)])
        expect = engine.copy()
        ref_retrieve(ref_views([expect], lay, 0), [CopyItem(np.arange(8, 12), np.arange(4), 4, got[0].view)])
        assert np.array_equal(f.read(), expect)
        for op in (mem.store, mem.retrieve):
            for during in (False, True):  # before the copy (its size check) or during it (a short transfer)
                os.truncate(f.path, nbytes)
                if during:
                    shrink_next.append(nbytes // 2)
                else:
                    os.truncate(f.path, nbytes // 2)  # layer 1 is gone
                with pytest.raises(cpu.ShmCopyError, match=r"layout.tensors\[0\] .*has \d+ bytes") as err:
                    op(0, [CopyItem(np.arange(0, 4), np.arange(4), 4, np.zeros(2 * 4 * 96, np.uint8))])
                # a write racing a truncation grows the file by what that one transfer wrote (40 bytes
                # here), never more: the size is checked before every further transfer
                grown = 40 if during and op == mem.retrieve else 0
                assert f"has {nbytes // 2 + grown} bytes" in str(err.value)
                assert os.stat(f.path).st_size == nbytes // 2 + grown
    finally:
        mem.close()


def test_a_file_cut_short_during_a_mapped_copy_is_a_copy_error_not_sigbus(shm, monkeypatch):
    """The client truncates its file after the size check, while the daemon copies through its
    mapping: the guard catches the SIGBUS of the first range past the new end, the copy raises
    ShmCopyError naming the tensor and both sizes, the file is not grown, and the thread copies
    again once the file is whole (the guard was re-armed)."""
    assert mapcopy.load() is not None
    bb, layer = 1024, 16 * 1024  # layers of four pages: a cut at one page leaves layers 1 and 2 unmapped
    nbytes = 3 * layer
    spans = [dict(tensor=0, offset=l * layer, block_stride=bb, num_blocks=16, run_bytes=bb) for l in range(3)]
    f = shm(nbytes)
    engine = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    f.write(engine)
    lay = PageLayout.from_wire(make_layout([f], [(0, nbytes)], spans))
    monkeypatch.setattr(CpuRankMemory, "_check_size", lambda *a: None)  # the race: cut after the check
    mem = CpuRankMemory(lay)
    try:
        item = CopyItem(np.arange(0, 4), np.arange(4), 4, np.zeros(3 * 4 * bb, np.uint8))
        for op in (mem.store, mem.retrieve):
            os.truncate(f.path, 4096)
            with pytest.raises(
                cpu.ShmCopyError,
                match=rf"layout.tensors\[0\] .*has 4096 bytes, the copy needs {layer + 4 * bb} ",
            ):
                op(0, [item])
            assert os.stat(f.path).st_size == 4096, "the copy grew the client's file"
        assert mem.groups[0][0].file.mapped == nbytes, "not mapped, or mapped as long as the cut file"
        os.truncate(f.path, nbytes)
        f.write(engine)
        mem.store(0, [item])
        want = CopyItem(np.arange(0, 4), np.arange(4), 4, np.zeros(3 * 4 * bb, np.uint8))
        ref_store(ref_views([engine], lay, 0), [want])
        assert np.array_equal(item.view, want.view)
    finally:
        mem.close()


_SIGBUS_CHILD = """
import ctypes, os, sys
from tierd.transfer import mapcopy
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)
os.ftruncate(fd, 1 << 16)
assert mapcopy.load() is not None
addr = mapcopy.map_file(fd, 1 << 16)
os.ftruncate(fd, 4096)
buf = ctypes.create_string_buffer(8192)
print("copied", {copy}, flush=True)
"""


@pytest.mark.parametrize(
    "copy, guarded",
    [
        ("mapcopy.copy(*(np.array([x], np.uint64) for x in (ctypes.addressof(buf), addr, 8192)))", True),
        ("ctypes.memmove(buf, addr, 8192)", False),
    ],
    ids=["guarded-copy", "unguarded-memmove"],
)
def test_only_a_guarded_copy_survives_a_mapping_past_the_end_of_its_file(shm, copy, guarded):
    """In a process of its own: the guarded copy of a range past the end of a truncated file
    reports it (0 ranges copied) and the process goes on; a plain memmove of the same range, with
    the guard's handler installed, still dies of SIGBUS (the handler passes on faults that are not
    a guarded copy's, and shows the hazard the guard exists for)."""
    f = shm(1 << 16)
    code = "import numpy as np\n" + _SIGBUS_CHILD.format(copy=copy)
    out = subprocess.run([sys.executable, "-c", code, f.path], capture_output=True, text=True, timeout=60)
    if guarded:
        assert out.returncode == 0 and out.stdout.strip() == "copied 0", out.stderr
    else:
        assert out.returncode == -signal.SIGBUS and "copied" not in out.stdout, (out.returncode, out.stderr)


def test_without_a_c_compiler_the_copies_go_through_preadv_and_pwritev(shm):
    """In a process of its own with no compiler to be found: the guarded copy is not built, no
    file is mapped, and a store and a retrieve still move the right bytes."""
    f = shm(3 * 16 * 96)
    code = textwrap.dedent(
        """
        import sys, numpy as np
        from tierd.protocol.layout import PageLayout
        from tierd.transfer import mapcopy
        from tierd.transfer.cpu import CpuRankMemory
        from tierd.transfer.items import CopyItem
        lay = PageLayout.from_wire({"namespace": {"model": "m", "fingerprint": "f", "world_size": 1},
            "rank": 0, "chunk_tokens": 16,
            "tensors": [{"handle": {"kind": "shm", "path": sys.argv[1], "offset": 0}, "nbytes": 4608}],
            "groups": [{"kind": "full", "block_tokens": 4, "layers": [dict(tensor=0, offset=l * 1536,
                block_stride=96, num_blocks=16, run_bytes=96) for l in range(3)]}]})
        mem = CpuRankMemory(lay)
        src = np.arange(3 * 4 * 96, dtype=np.uint32).astype(np.uint8)
        mem.retrieve(0, [CopyItem(np.arange(4, 8), np.arange(4), 4, src)])
        back = CopyItem(np.arange(4, 8), np.arange(4), 4, np.zeros_like(src))
        mem.store(0, [back])
        print(mapcopy.load() is None, mem.groups[0][0].file.addr, np.array_equal(back.view, src))
        """
    )
    env = {**os.environ, "CC": "/nonexistent/cc"}
    out = subprocess.run(
        [sys.executable, "-c", code, f.path], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.split() == ["True", "0", "True"], out.stderr
    assert "preadv/pwritev" in out.stderr  # the fallback is logged


def test_long_ranges_at_any_alignment_copy_exactly():
    """Ranges long enough for the streaming copy, at every alignment of both ends and with tails of
    every length, land byte for byte; so does a later range over an earlier one (the last wins)."""
    assert mapcopy.load() is not None
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 16 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    want = np.zeros_like(src)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    ranges = []
    at = 0
    for k in range(24):
        n = (4 << 10) + int(rng.integers(-70, 70)) + (k % 3) * (200 << 10)  # around STREAM_MIN, and past it
        s_off, d_off = int(rng.integers(0, 64)), at + k % 17
        ranges.append((d_off, s_off, n))
        at = d_off + n
    ranges.append((ranges[3][0] + 5, 1000, 300 << 10))  # over earlier ranges: written last
    for d_off, s_off, n in ranges:
        want[d_off : d_off + n] = src[s_off : s_off + n]
    arrays = [
        np.array([base + o for o in offs], dtype=np.uint64)
        for base, offs in ((base_d, [r[0] for r in ranges]), (base_s, [r[1] for r in ranges]))
    ]
    lengths = np.array([r[2] for r in ranges], dtype=np.uint64)
    assert mapcopy.copy(arrays[0], arrays[1], lengths) == len(ranges)
    assert np.array_equal(dst, want)


def test_a_block_outermost_chunk_of_consecutive_blocks_is_one_memcpy(shm, monkeypatch):
    """Block-outer layers (a block's layers one span): objects are laid out block by block, so a
    chunk of consecutive blocks is one range in both the file and the object, one memcpy."""
    assert mapcopy.load() is not None
    nbytes, tensors, spans = geometries()["block-outer"]
    f = shm(nbytes)
    lay = PageLayout.from_wire(make_layout([f], tensors, spans))
    assert lay.groups[0].block_major
    real = mapcopy.copy
    mem = CpuRankMemory(lay)
    try:
        item = CopyItem(np.arange(4, 8), np.arange(4), 4, np.zeros(2 * 4 * 96, np.uint8))
        mem.store(0, [item])
        base = mem.groups[0][0].file.addr
        seen = []

        def spy(d, s, n):
            seen.append(((s - base).tolist(), n.tolist()))
            return real(d, s, n)

        monkeypatch.setattr(cpu.mapcopy, "copy", spy)
        mem.store(0, [item])
    finally:
        mem.close()
    assert seen == [([4 * 2 * 96], [4 * 2 * 96])]


def test_status_says_how_a_rank_is_copied_and_which_groups_are_block_major(shm, tmp_path):
    """/status names each instance's copies and per group its object order; ``tierd status``
    marks a block-major group ``/block``."""
    from tierd.base.config import Settings
    from tierd.core import handlers
    from tierd.core.handlers import Call
    from tierd.daemon.server import Daemon
    from tierd.protocol import messages
    from tierd.tools.report import status_table

    d = Daemon(Settings(socket=f"ipc://{tmp_path}/t.sock", http_port=-1, l1_size_gb=0.0625))
    try:
        ident = b"s" * 16
        handlers.hello(d.tier, Call(ident, None, [ident], 0, 0.0), messages.Hello(1))
        call = Call(ident, d.registry.session(ident), [ident], 0, 0.0)
        for name, geometry in (("outer", "block-outer"), ("contiguous", "block-contiguous")):
            nbytes, tensors, spans = geometries()[geometry]
            f = shm(nbytes)
            lay = make_layout([f] * len(tensors), tensors, spans)
            lay["namespace"]["fingerprint"] = name
            handlers.register(
                d.tier, call, messages.convert({"instance": name, "layout": lay}, messages.Register)
            )
        st = d.status()
        got = {i["instance"]: (i["copies"], i["object_order"]) for i in st["instances"]}
        assert got == {"outer": ("shm", ["block"]), "contiguous": ("shm", ["layer"])}
        rows = {line.split()[0]: line for line in status_table(st).splitlines() if line.startswith("  ")}
        assert "groups full/block " in rows["outer"] and "groups full " in rows["contiguous"]
    finally:
        d.close()
