#!/usr/bin/env bash
# A real vLLM engine on a GPU machine judges the tier, in one go (benchmarks/gpu_engine.py): exactness
# per model family and copy path with its negative control, the warm-restore stage breakdown and the
# cold cost; alongside the exactness passes, TierdConnector's worker-path tests (what
# scripts/gpu_connector.sh runs: vLLM's real Scheduler over CUDA KV tensors, both fences with their
# negative controls) and the GPU kernel and daemon tests, the direct path's included. The tables are
# printed; $OUT gets summary.json and engine-logs.tgz.
# Needs .whl/ as scripts/gpu_vllm_setup.sh says. Knobs (environment):
#   ENGINE_ARGS  extra benchmarks/gpu_engine.py arguments (e.g. "--shapes llama1b --sizes 8192 --n 3")
#   TESTS        test files instead of the connector's, kernels' and daemon's ("none": no tests)
#   LIMIT        seconds for the harness (default 420); TEST_LIMIT for the tests (default 360)
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
# vLLM's CPU-platform package, unpatched, for the connector's worker-path tests (their engine is
# vLLM's Scheduler with a simulated forward); the patched one for the real engine
( mkdir -p /tmp/sitecpu && tar xJf .whl/vllm_pylib.tar.xz -C /tmp/sitecpu ) &
cpu_pkg=$!
. scripts/gpu_vllm_setup.sh > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"
say setup
# the native gather/scatter kernels (staged path) build into the cache every process reads; until
# they are there a staged rank copies with the pure-torch fallback (the same bytes)
( timeout 240 python3 -c "
import time; t = time.time()
from tierd_client import native
native.load(); print('native kernels', native.state()['state'], f'{time.time() - t:.1f} s')" > "$OUT/build.log" 2>&1 ) &
wait $cpu_pkg
if [ "${TESTS:-}" != none ]; then
  ( PYTHONPATH=/tmp/alias:$PWD:/tmp/sitecpu:/tmp/site VLLM_TARGET_DEVICE=cpu timeout -s INT -k 20 "${TEST_LIMIT:-360}" \
      python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --basetemp=/tmp/pt -o addopts="" \
      ${TESTS:-tests/e2e/test_gpu_connector.py tests/unit/test_gpu_kernels.py tests/daemon/test_gpu_daemon.py \
        tests/daemon/test_gpu_direct.py} \
      > "$OUT/tests.log" 2>&1; echo "pytest exit $?" >> "$OUT/tests.log" ) &
  tests=$!
fi
# the exactness passes run beside the tests; the timing passes wait for them (--wait-for)
timeout "${LIMIT:-420}" python3 benchmarks/gpu_engine.py --out "$OUT/engine" --wait-pid "${tests:-0}" \
  ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log"
say "harness exit ${PIPESTATUS[0]}"
tail -1 "$OUT/build.log"
[ -n "${tests:-}" ] && { wait $tests; say tests; grep -E "passed|failed|error|FAILED|ERROR|^E |SKIP|^(writer|reader) " "$OUT/tests.log" | tail -30; }
# what it leaves in $OUT: summary.json (every table's figures) and one archive of the rest (this
# script's logs, every pass's log and JSON, the tests' folders)
mv "$OUT/engine/summary.json" "$OUT/summary.json" 2>/dev/null
say done
tar czf "$OUT/engine-logs.tgz" -C "$OUT" env.txt setup.log build.log engine.log tests.log engine/runs \
  -C / tmp/pt 2>/dev/null
rm -rf "$OUT/engine" "$OUT"/{env.txt,setup.log,build.log,engine.log,tests.log}
