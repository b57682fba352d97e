"""Two real ``tierd serve`` daemons on one real ``mooncake_master`` (tests/l2_daemons.py, inside a
network namespace of their own): what one stores the other serves byte-exact; what L1 evicted
comes back from L2; a master killed under a fetch gives exactly the L2 chunks' blocks as failed,
by the deadline, and the daemon stays healthy; without a master the daemon is an L1 daemon.
Plus what needs no master: the refusal without Mooncake (exit 2, what to install) and the docs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_l2_mooncake import run

from tierd.protocol.keys import KEY_VERSION
from tierd.tools.testing import serve_argv

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "protocol.md").read_text()
MIB = 1 << 20


SECTION = DOC[DOC.index("## 22. Second tier") :]


def documented(words) -> list[str]:
    """The words docs/protocol.md does not name (section 22 names its counters' series by pattern)."""

    def named(w: str) -> bool:
        m = re.fullmatch(r"tierd_l2_(\w+)_total", w)
        return f"`{w}`" in DOC or bool(
            m and f"`{m.group(1)}`" in SECTION and "`tierd_l2_<counter>_total`" in SECTION
        )

    return sorted(w for w in words if not named(w))


def test_a_chunk_stored_through_a_is_served_through_b_byte_exact_and_never_to_another_namespace():
    r = run("shared")
    assert r["store"] == ["stored"] * 8 and r["a_drained"]["writeback_puts"] == 8
    assert r["b_before"] != r["src"]  # B's blocks held other bytes
    assert r["other_tenant"]["chunks"] == 0  # same keys, another namespace: nothing
    assert r["lookup"]["chunks"] == 8 and r["lookup"]["lease"] > 0
    assert r["retrieve"] == {"ok": [True] * 8, "failed": []}
    assert r["dst"] == r["src"]
    assert r["lookup_again"]["chunks"] == 8
    b = r["status_b"]
    l2 = b["l2"]
    assert (l2["hit_chunks"], l2["fetched"], l2["fetched_bytes"], l2["hits"]) == (8, 8, 8 * 256 << 10, 8)
    assert l2["lookups"] == 1 and l2["fetch_failed"] == 0 and l2["errors"] == 0  # the 2nd LOOKUP: L1 alone
    assert b["objects"] == 8 and b["retrieved_chunks"] == 8 and b["errors"] == 0
    assert r["status_a"]["l2"]["put_bytes"] == 8 * 256 << 10
    for row in ("l2 ", "l2 lookups", "l2 gets", "l2 puts", "l2 backlog", "l2 errors"):
        assert re.search(rf"^{row}", r["table_b"], re.M), row
    assert "+8 chunks from L2" in r["table_b"]
    families = re.findall(r"^# TYPE (tierd_l2_\S+) \S+$", r["metrics_b"], re.M)
    assert "tierd_l2_fetched_total" in families and "tierd_l2_op_seconds" in families
    assert re.search(r"^tierd_l2_hit_chunks_total 8\.0$", r["metrics_b"], re.M)
    assert not documented(families), "add these /metrics families to docs/protocol.md section 22"
    assert not documented(set(l2) | set(l2["latency_s"]) | set(l2["latency_s"]["get"])), "add these l2 keys"


def test_a_chunk_evicted_from_l1_comes_back_from_l2_byte_exact():
    r = run("evicted")
    assert all(s == ["stored"] * 8 for s in r["stores"])
    full = r["status_a_full"]
    assert full["evictions"] >= 64  # 96 objects through a pool of 32
    assert full["l2"]["writeback_lost"] == 0 and full["l2"]["writeback_puts"] >= 64  # written before eviction
    assert r["lookup_a"]["chunks"] == 8 and r["retrieve_a"] == {"ok": [True] * 8, "failed": []}
    assert r["dst_a"] == r["src"][0]
    assert r["lookup_b"]["chunks"] == 8 and r["retrieve_b"] == {"ok": [True] * 8, "failed": []}
    assert r["dst_b"] == r["src"][1]
    assert r["status_a"]["l2"]["hit_chunks"] == 8 and r["status_a"]["l2"]["fetched"] == 8


def test_objects_nodes_of_another_key_derivation_or_object_layout_wrote_are_never_served():
    """K derives keys under the next KEY_VERSION, O lays objects out under the next
    OBJECT_LAYOUT_VERSION: B, of this version, must not find their objects in the shared store (O's
    hold the very key bytes B asks for). C, of this version, is the control: B serves its chunks
    from L2 byte-exact."""
    r = run("other_formats")
    assert r["store_k"] == r["store_o"] == r["store_c"] == ["stored"] * 8
    assert [d["writeback_puts"] for d in r["drained"].values()] == [8, 8, 8]  # all in Mooncake
    assert r["lookup_k_keys"]["chunks"] == 0 and r["lookup_o_keys"]["chunks"] == 0  # never served
    assert r["lookup_c_keys"]["chunks"] == 8 and r["retrieve_c_keys"] == {"ok": [True] * 8, "failed": []}
    assert r["dst"] == r["src_c"]
    l2 = r["status_b"]["l2"]
    assert l2["lookups"] == 3 and l2["hit_chunks"] == 8 and l2["fetched"] == 8  # B asked L2 each time
    # imported here, after the behaviour: a version whose names lack the format fails on that first
    from tierd.state.planner import OBJECT_LAYOUT_VERSION
    from tierd.tier2.keys import name_format

    lines = r["l2_lines"]
    assert all(len(got) == 1 for got in lines.values()), lines
    for name, fmt in {
        "k": name_format(key_version=KEY_VERSION + 1),
        "o": name_format(layout_version=OBJECT_LAYOUT_VERSION + 1),
        "c": name_format(),
        "b": name_format(),
    }.items():
        assert KEY_FORMAT_LINE.format(fmt) in lines[name][0], (name, lines)


KEY_FORMAT_LINE = (
    "objects named tierd/{}/<key>: objects that other versions of the key derivation or object "
    "layout wrote are never read"
)


def test_master_killed_mid_fetch_fails_exactly_the_l2_blocks_in_time_and_the_daemon_stays_healthy():
    r = run("master_killed", timeout=300)
    assert r["lookup"]["chunks"] == 8 and r["store_b"] == ["stored"] * 2
    mid = r["status_mid"]
    assert (mid["waiting_retrieves"], mid["fetching"]) == (1, 6)  # the RETRIEVE waits on 6 fetches
    assert r["retrieve"]["ok"] == [True, True] + [False] * 6
    assert r["retrieve"]["failed"] == [[0, b] for b in range(40, 64)]  # chunks 2..7: blocks 40..63
    assert r["retrieve_s"] < 2.5  # by the get's deadline (2 s), not Mooncake's 30 s
    assert r["dst"][:2] == r["src_b"] and r["dst"][2:] == r["before"][2:]  # nothing half-written
    assert r["ping"]["boot_id"]
    assert r["lookup_down"]["chunks"] == 2 and r["lookup_down_s"] < 0.1  # L1 only, at once
    down = r["status_down"]
    assert down["l2"]["state"] == "degraded" and down["l2"]["lookups_skipped"] >= 1
    assert down["l2"]["fetch_failed"] == 6 and down["errors"] == 0  # no error reply to the engine
    assert r["reconnect"][0] >= 1
    assert r["lookup_new"]["chunks"] == 4 and r["retrieve_new"]["ok"] == [True] * 4
    assert r["dst_new"] == r["src_new"]
    l2_after = r["status_b"]["l2"]  # all of it: a failure here once showed too little to say why
    assert r["lookup_hung"]["chunks"] == 0, r["lookup_hung"]
    # --l2-lookup-timeout-ms 250; what L2 said before and after, whole (a repr pytest would cut)
    hung = f"{r['lookup_hung_s']:.4f} s; before {r['status_before_hung']}; after {l2_after}"
    assert 0.2 < r["lookup_hung_s"] < 1.0, hung
    assert r["status_b"]["l2"]["lookups_late"] == 1 and r["status_b"]["errors"] == 0


def test_without_a_master_the_daemon_serves_l1_alone_and_says_degraded():
    r = run("unreachable")
    assert r["store"] == ["stored"] * 4
    assert r["lookup"]["chunks"] == 4 and r["lookup_s"] < 0.1
    assert r["retrieve"] == {"ok": [True] * 4, "failed": []} and r["dst"] == r["src"]
    s = r["status"]
    assert s["l2"]["state"] == "degraded" and not s["l2"]["connected"] and s["l2"]["lookups_skipped"] == 1
    assert s["errors"] == 0


# -- without a master ---------------------------------------------------------------------------


def test_l2_url_without_mooncake_exits_2_saying_what_to_pip_install(tmp_path):
    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'mooncake.store'\")\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        serve_argv("--l2-url", "mooncake://127.0.0.1", endpoint=f"ipc://{tmp_path}/t.sock", http_port=-1),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr
    assert "pip install 'tierd[mooncake]'" in r.stderr and "--l2-url" in r.stderr
    assert not (tmp_path / "t.sock").exists()  # refused before anything started


@pytest.mark.parametrize(
    "url, says",
    [
        ("redis://x", "scheme"),
        ("mooncake://h?segment_gb=-1", "segment_gb"),
        ("mooncake://h?nope=1", "unknown"),
        ("", "expected mooncake://"),
    ],
)
def test_a_bad_l2_url_is_a_usage_error_naming_the_part(url, says):
    r = subprocess.run(
        serve_argv("--l2-url", url, http_port=-1),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "--l2-url" in r.stderr and says in r.stderr, r.stderr


def test_importing_the_daemon_does_not_import_the_second_tier():
    code = (
        "import sys, tierd.daemon.server, tierd.tools.cli, tierd.daemon.status, tierd.base.stats; "
        "print(sorted(m for m in sys.modules if m.startswith(('mooncake', 'tierd.l2', 'tierd.tier2'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
