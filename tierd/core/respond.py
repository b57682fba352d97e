"""Replies: the one way the daemon answers a request, on the ROUTER or on a lookup channel.

``respond`` takes what a request came to: a reply's body (encoded and sent; the op's latency
observed), a ProtocolError (its typed error), or any other exception (INTERNAL with its text).
Sending never blocks: a peer that is gone, or whose queue is full, loses the reply and its
client's deadline covers it.
"""

from __future__ import annotations

import logging
import time

from tierd.base.stats import Stats
from tierd.edge.channel import Channel, ChannelServer
from tierd.edge.zmtp import Router
from tierd.protocol import codec
from tierd.protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("tierd")

# a reply later than this after its request was read is logged: a stalled loop, a slow copy or a
# starved process then shows in the log, not only as a client's deadline
SLOW_REPLY_S = 1.0


class Replies:
    def __init__(self, router: Router, channel: ChannelServer | None, stats: Stats):
        self.router, self.channel, self.stats = router, channel, stats

    def respond(
        self,
        envelope: list[bytes] | Channel,
        req_id: int,
        op: str,
        t0: float,
        result,
        nbytes: int | None = None,
    ) -> None:
        """Answer ``req_id`` (sent at ``t0``) with ``result``: a reply's body or an exception."""
        if isinstance(result, Exception):
            if isinstance(result, ProtocolError):
                code, message = result.code, result.message
                if result.req_id is not None:
                    req_id = result.req_id
            else:  # every request gets a reply, whatever broke
                log.error("%s raised", op, exc_info=result)
                code, message = ErrorCode.INTERNAL, f"{type(result).__name__}: {result}"
            self.stats.error(code.name)
            log.debug("%s req %d -> %s: %s", op, req_id, code.name, message)
            self.send(envelope, codec.encode_error(req_id, code, message))
            return
        self.send(envelope, codec.encode_reply(req_id, result))
        took = time.perf_counter() - t0
        self.stats.observe(op, took, nbytes)
        if took > SLOW_REPLY_S:
            size = "" if nbytes is None else f" ({nbytes} bytes)"
            log.warning("%s req %d answered %.2f s after it was read%s", op, req_id, took, size)

    def send(self, envelope: list[bytes] | Channel, frame: bytes) -> None:
        if type(envelope) is Channel:
            if not envelope.send(frame):  # its queue is full or it is gone: its deadline covers it
                self.channel.dropped += 1
            return
        if not self.router.send(envelope[0], frame):  # gone or its queue full: its deadline covers it
            log.debug("reply dropped: no connection of that identity, or its queue is full")
