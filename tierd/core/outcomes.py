"""The main loop's side of a handler's outcome (tierd.core.handlers): a reply's body is sent, a copy
Job is submitted to its transfer lane and answered when it is done (``finish_jobs``), and what a
request needs of the second tier is asked of it and, once it answered (``finish_l2``), handed
back to the handler. Every reply goes out through one ``respond`` (tierd.core.respond).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierd.core import handlers
from tierd.core.jobs import Call, Expired, Job, LookupNeeds, RetrieveNeeds, Tier
from tierd.protocol.errors import ProtocolError
from tierd.transfer.engine import QUEUED, TransferEngine

if TYPE_CHECKING:
    from tierd.tier2.bridge import SecondTier

log = logging.getLogger("tierd")


class Outcomes:
    def __init__(self, tier: Tier, xfer: TransferEngine, l2: SecondTier | None, respond: Callable[..., None]):
        self.tier, self.xfer, self.l2, self.respond = tier, xfer, l2, respond

    def carry(self, call: Call, op: str, outcome) -> None:
        """A handler's outcome, until it is a reply (sent), a copy (submitted: ``_finish_jobs``
        answers it) or a wait for the second tier (``finish_l2`` brings it back here)."""
        try:
            kind = type(outcome)
            if kind is LookupNeeds:
                folded = self.l2.lookup(call, outcome)
                if folded is self.l2.PENDING:
                    return
                if folded is None:
                    outcome = handlers.lookup_l1(self.tier, call, outcome)
                else:
                    outcome = handlers.lookup_folded(self.tier, call, folded)
            elif kind is RetrieveNeeds:
                if self.l2.fetch_for(call, outcome):
                    return
                outcome = handlers.retrieve_planned(self.tier, call, outcome)
        except Exception as exc:  # noqa: BLE001 - answered below
            outcome = exc
        if isinstance(outcome, Job):
            self.xfer.submit(outcome.lane, outcome.run, outcome)
        else:
            self.respond(call.envelope, call.req_id, op, call.t0, outcome)

    def finish_jobs(self) -> None:
        stats = self.tier.stats
        for job, result, exc in self.xfer.drain():
            call = job.call
            job.stamp("return")
            if result is QUEUED:  # its copy is queued: the reply goes now, the completion later
                job.replied = True
                self.respond(call.envelope, call.req_id, job.op, call.t0, job.queued(self.tier), job.nbytes)
                job.stamp("early reply")
                continue
            if exc is not None and not isinstance(exc, Expired):
                log.error("%s copy for %s failed: %r", job.op, job.instance.label, exc)
            try:
                body = job.finish(self.tier, exc)
            except Exception as err:  # noqa: BLE001 - still answered
                body = err
            if not job.replied:
                self.respond(call.envelope, call.req_id, job.op, call.t0, body, job.nbytes)
            job.stamp("reply" if not job.replied else "finish")
            stats.stages(job.op, job.stamps)

    def finish_l2(self) -> None:
        for call, op, result in self.l2.drain(time.monotonic()):
            self.after_l2(call, op, result)

    def after_l2(self, call: Call, op: str, result) -> None:
        """A request that waited for L2, back to its handler: a LOOKUP's fold, a RETRIEVE's checked
        need to plan now (its fetches settled, or its time is up), or the error it is answered with."""
        if isinstance(result, Exception):
            if not isinstance(result, ProtocolError):
                log.error("%s after L2: %r", op, result)
            outcome = result
        else:
            try:
                if op == "LOOKUP":
                    outcome = handlers.lookup_folded(self.tier, call, result)
                else:
                    outcome = handlers.retrieve_resumed(self.tier, call, result)
            except Exception as exc:  # noqa: BLE001 - answered below
                outcome = exc
        self.carry(call, op, outcome)

    def poll_ms(self, wait: float) -> int:
        """``wait`` (seconds), or less when a request waiting for L2 is due sooner: in ms."""
        if self.l2 is not None:
            due = self.l2.next_due(time.monotonic())
            if due is not None:
                wait = min(wait, max(0.0, due))
        return math.ceil(wait * 1000)
