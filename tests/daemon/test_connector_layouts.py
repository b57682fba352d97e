"""The connector reads every KV layout from vLLM's own tensors (never a hard-coded shape): for each
of vLLM's KVCacheLayouts, built by vLLM's ``create_kv_cache_views`` over one int8 buffer (also
with kernel blocks smaller than manager blocks), and for MLA and mamba state pages, a worker
registers the views, stores chunks, and a second worker restores them byte for byte."""

from __future__ import annotations

import uuid

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm_sim import make_vllm_config  # noqa: E402

from tierd.protocol.layout import PageLayout  # noqa: E402
from tierd_client.vllm_connector import TierdConnector  # noqa: E402
from tierd_client.vllm_connector.metadata import ChunkIO, LoadOrder, StoreOrder, TierdMetadata  # noqa: E402

NUM_BLOCKS, LAYERS, BLOCK, CHUNK = 24, 3, 16, 32


def views(layout: KVCacheLayout, spec, names, kernel_block_size=None):
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, len(names), layout)
    size = spec.page_size_bytes * NUM_BLOCKS * len(names)
    raw = torch.zeros(size, dtype=torch.int8)
    kvt = KVCacheTensor(size=size, layers=list(names), layer_stride=layer_stride, block_stride=block_stride)
    return raw, dict(zip(names, create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, kvt, kernel_block_size)))


def worker(model, url, spec, names):
    vc = make_vllm_config(model, url, BLOCK, CHUNK, mamba=isinstance(spec, MambaSpec))
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(names), spec)]
    )
    return TierdConnector(vc, KVConnectorRole.WORKER, kcc)


def manager_block(view: torch.Tensor, b: int) -> torch.Tensor:
    ratio = view.shape[0] // NUM_BLOCKS
    return view[b * ratio : (b + 1) * ratio].contiguous().view(torch.uint8)  # bytes: random bits hold NaNs


def round_trip(model, url, spec, layout, kernel_block_size=None):
    names = [f"layer.{i}" for i in range(LAYERS)]
    try:
        raw_a, kv_a = views(layout, spec, names, kernel_block_size)
    except ValueError as exc:  # vLLM itself refuses this combination
        pytest.skip(str(exc))
    raw_b, kv_b = views(layout, spec, names, kernel_block_size)
    raw_a.copy_(torch.randint(-128, 127, raw_a.shape, dtype=torch.int8))
    a, b = worker(model, url, spec, names), worker(model, url, spec, names)
    try:
        a.register_kv_caches(kv_a)
        b.register_kv_caches(kv_b)
        # a block's layers in one span (block-outermost, one kernel block per manager block): its
        # objects are laid out block by block, one contiguous copy per block (GroupLayout.block_major)
        outer = (
            layout.name.startswith("BL") and kernel_block_size is None and isinstance(spec, FullAttentionSpec)
        )
        assert PageLayout.from_wire(a.worker.reg.layout).groups[0].block_major is outer
        bpc = 1 if isinstance(spec, MambaSpec) else CHUNK // BLOCK
        keys = [uuid.uuid4().bytes for _ in range(3)]
        src = [[1 + c * bpc + i for i in range(bpc)] for c in range(3)]
        dst = [[12 + c * bpc + i for i in range(bpc)] for c in range(3)]
        a.bind_connector_metadata(
            TierdMetadata(stores=[StoreOrder("r", [ChunkIO(k, [ids]) for k, ids in zip(keys, src)], [])])
        )
        a.wait_for_save()
        a.clear_connector_metadata()
        a.worker.flush()
        b.bind_connector_metadata(
            TierdMetadata(loads=[LoadOrder("r", 0, [ChunkIO(k, [ids]) for k, ids in zip(keys, dst)])])
        )
        b.start_load_kv(None)
        b.worker.loads["r"][0].result(10)
        finished, failed = b.worker.transfer_results()
        assert finished == {"r"} and not failed
        for name in names:
            for s_ids, d_ids in zip(src, dst):
                for s, d in zip(s_ids, d_ids):
                    assert torch.equal(manager_block(kv_b[name], d), manager_block(kv_a[name], s)), (
                        name,
                        s,
                        d,
                    )
        untouched = [x for x in range(NUM_BLOCKS) if x not in {i for ids in dst for i in ids}]
        assert all(not manager_block(kv_b[n], x).any() for n in names for x in untouched)
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda l: l.name)
def test_attention_views_of_every_layout_round_trip(tiny_model, daemon, layout):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    round_trip(tiny_model, daemon.endpoint, spec, layout)


@pytest.mark.parametrize(
    "layout", [KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC], ids=lambda l: l.name
)
def test_kernel_blocks_smaller_than_manager_blocks_round_trip(tiny_model, daemon, layout):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    round_trip(tiny_model, daemon.endpoint, spec, layout, kernel_block_size=BLOCK // 4)


def test_mla_latent_pages_round_trip(tiny_model, daemon):
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    round_trip(tiny_model, daemon.endpoint, spec, KVCacheLayout.LBHNC)


def test_mamba_state_pages_round_trip(tiny_model, daemon):
    spec = MambaSpec(
        block_size=CHUNK,
        shapes=((3, 40), (5,)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    round_trip(tiny_model, daemon.endpoint, spec, KVCacheLayout.LBHNC)


def _geometry(model, layout: str | None):
    from tierd_client.vllm_connector.geometry import build_geometry

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    kcc.kv_cache_layout = layout
    return build_geometry(make_vllm_config(model, "ipc:///unused", BLOCK, CHUNK), kcc, CHUNK)


def test_engines_whose_blocks_order_their_bytes_differently_never_share_a_namespace(tiny_model):
    """Same model, dtype, groups and block bytes; only the order inside a block differs (tokens
    then heads, or heads then tokens): a page one stored would restore scrambled into the other."""
    nhd, hnd = _geometry(tiny_model, "LBNHC"), _geometry(tiny_model, "LBHNC")
    assert nhd.fingerprint != hnd.fingerprint
    assert _geometry(tiny_model, "LBNHC").fingerprint == nhd.fingerprint  # deterministic per layout
