"""The socket's folder belongs to the daemon (tierd.edge.endpoint.check_folder): whoever can write it
could move the live socket away and bind their own, so a folder of another user, one its group
or others can write, a symlinked one, or one under a folder others can write (not sticky) or
behind another user's symlink stops ``tierd serve`` with a usage error naming it; the daemon's
own 0700/0750/0755 folders are accepted (the negative controls). With the socket's group set, an
engine in that group reaches a 0660 socket and other users do not.

Other users are throwaway numeric uids/gids with no passwd entry (nothing to remove afterwards);
code runs as them in a forked child, which keeps the modules already imported (the interpreter's
own files under /root are not readable by them). Needs root."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import shutil
import socket
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

import pytest
import zmq
from conftest import ROOT, DaemonProcess

from tierd.edge.endpoint import EndpointError, check_folder
from tierd.protocol import codec
from tierd.tools.testing import serve_argv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown and setuid to other users need root")


def free_ids(n: int) -> list[int]:
    """``n`` numbers that are neither a user's nor a group's id here."""
    out = []
    for i in range(61000, 65000):
        try:
            pwd.getpwuid(i)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(i)
            continue
        except KeyError:
            out.append(i)
        if len(out) == n:
            return out
    pytest.skip("no free uid/gid numbers")


@pytest.fixture
def other():
    """(uid, gid) of a user that is not the daemon's (root), and a second one."""
    return free_ids(2)


@pytest.fixture
def base():
    """A folder other users can traverse (tmp_path is under root's 0700 /tmp/pytest-of-root)."""
    path = f"/tmp/tierd-ep-{uuid.uuid4().hex[:8]}"
    os.mkdir(path, 0o711)
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """``tierd serve`` expected to refuse at start-up."""
    cmd = serve_argv(*args, endpoint=endpoint, http_port=-1, pool_mb=10.24)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tierd serve started on {endpoint} instead of refusing")


def as_user(uid: int, gid: int, groups: list[int], fn) -> int:
    """``fn()`` in a forked child running as uid/gid with these supplementary groups; its return
    value (0 or an errno) is the exit status."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            code = fn()
        except BaseException:  # noqa: BLE001 - reported by exit status
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def rename_away(path: str):
    def fn() -> int:
        try:
            os.rename(path, path + ".moved")
            return 0
        except OSError as exc:
            return exc.errno

    return fn


def connect_and_ping(path: str):
    def fn() -> int:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
        except OSError as exc:
            return exc.errno
        finally:
            s.close()
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"ipc://{path}")
        d.send(codec.encode_request("PING", 1, {}))
        answered = d.poll(5000)
        d.close()
        ctx.term()
        return 0 if answered else 98

    return fn


def test_folder_of_another_user_is_refused(base, other, tmp_path):
    uid = other[0]
    folder = os.path.join(base, "run")
    os.mkdir(folder, 0o700)
    os.chown(folder, uid, uid)  # e.g. a /tmp/tierd-<uid> another user created first
    res = serve(f"ipc://{folder}/tierd.sock")
    assert res.returncode == 2, res.stderr
    assert f"socket folder {folder} is owned by uid {uid}" in res.stderr and "0700" in res.stderr, res.stderr
    assert not os.path.exists(os.path.join(folder, "tierd.sock"))
    # why: the folder's owner can rename a live socket in it away (a socket bound here by root)
    victim = os.path.join(folder, "tierd.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(victim)
    try:
        assert as_user(uid, uid, [], rename_away(victim)) == 0
        assert os.path.exists(victim + ".moved")
    finally:
        s.close()
    # negative control: the same folder given back to the daemon's user is served
    shutil.rmtree(folder)
    os.mkdir(folder, 0o700)
    d = DaemonProcess(Path(folder))
    try:
        assert d.status()["pid"] == d.proc.pid
        assert as_user(uid, uid, [], rename_away(str(d.socket_file))) == errno.EACCES
        assert d.socket_file.is_socket()
    finally:
        d.kill()


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o730, 0o702, 0o1777])
def test_folder_its_group_or_others_can_write_is_refused(base, mode):
    folder = os.path.join(base, "run")
    os.mkdir(folder)
    os.chmod(folder, mode)
    with pytest.raises(EndpointError, match=f"mode {mode & 0o7777:04o}.*writable by"):
        check_folder(folder)


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o711])
def test_folder_of_the_daemon_writable_by_it_alone_is_accepted(base, mode):
    folder = os.path.join(base, "run")
    os.mkdir(folder)
    os.chmod(folder, mode)
    check_folder(folder)


def test_writable_folder_stops_serve_with_a_usage_error(base):
    folder = os.path.join(base, "run")
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    res = serve(f"ipc://{folder}/tierd.sock")
    assert res.returncode == 2 and f"chmod go-w {folder}" in res.stderr, res.stderr


def test_symlinked_folder_is_refused(base):
    real = os.path.join(base, "real")
    os.mkdir(real, 0o700)
    link = os.path.join(base, "run")
    os.symlink(real, link)
    res = serve(f"ipc://{link}/tierd.sock")
    assert res.returncode == 2 and f"socket folder {link} is a symlink" in res.stderr, res.stderr
    check_folder(real)  # negative control: the real folder is fine


def test_folder_under_one_others_can_write_is_refused(base, other):
    parent = os.path.join(base, "p")
    os.mkdir(parent)
    folder = os.path.join(parent, "run")
    os.mkdir(folder, 0o700)
    for mode, owner, ok in [
        (0o777, 0, False),
        (0o775, 0, False),
        (0o1777, 0, True),
        (0o755, 0, True),
        (0o755, other[0], False),
        (0o1777, other[0], False),
    ]:
        os.chmod(parent, mode)
        os.chown(parent, owner, owner)
        if ok:
            check_folder(folder)
        else:
            with pytest.raises(EndpointError, match=f"{parent}, above the socket folder"):
                check_folder(folder)


def test_symlink_of_another_user_on_the_way_is_refused(base, other):
    real = os.path.join(base, "real")
    os.mkdir(real, 0o755)
    os.mkdir(os.path.join(real, "run"), 0o700)
    link = os.path.join(base, "via")
    os.symlink(real, link)
    check_folder(os.path.join(link, "run"))  # negative control: root's own symlink
    os.lchown(link, other[0], other[0])
    with pytest.raises(EndpointError, match=f"{link}, on the way to the socket folder.*symlink owned by uid"):
        check_folder(os.path.join(link, "run"))


def test_missing_folder_is_created_0700(base):
    folder = os.path.join(base, "a", "b")
    check_folder(folder)
    assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(folder).st_uid == os.geteuid()


def test_engines_in_the_sockets_group_connect_others_cannot(base, other):
    """The systemd deployment: folder 0750 with the daemon's group, socket 0660 (deploy/)."""
    engine, stranger = other
    group = engine  # the group 'tierd' stands for; the engine's user is a member, the stranger is not
    folder = os.path.join(base, "run")
    os.mkdir(folder, 0o750)
    os.chmod(folder, 0o750)
    os.chown(folder, 0, group)
    d = DaemonProcess(Path(folder), "--socket-mode", "0660")
    try:
        sock = str(d.socket_file)
        os.chown(sock, 0, group)  # systemd's Group=tierd does this by the daemon's gid
        assert os.stat(sock).st_mode & 0o777 == 0o660
        assert as_user(engine, engine, [group], connect_and_ping(sock)) == 0
        assert as_user(stranger, stranger, [], connect_and_ping(sock)) == errno.EACCES
        os.chmod(sock, 0o600)  # negative control: without the group's bits the member is out too
        assert as_user(engine, engine, [group], connect_and_ping(sock)) == errno.EACCES
    finally:
        d.kill()
