"""Object names in Mooncake Store: every node derives the same name for the same chunk part.

Hazards:

- Names are global to the store: any client of the same master (and tenant) can read, overwrite
  or remove them. Tenant separation inside tierd rests on the namespace id being part of the
  key bytes (it hashes the model, layout, world and cache salt), never on Mooncake.
- Mooncake keys are strings. Raw key bytes are not valid UTF-8 in general, so a name is plain
  lowercase hex under a prefix: ``<prefix>/v2/<hex>``. Names of one namespace share a hex prefix,
  so an operator can select them with the master's regex removal. Mooncake 0.3.13 took names of
  10,000 characters and any printable characters; tierd's are under 200.
- ``v2`` is the encoding's version: a change to :func:`chunk_key`, :func:`object_name` or to the
  bytes of an object (tierd.planner.OBJECT_LAYOUT_VERSION) must bump it, or nodes of two versions
  would read each other's bytes under another meaning. v2: block-major groups' objects are laid
  out block by block.
"""

from __future__ import annotations

VERSION = "v2"
NAMESPACE_BYTES = 16  # tierd.protocol.keys.namespace_id digest size
MAX_KEY_BYTES = 96


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
    """``<prefix>/v2/<hex of key>``: the string Mooncake stores ``key`` under."""
    if not isinstance(key, (bytes, bytearray, memoryview)) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"l2 key must be 1-{MAX_KEY_BYTES} bytes")
    return f"{prefix}/{VERSION}/{bytes(key).hex()}"


def key_of(name: str, prefix: str) -> bytes:
    """Inverse of :func:`object_name` (for operators' tools and tests)."""
    head = f"{prefix}/{VERSION}/"
    if not name.startswith(head):
        raise ValueError(f"{name!r} is not a tierd {VERSION} object name under {prefix!r}")
    return bytes.fromhex(name[len(head) :])
