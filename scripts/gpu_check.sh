#!/usr/bin/env bash
# On a CUDA machine: build the native kernels, run the gpu-marked tests, and benchmark the
# Llama-3-8B-like and the MLA layouts through a real daemon (this shell's python is the engine).
# Logs and JSON go to $OUT (default ./gpu-out). Steps are time-boxed so the whole stays < 10 min.
#   BENCH_CHUNKS (128) BENCH_BATCH (16) BENCH_ROUNDS (3) BENCHES ("mha mla") BENCH_TAG (file suffix)
#   TESTS (the gpu test files; "none" skips them)
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
CHUNKS=${BENCH_CHUNKS:-128} BATCH=${BENCH_BATCH:-16} ROUNDS=${BENCH_ROUNDS:-3}
{
  date -u; nvidia-smi; nvcc --version | tail -2; python3 -V
  python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
p = torch.cuda.get_device_properties(0)
print(p.name, "sm", p.multi_processor_count, "uuid", p.uuid, "sleep", hasattr(torch.cuda, "_sleep"))
PY
} > "$OUT/env.txt" 2>&1

echo "== build" | tee "$OUT/build.log"
timeout 300 python3 - >> "$OUT/build.log" 2>&1 <<'PY'
import time
t = time.time()
from tierd.transfer import native
m = native.load()
print(native.state(), f"{time.time() - t:.1f} s", native.cache_dir())
PY
tail -3 "$OUT/build.log"

if [ "${TESTS:-}" != none ]; then
  echo "== tests"
  timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -rs -s -p no:cacheprovider --basetemp=/tmp/pt \
    ${TESTS:-tests/test_gpu_kernels.py tests/test_gpu_daemon.py tests/test_store_event.py tests/test_roundtrip.py} \
    > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu_tests.log"
  tail -5 "$OUT/gpu_tests.log"
  for f in $(ls -t /tmp/pt/*/*/daemon.log 2>/dev/null | head -40); do echo "== $f"; tail -40 "$f"; done > "$OUT/daemons.log" 2>&1
fi

echo "== bench ${BENCH_TAG:-}" | tee -a "$OUT/bench.log"
# BENCHES: mha, mla, and mha-torch / mla-torch (the daemon copies with the pure-torch fallback)
for kind in ${BENCHES:-mha mla}; do
  args="--chunks $CHUNKS --batch $BATCH --rounds $ROUNDS"
  case $kind in mla*) args="$args --mla --layers 61";; esac
  case $kind in *-torch) impl=torch;; *) impl=auto;; esac
  echo "== TIERD_CUDA_IMPL=$impl tierd bench --device cuda --json $args" >> "$OUT/bench.log"
  TIERD_CUDA_IMPL=$impl timeout ${BENCH_TIMEOUT:-150} python3 -m tierd bench --device cuda --json $args \
    > "$OUT/bench_$kind${BENCH_TAG:-}.json" 2>> "$OUT/bench.log"
  echo "exit $?" >> "$OUT/bench.log"
  python3 -c "import json,sys; from tierd.report import bench_table; print(bench_table(json.load(open(sys.argv[1]))))" \
    "$OUT/bench_$kind${BENCH_TAG:-}.json" >> "$OUT/bench.log" 2>&1
done
tail -n 60 "$OUT/bench.log"
