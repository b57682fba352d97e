"""``tierd bench``'s progress lines give each step its own time.

Regression: every phase line carried the time since the bench started, printed as the phase
began, which read as that step's time ("memcpy baseline (4.3 s)" after a 4.2 s daemon start)."""

from __future__ import annotations

import io

from tierd.tools.bench.common import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_phase_line_says_how_long_the_step_before_it_took():
    clock, out = Clock(), io.StringIO()
    p = Progress(True, clock=clock, out=out)
    p.phase("laying out the KV buffer")
    clock.now += 0.4
    p.phase("starting a private daemon")
    clock.now += 4.2
    p.phase("memcpy baseline")
    clock.now += 0.1
    step = p.bar(10, "store/retrieve")
    clock.now += 2.5
    step(10)
    step(None)
    lines = [ln for ln in out.getvalue().splitlines() if ln != "bench: store/retrieve"]  # the bar's own
    assert lines == [
        "bench: laying out the KV buffer",
        "bench: starting a private daemon (laying out the KV buffer took 0.4 s)",
        "bench: memcpy baseline (starting a private daemon took 4.2 s)",
        "bench: store/retrieve (memcpy baseline took 0.1 s)",
        "bench: store/retrieve took 2.5 s",
    ]


def test_a_quiet_bench_prints_nothing():
    clock, out = Clock(), io.StringIO()
    p = Progress(False, clock=clock, out=out)
    p.phase("laying out the KV buffer")
    step = p.bar(10, "store/retrieve")
    step(10)
    step(None)
    assert out.getvalue() == ""
