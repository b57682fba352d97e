"""A request on its way to the daemon (``Pending``), the future its caller holds (``Reply``), and
how a request ends (``resolve``, ``fail``); tierd_client.transport sends them and ends them with
the daemon's replies."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tierd.protocol import messages
from tierd.protocol.errors import ProtocolError
from tierd_client import wire
from tierd_client.errors import TierdError

log = logging.getLogger("tierd_client")


class Reply(Future):
    """A request's future whose ``result()``/``exception()`` first read the socket on the waiting
    thread (``Transport.pump``), then wait for the I/O thread as a plain future does."""

    def __init__(self, transport):  # the tierd_client.transport.Transport it pumps
        super().__init__()
        self._transport = transport
        self.pending: Pending | None = None  # set by Transport.request

    def result(self, timeout: float | None = None):
        return super().result(self._pumped(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(self._pumped(timeout))

    def poll(self) -> bool:
        """Whether the request has its answer, once what the client's sockets hold for it now has
        been read on this thread (``Transport.poll``): a thread that polls sees its reply without
        waiting for the I/O thread's turn."""
        if not self.done():
            self._transport.poll(self)
        return self.done()

    def _pumped(self, timeout: float | None) -> float | None:
        """Pump, and return what is left of ``timeout``."""
        if self.done() or timeout == 0:
            return timeout
        t0 = time.monotonic()
        self._transport.pump(self, timeout)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))


@dataclass(eq=False)
class Pending:
    op: str
    body: Any  # the op's typed request (tierd.protocol.messages), or a plain map
    deadline: float  # monotonic
    timeout: float
    future: Future | None = None
    callback: Callable[[bool, Any], None] | None = None  # (ok, typed reply or messages.ErrorReply)
    retried: bool = False
    publish: object | None = None  # .open() before it is sent, .close() once it ends
    claimed_until: float = 0.0  # monotonic: its caller reads its reply until then (module doc)
    channel: bool = False  # sent on the lookup channel (module doc), not on the DEALER

    @property
    def instance(self) -> str | None:
        """The instance the request names, if any."""
        body = self.body
        return body.get("instance") if isinstance(body, dict) else getattr(body, "instance", None)


def resolve(p: Pending, body) -> None:
    """``p`` answered with ``body``, its typed reply: its callback, or its future's result."""
    unpublish(p)
    if p.callback is not None:
        p.callback(True, body)
    elif p.future is not None and not p.future.done():
        p.future.set_result(body)
    release(p)


def fail(p: Pending, exc: TierdError) -> None:
    """``p`` ended in ``exc``: its callback (with the matching messages.ErrorReply), or its future's
    exception."""
    unpublish(p)
    if p.callback is not None:
        try:
            p.callback(False, messages.ErrorReply(exc.code, exc.message))
        except Exception:  # noqa: BLE001
            log.exception("client callback raised")
    elif p.future is not None and not p.future.done():
        p.future.set_exception(exc)
    release(p)


def unpublish(p: Pending) -> None:
    """``publish.close()`` of a request that ended, whichever way it ended."""
    if p.publish is not None:
        try:
            p.publish.close()
        except OSError as exc:
            log.warning("tierd: withdrawing the shared-memory names of %s failed: %s", p.instance, exc)


def release(p: Pending) -> None:
    """An answered request's Reply lets go of it: the two refer to each other, and a cycle is freed
    only by Python's cyclic GC, whose collections then walk every answered request's body (a
    LOOKUP's list of keys) on the caller's thread, a pause in LOOKUP's tail
    (``benchmarks/lookup_latency.py``'s p99)."""
    if isinstance(p.future, Reply):
        p.future.pending = None


def decode_reply(frame: bytes) -> wire.RawReply | None:
    """A reply's (req_id, ok, body), the body undecoded until its request is found
    (tierd_client.wire); None (logged) if the frame cannot be taken apart."""
    try:
        return wire.split_reply(frame)
    except ProtocolError as exc:
        log.warning("undecodable reply from tierd: %s", exc)
        return None
