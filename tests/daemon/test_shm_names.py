"""The CPU path's shared memory as an engine meets it: the KV tensors are shared in place without
touching process-wide state, have no /dev/shm name once the daemon has mapped them (so nothing
can outlive the engine), and a restarted daemon maps them again."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")


def _missing(self):
    raise AttributeError("_share_filename_cpu_")


def our_shm_names(pid: int | None = None) -> list[str]:
    """/dev/shm entries this process (or ``pid``) made: torch's named files (and links of old
    tierd versions)."""
    pid = os.getpid() if pid is None else pid
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith((f"torch_{pid}_", f"tierd-kv-{pid}-")))


@pytest.mark.parametrize(
    "per_storage_method", [True, False], ids=["torch-with-share-filename", "torch-without"]
)
def test_sharing_kv_tensors_leaves_the_process_sharing_strategy_alone(monkeypatch, per_storage_method):
    """torch.multiprocessing's strategy belongs to the engine (vLLM, its data loaders): sharing
    the KV cache must not switch it, whichever per-storage methods this torch has."""
    import torch.multiprocessing as mp

    from tierd_client.shm import share_torch_tensors

    if not per_storage_method:  # hide it (a data descriptor on the subclass shadows the C method)
        monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", property(_missing), raising=False)
    before = mp.get_sharing_strategy()
    kv = torch.zeros((64, 16, 8), dtype=torch.int8)
    error = None
    try:
        share_torch_tensors([kv[:32], kv[32:]])
    except Exception as exc:  # noqa: BLE001 - judged below, after the strategy
        error = exc
    strategy = mp.get_sharing_strategy()
    mp.set_sharing_strategy(before)
    assert strategy == before, f"sharing the KV cache switched torch.multiprocessing to {strategy!r}"
    assert error is None and kv.untyped_storage().is_shared()


def test_shared_kv_views_keep_working_and_are_handed_over_as_descriptors(client):
    from tierd_client.layouts import block_span, group, layout, namespace
    from tierd_client.shm import share_torch_tensors

    kv = torch.arange(4096, dtype=torch.int32).reshape(64, 64)
    view = kv[8:16]
    refs, where, pub = share_torch_tensors([kv[:32], kv[32:]])
    assert kv.untyped_storage().is_shared()
    assert view[0, 0].item() == 8 * 64  # the engine's own views follow the moved storage
    kv[8, 0] = -1
    assert view[0, 0].item() == -1
    assert len(refs) == 1 and where == [(0, 0), (0, 32 * 64 * 4)]
    handle = refs[0]["handle"]
    assert handle["kind"] == "fd" and handle["index"] == 0 and len(handle["ticket"]) == 16
    assert our_shm_names() == []  # no name, ever
    # the daemon copies from the descriptor: block 8 (one row of 256 bytes) stored, then restored into row 40
    spans = [block_span((64, 256), (256, 1), 1, 0, tensor=0, offset=0)]
    lay = layout(namespace("m", "shm-names"), 0, 4, refs, [group("full", 4, spans)])
    client.register("r", lay, publish=pub)
    assert our_shm_names() == []
    key = b"k" * 16
    assert client.store("r", [{"key": key, "blocks": [[8]]}]).results == ["stored"]
    assert client.retrieve("r", [{"key": key, "blocks": [[40]]}]).ok == [True]
    assert kv[40, 0].item() == -1 and torch.equal(kv[40], kv[8])


pytest.importorskip("vllm")
from vllm_sim import GroupDef, SimEngine  # noqa: E402

CHUNK = 64


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def daemon_shm_files(daemon) -> list[str]:
    """The /dev/shm files the daemon holds open (it copies with preadv/pwritev on fds, no mapping)."""
    out = set()
    for fd in os.listdir(f"/proc/{daemon.proc.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon.proc.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            out.add(target)
    return sorted(out)


def test_registered_kv_memory_has_no_name_and_the_daemon_still_copies_it(tiny_model, daemon):
    tokens = prompt(200, seed=61)
    a = SimEngine(tiny_model, daemon.endpoint, [GroupDef("full")], chunk_tokens=CHUNK)
    b = None
    try:
        assert len(daemon.status()["instances"]) == 1  # registered
        assert our_shm_names() == [], "the KV cache has a /dev/shm name after REGISTER"
        assert any(m.endswith("(deleted)") for m in daemon_shm_files(daemon))  # held open, by no name
        a.add("a", tokens)
        a.run()
        b = SimEngine(tiny_model, daemon.endpoint, [GroupDef("full")], chunk_tokens=CHUNK)
        b.add("b", tokens)
        b.run()
        assert b.first_computed("b") == 3 * CHUNK
        b.assert_restored("b", tokens, 3 * CHUNK)
        assert our_shm_names() == []
    finally:
        a.close()
        if b is not None:
            b.close()
    assert our_shm_names() == []


def test_a_restarted_daemon_maps_the_kv_memory_again(tiny_model, daemon):
    """After a daemon restart the client re-REGISTERs; the memory gets a name again only for
    that REGISTER, and the new daemon reads and writes the same bytes."""
    tokens = prompt(200, seed=62)
    a = SimEngine(tiny_model, daemon.endpoint, [GroupDef("full")], chunk_tokens=CHUNK)
    b = None
    try:
        a.add("warm", prompt(80, seed=63))
        a.run()
        daemon.restart()
        # the client reconnects, says HELLO and re-REGISTERs through the publication (stores made
        # while it is still reconnecting are lost, a future miss: wait for it, as a later step would)
        deadline = time.monotonic() + 10
        while len(daemon.status()["instances"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(daemon.status()["instances"]) == 1, "the engine did not re-register with the new daemon"
        a.add("a", tokens)
        a.run()  # its STOREs meet the new daemon: HELLO, re-REGISTER, STORE
        assert daemon.status()["stored_chunks"] >= 3, "the re-registered engine stored nothing"
        assert our_shm_names() == []
        b = SimEngine(tiny_model, daemon.endpoint, [GroupDef("full")], chunk_tokens=CHUNK)
        b.add("b", tokens)
        b.run()
        assert b.first_computed("b") == 3 * CHUNK
        b.assert_restored("b", tokens, 3 * CHUNK)
    finally:
        a.close()
        if b is not None:
            b.close()
