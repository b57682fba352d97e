"""Opening an engine's shared-memory file the way its owner could, and no other file.

A REGISTER names KV memory by a path under /dev/shm, and the daemon may run as root. The hazard
is a path that leads somewhere its sender could not go: a symlink to /etc/shadow or to a root
file in /dev/shm, a symlinked folder, a /proc path to the daemon's own pool memfd, a FUSE mount
whose server never answers, a fifo. So a path is never handed to the kernel whole:

- It must be ``/dev/shm/<name>[/<name>...]`` with no ``.`` or ``..``; the walk starts at a
  directory fd of /dev/shm (itself opened with O_NOFOLLOW: a symlinked /dev/shm is refused) and
  opens one component at a time with ``O_PATH | O_NOFOLLOW`` relative to the last, so no
  symlink anywhere in the path is followed and nothing is opened for I/O before it is checked.
- Every directory and the file must be on a tmpfs mount at or under /dev/shm (or the tmpfs
  holding /dev/shm). That is decided from the mount id the kernel gives in
  ``/proc/self/fdinfo/<fd>`` looked up in ``/proc/self/mountinfo``, not by statfs: statfs or
  fstat of a file on a FUSE mount would ask its (possibly hostile) server and could block.
- The file must be a regular file owned by the client's uid with its owner's read and write
  bits set (what that uid could open read-write itself), every directory searchable by that
  uid (owner/group/other bits; supplementary groups are not consulted, so this errs on
  refusing), and not a file the daemon refuses (its own pool files).
- Only then is it opened read-write, through ``/proc/self/fd/<the O_PATH fd>`` (the same inode,
  no second lookup by name), with the daemon's own permissions: a non-root daemon opens another
  user's file only if its group and mode let it.

No symlink is accepted, and no /proc path. Memory a client holds open but has not named (the
connector's, torch's unlinked storages) is handed over as descriptors instead (tierd.edge.fdinbox);
``check_fd`` checks one of those: a regular file on a tmpfs (any) or a memfd, open read-write.
Holding the descriptor is the right to use it, so no owner or path is involved.

A client without kernel credentials (tcp://) is treated as the daemon's own uid: only files the
daemon's user owns.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat

SHM = "/dev/shm"
_OCTAL = re.compile(r"\\([0-7]{3})")
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a fifo",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFLNK: "a symlink",
}


class Refused(Exception):
    """Why a file may not be opened (the caller adds the tensor and the path)."""


class Opener:
    """Opens files under /dev/shm as ``uid`` (gid ``gid``, process ``pid``; None: no process)
    may. One per REGISTER: holds a directory fd of /dev/shm and the mount table until closed."""

    def __init__(self, uid: int, gid: int, pid: int | None = None, refuse=None, whose: str = "the client's"):
        """``whose``: how refusals name ``uid`` (a tcp:// client's files are the daemon's uid's)."""
        self.uid, self.gid, self.refuse, self.whose = uid, gid, refuse, whose
        self.pid = None if pid == os.getpid() else pid  # the daemon's own fds are never a client's
        self._root = -1
        self._mounts: dict[int, tuple[str, str]] = {}
        try:
            self._root = os.open(SHM, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise Refused(f"{SHM} is not a real directory ({exc.strerror}): is it a symlink?") from None
        try:
            self._mounts = mount_table()
            self._root_mount = mount_id(self._root)
            point, fstype = self._mounts.get(self._root_mount, ("?", "an unlisted mount"))
            if fstype != "tmpfs":
                raise Refused(f"{SHM} is on {fstype} (mounted at {point}), not tmpfs")
        except BaseException:
            self.close()
            raise

    def open(self, path: str) -> tuple[int, os.stat_result]:
        """An ``O_PATH`` fd of the checked file and its stat; ``reopen`` makes it read-write."""
        if "\0" in path:
            raise Refused("the path has a NUL byte")
        if not path.startswith(SHM + "/"):
            raise Refused(f"not a file under {SHM}/")
        names = [n for n in path[len(SHM) + 1 :].split("/") if n]
        if not names or any(n in (".", "..") for n in names):
            raise Refused("the path must name a file under /dev/shm without '.' or '..'")
        fds = []
        try:
            cur, where = self._root, SHM
            for name in names[:-1]:
                where += "/" + name
                cur = self._step(cur, name, where)
                fds.append(cur)
                st = os.fstat(cur)
                if stat.S_ISLNK(st.st_mode):
                    raise Refused(f"{where} is a symlink (no symlink in the path is followed)")
                if not stat.S_ISDIR(st.st_mode):
                    raise Refused(f"{where} is {kind(st)}, not a directory")
                if not self._searchable(st):
                    raise Refused(
                        f"permission: folder {where} (uid {st.st_uid}, mode "
                        f"{st.st_mode & 0o7777:04o}) is not searchable by uid {self.uid}"
                    )
            where += "/" + names[-1]
            fds.append(self._step(cur, names[-1], where))
            st = os.fstat(fds[-1])
            if stat.S_ISLNK(st.st_mode):
                try:
                    target = os.readlink(names[-1], dir_fd=cur)
                except OSError:
                    target = "?"
                raise Refused(
                    f"{where} is a symlink (to {target!r}); no symlink is followed (pass memory "
                    f"that has no name as a descriptor: tierd_client.fdpass)"
                )
            self._check_file(st)
            return fds.pop(), st
        finally:
            for f in fds:
                os.close(f)

    def reopen(self, fd: int, st: os.stat_result) -> int:
        """A read-write fd of the file ``fd`` (O_PATH) refers to, opened with the daemon's rights."""
        try:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            me = os.geteuid()
            fix = (
                f"run the engine as the daemon's user (uid {me}), or give the file the daemon's group "
                f"with mode 0660"
                if exc.errno in (errno.EACCES, errno.EPERM)
                else ""
            )
            raise Refused(
                f"permission: the daemon (uid {me}) cannot open it read-write: {exc.strerror}"
                + (f"; {fix}" if fix else "")
            ) from None
        got = os.fstat(rw)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):  # cannot happen; never trust it blindly
            os.close(rw)
            raise Refused("the file changed while it was opened")
        return rw

    def close(self) -> None:
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    # ---- the checks ----------------------------------------------------------------------------
    def _step(self, cur: int, name: str, where: str) -> int:
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
        except OSError as exc:
            raise Refused(f"cannot open {where}: {exc.strerror}") from None
        try:
            self._on_shm(fd, where)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _on_shm(self, fd: int, where: str) -> None:
        """Before anything asks the file's filesystem: it is on a tmpfs at or under /dev/shm."""
        mid = mount_id(fd)
        if mid == self._root_mount:
            return
        if mid not in self._mounts:
            self._mounts = mount_table()  # mounted since this REGISTER began
        point, fstype = self._mounts.get(mid, ("?", "an unlisted mount (a memfd or another namespace's)"))
        if fstype != "tmpfs" or not (point == SHM or point.startswith(SHM + "/")):
            raise Refused(f"{where} is not on tmpfs under {SHM} (it is on {fstype} at {point})")

    def _searchable(self, st: os.stat_result) -> bool:
        if st.st_uid == self.uid:
            bit = stat.S_IXUSR
        else:
            bit = stat.S_IXGRP if st.st_gid == self.gid else stat.S_IXOTH
        return self.uid == 0 or bool(st.st_mode & bit)

    def check_fd(self, fd: int) -> os.stat_result:
        """A descriptor the client handed over: a regular file on a tmpfs or a memfd (never a file
        whose filesystem could block the daemon), open read-write, not one the daemon refuses."""
        mid = mount_id(fd)
        if mid not in self._mounts:
            self._mounts = mount_table()
        point, fstype = self._mounts.get(mid, ("", ""))
        if not point:
            try:
                name = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                name = "?"
            if not name.startswith("/memfd:"):
                raise Refused(f"the descriptor ({name}) is on an unlisted mount and is not a memfd")
        elif fstype != "tmpfs":
            raise Refused(f"the descriptor's file is on {fstype} (mounted at {point}), not tmpfs")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"the descriptor is not a regular file (it is {kind(st)})")
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            raise Refused("the descriptor is not open read-write")
        if self.refuse is not None:
            why = self.refuse(st)
            if why:
                raise Refused(why)
        return st

    def _check_file(self, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"not a regular file (it is {kind(st)})")
        if st.st_uid != self.uid:
            raise Refused(f"owned by uid {st.st_uid}, not {self.whose} uid {self.uid}")
        if st.st_mode & 0o600 != 0o600:
            raise Refused(
                f"permission: mode {st.st_mode & 0o7777:04o}, its owner (uid {self.uid}) cannot "
                f"read and write it"
            )
        if self.refuse is not None:
            why = self.refuse(st)
            if why:
                raise Refused(why)


def kind(st: os.stat_result) -> str:
    return _KINDS.get(stat.S_IFMT(st.st_mode), f"of type {stat.S_IFMT(st.st_mode):o}")


def mount_id(fd: int) -> int:
    """The kernel's mount id of an open fd (``mnt_id`` in /proc/self/fdinfo, Linux >= 3.15)."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as fh:
        for line in fh:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise Refused("the kernel gives no mount id for it (Linux older than 3.15?)")


def mount_table() -> dict[int, tuple[str, str]]:
    """mount id -> (mount point, filesystem type), from /proc/self/mountinfo."""
    table = {}
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and right:
                point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: a space
                table[int(fields[0])] = (point, right.split()[0])
    return table
