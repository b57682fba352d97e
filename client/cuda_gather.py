"""Copy plans for the device data path, and the pure-torch gather/scatter that the native kernel
must match byte for byte.

A plan packs the CopyItems of one group into staging *batches* (as many whole objects as fit one
staging slot). Inside a slot, item ``k`` of the batch occupies ``[k*obj, (k+1)*obj)`` laid out
``[layer][block of the chunk][run bytes]`` exactly like its object in the pool, so moving a batch
between staging and the pool is one DMA per object, and adjacent objects merge into one.

Jobs are the non-null blocks: job ``j`` copies block ``ids[j]`` of every layer to/from staging
offset ``offs[j] + layer*layer_pitch``. ``item[j]``/``pos[j]`` (the item within its batch and the
block's position in the chunk) serve the torch path. Everything here is device-agnostic, so the
fallback is tested on CPU tensors too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tierd.protocol.copies import CopyItem
from tierd.protocol.layout import GroupLayout


@dataclass(slots=True)
class Batch:
    j0: int  # jobs [j0, j1)
    j1: int
    i0: int  # items [i0, i1)
    i1: int


@dataclass(slots=True)
class Plan:
    obj: int  # bytes of one item (one group's part of one object)
    desc: np.ndarray  # int64 [4, jobs]: ids, offs, item-in-batch, pos
    batches: list[Batch]
    items: list[CopyItem]

    @property
    def jobs(self) -> int:
        return self.desc.shape[1]


def make_plan(group: GroupLayout, items: list[CopyItem], slot_bytes: int) -> Plan:
    nl, bb = len(group.layers), group.block_bytes
    bpc = items[0].bpc
    obj = nl * bpc * bb
    per_slot = max(1, slot_bytes // obj)
    counts = np.fromiter((len(it.ids) for it in items), dtype=np.int64, count=len(items))
    for it in items:
        assert it.bpc == bpc and it.view.nbytes == obj, "items of one group share the geometry"
    ids = np.concatenate([it.ids for it in items]).astype(np.int64, copy=False)
    pos = np.concatenate([it.pos for it in items]).astype(np.int64, copy=False)
    k = np.repeat(np.arange(len(items), dtype=np.int64) % per_slot, counts)
    _, step = group.object_strides(bpc * group.block_tokens)
    desc = np.stack([ids, k * obj + pos * step, k, pos])
    ends = np.concatenate([[0], np.cumsum(counts)])
    batches = [
        Batch(int(ends[i0]), int(ends[min(i0 + per_slot, len(items))]), i0, min(i0 + per_slot, len(items)))
        for i0 in range(0, len(items), per_slot)
    ]
    return Plan(obj, desc, batches, items)


def vector_width(group: GroupLayout, bases: list[int]) -> int:
    """Widest power-of-two access (<= 16 bytes) every address and stride of the group allows;
    ``bases`` are the device addresses of the layers (tensor base + span offset)."""
    g = 0
    for base, s in zip(bases, group.layers):
        g = math.gcd(g, base, s.block_stride, s.run_bytes, s.block_bytes)
        if s.runs > 1:
            g = math.gcd(g, s.run_stride)
    v = 16
    while v > 1 and g % v:
        v //= 2
    return v


def uniform_runs(group: GroupLayout) -> bool:
    """The kernel takes one (runs, run_bytes) per group; other groups use the torch path."""
    first = group.layers[0]
    return all(s.runs == first.runs and s.run_bytes == first.run_bytes for s in group.layers)


def coalesce(
    host: list[int], dev: list[int], size: int, same_range
) -> tuple[list[int], list[int], list[int]]:
    """Merge consecutive (host, dev) copies of ``size`` bytes that are contiguous on both sides
    and inside one pinned registration (``same_range(a, b)``)."""
    hs, ds, ns = [], [], []
    for h, d in zip(host, dev):
        if hs and hs[-1] + ns[-1] == h and ds[-1] + ns[-1] == d and same_range(hs[-1], h):
            ns[-1] += size
        else:
            hs.append(h)
            ds.append(d)
            ns.append(size)
    return hs, ds, ns


# ---- the pure-torch path ------------------------------------------------------------------------
def layer_views(group: GroupLayout, flats: list) -> list:
    """Per layer a ``[num_blocks, runs, run_bytes]`` uint8 view over the registered tensors
    (``flats[i]``: tensor i as a flat uint8 tensor)."""
    import torch

    return [
        torch.as_strided(
            flats[s.tensor], (s.num_blocks, s.runs, s.run_bytes), (s.block_stride, s.run_stride, 1), s.offset
        )
        for s in group.layers
    ]


def staging_view(
    staging,
    n_items: int,
    layers: int,
    bpc: int,
    bb: int,
    base: int = 0,
    item_stride: int | None = None,
    strides: tuple[int, int] | None = None,
):
    """``staging`` (flat uint8) as ``[n_items, layers, bpc, block]`` from ``base``, items ``item_stride``
    bytes apart (default: back to back); inside an item, layer and block ``strides`` apart
    (GroupLayout.object_strides; default: ``[layer][block]``)."""
    import torch

    stride = item_stride if item_stride is not None else layers * bpc * bb
    inner = strides if strides is not None else (bpc * bb, bb)
    return torch.as_strided(staging, (n_items, layers, bpc, bb), (stride, *inner, 1), base)


def torch_gather(
    views: list,
    staging,
    n_items: int,
    bpc: int,
    ids,
    item,
    pos,
    base: int = 0,
    item_stride: int | None = None,
    strides: tuple[int, int] | None = None,
) -> None:
    """Blocks ``ids`` of every layer into ``staging`` viewed as ``[n_items, layers, bpc, block]``."""
    bb = views[0].shape[1] * views[0].shape[2]
    s = staging_view(staging, n_items, len(views), bpc, bb, base, item_stride, strides)
    for layer, v in enumerate(views):
        s[:, layer].index_put_((item, pos), v.index_select(0, ids).reshape(-1, bb))


def torch_scatter(
    views: list,
    staging,
    n_items: int,
    bpc: int,
    ids,
    item,
    pos,
    base: int = 0,
    item_stride: int | None = None,
    strides: tuple[int, int] | None = None,
) -> None:
    """The reverse of ``torch_gather``."""
    bb = views[0].shape[1] * views[0].shape[2]
    s = staging_view(staging, n_items, len(views), bpc, bb, base, item_stride, strides)
    for layer, v in enumerate(views):
        v.index_put_((ids,), s[:, layer][item, pos].view(-1, v.shape[1], v.shape[2]))
