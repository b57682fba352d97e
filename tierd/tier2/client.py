"""The Mooncake Store calls tierd makes and what their codes mean. ``mooncake`` is imported lazily.

Hazards, observed with mooncake-transfer-engine-non-cuda 0.3.13.post1 on this host:

- After a failed ``setup`` the client object is half-built: a ``batch_put_from`` on it crashed the
  process (SIGSEGV). Such a client is dropped, never called again; a retry builds a fresh one.
- ``setup`` and ``close`` block *holding the GIL*: setup for seconds per try against an absent
  master (it tries many times with an automatic local port), for Mooncake's RPC timeout against a
  stopped one; close against a dead or stopped master, and the interpreter's exit with a live
  client, likewise for seconds to minutes. Hence the client runs in its own process
  (:mod:`tierd.tier2.agent`). The batch calls release the GIL.
- ``health_check()`` answered 0 (healthy) with the master killed; ``batch_is_exist`` tells, so the
  tier probes with that.
- A stopped (SIGSTOP) master holds every call for Mooncake's 30 s RPC timeout (RPC_TIMEOUT, -901);
  a killed one fails reads at once (RPC_FAIL, -900) but a put still blocks for seconds.
- A restarted master: the same client works again within about a second (it mounts its segment
  again), but every object the old master knew is gone (its metadata lives in its memory only,
  unless HA or snapshots are configured).
- A client that contributed a segment takes that segment's objects with it when it exits (at once
  on close; about ``client_ttl`` = 10 s after it dies).
- An object must fit in one free extent of one segment: a larger put fails NO_AVAILABLE_HANDLE
  (-200), and so do puts while the segments are full, until the master's eviction (above its 0.9
  watermark, 5% per pass) has run, about a second later.
- A get into a buffer smaller than the object fails INVALID_PARAMS (-600); a larger one succeeds
  and returns the object's size, so the tier checks the size it asked for.
- Over TCP, put and get worked from unregistered memory too; RDMA needs registration. The tier
  registers everything and refuses addresses outside what was registered.
"""

from __future__ import annotations

import importlib
import os

from tierd.base.l2url import MooncakeUrl

INSTALL_HINT = "pip install 'tierd[mooncake]'"
DEBIAN_LIBS = "libibverbs1 libnl-3-200 libnl-route-3-200"

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that tierd meets.
OK = 0
NO_AVAILABLE_HANDLE = -200  # no segment has room (full, or the object exceeds every free extent)
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  # read within the lease TTL (default 10 s): remove refused
CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",
}
# Codes that are an answer about the key, not a sign that Mooncake is unwell.
ANSWERS = frozenset((OK, NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE))


class L2Unavailable(RuntimeError):
    """Mooncake's Python client cannot be imported; the message says what to install."""


class SetupFailed(RuntimeError):
    def __init__(self, rc: int, detail: str):
        super().__init__(f"mooncake setup failed ({code_name(rc)}): {detail}")
        self.rc = rc


def code_name(rc: int) -> str:
    return CODE_NAMES.get(rc, f"code {rc}")


def load_store_class():
    """``mooncake.store.MooncakeDistributedStore``, or L2Unavailable saying what to install."""
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as e:
        text = str(e)
        if "libcuda" in text:
            fix = (
                "the installed Mooncake is a CUDA build and this host has no CUDA driver: "
                f"pip uninstall -y mooncake-transfer-engine && {INSTALL_HINT}"
            )
        elif "libibverbs" in text or "libnl" in text:
            fix = "Mooncake's libraries are missing: apt-get install -y " + DEBIAN_LIBS
        else:
            fix = f"Mooncake's Python client is not installed: {INSTALL_HINT}"
        raise L2Unavailable(f"--l2-url mooncake://... needs Mooncake Store; {fix} ({text})") from e
    return module.MooncakeDistributedStore


def advertise(host: str) -> str:
    """Make the transfer engine advertise ``host`` (process-wide; an operator's setting wins)."""
    return os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)


def open_store(store_class, url: MooncakeUrl, host: str):
    """A connected client contributing ``url.segment_bytes``, or SetupFailed (the client dropped).

    The local buffer is 0 bytes: tierd only moves registered memory (``*_from`` / ``*_into``).
    """
    store = store_class()
    rc = store.setup(
        url.local_hostname(host),
        url.metadata,
        url.segment_bytes,
        0,
        url.protocol,
        url.device,
        url.master_addr,
        tenant_id=url.tenant,
    )
    if rc != 0:
        drop(store)
        raise SetupFailed(
            rc, f"master {url.master_addr}, metadata {url.metadata}, local {url.local_hostname(host)}"
        )
    return store


def drop(store) -> None:
    """Forget a client whose setup failed. close() on it was safe; other calls were not."""
    try:
        store.close()
    except Exception:
        pass
