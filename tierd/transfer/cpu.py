"""CPU data path: the engine's KV tensors live in shared memory; the daemon maps them and copies
blocks with numpy gathers (memcpy per block run, GIL released) on the rank's transfer thread."""

from __future__ import annotations

import mmap
import os

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import PageLayout, ShmHandle, TensorRef
from tierd.transfer.items import CopyItem


class HostTensor:
    """A shared-memory file mapped read-write: ``{"kind": "shm", "path": ..., "offset": ...}``."""

    def __init__(self, ref: TensorRef, where: str):
        if not isinstance(ref.handle, ShmHandle):
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{where}: a cpu layout needs shm tensor handles")
        path, offset = ref.handle.path, ref.handle.offset
        if not path.startswith("/dev/shm/") or ".." in path:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{where}: shm path must be a file under /dev/shm/, got {path!r}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ProtocolError(
                ErrorCode.LAYOUT_INVALID,
                f"{where}: cannot open {path}: {exc.strerror} (the daemon must run as the engine's user)",
            ) from None
        try:
            size = os.fstat(fd).st_size
            if offset + ref.nbytes > size:
                raise ProtocolError(
                    ErrorCode.LAYOUT_INVALID, f"{where}: {path} has {size} bytes, the tensor needs {offset + ref.nbytes}"
                )
            self._map = mmap.mmap(fd, offset + ref.nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.view = np.frombuffer(self._map, dtype=np.uint8)[offset : offset + ref.nbytes]

    def close(self) -> None:
        self.view = None
        try:
            self._map.close()
        except BufferError:
            pass  # a copy still holds a view; the mapping is released with it


class CpuRankMemory:
    def __init__(self, layout: PageLayout, peer=None, refuse=None):
        self.layout = layout
        self.tensors: list[HostTensor] = []
        try:
            for i, ref in enumerate(layout.tensors):
                self.tensors.append(HostTensor(ref, f"layout.tensors[{i}]"))
        except BaseException:
            self.close()
            raise
        # per group, per layer: a [num_blocks, runs, run_bytes] byte view of the engine's tensor
        self.blocks = [
            [
                as_strided(
                    self.tensors[s.tensor].view[s.offset :],
                    shape=(s.num_blocks, s.runs, s.run_bytes),
                    strides=(s.block_stride, s.run_stride, 1),
                    writeable=True,
                )
                for s in group.layers
            ]
            for group in layout.groups
        ]

    def store(self, group: int, items: list[CopyItem]) -> None:
        layers = self.blocks[group]
        nl = len(layers)
        for it in items:
            dst = it.view.reshape(nl, it.bpc, *layers[0].shape[1:])
            if it.complete:
                for layer, src in enumerate(layers):
                    np.take(src, it.ids, axis=0, out=dst[layer], mode="clip")  # ids validated; "raise" would buffer
            else:
                for layer, src in enumerate(layers):
                    dst[layer, it.pos] = src[it.ids]

    def retrieve(self, group: int, items: list[CopyItem]) -> None:
        layers = self.blocks[group]
        nl = len(layers)
        for it in items:
            src = it.view.reshape(nl, it.bpc, *layers[0].shape[1:])
            for layer, dst in enumerate(layers):
                dst[it.ids] = src[layer] if it.complete else src[layer, it.pos]

    def close(self) -> None:
        self.blocks = []
        for t in self.tensors:
            t.close()
        self.tensors = []
