"""Pool folders for the warm-restart tests: a fresh folder on /dev/shm (tmpfs), a hugetlbfs
mount when the host has one with free huge pages, removed afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from tierd.pool import slabs
from tierd.pool.pooldir import HUGETLBFS_MAGIC, statfs

SLAB_BYTES = 256 << 10  # several size classes share a few MiB: slabs move between them


@pytest.fixture
def small_slabs(monkeypatch):
    monkeypatch.setattr(slabs, "SLAB_TARGET_BYTES", SLAB_BYTES)


@pytest.fixture
def shm_dir():
    path = f"/dev/shm/tierd-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def hugetlbfs_mount(min_free_bytes: int) -> str | None:
    """A hugetlbfs mount point (TIERD_TEST_HUGETLBFS, else the first in mountinfo) with room."""
    points = [os.environ["TIERD_TEST_HUGETLBFS"]] if os.environ.get("TIERD_TEST_HUGETLBFS") else []
    with open("/proc/self/mountinfo") as fh:
        points += [line.split()[4] for line in fh if " - hugetlbfs " in line]
    for point in points:
        try:
            magic, _ = statfs(point)
            st = os.statvfs(point)
        except OSError:
            continue
        if magic == HUGETLBFS_MAGIC and os.access(point, os.W_OK) and _free_huge(st) >= min_free_bytes:
            return point
    return None


def _free_huge(st: os.statvfs_result) -> int:
    if st.f_blocks:  # mounted with size=
        return st.f_bavail * st.f_bsize
    try:  # no size limit: the host's free pages of that size
        with open(f"/sys/kernel/mm/hugepages/hugepages-{st.f_bsize >> 10}kB/free_hugepages") as fh:
            return int(fh.read()) * st.f_bsize
    except OSError:
        return 0


@pytest.fixture
def huge_dir():
    point = hugetlbfs_mount(16 << 20)
    if point is None:
        pytest.skip("no writable hugetlbfs mount with 16 MiB of free huge pages")
    path = os.path.join(point, f"tierd-test-{uuid.uuid4().hex[:12]}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs():
    """A private 4 MiB tmpfs mount (needs CAP_SYS_ADMIN), for a pool folder that fills up."""
    point = f"/dev/shm/tierd-small-{uuid.uuid4().hex[:12]}"
    os.makedirs(point)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", point], capture_output=True)
    if mount.returncode:
        os.rmdir(point)
        pytest.skip("cannot mount a tmpfs here")
    yield point
    subprocess.run(["umount", "-l", point], check=True)
    os.rmdir(point)
