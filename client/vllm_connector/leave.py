"""Saying goodbye to the daemon however vLLM stops an engine, so no session or lease outlives it.

- A clean stop, and SIGTERM/SIGINT with ``--shutdown-timeout`` > 0: vLLM drains, then calls the
  connector's ``shutdown`` (scheduler in the engine core, ``ensure_kv_transfer_shutdown`` in
  workers): stores get a short grace, then the client says BYE.
- vLLM's default (``shutdown_timeout`` 0, "abort"): the API server sends SIGTERM to the engine
  core and kills its process tree right away (on vLLM 0.32 the kill follows the SIGTERM at
  once), so ``Scheduler.shutdown`` seldom runs. For that mode the
  connector chains vLLM's own SIGTERM/SIGINT handlers in its process (engine core, workers) and
  queues a BYE before handing the signal on: queueing is a lock-free put and a pipe write (safe
  in a signal handler), and the I/O thread sends it at once. Workers get no signal before
  the kill (only the engine core does), so the scheduler side UNREGISTERs the engine's
  worker instances (any session may): the daemon lets go of their KV memory at once; their
  now empty sessions end at the heartbeat timeout (at once with a daemon that drops a session
  when its connection closes). A worker that does see the signal (one in the engine core's
  process) only says BYE, and its shutdown afterwards sends nothing: each rank is named in one
  UNREGISTER. Only handlers vLLM installed are chained (never a user's), and
  only in abort mode: with a grace period the engine keeps serving while it drains, and a BYE
  then would turn the tier off under running requests.
- An ``atexit`` hook covers processes that exit without either (an offline ``LLM`` at
  interpreter exit).
- SIGKILL cannot be caught: the session ends at the daemon's heartbeat timeout (30 s by
  default), or at once with a daemon that drops sessions on disconnect. No file is left either
  way (``tierd_client.shm``).
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref


def arm(connector, vllm_config) -> None:
    atexit.register(_at_exit, weakref.ref(connector))
    if (
        getattr(vllm_config, "shutdown_timeout", 0)
        or threading.current_thread() is not threading.main_thread()
    ):
        return
    ref = weakref.ref(connector)
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if callable(prev) and str(getattr(prev, "__module__", "")).startswith("vllm."):
            signal.signal(sig, _chained(ref, prev))


def _chained(connector_ref, prev):
    def on_signal(signum, frame):
        connector = connector_ref()
        if connector is not None:
            connector.client.leave_now(connector.instances_to_drop())
        return prev(signum, frame)

    on_signal.__module__ = prev.__module__  # still vLLM's handler to anyone who looks (and to a second arm)
    return on_signal


def _at_exit(ref) -> None:
    connector = ref()
    if connector is not None:
        try:
            connector.shutdown()
        except Exception:  # noqa: BLE001 - the interpreter is going away; the daemon reaps us anyway
            pass
