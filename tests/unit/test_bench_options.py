"""``tierd bench``'s options are one record: the command line takes its defaults from it, and the
layout's sizes are derived from it once for the CPU, CUDA and multi-rank benches alike."""

from dataclasses import fields

from tierd.tools.bench.options import DEFAULTS, BenchOptions
from tierd.tools.cli import bench


def test_every_bench_option_is_a_field_of_the_record_with_its_default():
    params = {p.name: p for p in bench.params if p.name not in ("as_json", "quiet")}
    assert set(params) == {f.name for f in fields(BenchOptions)}
    for name, param in params.items():
        assert param.default == getattr(DEFAULTS, name), name


def test_block_and_chunk_sizes_follow_the_layout():
    mha = BenchOptions(layers=32, kv_heads=8, head_dim=128, block_tokens=16, chunk_tokens=256)
    assert (mha.heads, mha.row_bytes, mha.block_bytes) == (8, 512, 65536)  # 64 KiB per block
    assert (mha.blocks_per_chunk, mha.object_bytes) == (16, 32 * 16 * 65536)
    mla = BenchOptions(layers=61, mla=True, kv_heads=8)  # MLA: one 576-element latent per token
    assert (mla.heads, mla.row_bytes, mla.block_bytes) == (1, 1152, 18432)
    assert mla.object_bytes == 61 * 16 * 18432
    fp32 = BenchOptions(layers=80, kv_heads=1, dtype_bytes=4)
    assert fp32.block_bytes == 16 * 1 * 2 * 128 * 4
