#!/usr/bin/env bash
# On a CUDA machine (an H200 host): install the carried wheels, build the engine-side
# native kernels, run the gpu-marked tests, and benchmark through a real daemon (this shell's
# python is the engine). Logs and JSON go to $OUT (default ./gpu-out); steps are time-boxed.
#   TESTS   gpu test files ("none" skips them)     BENCHES  layouts: llama 8k 16k mla (see below), each
#           optionally NAME:KV_LAYOUT[:PATH], e.g. 8k:BLNHC:direct (--kv-layout, --path of `tierd bench`)
#   INTERFERENCE=1  also run the interference bench (INTERFERENCE_RUNS: its variants, e.g.
#           "staged staged:16 BLNHC:direct BLNHC:direct:16": KV_LAYOUT/PATH and --step-burst)
#   BENCH_ARGS  extra `tierd bench` arguments
#   RANKS  rank-process benches: "2" (2 ranks), "2mla" (2 replicated MLA ranks)
# Every bench's figures are summed up at the end: ratios to the same run's raw copies, one-chunk and
# 16-chunk latencies against their goals, and where a one-chunk request's time goes.
# Every step runs even after one fails (their logs are the evidence); a failed step's figures are
# not summed up, and the script ends with the failed steps named and exit status 1.
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
failed=()
check() {  # step name, its exit status: a non-zero one is remembered for the end
  if [ "$2" != 0 ]; then failed+=("$1 (exit $2)"); echo "== FAILED: $1 (exit $2)"; fi
}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p /tmp/alias && ln -sfn "$PWD/client" /tmp/alias/tierd_client   # the package-dir mapping of pyproject
export PYTHONPATH=/tmp/alias:$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  nvcc --version | tail -2; python3 -V
  python3 -c "import torch, zmq, msgspec; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'zmq', zmq.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== build"
timeout 300 python3 -c "
import time; t = time.time()
from tierd_client import native
native.load(); print(native.state(), f'{time.time() - t:.1f} s')" 2>&1 | tail -3
check build "${PIPESTATUS[0]}"

if [ "${TESTS:-}" != none ]; then
  echo "== tests"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/pt -o addopts="" \
    ${TESTS:-tests/unit/test_gpu_kernels.py tests/daemon/test_gpu_daemon.py tests/daemon/test_gpu_direct.py} > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  echo "pytest exit $rc" >> "$OUT/gpu_tests.log"
  check tests "$rc"
  grep -E "passed|failed|error|Error|assert" "$OUT/gpu_tests.log" | tail -25
  for f in $(ls -t /tmp/pt/*/*/daemon.log 2>/dev/null | head -20); do echo "== $f"; tail -30 "$f"; done > "$OUT/daemons.log" 2>&1
fi

bench() {  # name, args...
  local name=$1; shift
  echo "== tierd bench --device cuda --json $* ${BENCH_ARGS:-}" >> "$OUT/bench.log"
  timeout ${BENCH_TIMEOUT:-120} python3 -m tierd bench --device cuda --json --quiet "$@" ${BENCH_ARGS:-} \
    > "$OUT/bench_$name.json" 2>> "$OUT/bench.log"
  local rc=$?
  echo "exit $rc" >> "$OUT/bench.log"
  if [ "$rc" != 0 ]; then  # whatever it wrote is no figure: kept for reading, left out of the summary
    mv "$OUT/bench_$name.json" "$OUT/bench_$name.json.failed"
    check "bench $name" "$rc"
    return
  fi
  python3 -c "import json,sys; from tierd.tools.report import bench_table; print(bench_table(json.load(open(sys.argv[1]))))" \
    "$OUT/bench_$name.json" >> "$OUT/bench.log" 2>&1
}
variant() {  # LAYOUT[:PATH[:BURST]] -> bench arguments
  local IFS=:; set -- $1
  [ -n "${1:-}" ] && [ "$1" != staged ] && [ "$1" != direct ] && echo -n " --kv-layout $1" && shift
  [ -n "${1:-}" ] && echo -n " --path $1"
  [ -n "${2:-}" ] && echo -n " --step-burst $2"
}
for spec in ${BENCHES:-llama 8k 16k mla}; do
  kind=${spec%%:*}; rest=${spec#"$kind"}; rest=${rest#:}; tag=$(echo "$spec" | tr ':' '_')
  case $kind in
    llama) bench "$tag" $(variant "$rest") ;;                                   # 32 layers x 64 KiB (8 KV heads, 128, bf16)
    8k) bench "$tag" --layers 80 --kv-heads 1 $(variant "$rest") ;;            # 70B-class at TP8: 80 layers x 8 KiB
    16k) bench "$tag" --layers 48 --kv-heads 2 $(variant "$rest") ;;           # 48 layers x 16 KiB
    mla) bench "$tag" --mla --layers 61 $(variant "$rest") ;;                  # 61 layers x 18 KiB
  esac
done
if [ "${INTERFERENCE:-0}" = 1 ]; then
  for v in ${INTERFERENCE_RUNS:-staged}; do bench "interference_$(echo "$v" | tr ':' '_')" --interference $(variant "$v"); done
fi
for r in ${RANKS:-}; do                                          # e.g. RANKS="2 2mla": N rank processes at once
  case $r in
    *mla) bench "ranks${r}" --ranks "${r%mla}" --mla --layers 61 ;;
    *) bench "ranks$r" --ranks "$r" ;;
  esac
done
grep -v "^==" "$OUT/bench.log" | grep -v "^exit 0" | grep -i -E "error|exit|Traceback" | tail -n 20
shopt -s nullglob
jsons=("$OUT"/bench_*.json)  # the benches that exited 0
shopt -u nullglob
python3 - "${jsons[@]}" <<'PY'
import json, sys
failed = False
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except (OSError, ValueError) as exc:
        print(f"{path}: no figures ({exc})")
        failed = True
        continue
    name = path.rsplit("/", 1)[-1][6:-5]
    if r.get("bench") == "ranks":
        print(f"{name}: ranks {r['ranks']}: to raw {r['ratio_to_raw']}, to one rank {r['ratio_to_one_rank']}, verified {r['verified']}")
        continue
    head = f"{name}: {r['block_bytes'] >> 10} KiB x {r['layers']} layers, {r.get('kv_layout', '')[:5]} {r.get('path', 'staged')}"
    if r.get("interference"):
        for step, row in r["interference"].items():
            share = row['tierd_copy_gbps'] / row['raw_dma_copy_gbps'] if row['raw_dma_copy_gbps'] else 0
            print(f"{head} burst {r.get('interference_step_burst', 0)}: {step} alone {row['alone_ms']} ms, tierd "
                  f"{row['tierd_slowdown']}x at {row['tierd_copy_gbps']} GB/s, raw DMA {row['raw_dma_slowdown']}x at "
                  f"{row['raw_dma_copy_gbps']} GB/s (tierd's rate {share:.2f} of raw DMA's; goal <= 1.03x at >= 0.9)")
        continue
    print(f"{head}: store {r['store_ratio']} retrieve {r['retrieve_ratio']} both {r['both_ratio']} of raw "
          f"(raw D2H {r['baseline_d2h_gbps']} H2D {r['baseline_h2d_gbps']} both {r['baseline_both_gbps']} GB/s) verified {r['verified']}")
    for n in ("1_chunks", "16_chunks"):
        lat = (r.get("latency_ms") or {}).get(n)
        if lat:
            ok = lambda a, b: "ok" if lat[a] <= lat[b] else "over"  # noqa: E731
            print(f"   {n}: store {lat['store']} ms (raw {lat['raw_d2h']}, goal {lat['store_goal']}: {ok('store', 'store_goal')}), "
                  f"retrieve {lat['retrieve']} ms (raw {lat['raw_h2d']}, goal {lat['retrieve_goal']}: {ok('retrieve', 'retrieve_goal')})")
    for op, row in (r.get("daemon_stages_ms") or {}).items():
        print(f"   daemon stages of a timed round's {op}, ms per request: " + "; ".join(f"{k} {v}" for k, v in row.items()))
    lat = (r.get("latency_ms") or {}).get("1_chunks") or {}
    for op, row in (lat.get("breakdown") or {}).items():
        print(f"   1 chunk {op}: " + "; ".join(f"{k} {v}" for k, v in row.items()))
    if r.get("wire_floor_ms"):
        print(f"   round trips that copy nothing: {r['wire_floor_ms']}")
sys.exit(1 if failed else 0)
PY
check summary $?
if [ ${#failed[@]} != 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
