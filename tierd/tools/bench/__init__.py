"""``tierd bench``: a synthetic multi-layer KV layout stored and retrieved through the real
protocol and a real daemon, every byte verified, next to same-run baselines (CPU: memcpy;
CUDA: raw pinned cudaMemcpyAsync). The bench's own objects are removed from the daemon after."""

from __future__ import annotations

from tierd.tools.bench.common import BenchError, Progress
from tierd.tools.bench.cpu import run_cpu_bench
from tierd.tools.bench.cuda import run_cuda_bench
from tierd.tools.bench.options import BenchOptions
from tierd.tools.bench.ranks import run_ranks_bench

__all__ = ["BenchError", "BenchOptions", "run_bench"]


def run_bench(opts: BenchOptions, progress: bool) -> dict:
    """Run the bench ``opts`` describe (one rank on CPU or CUDA, or ``opts.ranks`` rank processes)."""
    if opts.chunk_tokens % opts.block_tokens:
        raise BenchError(
            f"--chunk-tokens {opts.chunk_tokens} is not a multiple of --block-tokens {opts.block_tokens}"
        )
    if opts.runs != 1 and (opts.device != "cpu" or opts.ranks > 1):
        raise BenchError("--runs lays out the one-rank CPU bench (--device cpu, no --ranks)")
    if opts.ranks < 1 or opts.seconds <= 0:
        raise BenchError(
            f"--ranks {opts.ranks} --seconds {opts.seconds:g}: need at least 1 rank and a positive window"
        )
    bar = Progress(progress)
    if opts.device == "cuda":
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
    if opts.ranks > 1:
        if opts.interference:
            raise BenchError("--interference runs with one rank (leave --ranks out)")
        return run_ranks_bench(opts, bar)
    if opts.device == "cuda":
        return run_cuda_bench(opts, bar)
    if opts.interference:
        raise BenchError("--interference measures GPU steps: it needs --device cuda")
    return run_cpu_bench(opts, bar)
