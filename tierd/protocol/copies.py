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


def pitched_copies(p: Pitched, host: int, ids, pos, block_major: bool = False) -> list[tuple[int, int, int]]:
    """The copies between the engine's blocks ``ids`` and an object part at ``host`` whose
    positions are ``pos``: ``(engine address, host address, row bytes)``. Layer-major parts: each
    copy is ``p.layers`` rows (engine rows ``p.pitch`` apart, host rows ``bpc*block_bytes``).
    ``block_major`` parts (GroupLayout.block_major: a block's layers one contiguous span, objects
    ``[block][layer]``): each copy is one contiguous span of ``p.layers*block_bytes``, one row.
    Blocks adjacent on both sides (consecutive ids and positions where blocks are contiguous in the
    engine's tensor) make one wider copy."""
    unit = p.layers * p.block_bytes if block_major else p.block_bytes
    merge = p.block_stride == unit
    out: list[list[int]] = []
    for b, k in zip(ids, pos):
        e, h = p.base + int(b) * p.block_stride, host + int(k) * unit
        if merge and out and out[-1][0] + out[-1][2] == e and out[-1][1] + out[-1][2] == h:
            out[-1][2] += unit
        else:
            out.append([e, h, unit])
    return [tuple(x) for x in out]
