#!/usr/bin/env bash
# On a CUDA machine (the `device` tool's H200): install the carried wheels, build the engine-side
# native kernels, run the gpu-marked tests, and benchmark through a real daemon (this shell's
# python is the engine). Logs and JSON go to $OUT (default ./gpu-out); steps are time-boxed.
#   TESTS   gpu test files ("none" skips them)     BENCHES  layouts: llama 8k 16k mla (see below)
#   INTERFERENCE=1  also run the interference bench  BENCH_ARGS  extra `tierd bench` arguments
#   RANKS  rank-process benches: "2" (2 ranks), "2mla" (2 replicated MLA ranks)
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
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

if [ "${TESTS:-}" != none ]; then
  echo "== tests"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rs -p no:cacheprovider --basetemp=/tmp/pt -o addopts="" \
    ${TESTS:-tests/test_gpu_kernels.py tests/test_gpu_daemon.py} > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu_tests.log"
  grep -E "passed|failed|error|Error|assert" "$OUT/gpu_tests.log" | tail -25
  for f in $(ls -t /tmp/pt/*/*/daemon.log 2>/dev/null | head -20); do echo "== $f"; tail -30 "$f"; done > "$OUT/daemons.log" 2>&1
fi

bench() {  # name, args...
  local name=$1; shift
  echo "== tierd bench --device cuda --json $* ${BENCH_ARGS:-}" >> "$OUT/bench.log"
  timeout ${BENCH_TIMEOUT:-120} python3 -m tierd bench --device cuda --json --quiet "$@" ${BENCH_ARGS:-} \
    > "$OUT/bench_$name.json" 2>> "$OUT/bench.log"
  echo "exit $?" >> "$OUT/bench.log"
  python3 -c "import json,sys; from tierd.report import bench_table; print(bench_table(json.load(open(sys.argv[1]))))" \
    "$OUT/bench_$name.json" >> "$OUT/bench.log" 2>&1
}
for kind in ${BENCHES:-llama 8k 16k mla}; do
  case $kind in
    llama) bench llama ;;                                        # 32 layers x 64 KiB (8 KV heads, 128, bf16)
    8k) bench 8k --layers 80 --kv-heads 1 ;;                     # 70B-class at TP8: 80 layers x 8 KiB
    16k) bench 16k --layers 48 --kv-heads 2 ;;                   # 48 layers x 16 KiB
    mla) bench mla --mla --layers 61 ;;                          # 61 layers x 18 KiB
  esac
done
if [ "${INTERFERENCE:-0}" = 1 ]; then bench interference --interference; fi
for r in ${RANKS:-}; do                                          # e.g. RANKS="2 2mla": N rank processes at once
  case $r in
    *mla) bench "ranks${r}" --ranks "${r%mla}" --mla --layers 61 ;;
    *) bench "ranks$r" --ranks "$r" ;;
  esac
done
cat "$OUT/bench.log" | grep -v "^==" | tail -n 80
