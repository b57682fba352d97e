"""The KV layouts the data path must copy byte-exactly, built the way vLLM 0.33 builds them: one
int8 buffer for all layers in a KVCacheLayout's physical order, a logical ``[B, H, N, C]`` view per
layer, spans from ``block_span``. Plus MLA, mamba state pages, kernel blocks smaller than manager
blocks, and unaligned state sizes that force narrow vector widths. Device-agnostic (CPU tests
use the torch fallback, GPU tests the kernel)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tierd.protocol.layout import GroupLayout
from tierd.transfer.items import CopyItem
from tierd_client.layouts import block_span, group

VLLM_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass
class Case:
    name: str
    buf: object  # flat uint8 torch tensor holding every layer
    group: GroupLayout
    bpc: int  # manager blocks per chunk
    _flat: np.ndarray | None = None

    @property
    def num_blocks(self) -> int:
        return self.group.num_blocks

    def reference(self, block: int) -> np.ndarray:
        """[layers, block_bytes] of manager block ``block``, read straight from the buffer."""
        if self._flat is None:
            self._flat = self.buf.cpu().numpy()
        flat = self._flat
        out = []
        for s in self.group.layers:
            start = s.offset + block * s.block_stride
            out.append(
                np.concatenate(
                    [
                        flat[start + r * s.run_stride : start + r * s.run_stride + s.run_bytes]
                        for r in range(s.runs)
                    ]
                )
            )
        return np.stack(out)


def _group(name, spans, bpc, kind="full", block_tokens=16):
    g = group(kind, block_tokens, spans)
    if kind == "state":
        g["block_tokens"] = 1
    return GroupLayout.from_wire(g, name)


def vllm_case(
    torch,
    kind: str,
    device,
    *,
    layers=3,
    blocks=8,
    heads=2,
    tokens=4,
    c=16,
    r=1,
    bpc=2,
    dtype=None,
    mla=False,
) -> Case:
    """vLLM 0.33: one buffer, physical order ``kind``, per-layer logical [B, H, N, C] views with B in
    kernel blocks (``r`` per manager block)."""
    dtype = dtype or torch.bfloat16
    if mla:
        heads, c = 1, 576
    dims = {"L": layers, "B": blocks * r, "H": heads, "N": tokens, "C": c}
    phys = [dims[ch] for ch in kind]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    buf = torch.randint(0, 256, (math.prod(phys) * itemsize,), dtype=torch.uint8, device=device)
    logical = buf.view(dtype).view(phys).permute([kind.index(ch) for ch in "LBHNC"])
    spans = []
    for layer in range(layers):
        v = logical[layer]
        spans.append(
            block_span(
                tuple(v.shape),
                tuple(v.stride()),
                itemsize,
                0,
                tensor=0,
                offset=v.storage_offset() * itemsize,
                blocks_per_block=r,
            )
        )
    name = ("MLA-" if mla else "") + kind + (f"-r{r}" if r > 1 else "")
    return Case(name, buf, _group(name, spans, bpc, block_tokens=tokens * r), bpc)


def state_case(torch, device, *, layers=3, blocks=8, state_bytes=4100, page_bytes=4608, name=None) -> Case:
    """Mamba-like state: per layer [B, page] int8 pages, the state in the first ``state_bytes``."""
    buf = torch.randint(0, 256, (layers * blocks * page_bytes,), dtype=torch.uint8, device=device)
    pages = buf.view(layers, blocks, page_bytes)
    spans = []
    for layer in range(layers):
        v = pages[layer, :, :state_bytes]
        spans.append(block_span(tuple(v.shape), tuple(v.stride()), 1, 0, tensor=0, offset=v.storage_offset()))
    name = name or f"mamba-{state_bytes}"
    return Case(name, buf, _group(name, spans, 1, kind="state"), 1)


def all_cases(torch, device) -> list[Case]:
    cases = [vllm_case(torch, k, device) for k in VLLM_LAYOUTS]
    cases += [vllm_case(torch, k, device, r=2) for k in VLLM_LAYOUTS]
    cases += [vllm_case(torch, "LBNHC", device, mla=True), vllm_case(torch, "LBNHC", device, mla=True, r=2)]
    cases += [
        state_case(torch, device),
        state_case(torch, device, state_bytes=1001, page_bytes=1030, name="state-odd"),
    ]
    return cases


def items_for(case: Case, host: np.ndarray, null_every: int = 3) -> tuple[list[CopyItem], list[list[int]]]:
    """CopyItems over ``host`` (one object per chunk, chunks of ``bpc`` blocks in a shuffled order,
    every ``null_every``-th position null), and each chunk's ids per position (-1 = null)."""
    g, bpc = case.group, case.bpc
    obj = len(g.layers) * bpc * g.block_bytes
    order = np.random.default_rng(7).permutation(case.num_blocks)
    chunks = len(order) // bpc
    assert host.nbytes >= chunks * obj
    items, ids_per_chunk = [], []
    for c in range(chunks):
        ids = order[c * bpc : (c + 1) * bpc].astype(np.int64)
        pos = np.arange(bpc, dtype=np.int64)
        if null_every and bpc > 1 and c % 2:
            keep = (pos % null_every) != 1
            ids, pos = ids[keep], pos[keep]
        items.append(CopyItem(ids, pos, bpc, host[c * obj : (c + 1) * obj]))
        full = [-1] * bpc
        for i, p in zip(ids.tolist(), pos.tolist()):
            full[p] = i
        ids_per_chunk.append(full)
    return items, ids_per_chunk


def check_objects(case: Case, items: list[CopyItem], ids_per_chunk) -> None:
    """Every present block of every object equals the engine's bytes."""
    g = case.group
    for it, full in zip(items, ids_per_chunk):
        if g.block_major:  # [block][layer]: each block as the engine holds it
            obj = it.view.reshape(it.bpc, len(g.layers), g.block_bytes).transpose(1, 0, 2)
        else:
            obj = it.view.reshape(len(g.layers), it.bpc, g.block_bytes)
        for p, b in enumerate(full):
            if b >= 0:
                np.testing.assert_array_equal(obj[:, p], case.reference(b), err_msg=f"{case.name} block {b}")


def object_bytes(case: Case) -> int:
    return len(case.group.layers) * case.bpc * case.group.block_bytes
