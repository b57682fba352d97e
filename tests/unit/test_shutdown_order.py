"""Shutdown order, in-process: a copy still running when the daemon closes finishes (and is
answered) before its rank's memory is closed, and that before the pool it copies into goes.

Regression: close() unregistered the instances first, which detached their lanes, so with
--workers 0 the transfer engine's close joined no lane and the pool was unmapped (and on CUDA
hosts unpinned) while the copy still ran, once the shutdown grace had passed."""

from __future__ import annotations

import threading
import time

import pytest

from tierd.base.config import Settings
from tierd.daemon.server import Daemon


class SlowMemory:
    """A rank's memory whose copies take ``seconds``; it records what happened in which order."""

    duplex = False

    def __init__(self, events: list, seconds: float):
        self.events, self.seconds = events, seconds

    def store(self, group, items):
        self.events.append("copy started")
        time.sleep(self.seconds)
        self.events.append("copy finished")

    def retrieve(self, group, items):
        self.store(group, items)

    def close(self):
        self.events.append("memory closed")


@pytest.mark.parametrize("workers", [0, 2])
def test_close_waits_for_running_copies_then_closes_memory_then_the_pool(tmp_path, workers):
    from tierd_client.layouts import block_span, group, layout, namespace

    events: list[str] = []
    settings = Settings(socket=f"ipc://{tmp_path}/t.sock", http_port=-1, l1_size_gb=0.0625, workers=workers)
    d = Daemon(settings)
    d.tier.open_memory = lambda lay, peer: SlowMemory(events, 0.5)  # what REGISTER opens
    pool_close = d.pool.close
    d.pool.close = lambda: (events.append("pool closed"), pool_close())
    spans = [block_span((16, 256), (256, 1), 1, 0, tensor=0, offset=0)]
    lay = layout(
        namespace("m", "f"),
        0,
        16,
        [{"handle": {"kind": "shm", "path": "/dev/shm/x"}, "nbytes": 4096}],
        [group("full", 4, spans)],
    )
    from tierd.core import handlers
    from tierd.core.handlers import Call
    from tierd.protocol import messages as m

    ident = b"c" * 16
    handlers.hello(d.tier, Call(ident, None, [ident], 1, 0.0), m.Hello(1))
    call = Call(ident, d.registry.session(ident), [ident], 2, 0.0)
    handlers.register(d.tier, call, m.convert({"instance": "r", "layout": lay}, m.Register))
    job = handlers.store(d.tier, call, m.Store("r", [m.Chunk(b"k" * 16, [[0, 1, 2, 3]])]))
    d.xfer.submit(job.lane, job.run, job)
    threading.Event().wait(0.1)  # the copy is running
    d.close()
    assert events == ["copy started", "copy finished", "memory closed", "pool closed"]
