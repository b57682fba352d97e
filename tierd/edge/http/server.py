"""The operators' HTTP server, bounded: the connections and threads behind /status, /metrics and
/healthz (what each answers: tierd.edge.http.endpoints).

Hazard: the stdlib ThreadingHTTPServer gives every connection a thread that waits for the
request as long as the client likes, so idle or byte-dripping connections pile up threads without
bound and hold them for ever. Here one thread accepts connections and reads their requests with a
selector: a connection costs a file descriptor, not a thread, until its request line and headers
have arrived, and it has ``timeout_s`` for all of them (one deadline, not one per read); it is
closed when that passes. A complete request goes to a pool of ``WORKERS`` threads, whose writes of
the reply each block at most ``timeout_s``; /healthz, whose reply never waits, is answered by the
accepting thread itself, so a queue of /status asks (each waits for the main loop) cannot delay it
and its answer proves that thread alive; it reads the main loop's heartbeat (``health``), so it is
a 503 with the reason once that loop is stuck or gone. At most ``max_connections`` are open at
once: when full, the oldest one still sending its request is closed to make room (a prompt client such as a
scraper or ``curl`` is not starved by idle ones). At most half of them wait for or hold a worker:
a complete request past that gets a 503 from the accepting thread, so slow /status and /metrics
replies never leave a new connection unread. One request per connection (HTTP/1.0).

Second hazard: all of this hangs on one thread, so one exception there would leave the endpoints
dark for the rest of the daemon's life (a connection closed to make room while its read event was
still due in the same round once did exactly that). Each round reads before it accepts, skips a
connection closed meanwhile, and accepts at most half the cap, so a connection is read at least
once before a burst can push it out; an exception while serving one connection closes that
connection; any other drops the unfinished requests and the loop starts afresh; and ``check()``
lets the daemon's housekeeping start the thread again should it end all the same.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("tierd.http")

WORKERS = 4  # threads answering complete requests (/status waits for the main loop, up to 5 s)
MAX_HEAD = 64 << 10  # request line and headers, bytes
TICK_S = 0.1  # how often deadlines are checked
BACKLOG = 1024  # connections the kernel holds for accept (past it, a client's SYN waits a second)
BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 26\r\n"
    b"Connection: close\r\n\r\ntoo many HTTP connections\n"
)
TOO_LARGE = b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


def _plain(status: str, body: bytes) -> bytes:
    head = f"HTTP/1.0 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


HEALTHY = _plain("200 OK", b"ok\n")


class _Pending:
    __slots__ = ("sock", "address", "deadline", "head", "round")

    def __init__(self, sock: socket.socket, address, deadline: float, round_: int):
        self.sock, self.address, self.deadline, self.head = sock, address, deadline, bytearray()
        self.round = round_  # of the accepting loop, when it was accepted


class BoundedHTTPServer:
    """An HTTP server whose threads (1 + WORKERS) and open connections are bounded. ``health()``
    (no waiting: None when healthy, else why not) decides /healthz, answered on the accepting
    thread; ``handler`` the rest."""

    def __init__(self, host: str, port: int, handler, timeout_s: float, max_connections: int, health=None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.handler, self.timeout_s, self.max_connections = handler, timeout_s, max_connections
        self.health = health
        self.accepts = max(1, max_connections // 2)  # per round
        self.answering = max(1, max_connections // 2)  # complete requests for the workers, at most
        self.round = 0  # rounds of the accepting loop
        self.pending: dict[socket.socket, _Pending] = {}  # insertion order = age
        self.active = 0  # handed to the workers, not yet answered
        self.refused = self.timed_out = self.evicted = 0
        self.failures = self.restarts = 0  # exceptions survived; accepting threads started again
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="tierd-http-worker")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = self._selector()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._warned = self._said = 0.0

    def start(self) -> None:
        """Serve from a new accepting thread (``tierd-http``)."""
        self._stopped.clear()
        self._thread = threading.Thread(target=self.serve_forever, name="tierd-http", daemon=True)
        self._thread.start()

    def check(self) -> bool:
        """For the daemon's housekeeping: whether the accepting thread is alive. One that ended
        (while not stopping) is started again, with a fresh selector, and logged."""
        if self._stopping or self._thread is None or self._thread.is_alive():
            return True
        self.restarts += 1
        log.error("HTTP: the accepting thread had ended; started again (%d restarts)", self.restarts)
        self._reset()
        self.start()
        return False

    # ---- the accepting thread ---------------------------------------------------------------
    def serve_forever(self) -> None:
        """No exception ends it (module docstring)."""
        try:
            while not self._stopping:
                try:
                    self._serve()
                except Exception:  # noqa: BLE001 - the operator's endpoints must not go dark
                    self.failures += 1
                    log.exception("HTTP: the accepting loop failed; its unfinished requests are dropped")
                    self._reset()
                    time.sleep(TICK_S)  # a failure that repeats does not spin
        finally:
            self._stopped.set()

    def _serve(self) -> None:
        while not self._stopping:
            self.round += 1
            accept = False
            for key, _ in self._sel.select(TICK_S):
                if key.fileobj is self.socket:
                    accept = True
                elif key.fileobj is self._wake_r:
                    self._wake_r.recv(64)  # (woken to see _stopping)
                else:
                    self._read(key.fileobj)
            if accept:
                self._accept()
            self._expire(time.monotonic())
            while len(self.pending) + self.active > self.max_connections and self._evict(self.round):
                pass  # back to the cap: newcomers beyond it have had their round

    def _accept(self) -> None:
        for _ in range(self.accepts):
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
            p = _Pending(sock, address, time.monotonic() + self.timeout_s, self.round)
            try:
                self._admit(p)
            except Exception:  # noqa: BLE001 - this connection goes, serving goes on
                self._failed(p)

    def _admit(self, p: _Pending) -> None:
        """A new connection, read at once: a prompt client's request is there already, and one that
        needs no worker (/healthz) is answered even when every place is taken."""
        p.sock.setblocking(False)
        got = self._take(p)
        if got is not False:
            self._finish(p, got)
        elif self._full() and not self._evict(self.round) and self._over() >= self.accepts:
            self.refused += 1
            _answer_and_close(p.sock, BUSY)
        else:  # over the cap at most until the next round has read it (then it, or an older one, goes)
            self.pending[p.sock] = p
            self._sel.register(p.sock, selectors.EVENT_READ)

    def _full(self) -> bool:
        with self._lock:
            return len(self.pending) + self.active >= self.max_connections

    def _over(self) -> int:
        with self._lock:
            return len(self.pending) + self.active - self.max_connections

    def _evict(self, before: int | None) -> bool:
        """The oldest connection still sending its request goes (if it came before round ``before``)."""
        oldest = next(iter(self.pending.values()), None)
        if oldest is None or (before is not None and oldest.round >= before):
            return False
        self.evicted += 1
        self._drop(oldest.sock)
        return True

    def _read(self, sock: socket.socket) -> None:
        p = self.pending.get(sock)
        if p is None:  # closed since the selector reported it
            return
        try:
            got = self._take(p)
            if got is not False:
                self._forget(sock)
                self._finish(p, got)
        except Exception:  # noqa: BLE001 - this connection goes, serving goes on
            self._failed(p)

    def _take(self, p: _Pending) -> bool | bytes:
        """Reads what has arrived. False: more is due; True: a complete request for the workers;
        bytes: the reply to send before closing (b"": none, the client ended its side or reset)."""
        try:
            data = p.sock.recv(MAX_HEAD)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            return b""
        seen = max(0, len(p.head) - 3)  # the end of the head may straddle two reads
        p.head += data
        if p.head.find(b"\r\n\r\n", seen) < 0 and p.head.find(b"\n\n", seen) < 0:
            return TOO_LARGE if len(p.head) > MAX_HEAD else False
        if self.health is not None and _path(p.head) == b"/healthz":
            why = self.health()
            return HEALTHY if why is None else _plain("503 Service Unavailable", why.encode() + b"\n")
        return True

    def _finish(self, p: _Pending, got: bool | bytes) -> None:
        """A connection no longer pending: to the workers (True), or answered and closed. A request
        for the workers takes the place of an unfinished one; it is answered 503 when half the cap
        is being answered already (the other half stays for connections to be read), or when every
        open connection is."""
        if got is not True:
            if got:
                _answer_and_close(p.sock, got)
            else:
                p.sock.close()
            return
        busy = self.active >= self.answering
        while not busy and self._full():  # (more than one goes when newcomers are over the cap)
            busy = not self._evict(None)
        if busy:
            self.refused += 1
            _answer_and_close(p.sock, BUSY)
            return
        with self._lock:
            self.active += 1
        try:
            self._pool.submit(self._answer, p)
        except RuntimeError:  # the pool is shut down: we are stopping
            self._done(p.sock)

    def _failed(self, p: _Pending) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._said >= 60:
            self._said = now
            log.exception("HTTP: serving %s failed; that connection is closed", p.address)
        if p.sock in self.pending:
            self._forget(p.sock)
        p.sock.close()

    def _expire(self, now: float) -> None:
        for sock in [s for s, p in self.pending.items() if p.deadline <= now]:
            self.timed_out += 1
            self._drop(sock)

    def _forget(self, sock: socket.socket) -> None:
        """No longer pending: being answered, or about to be closed."""
        del self.pending[sock]
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):  # a failure came between registering and here
            pass

    def _drop(self, sock: socket.socket) -> None:
        self._forget(sock)
        sock.close()

    def _reset(self) -> None:
        """After a failure of the loop itself: every unfinished request goes, and a fresh selector
        watches the listener, so no state the failure left half-changed outlives it."""
        pending, self.pending = self.pending, {}
        for sock in pending:
            sock.close()
        try:
            self._sel.close()
        except Exception:  # noqa: BLE001 - replaced below either way
            pass
        self._sel = self._selector()

    def _selector(self) -> selectors.BaseSelector:
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        return sel

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
            self._drop(sock)
        self._sel.close()
        for s in (self.socket, self._wake_r, self._wake_w):
            s.close()


def _path(head: bytearray) -> bytes | None:
    """The path of a GET request line (without its query), else None."""
    line = bytes(head[: head.find(b"\n")]).split()
    return line[1].split(b"?", 1)[0] if len(line) >= 2 and line[0] == b"GET" else None


def _answer_and_close(sock: socket.socket, reply: bytes) -> None:
    """From the accepting thread: never blocks (a reply this short fits a fresh socket's buffer).
    What already arrived is read first, since closing a socket with unread data resets the
    connection and the reply could be lost."""
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
