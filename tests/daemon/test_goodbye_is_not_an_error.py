"""An engine's goodbye is not an error: vLLM's default stop (SIGTERM, shutdown timeout 0) has the
engine core's scheduler session unregister every rank of the engine (its workers may be killed
before they speak), and then a worker that exits cleanly unregisters its own rank and says BYE.

Regression: that second UNREGISTER was answered UNKNOWN_INSTANCE, so every clean run of the
README's hit.py left one more `UNKNOWN_INSTANCE` in `tierd status`'s errors, with no log line."""

from __future__ import annotations

import time

from kv import GroupGeom
from util import ranks  # noqa: F401 - fixture

from tierd.protocol import messages


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_rank_unregistered_twice_by_an_engines_goodbye_counts_no_error(daemon, client_factory, ranks):
    worker = client_factory(daemon, name="vllm-worker-e")
    scheduler = client_factory(daemon, name="vllm-scheduler-e")
    worker.register("e/0", ranks(GroupGeom("full")).layout())
    assert [i["instance"] for i in daemon.status()["instances"]] == ["e/0"]

    scheduler.leave_now(("e/0",))  # the engine core's SIGTERM handler (tierd_client.vllm_connector.leave)
    scheduler.close()
    wait_for(lambda: daemon.status()["instances"] == [])

    # the worker's clean shutdown (Registration.leave)
    assert worker.unregister("e/0", timeout=5) == messages.Empty()
    worker.close()
    wait_for(lambda: daemon.status()["sessions"] == 0)

    st = daemon.status()
    assert (st["errors"], st["errors_by_code"]) == (0, {})
    assert "UNREGISTER 'e/0': not registered" in daemon.log.read_text()
