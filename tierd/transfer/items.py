"""What one copy touches: a chunk's block ids for one group and the object bytes they map to."""

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
