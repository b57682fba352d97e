"""Building page layouts (REGISTER payloads) from tensor geometry, never from assumptions.

``block_span`` turns "dimension ``block_dim`` of this strided tensor indexes blocks" into the
daemon's ``{offset, block_stride, runs, run_stride, run_bytes}`` description, so any layout
whose block is at most two strided levels (contiguous runs repeated at one stride) registers:
every vLLM 0.33 KVCacheLayout (LBNHC, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC) per-layer view, MLA,
mamba state blocks and kernel blocks smaller than manager blocks. Three levels (say a head-outer
layout whose token rows are padded) raise UnsupportedLayout.

The builders return plain maps of the wire's fields (tests and tools edit them); REGISTER sends
the typed ``tierd.protocol.layout.PageLayout`` they convert into (``PageLayout.from_wire``, which
TierdClient.register does for a map: a field the daemon does not know is refused there).
"""

from __future__ import annotations

from collections.abc import Sequence


class UnsupportedLayout(ValueError):
    pass


def block_span(
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    block_dim: int,
    *,
    tensor: int,
    offset: int,
    blocks_per_block: int = 1,
) -> dict:
    """Describe where block ``b`` of a strided tensor lives, in bytes.

    ``strides`` are in elements (torch/numpy convention divided by itemsize). With
    ``blocks_per_block = r > 1`` the tensor's ``block_dim`` counts *kernel* blocks and a
    manager block is ``r`` consecutive kernel blocks.
    """
    shape, strides = list(shape), [s * itemsize for s in strides]
    nblk, bstride = shape.pop(block_dim), strides.pop(block_dim)
    r = blocks_per_block
    if r > 1:
        if nblk % r:
            raise UnsupportedLayout(f"{nblk} kernel blocks is not a multiple of {r} kernel blocks per block")
        shape.insert(0, r)
        strides.insert(0, bstride)
        nblk, bstride = nblk // r, bstride * r
    # drop size-1 dims, order the rest as memory does (sorted by stride, outermost first: the
    # logical order of a permuted view is not its physical order), then coalesce from the
    # innermost dimension outwards. Object bytes follow that physical order.
    dims = sorted(((n, s) for n, s in zip(shape, strides) if n != 1), key=lambda d: -d[1])
    run = itemsize
    while dims and dims[-1][1] == run:
        n, _ = dims.pop()
        run *= n
    outer: list[list[int]] = []
    for n, s in dims:
        if outer and outer[-1][1] == n * s:
            outer[-1] = [outer[-1][0] * n, s]
        else:
            outer.append([n, s])
    if len(outer) > 1:
        raise UnsupportedLayout(
            f"a block spans {len(outer)} strided levels {outer} plus a run of {run} bytes"
        )
    runs, run_stride = (outer[0][0], outer[0][1]) if outer else (1, 0)
    return {
        "tensor": tensor,
        "offset": offset,
        "block_stride": bstride,
        "num_blocks": nblk,
        "runs": runs,
        "run_stride": run_stride,
        "run_bytes": run,
    }


def namespace(model: str, fingerprint: str, world_size: int = 1, salt: str = "") -> dict:
    return {"model": model, "fingerprint": fingerprint, "world_size": world_size, "salt": salt}


def group(
    kind: str, block_tokens: int, layers: list[dict], *, window_tokens: int = 0, dtype: str = ""
) -> dict:
    return {
        "kind": kind,
        "block_tokens": block_tokens,
        "window_tokens": window_tokens,
        "dtype": dtype,
        "layers": layers,
    }


def layout(
    ns: dict,
    rank: int,
    chunk_tokens: int,
    tensors: list[dict],
    groups: list[dict],
    *,
    device: str = "cpu",
    replicated: bool = False,
) -> dict:
    return {
        "namespace": ns,
        "rank": rank,
        "replicated": replicated,
        "chunk_tokens": chunk_tokens,
        "device": device,
        "tensors": tensors,
        "groups": groups,
    }


def group_specs(layout_: dict) -> list[dict]:
    """The per-group part of a layout that LOOKUP needs."""
    return [
        {"kind": g["kind"], "block_tokens": g["block_tokens"], "window_tokens": g.get("window_tokens", 0)}
        for g in layout_["groups"]
    ]
