"""A request trace ``tierd replay`` reads: one JSON object a line, each request's keys in prompt
order (the formats are tierd.tools.replay's), and what a pool that never evicts would hit of it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

MOONCAKE_BLOCK_TOKENS = 512
KEYS_CHUNK_TOKENS = 256  # the connector's default tierd.chunk_tokens


def block_key(name: bytes) -> bytes:
    """The pool's key for a trace's block or chunk ``name``: a 16-byte blake2b digest, as the
    connector's chunk keys are (hashes: the reuse policy's LRU shadow samples keys by their bytes)."""
    return hashlib.blake2b(name, digest_size=16).digest()


class TraceError(ValueError):
    """A trace that cannot be replayed (the message names the file and line)."""


@dataclass
class Trace:
    name: str
    requests: list[tuple[bytes, list[bytes]]]  # (namespace, keys) per request
    block_tokens: int
    blocks: int = 0
    distinct: int = 0
    infinite_hits: int = 0

    @property
    def infinite_hit_ratio(self) -> float:
        return self.infinite_hits / self.blocks if self.blocks else 0.0


def open_trace(path: str):
    """The trace file ``path`` open for reading; TraceError naming it when it cannot be opened."""
    try:
        return open(path, encoding="utf-8")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None


def read_trace(path: str) -> Trace:
    """Every request of the JSONL file ``path``; TraceError for a file or line it cannot read."""
    requests, tokens = [], set()
    with open_trace(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ns, keys, block_tokens = _request(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}, line {n}: {exc}") from None
            requests.append((ns, keys))
            tokens.add(block_tokens)
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    if len(tokens) > 1:
        raise TraceError(f"{path}: lines of different block sizes ({sorted(tokens)} tokens)")
    trace = Trace(path, requests, tokens.pop())
    _count_infinite(trace)
    return trace


def _request(obj) -> tuple[bytes, list[bytes], int]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "hash_ids" in obj:
        ids = obj["hash_ids"]
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError("hash_ids must be a list of integers >= 0")
        return (
            b"",
            [block_key(i.to_bytes(8, "little") if i < 1 << 64 else str(i).encode()) for i in ids],
            (MOONCAKE_BLOCK_TOKENS),
        )
    if "keys" in obj:
        keys, ns = obj["keys"], obj.get("namespace", "")
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("keys must be a list of non-empty strings")
        if not isinstance(ns, str):
            raise ValueError("namespace must be a string")
        chunk = obj.get("chunk_tokens", KEYS_CHUNK_TOKENS)
        if type(chunk) is not int or chunk < 1:
            raise ValueError("chunk_tokens must be an integer >= 1")
        return ns.encode(), [block_key(k.encode()) for k in keys], chunk
    raise ValueError('a request needs "hash_ids" (Mooncake) or "keys" (a chunk key list)')


def _count_infinite(trace: Trace) -> None:
    """What a pool that never evicts hits: each request's longest prefix seen before."""
    seen: set[tuple[bytes, bytes]] = set()
    blocks = hits = 0
    for ns, keys in trace.requests:
        blocks += len(keys)
        hit = 0
        for k in keys:
            if (ns, k) not in seen:
                break
            hit += 1
        hits += hit
        seen.update((ns, k) for k in keys)
    trace.blocks, trace.distinct, trace.infinite_hits = blocks, len(seen), hits
