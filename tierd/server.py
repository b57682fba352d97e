"""The daemon: one ROUTER socket and a single-threaded main loop that receives, decodes, dispatches,
submits copies and replies. State lives in the registry and the pool; handlers (tierd.handlers)
decide; copies run on transfer lanes; an HTTP thread serves operators from a status snapshot.

Every request gets exactly one reply: a success body or a typed error. A handler that raises is
answered INTERNAL with the exception text; a copy that raises is answered DEVICE_ERROR.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import time
import uuid

import zmq

from tierd import __version__, endpoint, handlers, warm
from tierd.channel import CHANNEL_OPS, Channel, ChannelServer, channel_path
from tierd.config import Settings
from tierd.disconnects import ConnectionWatch
from tierd.handlers import Call, Job, Tier
from tierd.peer import Peer, parse_peer_address
from tierd.pool.pool import Pool
from tierd.protocol import codec, messages
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import PageLayout
from tierd.registry import Limits, Registry
from tierd.stats import Stats
from tierd.status import StatusBoard, build_status
from tierd.tenants import Tenants, load_tokens
from tierd.transfer.engine import QUEUED, TransferEngine

log = logging.getLogger("tierd")

HOUSEKEEPING_S = 0.2
# Python's cyclic GC rescans every tracked object on a full collection: 0.4 s per million index
# objects, triggered by index churn. Long-lived objects are moved out of its sight periodically
# (gc.freeze); they are still freed by reference counting, which the index relies on (it builds
# no reference cycles).
GC_FREEZE_S = 5.0
SHUTDOWN_GRACE_S = 8.0
RECV_BURST = 256  # requests taken per wake-up before copies are finished and housekeeping runs
BATCH_BYTES = 8 << 20  # ... read before any is handled, at most (the batch's frames are all in memory)
NO_STATE_OPS = ("PING", "STATUS")  # answered while stopping
SESSIONLESS_OPS = ("HELLO",)


class Daemon:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.stats = Stats()
        self._stop_r, self._stop_w = os.pipe()
        os.set_blocking(self._stop_r, False)
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 1000)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # per part: a frame up to twice the limit is read and answered TOO_LARGE; beyond, the peer is dropped
        self.router.setsockopt(zmq.MAXMSGSIZE, 2 * settings.max_frame_bytes)
        # connections are capped (each costs a descriptor; libzmq aborts when none is left to accept
        # with), and a client's closed connection drops its session at once, not at the heartbeat
        # timeout (tierd.disconnects)
        self.max_connections = _connection_cap(settings)
        self.watch = ConnectionWatch(self.router, self.max_connections, 2 * settings.max_sessions_per_peer)
        # the endpoint first: a second daemon on a served socket is refused before it backs (and
        # pins) a pool; clients that connect meanwhile are answered once the loop runs
        self._bind()
        try:
            self._open(settings)
        except BaseException:
            self._unbind()
            raise
        self.stats.install(self.board.ask, _l2_families if self.l2 is not None else None)  # /metrics is
        # scraped on the HTTP thread: it asks the main loop

    def _open(self, settings: Settings) -> None:
        self.cuda = _cuda_support(settings)
        self.pool = Pool(
            settings.ceiling_bytes,
            settings.initial_bytes,
            settings.l1_align_bytes,
            settings.l1_segment_mb << 20,
            pinner=self.cuda.pinner() if self.cuda else None,
            ns_quota_bytes=int(settings.namespace_quota_gb * (1 << 30)),
            eviction_log=settings.eviction_log,
            eviction_policy=settings.eviction_policy,
            grow_bytes=settings.l1_grow_mb << 20,
            pool_dir=settings.pool_dir,
            meta=warm.pool_meta(settings),
            index_dir=settings.pool_index_dir,
        )
        warm.announce(settings, self.pool)
        self.xfer = TransferEngine(settings.workers)
        self.registry = Registry(
            self.pool,
            self.xfer,
            settings.lease_ttl_s,
            settings.heartbeat_timeout_s,
            Limits.from_settings(settings),
        )
        self._ipc = settings.socket.startswith("ipc://")
        tenants = Tenants(
            not self._ipc,
            load_tokens(settings.tcp_token_file) if settings.tcp_token_file else None,
            settings.insecure_tcp,
        )
        self._peers: dict[str, Peer] = {}  # Peer-Address -> Peer
        self.boot_id = uuid.uuid4().hex
        self.tier = Tier(
            self.registry,
            self.pool,
            self.stats,
            settings,
            self.boot_id,
            self._open_memory,
            self.status,
            tenants,
        )
        self.l2 = _second_tier(settings, self.pool)  # None without --l2-url
        self.tier.l2 = self.l2
        self.tier.channel_max_bytes = self.channel.max_bytes if self.channel is not None else 0
        self.stopping = False
        self._next_freeze = 0.0
        self.board = StatusBoard()  # the last /status, for the HTTP thread
        self.http = None
        self.http_port: int | None = None

    # ---- setup ----------------------------------------------------------------------------
    def _bind(self) -> None:
        # ipc://: a safe folder, the endpoint's lock held for our life, then the socket (tierd.endpoint)
        self.endpoint = endpoint.bind(self.router, self.settings.socket, self.settings.socket_mode)
        self.inbox = None  # engines hand their unnamed shared memory over as descriptors (tierd.fdinbox)
        self.channel = None  # LOOKUP and PING without ZeroMQ (tierd.channel)
        path = self.endpoint.path
        if path and self.settings.lookup_channel:
            mode = int(self.settings.socket_mode, 8)
            self.channel = ChannelServer(channel_path(path), mode, self.max_connections)
        if path:
            from tierd.fdinbox import FdInbox, inbox_path

            self.inbox = FdInbox(
                inbox_path(path),
                int(self.settings.socket_mode, 8),
                max_per_uid=self.settings.max_files_per_tenant,
            )

    def start_http(self) -> None:
        if self.settings.http_port < 0:
            return
        from tierd.http.server import start_http_server

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

    def _open_memory(self, layout: PageLayout, peer: Peer):
        if layout.device == "cpu":
            from tierd.transfer.cpu import CpuRankMemory

            claim = None
            if self.inbox is not None and peer.local:

                def claim(ticket, uid=peer.uid):
                    return self.inbox.claim(uid, ticket)

            return CpuRankMemory(layout, peer, self._refuse_own_file, claim)
        if not self.cuda:
            raise ProtocolError(
                ErrorCode.LAYOUT_INVALID, "a cuda layout was registered but this daemon has no CUDA"
            )
        return self.cuda.rank_memory(layout)

    def _refuse_own_file(self, st: os.stat_result) -> str | None:
        """A client naming one of the pool's own files (--pool-dir under /dev/shm) is refused."""
        for folder in {self.settings.pool_dir, self.settings.pool_index_dir} - {None}:
            try:
                if os.stat(folder).st_dev != st.st_dev:
                    continue
                with os.scandir(folder) as entries:
                    if any(e.inode() == st.st_ino for e in entries):
                        return f"it is one of the daemon's own pool files (in {folder})"
            except OSError:
                continue
        return None

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.xfer.wake_r, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        poller.register(self.board.wake_r, zmq.POLLIN)
        if self.l2 is not None:
            poller.register(self.l2.wake_r, zmq.POLLIN)
        if self.watch is not None:
            poller.register(self.watch.monitor, zmq.POLLIN)
        channels = None
        if self.channel is not None:
            self.channel.watch(poller)
            channels = self.channel.conns
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
        spin = self.settings.busy_poll_us / 1e6  # (--busy-poll-us: from the last socket event on)
        active = 0.0
        while True:
            events = poller.poll(0 if spin and time.perf_counter() - active < spin else self._poll_ms())
            for sock, _ in events:
                if sock is self.router:
                    self._recv_burst()
                elif self.watch is not None and sock is self.watch.monitor:
                    self.watch.drain()
                    self._drop_disconnected()
                elif sock == self.board.wake_r:
                    self.board.answer(self.status)
                elif channels is not None:
                    if sock == self.channel.fd:
                        self.channel.accept()
                    elif sock in channels:
                        self._recv_channel(channels[sock])
            self._finish_jobs()
            if self.l2 is not None:
                self._finish_l2()
            if spin and events:
                active = time.perf_counter()
            now = time.monotonic()
            if now >= next_house:
                self.board.beat = now  # /healthz reads it (tierd.status)
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

    def _recv_burst(self) -> None:
        """Up to RECV_BURST requests; in batches read whole before any is handled, so that the
        connection events that came before them are known first (tierd.disconnects). A batch holds
        at most BATCH_BYTES of frames, and one message more."""
        left = RECV_BURST
        while left > 0:
            batch, nbytes = [], 0
            while left > 0 and nbytes < BATCH_BYTES:
                try:
                    message = self._recv_message()
                except zmq.Again:
                    left = 0
                    break
                left -= 1
                batch.append(message)
                nbytes += len(message[1])
            watch = self.watch
            if watch is not None:
                watch.drain()
            for identity, frame, extra in batch:
                envelope = [identity]
                peer = self._peer(frame)
                if watch is not None:
                    watch.saw(identity, frame, peer.uid)
                if extra is not None:  # not [identity, frame] from a DEALER: nothing of it is echoed
                    self._refuse_message(envelope, *extra)
                    continue
                self._on_request(envelope, frame.buffer, peer)
            if watch is not None:
                self._drop_disconnected()

    def _recv_message(self) -> tuple[bytes, zmq.Frame, tuple[int, int] | None]:
        """One message: ``(identity, frame, None)`` for a DEALER's ``[identity, frame]``, else
        ``(identity, first frame, (frames, bytes in all))``.

        Hazard: ZeroMQ delivers a message whole, so by the time its first frame can be read libzmq
        holds all of it, whatever its number of parts (MAXMSGSIZE bounds each part, not their sum).
        What the daemon can bound is what it holds on top of that: the parts after the first are
        read one at a time and let go at once, never gathered, so a message of any number of parts
        costs at most its first frame besides libzmq's own copy, and that copy is freed as it is
        read (recv_multipart would hold every part, as a Python object each, until the batch is
        handled)."""
        identity = self.router.recv(zmq.NOBLOCK)
        frame = self.router.recv(copy=False)  # a ROUTER's message has one after the identity
        if not frame.more:
            return identity, frame, None
        frames, nbytes, more = 1, len(frame), True
        while more:
            part = self.router.recv(copy=False)
            frames, nbytes, more = frames + 1, nbytes + len(part), part.more
        return identity, frame, (frames, nbytes)

    def _refuse_message(self, envelope: list[bytes], frames: int, nbytes: int) -> None:
        cap = 2 * self.settings.max_frame_bytes
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
                self._on_request(channel, frame, channel.peer)

    def _drop_disconnected(self) -> None:
        """Sessions whose connection closed go now, as a heartbeat timeout would take them."""
        reg = self.registry
        ended = self.watch.ended()
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

    def _peer(self, frame: zmq.Frame) -> Peer:
        """The sender's credentials (SO_PEERCRED on ipc://), from the message's Peer-Address."""
        try:
            address = frame.get("Peer-Address")
        except zmq.ZMQError:
            address = ""
        peer = self._peers.get(address)
        if peer is None:
            if len(self._peers) >= 4096:
                self._peers.clear()
            peer = self._peers[address] = parse_peer_address(address, self._ipc)
        return peer

    def _on_request(self, envelope: list[bytes] | Channel, frame, peer: Peer) -> None:
        """One request from the ROUTER (``envelope`` [identity]) or from a lookup channel."""
        t0 = time.perf_counter()
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
            result = handlers.HANDLERS[op](
                self.tier, Call(identity, session, envelope, req_id, t0, peer), msg
            )
            if result is handlers.DEFERRED:  # answered once L2 has (tierd.tier2), by its deadline
                return
            if isinstance(result, Job):
                self.xfer.submit(result.lane, result.run, result)
                return
            self._send(envelope, codec.encode_reply(req_id, result))
            self.stats.observe(op, time.perf_counter() - t0)
        except ProtocolError as exc:
            self._error(envelope, exc.req_id if exc.req_id is not None else req_id, exc.code, exc.message, op)
        except Exception as exc:  # every request gets a reply, whatever broke
            log.exception("handler for %s raised", op)
            self._error(envelope, req_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", op)
        self.pool.settle()  # what the reply did not wait for (a LOOKUP's LRU touch), before the next request

    def _error(self, envelope, req_id: int, code: ErrorCode, message: str, op: str) -> None:
        self.stats.error(code.name)
        log.debug("%s req %d -> %s: %s", op, req_id, code.name, message)
        self._send(envelope, codec.encode_error(req_id, code, message))

    def _send(self, envelope: list[bytes] | Channel, frame: bytes) -> None:
        if type(envelope) is Channel:
            if not envelope.send(frame):  # its queue is full or it is gone: its deadline covers it
                self.channel.dropped += 1
            return
        try:
            self.router.send_multipart([*envelope, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: the client's deadline covers it
            log.debug("reply dropped: %s", exc)

    def _finish_jobs(self) -> None:
        for job, result, exc in self.xfer.drain():
            call = job.call
            if result is QUEUED:  # its copy is queued: the reply goes now, the completion later
                job.replied = True
                self._send(call.envelope, codec.encode_reply(call.req_id, job.queued(self.tier)))
                self.stats.observe(job.op, time.perf_counter() - call.t0, job.nbytes)
                continue
            if exc is not None and not isinstance(exc, handlers.Expired):
                log.error("%s copy for %s failed: %r", job.op, job.instance.id, exc)
            try:
                body = job.finish(self.tier, exc)
            except ProtocolError as err:
                if not job.replied:
                    self._error(call.envelope, call.req_id, err.code, err.message, job.op)
                continue
            except Exception as e:  # noqa: BLE001 - still answer
                log.exception("finishing %s raised", job.op)
                if not job.replied:
                    self._error(
                        call.envelope, call.req_id, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", job.op
                    )
                continue
            if not job.replied:
                self._send(call.envelope, codec.encode_reply(call.req_id, body))
                self.stats.observe(job.op, time.perf_counter() - call.t0, job.nbytes)

    def _finish_l2(self) -> None:
        for call, op, result in self.l2.drain(self.tier, time.monotonic()):
            self._deliver(call, op, result)
        self.pool.settle()  # the touches and lease pins of LOOKUPs answered now

    def _deliver(self, call: Call, op: str, result) -> None:
        """The reply, or the copy, of a request that waited for L2."""
        if isinstance(result, Job):
            self.xfer.submit(result.lane, result.run, result)
        elif isinstance(result, ProtocolError):
            self._error(call.envelope, call.req_id, result.code, result.message, op)
        elif isinstance(result, Exception):
            log.error("%s after L2: %r", op, result)
            self._error(
                call.envelope, call.req_id, ErrorCode.INTERNAL, f"{type(result).__name__}: {result}", op
            )
        else:
            self._send(call.envelope, codec.encode_reply(call.req_id, result))
            self.stats.observe(op, time.perf_counter() - call.t0)

    def _poll_ms(self) -> int:
        """Until the next housekeeping, or sooner when a request waiting for L2 is due."""
        wait = HOUSEKEEPING_S
        if self.l2 is not None:
            due = self.l2.next_due(time.monotonic())
            if due is not None:
                wait = min(wait, max(0.0, due))
        return math.ceil(wait * 1000)

    def _housekeeping(self, now: float) -> None:
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
                self._deliver(call, op, result)
        self.xfer.close()  # waits for every queued copy
        self._finish_jobs()
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
        if self.watch is not None:
            self.watch.close()
        self.router.close(linger=linger_ms)
        if self.inbox is not None:
            self.inbox.close()
        if self.channel is not None:
            self.channel.close()
        self.endpoint.close()  # our socket file goes, then the lock
        os.close(self._stop_r)
        os.close(self._stop_w)


def _connection_cap(settings: Settings) -> int:
    """--max-connections, or (0) a quarter of the descriptors this process may open, raised first
    to the hard limit: the rest is for shared-memory files, pool segments, and the connections a
    burst brings in before the loop sees them (libzmq accepts on its own thread)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    cap = (1 << 20) if soft == resource.RLIM_INFINITY else max(64, soft // 4)
    return min(settings.max_connections, cap) if settings.max_connections else cap


def _l2_families(status: dict):
    """The ``tierd_l2_*`` metric families of a /status (with --l2-url)."""
    from tierd.tier2.metrics import families

    return families(status.get("l2"))


def _second_tier(settings: Settings, pool: Pool):
    """Mooncake Store as L2 with --l2-url (imported only then), else None."""
    if not settings.l2_url:
        return None
    from tierd.tier2 import SecondTier

    return SecondTier(settings, pool)


def _cuda_support(settings: Settings):
    """The CUDA data path when torch sees a GPU (and --cuda is not off), else None."""
    if settings.cuda == "off":
        return None
    try:
        from tierd.transfer import cuda
    except ImportError:
        return None
    return cuda.detect(settings)
