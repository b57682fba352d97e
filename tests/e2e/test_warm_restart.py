"""Warm restart through a real ``tierd serve --pool-dir``: a SIGTERMed daemon's successor serves
every object of every group kind (full, sliding, state; MLA's replicated copy) byte for byte to
engines that reconnect by themselves, lists the namespaces again and says so in /status; leases
and sessions do not survive; a crash keeps the namespaces it had journaled."""

import json
import os
import signal

import numpy as np
import pytest
from conftest import ROOT
from kv import GroupGeom, keys
from pool_dirs import huge_dir, shm_dir  # noqa: F401 - fixtures
from util import NULL, chunk, grouping, ranks  # noqa: F401 - fixtures
from wire import wait_for

from tierd.protocol import messages

N = NULL
GROUPS = (
    GroupGeom("full", layers=3, block_bytes=512, block_tokens=4),
    GroupGeom("sliding", layers=2, block_bytes=256, block_tokens=4, window_tokens=8),
    GroupGeom("state", layers=1, block_bytes=4096, block_tokens=16),
)
MLA = GroupGeom("full", layers=2, block_bytes=4 * 1152, block_tokens=4)  # 576 bf16 latents per token


def names(d) -> list[str]:
    return sorted(i["instance"] for i in d.status()["instances"])


def planned_restart(d) -> None:
    assert d.stop(signal.SIGTERM) == 0, d.log.read_text()[-3000:]
    d.start()


def hybrid(c, rank, name="h0", n=4):
    """Store ``n`` chunks of every group kind; the bytes a restore of all ``n`` must give back."""
    c.register(name, rank.layout())
    ks = keys(n)
    stored = [chunk(k, range(4 * i, 4 * i + 4), [N, N, 4 * i + 2, 4 * i + 3], [i]) for i, k in enumerate(ks)]
    assert c.store(name, stored).results == ["stored"] * n
    expect = (rank.blocks(0, range(4 * n)), rank.blocks(1, [4 * n - 2, 4 * n - 1]), rank.blocks(2, [n - 1]))
    return ks, expect


def restore_hybrid(c, rank, ks, expect, name="h0"):
    n = len(ks)
    assert c.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens, lease=False).chunks == n
    for kv in rank.kv:
        kv[:, 32:] = 0
    want = [chunk(k, range(32 + 4 * i, 36 + 4 * i), [N] * 4, [N]) for i, k in enumerate(ks[:-1])]
    want.append(chunk(ks[-1], range(32 + 4 * n - 4, 32 + 4 * n), [N, N, 32, 33], [40]))
    assert c.retrieve(name, want) == messages.RetrieveReply([True] * n, [])
    np.testing.assert_array_equal(rank.kv[0][:, 32 : 32 + 4 * n], expect[0])
    np.testing.assert_array_equal(rank.kv[1][:, 32:34], expect[1])
    np.testing.assert_array_equal(rank.kv[2][:, 40:41], expect[2])


def test_planned_restart_serves_every_group_kind_and_mla_byte_equal(
    daemon_factory, client_factory, ranks, grouping, shm_dir
):
    d = daemon_factory("--pool-dir", shm_dir, *grouping)
    c = client_factory(d, timeout_s=15)
    rank = ranks(*GROUPS)
    ks, expect = hybrid(c, rank)
    m0 = ranks(MLA, rank=0, world_size=2, fingerprint="mla", replicated=True)
    m1 = ranks(MLA, rank=1, world_size=2, fingerprint="mla", replicated=True)
    c1 = client_factory(d, timeout_s=15, name="mla-rank1")
    c.register("mla-0", m0.layout())
    c1.register("mla-1", m1.layout())
    mks = keys(3)
    assert (
        c.store("mla-0", [chunk(k, range(4 * i, 4 * i + 4)) for i, k in enumerate(mks)]).results
        == ["stored"] * 3
    )
    mla_expect = m0.blocks(0, range(12))
    before = d.status()
    assert before["warm_restart"]["warm"] is False and "no index" in before["warm_restart"]["reason"]

    planned_restart(d)
    after = d.status()
    wr = after["warm_restart"]
    assert wr["warm"] and wr["reason"] is None and wr["persist_error"] is None, wr
    assert (
        wr["objects"] == before["objects"] == after["objects"] and wr["journal_records"] == 0
    )  # the index alone
    assert after["group_objects"] == before["group_objects"]
    assert sorted(map(json.dumps, after["namespaces"])) == sorted(map(json.dumps, before["namespaces"]))
    assert after["boot_id"] != before["boot_id"]

    # The engines reconnect and re-register by themselves; their first LOOKUP hits.
    wait_for(lambda: names(d) == ["h0", "mla-0", "mla-1"], 10, what="the clients to re-register")
    restore_hybrid(c, rank, ks, expect)
    reply = c1.lookup(m1.ns, mks, m1.specs(), 16, replicated=True)
    assert reply.chunks == 3
    m1.kv[0][:, 40:52] = 0
    out = c1.retrieve(
        "mla-1", [chunk(k, range(40 + 4 * i, 44 + 4 * i)) for i, k in enumerate(mks)], lease=reply.lease
    )
    assert out == messages.RetrieveReply([True] * 3, [])
    np.testing.assert_array_equal(m1.kv[0][:, 40:52], mla_expect)  # rank 0's copy, through a restart


def test_planned_restart_on_hugetlbfs_with_its_index_on_tmpfs(
    daemon_factory, client_factory, ranks, huge_dir, shm_dir
):
    d = daemon_factory(
        "--pool-dir", huge_dir, "--pool-index-dir", shm_dir, "--l1-segment-mb", "8", pool_mb=16
    )
    c = client_factory(d, timeout_s=15)
    rank = ranks(*GROUPS)
    ks, expect = hybrid(c, rank)
    assert sorted(os.listdir(shm_dir)) == ["index", "journal", "lock"]  # nothing but the index on tmpfs
    planned_restart(d)
    assert d.status()["warm_restart"]["objects"] == 12
    wait_for(lambda: names(d) == ["h0"], 10, what="re-registration")
    restore_hybrid(c, rank, ks, expect)


def test_leases_and_sessions_do_not_survive_a_restart(daemon_factory, client_factory, ranks, shm_dir):
    d = daemon_factory("--pool-dir", shm_dir)
    c = client_factory(d, timeout_s=15)
    rank = ranks(*GROUPS)
    ks, _ = hybrid(c, rank)
    lease = c.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens).lease
    assert lease and d.status()["leases_active"] == 1
    planned_restart(d)
    st = d.status()
    assert st["leases_active"] == 0 and st["leases_granted"] == 0  # (the client may already be back)
    assert st["objects"] == 12  # the leased objects themselves are kept
    wait_for(lambda: names(d) == ["h0"], 10, what="re-registration")
    with pytest.raises(Exception, match="UNKNOWN_LEASE"):
        c.release(lease)


def test_namespaces_journaled_before_a_crash_are_listed_after_it(
    daemon_factory, client_factory, ranks, shm_dir
):
    """No index is written at a SIGKILL: the journal alone must name the namespace again."""
    d = daemon_factory("--pool-dir", shm_dir)
    c = client_factory(d, timeout_s=15)
    rank = ranks(*GROUPS)
    ks, expect = hybrid(c, rank)
    before = d.status()["namespaces"]
    assert [n["objects"] for n in before] == [12]
    d.restart()  # SIGKILL, same flags
    st = d.status()
    assert st["warm_restart"]["warm"] and st["warm_restart"]["journal_records"] > 0
    assert st["namespaces"] == before
    wait_for(lambda: names(d) == ["h0"], 10, what="re-registration")
    restore_hybrid(c, rank, ks, expect)


def test_status_and_metrics_of_a_pool_dir_daemon_are_documented(
    daemon_factory, client_factory, ranks, shm_dir
):
    from protocol_doc import DOC, field_names, missing

    d = daemon_factory("--pool-dir", shm_dir)
    c = client_factory(d)
    hybrid(c, ranks(*GROUPS))
    doc = DOC.read_text()
    status = d.status()
    assert "warm_restart" in status and "pool_grow_error" in status
    assert not missing(doc, field_names(status)), "add these /status keys to docs/protocol.md"
    text = d.get("/metrics")[1].decode()
    for series in ("tierd_warm_restart_objects", "tierd_warm_restart_seconds", "tierd_pool_persisting"):
        assert f"# TYPE {series} gauge" in text and f"`{series}`" in doc
    assert "tierd_pool_persisting 1.0" in text


def test_tierd_status_shows_how_the_pool_started(daemon_factory, client_factory, ranks, shm_dir):
    import subprocess
    import sys

    d = daemon_factory("--pool-dir", shm_dir)
    hybrid(client_factory(d), ranks(*GROUPS))

    def table() -> str:
        res = subprocess.run(
            [sys.executable, "-m", "tierd", "status", "--url", d.http],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        assert res.returncode == 0, res.stderr
        return next(line for line in res.stdout.splitlines() if line.startswith("warm restart"))

    assert "cold: no index" in table()
    planned_restart(d)
    assert "warm: 12 objects" in table() and shm_dir in table()
