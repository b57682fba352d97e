"""Key derivation. Deterministic across processes, hosts and restarts: no process seed is used.

A PAGE hash names a chunk *and everything before it*: ``h_i = blake2b(h_{i-1} | extras_i | tokens_i)``
with ``h_{-1}`` derived from the request-level extras (cache salt, LoRA name) so that two tenants
with different salts never share a key. Only these digests cross the wire, never token lists.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import msgpack
import numpy as np

from tierd.protocol.layout import Namespace

KEY_BYTES = 16
MIN_KEY_BYTES = 8
MAX_KEY_BYTES = 64
# Bump with any change to how a PAGE hash or a namespace id is derived, or to what a client feeds
# into one (the connector's salt, LoRA name, multimodal extras, layout fingerprint); the golden
# values in tests/unit/test_key_formats.py then need this version's. Every digest changes with it
# (see _tag), a warm restart (--pool-dir) starts cold, and L2 names move (tierd.tier2.keys).
KEY_VERSION = 1


def _tag(kind: str) -> bytes:
    """A digest's domain tag, ``tierd/page/v1``: the version is in every key, so keys of two
    derivations never coincide, and an engine, pool folder or store of another version never
    answers this version's keys with objects stored under another meaning."""
    return f"tierd/{kind}/v{KEY_VERSION}".encode()


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


_NS_IDS: dict[Namespace, bytes] = {}
_NS_IDS_MAX = 4096


def namespace_id(ns: Namespace) -> bytes:
    """The index's namespace key: model, layout fingerprint, world size and operator salt
    (memoised: every LOOKUP names its namespace)."""
    got = _NS_IDS.get(ns)
    if got is None:
        got = _digest(_tag("ns"), msgpack.packb(ns.to_wire(), use_bin_type=True))
        if len(_NS_IDS) >= _NS_IDS_MAX:
            _NS_IDS.clear()
        _NS_IDS[ns] = got
    return got


def root_hash(cache_salt: str | None = None, lora: str | None = None, extra: object = None) -> bytes:
    """Parent of a prompt's first chunk: mixes in what makes a prefix distinct as a whole."""
    return _digest(_tag("page"), msgpack.packb([cache_salt or "", lora or "", extra], use_bin_type=True))


def chunk_hashes(
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    parent: bytes | None = None,
    chunk_extras: Iterable[object] | None = None,
    start: int = 0,
) -> list[bytes]:
    """PAGE hashes of every *full* chunk of ``tokens`` (a trailing partial chunk has none).

    ``chunk_extras`` yields one msgpack-able value per chunk (for example the multimodal
    content hashes whose placeholders fall in that chunk), or nothing. ``start`` skips the
    first ``start`` chunks' outputs while still chaining through them, so a caller that
    already holds ``h_0..h_{start-1}`` passes the last one as ``parent`` and ``start=0``.
    """
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))  # little-endian on every host
    n = len(arr) // chunk_tokens
    prev = parent if parent is not None else root_hash()
    extras = list(chunk_extras) if chunk_extras is not None else []
    out: list[bytes] = []
    for i in range(n):
        extra = (
            msgpack.packb(extras[i], use_bin_type=True) if i < len(extras) and extras[i] is not None else b""
        )
        prev = _digest(prev, extra, arr[i * chunk_tokens : (i + 1) * chunk_tokens].tobytes())
        if i >= start:
            out.append(prev)
    return out
