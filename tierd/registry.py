"""Who is connected and what they hold: sessions, registered ranks (instances), namespaces and
LOOKUP leases. One owner for all of it, driven by plain verbs; only the daemon's main loop calls in.

A session is one client connection (its ZeroMQ identity), opened by HELLO, kept alive by any
message, closed by BYE or reaped after ``heartbeat_timeout_s`` of silence: its leases are
released and its instances unregistered. A lease pins the objects a LOOKUP reported until every
rank of the namespace has retrieved against it, it is released, its TTL passes, or its session
goes. An instance's memory is unmapped only after every copy already queued for it has run.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from tierd.pool.index import Obj
from tierd.pool.pool import Pool
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.keys import namespace_id
from tierd.protocol.layout import Namespace, PageLayout

log = logging.getLogger("tierd")


@dataclass(eq=False)
class Instance:
    id: str
    session: bytes
    layout: PageLayout
    ns: bytes  # namespace id
    memory: object  # CpuRankMemory or CudaRankMemory
    registered_at: float = field(default_factory=time.time)
    closed: bool = False
    geometry: object = None  # the planner's per-layout constants (planner.Geometry), made on first use

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


class Registry:
    """Sessions, instances, namespaces and leases. ``lanes`` attaches/detaches an instance's copy
    lanes (the transfer engine); ``pool`` is pinned and unpinned for leases."""

    def __init__(self, pool: Pool, lanes, lease_ttl_s: float, heartbeat_timeout_s: float):
        self.pool = pool
        self.lanes = lanes
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.sessions: dict[bytes, Session] = {}
        self.instances: dict[str, Instance] = {}
        self.namespaces: dict[bytes, Namespace] = {}  # namespace id -> Namespace, as named by REGISTER/LOOKUP
        self.leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._by_ns: dict[bytes, set[str]] = {}  # namespace id -> its registered instance ids
        self._noted: set[bytes] = set()  # namespace ids in the pool's extra blob (warm restart)
        self._restore_namespaces(pool.extra)

    # ---- sessions -----------------------------------------------------------------------------
    def open_session(self, identity: bytes, name: str, pid: int) -> Session:
        if identity in self.sessions:  # a reconnect on the same identity: start clean
            self.close_session(identity, reason="re-HELLO")
        session = self.sessions[identity] = Session(identity, name, pid, time.monotonic())
        return session

    def session(self, identity: bytes) -> Session:
        """The live session of ``identity``, marked as heard from now; UNKNOWN_SESSION if none."""
        session = self.sessions.get(identity)
        if session is None:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, "send HELLO first (the daemon may have restarted)")
        session.last_seen = time.monotonic()
        return session

    def close_session(self, identity: bytes, reason: str) -> None:
        session = self.sessions.pop(identity, None)
        if session is None:
            return
        for lease_id in list(session.leases):
            self.release(lease_id)
        for inst_id in list(session.instances):
            self.unregister(inst_id)
        log.info("session %s (%s pid %d) closed: %s", identity.hex()[:12], session.name, session.pid, reason)

    def reap(self, now: float) -> tuple[int, int]:
        """Expire leases past their TTL and sessions silent for too long: (sessions, leases) gone."""
        dead_leases = [lid for lid, lease in self.leases.items() if lease.expires <= now]
        for lid in dead_leases:
            self.release(lid)
        reaped = 0
        for identity, session in list(self.sessions.items()):
            if now - session.last_seen > self.heartbeat_timeout_s:
                reaped += 1
                dead_leases.extend(session.leases)
                self.close_session(identity, reason=f"no message for {self.heartbeat_timeout_s:g} s")
        for ns_id in [n for n in self.namespaces if n not in self._by_ns and not self.pool.per_ns.get(n)]:
            del self.namespaces[ns_id]
        return reaped, len(dead_leases)

    # ---- instances ----------------------------------------------------------------------------
    def register(self, session: Session, inst_id: str, layout: PageLayout, open_memory) -> Instance:
        """Register (or re-register) a rank; ``open_memory(layout)`` maps its KV tensors."""
        old = self.instances.get(inst_id)
        if old is not None:
            if old.layout != layout and old.session != session.identity and old.session in self.sessions:
                raise ProtocolError(ErrorCode.LAYOUT_MISMATCH,
                                    f"instance {inst_id!r} is registered by another live client with a different layout")
            if old.layout == layout:  # idempotent re-register (a reconnecting client)
                previous = self.sessions.get(old.session)
                if previous is not None:
                    previous.instances.discard(inst_id)
                old.session = session.identity
                session.instances.add(inst_id)
                return old
            self.unregister(inst_id)
        memory = open_memory(layout)
        inst = Instance(inst_id, session.identity, layout, namespace_id(layout.namespace), memory)
        self.namespaces[inst.ns] = layout.namespace
        self.instances[inst_id] = inst
        self._by_ns.setdefault(inst.ns, set()).add(inst_id)
        if inst.ns not in self._noted:  # journaled before any of its objects can be committed
            self.pool.note_extra(self.persisted())
        session.instances.add(inst_id)
        self.lanes.attach(inst_id, duplex=getattr(memory, "duplex", False))
        log.info("registered %s: model=%s rank=%d/%d groups=%d device=%s", inst_id, layout.namespace.model,
                 layout.rank, layout.namespace.world_size, len(layout.groups), layout.device)
        return inst

    def instance(self, inst_id: str) -> Instance:
        inst = self.instances.get(inst_id)
        if inst is None or inst.closed:
            raise ProtocolError(ErrorCode.UNKNOWN_INSTANCE, f"instance {inst_id!r} is not registered")
        return inst

    def unregister(self, inst_id: str) -> bool:
        inst = self.instances.pop(inst_id, None)
        if inst is None:
            return False
        inst.closed = True
        same = self._by_ns.get(inst.ns)
        if same is not None:
            same.discard(inst_id)
            if not same:
                del self._by_ns[inst.ns]
        session = self.sessions.get(inst.session)
        if session is not None:
            session.instances.discard(inst_id)
        self.lanes.detach(inst_id, last=inst.memory.close)  # unmapped after its queued copies
        log.info("unregistered %s", inst_id)
        return True

    def registered_layout(self, ns_id: bytes) -> tuple[str, PageLayout] | None:
        """(instance id, layout) of some rank registered in namespace ``ns_id``."""
        ids = self._by_ns.get(ns_id)
        if not ids:
            return None
        inst = self.instances[next(iter(ids))]
        return inst.id, inst.layout

    def name_namespace(self, ns_id: bytes, ns: Namespace) -> None:
        self.namespaces.setdefault(ns_id, ns)

    # ---- warm restart -------------------------------------------------------------------------
    def persisted(self) -> dict:
        """What a restart needs to name the pool's namespaces again (the pool's extra blob): every
        namespace holding objects or registered ranks. Only REGISTER can bring objects into a
        namespace, so LOOKUPs of unknown namespaces never grow it or the journal."""
        keep = [n for n in self.namespaces if n in self._by_ns or self.pool.per_ns.get(n)]
        self._noted = set(keep)
        return {"namespaces": [self.namespaces[n].to_wire() for n in keep]}

    def _restore_namespaces(self, extra) -> None:
        """Name again the namespaces of the objects a warm restart recovered (for /status); an
        entry that does not decode is skipped: the objects stay servable by id either way."""
        entries = extra.get("namespaces") if isinstance(extra, dict) else None
        for wire in entries if isinstance(entries, list) else ():
            try:
                ns = Namespace.from_wire(wire, "namespaces[]")
            except ProtocolError as exc:
                log.warning("a recovered namespace is unreadable, skipped: %s", exc.message)
                continue
            ns_id = namespace_id(ns)
            if self.pool.per_ns.get(ns_id):
                self.namespaces[ns_id] = ns
        self._noted = set(self.namespaces)

    # ---- leases -------------------------------------------------------------------------------
    def grant(self, session: Session, objs: list[Obj], world_size: int) -> int:
        lease = Lease(next(self._lease_ids), session.identity, objs, set(range(world_size)),
                      time.monotonic() + self.lease_ttl_s)
        self.pool.pin(objs)
        self.leases[lease.id] = lease
        session.leases.add(lease.id)
        return lease.id

    def release(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.pool.unpin(lease.objs)
        owner = self.sessions.get(lease.session)
        if owner is not None:
            owner.leases.discard(lease_id)
        return True

    def consume(self, lease_id: int, rank: int) -> None:
        """A rank retrieved against the lease; the last rank releases it."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        lease.pending_ranks.discard(rank)
        if not lease.pending_ranks:
            self.release(lease_id)
