"""Who is connected and what they hold: sessions, registered ranks (instances), namespaces and
LOOKUP leases. One owner for all of it, driven by plain verbs; only the daemon's main loop calls in.

A session is one client connection (its ZeroMQ identity), opened by HELLO, kept alive by any
message, closed by BYE or reaped after ``heartbeat_timeout_s`` of silence: its leases are
released and its instances unregistered. Every session acts as one tenant (tierd.state.tenants):
instance names and leases are looked up within the caller's tenant only, and the limits of
``Limits`` are counted per peer, tenant or session. A lease pins the objects a LOOKUP reported until every
rank of the namespace has retrieved against it, it is released, its TTL passes, or its session
goes. An instance's memory is unmapped only after every copy already queued for it has run.
"""

from __future__ import annotations

import itertools
import logging
import time

from tierd.edge.peer import Peer
from tierd.pool.index import Obj
from tierd.pool.pool import Pool
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import Namespace, PageLayout
from tierd.state.records import (  # noqa: F401 (re-exported)
    OWN_PEER,
    OWNER,
    Instance,
    Lease,
    Limits,
    Session,
    instance_key,
)
from tierd.state.tenants import DEFAULT_TENANT, Principal, scoped_namespace_id

log = logging.getLogger("tierd")


class Registry:
    """Sessions, instances, namespaces and leases. ``lanes`` attaches/detaches an instance's copy
    lanes (the transfer engine); ``pool`` is pinned and unpinned for leases."""

    def __init__(
        self, pool: Pool, lanes, lease_ttl_s: float, heartbeat_timeout_s: float, limits: Limits | None = None
    ):
        self.pool = pool
        self.limits = limits or Limits()
        self.lanes = lanes
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.sessions: dict[bytes, Session] = {}
        self.instances: dict[str, Instance] = {}
        self.namespaces: dict[bytes, Namespace] = {}  # namespace id -> Namespace, as named by REGISTER/LOOKUP
        self.leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._by_ns: dict[bytes, set[str]] = {}  # namespace id -> its registered instance ids
        self.ns_tenant: dict[bytes, str] = {}  # namespace id -> the tenant it belongs to
        self._peer_sessions: dict[str, int] = {}  # Principal.peer_key -> live sessions
        self._tenant_instances: dict[str, int] = {}
        self._tenant_files: dict[str, int] = {}
        self._noted: set[bytes] = set()  # namespace ids in the pool's extra blob (warm restart)
        self._restore_namespaces(pool.extra)

    # ---- sessions -----------------------------------------------------------------------------
    def open_session(
        self, identity: bytes, name: str, pid: int, principal: Principal = OWNER, peer: Peer = OWN_PEER
    ) -> Session:
        old = self.sessions.get(identity)
        if old is not None:  # a reconnect on the same identity: start clean
            if old.principal != principal or old.uid != peer.uid:
                raise ProtocolError(
                    ErrorCode.FORBIDDEN, "this connection identity is another user's live session"
                )
            self.close_session(identity, reason="re-HELLO")
        key = principal.peer_key
        have = self._peer_sessions.get(key, 0)
        if have >= self.limits.sessions_per_peer:
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"{key} already has {have} sessions (--max-sessions-per-peer "
                f"{self.limits.sessions_per_peer}); close some (BYE) or raise the limit",
            )
        self._peer_sessions[key] = have + 1
        session = self.sessions[identity] = Session(
            identity, name, pid, time.monotonic(), principal=principal, peer=peer
        )
        return session

    def session(self, identity: bytes, uid: int = OWN_PEER.uid) -> Session:
        """The live session of ``identity``, marked as heard from now; UNKNOWN_SESSION if none,
        FORBIDDEN when the message came from another uid than the session's HELLO (a routing
        identity taken over by another user's connection)."""
        session = self.sessions.get(identity)
        if session is None:
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, "send HELLO first (the daemon may have restarted)")
        if session.uid != uid:
            raise ProtocolError(ErrorCode.FORBIDDEN, "this connection identity is another user's session")
        session.last_seen = time.monotonic()
        return session

    def close_session(self, identity: bytes, reason: str, level: int = logging.INFO) -> None:
        session = self.sessions.pop(identity, None)
        if session is None:
            return
        key = session.principal.peer_key
        self._peer_sessions[key] -= 1
        if not self._peer_sessions[key]:
            del self._peer_sessions[key]
        for lease_id in list(session.leases):
            self.release(lease_id)
        for inst_id in list(session.instances):
            self.unregister(inst_id)
        log.log(
            level, "session %s (%s pid %d) closed: %s", identity.hex()[:12], session.name, session.pid, reason
        )

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
            self.ns_tenant.pop(ns_id, None)
        return reaped, len(dead_leases)

    # ---- instances ----------------------------------------------------------------------------
    def register(self, session: Session, name: str, layout: PageLayout, open_memory) -> Instance:
        """Register (or re-register) a rank of the session's tenant; ``open_memory(layout, peer)``
        maps its KV tensors as the session's peer may."""
        tenant = session.tenant
        inst_id = instance_key(tenant, name)
        old = self.instances.get(inst_id)
        if old is not None:
            if old.layout != layout and old.session != session.identity and old.session in self.sessions:
                raise ProtocolError(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"instance {name!r} is registered by another live client with a different layout",
                )
            if old.layout == layout:  # idempotent re-register (a reconnecting client)
                previous = self.sessions.get(old.session)
                if previous is not None:
                    previous.instances.discard(inst_id)
                old.session = session.identity
                session.instances.add(inst_id)
                return old
            self.unregister(inst_id)
        lim = self.limits
        have = self._tenant_instances.get(tenant, 0)
        if have >= lim.instances_per_tenant:
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"this tenant has {have} registered ranks (--max-instances-per-tenant "
                f"{lim.instances_per_tenant})",
            )
        memory = open_memory(layout, session.peer)
        files = getattr(memory, "files", 0)
        held = self._tenant_files.get(tenant, 0)
        if held + files > lim.files_per_tenant:
            memory.close()
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"this rank's {files} shared-memory files and the {held} this tenant "
                f"holds pass --max-files-per-tenant {lim.files_per_tenant}",
            )
        ns_id = scoped_namespace_id(tenant, layout.namespace)
        inst = Instance(inst_id, session.identity, layout, ns_id, memory, name=name, tenant=tenant)
        self._tenant_instances[tenant] = have + 1
        self._tenant_files[tenant] = held + files
        self.namespaces[inst.ns] = layout.namespace
        self.ns_tenant[inst.ns] = tenant
        self.instances[inst_id] = inst
        self._by_ns.setdefault(inst.ns, set()).add(inst_id)
        if inst.ns not in self._noted:  # journaled before any of its objects can be committed
            self.pool.note_extra(self.persisted())
        session.instances.add(inst_id)
        self.lanes.attach(
            inst_id, duplex=getattr(memory, "duplex", False), inline=getattr(memory, "inline", 0)
        )
        log.info(
            "registered %s: model=%s rank=%d/%d groups=%d device=%s",
            inst_id,
            layout.namespace.model,
            layout.rank,
            layout.namespace.world_size,
            len(layout.groups),
            layout.device,
        )
        return inst

    def instance(self, name: str, tenant: str = DEFAULT_TENANT) -> Instance:
        """Instance ``name`` of ``tenant`` (another tenant's instances of that name are not seen)."""
        inst = self.instances.get(instance_key(tenant, name))
        if inst is None or inst.closed:
            raise ProtocolError(ErrorCode.UNKNOWN_INSTANCE, f"instance {name!r} is not registered")
        return inst

    def unregister(self, inst_id: str) -> bool:
        """Unregister by the registry's key (``instance_key``)."""
        inst = self.instances.pop(inst_id, None)
        if inst is None:
            return False
        inst.closed = True
        self._tenant_instances[inst.tenant] -= 1
        if not self._tenant_instances[inst.tenant]:
            del self._tenant_instances[inst.tenant]
        files = getattr(inst.memory, "files", 0)
        if files:
            self._tenant_files[inst.tenant] -= files
            if not self._tenant_files[inst.tenant]:
                del self._tenant_files[inst.tenant]
        same = self._by_ns.get(inst.ns)
        if same is not None:
            same.discard(inst_id)
            if not same:
                del self._by_ns[inst.ns]
        session = self.sessions.get(inst.session)
        if session is not None:
            session.instances.discard(inst_id)
        self.lanes.detach(inst_id, last=inst.memory.close)  # unmapped after its queued copies
        log.info("unregistered %s", inst.label)
        return True

    def registered_layout(self, ns_id: bytes) -> tuple[str, PageLayout] | None:
        """(instance name, layout) of some rank registered in namespace ``ns_id``."""
        ids = self._by_ns.get(ns_id)
        if not ids:
            return None
        inst = self.instances[next(iter(ids))]
        return inst.name, inst.layout

    def name_namespace(self, ns_id: bytes, ns: Namespace, tenant: str = DEFAULT_TENANT) -> None:
        self.namespaces.setdefault(ns_id, ns)
        self.ns_tenant.setdefault(ns_id, tenant)

    # ---- warm restart -------------------------------------------------------------------------
    def persisted(self) -> dict:
        """What a restart needs to name the pool's namespaces again (the pool's extra blob): every
        namespace holding objects or registered ranks. Only REGISTER can bring objects into a
        namespace, so LOOKUPs of unknown namespaces never grow it or the journal."""
        keep = [n for n in self.namespaces if n in self._by_ns or self.pool.per_ns.get(n)]
        self._noted = set(keep)
        return {
            "namespaces": [
                {**self.namespaces[n].to_wire(), "tenant": self.ns_tenant.get(n, DEFAULT_TENANT)}
                for n in keep
            ]
        }

    def _restore_namespaces(self, extra) -> None:
        """Name again the namespaces of the objects a warm restart recovered, with their tenants
        (for /status); an entry that does not decode is skipped: the objects stay servable by id
        either way, and only their own tenant's LOOKUPs derive that id."""
        entries = extra.get("namespaces") if isinstance(extra, dict) else None
        for wire in entries if isinstance(entries, list) else ():
            wire = dict(wire) if isinstance(wire, dict) else {}
            tenant = wire.pop("tenant", DEFAULT_TENANT)
            try:
                if not isinstance(tenant, str):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, f"tenant {tenant!r} is not a string")
                ns = Namespace.from_wire(wire, "namespaces[]")
            except ProtocolError as exc:
                log.warning("a recovered namespace is unreadable, skipped: %s", exc.message)
                continue
            ns_id = scoped_namespace_id(tenant, ns)
            if self.pool.per_ns.get(ns_id):
                self.namespaces[ns_id] = ns
                self.ns_tenant[ns_id] = tenant
        self._noted = set(self.namespaces)

    # ---- leases -------------------------------------------------------------------------------
    @property
    def leased_bytes(self) -> dict[str, int]:
        """Tenant -> the bytes its leases pin, each object once (kept by the pool: Pool.pin_lease)."""
        return self.pool.leased_bytes

    def grant(self, session: Session, objs: list[Obj], world_size: int) -> int:
        """A lease pinning ``objs`` (LIMIT past --max-leases-per-session or --max-lease-share:
        nothing pinned). A tenant's pinned bytes count each object once, however many of its
        leases pin it (concurrent requests sharing a prefix)."""
        lim = self.limits
        if len(session.leases) >= lim.leases_per_session:
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"this session holds {len(session.leases)} leases "
                f"(--max-leases-per-session {lim.leases_per_session}); RELEASE some",
            )
        tenant = session.tenant
        self.pool.settle_pins()  # another grant's (several L2 answers in one turn): counted first
        cap = lim.lease_share * self.pool.configured_bytes
        pinned = self.leased_bytes.get(tenant, 0)
        lease = Lease(
            0,  # numbered once granted
            session.identity,
            objs,
            set(range(world_size)),
            time.monotonic() + self.lease_ttl_s,
            tenant,
        )
        if pinned + len(objs) * self.pool.largest_bytes <= cap:
            # within the cap even if none of them is leased yet and each is as large as the pool's
            # largest (a bound that reads no object): the pins can wait for the reply. The pool's
            # lock applies them before anyone reads pins (an eviction, a release).
            self.pool.defer_lease(lease.objs, tenant)
        else:  # count each object once (some may be leased already), and undo past the cap
            with self.pool.lock.plain:
                add = self.pool.pin_lease(lease.objs, tenant)
                if add and pinned + add > cap:
                    self.pool.unpin_lease(lease.objs, tenant)
                    raise ProtocolError(
                        ErrorCode.LIMIT,
                        f"this tenant's leases would pin {pinned + add} bytes, more than "
                        f"--max-lease-share {lim.lease_share:g} of the pool ({int(cap)} bytes)",
                    )
        lease.id = next(self._lease_ids)
        self.leases[lease.id] = lease
        session.leases.add(lease.id)
        return lease.id

    def lease_of(self, lease_id: int, tenant: str) -> Lease | None:
        """The lease, if it is ``tenant``'s (another tenant's lease is FORBIDDEN)."""
        lease = self.leases.get(lease_id)
        if lease is not None and lease.tenant != tenant:
            raise ProtocolError(ErrorCode.FORBIDDEN, f"lease {lease_id} is another tenant's")
        return lease

    def release(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        with self.pool.lock.plain:  # pins only (and a grant's not applied yet, first)
            self.pool.unpin_lease(lease.objs, lease.tenant)
        owner = self.sessions.get(lease.session)
        if owner is not None:
            owner.leases.discard(lease_id)
        return True

    def consume(self, lease_id: int, rank: int, tenant: str = DEFAULT_TENANT) -> None:
        """A rank retrieved against the lease; the last rank releases it."""
        lease = self.lease_of(lease_id, tenant)
        if lease is None:
            return
        lease.pending_ranks.discard(rank)
        if not lease.pending_ranks:
            self.release(lease_id)
