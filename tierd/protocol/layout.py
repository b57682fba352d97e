"""Page layouts: what a registered rank publishes, and the chunk geometry derived from it.

A *chunk* is ``chunk_tokens`` consecutive prompt tokens; it is the unit the index keys by PAGE
hash. Each engine group stores one object per chunk (per rank). Inside an object the bytes are
laid out ``[layer][block of the chunk][run]``, so one layer's blocks of one chunk are contiguous;
a group whose blocks hold all their layers in one contiguous span (``GroupLayout.block_major``)
lays them out ``[block of the chunk][layer][run]`` instead, each block's bytes as the engine's.

A layer of a group is described by where block ``b`` lives in a registered tensor::

    for r in range(runs):
        bytes [offset + b*block_stride + r*run_stride, ... + run_bytes)

which covers block-contiguous layouts (runs == 1), head-outer layouts (one run per head) and
kernel blocks smaller than manager blocks (block_stride spans several kernel blocks).

These are msgspec Structs: a REGISTER or LOOKUP body is decoded straight into them, every type
and range checked on the way in (``BAD_REQUEST``, with the field's path), and the geometry that
spans several fields (bytes inside their tensor, runs that do not overlap, chunks that end on a
block boundary) checked once the layout is whole (``LAYOUT_INVALID``).
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tierd.protocol.errors import ErrorCode, ProtocolError, convert

MAX_TENSORS = 4096
MAX_GROUPS = 64
MAX_LAYERS = 1024
MAX_BLOCKS_PER_CHUNK = 4096
MAX_NAME = 256
MAX_WORLD = 4096
MAX_CHUNK_TOKENS = 1 << 24
MAX_BLOCK_TOKENS = 1 << 20
MAX_WINDOW_TOKENS = 1 << 30
MAX_BYTES = 1 << 50

Name = Annotated[str, Meta(max_length=MAX_NAME, pattern="^[^\x00]*$")]
NonEmptyName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME, pattern="^[^\x00]*$")]
ByteOffset = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
ByteCount = Annotated[int, Meta(ge=1, le=MAX_BYTES)]
ChunkTokens = Annotated[int, Meta(ge=1, le=MAX_CHUNK_TOKENS)]


def invalid(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.LAYOUT_INVALID, msg)


class Wire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the layout's parts: ``from_wire`` decodes plain data (tests, tools) with the edge's
    checks and error codes. A field none of them knows is refused, as in a request body."""

    @classmethod
    def from_wire(cls, m: object, path: str = ""):
        return convert(m, cls, path)


class GroupKind(str, enum.Enum):
    FULL = "full"  # full attention: every chunk of the prefix is needed
    SLIDING = "sliding"  # sliding-window attention: only blocks inside the window are needed
    STATE = "state"  # recurrent state (mamba, linear attention): only the state at the hit boundary


class Namespace(Wire, frozen=True):
    model: NonEmptyName
    fingerprint: Name
    world_size: Annotated[int, Meta(ge=1, le=MAX_WORLD)]
    salt: Name = ""

    def to_wire(self) -> dict:
        return msgspec.structs.asdict(self)


class GroupSpec(Wire, frozen=True):
    """What LOOKUP needs to know of a group to decide servability."""

    kind: GroupKind
    block_tokens: Annotated[int, Meta(ge=1, le=MAX_BLOCK_TOKENS)]
    window_tokens: Annotated[int, Meta(ge=0, le=MAX_WINDOW_TOKENS)] = 0  # SLIDING only

    def __post_init__(self):
        if self.kind is GroupKind.SLIDING and self.window_tokens < 1:
            raise ValueError("a sliding group needs window_tokens >= 1")

    def to_wire(self) -> dict:
        return {
            "kind": self.kind.value,
            "block_tokens": self.block_tokens,
            "window_tokens": self.window_tokens,
        }

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        """Block ids a STORE/RETRIEVE carries for this group per chunk."""
        if self.kind is GroupKind.STATE:
            return 1  # the state at the end of the chunk
        return chunk_tokens // self.block_tokens

    def check_chunk(self, chunk_tokens: int, path: str) -> None:
        # Every kind: a chunk boundary must be a block boundary. For a state group this is what
        # makes "the state at the end of the chunk" exist: an engine keeps states at block ends.
        if chunk_tokens % self.block_tokens:
            raise invalid(
                f"{path}: chunk_tokens {chunk_tokens} is not a multiple of block_tokens {self.block_tokens}"
            )
        if self.blocks_per_chunk(chunk_tokens) > MAX_BLOCKS_PER_CHUNK:
            raise invalid(f"{path}: more than {MAX_BLOCKS_PER_CHUNK} blocks per chunk")

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
        first = max(0, (start - chunk_start) // self.block_tokens)
        last = min(bpc, -(-(end - chunk_start) // self.block_tokens))
        return ((1 << last) - 1) & ~((1 << first) - 1) if last > first else 0

    def lookback_chunks(self, chunk_tokens: int) -> int:
        """How many chunks before a boundary this group can need (FULL: all)."""
        if self.kind is GroupKind.STATE:
            return 1
        if self.kind is GroupKind.SLIDING:
            return -(-(self.window_tokens - 1) // chunk_tokens) + 1
        return 1 << 62


class LayerSpan(Wire, frozen=True):
    tensor: Annotated[int, Meta(ge=0, lt=MAX_TENSORS)]
    offset: ByteOffset
    block_stride: ByteCount
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 32)]
    run_bytes: ByteCount
    runs: Annotated[int, Meta(ge=1, le=1 << 16)] = 1
    run_stride: ByteOffset = 0

    def __post_init__(self):
        if self.runs > 1 and self.run_stride < self.run_bytes:
            raise invalid("runs overlap (run_stride < run_bytes)")

    @property
    def block_bytes(self) -> int:
        return self.runs * self.run_bytes

    @property
    def end(self) -> int:
        """One past the last byte any block of this layer touches."""
        return (
            self.offset
            + (self.num_blocks - 1) * self.block_stride
            + (self.runs - 1) * self.run_stride
            + self.run_bytes
        )

    def to_wire(self) -> dict:
        return msgspec.structs.asdict(self)


class GroupLayout(Wire, frozen=True):
    kind: GroupKind
    block_tokens: Annotated[int, Meta(ge=1, le=MAX_BLOCK_TOKENS)]
    layers: Annotated[tuple[LayerSpan, ...], Meta(min_length=1, max_length=MAX_LAYERS)]
    window_tokens: Annotated[int, Meta(ge=0, le=MAX_WINDOW_TOKENS)] = 0
    dtype: Annotated[str, Meta(max_length=64)] = ""

    def __post_init__(self):
        if len({layer.block_bytes for layer in self.layers}) != 1:
            raise invalid("layers of one group must have equal block bytes")
        if self.kind is GroupKind.SLIDING and self.window_tokens < 1:
            raise ValueError("a sliding group needs window_tokens >= 1")

    @property
    def spec(self) -> GroupSpec:
        return GroupSpec(self.kind, self.block_tokens, self.window_tokens)

    @property
    def block_bytes(self) -> int:
        return self.layers[0].block_bytes

    def object_bytes(self, chunk_tokens: int) -> int:
        return len(self.layers) * self.spec.blocks_per_chunk(chunk_tokens) * self.block_bytes

    @property
    def block_major(self) -> bool:
        """Whether a block's layers are one contiguous span of one tensor: every layer keeps a block
        in one run, and layer ``l``'s block ``b`` starts where layer ``l-1``'s ends (block-outermost
        KV such as vLLM's BLNHC and BLHNC, all layers in one buffer). Such a group's objects are laid
        out ``[block][layer][run]``, each block as the engine holds it, so that moving a block is one
        contiguous copy; every other group's ``[layer][block][run]`` (module doc). Computed from the
        layout alone, so every rank and the daemon agree on it."""
        first, bb = self.layers[0], self.block_bytes
        return (
            len(self.layers) > 1
            and first.block_stride >= len(self.layers) * bb
            and all(
                s.tensor == first.tensor
                and s.runs == 1
                and s.block_stride == first.block_stride
                and s.offset == first.offset + i * bb
                for i, s in enumerate(self.layers)
            )
        )

    def object_strides(self, chunk_tokens: int) -> tuple[int, int]:
        """(layer stride, block stride) in bytes inside this group's part of an object: layer ``l``'s
        block at chunk position ``p`` starts at ``l * layer stride + p * block stride``."""
        bb, bpc = self.block_bytes, self.spec.blocks_per_chunk(chunk_tokens)
        return (bb, len(self.layers) * bb) if self.block_major else (bpc * bb, bb)

    @property
    def num_blocks(self) -> int:
        return min(layer.num_blocks for layer in self.layers)

    def to_wire(self) -> dict:
        return {**self.spec.to_wire(), "dtype": self.dtype, "layers": [x.to_wire() for x in self.layers]}


class ShmHandle(msgspec.Struct, frozen=True, tag="shm", tag_field="kind", forbid_unknown_fields=True):
    """A file under /dev/shm the engine's tensor lives in, at ``offset``."""

    path: Annotated[str, Meta(min_length=1, max_length=4096, pattern="^[^\x00]*$")]
    offset: ByteOffset = 0


class FdHandle(msgspec.Struct, frozen=True, tag="fd", tag_field="kind", forbid_unknown_fields=True):
    """Descriptor ``index`` of those the client sent under ``ticket`` to the daemon's fd socket
    (tierd.edge.fdinbox), at ``offset``: shared memory it holds open, named by no path."""

    ticket: Annotated[bytes, Meta(min_length=16, max_length=16)]
    index: Annotated[int, Meta(ge=0, lt=MAX_TENSORS)]
    offset: ByteOffset = 0


# torch's untyped_storage()._share_cuda_(): device, handle, size, offset, ref counter handle,
# ref counter offset, event handle, event sync
IpcFields = tuple[
    int,
    Annotated[bytes, Meta(max_length=4096)],
    int,
    int,
    Annotated[bytes, Meta(max_length=4096)],
    int,
    Annotated[bytes, Meta(max_length=4096)],
    bool,
]


class CudaIpcHandle(
    msgspec.Struct, frozen=True, tag="cuda_ipc", tag_field="kind", forbid_unknown_fields=True
):
    """A CUDA IPC handle of the engine's storage on the GPU with ``device_uuid``."""

    device_uuid: NonEmptyName
    ipc: IpcFields


class TensorRef(Wire, frozen=True):
    handle: ShmHandle | FdHandle | CudaIpcHandle
    nbytes: ByteCount

    def to_wire(self) -> dict:
        return {"handle": msgspec.to_builtins(self.handle), "nbytes": self.nbytes}


class PageLayout(Wire, frozen=True, omit_defaults=True):  # a cpu layout's frame has no `staging`
    namespace: Namespace
    rank: Annotated[int, Meta(ge=0)]
    chunk_tokens: ChunkTokens
    tensors: Annotated[tuple[TensorRef, ...], Meta(min_length=1, max_length=MAX_TENSORS)]
    groups: Annotated[tuple[GroupLayout, ...], Meta(min_length=1, max_length=MAX_GROUPS)]
    replicated: bool = False  # one copy serves every rank (MLA); only rank 0's bytes are stored
    device: Literal["cpu", "cuda"] = "cpu"
    staging: TensorRef | None = None  # cuda: the engine's staging buffer the daemon copies objects through

    def __post_init__(self):
        if self.rank >= self.namespace.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.namespace.world_size}")
        if self.staging is not None and self.device != "cuda":
            raise invalid("only a cuda layout has a staging buffer")
        self.check()

    def check(self, path: str = "layout") -> None:
        """Every byte any block id can address must lie inside its tensor."""
        for gi, group in enumerate(self.groups):
            group.spec.check_chunk(self.chunk_tokens, f"{path}.groups[{gi}]")
            for li, layer in enumerate(group.layers):
                where = f"{path}.groups[{gi}].layers[{li}]"
                if layer.tensor >= len(self.tensors):
                    raise invalid(f"{where}: tensor index {layer.tensor} out of range")
                nbytes = self.tensors[layer.tensor].nbytes
                if layer.end > nbytes:
                    raise invalid(f"{where}: blocks reach byte {layer.end} but the tensor has {nbytes}")

    @property
    def specs(self) -> tuple[GroupSpec, ...]:
        return tuple(g.spec for g in self.groups)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk's object: every group's part (the engine's staging holds chunks so)."""
        return sum(g.object_bytes(self.chunk_tokens) for g in self.groups)

    def to_wire(self) -> dict:
        return {
            "namespace": self.namespace.to_wire(),
            "rank": self.rank,
            "replicated": self.replicated,
            "chunk_tokens": self.chunk_tokens,
            "device": self.device,
            "tensors": [t.to_wire() for t in self.tensors],
            "groups": [g.to_wire() for g in self.groups],
            **({"staging": self.staging.to_wire()} if self.staging is not None else {}),
        }
