"""One handler per op: ``handler(tier, call, request) -> reply | Job``, run on the daemon's main
loop only. A handler raises ProtocolError for a typed error. STORE and RETRIEVE return a Job:
its copy runs on the instance's transfer lane (``Job.run``) and its completion (commit or abort,
unpin, counters, the reply) runs back on the main loop (``Job.finish``).

Deadlines: STORE and RETRIEVE carry the client's wall-clock deadline. A store never commits after
it (the client may already reuse the blocks it read), and a retrieve never starts after it (the
engine may have given its blocks to another request): both answer EXPIRED instead.

With a second tier (``tier.l2``, tierd.tier2) a LOOKUP or RETRIEVE may answer DEFERRED: its reply
comes later, from the main loop, once L2 answered or its deadline passed (never later than that).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierd import __version__
from tierd.channel import Channel
from tierd.config import Settings
from tierd.peer import Peer
from tierd.planner import CopyPlan, Geometry, plan_retrieve, plan_store
from tierd.pool.pool import Pool
from tierd.protocol import MAX_LOOKUP_PARTS, PROTOCOL_VERSION
from tierd.protocol import messages as m
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.registry import Instance, Registry, Session, instance_key
from tierd.stats import Stats
from tierd.tenants import Tenants, scoped_namespace_id
from tierd.transfer.engine import READ_LANE, DeviceWork, device_work

log = logging.getLogger("tierd")

DEFERRED = object()  # a handler's answer when its reply comes later (tierd.tier2 sends it)


@dataclass
class Tier:
    """What handlers act on."""

    registry: Registry
    pool: Pool
    stats: Stats
    settings: Settings
    boot_id: str
    open_memory: Callable  # (PageLayout, Peer) -> rank memory (CPU shm or CUDA IPC mappings)
    status: Callable[[], dict]
    tenants: Tenants = None  # who a HELLO acts as (None: everyone is the daemon's own tenant)
    l2: object = None  # tierd.tier2.SecondTier with --l2-url
    channel_max_bytes: int = 0  # the lookup channel's largest frame (tierd.channel); 0: none


@dataclass
class Call:
    """One request as it arrived: who sent it, where the reply goes, when it came."""

    identity: bytes
    session: Session | None
    envelope: list[bytes] | Channel  # the ROUTER's [identity], or the lookup channel it came on
    req_id: int
    t0: float
    peer: Peer | None = None  # the kernel's credentials of the connection (None: the daemon's own user)

    @property
    def tenant(self) -> str:
        return self.session.tenant


class Expired(Exception):
    """The client's deadline passed before the copy could start."""


class Job:
    """A STORE or RETRIEVE whose copy runs on a transfer lane."""

    op = ""

    def __init__(self, tier: Tier, call: Call, inst: Instance, plan: CopyPlan, deadline: float):
        self.call, self.instance, self.plan, self.deadline = call, inst, plan, deadline
        self.lane = inst.id
        self.replied = False  # an early reply went out when the copy was queued (``queued``)

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    def run(self) -> DeviceWork | None:  # on the transfer thread
        raise NotImplementedError

    def finish(self, tier: Tier, exc: BaseException | None):  # on the main loop
        raise NotImplementedError

    def queued(self, tier: Tier):  # on the main loop: the reply of a job whose copy is queued
        raise NotImplementedError


class StoreJob(Job):
    op = "STORE"

    def __init__(self, tier, call, inst, plan, deadline, touch: list[bytes], event: bytes | None):
        super().__init__(tier, call, inst, plan, deadline)
        self.touch = touch
        self.event = event

    def run(self) -> DeviceWork | None:
        memory = self.instance.memory
        if self.event is not None and hasattr(memory, "wait_event"):
            memory.wait_event(self.event, store=True)  # the DMA starts only once the engine's gather is done
        return device_work([memory.store(g, items) for g, items in self.plan.copies.items()])

    def finish(self, tier: Tier, exc: BaseException | None) -> m.StoreReply:
        pool = tier.pool
        if exc is not None:
            pool.abort(self.plan.objs)
            _drop_broken(tier, self.instance, exc)
            raise ProtocolError(ErrorCode.DEVICE_ERROR, f"store copy failed: {type(exc).__name__}: {exc}")
        if self.deadline and time.time() > self.deadline:
            pool.abort(self.plan.objs)  # the client gave up and may already reuse the blocks we read
            raise ProtocolError(
                ErrorCode.EXPIRED, "the store finished after its deadline; nothing was stored"
            )
        pool.commit(self.plan.objs)
        if self.touch:  # again after the commit, or the new tail ends up more recent than the head it extends
            pool.touch(self.instance.ns, self.touch)
        if tier.l2 is not None:
            tier.l2.committed(self.instance, _geometry(tier, self.instance), self.plan.objs)
        _count_store(tier.stats, self.plan)
        return m.StoreReply(self.plan.results)


class RetrieveJob(Job):
    op = "RETRIEVE"

    def __init__(self, tier, call, inst, plan, deadline, lease: int, event: bytes | None):
        super().__init__(tier, call, inst, plan, deadline)
        self.lease = lease
        self.event = event
        self.signal: bytes | None = None  # the daemon's event the engine waits on (staged ranks)
        if getattr(inst.memory, "duplex", False):
            self.lane += READ_LANE

    def run(self) -> DeviceWork | None:
        if self.deadline and time.time() > self.deadline:
            raise Expired()
        memory = self.instance.memory
        if self.event is not None and hasattr(memory, "wait_event"):
            memory.wait_event(self.event, store=False)  # the engine is done with these staging bytes
        work = device_work([memory.retrieve(g, items) for g, items in self.plan.copies.items()])
        if work is not None and hasattr(memory, "signal"):
            # Staged (cuda): answer once the DMA is queued; the engine's scatter waits on the GPU for
            # this event, so the reply does not wait for the copy and a host round trip.
            work.early = {"event": memory.signal()}
            self.signal = work.early["event"]
        return work

    def queued(self, tier: Tier) -> m.RetrieveReply:
        return m.RetrieveReply(self.plan.results, self.plan.failed, self.signal)

    def finish(self, tier: Tier, exc: BaseException | None) -> m.RetrieveReply:
        tier.pool.unpin(self.plan.objs)  # the bytes have been read: the objects may go
        if self.replied and exc is not None:
            # The engine was told to wait for a copy that then failed: it must not use those blocks.
            # Drop the rank, so its next request fails and the client re-registers (the load is lost).
            log.error(
                "retrieve DMA for %s failed after its reply: unregistering it (%r)", self.instance.id, exc
            )
            tier.registry.unregister(self.instance.id)
        return _retrieved(tier, self.instance, self.plan, self.lease, exc)


def _retrieved(
    tier: Tier, inst: Instance, plan: CopyPlan, lease: int, exc: BaseException | None
) -> m.RetrieveReply:
    if lease:
        tier.registry.consume(lease, inst.layout.rank, inst.tenant)
    if isinstance(exc, Expired):
        raise ProtocolError(ErrorCode.EXPIRED, "the retrieve's deadline passed before its copy started")
    if exc is not None:
        _drop_broken(tier, inst, exc)
        raise ProtocolError(ErrorCode.DEVICE_ERROR, f"retrieve copy failed: {type(exc).__name__}: {exc}")
    stats = tier.stats
    stats.add("retrieves")
    stats.add("retrieved_chunks", sum(plan.results))
    stats.add("retrieved_bytes", plan.nbytes)
    stats.add("retrieve_failed_blocks", len(plan.failed))
    return m.RetrieveReply(plan.results, plan.failed, None)


def _drop_broken(tier: Tier, inst: Instance, exc: BaseException) -> None:
    """A CPU rank whose copy failed has memory that is not what it registered (a file truncated
    or gone): unregister it, so its next request fails UNKNOWN_INSTANCE and the client registers
    again. Nobody else is affected."""
    if inst.layout.device == "cpu" and not inst.closed:
        log.warning("%s: its shared memory failed a copy, unregistering it: %s", inst.id, exc)
        tier.registry.unregister(inst.id)


def _count_store(stats: Stats, plan: CopyPlan) -> None:
    stats.add("stores")
    stats.add("stored_chunks", plan.results.count("stored"))
    stats.add("store_rejects", plan.results.count("rejected"))
    stats.add("stored_bytes", plan.nbytes)


# ---- sessions ------------------------------------------------------------------------------------
def hello(tier: Tier, call: Call, msg: m.Hello) -> m.HelloReply:
    if msg.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"this daemon speaks protocol {PROTOCOL_VERSION}, the client {msg.protocol}",
        )
    if tier.tenants is None or call.peer is None:
        session = tier.registry.open_session(call.identity, msg.client, msg.pid)
    else:
        principal = tier.tenants.principal(call.peer, msg.token)
        session = tier.registry.open_session(
            call.identity, msg.client, call.peer.pid or msg.pid, principal, call.peer
        )
    s = tier.settings
    return m.HelloReply(
        PROTOCOL_VERSION,
        __version__,
        tier.boot_id,
        os.getpid(),
        s.null_block_id,
        s.heartbeat_timeout_s,
        s.lease_ttl_s,
        s.max_frame_bytes,
        session.tenant,
        session.principal.operator,
        tier.channel_max_bytes,
    )


def bye(tier: Tier, call: Call, msg: m.Bye) -> m.Empty:
    tier.registry.close_session(call.identity, reason="BYE")
    return m.Empty()


def ping(tier: Tier, call: Call, msg: m.Ping) -> m.PingReply:
    return m.PingReply(time.time(), tier.boot_id)


def status(tier: Tier, call: Call, msg: m.Status) -> dict:
    return tier.status()


def clear(tier: Tier, call: Call, msg: m.Clear) -> m.ClearReply:
    """Operators only: every object, or one namespace's (the caller's own tenant's, or ``tenant``'s)."""
    if not call.session.principal.operator:
        raise ProtocolError(
            ErrorCode.FORBIDDEN,
            "CLEAR is an operator action (the daemon's own user, root, or the tcp:// tenant 'admin')",
        )
    if msg.namespace is None:
        if msg.tenant is not None:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "tenant: names whose namespace to clear; give namespace too"
            )
        return m.ClearReply(tier.pool.clear(None))
    tenant = call.tenant if msg.tenant is None else msg.tenant
    return m.ClearReply(tier.pool.clear(scoped_namespace_id(tenant, msg.namespace)))


def evicted(tier: Tier, call: Call, msg: m.Evicted) -> m.EvictedReply:
    """The chunk keys of the caller's namespace (scoped by its tenant, as LOOKUP's) that stopped
    being servable from this daemon's pool after ``since`` (tierd.pool.evlog). A cursor of another
    boot (``boot_id``, or past this boot's seq) reads this boot's records from the start: missed."""
    ns_id = scoped_namespace_id(call.tenant, msg.namespace)
    pool = tier.pool
    since, reset = msg.since, False
    with pool.lock:
        evlog = pool.evlog
        if (msg.boot_id and msg.boot_id != tier.boot_id) or since > evlog.seq:
            since, reset = 0, True
        if since < 0:  # from now on
            seq, keys, missed = evlog.seq, [], False
        else:
            seq, keys, missed = evlog.since(ns_id, since, msg.max)
    missed = missed or reset
    stats = tier.stats
    stats.add("evicted_polls")
    stats.add("evicted_keys", len(keys))
    if missed:
        stats.add("evicted_missed")
    return m.EvictedReply(seq, keys, missed, tier.boot_id)


# ---- registration --------------------------------------------------------------------------------
def register(tier: Tier, call: Call, msg: m.Register) -> m.RegisterReply:
    inst = tier.registry.register(call.session, msg.instance, msg.layout, tier.open_memory)
    layout = inst.layout
    return m.RegisterReply(inst.name, inst.ns, [g.object_bytes(layout.chunk_tokens) for g in layout.groups])


def unregister(tier: Tier, call: Call, msg: m.Unregister) -> m.Empty:
    """Idempotent: an engine's goodbye names its ranks twice by design (the scheduler side drops
    every rank at SIGTERM, as its workers may be killed before they speak; a worker that exits
    cleanly drops its own), so an instance already gone is the goodbye done, not an error."""
    if not tier.registry.unregister(instance_key(call.tenant, msg.instance)):
        log.info("UNREGISTER %r: not registered (already unregistered, or its session ended)", msg.instance)
    return m.Empty()


# ---- lookup --------------------------------------------------------------------------------------
def lookup(tier: Tier, call: Call, msg: m.Lookup) -> m.LookupReply:
    for i, spec in enumerate(msg.groups):
        spec.check_chunk(msg.chunk_tokens, f"groups[{i}]")
    ns = msg.namespace
    ranks = 1 if msg.replicated else ns.world_size
    if len(msg.keys) * len(msg.groups) * ranks > MAX_LOOKUP_PARTS:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"keys: {len(msg.keys)} keys x {len(msg.groups)} groups x {ranks} "
            f"ranks is more than {MAX_LOOKUP_PARTS} parts in one LOOKUP: look up a prefix of the "
            "keys (tierd_client does)",
        )
    tenant = call.tenant
    ns_id = scoped_namespace_id(tenant, ns)
    registered = tier.registry.registered_layout(ns_id)
    if registered is not None:
        inst_id, lay = registered
        if (
            lay.specs[: len(msg.groups)] != msg.groups
            or len(msg.groups) > len(lay.specs)
            or lay.chunk_tokens != msg.chunk_tokens
            or lay.replicated != msg.replicated
        ):
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"LOOKUP groups/chunk_tokens/replicated differ from the "
                f"layout {inst_id!r} registered in this namespace",
            )
    tier.registry.name_namespace(ns_id, ns, tenant)
    ranks = [0] if msg.replicated else list(range(ns.world_size))
    hit, objs = tier.pool.lookup(ns_id, msg.keys, msg.groups, msg.chunk_tokens, ranks)
    if tier.l2 is not None and hit < len(msg.keys):
        reply = tier.l2.lookup(tier, call, msg, ns_id, ranks)  # L1 then L2
        if reply is not None:
            return reply
    return lookup_reply(tier, call, msg, hit, objs)


def lookup_reply(tier: Tier, call: Call, msg: m.Lookup, hit: int, objs: list) -> m.LookupReply:
    """Count a LOOKUP's answer and lease what it promised (``objs``: what a retrieve at ``hit`` reads)."""
    ns = msg.namespace
    stats = tier.stats
    stats.add("lookups")
    stats.add("lookup_chunks", len(msg.keys))
    stats.add("hit_chunks", hit)
    lease = 0
    if hit and msg.lease:
        lease = tier.registry.grant(call.session, objs, ns.world_size)
        stats.add("leases_granted")
    return m.LookupReply(hit, lease, tier.settings.lease_ttl_s)


def release(tier: Tier, call: Call, msg: m.Release) -> m.Empty:
    if tier.registry.lease_of(msg.lease, call.tenant) is None or not tier.registry.release(msg.lease):
        raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {msg.lease} is not held")
    return m.Empty()


# ---- store / retrieve ----------------------------------------------------------------------------
def _geometry(tier: Tier, inst: Instance) -> Geometry:
    if inst.geometry is None:
        inst.geometry = Geometry(
            inst.layout, tier.settings.separate_object_groups, tier.settings.null_block_id
        )
    return inst.geometry


def _check_deadline(deadline: float) -> None:
    if deadline and time.time() > deadline:
        raise ProtocolError(ErrorCode.EXPIRED, "the request arrived after its deadline")


def store(tier: Tier, call: Call, msg: m.Store):
    inst = tier.registry.instance(msg.instance, call.tenant)
    geo = _geometry(tier, inst)
    blocks = geo.check(msg.chunks)
    geo.check_staging(msg.staged_at, len(msg.chunks))
    _check_deadline(msg.deadline)
    if msg.touch:
        tier.pool.touch(inst.ns, msg.touch)  # keep the head from being evicted by this store's allocations
    if inst.layout.replicated and inst.layout.rank != 0:
        tier.stats.add("stores")
        return m.StoreReply(["exists"] * len(msg.chunks))  # rank 0's copy serves every rank
    plan = plan_store(geo, msg.chunks, tier.pool, inst.ns, inst.rank_key, msg.staged_at, blocks)
    if not plan.objs:
        _count_store(tier.stats, plan)
        return m.StoreReply(plan.results)
    return StoreJob(tier, call, inst, plan, msg.deadline, msg.touch, msg.event)


def retrieve(tier: Tier, call: Call, msg: m.Retrieve, fetch: bool = True):
    """``fetch``: objects L1 lacks are first fetched from L2 (DEFERRED until they landed or failed;
    then tierd.tier2 calls again with ``fetch`` False)."""
    inst = tier.registry.instance(msg.instance, call.tenant)
    if msg.lease:
        tier.registry.lease_of(msg.lease, inst.tenant)  # FORBIDDEN for another tenant's lease
    geo = _geometry(tier, inst)
    blocks = geo.check(msg.chunks)
    geo.check_staging(msg.staged_at, len(msg.chunks))
    _check_deadline(msg.deadline)
    if fetch and tier.l2 is not None and tier.l2.fetch_for(tier, call, msg, inst, geo):
        return DEFERRED
    plan = plan_retrieve(geo, msg.chunks, tier.pool, inst.ns, inst.rank_key, msg.staged_at, blocks)
    if not plan.objs:
        return _retrieved(tier, inst, plan, msg.lease, None)
    tier.pool.pin(plan.objs)  # no eviction while the bytes are read
    return RetrieveJob(tier, call, inst, plan, msg.deadline, msg.lease, msg.event)


HANDLERS: dict[str, Callable] = {
    "HELLO": hello,
    "BYE": bye,
    "REGISTER": register,
    "UNREGISTER": unregister,
    "LOOKUP": lookup,
    "RELEASE": release,
    "STORE": store,
    "RETRIEVE": retrieve,
    "PING": ping,
    "STATUS": status,
    "CLEAR": clear,
    "EVICTED": evicted,
}
assert HANDLERS.keys() == m.REQUESTS.keys()
