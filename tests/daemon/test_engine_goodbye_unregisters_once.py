"""An engine's goodbye sends exactly one UNREGISTER per registered rank, however it stops.

vLLM's real Scheduler and TierdConnector in both roles in one process (as vLLM's single-process
executor runs them), against a real daemon that counts the UNREGISTERs it answers
(``tierd_op_seconds_count{op="UNREGISTER"}`` on /metrics; the daemon answers every UNREGISTER
with success, so each one sent is counted):

- a clean stop: the worker drops its own rank, then each side says BYE;
- vLLM's default abort stop (SIGTERM): the scheduler side drops every rank of the engine (its
  workers may be killed before they speak), a worker that sees the signal says only BYE, and its
  shutdown afterwards sends nothing more.

Regression: the worker's signal handler and its shutdown each sent UNREGISTER for a rank the
scheduler side had just dropped (three for one rank).
"""

from __future__ import annotations

import re
import signal
import weakref

import pytest

pytest.importorskip("vllm")

from conftest import DaemonProcess  # noqa: E402,F401 - fixtures from conftest
from conftest_vllm import tiny_model  # noqa: E402,F401 - fixture
from vllm_sim import GroupDef, SimEngine  # noqa: E402
from wire import wait_for  # noqa: E402

from tierd_client.vllm_connector import leave  # noqa: E402


def unregisters(daemon) -> int:
    m = re.search(
        r'^tierd_op_seconds_count\{op="UNREGISTER"\} (\S+)$', daemon.get("/metrics")[1].decode(), re.M
    )
    return int(float(m.group(1))) if m else 0


def engine(tiny_model, daemon) -> SimEngine:
    e = SimEngine(tiny_model, daemon.endpoint, [GroupDef("full")], num_blocks=32, chunk_tokens=64)
    assert [i["instance"] for i in daemon.status()["instances"]] == [e.worker.worker.instance]
    return e


def test_a_clean_stop_unregisters_each_rank_once(tiny_model, daemon):
    e = engine(tiny_model, daemon)
    e.close()  # the worker's shutdown, then the scheduler's (vLLM's order)
    wait_for(lambda: daemon.status()["sessions"] == 0, timeout=10)
    assert daemon.status()["instances"] == []
    assert unregisters(daemon) == 1


def test_a_sigterm_abort_unregisters_each_rank_once(tiny_model, daemon):
    e = engine(tiny_model, daemon)
    # vLLM's SIGTERM handler, chained by each connector in the order they were armed (the worker's
    # first): the last armed, the scheduler side's, runs first
    handler = lambda signum, frame: None  # noqa: E731 - vLLM's own handler, which raises SystemExit
    for connector in (e.worker, e.connector):
        handler = leave._chained(weakref.ref(connector), handler)
    handler(signal.SIGTERM, None)
    e.close()  # then the interpreter's exit runs each connector's shutdown (leave's atexit hook)
    wait_for(lambda: daemon.status()["sessions"] == 0, timeout=10)
    assert daemon.status()["instances"] == []
    assert unregisters(daemon) == 1
