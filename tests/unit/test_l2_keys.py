"""L2 object names: identical on every node and in every process, one name per (namespace, page,
group, rank), plain ASCII that Mooncake takes as a key, and other names under another key
derivation or object layout, so a node never reads objects another version wrote."""

import os
import subprocess
import sys

import pytest

from tierd.tier2.keys import chunk_key, key_of, object_name

NS = bytes(range(16))
PAGE = bytes(range(100, 116))

SCRIPT = """
from tierd.tier2.keys import chunk_key, object_name
print(object_name(chunk_key(bytes(range(16)), bytes(range(100, 116)), 3, 1), "tierd"))
"""


OTHER_VERSION = """
import sys
import tierd.state.planner
import tierd.protocol.keys

tierd.protocol.keys.KEY_VERSION += int(sys.argv[1])
tierd.state.planner.OBJECT_LAYOUT_VERSION += int(sys.argv[2])
from tierd.tier2.keys import chunk_key, object_name
print(object_name(chunk_key(bytes(range(16)), bytes(range(100, 116)), 3, 1), "tierd"))
"""


def test_golden_name():
    # A change here breaks every store shared with nodes of the previous version: bump
    # tier2.keys.NAME_VERSION (or KEY_VERSION / OBJECT_LAYOUT_VERSION, which are part of the name).
    assert object_name(chunk_key(NS, PAGE, 3, 1), "tierd") == (
        "tierd/v3-k1-o2/000102030405060708090a0b0c0d0e0f6465666768696a6b6c6d6e6f7071727300030001"
    )


def name_under(key_bump: int, layout_bump: int) -> str:
    """The name a tierd whose KEY_VERSION / OBJECT_LAYOUT_VERSION differ by these bumps gives the
    same key bytes (another process: the versions are read when tierd.tier2.keys is imported)."""
    argv = [sys.executable, "-c", OTHER_VERSION, str(key_bump), str(layout_bump)]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def test_another_key_derivation_or_object_layout_names_the_same_key_otherwise():
    """Same key bytes, other meaning: a node of another key format (a PAGE hash or namespace id
    derived otherwise) or object layout must not find this version's objects, nor this one its."""
    here = object_name(chunk_key(NS, PAGE, 3, 1), "tierd")
    assert name_under(0, 0) == here  # the control: the same versions give the same name
    other_keys, other_layout = name_under(1, 0), name_under(0, 1)
    assert other_keys != here and other_layout != here and other_keys != other_layout
    key = chunk_key(NS, PAGE, 3, 1).hex()
    assert (other_keys, other_layout) == (f"tierd/v3-k2-o2/{key}", f"tierd/v3-k1-o3/{key}")


def test_same_name_in_other_processes_whatever_their_hash_seed():
    names = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        names.add(
            subprocess.run(
                [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True
            ).stdout
        )
    assert names == {object_name(chunk_key(NS, PAGE, 3, 1), "tierd") + "\n"}


def test_each_part_separates_names():
    base = chunk_key(NS, PAGE, 0, 0)
    others = [
        chunk_key(bytes(16), PAGE, 0, 0),
        chunk_key(NS, PAGE[:-1] + b"\0", 0, 0),
        chunk_key(NS, PAGE, 1, 0),
        chunk_key(NS, PAGE, 0, 1),
        chunk_key(NS, PAGE, -1, 0),
        chunk_key(NS, PAGE + b"x", 0, 0),
    ]
    assert len({base, *others}) == 1 + len(others)
    assert object_name(base, "a") != object_name(base, "b")


def test_group_minus_one_means_all_groups():
    assert chunk_key(NS, PAGE, -1, 2)[-4:] == b"\xff\xff\x00\x02"


def test_names_round_trip_and_are_ascii():
    key = chunk_key(NS, PAGE, 7, 9)
    name = object_name(key, "tierd")
    assert name.isascii() and name.isprintable() and key_of(name, "tierd") == key


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: chunk_key(NS[:8], PAGE, 0, 0), "16 bytes"),
        (lambda: chunk_key(NS, b"", 0, 0), "empty"),
        (lambda: chunk_key(NS, PAGE, -2, 0), "out of range"),
        (lambda: chunk_key(NS, PAGE, 0, -1), "out of range"),
        (lambda: object_name(b"", "tierd"), "1-96 bytes"),
        (lambda: object_name(b"x" * 97, "tierd"), "1-96 bytes"),
        (lambda: key_of("other/v3-k1-o2/00", "tierd"), "not a tierd v3-k1-o2"),
        (lambda: key_of("tierd/v2/00", "tierd"), "not a tierd v3-k1-o2"),
    ],
)
def test_bad_parts_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
