"""What one copy touches: a chunk's block ids for one group and the object bytes they map to, and
the groups the copy engines can move without staging (Pitched). Both sides compute these: the
daemon's planner and copy lanes (tierd.transfer), and the engine's CUDA gather plans and its choice
of registering without a staging buffer (tierd_client)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class CopyItem:
    ids: np.ndarray  # int64 block ids that are not null, in chunk order
    pos: np.ndarray  # their positions inside the chunk (0..bpc-1)
    bpc: int  # blocks per chunk of the group
    view: np.ndarray  # uint8 bytes of this group's part of the object, laid out [layer][block][run]
    staged: int = -1  # cuda: byte offset of this part in the rank's staging buffer

    @property
    def complete(self) -> bool:
        return len(self.ids) == self.bpc


def split_nulls(
    block_ids: list[int], null: int, positions: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(non-null ids, their positions). ``positions`` (read-only ``arange(len)``) is returned as
    is when no id is null, the common case."""
    if positions is not None and null not in block_ids:
        return np.array(block_ids, dtype=np.int64), positions
    ids = np.asarray(block_ids, dtype=np.int64)
    keep = ids != null
    return ids[keep], np.flatnonzero(keep)


MAX_PITCH = (1 << 31) - 1  # the copy engines' largest row pitch (CUDA's max pitch attribute on Hopper)


@dataclass(frozen=True, slots=True)
class Pitched:
    """A group the copy engines can move without staging: each layer keeps a block in one run and
    the layers lie a constant ``pitch`` apart in one address space, so block ``b`` of layer ``l`` is
    ``[base + l*pitch + b*block_stride, +block_bytes)``. One block of every layer is then one
    pitched (2D) copy of ``layers`` rows, to or from its object's ``[layer][block][bytes]`` rows
    ``bpc*block_bytes`` apart. Both vLLM 0.33 orders of full-attention KV qualify: layer-outermost
    (``LBNHC``, ``LBHNC``: pitch = the layer's bytes) and block-outermost (``BLNHC``, ``BLHNC``:
    pitch = block bytes, a block's layers one contiguous span)."""

    base: int
    pitch: int
    block_stride: int
    block_bytes: int
    layers: int


def pitched(group, bases: list[int], max_pitch: int = MAX_PITCH) -> Pitched | None:
    """``group`` (a GroupLayout) as a Pitched geometry, or None when it is not one; ``bases``: each
    layer's address (its tensor's base + its span's offset)."""
    first = group.layers[0]
    bb = first.block_bytes
    if any(s.runs != 1 or s.block_stride != first.block_stride for s in group.layers):
        return None
    if len(bases) == 1:
        return Pitched(bases[0], bb, first.block_stride, bb, 1)
    pitch = bases[1] - bases[0]
    if pitch < bb or pitch > max_pitch or any(b != bases[0] + i * pitch for i, b in enumerate(bases)):
        return None
    return Pitched(bases[0], pitch, first.block_stride, bb, len(bases))


def pitched_copies(p: Pitched, host: int, ids, pos) -> list[tuple[int, int, int]]:
    """The pitched copies between the engine's blocks ``ids`` and an object part at ``host`` whose
    positions are ``pos``: ``(engine address, host address, row bytes)``, each ``p.layers`` rows
    (engine rows ``p.pitch`` apart, host rows ``bpc*block_bytes``). Blocks adjacent on both sides
    (consecutive ids and positions where a layer's blocks are contiguous) make one wider copy.
    A block-major group's copies are ``span_copies``."""
    bb = p.block_bytes
    e = p.base + np.asarray(ids, dtype=np.int64) * p.block_stride
    h = host + np.asarray(pos, dtype=np.int64) * bb
    if len(e) < 2 or p.block_stride != bb:
        return list(zip(e.tolist(), h.tolist(), [bb] * len(e)))
    first = np.flatnonzero(np.concatenate(([True], (e[1:] != e[:-1] + bb) | (h[1:] != h[:-1] + bb))))
    count = np.diff(np.append(first, len(e)))
    return list(zip(e[first].tolist(), h[first].tolist(), (count * bb).tolist()))


def row_pitches(rows: int, width: int, dev_pitch: int, host_pitch: int) -> tuple[int, int]:
    """The (engine, host) row pitches the copy engines are given for one pitched copy of ``rows``
    rows of ``width`` bytes. They refuse a pitch below the width (CUDA_ERROR_INVALID_VALUE), and a
    single row has no pitch of its own: a group of one layer (``Pitched.pitch`` = one block) merges
    adjacent blocks into a row wider than that, so its pitches are raised to the width. Rows wider
    than their pitch would overlap: a ValueError, never a copy."""
    if rows == 1:
        return max(dev_pitch, width), max(host_pitch, width)
    if width > dev_pitch or width > host_pitch:
        raise ValueError(f"a pitched copy of {rows} rows of {width} bytes, pitches {dev_pitch}/{host_pitch}")
    return dev_pitch, host_pitch


def events_order_processes(torch) -> bool:
    """Whether an interprocess event orders another process's work on this build of ``torch``:
    not on ROCm, where HIP answers a query of one as complete once it is recorded, whatever runs
    before it (ROCm/hip#3778). Where not, the daemon answers a RETRIEVE once its copies are
    complete and refuses a request that carries an event (tierd.transfer.cuda), and a staged rank
    sends in host order (tierd_client.staged_rank)."""
    return getattr(torch.version, "hip", None) is None


def span_copies(p: Pitched, items: list[CopyItem]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The contiguous copies between the engine's blocks and the object parts of ``items`` for a
    block-major group (GroupLayout.block_major: a block of every layer is one span of
    ``p.layers*block_bytes``, at position ``p`` of its part): ``(engine addresses, host addresses,
    bytes)`` as int64 arrays, in item and block order. Blocks adjacent on both sides within one
    item make one copy (never across items: two objects may lie in different pinned ranges). The
    same as one pitched copy of ``p.layers`` rows per block, without a Python step per block."""
    unit = p.layers * p.block_bytes
    items = [it for it in items if len(it.ids)]
    if not items:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    counts = np.fromiter((len(it.ids) for it in items), dtype=np.int64, count=len(items))
    ids = np.concatenate([np.asarray(it.ids, dtype=np.int64) for it in items])
    pos = np.concatenate([np.asarray(it.pos, dtype=np.int64) for it in items])
    hosts = np.fromiter((it.view.ctypes.data for it in items), dtype=np.int64, count=len(items))
    e = p.base + ids * p.block_stride
    h = np.repeat(hosts, counts) + pos * unit
    if p.block_stride != unit or len(e) < 2:  # no two blocks adjacent on the engine's side
        return e, h, np.full(len(e), unit, dtype=np.int64)
    start = np.empty(len(e), dtype=bool)
    start[0] = True
    start[1:] = (e[1:] != e[:-1] + unit) | (h[1:] != h[:-1] + unit)
    start[np.cumsum(counts)[:-1]] = True  # each item's first block starts a copy
    if start.all():  # (an engine's free list after a while: nothing merges)
        return e, h, np.full(len(e), unit, dtype=np.int64)
    first = np.flatnonzero(start)
    return e[first], h[first], np.diff(np.append(first, len(e))) * unit
