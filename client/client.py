"""The thin engine client: the protocol's verbs (docs/protocol.md section 14) over its transport
(``tierd_client.transport``: the I/O thread, requests and their deadlines, the lookup channel, the
caller's-thread fast path) and its session (``tierd_client.session``: HELLO, registrations,
heartbeats, restart recovery, BYE). ``TierdClient`` holds the two as ``transport`` and
``session`` and composes them: the session reacts to the transport through its hooks.

Each verb sends the typed request of tierd.protocol.messages that the daemon decodes it into, its
parts (a namespace, group specs, a layout, chunks) typed too, so a field's name and default are
written once for both sides. A part may be given as a plain map of its fields: the verb converts
it with the daemon's own checks (tierd_client.wire.typed), so a field the daemon does not know is
refused before anything is sent. Each verb returns the op's typed reply (messages.REPLIES, read
through tierd_client.wire): ``lookup`` a LookupReply, ``store`` a StoreReply and so on; ``status``
the /status map. A daemon's error raises TierdError with its code and message."""

from __future__ import annotations

from concurrent.futures import Future

from tierd.protocol import MAX_LOOKUP_PARTS, MAX_REQUEST_IDS, MAX_REQUEST_PARTS, messages
from tierd.protocol.layout import GroupSpec, Namespace, PageLayout
from tierd.protocol.sockets import default_socket
from tierd_client.errors import DaemonUnavailable, DeadlineExceeded, TierdError
from tierd_client.futures import failed, join, merge_retrieves, merge_stores
from tierd_client.session import Session
from tierd_client.transport import SPIN_S, Transport
from tierd_client.wire import typed

__all__ = ["TierdClient", "TierdError", "DeadlineExceeded", "DaemonUnavailable"]


class TierdClient:
    def __init__(
        self,
        url: str | None = None,
        *,
        timeout_s: float = 10.0,
        heartbeat_interval_s: float | None = None,
        name: str = "tierd-client",
        connect_timeout_s: float = 5.0,
        token: str | None = None,
        lookup_channel: bool = True,
        spin_s: float = SPIN_S,
    ):
        """``lookup_channel``: send LOOKUP and PING on the daemon's lookup channel when it has one
        (docs/protocol.md section 2.1); False: everything on the ZeroMQ socket. ``spin_s``: how
        long a caller reads the channel for its reply before it sleeps in poll() (SPIN_S; 0: sleep
        at once)."""
        if not spin_s >= 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s}")
        self.transport = Transport(url or default_socket(), timeout_s, name, lookup_channel, spin_s)
        self.session = Session(self.transport, token, heartbeat_interval_s)
        self.transport.start(self.session)
        self.session.greet(connect_timeout_s)

    # ---- requests -------------------------------------------------------------------------------
    def call_async(
        self,
        op: str,
        body: messages.Message | dict | None = None,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        """``body``: the op's typed request (tierd.protocol.messages); a plain map is sent as it is
        (tools, and tests of the daemon's own checks). STORE and RETRIEVE get their ``deadline``
        here. ``wait``: the caller asks for the result at once; its thread then reads the reply
        itself (tierd_client.fast_path: one wake-up of another thread less each way). The future's
        result is the op's typed reply (messages.REPLIES; STATUS's a map), its error a TierdError."""
        return self.transport.call_async(op, body, timeout, wait)

    def call(self, op: str, body: messages.Message | dict | None = None, timeout: float | None = None):
        return self.transport.call(op, body, timeout)

    def pump(self, fut: Future, limit: float | None) -> None:
        """Read the reply of ``fut`` (a request's future) on this thread, for at most a few ms."""
        self.transport.pump(fut, limit)

    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def name(self) -> str:
        return self.transport.name

    @property
    def timeout_s(self) -> float:
        """The deadline of a call that names none."""
        return self.transport.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.transport.timeout_s = value

    # ---- the session ----------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> messages.HelloReply:
        """Block until HELLO was answered; returns its reply. Raises the daemon's own error when it
        refused the HELLO (e.g. ``UNSUPPORTED_VERSION``), ``DaemonUnavailable`` when none answered."""
        return self.session.wait_ready(timeout)

    @property
    def server(self) -> messages.HelloReply | None:
        """The last HELLO reply (protocol, version, boot_id, null_block_id, ...)."""
        return self.session.server

    @property
    def connected(self) -> bool:
        """Whether the daemon is there now: a HELLO answered and the connection not lost since."""
        return self.session.connected

    @property
    def refusal(self) -> TierdError | None:
        """The daemon's error if it refused our last HELLO (e.g. UNSUPPORTED_VERSION), else None."""
        return self.session.refusal

    def register_async(
        self,
        instance: str,
        layout: PageLayout | dict,
        timeout: float | None = None,
        publish: object | None = None,
    ) -> Future:
        """REGISTER a rank's page layout; once accepted it is re-sent after a daemon restart.
        ``publish`` (optional): ``open()``/``close()`` around every REGISTER of it
        (tierd_client.session)."""
        return self.session.register_async(instance, layout, timeout, publish)

    @property
    def leaving(self) -> bool:
        """Whether ``leave_now`` or ``close`` began saying goodbye."""
        return self.session.leaving

    def leave_now(self, unregister: tuple[str, ...] = ()) -> None:
        """Queue UNREGISTERs of ``unregister`` (any session may drop any instance) and a BYE, and
        return at once: safe in a signal handler (lock-free queue puts, a pipe write). No
        heartbeats or recovery after it; ``close`` then only lets the queue drain and stops."""
        self.session.leave_now(unregister)

    def close(self, bye_timeout: float = 0.5) -> None:
        """Say BYE (at most ``bye_timeout`` s), then stop the I/O thread."""
        if self.transport.closed.is_set():
            return
        self.session.bye(bye_timeout)
        self.transport.stop()

    # ---- the verbs ------------------------------------------------------------------------------
    def register(
        self,
        instance: str,
        layout: PageLayout | dict,
        timeout: float | None = None,
        publish: object | None = None,
    ) -> messages.RegisterReply:
        return self.register_async(instance, layout, timeout, publish).result()

    def unregister(self, instance: str, timeout: float | None = None) -> messages.Empty:
        self.session.forget(instance)
        return self.call("UNREGISTER", messages.Unregister(instance), timeout)

    def lookup_async(
        self,
        namespace: Namespace | dict,
        keys: list[bytes],
        groups: list,
        chunk_tokens: int,
        *,
        replicated: bool = False,
        lease: bool = True,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        try:
            body = lookup_request(namespace, keys, groups, chunk_tokens, replicated, lease)
        except TierdError as exc:
            return failed(exc)
        return self.call_async("LOOKUP", body, timeout, wait=wait)

    def lookup(self, *args, **kwargs) -> messages.LookupReply:
        return self.lookup_async(*args, wait=True, **kwargs).result()

    def release(self, lease: int, timeout: float | None = None) -> messages.Empty:
        return self.call("RELEASE", messages.Release(lease), timeout)

    def store_async(
        self,
        instance: str,
        chunks: list,
        touch: list[bytes] | None = None,
        timeout: float | None = None,
        event: bytes | None = None,
        wait: bool = False,
    ) -> Future:
        try:
            parts = _split(typed_chunks(chunks))
        except TierdError as exc:
            return failed(exc)
        futs = []
        for i, part in enumerate(parts):
            # event (CUDA): the IPC event the daemon's gather waits on
            body = messages.Store(instance, part, touch=(touch or []) if i == 0 else [], event=event)
            futs.append(self.call_async("STORE", body, timeout, wait=wait and len(parts) == 1))
        return _one(futs, merge_stores)

    def store(self, *args, **kwargs) -> messages.StoreReply:
        return self.store_async(*args, wait=True, **kwargs).result()

    def retrieve_async(
        self,
        instance: str,
        chunks: list,
        lease: int = 0,
        timeout: float | None = None,
        wait: bool = False,
    ) -> Future:
        try:
            parts = _split(typed_chunks(chunks))
        except TierdError as exc:
            return failed(exc)
        futs = [
            self.call_async(
                "RETRIEVE",
                messages.Retrieve(instance, part, lease=lease),
                timeout,
                wait=wait and len(parts) == 1,
            )
            for part in parts
        ]
        return _one(futs, merge_retrieves)

    def retrieve(self, *args, **kwargs) -> messages.RetrieveReply:
        return self.retrieve_async(*args, wait=True, **kwargs).result()

    def ping(self, timeout: float | None = None) -> messages.PingReply:
        return self.call("PING", messages.Ping(), timeout)

    def status(self, timeout: float | None = None) -> dict:
        """The daemon's /status object (docs/protocol.md section 16), a map."""
        return self.call("STATUS", messages.Status(), timeout)

    def clear(self, timeout: float | None = None) -> messages.ClearReply:
        return self.call("CLEAR", messages.Clear(), timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def lookup_request(
    namespace: Namespace | dict,
    keys: list[bytes],
    groups: list,
    chunk_tokens: int,
    replicated: bool,
    lease: bool,
) -> messages.Lookup:
    """The LOOKUP of ``keys``, or of their longest prefix the daemon folds: at most
    MAX_LOOKUP_PARTS (keys x groups x ranks) per LOOKUP (a hit is a prefix anyway). ``namespace``
    and ``groups`` typed, or plain maps converted (tierd_client.wire.typed; raises TierdError)."""
    namespace = typed(namespace, Namespace, "namespace")
    for g in groups:  # (converted only when some are not typed: a LOOKUP's every microsecond counts)
        if type(g) is not GroupSpec:
            groups = tuple(typed(g, GroupSpec, f"groups[{i}]") for i, g in enumerate(groups))
            break
    ranks = 1 if replicated else namespace.world_size
    keys = keys[: max(1, MAX_LOOKUP_PARTS // (max(1, len(groups)) * max(1, ranks)))]
    return messages.Lookup(namespace, keys, chunk_tokens, groups, replicated=replicated, lease=lease)


def blocks_of(chunk) -> list:
    """A chunk's block ids per group, of a typed Chunk or a plain map."""
    return chunk.blocks if isinstance(chunk, messages.Chunk) else chunk["blocks"]


def typed_chunks(chunks: list) -> list[messages.Chunk]:
    """``chunks`` as typed Chunks: themselves when they are, else each converted (raises TierdError)."""
    for c in chunks:
        if type(c) is not messages.Chunk:
            return [typed(c, messages.Chunk, f"chunks[{i}]") for i, c in enumerate(chunks)]
    return chunks


def _split(chunks: list) -> list[list]:
    """``chunks`` in requests of at most MAX_REQUEST_PARTS chunks x groups (the daemon's bound)."""
    groups = max(1, len(blocks_of(chunks[0]))) if chunks else 1
    ids = max(1, sum(len(b) for b in blocks_of(chunks[0]))) if chunks else 1
    step = max(
        1, min(MAX_REQUEST_PARTS // groups, MAX_REQUEST_IDS // ids)
    )  # and frames well under --max-frame-mb
    return [chunks[i : i + step] for i in range(0, len(chunks), step)] or [chunks]


def _one(futs: list[Future], merge) -> Future:
    """The future of a request sent in parts: the part's own, or their replies merged in order."""
    if len(futs) == 1:
        return futs[0]
    out: Future = Future()
    join(futs, out, merge)
    return out
