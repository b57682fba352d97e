"""Object names in Mooncake Store: every node derives the same name for the same chunk part.

Hazards:

- Names are global to the store: any client of the same master (and tenant) can read, overwrite
  or remove them. Tenant separation inside tierd rests on the namespace id being part of the
  key bytes (it hashes the model, layout, world and cache salt), never on Mooncake.
- Mooncake keys are strings. Raw key bytes are not valid UTF-8 in general, so a name is plain
  lowercase hex under a prefix and the format: ``<prefix>/v3-k1-o2/<hex>``. Names of one
  namespace share a hex prefix, so an operator can select them with the master's regex removal.
  Mooncake 0.3.13 took names of 10,000 characters and any printable characters; tierd's are
  under 200.
- Nodes of two versions must never read each other's objects under another meaning, and nobody
  has to remember that: the format in the name is made of the name encoding's version
  (``NAME_VERSION``: :func:`chunk_key` and :func:`object_name`), the key derivation's
  (tierd.protocol.keys.KEY_VERSION: what a PAGE hash or a namespace id means) and the object
  byte layout's (tierd.state.planner.OBJECT_LAYOUT_VERSION). A change of any of them gives other
  names, so objects written under another format are never found, never served. History: v2
  (no key or layout part) until block-major groups' objects were laid out block by block; v3
  added the key and layout parts.
"""

from __future__ import annotations

from tierd.protocol.keys import KEY_VERSION
from tierd.state.planner import OBJECT_LAYOUT_VERSION

NAME_VERSION = 3
NAMESPACE_BYTES = 16  # tierd.protocol.keys.namespace_id digest size
MAX_KEY_BYTES = 96


def name_format(key_version: int = KEY_VERSION, layout_version: int = OBJECT_LAYOUT_VERSION) -> str:
    """The format part of every object name: ``v3-k1-o2`` for this version of tierd."""
    return f"v{NAME_VERSION}-k{key_version}-o{layout_version}"


FORMAT = name_format()


def chunk_key(namespace: bytes, page_hash: bytes, group: int, rank: int) -> bytes:
    """The L2 key of one chunk's bytes for one engine group (-1: all groups) on one rank.

    ``namespace`` is fixed-size, ``group`` and ``rank`` are fixed-size at the end, so the page
    hash (8-64 bytes in tierd's protocol) needs no length field to be unambiguous.
    """
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace id must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    if not page_hash:
        raise ValueError("page hash is empty")
    if not -1 <= group < 0x7FFF or not 0 <= rank < 0xFFFF:
        raise ValueError(f"group {group} or rank {rank} out of range")
    return bytes(namespace) + bytes(page_hash) + (group & 0xFFFF).to_bytes(2, "big") + rank.to_bytes(2, "big")


def object_name(key: bytes, prefix: str) -> str:
    """``<prefix>/<FORMAT>/<hex of key>``: the string Mooncake stores ``key`` under."""
    if not isinstance(key, (bytes, bytearray, memoryview)) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"l2 key must be 1-{MAX_KEY_BYTES} bytes")
    return f"{prefix}/{FORMAT}/{bytes(key).hex()}"


def key_of(name: str, prefix: str) -> bytes:
    """Inverse of :func:`object_name` (for operators' tools and tests)."""
    head = f"{prefix}/{FORMAT}/"
    if not name.startswith(head):
        raise ValueError(f"{name!r} is not a tierd {FORMAT} object name under {prefix!r}")
    return bytes.fromhex(name[len(head) :])
