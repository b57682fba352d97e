"""What one ``tierd bench`` run is asked to do: every option in one record with its default (the
command line's defaults are read from here), and the sizes the layout's options imply."""

from __future__ import annotations

from dataclasses import dataclass

MLA_LATENT = 576  # elements per token of an MLA layer's latent (DeepSeek's 512 + 64 rope)


@dataclass(frozen=True)
class BenchOptions:
    socket: str | None = None  # a running daemon's socket; None starts a private one
    device: str = "cpu"
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_tokens: int = 16
    chunk_tokens: int = 256
    dtype_bytes: int = 2
    mla: bool = False
    chunks: int = 64  # stored and retrieved per round
    batch: int = 8  # chunks per request
    rounds: int = 3
    runs: int = 1  # CPU: runs per block's bytes
    pool_gb: float | None = None  # None: sized to fit
    interference: bool = False
    staging_mb: int = 1024
    impl: str = "auto"
    ctas: int = 0
    gpu_order: str = "host"
    step_burst: int = 0
    kv_layout: str = "LBNHC"
    path: str = "staged"
    ranks: int = 1
    seconds: float = 2.0

    @property
    def heads(self) -> int:
        """Heads of a block as the layout names them (MLA: one latent)."""
        return 1 if self.mla else self.kv_heads

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one head: K and V, or an MLA latent."""
        return (MLA_LATENT if self.mla else 2 * self.head_dim) * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.heads * self.row_bytes

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_tokens

    @property
    def object_bytes(self) -> int:
        """Bytes of one stored chunk: every layer's blocks of it."""
        return self.layers * self.blocks_per_chunk * self.block_bytes


DEFAULTS = BenchOptions()
