"""A reply sent long after its request was read leaves a warning in the daemon's log, with its op
and how long it took; a prompt one leaves nothing. A stall a client only sees as its deadline is
then in the operator's log too."""

import logging
import time

from tierd.base.stats import Stats
from tierd.core.respond import SLOW_REPLY_S, Replies
from tierd.edge.zmtp import Router
from tierd.protocol import messages as m


def _replies():
    router = Router(1 << 20)  # bound nowhere: every reply is dropped, as to a client that left
    return router, Replies(router, None, Stats())


def test_a_reply_later_than_the_slow_mark_is_logged_with_its_op_and_time(caplog):
    router, replies = _replies()
    body = m.PingReply(time=0.0, boot_id="b")
    try:
        with caplog.at_level(logging.WARNING, logger="tierd"):
            # no peer of that identity: the reply is dropped, as to a client that left
            replies.respond([b"gone"], 7, "RETRIEVE", time.perf_counter() - 2 * SLOW_REPLY_S, body)
            replies.respond([b"gone"], 8, "LOOKUP", time.perf_counter(), body)
    finally:
        router.close()
    slow = [r.getMessage() for r in caplog.records if "answered" in r.getMessage()]
    assert len(slow) == 1, slow
    assert slow[0].startswith("RETRIEVE req 7 answered 2.")
