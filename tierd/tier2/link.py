"""The daemon's end of the agent process: spawn it, ask it one thing at a time, kill it if it wedges.

Hazards:

- :meth:`AgentLink.call` blocks (in ``recv``, with the GIL released) until the agent answers or
  ``hang_s`` passes; only the tier's worker thread calls it. Past ``hang_s`` the agent is killed
  (SIGKILL: Mooncake's own teardown can block for minutes) and :class:`AgentLost` raised; the
  segment it contributed, and the objects in it, are dropped by the master after its client TTL.
- Requests and replies are single SOCK_SEQPACKET messages (4 MiB socket buffers), so one call
  carries at most a few thousand keys; the tier caps a call at ``MAX_KEYS``.
- The agent inherits the daemon's stderr: Mooncake's glog lines land in the daemon's log
  (``GLOG_minloglevel=2`` quiets all but errors).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import msgpack

from tierd.tier2.client import L2Unavailable

SOCKET_BUFFER = 4 << 20
MAX_KEYS = 4096
HELLO_S = 30.0


class AgentLost(RuntimeError):
    """The agent died, or was killed for not answering in time."""


class AgentLink:
    def __init__(self, hang_s: float):
        self.hang_s = hang_s
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        self.sock = ours
        self.seq = 0
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierd.tier2.agent", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            theirs.close()
        hello = self._recv(HELLO_S, "hello")
        if hello[1] is not None:
            self.kill()
            raise L2Unavailable(hello[1])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, verb: str, *args, fds: tuple[int, ...] = (), timeout: float | None = None):
        """Send one request, wait for its answer; AgentLost if the agent dies or wedges."""
        self.seq += 1
        data = msgpack.packb([self.seq, verb, *args], use_bin_type=True)
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.send(data)
        except OSError as e:
            self.kill()
            raise AgentLost(f"agent unreachable: {e}") from None
        seq, result = self._recv(self.hang_s if timeout is None else timeout, verb)
        if seq != self.seq:
            self.kill()
            raise AgentLost(f"agent answered request {seq}, expected {self.seq}")
        return result

    def _recv(self, timeout: float, what: str):
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            ready, _, _ = select.select([self.sock], [], [], max(0.0, left))
            if ready:
                try:
                    data = self.sock.recv(SOCKET_BUFFER)
                except OSError:
                    data = b""
                if not data:
                    self.kill()
                    raise AgentLost(f"agent exited during {what} (status {self.proc.returncode})")
                return msgpack.unpackb(data)
            if left <= 0:
                self.kill()
                raise AgentLost(f"agent gave no answer to {what} in {timeout:g} s: killed")

    def close(self, timeout: float) -> bool:
        """Ask the agent to leave the store (segment unmounted at once), then make sure it is gone."""
        ok = False
        if self.alive:
            try:
                ok = self.call("close", timeout=timeout) == 0
            except AgentLost:
                ok = False
        self.kill()
        return ok

    def terminate(self) -> None:
        """SIGKILL the agent from any thread; the thread inside call() then sees AgentLost."""
        if self.proc.poll() is None:
            self.proc.kill()

    def kill(self) -> None:
        """Only from the thread that calls: the process, then the socket."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def dup(fd: int) -> int:
    """A descriptor of our own for a registered buffer (the caller may close theirs)."""
    return os.dup(fd)
