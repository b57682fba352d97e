"""What the scheduler-side connector hands each worker per step, and what workers hand back.
Plain, picklable data: vLLM ships it between processes."""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # pragma: no cover - vLLM without worker metadata
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass


SKIP = -1  # "leave this block alone": the worker turns it (and vLLM's null block) into the daemon's null id


@dataclass
class ChunkIO:
    key: bytes
    blocks: list[list[int]]  # one list per engine group, daemon null ids already applied


@dataclass
class LoadOrder:
    req_id: str
    lease: int
    chunks: list[ChunkIO]


@dataclass
class StoreOrder:
    req_id: str
    chunks: list[ChunkIO]
    touch: list[bytes]  # keys of the chunks before these, so the prefix head stays most recent


@dataclass
class TierdMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    stores: list[StoreOrder] = field(default_factory=list)
    # block ids handed out this step, in any KV cache group: a pending store reading one must
    # finish first. One set for all groups: vLLM's groups draw ids from one block pool, and its
    # hybrid allocator backs block b of every group with the same page of shared tensors.
    new_blocks: set[int] = field(default_factory=set)


@dataclass
class TierdWorkerMeta(KVConnectorWorkerMetadata):
    failed_loads: set[str] = field(default_factory=set)

    def aggregate(self, other: TierdWorkerMeta) -> TierdWorkerMeta:
        return TierdWorkerMeta(self.failed_loads | other.failed_loads)
