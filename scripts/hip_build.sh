#!/usr/bin/env bash
# Compile native/tierd_copy.cu for AMD GPUs with Debian's ROCm toolchain (hipcc, on LLVM), for the
# newest data-center gfx target that compiler knows, and say what it built. A compile check: the
# result is not loaded or run here (no AMD GPU); the engine side builds the same source itself
# through torch's cpp_extension on a ROCm host (tierd_client.native), which hipifies it the same way.
#   INSTALL=0   skip apt-get (hipcc, pybind11-dev, python3-dev already there; installing needs root)
#   TARGETS     gfx targets to try, newest first (default: MI355, MI300X, MI300A, MI300, MI200, MI100)
#   OUTDIR      where the hipified source and the modules go (default: build/hip)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${OUTDIR:-$ROOT/build/hip}
TARGETS=${TARGETS:-"gfx950 gfx942 gfx941 gfx940 gfx90a gfx908"}
if [ "${INSTALL:-1}" = 1 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends hipcc pybind11-dev python3-dev
fi
export HIP_PLATFORM=amd  # hipcc compiles for NVIDIA when it finds an nvcc on PATH
mkdir -p "$OUTDIR"
version=$(hipcc --version 2>/dev/null || true)
echo "hipcc: $(echo "$version" | grep -m1 'HIP version' || echo unknown)"
LLC=$(ls /usr/lib/llvm-*/bin/llc 2>/dev/null | sort -V | tail -1)
known=$("$LLC" -march=amdgcn -mcpu=help 2>&1 | grep -o 'gfx[0-9a-f]*' | sort -u | tr '\n' ' ')
echo "gfx targets $LLC knows: $known"

# hipify: the source keeps to runtime calls that map one to one (module doc of native/tierd_copy.cu)
SRC="$OUTDIR/tierd_copy.hip.cpp"
sed -E -e 's#<cuda_runtime\.h>#<hip/hip_runtime.h>#' -e 's/\bcuda([A-Z][A-Za-z]*)/hip\1/g' \
  "$ROOT/native/tierd_copy.cu" > "$SRC"
if grep -n -E '\bcu[A-Z]|cuda[A-Z_]' "$SRC"; then echo "CUDA names left after hipify (above)"; exit 1; fi

PY=/usr/bin/python3
EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
built=()
for t in $TARGETS; do
  case " $known " in *" $t "*) ;; *) echo "$t: not known to this compiler, skipped"; continue ;; esac
  out="$OUTDIR/tierd_copy_$t$EXT"
  if hipcc --offload-arch="$t" -O3 -std=c++17 -fPIC -shared -DTORCH_EXTENSION_NAME=tierd_copy \
      $("$PY"-config --includes) -I/usr/include "$SRC" -o "$out" 2> "$OUTDIR/$t.log"; then
    code=$(strings "$out" | grep -c -- "amdgcn-amd-amdhsa--$t" || true)
    echo "$t: built $out ($(stat -c %s "$out") bytes; $code offload bundle entries for amdgcn-amd-amdhsa--$t)"
    built+=("$t")
  else
    echo "$t: compile failed:"; tail -20 "$OUTDIR/$t.log"
  fi
done
if [ ${#built[@]} -eq 0 ]; then echo "nothing built"; exit 1; fi
echo "newest target built: ${built[0]} (also: ${built[*]:1}); not run: no AMD GPU here"
