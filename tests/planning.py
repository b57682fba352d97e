"""A STORE planned the way handlers.store plans it (tierd.state.planner decides, tierd.pool.reserve
reserves, tierd.transfer.plans binds), for tests that pin its decisions with exact ids."""

from __future__ import annotations

from tierd.pool.reserve import reserve
from tierd.state import planner
from tierd.transfer.plans import CopyPlan, bind


def plan_store(geo, chunks, pool, ns: bytes, rank: int, staged_at=None, blocks=None) -> CopyPlan:
    req = planner.plan_store(geo, chunks, staged_at, blocks)
    return bind(req, reserve(pool, ns, rank, req))
