"""A pool folder written under another format is never served by ``tierd serve --pool-dir``: an
index that another key derivation (KEY_VERSION), object byte layout (OBJECT_LAYOUT_VERSION) or
index format wrote, rewritten here the way that version writes it, starts the daemon cold with
one log line naming what it found and what it expects, and not one byte of the old files is
served. The control: the same index rewritten with this version's values is served warm."""

import os
import struct
from hashlib import blake2b

import msgpack
import pytest
from pool_dirs import shm_dir  # noqa: F401 - fixture
from test_warm_restart_cold import restarted_cold, stored_then_stopped
from util import ranks  # noqa: F401 - fixture
from wire import wait_for

from tierd.pool.model import FORMAT, MAGIC
from tierd.protocol.keys import KEY_VERSION
from tierd.state.planner import OBJECT_LAYOUT_VERSION

HEAD = struct.Struct("<8sIIQ")  # the index header, as tierd.pool.persist documents it
SUM = 32  # blake2b-256 of the header and the body, after the header


def rewrite_index(path: str, fmt: int = FORMAT, **settings) -> None:
    """Write the index again as a tierd whose index format is ``fmt`` and whose settings differ by
    ``settings`` would have written it: same objects, a valid checksum."""
    with open(path, "rb") as fh:
        data = fh.read()
    magic, _, zero, length = HEAD.unpack_from(data)
    assert magic == MAGIC and len(data) == HEAD.size + SUM + length
    body = msgpack.unpackb(data[HEAD.size + SUM :], raw=False)
    assert set(settings) <= set(body["settings"]), body["settings"]
    body["settings"].update(settings)
    packed = msgpack.packb(body, use_bin_type=True)
    head = HEAD.pack(magic, fmt, zero, len(packed))
    with open(path, "wb") as fh:
        fh.write(head + blake2b(head + packed, digest_size=SUM).digest() + packed)


@pytest.mark.parametrize(
    "written_by, reason",
    [
        (  # a newer tierd wrote the folder, then was downgraded
            {"meta.key_version": KEY_VERSION + 1},
            f"settings changed: meta.key_version {KEY_VERSION + 1} -> {KEY_VERSION}",
        ),
        (  # an older tierd laid objects out otherwise
            {"meta.object_layout": OBJECT_LAYOUT_VERSION - 1},
            f"settings changed: meta.object_layout {OBJECT_LAYOUT_VERSION - 1} -> {OBJECT_LAYOUT_VERSION}",
        ),
        (  # an older tierd wrote another index format
            {"fmt": FORMAT - 1},
            f"index format {MAGIC!r}/{FORMAT - 1}, this tierd reads {MAGIC!r}/{FORMAT}",
        ),
    ],
    ids=["next-key-version", "older-object-layout", "older-index-format"],
)
def test_a_pool_folder_of_another_format_starts_cold_with_one_line_and_serves_no_byte(
    daemon_factory, client_factory, ranks, shm_dir, written_by, reason
):
    d, c, rank, ks = stored_then_stopped(daemon_factory, client_factory, ranks, shm_dir)
    rewrite_index(os.path.join(shm_dir, "index"), **written_by)
    before = len(d.log.read_text())
    d.start()
    assert d.status()["warm_restart"]["reason"] == reason
    restarted_cold(d, c, rank, ks, reason)  # nothing looked up or restored, not one byte written
    said = [ln for ln in d.log.read_text()[before:].splitlines() if "starts cold" in ln]
    assert len(said) == 1 and said[0].endswith(f"pool {shm_dir} starts cold: {reason}"), said


def test_the_same_index_rewritten_with_this_versions_values_is_served_warm(
    daemon_factory, client_factory, ranks, shm_dir
):
    """The control: the rewrite itself keeps the folder valid, so only the versions above made
    those starts cold."""
    d, c, rank, ks = stored_then_stopped(daemon_factory, client_factory, ranks, shm_dir)
    rewrite_index(
        os.path.join(shm_dir, "index"),
        **{"meta.key_version": KEY_VERSION, "meta.object_layout": OBJECT_LAYOUT_VERSION},
    )
    before = len(d.log.read_text())
    d.start()
    wr = d.status()["warm_restart"]
    assert wr["warm"] is True and wr["objects"] == 12, wr
    assert "starts cold" not in d.log.read_text()[before:]
    wait_for(lambda: d.status()["instances"], 10, what="re-registration")
    assert c.lookup(rank.ns, ks, rank.specs(), rank.chunk_tokens, lease=False).chunks == 6
