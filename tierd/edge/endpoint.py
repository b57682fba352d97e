"""The daemon's endpoint: one daemon per socket path, in a folder only the daemon's user controls.

Hazards. A daemon must unlink a stale socket file before it can bind its path, so two daemons
started on one path, each unlinking the other's, would both serve, each with the clients that
connected after it: who serves a path is decided by an exclusive flock on ``<socket>.lock``, taken
before anything is unlinked and held for the daemon's life. The kernel drops a flock when its
process dies, however it dies, so a daemon restarted after SIGKILL finds the lock free at once; a
socket file left behind is unlinked only by the holder. The lock file holds the holder's pid (for
the refusal message). At a clean stop the holder removes it while still holding it, then lets go:
a daemon that opened the old file just before, and flocks it just after, finds that the path no
longer names the file it locked and starts over on the path (``take_lock``), so two daemons never
each hold "the" lock on a different file. After SIGKILL the unlocked file stays, harmless.

Whoever can write the socket's folder can rename the live socket away and bind their own in its
place, and every engine that connects afterwards talks to them. So the folder must be a real
directory (not a symlink), owned by the daemon's uid and writable by no one else (0700, or 0750
with a group of engines); every folder above it must belong to root or the daemon's uid and be
writable by no one else unless it is sticky like /tmp (where only an entry's owner may rename it),
and a symlink on the way must belong to root or the daemon's uid too. A missing folder is
created 0700. The lock file is created 0600: a file others could open could be flocked by them,
and no daemon could start.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import pwd
import socket
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierd.edge.zmtp import Router

log = logging.getLogger("tierd")

LOCK_SUFFIX = ".lock"


class EndpointError(RuntimeError):
    """The endpoint cannot be served by this daemon (held by another one, or an unsafe folder)."""


class Endpoint:
    """A bound endpoint; for ipc://, the held lock and the socket file's identity."""

    def __init__(self, url: str, path: str | None, lock_fd: int | None, sock_id: tuple[int, int] | None):
        self.url = url
        self.path = path
        self.lock_path = path + LOCK_SUFFIX if path else None
        self._lock_fd = lock_fd
        self._sock_id = sock_id

    def close(self) -> None:
        """Unlink our socket file (not one that replaced it), then our lock file, then let the lock
        go: in that order, so a daemon that takes the lock next never has its fresh socket or
        lock file unlinked by us (module doc)."""
        if self._lock_fd is None:
            return
        try:
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._sock_id:
                os.unlink(self.path)
        except OSError:
            pass
        try:
            st, held = os.lstat(self.lock_path), os.fstat(self._lock_fd)
            if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                os.unlink(self.lock_path)
        except OSError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None


def bind(router: Router, url: str, socket_mode: str) -> Endpoint:
    """Bind ``router`` to ``url``. For ipc://PATH: check PATH's folder (creating it if missing),
    take the lock, remove a stale socket file, bind with the file at most ``socket_mode`` from the
    start, then set exactly that mode."""
    if not url.startswith("ipc://") or url.startswith("ipc://@"):
        # tcp://, or an abstract ipc:// name (no file: the kernel refuses a second bind itself, and
        # any local user may connect; peer credentials still come with every message)
        _bind(router, url)
        return Endpoint(url, None, None, None)
    path = os.path.abspath(url[len("ipc://") :])
    check_folder(os.path.dirname(path))
    fd = take_lock(path + LOCK_SUFFIX, url)
    try:
        _remove_stale(path)
        mode = int(socket_mode, 8)
        old = os.umask(0o777 & ~mode)  # the file never has more than --socket-mode, not even at bind
        try:
            _bind(router, url)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        st = os.lstat(path)
    except BaseException:
        Endpoint(url, path, fd, None).close()  # our lock file goes (no socket of ours to unlink)
        raise
    return Endpoint(url, path, fd, (st.st_dev, st.st_ino))


def listen_seqpacket(path: str, mode: int, backlog: int = 64) -> socket.socket:
    """A non-blocking Unix seqpacket socket listening at ``path`` (next to the ipc:// socket,
    whose lock the caller holds: a socket file left there by a dead daemon is unlinked), never
    more permissive than ``mode``, not even between bind and chmod."""
    unlink_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(umask)
    os.chmod(path, mode)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def unlink_socket(path: str) -> None:
    """Remove the socket file at ``path``; any other kind of file is left alone."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def check_folder(folder: str, uid: int | None = None) -> None:
    """Raise EndpointError unless ``folder`` is safe to hold the socket of a daemon running as
    ``uid`` (default: this process's); create it 0700 when it is missing."""
    uid = os.geteuid() if uid is None else uid
    folder = os.path.abspath(folder)
    try:
        os.makedirs(folder, mode=0o700)
        log.info("created the socket folder %s (mode 0700)", folder)
    except FileExistsError:
        pass
    _check_ancestors(folder, uid)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise EndpointError(
            f"socket folder {folder} is a symlink (to {os.readlink(folder)}): give --socket "
            "a path in the real folder"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise EndpointError(f"socket folder {folder} is not a directory")
    if st.st_uid != uid:
        raise EndpointError(
            f"socket folder {folder} is owned by {_user(st.st_uid)}, not by this daemon's user {_user(uid)} "
            f"(mode {_mode(st)}): its owner could move the socket away. Remove the folder (it is created "
            f"0700 when missing), `chown {_name(uid)} {folder}`, or give --socket a path in a folder this "
            "user owns"
        )
    if st.st_mode & 0o022:
        raise EndpointError(
            f"socket folder {folder} (owner {_user(st.st_uid)}, group {_group(st.st_gid)}, mode {_mode(st)}) "
            f"is writable by {_who(st.st_mode)}, who could move the socket away: `chmod go-w {folder}` "
            "(0700, or 0750 for a group of engines)"
        )


def take_lock(lock_path: str, url: str) -> int:
    """The fd of ``lock_path``, exclusively flocked and holding our pid; EndpointError naming the
    holder's pid when another process holds it."""
    for _ in range(8):
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise EndpointError(
                f"cannot open the lock file {lock_path}: {exc.strerror} "
                f"({_describe(lock_path)}); remove it if no tierd runs there"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise EndpointError(
                    f"lock file {lock_path} is not a regular file of this daemon's user "
                    f"({_describe(lock_path)}); remove it if no tierd runs there"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                raise EndpointError(
                    f"another tierd (pid {pid}) serves {url}: it holds the lock {lock_path}. "
                    "Stop it first, or give this daemon another --socket"
                ) from None
            try:
                now = os.stat(lock_path)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)  # someone removed or replaced it between our open and our flock: again
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
    raise EndpointError(f"lock file {lock_path} keeps being replaced; is something removing it?")


def _check_ancestors(folder: str, uid: int) -> None:
    """Symlinks on the way to ``folder`` and the real folders above it: root's or ``uid``'s, and
    writable by no one else unless sticky."""
    parts = folder.strip("/").split("/")
    for i in range(1, len(parts)):
        at = "/" + "/".join(parts[:i])
        st = os.lstat(at)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            raise EndpointError(
                f"{at}, on the way to the socket folder {folder}, is a symlink owned by "
                f"{_user(st.st_uid)}, who could point it elsewhere: give --socket a real "
                "path"
            )
    real = os.path.realpath(folder)
    above = os.path.dirname(real)
    while True:
        st = os.stat(above)
        if st.st_uid not in (0, uid) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise EndpointError(
                f"{above}, above the socket folder {real}, is owned by {_user(st.st_uid)} (group "
                f"{_group(st.st_gid)}, mode {_mode(st)}): whoever can write it can rename the socket folder "
                "away. Put the socket under folders only root or this daemon's user can write (or sticky "
                "ones such as /tmp)"
            )
        if above == "/":
            return
        above = os.path.dirname(above)


def _remove_stale(path: str) -> None:
    """Under the lock: whatever socket (or symlink) lies at ``path`` is a dead daemon's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode):
        os.unlink(path)
        log.info("removed the stale socket %s (no daemon held its lock)", path)
        return
    raise EndpointError(
        f"{path} exists and is not a socket ({_describe(path)}): remove it or give another --socket"
    )


def _bind(router: Router, url: str) -> None:
    try:
        router.bind(url)
    except OSError as exc:
        hint = " (another process listens there?)" if exc.errno == errno.EADDRINUSE else ""
        raise EndpointError(f"cannot bind {url}: {exc.strerror}{hint}") from None


def _describe(path: str) -> str:
    try:
        st = os.lstat(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    kind = {stat.S_IFREG: "file", stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink", stat.S_IFSOCK: "socket"}
    return f"{kind.get(stat.S_IFMT(st.st_mode), 'special file')}, owner {_user(st.st_uid)}, mode {_mode(st)}"


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _who(mode: int) -> str:
    return " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _name(uid: int) -> str:
    """A user as chown(1) takes it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"
