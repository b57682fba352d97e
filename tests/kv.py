"""A small synthetic KV layout over real shared memory, for tests that cross the wire."""

from __future__ import annotations

import os
import uuid
import weakref
from dataclasses import dataclass, field

import numpy as np

from tierd_client.layouts import block_span, group, layout, namespace
from tierd_client.shm import SharedBuffer


@dataclass
class GroupGeom:
    kind: str = "full"
    layers: int = 2
    block_bytes: int = 256
    block_tokens: int = 4
    window_tokens: int = 0


def _unlink(paths: list[str]) -> None:
    """Remove a rank's /dev/shm files (a daemon that mapped them keeps its mapping)."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@dataclass
class FakeRank:
    """One rank's KV: per group a [layers, num_blocks, block_bytes] shared buffer."""

    groups: list[GroupGeom]
    num_blocks: int = 64
    chunk_tokens: int = 16
    rank: int = 0
    world_size: int = 1
    model: str = "test-model"
    fingerprint: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    replicated: bool = False

    def __post_init__(self):
        self.bufs = [
            SharedBuffer(g.layers * self.num_blocks * g.block_bytes, prefix="tierd-test") for g in self.groups
        ]
        # the files go with the rank (collected, or this process ending), whoever forgets close()
        self._files = weakref.finalize(self, _unlink, [b.path for b in self.bufs])
        self.kv = [
            b.array.reshape(g.layers, self.num_blocks, g.block_bytes) for b, g in zip(self.bufs, self.groups)
        ]
        rng = np.random.default_rng(self.rank * 7919 + 1)
        for kv in self.kv:
            kv[:] = rng.integers(0, 255, kv.shape, dtype=np.uint8)

    @property
    def ns(self) -> dict:
        return namespace(self.model, self.fingerprint, self.world_size)

    def layout(self) -> dict:
        groups = []
        for gi, g in enumerate(self.groups):
            spans = [
                block_span(
                    (self.num_blocks, g.block_bytes),
                    (g.block_bytes, 1),
                    1,
                    0,
                    tensor=gi,
                    offset=l * self.num_blocks * g.block_bytes,
                )
                for l in range(g.layers)
            ]
            groups.append(group(g.kind, g.block_tokens, spans, window_tokens=g.window_tokens))
        return layout(
            self.ns,
            self.rank,
            self.chunk_tokens,
            [b.ref() for b in self.bufs],
            groups,
            replicated=self.replicated,
        )

    def specs(self) -> list[dict]:
        return [
            {"kind": g.kind, "block_tokens": g.block_tokens, "window_tokens": g.window_tokens}
            for g in self.groups
        ]

    def bpc(self, gi: int) -> int:
        g = self.groups[gi]
        return 1 if g.kind == "state" else self.chunk_tokens // g.block_tokens

    def blocks(self, gi: int, ids) -> np.ndarray:
        return self.kv[gi][:, list(ids)].copy()

    def close(self):
        for b in self.bufs:
            b.close()


def keys(n: int, tag: bytes = b"") -> list[bytes]:
    base = uuid.uuid4().bytes
    return [(tag + base)[:12] + i.to_bytes(4, "little") for i in range(n)]
