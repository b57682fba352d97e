"""Throwaway local users for cross-user tests, and running test code as one of them.

``run_as(user, fn, *args)`` forks: the child drops to the user's uid/gid (no supplementary
groups) and runs ``fn(*args)``, and its return value (or exception text) comes back pickled. The
child keeps the modules the parent imported, so code runs even where the interpreter's own files
are not readable by that user (a python under /root); import what ``fn`` needs before calling.
"""

from __future__ import annotations

import os
import pickle
import pwd
import select
import subprocess
import time
import traceback
import uuid
from dataclasses import dataclass

import numpy.random  # noqa: F401 - imported before a fork: the child may not read the interpreter's files
import pytest


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def need_root():
    if os.geteuid() != 0:
        pytest.skip("cross-user tests create throwaway users: run as root (CI does)")


@pytest.fixture
def make_user():
    """``make_user()``: a new system user (no home, no login), removed at teardown."""
    need_root()
    made: list[str] = []

    def make() -> User:
        name = f"tierdt{uuid.uuid4().hex[:8]}"
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        made.append(name)
        pw = pwd.getpwnam(name)
        return User(name, pw.pw_uid, pw.pw_gid)

    yield make
    for name in made:
        subprocess.run(["userdel", name], capture_output=True)


class RemoteError(Exception):
    pass


def run_as(user: User, fn, *args, timeout_s: float = 30.0):
    """``fn(*args)`` in a forked child running as ``user``; returns its result, raises RemoteError
    with the child's traceback if it raised."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            out = ("ok", fn(*args))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            out = ("err", traceback.format_exc())
        try:
            data = pickle.dumps(out)
        except Exception:  # noqa: BLE001
            data = pickle.dumps(("err", f"unpicklable result: {out!r}"))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while True:
            ready, _, _ = select.select([f], [], [], timeout_s)
            if not ready:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise TimeoutError(f"code run as {user.name} took more than {timeout_s} s")
            chunk = f.read1(1 << 20) if hasattr(f, "read1") else f.read()
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    status, value = pickle.loads(b"".join(chunks)) if chunks else ("err", "the child died without a result")
    if status == "err":
        raise RemoteError(value)
    return value


def shared_socket_dir() -> str:
    """A socket folder other users can reach (0711, owned by the daemon's user: the tests' user)."""
    path = f"/tmp/tierd-xuser-{uuid.uuid4().hex[:8]}"
    os.mkdir(path, 0o711)
    os.chmod(path, 0o711)
    return path


class UserProcess:
    """A long-lived forked child running as ``user``: ``call(fn, *args)`` runs ``fn(state, *args)``
    there (``state`` is a dict kept between calls; values with ``close`` are closed at the end)
    and returns its result. For sessions that must stay open while another user acts."""

    # this process's ends of every child's pipes: a child forked later must not keep an earlier
    # child's request pipe open, or that child never reads its end of input and outlives close()
    _parent_ends: set[int] = set()

    def __init__(self, user: User):
        self.user = user
        c_r, w = os.pipe()
        r, c_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in (w, r, *UserProcess._parent_ends):
                os.close(fd)
            self._serve(c_r, c_w)
        os.close(c_r)
        os.close(c_w)
        self._ends = (w, r)
        UserProcess._parent_ends.update(self._ends)
        self._out = os.fdopen(w, "wb")
        self._in = os.fdopen(r, "rb")

    def _serve(self, r: int, w: int) -> None:
        try:
            os.setgroups([])
            os.setgid(self.user.gid)
            os.setuid(self.user.uid)
        except BaseException:  # noqa: BLE001
            os._exit(3)
        state: dict = {}
        fin, fout = os.fdopen(r, "rb"), os.fdopen(w, "wb")
        while True:
            try:
                fn, args = pickle.load(fin)
            except EOFError:
                break
            try:
                out = ("ok", fn(state, *args))
            except BaseException:  # noqa: BLE001
                out = ("err", traceback.format_exc())
            pickle.dump(out, fout)
            fout.flush()
        for v in state.values():
            close = getattr(v, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # noqa: BLE001
                    pass
        os._exit(0)

    def call(self, fn, *args, timeout_s: float = 30.0):
        pickle.dump((fn, args), self._out)
        self._out.flush()
        ready, _, _ = select.select([self._in], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"{fn.__name__} as {self.user.name} took more than {timeout_s} s")
        status, value = pickle.load(self._in)
        if status == "err":
            raise RemoteError(value)
        return value

    def close(self, timeout_s: float = 5.0) -> None:
        UserProcess._parent_ends.difference_update(self._ends)
        try:
            self._out.close()
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        try:
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(self.pid, 9)
                    os.waitpid(self.pid, 0)
                    break
                time.sleep(0.02)
        except ChildProcessError:
            pass
        self._in.close()
