"""``tierd bench``: a synthetic multi-layer KV layout stored and retrieved through the real
protocol and a real daemon, every byte verified, next to same-run baselines (CPU: memcpy;
CUDA: raw pinned cudaMemcpyAsync). The bench's own objects are removed from the daemon after."""

from __future__ import annotations

from tierd.tools.bench.common import BenchError, Progress

__all__ = ["BenchError", "run_bench"]


def run_bench(
    *,
    socket,
    device,
    layers,
    kv_heads,
    head_dim,
    block_tokens,
    chunk_tokens,
    dtype_bytes,
    mla,
    chunks,
    batch,
    rounds,
    pool_gb,
    progress: bool,
    interference: bool = False,
    staging_mb: int = 1024,
    impl: str = "auto",
    ranks: int = 1,
    seconds: float = 2.0,
    ctas: int = 0,
    gpu_order: str = "host",
    step_burst: int = 0,
    kv_layout: str = "LBNHC",
    path: str = "staged",
    runs: int = 1,
) -> dict:
    if chunk_tokens % block_tokens:
        raise BenchError(f"--chunk-tokens {chunk_tokens} is not a multiple of --block-tokens {block_tokens}")
    if runs != 1 and (device != "cpu" or ranks > 1):
        raise BenchError("--runs lays out the one-rank CPU bench (--device cpu, no --ranks)")
    if ranks < 1 or seconds <= 0:
        raise BenchError(f"--ranks {ranks} --seconds {seconds:g}: need at least 1 rank and a positive window")
    kw = dict(
        socket=socket,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_tokens=block_tokens,
        chunk_tokens=chunk_tokens,
        dtype_bytes=dtype_bytes,
        mla=mla,
        chunks=chunks,
        batch=batch,
        rounds=rounds,
        pool_gb=pool_gb,
        progress=Progress(progress),
    )
    if device == "cuda":
        try:
            import torch
        except ImportError:
            raise BenchError(
                "--device cuda needs PyTorch with CUDA (pip install 'tierd[gpu]' with the torch build "
                "that matches your driver)"
            ) from None
        if not torch.cuda.is_available():
            raise BenchError(
                f"--device cuda needs a CUDA GPU visible to this process (torch {torch.__version__} "
                "sees none)"
            )
    if ranks > 1:
        if interference:
            raise BenchError("--interference runs with one rank (leave --ranks out)")
        from tierd.tools.bench.ranks import run_ranks_bench

        kw.pop("rounds")
        return run_ranks_bench(**kw, device=device, ranks=ranks, seconds=seconds, gpu_order=gpu_order)
    if device == "cuda":
        from tierd.tools.bench.cuda import run_cuda_bench

        return run_cuda_bench(
            **kw,
            interference=interference,
            staging_mb=staging_mb,
            impl=impl,
            ctas=ctas,
            gpu_order=gpu_order,
            step_burst=step_burst,
            kv_layout=kv_layout,
            path=path,
        )
    if interference:
        raise BenchError("--interference measures GPU steps: it needs --device cuda")
    from tierd.tools.bench.cpu import run_cpu_bench

    return run_cpu_bench(**kw, runs=runs)
