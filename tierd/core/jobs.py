"""What handlers act on (``Tier``), one request as it arrived (``Call``), and what a handler
returns besides a reply: a ``Job`` whose copy runs on a transfer lane (``StoreJob``,
``RetrieveJob``), or what it needs of the second tier (``LookupNeeds``, ``RetrieveNeeds``), which
the main loop carries to tierd.tier2 and back to the handler.

A Job's copy runs on the instance's transfer lane (``Job.run``) and its completion (commit or
abort, unpin, counters, the reply's body) runs back on the main loop (``Job.finish``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tierd.base.config import Settings
from tierd.base.stats import Stats
from tierd.edge.channel import Channel
from tierd.edge.peer import Peer
from tierd.pool.index import Obj
from tierd.pool.pool import Pool
from tierd.protocol import messages as m
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.state.planner import Geometry
from tierd.state.registry import Instance, Registry, Session
from tierd.state.tenants import Tenants
from tierd.transfer.engine import READ_LANE, DeviceWork, device_work
from tierd.transfer.plans import CopyPlan

if TYPE_CHECKING:
    from tierd.tier2.bridge import SecondTier

log = logging.getLogger("tierd")


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
    l2: SecondTier | None = None  # with --l2-url (tierd.tier2)
    channel_max_bytes: int = 0  # the lookup channel's largest frame (tierd.edge.channel); 0: none


@dataclass
class Call:
    """One request as it arrived: who sent it, where the reply goes, when it came."""

    identity: bytes
    session: Session | None
    envelope: list[bytes] | Channel  # the ROUTER's [identity], or the lookup channel it came on
    req_id: int
    t0: float
    peer: Peer | None = None  # the kernel's credentials of the connection (None: the daemon's own user)
    started: float = 0.0  # when the main loop took it up (after ``t0``, its arrival; 0: not known)

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
        # (stage, when) from the request's arrival on, as it reaches each stage (tierd.base.stats STAGES)
        self.stamps: list[tuple[str, float]] = [("read", call.t0)]
        if call.started:
            self.stamps.append(("wait", call.started))

    def stamp(self, stage: str) -> None:
        """The job has just finished ``stage`` (tierd.base.stats.STAGES)."""
        self.stamps.append((stage, time.perf_counter()))

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
            drop_broken(tier, self.instance, exc)
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
            tier.l2.committed(self.instance, geometry(tier, self.instance), self.plan.objs)
        count_store(tier.stats, self.plan)
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
        if work is not None and getattr(memory, "signals", False):
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
                "retrieve DMA for %s failed after its reply: unregistering it (%r)", self.instance.label, exc
            )
            tier.registry.unregister(self.instance.id)
        return retrieved(tier, self.instance, self.plan, self.lease, exc)


def retrieved(
    tier: Tier, inst: Instance, plan: CopyPlan, lease: int, exc: BaseException | None
) -> m.RetrieveReply:
    if lease:
        tier.registry.consume(lease, inst.layout.rank, inst.tenant)
    if isinstance(exc, Expired):
        raise ProtocolError(ErrorCode.EXPIRED, "the retrieve's deadline passed before its copy started")
    if exc is not None:
        drop_broken(tier, inst, exc)
        raise ProtocolError(ErrorCode.DEVICE_ERROR, f"retrieve copy failed: {type(exc).__name__}: {exc}")
    stats = tier.stats
    stats.add("retrieves")
    stats.add("retrieved_chunks", sum(plan.results))
    stats.add("retrieved_bytes", plan.nbytes)
    stats.add("retrieve_failed_blocks", len(plan.failed))
    return m.RetrieveReply(plan.results, plan.failed, None)


def drop_broken(tier: Tier, inst: Instance, exc: BaseException) -> None:
    """A CPU rank whose copy failed has memory that is not what it registered (a file truncated
    or gone): unregister it, so its next request fails UNKNOWN_INSTANCE and the client registers
    again. Nobody else is affected."""
    if inst.layout.device == "cpu" and not inst.closed:
        log.warning("%s: its shared memory failed a copy, unregistering it: %s", inst.label, exc)
        tier.registry.unregister(inst.id)


def count_store(stats: Stats, plan: CopyPlan) -> None:
    stats.add("stores")
    stats.add("stored_chunks", plan.results.count("stored"))
    stats.add("store_rejects", plan.results.count("rejected"))
    stats.add("stored_bytes", plan.nbytes)


def geometry(tier: Tier, inst: Instance) -> Geometry:
    if inst.geometry is None:
        inst.geometry = Geometry(
            inst.layout, tier.settings.separate_object_groups, tier.settings.null_block_id
        )
    return inst.geometry


@dataclass
class LookupNeeds:
    """A LOOKUP that L1 alone does not answer whole: L1's answer (``hit``, ``objs``) and what the
    second tier needs to ask about the rest (the namespace id and the ranks)."""

    msg: m.Lookup
    ns: bytes
    ranks: list[int]
    hit: int
    objs: list[Obj]


@dataclass
class RetrieveNeeds:
    """A checked RETRIEVE whose objects L1 may lack: the second tier fetches them first (or says
    there is nothing to wait for, and it is planned at once)."""

    msg: m.Retrieve
    instance: Instance
    geometry: Geometry
    blocks: list[np.ndarray]
