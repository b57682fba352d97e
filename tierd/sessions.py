"""Clients (sessions), registered ranks (instances) and LOOKUP leases.

A session is one client connection (its ZeroMQ identity), created by HELLO and kept alive by any
message. A session silent for --heartbeat-timeout-s is reaped: its leases are released and its
instances unregistered. A lease pins the objects a LOOKUP reported until every rank of the
namespace has retrieved against it, it is released, its TTL passes, or its session dies.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from tierd.pool.index import Obj
from tierd.pool.pool import Pool
from tierd.protocol.layout import PageLayout


@dataclass(eq=False)
class Instance:
    id: str
    session: bytes
    layout: PageLayout
    ns: bytes  # namespace id
    memory: object  # CpuRankMemory or CudaRankMemory
    registered_at: float = field(default_factory=time.time)
    inflight: int = 0
    closed: bool = False
    geom: object = None  # per-layout constants of STORE/RETRIEVE, computed on first use (ops._Geometry)

    @property
    def rank_key(self) -> int:
        """The rank objects are keyed by: 0 for replicated (MLA) layouts."""
        return 0 if self.layout.replicated else self.layout.rank


@dataclass(eq=False)
class Session:
    identity: bytes
    name: str
    pid: int
    last_seen: float
    instances: set[str] = field(default_factory=set)
    leases: set[int] = field(default_factory=set)


@dataclass(eq=False)
class Lease:
    id: int
    session: bytes
    objs: list[Obj]
    pending_ranks: set[int]
    expires: float


class LeaseTable:
    def __init__(self, pool: Pool, ttl_s: float):
        self.pool = pool
        self.ttl_s = ttl_s
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(1)

    def grant(self, session: Session, objs: list[Obj], world_size: int) -> Lease:
        lease = Lease(next(self._ids), session.identity, objs, set(range(world_size)), time.monotonic() + self.ttl_s)
        self.pool.pin(objs)
        self.leases[lease.id] = lease
        session.leases.add(lease.id)
        return lease

    def release(self, lease_id: int, sessions: dict[bytes, Session]) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.pool.unpin(lease.objs)
        owner = sessions.get(lease.session)
        if owner is not None:
            owner.leases.discard(lease_id)
        return True

    def consume(self, lease_id: int, rank: int, sessions: dict[bytes, Session]) -> None:
        """A rank retrieved against the lease; the last rank releases it."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        lease.pending_ranks.discard(rank)
        if not lease.pending_ranks:
            self.release(lease_id, sessions)

    def expire(self, now: float, sessions: dict[bytes, Session]) -> int:
        dead = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in dead:
            self.release(lid, sessions)
        return len(dead)
