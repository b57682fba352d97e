"""PAGE hashes of a vLLM request's chunks (no vLLM import: the derivation reads plain attributes).

Chained blake2b over the token ids (``tierd.protocol.keys``), rooted in what makes a prefix
distinct as a whole (cache salt, LoRA adapter name) and mixing in, per chunk, the identifiers
of multimodal items whose placeholder tokens fall in it. Nothing depends on PYTHONHASHSEED or
on vLLM's own block hashes (whose seed is random per process unless PYTHONHASHSEED is set).
"""

from __future__ import annotations

from tierd.protocol.keys import chunk_hashes, root_hash


def extend_keys(request, keys: list[bytes], upto_chunks: int, chunk_tokens: int) -> None:
    """Append to ``keys`` (the request's chunk keys so far) up to ``upto_chunks`` keys."""
    if len(keys) >= upto_chunks:
        return
    start = len(keys)
    parent = keys[-1] if keys else _root(request)
    tokens = request.all_token_ids[start * chunk_tokens : upto_chunks * chunk_tokens]
    extras = _mm_extras(request, start, upto_chunks, chunk_tokens)
    keys.extend(chunk_hashes(tokens, chunk_tokens, parent=parent, chunk_extras=extras))


def unkeyable(request) -> bool:
    """Requests keyed by embeddings instead of token ids cannot be named by PAGE hashes."""
    return (
        getattr(request, "prompt_embeds", None) is not None
        or getattr(request, "prompt_token_ids", []) is None
    )


def _root(request) -> bytes:
    lora = getattr(request, "lora_request", None)
    return root_hash(getattr(request, "cache_salt", None), getattr(lora, "lora_name", None) if lora else None)


def _mm_extras(request, start: int, end: int, chunk_tokens: int) -> list | None:
    """Per chunk, the identifiers of multimodal items whose placeholders overlap it."""
    feats = getattr(request, "mm_features", None) or []
    if not feats:
        return None
    out = []
    for j in range(start, end):
        lo, hi = j * chunk_tokens, (j + 1) * chunk_tokens
        ids = [
            f.identifier
            for f in feats
            if f.mm_position.offset < hi and f.mm_position.offset + f.mm_position.length > lo
        ]
        out.append(ids or None)
    return out
