"""Operator endpoints: GET /status (JSON), /metrics (Prometheus text), /healthz.

Hazard: the stdlib ThreadingHTTPServer gives every connection a thread that waits for the
request as long as the client likes, so idle or byte-dripping connections pile up threads without
bound and hold them for ever. Here one thread accepts connections and reads their requests with a
selector: a connection costs a file descriptor, not a thread, until its request line and headers
have arrived, and it has ``timeout_s`` for all of them (one deadline, not one per read); it is
closed when that passes. A complete request goes to a pool of ``WORKERS`` threads, whose writes of
the reply each block at most ``timeout_s``. At most ``max_connections`` are open at once: when
full, the oldest one still sending its request is closed to make room (a prompt client such as a
scraper or ``curl`` is not starved by idle ones), and when every open one is being answered the
new one gets a 503 from the accepting thread. One request per connection (HTTP/1.0).
"""

from __future__ import annotations

import io
import json
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("tierd.http")

WORKERS = 4  # threads answering complete requests (/status waits for the main loop, up to 5 s)
MAX_HEAD = 64 << 10  # request line and headers, bytes
TICK_S = 0.1  # how often deadlines are checked
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 26\r\n"
    b"Connection: close\r\n\r\ntoo many HTTP connections\n"
)
TOO_LARGE = b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Pending:
    __slots__ = ("sock", "address", "deadline", "head")

    def __init__(self, sock: socket.socket, address, deadline: float):
        self.sock, self.address, self.deadline, self.head = sock, address, deadline, bytearray()


class BoundedHTTPServer:
    """An HTTP server whose threads (1 + WORKERS) and open connections are bounded."""

    def __init__(self, host: str, port: int, handler, timeout_s: float, max_connections: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.handler, self.timeout_s, self.max_connections = handler, timeout_s, max_connections
        self.pending: dict[socket.socket, _Pending] = {}  # insertion order = age
        self.active = 0  # handed to the workers, not yet answered
        self.refused = self.timed_out = self.evicted = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="tierd-http-worker")
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.socket, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stopping = False
        self._stopped = threading.Event()
        self._warned = 0.0

    # ---- the accepting thread ---------------------------------------------------------------
    def serve_forever(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._sel.select(TICK_S):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._read(key.fileobj)
                self._expire(time.monotonic())
        finally:
            self._stopped.set()

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: the listener stays readable
                now = time.monotonic()
                if now - self._warned >= 60:
                    self._warned = now
                    log.warning("HTTP accept failed: %s", exc)
                time.sleep(0.5)  # no busy loop; only HTTP waits
                return
            with self._lock:
                full = len(self.pending) + self.active >= self.max_connections
            if full and self.pending:
                self.evicted += 1
                self._close(next(iter(self.pending)))  # the oldest still sending its request
            elif full:
                self.refused += 1
                _answer_and_close(sock, BUSY)
                continue
            sock.setblocking(False)
            self.pending[sock] = _Pending(sock, address, time.monotonic() + self.timeout_s)
            self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        p = self.pending[sock]
        try:
            data = sock.recv(MAX_HEAD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(sock)
            return
        p.head += data
        if b"\r\n\r\n" not in p.head and b"\n\n" not in p.head:
            if len(p.head) > MAX_HEAD:
                self._sel.unregister(sock)
                del self.pending[sock]
                _answer_and_close(sock, TOO_LARGE)
            return
        self._sel.unregister(sock)
        del self.pending[sock]
        with self._lock:
            self.active += 1
        try:
            self._pool.submit(self._answer, p)
        except RuntimeError:  # the pool is shut down: we are stopping
            self._done(sock)

    def _expire(self, now: float) -> None:
        for sock in [s for s, p in self.pending.items() if p.deadline <= now]:
            self.timed_out += 1
            self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        self._sel.unregister(sock)
        del self.pending[sock]
        sock.close()

    # ---- the workers ----------------------------------------------------------------------------
    def _answer(self, p: _Pending) -> None:
        try:
            p.sock.setblocking(True)
            p.sock.settimeout(self.timeout_s)  # each write of the reply
            self.handler(p, p.address, self)
        except Exception:  # noqa: BLE001 - a client that went away, or a reply that timed out
            log.debug("HTTP reply to %s failed", p.address, exc_info=True)
        finally:
            self._done(p.sock)

    def _done(self, sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()
        with self._lock:
            self.active -= 1

    # ---- stop -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop accepting and reading; replies being written finish on their own (bounded)."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait(5)

    def server_close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for sock in list(self.pending):
            self._close(sock)
        self._sel.close()
        for s in (self.socket, self._wake_r, self._wake_w):
            s.close()


def _answer_and_close(sock: socket.socket, reply: bytes) -> None:
    """From the accepting thread: never blocks. What already arrived is read first, since closing a
    socket with unread data resets the connection and the reply could be lost."""
    try:
        sock.setblocking(False)
        try:
            sock.recv(MAX_HEAD)
        except OSError:
            pass
        sock.send(reply)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()


def start_http_server(
    board, metrics, host: str, port: int, timeout_s: float = 5.0, max_connections: int = 64
) -> BoundedHTTPServer:
    """Serve ``board`` (a tierd.status.StatusBoard) and the Prometheus registry ``metrics``."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "tierd"

        def setup(self):  # the request has been read already (BoundedHTTPServer)
            self.connection = self.request.sock
            self.rfile = io.BytesIO(bytes(self.request.head))
            self.wfile = self.connection.makefile("wb")

        def do_GET(self):  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            try:
                if path == "/status":
                    self._send(200, "application/json", json.dumps(board.ask(), indent=1).encode())
                elif path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics))
                elif path == "/healthz":
                    if board.stopping:
                        self._send(503, "text/plain", b"stopping\n")
                    else:
                        self._send(200, "text/plain", b"ok\n")
                else:
                    self._send(404, "text/plain", b"not found: try /status, /metrics or /healthz\n")
            except Exception as exc:  # noqa: BLE001 - answer, never hang the operator
                log.exception("HTTP %s failed", path)
                self._send(500, "text/plain", f"{type(exc).__name__}: {exc}\n".encode())

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):
            log.debug("http: " + fmt, *args)

    server = BoundedHTTPServer(host, port, Handler, timeout_s, max_connections)
    threading.Thread(target=server.serve_forever, name="tierd-http", daemon=True).start()
    log.info(
        "HTTP on http://%s:%d (/status /metrics /healthz; at most %d connections, %.3g s each to send "
        "its request)",
        host,
        server.server_address[1],
        max_connections,
        timeout_s,
    )
    return server
