"""Where a copy's time goes in the daemon: a job's stamps (stage, when it ended) become seconds per
stage, summed per op, in time order whichever thread stamped first."""

from tierd.base.stats import STAGES, Stats
from tierd.tools.bench.common import stage_means


def test_stages_are_the_gaps_between_stamps_in_time_order():
    st = Stats()
    # an early-answered RETRIEVE whose waiter saw the DMAs finish before the main loop took the
    # QUEUED item back: "device" was stamped before "return" and "early reply"
    st.stages(
        "RETRIEVE",
        [
            ("read", 10.0),
            ("plan", 10.5),
            ("lane", 10.75),
            ("copy", 11.0),
            ("device", 12.0),
            ("return", 11.5),
            ("early reply", 11.75),
            ("return", 12.5),
            ("finish", 13.0),
        ],
    )
    st.stages(
        "RETRIEVE",
        [("read", 0.0), ("plan", 1.0), ("lane", 1.0), ("copy", 3.0), ("return", 3.5), ("reply", 4.0)],
    )
    st.stages(
        "STORE",
        [("read", 0.0), ("plan", 0.25), ("lane", 0.5), ("copy", 1.0), ("return", 1.5), ("reply", 2.0)],
    )
    assert st.stages_status() == {
        "RETRIEVE": {
            "jobs": 2,
            "seconds": {
                "plan": 1.5,
                "lane": 0.25,
                "copy": 2.25,
                "return": 0.5 + 0.5 + 0.5,
                "early reply": 0.25,
                "device": 0.25,
                "finish": 0.5,
                "reply": 0.5,
            },
        },
        "STORE": {
            "jobs": 1,
            "seconds": {"plan": 0.25, "lane": 0.25, "copy": 0.5, "return": 0.5, "reply": 0.5},
        },
    }


def test_every_stage_a_job_stamps_is_documented():
    names = {name for name, _ in STAGES}
    assert names == {"wait", "plan", "lane", "copy", "device", "return", "early reply", "reply", "finish"}


def test_the_bench_takes_per_request_means_of_the_stages_between_two_statuses():
    before = {"STORE": {"jobs": 2, "seconds": {"plan": 0.002, "copy": 0.004, "reply": 0.001}}}
    after = {
        "STORE": {"jobs": 6, "seconds": {"plan": 0.006, "copy": 0.012, "reply": 0.001, "device": 0.02}},
        "RETRIEVE": {"jobs": 2, "seconds": {"early reply": 0.001, "plan": 0.003}},
        "LOOKUP": {"jobs": 0, "seconds": {}},
    }
    means = stage_means(before, after)
    assert means == {
        "STORE": {"plan": 1.0, "copy": 2.0, "device": 5.0, "reply": 0.0},
        "RETRIEVE": {"plan": 1.5, "early reply": 0.5},
    }
    assert list(means["STORE"]) == ["plan", "copy", "device", "reply"]  # the order a job passes them
