"""Page layouts: what a registered rank publishes, and the chunk geometry derived from it.

A *chunk* is ``chunk_tokens`` consecutive prompt tokens; it is the unit the index keys by PAGE
hash. Each engine group stores one object per chunk (per rank). Inside an object the bytes are
laid out ``[layer][block of the chunk][run]``, so one layer's blocks of one chunk are contiguous.

A layer of a group is described by where block ``b`` lives in a registered tensor::

    for r in range(runs):
        bytes [offset + b*block_stride + r*run_stride, ... + run_bytes)

which covers block-contiguous layouts (runs == 1), head-outer layouts (one run per head) and
kernel blocks smaller than manager blocks (block_stride spans several kernel blocks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tierd.protocol import fields as f
from tierd.protocol.errors import ErrorCode, ProtocolError

MAX_TENSORS = 4096
MAX_GROUPS = 64
MAX_LAYERS = 1024
MAX_BLOCKS_PER_CHUNK = 4096


class GroupKind(str, enum.Enum):
    FULL = "full"  # full attention: every chunk of the prefix is needed
    SLIDING = "sliding"  # sliding-window attention: only blocks inside the window are needed
    STATE = "state"  # recurrent state (mamba, linear attention): only the state at the hit boundary


@dataclass(frozen=True, slots=True)
class Namespace:
    model: str
    fingerprint: str
    world_size: int
    salt: str = ""

    @classmethod
    def from_wire(cls, m: object, path: str = "namespace") -> "Namespace":
        m = f.as_map(m, path)
        return cls(
            model=f.as_str(f.get(m, "model", path), f"{path}.model", allow_empty=False),
            fingerprint=f.as_str(f.get(m, "fingerprint", path), f"{path}.fingerprint"),
            world_size=f.as_int(f.get(m, "world_size", path), f"{path}.world_size", 1, 4096),
            salt=f.as_str(f.get(m, "salt", path, ""), f"{path}.salt"),
        )

    def to_wire(self) -> dict:
        return {"model": self.model, "fingerprint": self.fingerprint, "world_size": self.world_size, "salt": self.salt}


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What LOOKUP needs to know of a group to decide servability."""

    kind: GroupKind
    block_tokens: int
    window_tokens: int = 0  # SLIDING only

    @classmethod
    def from_wire(cls, m: object, path: str) -> "GroupSpec":
        m = f.as_map(m, path)
        kind = GroupKind(f.as_choice(f.get(m, "kind", path), f"{path}.kind", tuple(k.value for k in GroupKind)))
        spec = cls(
            kind=kind,
            block_tokens=f.as_int(f.get(m, "block_tokens", path), f"{path}.block_tokens", 1, 1 << 20),
            window_tokens=f.as_int(f.get(m, "window_tokens", path, 0), f"{path}.window_tokens", 0, 1 << 30),
        )
        if kind is GroupKind.SLIDING and spec.window_tokens < 1:
            raise f.bad(f"{path}.window_tokens", "a sliding group needs window_tokens >= 1")
        return spec

    def to_wire(self) -> dict:
        return {"kind": self.kind.value, "block_tokens": self.block_tokens, "window_tokens": self.window_tokens}

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        """Block ids a STORE/RETRIEVE carries for this group per chunk."""
        if self.kind is GroupKind.STATE:
            return 1  # the state at the end of the chunk
        return chunk_tokens // self.block_tokens

    def check_chunk(self, chunk_tokens: int, path: str) -> None:
        # Every kind: a chunk boundary must be a block boundary. For a state group this is what
        # makes "the state at the end of the chunk" exist: an engine keeps states at block ends.
        if chunk_tokens % self.block_tokens:
            raise ProtocolError(
                ErrorCode.LAYOUT_INVALID,
                f"{path}: chunk_tokens {chunk_tokens} is not a multiple of block_tokens {self.block_tokens}",
            )
        if self.blocks_per_chunk(chunk_tokens) > MAX_BLOCKS_PER_CHUNK:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{path}: more than {MAX_BLOCKS_PER_CHUNK} blocks per chunk")

    def needed_mask(self, chunk_index: int, boundary: int, chunk_tokens: int) -> int:
        """Bitmask of this chunk's blocks a hit of ``boundary`` chunks needs (0 = not needed)."""
        if chunk_index >= boundary:
            return 0
        bpc = self.blocks_per_chunk(chunk_tokens)
        if self.kind is GroupKind.FULL:
            return (1 << bpc) - 1
        if self.kind is GroupKind.STATE:
            return 1 if chunk_index == boundary - 1 else 0
        # SLIDING: the next token (at boundary*chunk_tokens) attends to the window_tokens - 1 before it.
        end = boundary * chunk_tokens
        start = max(0, end - self.window_tokens + 1)
        chunk_start = chunk_index * chunk_tokens
        mask = 0
        for b in range(bpc):
            b_start = chunk_start + b * self.block_tokens
            if b_start + self.block_tokens > start and b_start < end:
                mask |= 1 << b
        return mask

    def lookback_chunks(self, chunk_tokens: int) -> int:
        """How many chunks before a boundary this group can need (FULL: all)."""
        if self.kind is GroupKind.STATE:
            return 1
        if self.kind is GroupKind.SLIDING:
            return -(-(self.window_tokens - 1) // chunk_tokens) + 1
        return 1 << 62


@dataclass(frozen=True, slots=True)
class LayerSpan:
    tensor: int
    offset: int
    block_stride: int
    num_blocks: int
    runs: int
    run_stride: int
    run_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.runs * self.run_bytes

    @property
    def end(self) -> int:
        """One past the last byte any block of this layer touches."""
        return self.offset + (self.num_blocks - 1) * self.block_stride + (self.runs - 1) * self.run_stride + self.run_bytes

    @classmethod
    def from_wire(cls, m: object, path: str) -> "LayerSpan":
        m = f.as_map(m, path)
        big = 1 << 50
        span = cls(
            tensor=f.as_int(f.get(m, "tensor", path), f"{path}.tensor", 0, MAX_TENSORS - 1),
            offset=f.as_int(f.get(m, "offset", path), f"{path}.offset", 0, big),
            block_stride=f.as_int(f.get(m, "block_stride", path), f"{path}.block_stride", 1, big),
            num_blocks=f.as_int(f.get(m, "num_blocks", path), f"{path}.num_blocks", 1, 1 << 32),
            runs=f.as_int(f.get(m, "runs", path, 1), f"{path}.runs", 1, 1 << 16),
            run_stride=f.as_int(f.get(m, "run_stride", path, 0), f"{path}.run_stride", 0, big),
            run_bytes=f.as_int(f.get(m, "run_bytes", path), f"{path}.run_bytes", 1, big),
        )
        if span.runs > 1 and span.run_stride < span.run_bytes:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{path}: runs overlap (run_stride < run_bytes)")
        return span

    def to_wire(self) -> dict:
        return {
            "tensor": self.tensor,
            "offset": self.offset,
            "block_stride": self.block_stride,
            "num_blocks": self.num_blocks,
            "runs": self.runs,
            "run_stride": self.run_stride,
            "run_bytes": self.run_bytes,
        }


@dataclass(frozen=True, slots=True)
class GroupLayout:
    spec: GroupSpec
    dtype: str
    layers: tuple[LayerSpan, ...]

    @property
    def block_bytes(self) -> int:
        return self.layers[0].block_bytes

    def object_bytes(self, chunk_tokens: int) -> int:
        return len(self.layers) * self.spec.blocks_per_chunk(chunk_tokens) * self.block_bytes

    @property
    def num_blocks(self) -> int:
        return min(layer.num_blocks for layer in self.layers)

    @classmethod
    def from_wire(cls, m: object, path: str) -> "GroupLayout":
        m = f.as_map(m, path)
        layers = tuple(
            LayerSpan.from_wire(x, f"{path}.layers[{i}]")
            for i, x in enumerate(f.as_list(f.get(m, "layers", path), f"{path}.layers", MAX_LAYERS, 1))
        )
        if len({layer.block_bytes for layer in layers}) != 1:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{path}: layers of one group must have equal block bytes")
        return cls(
            spec=GroupSpec.from_wire(m, path),
            dtype=f.as_str(f.get(m, "dtype", path, ""), f"{path}.dtype", 64),
            layers=layers,
        )

    def to_wire(self) -> dict:
        return {**self.spec.to_wire(), "dtype": self.dtype, "layers": [x.to_wire() for x in self.layers]}


@dataclass(frozen=True, slots=True)
class TensorRef:
    handle: dict  # transport-specific: {"kind": "shm", "path": ...} or {"kind": "cuda_ipc", ...}
    nbytes: int

    @classmethod
    def from_wire(cls, m: object, path: str) -> "TensorRef":
        m = f.as_map(m, path)
        handle = f.as_map(f.get(m, "handle", path), f"{path}.handle")
        f.as_choice(f.get(handle, "kind", f"{path}.handle"), f"{path}.handle.kind", ("shm", "cuda_ipc"))
        return cls(handle=handle, nbytes=f.as_int(f.get(m, "nbytes", path), f"{path}.nbytes", 1, 1 << 50))

    def to_wire(self) -> dict:
        return {"handle": self.handle, "nbytes": self.nbytes}


@dataclass(frozen=True, slots=True)
class PageLayout:
    namespace: Namespace
    rank: int
    replicated: bool  # one copy serves every rank (MLA); only rank 0's bytes are stored
    chunk_tokens: int
    device: str  # "cpu" or "cuda"
    tensors: tuple[TensorRef, ...]
    groups: tuple[GroupLayout, ...]

    @classmethod
    def from_wire(cls, m: object, path: str = "layout") -> "PageLayout":
        m = f.as_map(m, path)
        ns = Namespace.from_wire(f.get(m, "namespace", path), f"{path}.namespace")
        layout = cls(
            namespace=ns,
            rank=f.as_int(f.get(m, "rank", path), f"{path}.rank", 0, ns.world_size - 1),
            replicated=f.as_bool(f.get(m, "replicated", path, False), f"{path}.replicated"),
            chunk_tokens=f.as_int(f.get(m, "chunk_tokens", path), f"{path}.chunk_tokens", 1, 1 << 24),
            device=f.as_choice(f.get(m, "device", path, "cpu"), f"{path}.device", ("cpu", "cuda")),
            tensors=tuple(
                TensorRef.from_wire(x, f"{path}.tensors[{i}]")
                for i, x in enumerate(f.as_list(f.get(m, "tensors", path), f"{path}.tensors", MAX_TENSORS, 1))
            ),
            groups=tuple(
                GroupLayout.from_wire(x, f"{path}.groups[{i}]")
                for i, x in enumerate(f.as_list(f.get(m, "groups", path), f"{path}.groups", MAX_GROUPS, 1))
            ),
        )
        layout.check(path)
        return layout

    def check(self, path: str = "layout") -> None:
        """Every byte any block id can address must lie inside its tensor."""
        for gi, group in enumerate(self.groups):
            group.spec.check_chunk(self.chunk_tokens, f"{path}.groups[{gi}]")
            for li, layer in enumerate(group.layers):
                where = f"{path}.groups[{gi}].layers[{li}]"
                if layer.tensor >= len(self.tensors):
                    raise ProtocolError(ErrorCode.LAYOUT_INVALID, f"{where}: tensor index {layer.tensor} out of range")
                nbytes = self.tensors[layer.tensor].nbytes
                if layer.end > nbytes:
                    raise ProtocolError(
                        ErrorCode.LAYOUT_INVALID,
                        f"{where}: blocks reach byte {layer.end} but the tensor has {nbytes}",
                    )

    @property
    def specs(self) -> tuple[GroupSpec, ...]:
        return tuple(g.spec for g in self.groups)

    def to_wire(self) -> dict:
        return {
            "namespace": self.namespace.to_wire(),
            "rank": self.rank,
            "replicated": self.replicated,
            "chunk_tokens": self.chunk_tokens,
            "device": self.device,
            "tensors": [t.to_wire() for t in self.tensors],
            "groups": [g.to_wire() for g in self.groups],
        }
