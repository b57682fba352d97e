"""The daemon's objects in this process, for tests of what the daemon decides rather than of how
its answer travels: ``tierd serve``'s own ``Daemon`` (built from the same flags, its pool, registry
and handlers real), with its main loop's request path driven by hand. A request goes in as the
frame a client sends (``Daemon._on_request``: decode, dispatch, the handler, its copy on a transfer
lane and that copy's completion) and its reply comes back as the frame the daemon would send;
nothing goes through a socket and no thread runs the loop.

What only the wire shows (ZeroMQ framing, connections, the HTTP thread, signals, another
process's memory) stays with the tests that start ``tierd serve``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import select
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
import zmq
from wire import Raw, request

from tierd.protocol import PROTOCOL_VERSION
from tierd.state.records import OWN_PEER

REPLY_WAIT_S = 10.0


class InProcessDaemon:
    """``tierd serve *args`` as objects: ``Daemon`` on ``ipc://<folder>/tierd.sock`` (bound, never
    read) without HTTP, its log (``tierd`` at debug, as the tests' daemons log) in ``log``.
    ``send`` hands it one request frame as the loop takes it; ``next_reply`` is the next reply it
    sent to an identity, in the order it sent them; ``status()`` is /status's JSON."""

    def __init__(self, folder: str | os.PathLike, *args: str, pool_mb: float = 256):
        from tierd.base.config import Settings
        from tierd.daemon.server import Daemon
        from tierd.tools.cli import serve

        self.folder = Path(folder)
        self.endpoint = f"ipc://{self.folder}/tierd.sock"
        self.log = self.folder / "daemon.log"
        argv = ["--socket", self.endpoint, "--http-port", "-1", "--l1-size-gb", f"{pool_mb / 1024:.6f}"]
        self._settings = lambda: Settings(**serve.make_context("serve", [*argv, *args]).params)
        self._daemon = Daemon
        self._boot()

    def _boot(self) -> None:
        self._logger = logging.getLogger("tierd")
        self._handler = logging.FileHandler(self.log)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self._level = self._logger.level
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self._handler)
        self.daemon = self._daemon(self._settings())
        self.settings = self.daemon.settings
        self._replies: dict[bytes, list[bytes]] = {}
        self.daemon.replies.send = self._sent
        self.closed = False

    def restart(self) -> None:
        """Another boot: the daemon closed as at its stop, and a new one built from the same flags."""
        self.close()
        self._boot()

    def _sent(self, envelope, frame: bytes) -> None:
        self._replies.setdefault(bytes(envelope[0]), []).append(frame)

    def send(self, identity: bytes, frame: bytes, peer=OWN_PEER) -> None:
        """One frame as the ROUTER hands it to the loop (arrival stamped now)."""
        self.daemon._on_request(frame, [identity], peer, time.perf_counter())

    def send_together(self, identity: bytes, frames: list[bytes], peer=OWN_PEER) -> None:
        """Frames the loop reads in one turn, as when they wait on its socket together: into its
        backlog, then handled in the backlog's order (tierd.core.backlog)."""
        for frame in frames:
            self.daemon.backlog.put(frame, [identity], peer, time.perf_counter())
        self.daemon._serve(zmq.Poller())

    def next_reply(self, identity: bytes, timeout: float = REPLY_WAIT_S) -> bytes:
        """The next reply frame sent to ``identity``: copies that finished are finished on this
        thread, as the loop finishes them, until one is there; then what a LOOKUP left for after
        its reply is applied, as the loop does while nothing waits."""
        d = self.daemon
        queue = self._replies.setdefault(identity, [])
        deadline = time.monotonic() + timeout
        while True:
            d.outcomes.finish_jobs()
            if queue:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no reply within {timeout} s")
            select.select([d.xfer.wake_r], [], [], 0.05)
        if d.pool.unsettled:
            d.pool.settle()
        return queue.pop(0)

    def quiet(self, identity: bytes, timeout: float = 0.2) -> bool:
        """Whether no reply to ``identity`` is waiting, nor comes of a copy within ``timeout``."""
        try:
            frame = self.next_reply(identity, timeout)
        except TimeoutError:
            return True
        self._replies[identity].insert(0, frame)
        return False

    def housekeeping(self, now: float | None = None) -> None:
        """The loop's periodic turn (sessions whose heartbeat stopped, leases past their TTL)."""
        self.daemon._housekeeping(time.monotonic() if now is None else now)

    def status(self) -> dict:
        """What GET /status answers (the same dict, through JSON)."""
        return json.loads(json.dumps(self.daemon.status()))

    def metrics(self) -> str:
        """What GET /metrics answers: the daemon's Prometheus registry as text, scraped on another
        thread as the HTTP thread scrapes it, the status it asks for built on this one, as the loop
        builds it."""
        from prometheus_client import generate_latest

        board = self.daemon.board
        with ThreadPoolExecutor(1) as scraper:
            scrape = scraper.submit(generate_latest, self.daemon.stats.registry)
            while not scrape.done():
                select.select([board.wake_r], [], [], 0.05)
                board.answer(self.daemon.status)
        return scrape.result().decode()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.daemon.close()
            finally:
                self._logger.removeHandler(self._handler)
                self._logger.setLevel(self._level)
                self._handler.close()


class InProcessRaw(Raw):
    """``tests/wire.Raw``'s calls, on an in-process daemon: hand-built request frames from one
    identity, each reply read in the order the daemon sent them and checked as ``Raw.recv``
    checks it."""

    def __init__(self, d: InProcessDaemon, identity: bytes | None = None, peer=OWN_PEER):
        self.d, self.identity, self.peer = d, identity or uuid.uuid4().bytes, peer
        self.ids = itertools.count(1000)

    def send(self, frame: bytes) -> None:
        self.d.send(self.identity, frame, self.peer)

    def send_together(self, requests: list[tuple[str, dict]]) -> list[int]:
        """``(op, body)`` requests the daemon reads in one turn (InProcessDaemon.send_together)."""
        ids = [next(self.ids) for _ in requests]
        self.d.send_together(self.identity, [request(op, i, body) for i, (op, body) in zip(ids, requests)])
        return ids

    def next_frame(self, timeout: float) -> bytes:
        return self.d.next_reply(self.identity, timeout)

    def quiet(self, timeout: float = 0.2) -> bool:
        """Whether nothing more arrives within ``timeout``."""
        return self.d.quiet(self.identity, timeout)

    def close(self) -> None:
        pass


class InProcessClient:
    """The TierdClient calls these tests make, each one request answered by an in-process daemon.
    Requests are built as tierd_client builds them (its typed messages, plain maps converted by its
    ``typed``, its LOOKUP prefix, its STORE/RETRIEVE deadline) and go through its codec
    (tierd_client.wire); an error reply raises TierdError with the daemon's code and message.
    TierdClient's transport is not here: a request too large for one frame, reconnects and
    re-registering, client-side deadlines are tested against ``tierd serve``."""

    def __init__(self, d: InProcessDaemon, name: str = "tierd-client", timeout_s: float = 10.0):
        from tierd.protocol import messages

        self.d, self.timeout_s = d, timeout_s
        self.identity = uuid.uuid4().bytes
        self.ids = itertools.count(1)
        self.server = self.call("HELLO", messages.Hello(PROTOCOL_VERSION, name, os.getpid(), ""))

    def call(self, op: str, body=None):
        from tierd_client.errors import TierdError
        from tierd_client.transport import with_deadline
        from tierd_client.wire import decode_body, encode_request, split_reply

        req_id = next(self.ids)
        body = with_deadline(op, {} if body is None else body, self.timeout_s)
        self.d.send(self.identity, encode_request(op, req_id, body))
        got, ok, raw = split_reply(self.d.next_reply(self.identity))
        assert got == req_id, f"reply to {got}, expected {req_id}"
        reply = decode_body(op, ok, raw)
        if not ok:
            raise TierdError(reply.code, reply.message)
        return reply

    def register(self, instance: str, layout):
        from tierd.protocol import messages
        from tierd.protocol.layout import PageLayout
        from tierd_client.wire import typed

        return self.call("REGISTER", messages.Register(instance, typed(layout, PageLayout, "layout")))

    def unregister(self, instance: str):
        from tierd.protocol import messages

        return self.call("UNREGISTER", messages.Unregister(instance))

    def lookup(self, namespace, keys, groups, chunk_tokens, *, replicated=False, lease=True):
        from tierd_client.client import lookup_request

        return self.call("LOOKUP", lookup_request(namespace, keys, groups, chunk_tokens, replicated, lease))

    def store(
        self, instance: str, chunks: list, touch: list[bytes] | None = None, event: bytes | None = None
    ):
        from tierd.protocol import messages

        return self.call("STORE", messages.Store(instance, self._one(chunks), touch=touch or [], event=event))

    def retrieve(self, instance: str, chunks: list, lease: int = 0):
        from tierd.protocol import messages

        return self.call("RETRIEVE", messages.Retrieve(instance, self._one(chunks), lease=lease))

    def release(self, lease: int):
        from tierd.protocol import messages

        return self.call("RELEASE", messages.Release(lease))

    def ping(self):
        from tierd.protocol import messages

        return self.call("PING", messages.Ping())

    def status(self) -> dict:
        from tierd.protocol import messages

        return self.call("STATUS", messages.Status())

    def clear(self):
        from tierd.protocol import messages

        return self.call("CLEAR", messages.Clear())

    @staticmethod
    def _one(chunks: list) -> list:
        from tierd_client.client import _split, typed_chunks

        chunks = typed_chunks(chunks)
        assert len(_split(chunks)) == 1, "TierdClient would send these chunks as several requests"
        return chunks


@pytest.fixture
def inproc_factory(tmp_path):
    """``inproc_factory(*serve_flags, pool_mb=256)``: an in-process daemon, closed at teardown."""
    made: list[InProcessDaemon] = []

    def make(*args: str, pool_mb: float = 256) -> InProcessDaemon:
        folder = tmp_path / f"inproc{len(made)}"
        folder.mkdir()
        d = InProcessDaemon(folder, *args, pool_mb=pool_mb)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.fixture
def inproc(inproc_factory):
    return inproc_factory()


@pytest.fixture
def inraw():
    """``inraw(d)``: a hand-built-request caller of one identity on an in-process daemon."""

    def make(d: InProcessDaemon, identity: bytes | None = None) -> InProcessRaw:
        return InProcessRaw(d, identity)

    return make


@pytest.fixture
def inclient_factory():
    """``inclient_factory(d, **kw)``: an InProcessClient (its HELLO answered) on ``d``."""

    def make(d: InProcessDaemon, **kw) -> InProcessClient:
        return InProcessClient(d, **kw)

    return make


@pytest.fixture
def inclient(inproc, inclient_factory):
    return inclient_factory(inproc)


@pytest.fixture
def ginproc(grouping, inproc_factory):
    """An in-process daemon in each object grouping (tests/util.py's ``grouping``)."""
    return inproc_factory(*grouping)


@pytest.fixture
def ginclient(ginproc, inclient_factory):
    return inclient_factory(ginproc)
