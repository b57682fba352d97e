#!/usr/bin/env bash
# Serving on a GPU machine, in one go: vLLM's OpenAI server on the GPU (the engine set-up of
# scripts/gpu_vllm_setup.sh) with no connector, the do-nothing connector and TierdConnector cold and
# warm, driven by vLLM's own `vllm bench serve` (benchmarks/serve.py --device cuda), then the faults
# (a daemon SIGKILLed and restarted mid-run). The table is printed; $OUT gets serve.json and
# serve-logs.tgz.
# Needs .whl/ as scripts/gpu_vllm_setup.sh says. Knobs (environment):
#   SERVE_ARGS  benchmarks/serve.py arguments (default below: the 1B shape, 8k-token prefixes)
#               (--workloads trace --trace FILE: a Mooncake-format trace the machine has)
#   LIMIT       seconds for the benchmark (default 540)
set -u -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
. scripts/gpu_vllm_setup.sh > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"
echo "== setup ($(( $(date +%s) - t0 )) s)"
timeout -k 45 "${LIMIT:-540}" python3 benchmarks/serve.py --device cuda --workdir /tmp/serve-work --json "$OUT/serve.json" \
  ${SERVE_ARGS:---shape llama1b --phases none,nothing,cold,warm --workloads prefix --concurrency 1,8,32 --prompts 64 --prefix-len 8192 --suffix-len 128 --output-len 64 --max-model-len 16384 --pool-gb 32 --faults kill} \
  2>&1 | tee "$OUT/serve.log"
rc=${PIPESTATUS[0]}
echo "== serve.py exit $rc ($(( $(date +%s) - t0 )) s)"
# what it leaves in $OUT: serve.json and one archive of the logs and the client's results (not
# their bulk, nor the models)
kept=$(cd /tmp/serve-work 2>/dev/null && find . -maxdepth 2 -not -path './models/*' \( -name '*.log' -o -name '*.json' \) -size -1024k)
tar czf "$OUT/serve-logs.tgz" -C "$OUT" env.txt setup.log serve.log ${kept:+-C /tmp/serve-work $kept} 2>/dev/null
rm -f "$OUT"/{env.txt,setup.log,serve.log}
exit "$rc"
