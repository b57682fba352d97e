"""memcpy between the pool and a mapped engine file, safe against the file being cut short.

Why not preadv/pwritev: the kernel copies a tmpfs file one 4 KiB page at a time (look the page
up, lock it, copy it, mark it accessed), well below what a memcpy of the same bytes reaches
(benchmarks/cpu_copy.py prints both, and tierd bench the whole path against memcpy). A mapped
file is copied by the C library's memcpy, as fast as any memory; ranges of 4 KiB or more (on
x86-64) with non-temporal stores, which do not read the destination first (mapcopy.c).

Why a mapping needs a guard: the file belongs to the client, which can truncate it at any time,
and a load or store past the end of a shared mapping raises SIGBUS. mapcopy.c's copy arms a
thread-local guard, and its SIGBUS handler jumps back out of a guarded copy (any other SIGBUS goes
to the handler it replaced, or ends the process as before): the copy reports the range it stopped
at, and the caller raises ShmCopyError as for a short read.

The C file is compiled on first use (a rank's first copy, on its copy thread) with the system's C
compiler (``$CC``, else ``cc``) into a private temporary folder, loaded with ctypes and the file
removed. No compiler, or a build or
load that fails: ``load()`` answers None, once logged, and the copies stay preadv/pwritev.
ctypes releases the GIL for the length of each call.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import tempfile
import threading

log = logging.getLogger("tierd")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mapcopy.c")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_U64P = ctypes.POINTER(ctypes.c_uint64)


def build(folder: str) -> str:
    """mapcopy.c compiled into ``folder``; the library's path (raises on failure)."""
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH")
    out = os.path.join(folder, "tierd_mapcopy.so")
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", out, SOURCE], check=True, capture_output=True, timeout=60
    )
    return out


def load() -> ctypes.CDLL | None:
    """The compiled copy with its SIGBUS handler installed, or None (module doc)."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                with tempfile.TemporaryDirectory(prefix="tierd-mapcopy-") as folder:
                    lib = ctypes.CDLL(build(folder), use_errno=True)
                lib.tierd_mapcopy.restype = ctypes.c_int64
                lib.tierd_mapcopy.argtypes = [_U64P, _U64P, _U64P, ctypes.c_int64]
                lib.tierd_mapcopy_map.restype = ctypes.c_void_p
                lib.tierd_mapcopy_map.argtypes = [ctypes.c_int, ctypes.c_uint64]
                lib.tierd_mapcopy_unmap.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
                if lib.tierd_mapcopy_install() != 0:
                    raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) failed")
                _lib = lib
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", b"") or b""
                log.warning(
                    "CPU copies use preadv/pwritev (slower): the mapped copy could not be built: %s %s",
                    exc,
                    detail.decode(errors="replace")[-500:],
                )
        return _lib


def armed() -> bool:
    """Whether the guard's SIGBUS handler is still the process's (something installed later, such
    as faulthandler.enable(), chains to it only after printing a fatal error)."""
    return _lib is not None and bool(_lib.tierd_mapcopy_armed())


def _u64(a) -> ctypes.POINTER:
    return a.ctypes.data_as(_U64P)


def copy(dst, src, lengths) -> int:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]``, in order (uint64 arrays,
    C-contiguous). Returns how many ranges were copied whole: ``len(dst)``, or the index of the
    range a SIGBUS stopped."""
    return int(_lib.tierd_mapcopy(_u64(dst), _u64(src), _u64(lengths), len(dst)))


def map_file(fd: int, size: int) -> int:
    """Address of a shared read-write mapping of ``fd``'s first ``size`` bytes."""
    addr = _lib.tierd_mapcopy_map(fd, size)
    if not addr:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err) if err else "mmap failed")
    return int(addr)


def unmap(addr: int, size: int) -> None:
    _lib.tierd_mapcopy_unmap(addr, size)
