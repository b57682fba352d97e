"""Engine-side GPU copies: the engine's own CUDA context does the SM work of the tier.

Kernels of different processes time-slice on a GPU (no MPS): a gather launched from the daemon's
context holds the engine's kernels off (a co-running matmul runs markedly slower), while the same
gather in the engine's context on a side stream, or DMA from any process, costs it little
(docs/findings.md; ``tierd bench --device cuda --interference`` measures it). So the engine
gathers the blocks of a STORE into its *staging buffer* on its own stream, and scatters a
RETRIEVE's bytes out of it; the daemon only DMAs whole objects between that
buffer (opened over CUDA IPC at REGISTER) and its pinned pool.

Staging layout of a request: its chunks back to back from ``staged_at``, each chunk its groups'
parts in layout order, each part ``[layer][block of the chunk][block bytes]`` (``[block][layer]``
for a GroupLayout.block_major group: the daemon's combined object layout), so an object is one
contiguous DMA.

Ordering, all on the GPU (no host wait on the engine's forward thread):
- a gather waits for the event the caller recorded after the forward's KV writes;
- the daemon's DMA waits for the staging stream's IPC event recorded after the gather (STORE) or
  after the last use of those staging bytes (RETRIEVE);
- a forward that overwrites blocks a queued gather still reads first waits for the staging stream
  (``Stager.fence_into``);
- a RETRIEVE's scatter is launched when the daemon answers (its DMA is done); the blocks may be
  read once ``done`` (a CUDA event) completes, or after the reader's stream waits on it.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import numpy as np

from tierd.protocol.layout import PageLayout
from tierd_client import cuda_gather, native
from tierd_client.cuda_ipc import StoreFence, share_cuda_tensors
from tierd_client.desc_ring import DescRing

GRID_PER_SM = 8  # CTAs per multiprocessor for the gather/scatter kernels
MAX_PEER_EVENTS = 64  # daemon events opened (one per daemon lane; a restarted daemon brings new ones)


class GroupCopy:
    """One group's layers as the kernels see them: a device descriptor table and torch views."""

    def __init__(self, torch, group, flats, device, chunk_tokens: int):
        self.layers = len(group.layers)
        self.block_bytes = group.block_bytes
        # where layer l's block at chunk position p lies in the group's part: l*layer + p*block
        self.layer_stride, self.block_stride = group.object_strides(chunk_tokens)
        self.runs, self.run_bytes = group.layers[0].runs, group.layers[0].run_bytes
        bases = [flats[s.tensor].data_ptr() + s.offset for s in group.layers]
        table = np.zeros((self.layers, 4), dtype=np.int64)
        for i, (base, s) in enumerate(zip(bases, group.layers)):
            table[i, :3] = (base, s.block_stride, s.run_stride)
        self.table = torch.from_numpy(table).to(device)
        self.kernel_ok = cuda_gather.uniform_runs(group)
        self.vec = cuda_gather.vector_width(group, bases)
        self.views = cuda_gather.layer_views(group, flats)


class Stager:
    """A rank's staging buffer, its stream and its fence; gathers and scatters by block id."""

    def __init__(self, layout: PageLayout, tensors, staging_bytes: int, impl: str = "auto", ctas: int = 0):
        """``ctas``: CTAs per gather/scatter kernel (0: GRID_PER_SM per multiprocessor). Fewer leave
        more of the GPU to the engine's own kernels running at the same time, at a lower copy rate."""
        import torch

        self.torch = torch
        self.device = tensors[0].device
        self.impl = impl  # auto | kernel | torch
        if impl != "torch":
            native.start()
        chunk = layout.chunk_tokens
        self.blocks_per_chunk = [g.spec.blocks_per_chunk(chunk) for g in layout.groups]
        part = [len(g.layers) * n * g.block_bytes for g, n in zip(layout.groups, self.blocks_per_chunk)]
        self.part_bytes = part
        self.group_offsets = [sum(part[:g]) for g in range(len(part))]
        self.chunk_bytes = sum(part)
        if staging_bytes < self.chunk_bytes:
            raise ValueError(
                f"a staging buffer of {staging_bytes} bytes holds no chunk of {self.chunk_bytes} bytes"
            )
        with torch.cuda.device(self.device):
            flats = [t.view(-1).view(torch.uint8) if t.dim() else t for t in tensors]
            self.groups = [GroupCopy(torch, g, flats, self.device, chunk) for g in layout.groups]
            # gathers (STOREs) and scatters (RETRIEVEs) on their own streams: a scatter waits on the GPU for
            # the daemon's DMA, and a store's gather must not queue behind that wait
            # the lowest priority the device has: where the engine's own streams ask for more, its
            # kernels' blocks are scheduled before a gather's or a scatter's
            low = _lowest_priority(torch)
            self.stream = torch.cuda.Stream(self.device, priority=low)  # gathers
            self.scatter_stream = torch.cuda.Stream(self.device, priority=low)
            self.rings = {False: DescRing(torch, self.device), True: DescRing(torch, self.device)}
            self.buf = torch.empty(staging_bytes, dtype=torch.uint8, device=self.device)
            self.fence = StoreFence(self.device)
            self.scatter_fence = StoreFence(self.device)
        refs, _ = share_cuda_tensors([self.buf])
        self.ref = refs[0]
        self.sm = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.grid = ctas if ctas > 0 else self.sm * GRID_PER_SM
        self.lock = threading.Lock()  # the stream is fed from the engine's thread and the client's I/O thread
        # a dict (the bench's breakdown): per "gather"/"scatter" call, the seconds of its stages
        self.timings: dict[str, list[dict]] | None = None
        self._peers: dict[bytes, object] = {}

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    # ---- copies -------------------------------------------------------------------------------
    def gather(
        self, chunks: list[list[list[int]]], at: int, after=None, null: int = -1, fence: bool = True
    ) -> bytes | None:
        """Blocks of ``chunks`` (per chunk, per group, ids; ``null`` = none) into staging from ``at``,
        after the event ``after``; returns the IPC event handle the daemon's DMA waits for (with
        ``fence``; None without: the caller orders the DMA on the host)."""
        t = _Stages(self.timings, "gather")
        with self.lock, self.torch.cuda.device(self.device):
            t("lock")
            if after is not None:
                self.stream.wait_event(after)
            self._copy(chunks, at, null, scatter=False, skip=None, t=t)
            handle = self.fence.mark(self.stream) if fence else None
            t("fence")
            return handle

    def scatter(
        self,
        chunks: list[list[list[int]]],
        at: int,
        null: int = -1,
        skip=None,
        after: bytes | None = None,
        ready=None,
        prepared: Prepared | None = None,
    ):
        """Staging from ``at`` into the blocks of ``chunks``, except ``skip`` ((group, id) pairs not
        restored), once the daemon's interprocess event ``after`` (its DMA) is done and, if given,
        the engine's event ``ready`` (recorded where the blocks may be overwritten: after the
        forward that last read them, after vLLM zeroed them); returns a CUDA event done when the
        blocks may be read. ``prepared``: ``prepare_scatter``'s plan of the same chunks, used when
        nothing is skipped (and let go of in any case)."""
        t = _Stages(self.timings, "scatter")
        with self.lock, self.torch.cuda.device(self.device):
            t("lock")
            try:
                if ready is not None:
                    self.scatter_stream.wait_event(ready)
                if after:
                    self.scatter_stream.wait_event(self._peer_event(after))
                t("waits")
                if prepared is not None and not skip:
                    self._launch(prepared.plans, scatter=True, t=t)
                else:
                    self._copy(chunks, at, null, scatter=True, skip=skip, t=t)
            finally:
                if prepared is not None:
                    self._let_go(prepared)
            done = self.torch.cuda.Event()
            done.record(self.scatter_stream)
            t("event")
            return done

    def prepare_scatter(self, chunks: list[list[list[int]]], at: int, null: int = -1) -> Prepared | None:
        """A scatter's plan and block descriptors, uploaded now (while the daemon copies) so that
        ``scatter(prepared=...)`` only waits and launches when its answer comes; None where the
        scatter would not run the native kernels. What is prepared must be passed to ``scatter``
        or ``release``d: until then its descriptors hold their place in the upload ring."""
        if self.impl == "torch" or native.get() is None or not all(g.kernel_ok for g in self.groups):
            return None
        with self.lock, self.torch.cuda.device(self.device):
            return Prepared(self._plan(chunks, at, null, scatter=True, skip=None, pin=True))

    def release(self, prepared: Prepared | None) -> None:
        """Let go of a prepared scatter that will not run."""
        if prepared is not None:
            with self.lock:
                self._let_go(prepared)

    def _let_go(self, prepared: Prepared) -> None:
        ring = self.rings[True]
        for plan in prepared.plans:
            ring.unpin(plan.desc)
        prepared.plans = []

    def _peer_event(self, handle: bytes):
        """The daemon's interprocess event ``handle``, opened once (it records the same one again)."""
        ev = self._peers.get(handle)
        if ev is None:
            if len(self._peers) >= MAX_PEER_EVENTS:
                self._peers.clear()
            ev = self._peers[handle] = self.torch.cuda.Event.from_ipc_handle(self.device, handle)
        return ev

    def mark(self) -> bytes:
        """The IPC event after every scatter queued so far: a RETRIEVE's ``event`` (the daemon may
        then overwrite the retrieve half of staging)."""
        with self.lock, self.torch.cuda.device(self.device):
            return self.scatter_fence.mark(self.scatter_stream)

    def recorded(self, scatter: bool = False):
        """A CUDA event after everything queued so far on the gather (or scatter) stream: it completes
        once those copies have read (gather) or written (scatter) the engine's blocks."""
        with self.lock, self.torch.cuda.device(self.device):
            ev = self.torch.cuda.Event()
            ev.record(self.scatter_stream if scatter else self.stream)
            return ev

    def fence_into(self, stream) -> None:
        """``stream`` (the forward's) waits for every gather queued so far (they read KV blocks)."""
        with self.lock:
            stream.wait_stream(self.stream)

    def _copy(self, chunks, at, null, scatter: bool, skip, t=None) -> None:
        self._launch(self._plan(chunks, at, null, scatter, skip, t=t), scatter, t)

    def _plan(self, chunks, at, null, scatter: bool, skip, t=None, pin: bool = False) -> list[tuple]:
        """Per group with blocks to copy, a ``_Kernel`` (its descriptors uploaded on the copy's
        stream; ``pin``: their place in the ring is held until ``DescRing.unpin``) or a ``_Torch``."""
        mod = None if self.impl == "torch" else native.get()
        if mod is None and self.impl == "kernel":
            mod = native.load()
            if mod is None:
                raise RuntimeError(f"native kernels unavailable: {native.state()['error']}")
        stream = self.scatter_stream if scatter else self.stream
        ring = self.rings[scatter]
        plans = []
        for g, gc in enumerate(self.groups):
            ids, offs, item, pos = self._jobs(chunks, at, g, null, skip)
            if not len(ids):
                continue
            if t is not None:
                t("plan")
            if mod is not None and gc.kernel_ok:
                desc, keep = ring.upload_raw(np.stack([ids, offs]), stream, mod, pin=pin)
                plans.append(_Kernel(g, len(ids), desc, keep))
                if t is not None:
                    t("upload")
            else:
                plans.append(_Torch(g, np.stack([ids, item, pos]), len(chunks), at + self.group_offsets[g]))
        return plans

    def _launch(self, plans: list[tuple], scatter: bool, t=None) -> None:
        """Queue ``_plan``'s copies on the copy's stream."""
        torch = self.torch
        stream = self.scatter_stream if scatter else self.stream
        for plan in plans:
            gc = self.groups[plan.group]
            if isinstance(plan, _Kernel):
                mod = native.get()
                fn = mod.scatter if scatter else mod.gather
                fn(
                    gc.table.data_ptr(),
                    gc.layers,
                    plan.desc,
                    plan.desc + 8 * plan.count,
                    plan.count,
                    self.buf.data_ptr(),
                    gc.layer_stride,
                    gc.block_bytes,
                    gc.run_bytes,
                    gc.runs,
                    gc.vec,
                    self.grid,
                    stream.cuda_stream,
                )
                if t is not None:
                    t("launch")
                continue
            dev = self.rings[scatter].upload(plan.desc, stream)
            fn = cuda_gather.torch_scatter if scatter else cuda_gather.torch_gather
            with torch.cuda.stream(stream):
                fn(
                    gc.views,
                    self.buf,
                    plan.chunks,
                    self.blocks_per_chunk[plan.group],
                    dev[0],
                    dev[1],
                    dev[2],
                    base=plan.base,
                    item_stride=self.chunk_bytes,
                    strides=(gc.layer_stride, gc.block_stride),
                )

    def _jobs(self, chunks, at, g, null, skip):
        """For group ``g``: non-null (and not skipped) block ids, their staging offsets, chunk and
        position."""
        step, bpc = self.groups[g].block_stride, self.blocks_per_chunk[g]
        ids, offs, item, pos = [], [], [], []
        base = at + self.group_offsets[g]
        for i, c in enumerate(chunks):
            for p, b in enumerate(c[g]):
                if b == null or (skip and (g, b) in skip):
                    continue
                ids.append(b)
                offs.append(base + i * self.chunk_bytes + p * step)
                item.append(i)
                pos.append(p)
        assert all(0 <= p < bpc for p in pos)
        return (
            np.asarray(ids, dtype=np.int64),
            np.asarray(offs, dtype=np.int64),
            np.asarray(item, dtype=np.int64),
            np.asarray(pos, dtype=np.int64),
        )


class _Kernel(NamedTuple):
    """A group's copy by the native kernels: ``count`` blocks, their descriptors at ``desc`` (a
    device address) kept alive by ``keep`` until the kernel is queued."""

    group: int
    count: int
    desc: int
    keep: object


class _Torch(NamedTuple):
    """A group's copy by the torch fallback: ``desc`` rows ids, chunk and position."""

    group: int
    desc: np.ndarray
    chunks: int
    base: int  # the group's first staging byte


class Prepared:
    """A scatter planned ahead (``Stager.prepare_scatter``)."""

    __slots__ = ("plans",)

    def __init__(self, plans: list[_Kernel]):
        self.plans = plans


class _Stages:
    """Stamps of one gather or scatter call into ``timings[op]`` (None: nothing is kept)."""

    __slots__ = ("row", "last")

    def __init__(self, timings: dict | None, op: str):
        self.row = None
        if timings is not None:
            self.row = {}
            timings.setdefault(op, []).append(self.row)
            self.last = time.perf_counter()

    def __call__(self, stage: str) -> None:
        if self.row is not None:
            now = time.perf_counter()
            self.row[stage] = self.row.get(stage, 0.0) + now - self.last
            self.last = now


def _lowest_priority(torch) -> int:
    """The device's lowest stream priority (CUDA and HIP: the largest number, 0 on current GPUs)."""
    try:
        low, _high = torch.cuda.Stream.priority_range()
        return int(low)
    except (AttributeError, RuntimeError):
        return 0
