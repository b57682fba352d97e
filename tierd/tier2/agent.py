"""The Mooncake client's own process: ``python -m tierd.tier2.agent FD``, started by ``link.AgentLink``.

Why a process and not a thread: Mooncake's ``setup`` and ``close`` hold the GIL while they block
(seconds to minutes against an absent or stopped master: tierd.l2.client's hazards), a client
whose setup failed crashed its process when called, and no call can be cancelled. Here none of
that reaches the daemon: it waits on a socket with the GIL released, and a wedged agent is killed
and replaced.

Zero copy: the daemon sends each registered buffer's file descriptor (its memfd or pool file) with
SCM_RIGHTS; the agent maps the same pages (MAP_SHARED) and registers that mapping with Mooncake,
so put and get move bytes between Mooncake and the daemon's pool with nothing in between.

Hazards: the agent serves one request at a time, in order (so replies never cross); it exits at
once, without Mooncake's slow teardown, when the daemon closes the socket or dies
(PR_SET_PDEATHSIG); the master then drops its segment after ``client_ttl`` (10 s by default).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import socket
import sys

import msgpack

from tierd.base.l2url import MooncakeUrl
from tierd.tier2 import client

MAX_MESSAGE = 8 << 20
VERBS = frozenset(("setup", "register", "unregister", "put", "get", "exists", "remove", "close"))


def main(fd: int) -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the daemon
    sock = socket.socket(fileno=fd)
    try:
        store_class = client.load_store_class()
    except client.L2Unavailable as e:
        _send(sock, ["hello", str(e)])
        os._exit(1)
    _send(sock, ["hello", None])
    agent = Agent(store_class)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
        except OSError:
            os._exit(0)
        if not data:  # the daemon went away: skip Mooncake's teardown (it can block for minutes)
            os._exit(0)
        seq, verb, *args = msgpack.unpackb(data)
        try:
            if verb not in VERBS:
                raise ValueError("unknown verb")
            result = getattr(agent, verb)(*args, *fds)
        except Exception as e:  # a bug or a binding error: answer it, keep serving
            result = ["error", f"{verb}: {type(e).__name__}: {e}"]
        _send(sock, [seq, result])
        if verb == "close":
            os._exit(0)


class Agent:
    """One Mooncake client and the daemon's buffers mapped into this process."""

    def __init__(self, store_class):
        self.store_class = store_class
        self.store = None
        self.maps: dict[int, tuple[mmap.mmap, int, int]] = {}  # buffer id -> (mapping, address, bytes)

    def setup(self, url: dict, host: str):
        if self.store is not None:
            return [0, self.store.get_hostname()]
        client.advertise(host)  # this process's environment only
        try:
            self.store = client.open_store(self.store_class, MooncakeUrl(**url), host)
        except client.SetupFailed as e:
            return [e.rc, str(e)]
        return [0, self.store.get_hostname()]

    def register(self, buf: int, nbytes: int, offset: int, fd: int):
        # MAP_POPULATE: the pages exist (the daemon's mapping), but this mapping's page tables do
        # not; without it every first touch of a 4 KiB page in a put or get takes a minor fault.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            m = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        finally:
            os.close(fd)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        self.maps[buf] = (m, addr, nbytes)
        return self.store.register_buffer(addr, nbytes) if self.store is not None else 0

    def unregister(self, buf: int):
        m, addr, _ = self.maps.pop(buf)
        rc = self.store.unregister_buffer(addr) if self.store is not None else 0
        return rc  # the mapping itself goes with the process (a live ctypes view pins it)

    def put(self, names, bufs, offsets, sizes):
        return self.store.batch_put_from(names, self._addrs(bufs, offsets, sizes), sizes)

    def get(self, names, bufs, offsets, sizes):
        return self.store.batch_get_into(names, self._addrs(bufs, offsets, sizes), sizes)

    def exists(self, names):
        return self.store.batch_is_exist(names)

    def remove(self, names):
        return self.store.batch_remove(names)

    def close(self):
        store, self.store = self.store, None
        return 0 if store is None else store.close()

    def _addrs(self, bufs, offsets, sizes) -> list[int]:
        out = []
        for b, off, n in zip(bufs, offsets, sizes):
            _, addr, nbytes = self.maps[b]
            if off < 0 or off + n > nbytes:  # the daemon checks too; never trust a range twice removed
                raise ValueError(f"{n} bytes at offset {off} exceed buffer {b} ({nbytes} bytes)")
            out.append(addr + off)
        return out


def _send(sock: socket.socket, obj) -> None:
    sock.send(msgpack.packb(obj, use_bin_type=True))  # SOCK_SEQPACKET: whole or not at all


if __name__ == "__main__":
    main(int(sys.argv[1]))
