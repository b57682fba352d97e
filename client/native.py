"""The native gather/scatter extension (native/tierd_copy.cu), built with torch's cpp_extension on
first use and cached (``configure(cache)``, default ``~/.cache/tierd/native``; the connector's
``tierd.native_cache``).

The engine side (tierd_client.cuda_stage) starts the build in a background thread when it
registers a GPU rank and copies with the pure-torch fallback (same bytes) until the module is
ready, so a cold cache never stalls the engine. ``configure(build=False)`` disables the
extension (the fallback only). A CPU-only install never needs nvcc: nothing here runs without
a usable GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("tierd.native")

SOURCE = "tierd_copy.cu"

_lock = threading.Lock()
_state = "idle"  # idle | building | ready | failed | disabled
_module = None
_error = ""
_done = threading.Event()
_build_s = 0.0
_config = {"cache": "~/.cache/tierd/native", "build": True, "verbose": False}


def configure(cache: str | None = None, build: bool = True, verbose: bool = False) -> None:
    """Where the build is cached, whether to build at all, and whether to show the compiler."""
    _config.update(cache=cache or _config["cache"], build=build, verbose=verbose)


def source_path() -> Path:
    """native/tierd_copy.cu: installed as package data of ``tierd.native``, or next to tierd/."""
    try:
        import tierd.native as pkg  # the installed mapping native/ -> tierd.native

        p = Path(pkg.__file__).parent / SOURCE
        if p.exists():
            return p
    except ImportError:
        pass
    return Path(__file__).resolve().parents[1] / "native" / SOURCE  # client/ -> the checkout


def cache_dir() -> Path:
    import torch

    src = source_path().read_bytes()
    tag = hashlib.sha256(
        src + torch.__version__.encode() + str(torch.version.cuda or torch.version.hip).encode()
    )
    base = Path(_config["cache"]).expanduser()
    return base / tag.hexdigest()[:16]


def _arch_list() -> None:
    """Build for the GPUs present only (device properties need no CUDA context)."""
    import torch

    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.version.hip:
        return
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    if caps:
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{a}.{b}" for a, b in caps)


def _build():
    import torch.utils.cpp_extension as ext

    _arch_list()
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    name = f"tierd_copy_{folder.name}"
    return ext.load(
        name=name,
        sources=[str(source_path())],
        build_directory=str(folder),
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        verbose=_config["verbose"],
    )


def _run() -> None:
    global _state, _module, _error, _build_s
    t0 = time.monotonic()
    try:
        mod = _build()
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        with _lock:
            _state, _error = "failed", f"{type(exc).__name__}: {exc}"
        log.warning(
            "native gather/scatter unavailable, using the torch fallback: %s", _error.splitlines()[0][:500]
        )
    else:
        with _lock:
            _state, _module = "ready", mod
        log.info("native gather/scatter ready (%.1f s)", time.monotonic() - t0)
    _build_s = time.monotonic() - t0
    _done.set()


def start() -> None:
    """Begin loading (building if the cache is cold) in the background; idempotent."""
    global _state
    with _lock:
        if _state != "idle":
            return
        if not _config["build"]:
            _state = "disabled"
            _done.set()
            return
        _state = "building"
    threading.Thread(target=_run, name="tierd-native-build", daemon=True).start()


def get():
    """The loaded module, or None while building / when unavailable (never blocks)."""
    return _module


def load(timeout: float | None = None):
    """Start if needed and wait for the module; None when it cannot be built."""
    start()
    _done.wait(timeout)
    return _module


def state() -> dict:
    return {"state": _state, "error": _error, "build_s": round(_build_s, 3)}
