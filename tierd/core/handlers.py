"""One handler per op: ``handler(tier, call, request) -> outcome``, run on the daemon's main loop
only. An outcome is a reply's body, a Job (STORE and RETRIEVE: a copy on a transfer lane, then
its completion on the main loop; tierd.core.jobs), or what the request needs of the second tier
(``LookupNeeds``, ``RetrieveNeeds``). A handler raises ProtocolError for a typed error and never
sends anything: the main loop (tierd.daemon.server) carries needs to tierd.tier2, submits copies, and
sends every reply.

Deadlines: STORE and RETRIEVE carry the client's wall-clock deadline. A store never commits after
it (the client may already reuse the blocks it read), and a retrieve never starts after it (the
engine may have given its blocks to another request): both answer EXPIRED instead.

With a second tier (``tier.l2``) a LOOKUP that L1 does not answer whole, and every RETRIEVE,
return what they need of it; the main loop calls back here (``lookup_folded``, ``retrieve_planned``,
``retrieve`` with ``fetch`` False) once L2 answered or its deadline passed (never later than that).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierd import __version__
from tierd.core.jobs import (
    Call,
    LookupNeeds,
    RetrieveJob,
    RetrieveNeeds,
    StoreJob,
    Tier,
    count_store,
    geometry,
    retrieved,
)
from tierd.pool.reserve import reserve
from tierd.protocol import MAX_LOOKUP_PARTS, PROTOCOL_VERSION
from tierd.protocol import messages as m
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.state.planner import plan_retrieve, plan_store
from tierd.state.registry import instance_key
from tierd.state.tenants import scoped_namespace_id
from tierd.transfer.plans import bind

if TYPE_CHECKING:  # (tierd.tier2 is imported only with --l2-url)
    from tierd.tier2.lookups import Folded

log = logging.getLogger("tierd")


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
    """An operator sees every tenant's namespaces and instances; any other tenant its own only (the
    daemon-wide figures, as /metrics gives them, are everyone's)."""
    out = tier.status()
    if call.session.principal.operator:
        return out
    mine = call.tenant
    out["namespaces"] = [n for n in out["namespaces"] if n["tenant"] == mine]
    out["instances"] = [i for i in out["instances"] if i["tenant"] == mine]
    return out


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
    """Idempotent: an instance already gone (its session's BYE or end dropped it, or an older
    connector that named its ranks from both sides) is the goodbye done, not an error."""
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
        inst_name, lay = registered
        if (
            lay.specs[: len(msg.groups)] != msg.groups
            or len(msg.groups) > len(lay.specs)
            or lay.chunk_tokens != msg.chunk_tokens
            or lay.replicated != msg.replicated
        ):
            raise ProtocolError(
                ErrorCode.LAYOUT_MISMATCH,
                f"LOOKUP groups/chunk_tokens/replicated differ from the "
                f"layout {inst_name!r} registered in this namespace",
            )
    tier.registry.name_namespace(ns_id, ns, tenant)
    ranks = [0] if msg.replicated else list(range(ns.world_size))
    hit, objs = tier.pool.lookup(ns_id, msg.keys, msg.groups, msg.chunk_tokens, ranks)
    if tier.l2 is not None and hit < len(msg.keys):
        return LookupNeeds(msg, ns_id, ranks, hit, objs)  # L1 then L2 (lookup_folded)
    return lookup_reply(tier, call, msg, hit, objs)


def lookup_l1(tier: Tier, call: Call, need: LookupNeeds) -> m.LookupReply:
    """A LOOKUP that needed L2, answered from L1 alone (L2 had nothing to add, or is not connected)."""
    return lookup_reply(tier, call, need.msg, need.hit, need.objs)


def lookup_folded(tier: Tier, call: Call, folded: Folded) -> m.LookupReply:
    """A LOOKUP that needed L2, once the fold over L1 and L2 is known. The L1 objects the fold
    pinned while L2's fetches took room are let go once the lease holds them."""
    try:
        return lookup_reply(tier, call, folded.msg, folded.hit, folded.objs)
    finally:
        tier.pool.unpin(folded.pinned)


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
def _check_deadline(deadline: float) -> None:
    if deadline and time.time() > deadline:
        raise ProtocolError(ErrorCode.EXPIRED, "the request arrived after its deadline")


def _check_event(inst, event: bytes | None) -> None:
    """A request may carry an event for the daemon's copies to wait for only where interprocess
    events order another process's work (not on ROCm: tierd.transfer.cuda, ``signals``)."""
    if event is not None and getattr(inst.memory, "signals", None) is False:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"{inst.label}: its GPU's interprocess events do not order another process's work "
            "(ROCm): send the request without an event, once its bytes are ready (host order)",
        )


def store(tier: Tier, call: Call, msg: m.Store):
    inst = tier.registry.instance(msg.instance, call.tenant)
    _check_event(inst, msg.event)
    geo = geometry(tier, inst)
    blocks = geo.check(msg.chunks)
    geo.check_staging(msg.staged_at, len(msg.chunks))
    _check_deadline(msg.deadline)
    if msg.touch:
        tier.pool.touch(inst.ns, msg.touch)  # keep the head from being evicted by this store's allocations
    if inst.layout.replicated and inst.layout.rank != 0:
        tier.stats.add("stores")
        return m.StoreReply(["exists"] * len(msg.chunks))  # rank 0's copy serves every rank
    req = plan_store(geo, msg.chunks, msg.staged_at, blocks)  # decided (planner: no pool)
    plan = bind(req, reserve(tier.pool, inst.ns, inst.rank_key, req))  # reserved (pool), bound (transfer)
    if not plan.objs:
        count_store(tier.stats, plan)
        return m.StoreReply(plan.results)
    return StoreJob(tier, call, inst, plan, msg.deadline, msg.touch, msg.event)


def retrieve(tier: Tier, call: Call, msg: m.Retrieve):
    """Planned now from what L1 holds; with a second tier, what it needs first (RetrieveNeeds: the
    main loop has L2 fetch what L1 lacks, then calls ``retrieve_planned``, or ``retrieve_resumed``
    once the fetches it waited for settled)."""
    need = _checked_retrieve(tier, call, msg)
    if tier.l2 is not None:
        return need
    return retrieve_planned(tier, call, need)


def _checked_retrieve(tier: Tier, call: Call, msg: m.Retrieve) -> RetrieveNeeds:
    inst = tier.registry.instance(msg.instance, call.tenant)
    _check_event(inst, msg.event)
    if msg.lease:
        tier.registry.lease_of(msg.lease, inst.tenant)  # FORBIDDEN for another tenant's lease
    geo = geometry(tier, inst)
    blocks = geo.check(msg.chunks)
    geo.check_staging(msg.staged_at, len(msg.chunks))
    _check_deadline(msg.deadline)
    return RetrieveNeeds(msg, inst, geo, blocks)


def retrieve_planned(tier: Tier, call: Call, need: RetrieveNeeds):
    """A checked RETRIEVE, planned now from what L1 holds."""
    return _plan_retrieve(tier, call, need.msg, need.instance, need.geometry, need.blocks)


def retrieve_resumed(tier: Tier, call: Call, need: RetrieveNeeds):
    """A RETRIEVE back from waiting for the second tier, planned from what was checked before it
    waited. Only what the wait may have changed is checked again: its instance is still the one
    registered (gone: UNKNOWN_INSTANCE; registered anew: every check again, against the new one),
    its lease and its deadline."""
    msg = need.msg
    if tier.registry.instance(msg.instance, call.tenant) is not need.instance:
        need = _checked_retrieve(tier, call, msg)
    else:
        if msg.lease:
            tier.registry.lease_of(msg.lease, need.instance.tenant)
        _check_deadline(msg.deadline)
    return retrieve_planned(tier, call, need)


def _plan_retrieve(tier: Tier, call: Call, msg: m.Retrieve, inst, geo, blocks):
    plan = plan_retrieve(geo, msg.chunks, tier.pool, inst.ns, inst.rank_key, msg.staged_at, blocks)
    if not plan.objs:
        return retrieved(tier, inst, plan, msg.lease, None)
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
