"""What the scheduler side keeps per request, and the per-request controls a caller (or a
KV-aware router) sets in ``kv_transfer_params``.

Per-request ``kv_transfer_params`` keys, read once when the request is first seen:

- ``max_load_tokens`` (int >= 0): load at most this many tokens from the tier beyond the local
  prefix-cache hit; 0 disables loading (no LOOKUP is sent). The hit is rounded down to whole
  chunks, so a cap below one chunk loads nothing.
- ``max_offload_tokens`` (int >= 0): store at most the first this-many tokens of the request
  (whole chunks); 0 stores nothing.
- ``tierd.skip`` (bool): the request neither loads from nor stores to the tier.

The first two mean what they mean to vLLM's own OffloadingConnector (llm-d's router sets them).
A value of the wrong type is logged and ignored, as vLLM does, so a bad parameter never fails a
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierd_client.vllm_connector.log import get_logger

log = get_logger("tierd_client.vllm_connector")

SKIP_KEY = "tierd.skip"


@dataclass(frozen=True)
class RequestCaps:
    max_load_tokens: int | None = None  # None: no cap
    max_offload_tokens: int | None = None
    skip: bool = False

    @classmethod
    def of(cls, request) -> RequestCaps:
        params = getattr(request, "kv_transfer_params", None) or {}
        if not isinstance(params, dict) or not params:
            return cls()
        return cls(
            _count(params, "max_load_tokens", request),
            _count(params, "max_offload_tokens", request),
            _flag(params.get(SKIP_KEY, False), request),
        )

    def load_cap(self, local_tokens: int, chunk_tokens: int) -> int | None:
        """The highest chunk-aligned hit boundary (tokens) this request may load up to."""
        if self.skip:
            return 0
        if self.max_load_tokens is None:
            return None
        return (local_tokens + self.max_load_tokens) // chunk_tokens * chunk_tokens

    def store_cap(self) -> int | None:
        """How many leading tokens of this request may be stored (None: all)."""
        return 0 if self.skip else self.max_offload_tokens


def _count(params: dict, key: str, request) -> int | None:
    raw = params.get(key)
    if raw is None:
        return None
    if type(raw) is int and raw >= 0:
        return raw
    log.warning(
        "tierd: request %s: %s must be a non-negative int, got %r; ignoring it",
        getattr(request, "request_id", "?"),
        key,
        raw,
    )
    return None


def _flag(raw, request) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
        "",
    ):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if type(raw) is int and raw in (0, 1):
        return bool(raw)
    log.warning(
        "tierd: request %s: %s must be a bool, got %r; ignoring it",
        getattr(request, "request_id", "?"),
        SKIP_KEY,
        raw,
    )
    return False


@dataclass
class ReqState:
    request: object
    caps: RequestCaps = field(default_factory=RequestCaps)
    keys: list[bytes] = field(default_factory=list)
    lookup: object = None  # Future of the LOOKUP reply
    lookup_at: float = 0.0
    hit_chunks: int = 0
    lease: int = 0
    local_tokens: int = 0  # block-aligned local prefix-cache hit at the last query
    stored_chunks: int = 0  # chunks [0, stored_chunks) are in the tier (stored or loaded)
    bypass: bool = False  # a load failed: no more lookups for this request
    loading: bool = False
