"""A ``tierd serve --pool-dir`` that cannot trust its folder starts cold, says why in /status, and
never serves a byte of the old files: a flipped or cut index, changed settings. A folder that
cannot hold a pool stops start-up with exit status 2, naming the folder and its filesystem."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from kv import GroupGeom, keys
from pool_dirs import shm_dir  # noqa: F401 - fixture
from util import NULL, chunk, ranks  # noqa: F401 - fixtures
from wire import wait_for

from tierd.base.config import Settings
from tierd.daemon import warm
from tierd.tools.testing import serve_argv

N = NULL
GROUPS = (GroupGeom("full", layers=2, block_bytes=1024, block_tokens=4), GroupGeom("state", block_tokens=16))
BASE = ("--l1-segment-mb", "64")  # a segment size of its own: a ceiling change alone is not a segment change
SENTINEL = 0x5A


def stored_then_stopped(daemon_factory, client_factory, ranks, shm_dir, *flags, pool_mb=256):
    d = daemon_factory("--pool-dir", shm_dir, *BASE, *flags, pool_mb=pool_mb)
    c = client_factory(d, timeout_s=15)
    rank = ranks(*GROUPS)
    c.register("r0", rank.layout())
    ks = keys(6)
    assert (
        c.store("r0", [chunk(k, range(4 * i, 4 * i + 4), [i]) for i, k in enumerate(ks)]).results
        == ["stored"] * 6
    )
    assert d.stop(signal.SIGTERM) == 0
    return d, c, rank, ks


def restarted_cold(d, c, rank, ks, reason: str) -> None:
    """The daemon came back cold for ``reason``; nothing of the old files is looked up or restored."""
    st = d.status()
    wr = st["warm_restart"]
    assert wr["warm"] is False and reason in wr["reason"] and wr["objects"] == 0, wr
    assert st["objects"] == 0 and st["namespaces"] == []
    assert f"starts cold: {wr['reason']}" in d.log.read_text()  # the one log line
    wait_for(lambda: d.status()["instances"], 10, what="re-registration")
    assert c.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens, lease=False).chunks == 0
    for kv in rank.kv:
        kv[:, 40:] = SENTINEL
    out = c.retrieve("r0", [chunk(k, range(40 + 4 * i, 44 + 4 * i), [40 + i]) for i, k in enumerate(ks)])
    assert out.ok == [False] * 6 and len(out.failed) == 6 * 5
    assert all((kv[:, 40:] == SENTINEL).all() for kv in rank.kv)  # not one byte written


def rewrite(path: str, fn) -> None:
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(fn(data))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_or_truncated_index_starts_cold_and_serves_no_byte(
    daemon_factory, client_factory, ranks, shm_dir, damage
):
    d, c, rank, ks = stored_then_stopped(daemon_factory, client_factory, ranks, shm_dir)
    index = os.path.join(shm_dir, "index")
    if damage == "flip":
        rewrite(index, lambda b: b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 0x01]) + b[len(b) // 2 + 1 :])
    else:
        rewrite(index, lambda b: b[: len(b) // 2])
    d.start()
    restarted_cold(d, c, rank, ks, "index")
    assert [n for n in os.listdir(shm_dir) if n.startswith("segment-")] == []  # the old segments are gone


@pytest.mark.parametrize(
    "flags, pool_mb, reason",
    [
        (("--no-separate-object-groups",), 256, "meta.separate_object_groups True -> False"),
        (("--l1-align-bytes", "8192"), 256, "align 4096 -> 8192"),
        (("--l1-segment-mb", "32"), 256, "segment_bytes"),
    ],
)
def test_changed_settings_start_cold(daemon_factory, client_factory, ranks, shm_dir, flags, pool_mb, reason):
    d, c, rank, ks = stored_then_stopped(daemon_factory, client_factory, ranks, shm_dir)
    d.args = ["--l1-size-gb", f"{pool_mb / 1024:.6f}", "--pool-dir", shm_dir, *BASE, *flags]
    d.start()
    restarted_cold(d, c, rank, ks, reason)


def test_a_ceiling_below_what_the_pool_holds_starts_cold(daemon_factory, client_factory, ranks, shm_dir):
    d = daemon_factory("--pool-dir", shm_dir, "--l1-segment-mb", "4", pool_mb=64)
    c = client_factory(d, timeout_s=15)
    rank = ranks(*GROUPS)
    c.register("r0", rank.layout())
    for _ in range(400):  # until a second 4 MiB segment is backed
        ks = keys(6)
        c.store("r0", [chunk(k, range(4 * i, 4 * i + 4), [i]) for i, k in enumerate(ks)])
        if d.status()["memory_total_bytes"] > 4 << 20:
            break
    assert d.status()["memory_total_bytes"] > 4 << 20
    assert d.stop(signal.SIGTERM) == 0
    d.args = ["--l1-size-gb", "0.00390625", "--pool-dir", shm_dir, "--l1-segment-mb", "4"]  # 4 MiB exactly
    d.start()
    restarted_cold(d, c, rank, ks, "ceiling")


def test_settings_that_do_not_shape_objects_keep_the_pool_warm(
    daemon_factory, client_factory, ranks, shm_dir
):
    d, c, rank, ks = stored_then_stopped(daemon_factory, client_factory, ranks, shm_dir)
    d.args = [
        "--l1-size-gb",
        "0.5",
        "--pool-dir",
        shm_dir,
        *BASE,
        "--workers",
        "2",
        "--lease-ttl-s",
        "5",
        "--heartbeat-timeout-s",
        "20",
        "--max-frame-mb",
        "8",
    ]
    d.start()
    assert d.status()["warm_restart"]["objects"] == 12
    wait_for(lambda: d.status()["instances"], 10, what="re-registration")
    assert c.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens, lease=False).chunks == 6


def test_pool_meta_names_what_shapes_objects_and_keys():
    meta = warm.pool_meta(Settings(separate_object_groups=False))
    assert meta == {"separate_object_groups": False, "key_version": 1, "object_layout": 2}
    assert "version" not in meta  # an upgrade keeps the pool


# ---- folders that cannot hold a pool ---------------------------------------------------------------
def serve(tmp_path, *args, timeout=60):
    sock = f"ipc://{tmp_path}/never.sock"
    return subprocess.run(
        serve_argv(*args, endpoint=sock, http_port=-1),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def refused(res, *needles) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    for needle in needles:
        assert needle in res.stderr, (needle, res.stderr)


def test_a_pool_dir_on_a_disk_filesystem_exits_2_naming_the_folder_and_filesystem(tmp_path, shm_dir):
    folder = str(tmp_path / "pool")
    fstype = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "-T", str(tmp_path)], capture_output=True, text=True
    ).stdout.strip()
    assert fstype and fstype != "tmpfs"
    refused(
        serve(tmp_path, "--pool-dir", folder),
        folder,
        f"is on {fstype}",
        "must be on tmpfs or hugetlbfs",
        "--pool-dir",
    )
    refused(
        serve(tmp_path, "--pool-dir", shm_dir, "--pool-index-dir", folder),  # shm_dir is removed afterwards
        folder,
        "index folder",
        "--pool-index-dir",
    )


def test_pool_index_dir_without_pool_dir_exits_2(tmp_path):
    refused(serve(tmp_path, "--pool-index-dir", "/dev/shm/x"), "--pool-index-dir needs --pool-dir")
    refused(serve(tmp_path, "--pool-dir", ""), "--pool-dir must name a path")


def test_hugetlbfs_without_a_tmpfs_index_dir_exits_2(tmp_path):
    point = tmp_path / "huge"
    point.mkdir()
    if subprocess.run(["mount", "-t", "hugetlbfs", "none", str(point)], capture_output=True).returncode:
        pytest.skip("cannot mount hugetlbfs here")
    try:
        refused(
            serve(tmp_path, "--pool-dir", str(point / "pool")),
            str(point / "pool"),
            "hugetlbfs",
            "give one on tmpfs",
        )
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_a_second_daemon_on_a_held_pool_dir_exits_2(daemon_factory, shm_dir, tmp_path):
    d = daemon_factory("--pool-dir", shm_dir)
    refused(serve(tmp_path, "--pool-dir", shm_dir), shm_dir, "held by another pool")
    assert d.status()["warm_restart"]["pool_dir"] == shm_dir  # the first one is untouched
