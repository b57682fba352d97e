"""The HTTP server's accepting thread is never lost (tierd.edge.http.server): an exception while serving
one connection closes that connection only, one in the loop itself drops the unfinished requests
and serving goes on, a thread that ended all the same is started again by ``check()`` (the
daemon's housekeeping calls it), and /healthz is answered by that thread itself, also while every
worker is held by a slow reply."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tierd.edge.http.server import WORKERS, BoundedHTTPServer


class Ok:
    def __init__(self, request, address, server):
        request.sock.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nyes")


@pytest.fixture
def serve():
    made: list[BoundedHTTPServer] = []

    def make(handler=Ok, max_connections: int = 8, timeout_s: float = 5.0) -> BoundedHTTPServer:
        server = BoundedHTTPServer("127.0.0.1", 0, handler, timeout_s, max_connections, health=lambda: None)
        server.start()
        made.append(server)
        return server

    yield make
    for server in made:
        server.shutdown()
        server.server_close()


def get(server: BoundedHTTPServer, path: str = "/", extra: bytes = b"") -> bytes:
    """The whole reply (b"" when the server closed the connection unanswered)."""
    with socket.create_connection(server.server_address, timeout=5) as s:
        s.sendall(f"GET {path} HTTP/1.0\r\n".encode() + extra + b"\r\n")
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
        return out


def test_an_exception_serving_one_connection_closes_only_that_one(serve):
    server = serve()
    take = server._take

    def faulty(p):
        got = take(p)
        if b"X-Boom" in p.head:
            raise RuntimeError("boom")
        return got

    server._take = faulty
    assert get(server, "/", b"X-Boom: 1\r\n") == b""
    assert server.failures == 1
    assert get(server).endswith(b"yes")
    assert get(server, "/healthz").startswith(b"HTTP/1.0 200 OK")
    assert server._thread.is_alive()


class FailingSelector:
    """Stands in for the loop's selector: its next select() fails (then the real one is back)."""

    def __init__(self, server: BoundedHTTPServer):
        self.server, self.real = server, server._sel

    def select(self, timeout):
        self.server._sel = self.real
        raise OSError("select failed")

    def __getattr__(self, name):
        return getattr(self.real, name)


def fail_loop_once(server: BoundedHTTPServer) -> None:
    server._sel = FailingSelector(server)
    server._wake_w.send(b"x")  # the loop wakes and meets it now


def test_an_exception_in_the_accepting_loop_drops_unfinished_requests_and_serves_on(serve):
    server = serve()
    unfinished = socket.create_connection(server.server_address, timeout=5)
    unfinished.sendall(b"GET / HTTP/1.0\r\n")  # never finished
    deadline = time.monotonic() + 5
    while not server.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.pending
    fail_loop_once(server)
    unfinished.settimeout(5)
    try:  # dropped: the end of the stream, or a reset where the server closed with bytes unread
        assert unfinished.recv(1 << 16) == b"", "the unfinished request was answered"
    except ConnectionResetError:
        pass
    unfinished.close()
    assert server.failures == 1 and not server.pending
    assert get(server).endswith(b"yes")
    assert server._thread.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_check_starts_an_ended_accepting_thread_again(serve):
    server = serve()
    assert server.check() is True and server.restarts == 0

    def end_thread():  # what no exception can do any more (SystemExit is not an Exception)
        raise SystemExit

    server._serve = end_thread  # called again after the next failure of the loop
    fail_loop_once(server)
    server._thread.join(5)
    assert not server._thread.is_alive()
    del server._serve
    assert server.check() is False and server.restarts == 1
    assert server._thread.is_alive()
    assert get(server, "/healthz").startswith(b"HTTP/1.0 200 OK")
    assert get(server).endswith(b"yes")


def test_healthz_is_answered_while_every_worker_is_held(serve):
    release = threading.Event()
    entered = threading.Semaphore(0)

    class Held:
        def __init__(self, request, address, server):
            entered.release()
            release.wait(10)
            request.sock.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")

    server = serve(Held, max_connections=2 * (WORKERS + 1))  # half of it, WORKERS + 1, to be answered
    held = [socket.create_connection(server.server_address, timeout=5) for _ in range(WORKERS + 1)]
    try:
        for s in held:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        for _ in range(WORKERS):
            assert entered.acquire(timeout=5)
        # every worker is held, one request waits for a worker: as many as may be answered at once
        t = time.monotonic()
        assert get(server, "/healthz").startswith(b"HTTP/1.0 200 OK")
        assert time.monotonic() - t < 2
        assert get(server).startswith(b"HTTP/1.0 503"), "a request that needs a worker waits for none"
    finally:
        release.set()
        for s in held:
            s.close()
