"""An engine's goodbye is not an error: vLLM's default stop (SIGTERM, shutdown timeout 0) has the
engine core's scheduler session unregister every rank of the engine (its workers may be killed
before they speak), and then a worker that exits cleanly unregisters its own rank and says BYE.

Regression: that second UNREGISTER was answered UNKNOWN_INSTANCE, so every clean run of the
README's hit.py left one more `UNKNOWN_INSTANCE` in `tierd status`'s errors, with no log line.

The daemon's objects in this process (tests/inproc.py), each side a session of its own; the
scheduler's goodbye is the requests TierdClient.leave_now sends (UNREGISTER of each rank of the
engine, then BYE). That vLLM's own stop sends each of them once is
tests/daemon/test_engine_goodbye_unregisters_once.py's."""

from __future__ import annotations

from kv import GroupGeom
from util import ranks  # noqa: F401 - fixture

from tierd.protocol import messages


def test_a_rank_unregistered_twice_by_an_engines_goodbye_counts_no_error(inproc, inclient_factory, ranks):
    worker = inclient_factory(inproc, name="vllm-worker-e")
    scheduler = inclient_factory(inproc, name="vllm-scheduler-e")
    worker.register("e/0", ranks(GroupGeom("full")).layout())
    assert [i["instance"] for i in inproc.status()["instances"]] == ["e/0"]

    # the engine core's SIGTERM handler (tierd_client.vllm_connector.leave): leave_now(("e/0",))
    assert scheduler.unregister("e/0") == messages.Empty()
    assert scheduler.call("BYE", messages.Bye()) == messages.Empty()
    assert inproc.status()["instances"] == []

    # the worker's clean shutdown (Registration.leave)
    assert worker.unregister("e/0") == messages.Empty()
    assert worker.call("BYE", messages.Bye()) == messages.Empty()
    assert inproc.status()["sessions"] == 0

    st = inproc.status()
    assert (st["errors"], st["errors_by_code"]) == (0, {})
    assert "UNREGISTER 'e/0': not registered" in inproc.log.read_text()
