"""Huge pages for the memory every copy goes through: the pool's segments, the daemon's mapping of
an engine's buffer and the client's shared buffers are advised MADV_HUGEPAGE (the kernel grants
them where its setting for shared memory allows), and the setting that decides it is read right
(``tierd.pool.pages.huge_pages``: what /status and the start-up log report)."""

from __future__ import annotations

import os

import pytest

from tierd.pool import pages
from tierd.pool.segments import Segment
from tierd.transfer import mapcopy
from tierd_client.shm import SharedBuffer

THP = "/sys/kernel/mm/transparent_hugepage"


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


needs_thp = pytest.mark.skipif(not os.path.isdir(THP), reason="the kernel has no transparent huge pages")


@needs_thp
def test_pool_segments_engine_buffers_and_shared_buffers_are_mapped_with_huge_page_advice():
    seg = Segment(0, 4 << 20, None)
    buf = SharedBuffer(4 << 20)
    assert mapcopy.load() is not None, "the guarded copy did not build (is there a C compiler?)"
    fd = os.open(buf.path, os.O_RDWR)
    addr = mapcopy.map_file(fd, 4 << 20)  # how the daemon maps an engine's buffer
    try:
        assert "hg" in vm_flags(seg.addr), "the pool's segment is not advised huge pages"
        assert "hg" in vm_flags(buf.array.ctypes.data), "the client's shared buffer is not advised"
        assert "hg" in vm_flags(addr), "the daemon's mapping of an engine buffer is not advised"
    finally:
        mapcopy.unmap(addr, 4 << 20)
        os.close(fd)
        buf.close()
        seg.close(None)


def write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


MOUNTS = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:23 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,size=1024k
26 22 0:24 / /mnt/pool rw,relatime shared:5 - tmpfs tmpfs rw,size=8g,huge=within_size,mode=700
27 26 0:25 / /mnt/pool/plain rw,relatime shared:6 - tmpfs tmpfs rw,size=1g
"""


def test_the_huge_page_setting_is_memfds_or_the_pool_folders_mount_option(tmp_path):
    mounts = write(tmp_path, "mountinfo", MOUNTS)

    def huge(setting: str, folder: str | None) -> str:  # (a line of shmem_enabled, the pool's folder)
        thp = write(tmp_path, "shmem_enabled", setting)
        return pages.huge_pages(folder, thp=thp, mountinfo=mounts)

    assert huge("always within_size [advise] never deny force\n", None) == "advise"
    assert huge("always within_size advise [never] deny force\n", None) == "never"
    # a folder: its own tmpfs mount's huge=, the deepest mount that holds it; none said: never
    assert huge("always within_size [advise] never deny force\n", "/mnt/pool/tierd") == "within_size"
    assert huge("always within_size [advise] never deny force\n", "/mnt/pool/plain/x") == "never"
    assert huge("always within_size [advise] never deny force\n", "/dev/shm/tierd") == "never"
    assert huge("always within_size [advise] never deny force\n", "/mnt/poolx") == "never"  # not /mnt/pool's
    # deny and force override every mount's option
    assert huge("always within_size advise never [deny] force\n", "/mnt/pool/tierd") == "deny"
    assert huge("always within_size advise never deny [force]\n", "/dev/shm/tierd") == "force"
    assert pages.huge_pages(None, thp=str(tmp_path / "absent")) == "unsupported"
    assert {"never", "deny", "unsupported"} <= set(pages.SMALL_PAGES) and "advise" not in pages.SMALL_PAGES
