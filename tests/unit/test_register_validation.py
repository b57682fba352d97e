"""REGISTER validates a layout before mapping anything: blocks that reach past their tensor,
tensors larger than their shared-memory file, paths outside /dev/shm and inconsistent geometry
are LAYOUT_INVALID (wrong types and ranges BAD_REQUEST); nothing is registered, and the session
keeps working. The daemon's objects in this process (tests/inproc.py): requests as a client frames
them, answered by its handlers."""

import copy

import pytest
from kv import GroupGeom, keys
from util import chunk, ranks  # noqa: F401 - fixtures


def mutations(tmp_path):
    outside = tmp_path / "not-shm"
    outside.write_bytes(b"\0" * (1 << 20))

    def tensor(lay, **handle):
        lay["tensors"][0]["handle"].update(handle)

    def layer(lay, **span):
        lay["groups"][0]["layers"][-1].update(span)

    return {
        "blocks past the tensor": (lambda l: layer(l, num_blocks=65), "LAYOUT_INVALID"),
        "offset past the tensor": (lambda l: layer(l, offset=l["tensors"][0]["nbytes"]), "LAYOUT_INVALID"),
        "run past the tensor": (lambda l: layer(l, run_bytes=1 << 30), "LAYOUT_INVALID"),
        "tensor larger than its file": (
            lambda l: l["tensors"][0].update(nbytes=l["tensors"][0]["nbytes"] + 1),
            "LAYOUT_INVALID",
        ),
        "handle offset past the file": (lambda l: tensor(l, offset=4096), "LAYOUT_INVALID"),
        "negative handle offset": (lambda l: tensor(l, offset=-1), "LAYOUT_INVALID"),
        "path outside /dev/shm": (lambda l: tensor(l, path=str(outside)), "LAYOUT_INVALID"),
        "path escaping /dev/shm": (
            lambda l: tensor(l, path="/dev/shm/../../" + str(outside)),
            "LAYOUT_INVALID",
        ),
        "missing shm file": (
            lambda l: tensor(l, path="/dev/shm/tierd-test-does-not-exist"),
            "LAYOUT_INVALID",
        ),
        "shm path with NUL": (lambda l: tensor(l, path="/dev/shm/tierd\x00x"), "LAYOUT_INVALID"),
        "shm path not a string": (lambda l: tensor(l, path=7), "LAYOUT_INVALID"),
        "cuda handle on a cpu layout": (
            lambda l: l["tensors"][0].update(handle={"kind": "cuda_ipc"}),
            "LAYOUT_INVALID",
        ),
        "cuda layout on a cpu daemon": (lambda l: l.update(device="cuda"), "LAYOUT_INVALID"),
        "tensor index out of range": (lambda l: layer(l, tensor=5), "LAYOUT_INVALID"),
        "chunk not a multiple of blocks": (lambda l: l.update(chunk_tokens=18), "LAYOUT_INVALID"),
        "overlapping runs": (lambda l: layer(l, runs=2, run_stride=8), "LAYOUT_INVALID"),
        "unequal block bytes": (lambda l: layer(l, run_bytes=128), "LAYOUT_INVALID"),
        "rank outside the world": (lambda l: l.update(rank=1), "BAD_REQUEST"),
        "sliding without window": (
            lambda l: l["groups"][0].update(kind="sliding", window_tokens=0),
            "BAD_REQUEST",
        ),
        "unknown group kind": (lambda l: l["groups"][0].update(kind="mamba"), "BAD_REQUEST"),
        "no tensors": (lambda l: l.update(tensors=[]), "BAD_REQUEST"),
        "no groups": (lambda l: l.update(groups=[]), "BAD_REQUEST"),
        "zero block stride": (lambda l: layer(l, block_stride=0), "BAD_REQUEST"),
        "empty model": (lambda l: l["namespace"].update(model=""), "BAD_REQUEST"),
        "layout not a map": (lambda l: l.clear() or l.update(x=1), "BAD_REQUEST"),
    }


def test_bad_layouts_are_refused(inproc, inraw, ranks, tmp_path):
    rank = ranks(GroupGeom("full", layers=2, block_bytes=256), num_blocks=64)
    r = inraw(inproc)
    r.hello()
    good = rank.layout()
    for name, (mutate, code) in mutations(tmp_path).items():
        lay = copy.deepcopy(good)
        mutate(lay)
        assert r.error("REGISTER", {"instance": "x", "layout": lay}) == code, name
    assert r.error("REGISTER", {"instance": "", "layout": good}) == "BAD_REQUEST"
    st = inproc.status()
    assert st["instances"] == [] and st["errors_by_code"].get("INTERNAL", 0) == 0
    # the session still works, and the good layout registers and round-trips
    r.ok("REGISTER", {"instance": "x", "layout": good})
    k = keys(1)[0]
    assert r.ok("STORE", {"instance": "x", "chunks": [chunk(k, range(4))]})["results"] == ["stored"]


def test_shm_path_with_nul_is_layout_invalid(inproc, inraw, ranks):
    """Regression: a NUL byte in a shm path made os.open raise ValueError, answered INTERNAL."""
    rank = ranks(GroupGeom("full"))
    r = inraw(inproc)
    r.hello()
    lay = rank.layout()
    lay["tensors"][0]["handle"]["path"] = rank.bufs[0].path + "\x00.tail"
    ok, reply = r.call("REGISTER", {"instance": "x", "layout": lay})
    assert not ok and reply["code"] == "LAYOUT_INVALID"
    assert "INTERNAL" not in inproc.status()["errors_by_code"]


def test_reregister_same_layout_is_idempotent_and_new_layout_replaces(inproc, inraw, ranks):
    a, b = ranks(GroupGeom("full")), ranks(GroupGeom("full", block_bytes=512))
    r = inraw(inproc)
    r.hello()
    first = r.ok("REGISTER", {"instance": "x", "layout": a.layout()})
    assert r.ok("REGISTER", {"instance": "x", "layout": a.layout()}) == first
    assert len(inproc.status()["instances"]) == 1
    k = keys(1)[0]
    r.ok("STORE", {"instance": "x", "chunks": [chunk(k, range(4))]})
    second = r.ok("REGISTER", {"instance": "x", "layout": b.layout()})
    assert second["object_bytes"] == [2 * 4 * 512] and first["object_bytes"] == [2 * 4 * 256]
    st = inproc.status()
    assert len(st["instances"]) == 1 and st["instances"][0]["namespace"]["fingerprint"] == b.fingerprint


@pytest.mark.parametrize("bad", [{"instance": 3}, {"instance": "x" * 300}, {"instance": "a\x00b"}, {}])
def test_bad_instance_names(inproc, inraw, ranks, bad):
    rank = ranks(GroupGeom("full"))
    r = inraw(inproc)
    r.hello()
    assert r.error("REGISTER", {"layout": rank.layout(), **bad}) == "BAD_REQUEST"
