"""The daemon: one ROUTER endpoint (tierd.edge.zmtp) and a single-threaded main loop that receives,
decodes, dispatches, carries each handler's outcome and replies. Requests read wait in a backlog,
handled in arrival order except that a RETRIEVE goes before the STOREs ahead of it, then by turns
(tierd.core.backlog). State lives in the registry and the pool; handlers (tierd.core.handlers) decide and
return an outcome: a reply's body, a copy Job, or what the request needs of the second tier, which
the loop asks it and hands back to the handler once it answered.
Copies run on transfer lanes; an HTTP thread serves operators from a status snapshot.

Every request gets exactly one reply, and every reply goes out through ``respond``
(tierd.core.respond): a success body or a typed error. A handler that raises is answered INTERNAL
with the exception text; a copy that raises is answered DEVICE_ERROR.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import uuid

import zmq

from tierd import __version__
from tierd.base.config import Settings
from tierd.base.stats import Stats, live_families
from tierd.core import handlers
from tierd.core.backlog import Backlog
from tierd.core.jobs import Call, Tier
from tierd.core.outcomes import Outcomes
from tierd.core.respond import Replies
from tierd.daemon import assemble, warm
from tierd.daemon.status import StatusBoard, build_status
from tierd.edge import endpoint
from tierd.edge.channel import CHANNEL_OPS, Channel, ChannelServer, channel_path
from tierd.edge.fdinbox import FdInbox, inbox_path
from tierd.edge.http.endpoints import start_http_server
from tierd.edge.peer import Peer
from tierd.edge.zmtp import Router
from tierd.pool.pages import SMALL_PAGES
from tierd.protocol import codec, messages
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.transfer.engine import TransferEngine

log = logging.getLogger("tierd")

HOUSEKEEPING_S = 0.2
# Python's cyclic GC rescans every tracked object on a full collection, a pause that grows with
# the index (``benchmarks/lookup_latency.py --no-freeze-gc`` shows it in LOOKUP's p99), triggered
# by index churn. Long-lived objects are moved out of its sight periodically
# (gc.freeze); they are still freed by reference counting, which the index relies on (it builds
# no reference cycles).
GC_FREEZE_S = 5.0
SHUTDOWN_GRACE_S = 8.0
# requests a turn takes before housekeeping: per lookup channel read, and in all while it reads
# between two requests (tierd.core.backlog)
RECV_BURST = 256
# LOOKUP bookkeeping (tierd.pool.recency), in objects and keys: the most left unapplied when
# requests leave the loop no idle time (two 2,048-key LOOKUPs)
SETTLE_MAX = 1 << 13
NO_STATE_OPS = ("PING", "STATUS")  # answered while stopping
SESSIONLESS_OPS = ("HELLO",)


class Daemon:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.stats = Stats()
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_r, False)
        # the daemon serves ZeroMQ's wire protocol itself (tierd.edge.zmtp): a message's size is bounded
        # whatever its number of parts, and each message comes with its connection's credentials.
        # Connections are capped: each costs a descriptor before it says anything.
        self.max_connections = assemble.connection_cap(settings)
        per_peer = 2 * settings.max_sessions_per_peer
        self.router = Router(2 * settings.max_frame_bytes, self.max_connections, per_peer)
        self.backlog = Backlog()  # requests read, not handled yet (tierd.core.backlog)
        # the endpoint first: a second daemon on a served socket is refused before it backs (and
        # pins) a pool; clients that connect meanwhile get their handshake, their requests are
        # answered once the loop runs
        self._bind()
        try:
            self.router.handshakes_during(lambda: self._open(settings))
        except BaseException:
            self._unbind()
            raise
        # /metrics is scraped on the HTTP thread: it asks the main loop
        self.stats.install(
            self.board.ask, assemble.l2_families if self.l2 is not None else None, self._live_families
        )

    def _open(self, settings: Settings) -> None:
        self.cuda = assemble.cuda_support(settings)
        self.pool = assemble.open_pool(settings, self.cuda)
        warm.announce(settings, self.pool)
        self.xfer = TransferEngine(settings.workers)
        self.registry = assemble.open_registry(settings, self.pool, self.xfer)
        tenants = assemble.open_tenants(settings, settings.socket.startswith("ipc://"))
        self.boot_id = uuid.uuid4().hex
        self.memory = assemble.MemoryOpener(settings, self.cuda, self.inbox)
        self.tier = Tier(
            self.registry, self.pool, self.stats, settings, self.boot_id, self.memory, self.status, tenants
        )
        self.l2 = assemble.second_tier(settings, self.pool, self.registry)  # None without --l2-url
        self.tier.l2 = self.l2
        self.replies = Replies(self.router, self.channel, self.stats)
        self.respond = self.replies.respond  # every reply goes out through it
        self.outcomes = Outcomes(self.tier, self.xfer, self.l2, self.respond)
        self.tier.channel_max_bytes = self.channel.max_bytes if self.channel is not None else 0
        self.stopping = False
        self._next_freeze = 0.0
        self.board = StatusBoard()  # the last /status, for the HTTP thread
        self.http = None
        self.http_port: int | None = None

    # ---- setup ----------------------------------------------------------------------------
    def _bind(self) -> None:
        # ipc://: a safe folder, the endpoint's lock held for our life, then the socket (tierd.edge.endpoint)
        self.endpoint = endpoint.bind(self.router, self.settings.socket, self.settings.socket_mode)
        self.inbox = None  # engines hand their unnamed shared memory over as descriptors (tierd.edge.fdinbox)
        self.channel = None  # LOOKUP and PING without ZeroMQ (tierd.edge.channel)
        path = self.endpoint.path
        if path and self.settings.lookup_channel:
            mode = int(self.settings.socket_mode, 8)
            self.channel = ChannelServer(channel_path(path), mode, self.max_connections)
        if path:
            self.inbox = FdInbox(
                inbox_path(path),
                int(self.settings.socket_mode, 8),
                max_per_uid=self.settings.max_files_per_tenant,
            )

    def start_http(self) -> None:
        if self.settings.http_port < 0:
            return
        self.board.publish(self.status())
        self.http = start_http_server(
            self.board,
            self.stats.registry,
            self.settings.http_host,
            self.settings.http_port,
            self.settings.http_timeout_s,
            self.settings.http_max_connections,
        )
        self.http_port = self.http.server_address[1]

    def _live_families(self):
        """/metrics figures read on the HTTP thread, not asked of the main loop (tierd.base.stats)."""
        return live_families(time.monotonic() - self.board.beat, self.http)

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router.fd, zmq.POLLIN)
        poller.register(self.xfer.wake_r, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        poller.register(self.board.wake_r, zmq.POLLIN)
        if self.l2 is not None:
            poller.register(self.l2.wake_r, zmq.POLLIN)
        if self.channel is not None:
            self.channel.watch(poller)
        next_house = time.monotonic()
        stop_deadline = None
        log.info(
            "tierd %s serving %s (pool ceiling %.2f GiB, backed %.2f GiB%s)",
            __version__,
            self.settings.socket,
            self.pool.configured_bytes / 2**30,
            self.pool.backed_bytes / 2**30,
            ", pinned" if self.cuda else "",
        )
        huge = self.pool.segments.huge_pages()
        if huge in SMALL_PAGES:
            log.info(
                "the pool's shared memory is in 4 KiB pages (the kernel's huge-page setting for it: %s);"
                " CPU copies through it run faster in huge pages (README, 'Huge pages')",
                huge,
            )
        spin = self.settings.busy_poll_us / 1e6  # (--busy-poll-us: from the last socket event on)
        active = 0.0
        while True:
            events = poller.poll(
                0
                if self.pool.unsettled or (spin and time.perf_counter() - active < spin)
                else self.outcomes.poll_ms(HOUSEKEEPING_S)
            )
            for sock, _ in events:
                if self._read(sock):
                    continue
                if sock == self.board.wake_r:
                    self.board.answer(self.status)
                elif self.channel is not None and sock == self.channel.fd:
                    self.channel.accept()
            self._serve(poller)
            self._drop_disconnected()
            self.outcomes.finish_jobs()
            if self.l2 is not None:
                self.outcomes.finish_l2()
            if self.pool.unsettled:
                self._settle(poller)
            if spin and events:
                active = time.perf_counter()
            now = time.monotonic()
            if now >= next_house:
                self.board.beat = now  # /healthz reads it (tierd.daemon.status)
                self._housekeeping(now)
                next_house = now + HOUSEKEEPING_S
            if self.stopping:
                stop_deadline = stop_deadline or now + SHUTDOWN_GRACE_S
                if (self.xfer.inflight == 0 and (self.l2 is None or self.l2.idle)) or now > stop_deadline:
                    break
        self.close()

    def stop(self, *_args) -> None:
        """Signal-safe: stop taking new work, finish in-flight copies, then exit the loop."""
        if not self.stopping:
            log.info("stopping: finishing %d in-flight copies", self.xfer.inflight)
        self.stopping = True
        self.board.stopping = True
        try:
            os.write(self._stop_w, b"s")
        except OSError:
            pass

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def _serve(self, poller) -> None:
        """Handle the requests read, in the backlog's order (tierd.core.backlog). While a STORE waits,
        what arrived meanwhile is read between two requests, so a RETRIEVE can go first, and
        copies that finished are answered; for RECV_BURST requests a turn at most, so a client
        that keeps the sockets full never holds the loop from the rest of its turn (status,
        housekeeping, the second tier)."""
        backlog = self.backlog
        handled = 0
        while backlog:
            self._on_request(*backlog.take())
            handled += 1
            if handled < RECV_BURST and backlog.may_reorder():
                self.outcomes.finish_jobs()
                for sock, _ in poller.poll(0):
                    self._read(sock)

    def _settle(self, poller) -> None:
        """What LOOKUP replies did not wait for (their LRU touches, lease pins and the policy's
        observations), --lookup-settle-objects at a time while nothing waits to be read: a
        request that arrives meanwhile waits for one part at most. Never more than SETTLE_MAX
        behind: a loop with too little idle time applies, each turn, what its turn added beyond."""
        pool, part = self.pool, self.settings.lookup_settle_objects
        if not part:  # at once (what a LOOKUP answered after the second tier left)
            pool.settle()
            return
        while pool.unsettled > SETTLE_MAX and pool.settle(part):
            pass
        while pool.settle(part):
            if poller.poll(0):
                return

    def _read(self, sock) -> bool:
        """Requests ``sock`` holds into the backlog, if it is the ROUTER's or a lookup channel's."""
        if sock == self.router.fd:
            self._recv_router()
            return True
        channel = self.channel.conns.get(sock) if self.channel is not None else None
        if channel is None:
            return False
        self._recv_channel(channel)
        return True

    def _recv_router(self) -> None:
        """What the ROUTER read in one turn (a bounded amount per connection), into the backlog."""
        for identity, frame, peer, extra in self.router.messages():
            envelope = [identity]
            if extra is not None:  # not one frame: nothing of it is echoed
                self._refuse_message(envelope, *extra)
            else:
                self.backlog.put(frame, envelope, peer, time.perf_counter())

    def _refuse_message(self, envelope: list[bytes], frames: int, nbytes: int) -> None:
        cap = self.router.cap
        if nbytes > cap:
            message = f"a message is one frame of at most {cap} bytes, got {frames} frames, {nbytes} bytes"
            self._error(envelope, 0, ErrorCode.TOO_LARGE, message, "?")
        else:
            self._error(envelope, 0, ErrorCode.BAD_REQUEST, f"a request is one frame, got {frames}", "?")

    def _recv_channel(self, channel: Channel) -> None:
        for frame in self.channel.receive(channel, RECV_BURST):
            if isinstance(frame, ProtocolError):
                self._error(channel, frame.req_id or 0, frame.code, frame.message, "?")
            else:
                self.backlog.put(frame, channel, channel.peer, time.perf_counter())

    def _drop_disconnected(self) -> None:
        """Sessions whose connection closed go now, as a heartbeat timeout would take them."""
        reg = self.registry
        ended = self.router.ended()
        if not self.settings.drop_on_disconnect:
            return
        for identity, uid in ended:
            session = reg.sessions.get(identity)
            if session is None or session.uid != uid:
                continue  # gone already (BYE), or another user's connection on its identity ended
            leases = len(session.leases)
            reg.close_session(identity, reason="its connection closed", level=logging.DEBUG)
            self.stats.add("sessions_disconnected")
            if leases:
                self.stats.add("leases_expired", leases)

    def _on_request(self, frame, envelope: list[bytes] | Channel, peer: Peer, t0: float) -> None:
        """One request from the ROUTER (``envelope`` [identity]) or from a lookup channel, read at
        ``t0``."""
        started = time.perf_counter()
        req_id, op = 0, "?"
        try:
            op, req_id, body = codec.split_request(frame, self.settings.max_frame_bytes)
            msg = messages.decode(op, body)
            if type(envelope) is Channel:
                if op not in CHANNEL_OPS:
                    only = " and ".join(CHANNEL_OPS)
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"the lookup channel serves {only}, not {op}")
                identity = envelope.identity
            else:
                identity = envelope[0]
            if self.stopping and op not in NO_STATE_OPS:
                raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
            session = None if op in SESSIONLESS_OPS else self.registry.session(identity, peer.uid)
            call = Call(identity, session, envelope, req_id, t0, peer, started)
            outcome = handlers.HANDLERS[op](self.tier, call, msg)
        except Exception as exc:  # noqa: BLE001 - every request gets a reply, whatever broke
            self.respond(envelope, req_id, op, t0, exc)
        else:
            self.outcomes.carry(call, op, outcome)
        if not self.settings.lookup_settle_objects:
            self.pool.settle()  # at once (--lookup-settle-objects 0)

    def _error(self, envelope, req_id: int, code: ErrorCode, message: str, op: str) -> None:
        self.respond(envelope, req_id, op, 0.0, ProtocolError(code, message))

    def _housekeeping(self, now: float) -> None:
        self.router.sweep(now)  # connections whose handshake never finished
        if self.http is not None:
            self.http.check()  # its accepting thread, started again should it have ended
        if now >= self._next_freeze:
            gc.freeze()
            self._next_freeze = now + GC_FREEZE_S
        if self.l2 is not None:
            self.l2.housekeeping(now)
        reaped, expired = self.registry.reap(now)
        if expired:
            self.stats.add("leases_expired", expired)
        if reaped:
            self.stats.add("sessions_reaped", reaped)

    # ---- status ------------------------------------------------------------------------------------
    def status(self) -> dict:
        return build_status(self)

    # ---- shutdown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Copies first (each answered), then the ranks' memory, then the pool they copied into."""
        if self.l2 is not None:  # the grace is over: what still waits for L2 is answered SHUTTING_DOWN
            for call, op, result in self.l2.abandon():
                self.outcomes.after_l2(call, op, result)
        self.xfer.close()  # waits for every queued copy
        self.outcomes.finish_jobs()
        if self.l2 is not None:
            self.l2.close()  # Mooncake lets go of the pool's memory (bounded: it kills its agent)
        self.board.publish(self.status())
        self.board.close()  # HTTP asks from here on get the last status
        for inst_id in list(self.registry.instances):
            self.registry.unregister(inst_id)  # lanes are gone: the memory is closed at once
        warm.save(self.pool, self.registry)  # copies are done; the pool is still open
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
        self._unbind(linger_ms=500)
        self.pool.close()
        log.info("stopped")

    def _unbind(self, linger_ms: int = 0) -> None:
        self.router.close(linger_ms / 1000)
        if self.inbox is not None:
            self.inbox.close()
        if self.channel is not None:
            self.channel.close()
        self.endpoint.close()  # our socket file goes, then the lock
        os.close(self._stop_r)
        os.close(self._stop_w)
