"""The daemon: one ROUTER socket, a single-threaded main loop that owns all metadata, transfer
threads for the copies, and an HTTP thread for operators.

Every request gets exactly one reply: a success body or a typed error. A handler that raises is
answered INTERNAL with the exception text; a copy that raises is answered DEVICE_ERROR.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import stat
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import zmq

from tierd import __version__
from tierd.config import Settings
from tierd.ops import PENDING, Job, Ops
from tierd.pool.pool import Pool
from tierd.protocol import codec
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import PageLayout
from tierd.sessions import Instance, LeaseTable, Session
from tierd.stats import COUNTERS, Stats
from tierd.transfer.engine import READ_LANE, TransferEngine

log = logging.getLogger("tierd")

HOUSEKEEPING_S = 0.2
# Python's cyclic GC rescans every tracked object on a full collection: 0.4 s per million index
# objects, triggered by index churn. Long-lived objects are moved out of its sight periodically
# (gc.freeze); they are still freed by reference counting, which the index relies on (it builds
# no reference cycles).
GC_FREEZE_S = 5.0
SHUTDOWN_GRACE_S = 8.0


class Daemon:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.stats = Stats()
        self.cuda = _cuda_support()
        self.pool = Pool(
            settings.ceiling_bytes,
            settings.initial_bytes,
            settings.l1_align_bytes,
            settings.l1_segment_mb << 20,
            pinner=self.cuda.pinner() if self.cuda else None,
        )
        self.sessions: dict[bytes, Session] = {}
        self.instances: dict[str, Instance] = {}
        self.namespaces: dict[bytes, object] = {}  # namespace id -> Namespace, as named by REGISTER/LOOKUP
        self.leases = LeaseTable(self.pool, settings.lease_ttl_s)
        self.xfer = TransferEngine(settings.workers)
        self.ops = Ops(self)
        self.stopping = False
        self._next_freeze = 0.0
        self.http = None
        self.http_port: int | None = None
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._call_r, self._call_w = os.pipe()
        os.set_blocking(self._call_r, False)
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 1000)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, max(4 * settings.max_frame_bytes, 256 << 20))
        self._bind()
        self.stats.install(self.status)

    # ---- setup ----------------------------------------------------------------------------
    def _bind(self) -> None:
        path = self.settings.socket_file
        if path:
            folder = os.path.dirname(path) or "."
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.path.exists(path):
                if _endpoint_alive(self.ctx, self.settings.socket):
                    raise RuntimeError(f"another tierd is already serving {self.settings.socket}")
                os.unlink(path)  # stale file from a crashed daemon
        self.router.bind(self.settings.socket)
        if path:
            os.chmod(path, int(self.settings.socket_mode, 8))

    def start_http(self) -> None:
        if self.settings.http_port < 0:
            return
        from tierd.http.server import start_http_server

        self.http = start_http_server(self, self.settings.http_host, self.settings.http_port)
        self.http_port = self.http.server_address[1]

    def open_memory(self, layout: PageLayout):
        if layout.device == "cpu":
            from tierd.transfer.cpu import CpuRankMemory

            return CpuRankMemory(layout)
        if not self.cuda:
            raise ProtocolError(ErrorCode.LAYOUT_INVALID, "a cuda layout was registered but this daemon has no CUDA")
        return self.cuda.rank_memory(layout)

    # ---- state changes used by handlers -------------------------------------------------------
    def unregister(self, inst_id: str) -> None:
        inst = self.instances.pop(inst_id, None)
        if inst is None:
            return
        inst.closed = True
        session = self.sessions.get(inst.session)
        if session is not None:
            session.instances.discard(inst_id)
        self.xfer.detach(inst_id, last=inst.memory.close)  # unmapped after its queued copies
        log.info("unregistered %s", inst_id)

    def drop_session(self, identity: bytes, reason: str) -> None:
        session = self.sessions.pop(identity, None)
        if session is None:
            return
        for lease_id in list(session.leases):
            self.leases.release(lease_id, self.sessions)
        for inst_id in list(session.instances):
            self.unregister(inst_id)
        log.info("session %s (%s pid %d) dropped: %s", identity.hex()[:12], session.name, session.pid, reason)

    def submit(self, job: Job, fn) -> None:
        job.instance.inflight += 1
        lane = job.instance.id
        if job.op == "RETRIEVE" and getattr(job.instance.memory, "duplex", False):
            lane += READ_LANE
        self.xfer.submit(lane, fn, job)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.xfer.wake_r, zmq.POLLIN)
        poller.register(self._call_r, zmq.POLLIN)
        next_house = time.monotonic()
        stop_deadline = None
        log.info(
            "tierd %s serving %s (pool ceiling %.2f GiB, backed %.2f GiB%s)",
            __version__, self.settings.socket, self.pool.configured_bytes / 2**30, self.pool.backed_bytes / 2**30,
            ", pinned" if self.cuda else "",
        )
        while True:
            for sock, _ in poller.poll(int(HOUSEKEEPING_S * 1000)):
                if sock is self.router:
                    self._recv_burst()
                elif sock == self._call_r:
                    self._run_calls()
            self._finish_jobs()
            now = time.monotonic()
            if now >= next_house:
                self._housekeeping(now)
                next_house = now + HOUSEKEEPING_S
            if self.stopping:
                stop_deadline = stop_deadline or now + SHUTDOWN_GRACE_S
                if self.xfer.inflight == 0 or now > stop_deadline:
                    break
        self._finish_jobs()
        self.close()

    def stop(self, *_args) -> None:
        """Signal-safe: stop taking new work, finish in-flight copies, then exit the loop."""
        if not self.stopping:
            log.info("stopping: finishing %d in-flight copies", self.xfer.inflight)
        self.stopping = True
        try:
            os.write(self._call_w, b"s")
        except OSError:
            pass

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def _recv_burst(self) -> None:
        for _ in range(256):
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(parts) < 2:
                continue
            self._on_request(parts[:-1], parts[-1])

    def _on_request(self, envelope: list[bytes], frame: bytes) -> None:
        t0 = time.perf_counter()
        req_id, op = 0, "?"
        try:
            op, req_id, body = codec.decode_request(frame, self.settings.max_frame_bytes)
            handler = self.ops.table.get(op)
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}")
            if self.stopping and op not in ("PING", "STATUS"):
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
            identity = envelope[0]
            session = self.sessions.get(identity)
            if op != "HELLO":
                if session is None:
                    raise ProtocolError(ErrorCode.UNKNOWN_SESSION, "send HELLO first (the daemon may have restarted)")
                session.last_seen = time.monotonic()
            ctx = SimpleNamespace(envelope=envelope, req_id=req_id, t0=t0)
            result = handler(identity, session, body, ctx)
            if result is PENDING:
                return
            self._send(envelope, codec.encode_reply(req_id, result))
            self.stats.observe(op, time.perf_counter() - t0)
        except ProtocolError as exc:
            self._error(envelope, exc.req_id if exc.req_id is not None else req_id, exc.code, exc.message, op)
        except Exception as exc:  # every request gets a reply, whatever broke
            log.exception("handler for %s raised", op)
            self._error(envelope, req_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", op)

    def _error(self, envelope, req_id: int, code: ErrorCode, message: str, op: str) -> None:
        self.stats.error(code.name)
        log.debug("%s req %d -> %s: %s", op, req_id, code.name, message)
        self._send(envelope, codec.encode_error(req_id, code, message))

    def _send(self, envelope: list[bytes], frame: bytes) -> None:
        try:
            self.router.send_multipart([*envelope, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: the client's deadline covers it
            log.debug("reply dropped: %s", exc)

    def _finish_jobs(self) -> None:
        for job, _result, exc in self.xfer.drain():
            job.instance.inflight -= 1
            try:
                if job.op == "STORE":
                    body, err = self.ops.finish_store(job, exc)
                else:
                    body, err = self.ops.finish_retrieve(job, exc)
            except Exception as e:  # noqa: BLE001 - still answer
                log.exception("finishing %s raised", job.op)
                body, err = None, ProtocolError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            if exc is not None:
                log.error("%s copy for %s failed: %r", job.op, job.instance.id, exc)
            if err is not None:
                self._error(job.envelope, job.req_id, err.code, err.message, job.op)
            else:
                self._send(job.envelope, codec.encode_reply(job.req_id, body))
                self.stats.observe(job.op, time.perf_counter() - job.t0, job.nbytes)

    def _housekeeping(self, now: float) -> None:
        if now >= self._next_freeze:
            gc.freeze()
            self._next_freeze = now + GC_FREEZE_S
        live = {inst.ns for inst in self.instances.values()}
        for ns_id in [n for n in self.namespaces if n not in live and not self.pool.per_ns.get(n)]:
            del self.namespaces[ns_id]
        expired = self.leases.expire(now, self.sessions)
        if expired:
            self.stats.add("leases_expired", expired)
        limit = self.settings.heartbeat_timeout_s
        for identity, session in list(self.sessions.items()):
            if now - session.last_seen > limit:
                self.stats.add("leases_expired", len(session.leases))
                self.stats.add("sessions_reaped")
                self.drop_session(identity, reason=f"no message for {limit:g} s")

    # ---- calls from other threads (HTTP) ----------------------------------------------------------
    def call(self, fn, timeout: float = 5.0):
        """Run ``fn`` on the main loop (which owns all state) and return its result."""
        if threading.current_thread() is threading.main_thread() or self.stopping:
            return fn()
        fut: Future = Future()
        self._calls.put((fn, fut))
        os.write(self._call_w, b"c")
        return fut.result(timeout)

    def _run_calls(self) -> None:
        try:
            while os.read(self._call_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001
                fut.set_exception(exc)

    # ---- status ------------------------------------------------------------------------------------
    def status(self) -> dict:
        pool, counts = self.pool, self.stats.counts
        with pool.lock:
            out = {
                "version": __version__,
                "boot_id": self.ops.boot_id,
                "pid": os.getpid(),
                "uptime_s": round(time.time() - self.stats.started, 3),
                "socket": self.settings.socket,
                "cuda": bool(self.cuda),
                "memory_configured_bytes": pool.configured_bytes,
                "memory_total_bytes": pool.backed_bytes,
                "memory_used_bytes": pool.used_bytes,
                "memory_pinned_bytes": self.cuda.pinned_bytes if self.cuda else 0,
                "objects": pool.objects,
                "group_objects": dict(pool.per_group),
                "evictions": pool.evictions,
                "namespaces": [
                    {**ns.to_wire(), "objects": pool.per_ns[ns_id]}
                    for ns_id, ns in self.namespaces.items()
                    if pool.per_ns.get(ns_id)
                ],
            }
        out.update({name: counts.get(name, 0) for name, _ in COUNTERS if name != "evictions"})
        now = time.monotonic()
        if self.cuda:
            out["cuda_detail"] = self.cuda.status()
        out["errors_by_code"] = dict(self.stats.errors_by_code)
        out["leases_active"] = len(self.leases.leases)
        out["gc_frozen_objects"] = gc.get_freeze_count()
        out["sessions"] = len(self.sessions)
        out["instances"] = [
            {
                "instance": inst.id,
                "model": inst.layout.namespace.model,
                "namespace": inst.layout.namespace.to_wire(),
                "rank": inst.layout.rank,
                "device": inst.layout.device,
                "groups": [g.spec.kind.value for g in inst.layout.groups],
                "last_heartbeat_s_ago": round(now - self.sessions[inst.session].last_seen, 3)
                if inst.session in self.sessions
                else None,
            }
            for inst in list(self.instances.values())
        ]
        return out

    # ---- shutdown ----------------------------------------------------------------------------------
    def close(self) -> None:
        for inst_id in list(self.instances):
            self.unregister(inst_id)
        self.xfer.close()  # waits for every queued copy, then each gets its reply
        self._finish_jobs()
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self.router.close(linger=500)
        path = self.settings.socket_file
        if path and os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
        self.pool.close()
        os.close(self._call_r)
        os.close(self._call_w)
        log.info("stopped")


def _endpoint_alive(ctx: zmq.Context, endpoint: str, timeout_ms: int = 500) -> bool:
    """Whether a tierd answers on ``endpoint`` (any reply to a PING within the deadline)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(codec.encode_request("PING", 1, {}))
        return bool(sock.poll(timeout_ms))
    finally:
        sock.close()


def _cuda_support():
    """The CUDA data path when torch sees a GPU, else None (CPU-only daemon)."""
    if os.environ.get("TIERD_DISABLE_CUDA") == "1":
        return None
    try:
        from tierd.transfer import cuda
    except ImportError:
        return None
    return cuda.detect()
