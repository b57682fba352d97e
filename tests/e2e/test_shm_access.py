"""The daemon opens only what the client could open read-write itself, and no client file can
crash it (tierd.transfer.shm, tierd.transfer.cpu), against a real daemon running as root.

Each refusal is LAYOUT_INVALID naming the tensor, the path and the reason, and comes with its
negative control: the same REGISTER by the file's owner, of a proper file, succeeds. Clients of
another user are forked processes that really run as a throwaway user (the daemon takes the uid
from the connection, SO_PEERCRED), so these tests need root and skip without it.

A REGISTER's memory is opened by the daemon's ``Tier.open_memory`` (tierd.daemon.assemble.MemoryOpener),
which hands CpuRankMemory the connection's credentials (tierd.edge.peer.Peer). The negative controls of
another user's own file test that: were the credentials not passed, the root daemon would check
the file against its own uid 0, refuse it, and the control would fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import DaemonProcess, free_port
from kv import GroupGeom, keys
from users import make_user, run_as, shared_socket_dir  # noqa: F401 - fixture
from util import chunk, ids, ranks, raw  # noqa: F401 - fixtures
from wire import Raw, wait_for

from tierd.edge.peer import Peer
from tierd.protocol.errors import ProtocolError
from tierd.protocol.layout import PageLayout
from tierd.transfer.cpu import CpuRankMemory
from tierd_client.layouts import block_span, group, layout, namespace

BLOCKS, BLOCK = 64, 256

NBYTES = 2 * BLOCKS * BLOCK  # two layers


def kv_layout(path: str, nbytes: int = NBYTES) -> dict:
    spans = [
        block_span((BLOCKS, BLOCK), (BLOCK, 1), 1, 0, tensor=0, offset=li * BLOCKS * BLOCK) for li in range(2)
    ]
    tensors = [{"handle": {"kind": "shm", "path": path, "offset": 0}, "nbytes": nbytes}]
    return layout(namespace("test-model", uuid.uuid4().hex[:8]), 0, 16, tensors, [group("full", 4, spans)])


class Shm:
    """Things made under /dev/shm for one test (files, links, folders, fifos, mounts), removed after."""

    def __init__(self):
        self.tag = f"/dev/shm/tierd-test-acc-{uuid.uuid4().hex[:8]}"
        self.made: list[str] = []
        self.mounts: list[str] = []

    def name(self, what: str) -> str:
        return f"{self.tag}-{what}"

    def file(self, path: str, owner=None, mode: int = 0o600, nbytes: int = NBYTES) -> str:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.ftruncate(fd, nbytes)
            os.pwrite(fd, np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8).tobytes(), 0)
            if owner is not None:
                os.fchown(fd, owner.uid, owner.gid)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        self.made.append(path)
        return path

    def link(self, path: str, target: str, owner=None) -> str:
        os.symlink(target, path)
        if owner is not None:
            os.lchown(path, owner.uid, owner.gid)
        self.made.append(path)
        return path

    def folder(self, path: str, owner=None, mode: int = 0o755) -> str:
        os.mkdir(path, mode)
        if owner is not None:
            os.chown(path, owner.uid, owner.gid)
        self.made.append(path)
        return path

    def mount(self, fstype: str, path: str) -> str:
        self.folder(path)
        if subprocess.run(["mount", "-t", fstype, "none", path], capture_output=True).returncode != 0:
            pytest.skip(f"cannot mount {fstype} here")
        self.mounts.append(path)
        return path

    def cleanup(self) -> None:
        for path in reversed(self.mounts):
            subprocess.run(["umount", "-l", path], capture_output=True)
        for path in reversed(self.made):
            if os.path.islink(path) or not os.path.isdir(path):
                if os.path.lexists(path):
                    os.unlink(path)
            else:
                shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm():
    s = Shm()
    yield s
    s.cleanup()


def register(endpoint: str, lay: dict) -> tuple[bool, dict]:
    """HELLO and REGISTER on a fresh connection (in whichever process, as whichever user, runs it)."""
    r = Raw(endpoint)
    try:
        r.hello()
        return r.call("REGISTER", {"instance": "x", "layout": lay})
    finally:
        r.close()


def register_as(user, d: DaemonProcess, path: str) -> tuple[bool, dict]:
    return run_as(user, register, d.endpoint, kv_layout(path))


def refused(result: tuple[bool, dict], *words: str) -> str:
    ok, reply = result
    assert not ok, f"REGISTER succeeded: {reply}"
    assert reply["code"] == "LAYOUT_INVALID", reply
    for w in ("layout.tensors[0]", *words):
        assert w in reply["message"], f"{w!r} not in {reply['message']!r}"
    return reply["message"]


def accepted(result: tuple[bool, dict]) -> None:
    ok, reply = result
    assert ok, f"REGISTER refused: {reply}"


# ---- the path -------------------------------------------------------------------------------------
def test_a_symlink_as_the_last_component_is_refused(xdaemon, make_user, shm):
    """Was: an unprivileged client's link made the root daemon read /etc/hostname and a root file."""
    user = make_user()
    root_file = shm.file(shm.name("root"))
    for target in ("/etc/hostname", root_file):
        link = shm.link(shm.name(f"link{len(shm.made)}"), target, owner=user)
        refused(register_as(user, xdaemon, link), link, "symlink")
    accepted(register_as(user, xdaemon, shm.file(shm.name("own"), owner=user)))


def test_a_symlinked_folder_in_the_path_is_refused(xdaemon, make_user, shm):
    user = make_user()
    real = shm.folder(shm.name("dir"), owner=user)
    own = shm.file(f"{real}/kv", owner=user)
    for target, name in (("/etc", "hostname"), (real, "kv")):  # even a link to the client's own folder
        link = shm.link(shm.name(f"dirlink{len(shm.made)}"), target, owner=user)
        refused(register_as(user, xdaemon, f"{link}/{name}"), link, "symlink")
    accepted(register_as(user, xdaemon, own))  # a real folder is fine


def test_a_symlinked_subfolder_is_refused(xdaemon, make_user, shm):
    user = make_user()
    top = shm.folder(shm.name("top"), owner=user)
    secret_dir = shm.folder(shm.name("rootonly"), mode=0o700)
    shm.file(f"{secret_dir}/secret")
    shm.link(f"{top}/sub", secret_dir, owner=user)
    refused(register_as(user, xdaemon, f"{top}/sub/secret"), f"{top}/sub", "symlink")
    shm.folder(f"{top}/realsub", owner=user)
    accepted(register_as(user, xdaemon, shm.file(f"{top}/realsub/kv", owner=user)))


def test_a_file_of_another_user_is_refused(xdaemon, make_user, shm):
    owner, other = make_user(), make_user()
    theirs = shm.file(shm.name("theirs"), owner=owner, mode=0o666)  # even world-writable: not the client's
    msg = refused(register_as(other, xdaemon, theirs), theirs)
    assert f"owned by uid {owner.uid}, not the client's uid {other.uid}" in msg
    accepted(register_as(owner, xdaemon, theirs))


def test_a_root_only_file_reached_through_a_symlink_is_refused(xdaemon, make_user, shm, tmp_path):
    """Was: the daemon read a root-only 0600 file for an unprivileged client."""
    user = make_user()
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * NBYTES)
    secret.chmod(0o600)
    shm_secret = shm.file(shm.name("rootsecret"))
    for target in (str(secret), shm_secret):
        link = shm.link(shm.name(f"l{len(shm.made)}"), target, owner=user)
        refused(register_as(user, xdaemon, link), "symlink")
    refused(register_as(user, xdaemon, shm_secret), "owned by uid 0")  # by its own name: not the client's
    accepted(register(xdaemon.endpoint, kv_layout(shm_secret)))  # root, its owner, may


def test_a_file_whose_owner_cannot_write_it_is_refused(xdaemon, make_user, shm):
    user = make_user()
    read_only = shm.file(shm.name("ro"), owner=user, mode=0o400)
    refused(register_as(user, xdaemon, read_only), "permission", "0400")
    os.chmod(read_only, 0o600)
    accepted(register_as(user, xdaemon, read_only))


def test_proc_paths_are_refused(xdaemon, make_user, shm, raw, ranks):
    """Was: a client read the daemon's pool memfd (every tenant's KV) through /proc."""
    user = make_user()
    r = raw(xdaemon)  # make the pool hold a segment
    r.hello()
    rank = ranks(GroupGeom("full"))
    r.ok("REGISTER", {"instance": "seed", "layout": rank.layout()})
    assert r.ok("STORE", {"instance": "seed", "chunks": [chunk(keys(1)[0], ids(0))]})["results"] == ["stored"]
    pid = xdaemon.proc.pid
    memfd = next(fd for fd, target in daemon_fds(xdaemon).items() if target.startswith("/memfd:"))
    for path in (f"/proc/{pid}/fd/{memfd}", "/proc/self/fd/0", f"/dev/shm/../proc/{pid}/fd/{memfd}"):
        refused(register_as(user, xdaemon, path), path)
    link = shm.link(shm.name("memfd"), f"/proc/{pid}/fd/{memfd}", owner=user)
    refused(register_as(user, xdaemon, link), "symlink")
    link = shm.link(shm.name("self"), "/proc/self/fd/3", owner=user)
    refused(register_as(user, xdaemon, link), "symlink")
    # the connector's way to share memory with no name: its descriptor, handed over (tierd_client.fdpass)
    accepted(run_as(user, publish_and_register, xdaemon.endpoint, shm.name("pub")))


def publish_and_register(endpoint: str, base: str) -> tuple[bool, dict]:
    """As tierd_client.shm does: an unlinked /dev/shm file of ours, handed to the daemon as an fd."""
    from tierd_client import fdpass

    fd = os.open(base + "-file", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, NBYTES)
        os.unlink(base + "-file")
        ticket = fdpass.new_ticket()
        fdpass.send_fds(endpoint, ticket, [fd])
        return register(endpoint, kv_layout_fd(ticket))
    finally:
        os.close(fd)


def kv_layout_fd(ticket: bytes, index: int = 0) -> dict:
    lay = kv_layout("")
    lay["tensors"] = [
        {"handle": {"kind": "fd", "ticket": ticket, "index": index, "offset": 0}, "nbytes": NBYTES}
    ]
    return lay


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_file_that_is_not_regular_is_refused(xdaemon, make_user, shm, kind):
    user = make_user()
    path = shm.name(kind)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        os.chown(path, user.uid, user.gid)
        shm.made.append(path)
    else:
        shm.folder(path, owner=user)
    what = "a fifo" if kind == "fifo" else "a directory"
    refused(register_as(user, xdaemon, path), "not a regular file", what)
    assert xdaemon.proc.poll() is None  # answered at once: nothing was opened for I/O (a fifo would block)
    accepted(register_as(user, xdaemon, shm.file(shm.name("own"), owner=user)))


def test_a_file_on_another_filesystem_mounted_under_dev_shm_is_refused(daemon, shm):
    ram = shm.mount("ramfs", shm.name("ramfs"))
    path = shm.file(f"{ram}/kv")
    refused(register(daemon.endpoint, kv_layout(path)), "not on tmpfs", "ramfs")
    tmp = shm.mount("tmpfs", shm.name("tmpfs"))  # a tmpfs mounted under /dev/shm is still shared memory
    accepted(register(daemon.endpoint, kv_layout(shm.file(f"{tmp}/kv"))))


def test_a_folder_the_client_cannot_search_is_refused(xdaemon, make_user, shm):
    user = make_user()
    closed = shm.folder(shm.name("closed"), mode=0o700)  # root's
    own = shm.file(f"{closed}/kv", owner=user)
    refused(register_as(user, xdaemon, own), "not searchable", closed)
    os.chmod(closed, 0o711)
    accepted(register_as(user, xdaemon, own))


# ---- a file that changes under the daemon ----------------------------------------------------------
def test_truncating_the_file_fails_store_and_retrieve_with_a_typed_error(daemon, raw, ranks):
    """Was: SIGBUS at the next copy; every client lost every object."""
    victim, bystander = ranks(GroupGeom("full")), ranks(GroupGeom("full"))
    a, b = raw(daemon), raw(daemon)
    a.hello()
    b.hello()
    b.ok("REGISTER", {"instance": "b", "layout": bystander.layout()})
    kb = keys(2)
    assert b.ok("STORE", {"instance": "b", "chunks": [chunk(kb[0], ids(0))]})["results"] == ["stored"]
    path = victim.bufs[0].path
    full = os.stat(path).st_size
    k = keys(2)
    for op in ("STORE", "RETRIEVE"):
        os.truncate(path, full)
        a.ok("REGISTER", {"instance": "a", "layout": victim.layout()})
        a.ok("STORE", {"instance": "a", "chunks": [chunk(k[0], ids(0))]})
        os.truncate(path, full // 4)  # the second layer, and the end of the first, are gone
        key = k[0] if op == "RETRIEVE" else k[1]
        try:
            ok, reply = a.call(op, {"instance": "a", "chunks": [chunk(key, ids(8))]}, timeout=5)
        except TimeoutError:
            pytest.fail(f"no reply to {op}: the daemon exited with {daemon.proc.wait(5)} (-7: SIGBUS)")
        assert not ok and reply["code"] == "DEVICE_ERROR", reply
        assert "layout.tensors[0]" in reply["message"] and f"has {full // 4} bytes" in reply["message"], reply
        assert os.stat(path).st_size == full // 4, "the daemon grew the client's file"
        assert daemon.proc.poll() is None
        # another client goes on: it stores and gets its bytes back
        b.ok("STORE", {"instance": "b", "chunks": [chunk(kb[1], ids(4))]})
        before = bystander.blocks(0, ids(0))
        bystander.kv[0][:, 40:44] = 0
        assert b.ok("RETRIEVE", {"instance": "b", "chunks": [chunk(kb[0], ids(40))]})["ok"] == [True]
        assert np.array_equal(bystander.blocks(0, ids(40)), before)
    st = daemon.status()
    assert st["errors_by_code"].get("INTERNAL", 0) == 0


# ---- descriptors ---------------------------------------------------------------------------------
def daemon_fds(d: DaemonProcess) -> dict[str, str]:
    """fd -> what it is, of the daemon process."""
    out = {}
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            out[fd] = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
        except OSError:
            pass
    return out


def test_a_thousand_tensors_in_one_file_hold_one_fd(daemon, raw, shm):
    """Was: one fd per tensor (4096 per REGISTER; 11 REGISTERs took all 20k fds)."""
    n, per = 1000, BLOCKS * 64  # 1000 tensors of 64 blocks of 64 bytes, one layer each, one file
    path = shm.file(shm.name("many"), nbytes=n * per)
    tensors = [{"handle": {"kind": "shm", "path": path, "offset": i * per}, "nbytes": per} for i in range(n)]
    spans = [block_span((BLOCKS, 64), (64, 1), 1, 0, tensor=i, offset=0) for i in range(n)]
    lay = layout(namespace("test-model", uuid.uuid4().hex[:8]), 0, 16, tensors, [group("full", 4, spans)])
    r = raw(daemon)
    r.hello()
    before = daemon_fds(daemon)
    r.ok("REGISTER", {"instance": "many", "layout": lay})
    after = daemon_fds(daemon)
    assert len(after) == len(before) + 1 and list(after.values()).count(path) == 1
    # and the shared fd serves every tensor: blocks 0-3 of every layer come back into blocks 8-11
    k = keys(1)[0]
    assert r.ok("STORE", {"instance": "many", "chunks": [chunk(k, ids(0))]})["results"] == ["stored"]
    assert r.ok("RETRIEVE", {"instance": "many", "chunks": [chunk(k, ids(8))]})["ok"] == [True]
    data = np.fromfile(path, dtype=np.uint8).reshape(n, BLOCKS, 64)
    assert np.array_equal(data[:, 8:12], data[:, 0:4])
    r.ok("UNREGISTER", {"instance": "many"})
    wait_for(lambda: path not in daemon_fds(daemon).values(), 5, what="the file closed after UNREGISTER")


def test_refusals_leave_no_descriptor_behind(daemon, raw, shm):
    """Nor does a layout whose first tensor opened and whose second was refused."""
    folder = shm.folder(shm.name("dir"))
    bad = [
        shm.link(shm.name("link"), "/etc/hostname"),
        f"{shm.link(shm.name('dl'), folder)}/x",
        folder,
        shm.file(shm.name("ro"), mode=0o400),
        shm.file(shm.name("short"), nbytes=100),
        "/dev/shm/tierd-test-none",
    ]
    good = shm.file(shm.name("good"))
    r = raw(daemon)
    r.hello()
    before = daemon_fds(daemon)
    for _ in range(20):
        for path in bad:
            lay = kv_layout(good)
            lay["tensors"].append(kv_layout(path)["tensors"][0])
            assert r.error("REGISTER", {"instance": "x", "layout": lay}) == "LAYOUT_INVALID", path
    # every descriptor the daemon holds now it held before (sockets may come and go: a client's
    # connection, the HTTP server's), and none is one of the files the refused layouts named
    added = {fd: t for fd, t in daemon_fds(daemon).items() if before.get(fd) != t and "socket:" not in t}
    assert added == {}, f"descriptors left behind: {added}"


class TcpDaemon(DaemonProcess):
    def __init__(self, tmp: Path, *args: str):
        self.port = free_port()
        super().__init__(tmp, *args)

    def start(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        super().start()


def test_a_tcp_client_may_register_only_files_of_the_daemons_own_user(tmp_path, make_user, shm):
    """tcp:// carries no kernel credentials: its files must be the daemon's user's, and the
    connector's /proc fd links (which need the client's pid) are not accepted."""
    user = make_user()
    d = TcpDaemon(tmp_path, "--insecure-tcp")
    try:
        theirs = shm.file(shm.name("user"), owner=user)
        msg = refused(register(d.endpoint, kv_layout(theirs)), theirs)
        assert f"owned by uid {user.uid}, not the daemon's" in msg and "tcp://" in msg
        link = shm.link(shm.name("pub"), f"/proc/{os.getpid()}/fd/0")
        refused(register(d.endpoint, kv_layout(link)), "symlink")
        accepted(register(d.endpoint, kv_layout(shm.file(shm.name("own")))))
    finally:
        d.kill()


# ---- without a daemon: what the daemon passes in, and a daemon that is not root -----------------
def open_memory(lay: dict, peer=None, refuse=None) -> str:
    """'' when the rank memory opens, else the LAYOUT_INVALID message."""
    try:
        CpuRankMemory(PageLayout.from_wire(lay), peer, refuse).close()
    except ProtocolError as exc:
        assert exc.code.name == "LAYOUT_INVALID"
        return exc.message
    return ""


def test_a_link_to_the_daemons_own_fds_is_refused_even_for_its_own_pid(shm):
    """A peer that is the daemon itself (or a default that names it) publishes nothing: a link to
    /proc/<daemon pid>/fd/<n> would reach a --pool-dir file under /dev/shm the daemon holds."""
    path = shm.file(shm.name("held"))
    fd = os.open(path, os.O_RDWR)
    try:
        link = shm.link(shm.name("self"), f"/proc/{os.getpid()}/fd/{fd}")
        peer = Peer(os.getuid(), os.getgid(), os.getpid())
        assert "symlink" in open_memory(kv_layout(link), peer)
        assert open_memory(kv_layout(path), peer) == ""  # by its name: a file of the daemon's uid
    finally:
        os.close(fd)


def test_files_the_daemon_refuses_are_refused(shm):
    """``refuse`` lets the daemon keep clients off its own pool files (a --pool-dir under /dev/shm)."""
    path = shm.file(shm.name("pool"))
    ino = os.stat(path).st_ino

    def refuse(st):
        return "one of the daemon's pool files" if st.st_ino == ino else None

    assert "one of the daemon's pool files" in open_memory(kv_layout(path), refuse=refuse)
    assert open_memory(kv_layout(shm.file(shm.name("kv"))), refuse=refuse) == ""


def test_a_daemon_that_cannot_open_the_file_says_how_to_fix_it(make_user, shm):
    """A daemon of its own user (not root) opens an engine's file only through its group and mode;
    the message says so."""
    daemon_user, engine = make_user(), make_user()
    path = shm.file(shm.name("kv"), owner=engine)
    peer = Peer(engine.uid, engine.gid, os.getpid())
    msg = run_as(daemon_user, open_memory, kv_layout(path), peer)
    assert "permission" in msg and f"uid {daemon_user.uid}" in msg and "0660" in msg and "group" in msg, msg
    os.chown(path, engine.uid, daemon_user.gid)
    os.chmod(path, 0o660)
    assert run_as(daemon_user, open_memory, kv_layout(path), peer) == ""
