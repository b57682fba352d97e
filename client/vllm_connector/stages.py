"""Where a request's time goes in the connector: ``perf_counter`` stamps per request, kept for the
last ``KEEP`` requests of this process (a few dict writes per request; always on).

Stamps, in the order a restored request meets them (scheduler side, then worker side, then back):

- ``lookup_sent``: the scheduler hook sent the LOOKUP; ``lookup_answered``: its reply arrived (the
  client's thread); ``hit_seen``: the hook returned the hit to vLLM (a later step when the reply
  took longer than ``tierd.lookup_wait_ms``); ``allocated``: vLLM gave the hit blocks
  (``update_state_after_alloc``); ``hook_s``: seconds spent inside the hook, summed over calls,
  ``hook_calls`` how many;
- ``load_start``: the worker's ``start_load_kv`` took the load; ``load_sent``: its RETRIEVE went out
  (or was queued behind the forward's event); ``load_answered``: the daemon answered;
  ``landed``: the worker saw the copies complete on the GPU (``load_polls``: how many times it
  looked) and reported the load finished;
- ``finished_seen``: the scheduler side read ``finished_recving`` (the next step schedules the
  request's remaining tokens).

A request that waits on its load is not waited for per layer (``wait_for_layer_load`` returns at
once: loads are asynchronous, vLLM holds the request until ``landed``). Scheduler and worker stamp
the same record when they share a process (vLLM's in-process engine, one rank); otherwise each
process keeps its own half.
"""

from __future__ import annotations

import time
from collections import OrderedDict

KEEP = 1024
_recs: OrderedDict[str, dict[str, float]] = OrderedDict()


def _rec(req_id: str) -> dict[str, float]:
    rec = _recs.get(req_id)
    if rec is None:
        rec = _recs[req_id] = {}
        while len(_recs) > KEEP:
            _recs.popitem(last=False)
    return rec


def stamp(req_id: str, stage: str) -> None:
    """Record the first time ``req_id`` reached ``stage``."""
    rec = _rec(req_id)
    if stage not in rec:
        rec[stage] = time.perf_counter()


def add(req_id: str, key: str, value: float) -> None:
    """Add ``value`` to a summed figure of ``req_id`` (seconds in the hook, polls, ...)."""
    rec = _rec(req_id)
    rec[key] = rec.get(key, 0.0) + value


def take() -> dict[str, dict[str, float]]:
    """Every kept record, oldest first; forgets them."""
    out = dict(_recs)
    _recs.clear()
    return out
