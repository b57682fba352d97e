"""The connector's per-request stage stamps (tierd_client.vllm_connector.stages): the first time a
request reaches a stage is kept, summed figures add up, old requests are forgotten past KEEP, and
take() hands every record over once."""

from tierd_client.vllm_connector import stages


def test_a_stage_keeps_its_first_time_and_sums_add_up():
    stages.take()
    stages.stamp("r1", "lookup_sent")
    first = stages._recs["r1"]["lookup_sent"]
    stages.stamp("r1", "lookup_sent")
    stages.add("r1", "hook_s", 0.25)
    stages.add("r1", "hook_s", 0.5)
    recs = stages.take()
    assert recs["r1"]["lookup_sent"] == first and recs["r1"]["hook_s"] == 0.75
    assert stages.take() == {}


def test_only_the_last_KEEP_requests_are_kept():
    stages.take()
    for i in range(stages.KEEP + 5):
        stages.stamp(f"r{i}", "landed")
    recs = stages.take()
    assert len(recs) == stages.KEEP and "r4" not in recs and "r5" in recs
