"""Request handlers. Each returns a reply body, or PENDING when a transfer job will reply later;
each raises ProtocolError for a typed error. They run on the daemon's main loop only."""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tierd import __version__
from tierd.pool.index import Obj
from tierd.pool.pool import EXISTS
from tierd.protocol import PROTOCOL_VERSION
from tierd.protocol import fields as f
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.keys import MAX_KEY_BYTES, MIN_KEY_BYTES, namespace_id
from tierd.protocol.layout import GroupKind, GroupSpec, Namespace, PageLayout
from tierd.sessions import Instance, Session
from tierd.transfer.engine import pending
from tierd.transfer.plan import CopyItem, split_nulls

if TYPE_CHECKING:
    from tierd.server import Daemon

log = logging.getLogger("tierd.ops")

PENDING = object()
MAX_CHUNKS = 1 << 16
IPC_EVENT_BYTES = 64  # cudaIpcEventHandle_t


@dataclass(eq=False)
class Job:
    op: str
    envelope: list[bytes]
    req_id: int
    t0: float
    instance: Instance
    objs: list[Obj] = field(default_factory=list)  # written (STORE) or read (RETRIEVE)
    results: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    nbytes: int = 0
    lease: int = 0
    deadline: float = 0.0  # wall clock; 0 = none
    touch: list[bytes] = field(default_factory=list)  # STORE: the prefix before its chunks


def _keys(body: dict, name: str, required: bool = True) -> list[bytes]:
    """A list of PAGE hashes, checked without building a field path per key (LOOKUP's hot path)."""
    keys = f.as_list(f.get(body, name, "", ... if required else []), name, MAX_CHUNKS)
    for i, k in enumerate(keys):
        if type(k) is not bytes or not MIN_KEY_BYTES <= len(k) <= MAX_KEY_BYTES:
            f.as_bytes(k, f"{name}[{i}]", MIN_KEY_BYTES, MAX_KEY_BYTES)  # raises with the reason
    return keys


class _ObjectSet:
    """One object a chunk needs: the groups it holds, as (group, mask shift, byte offset)."""

    def __init__(self, parts: list[tuple[int, int, int]], nbytes: int, label: str):
        self.parts = parts
        self.span = {g: (sh, off) for g, sh, off in parts}
        self.nbytes = nbytes
        self.label = label


class _Geometry:
    """Per registered instance, what every STORE/RETRIEVE of it needs, computed once."""

    def __init__(self, layout: PageLayout, separate: bool):
        groups, C = layout.groups, layout.chunk_tokens
        self.bpcs = [g.spec.blocks_per_chunk(C) for g in groups]
        self.gbytes = [g.object_bytes(C) for g in groups]
        self.limits = [g.num_blocks for g in groups]
        self.full_masks = [(1 << n) - 1 for n in self.bpcs]
        self.positions = [np.arange(n, dtype=np.int64) for n in self.bpcs]
        for p in self.positions:
            p.flags.writeable = False
        self.has_full = any(g.spec.kind is GroupKind.FULL for g in groups)
        if separate:
            self.objects = [_ObjectSet([(g, 0, 0)], self.gbytes[g], f"g{g}/{groups[g].spec.kind.value}")
                            for g in range(len(groups))]
        else:
            parts, shift, off = [], 0, 0
            for g in range(len(groups)):
                parts.append((g, shift, off))
                shift += self.bpcs[g]
                off += self.gbytes[g]
            self.objects = [_ObjectSet(parts, off, "all")]


class Expired(Exception):
    """The client's deadline passed before the copy could start."""


def _deadline(body: dict) -> float:
    deadline = f.as_float(f.get(body, "deadline", "", 0.0), "deadline", 0.0)
    if deadline and time.time() > deadline:
        raise ProtocolError(ErrorCode.EXPIRED, "the request arrived after its deadline")
    return deadline


class Ops:
    def __init__(self, daemon: "Daemon"):
        self.d = daemon
        self.boot_id = uuid.uuid4().hex
        self.table = {
            "HELLO": self.hello,
            "BYE": self.bye,
            "REGISTER": self.register,
            "UNREGISTER": self.unregister,
            "LOOKUP": self.lookup,
            "RELEASE": self.release,
            "STORE": self.store,
            "RETRIEVE": self.retrieve,
            "PING": self.ping,
            "STATUS": self.status,
            "CLEAR": self.clear,
        }

    # ---- session ---------------------------------------------------------------------------
    def hello(self, identity: bytes, session: Session | None, body: dict, ctx) -> dict:
        version = f.as_int(f.get(body, "protocol", ""), "protocol", 0)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION, f"this daemon speaks protocol {PROTOCOL_VERSION}, the client {version}"
            )
        name = f.as_str(f.get(body, "client", "", ""), "client")
        pid = f.as_int(f.get(body, "pid", "", 0), "pid", 0)
        if session is not None:  # a reconnect on the same identity: start clean
            self.d.drop_session(identity, reason="re-HELLO")
        self.d.sessions[identity] = Session(identity, name, pid, time.monotonic())
        s = self.d.settings
        return {
            "protocol": PROTOCOL_VERSION,
            "version": __version__,
            "boot_id": self.boot_id,
            "pid": os.getpid(),
            "null_block_id": s.null_block_id,
            "heartbeat_timeout_s": s.heartbeat_timeout_s,
            "lease_ttl_s": s.lease_ttl_s,
            "max_frame_bytes": s.max_frame_bytes,
        }

    def bye(self, identity, session, body, ctx) -> dict:
        """A client closing cleanly: its leases and instances go now, not at the heartbeat timeout."""
        self.d.drop_session(identity, reason="BYE")
        return {}

    def ping(self, identity, session, body, ctx) -> dict:
        return {"time": time.time(), "boot_id": self.boot_id}

    def status(self, identity, session, body, ctx) -> dict:
        return self.d.status()

    def clear(self, identity, session, body, ctx) -> dict:
        return {"evicted": self.d.pool.clear()}

    # ---- registration ------------------------------------------------------------------------
    def register(self, identity, session: Session, body, ctx) -> dict:
        inst_id = f.as_str(f.get(body, "instance", ""), "instance", allow_empty=False)
        layout = PageLayout.from_wire(f.get(body, "layout", ""))
        old = self.d.instances.get(inst_id)
        if old is not None:
            if old.layout != layout and old.session != identity and old.session in self.d.sessions:
                raise ProtocolError(
                    ErrorCode.LAYOUT_MISMATCH,
                    f"instance {inst_id!r} is registered by another live client with a different layout",
                )
            if old.layout == layout:  # idempotent re-register (a reconnecting client)
                previous = self.d.sessions.get(old.session)
                if previous is not None:
                    previous.instances.discard(inst_id)
                old.session = identity
                session.instances.add(inst_id)
                return self._registered(old)
            self.d.unregister(inst_id)
        memory = self.d.open_memory(layout)
        inst = Instance(inst_id, identity, layout, namespace_id(layout.namespace), memory)
        self.d.namespaces[inst.ns] = layout.namespace
        self.d.instances[inst_id] = inst
        session.instances.add(inst_id)
        self.d.xfer.attach(inst_id, duplex=getattr(memory, "duplex", False))
        log.info(
            "registered %s: model=%s rank=%d/%d groups=%d device=%s",
            inst_id, layout.namespace.model, layout.rank, layout.namespace.world_size, len(layout.groups), layout.device,
        )
        return self._registered(inst)

    def _registered(self, inst: Instance) -> dict:
        layout = inst.layout
        return {
            "instance": inst.id,
            "namespace_id": inst.ns,
            "object_bytes": [g.object_bytes(layout.chunk_tokens) for g in layout.groups],
        }

    def unregister(self, identity, session, body, ctx) -> dict:
        inst_id = f.as_str(f.get(body, "instance", ""), "instance")
        if inst_id not in self.d.instances:
            raise ProtocolError(ErrorCode.UNKNOWN_INSTANCE, f"instance {inst_id!r} is not registered")
        self.d.unregister(inst_id)
        return {}

    def _instance(self, body: dict) -> Instance:
        inst_id = f.as_str(f.get(body, "instance", ""), "instance")
        inst = self.d.instances.get(inst_id)
        if inst is None or inst.closed:
            raise ProtocolError(ErrorCode.UNKNOWN_INSTANCE, f"instance {inst_id!r} is not registered")
        return inst

    # ---- lookup ------------------------------------------------------------------------------
    def lookup(self, identity, session: Session, body, ctx) -> dict:
        ns = Namespace.from_wire(f.get(body, "namespace", ""))
        keys = _keys(body, "keys")
        chunk_tokens = f.as_int(f.get(body, "chunk_tokens", ""), "chunk_tokens", 1, 1 << 24)
        specs = [GroupSpec.from_wire(g, f"groups[{i}]") for i, g in enumerate(f.as_list(f.get(body, "groups", ""), "groups", 64, 1))]
        for i, spec in enumerate(specs):
            spec.check_chunk(chunk_tokens, f"groups[{i}]")
        replicated = f.as_bool(f.get(body, "replicated", "", False), "replicated")
        want_lease = f.as_bool(f.get(body, "lease", "", True), "lease")
        ranks = [0] if replicated else list(range(ns.world_size))
        ns_id = namespace_id(ns)
        for inst in self.d.instances.values():
            if inst.ns == ns_id:
                lay = inst.layout
                if (list(lay.specs[: len(specs)]) != specs or len(specs) > len(lay.specs)
                        or lay.chunk_tokens != chunk_tokens or lay.replicated != replicated):
                    raise ProtocolError(
                        ErrorCode.LAYOUT_MISMATCH,
                        f"LOOKUP groups/chunk_tokens/replicated differ from the layout {inst.id!r} registered "
                        "in this namespace",
                    )
                break
        self.d.namespaces.setdefault(ns_id, ns)
        hit, objs = self.d.pool.lookup(ns_id, keys, specs, chunk_tokens, ranks)
        stats = self.d.stats
        stats.add("lookups")
        stats.add("lookup_chunks", len(keys))
        stats.add("hit_chunks", hit)
        lease_id = 0
        if hit and want_lease:
            lease_id = self.d.leases.grant(session, objs, ns.world_size).id
            stats.add("leases_granted")
        return {"chunks": hit, "lease": lease_id, "lease_ttl_s": self.d.settings.lease_ttl_s}

    def release(self, identity, session, body, ctx) -> dict:
        lease_id = f.as_int(f.get(body, "lease", ""), "lease", 0)
        if not self.d.leases.release(lease_id, self.d.sessions):
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is not held")
        return {}

    # ---- store / retrieve ----------------------------------------------------------------------
    def _chunks(self, inst: Instance, body: dict) -> list[tuple[bytes, list[list[int]]]]:
        geo = self._geom(inst)
        null = self.d.settings.null_block_id
        ngroups = len(geo.bpcs)
        out = []
        for i, c in enumerate(f.as_list(f.get(body, "chunks", ""), "chunks", MAX_CHUNKS)):
            if type(c) is not dict:
                f.as_map(c, f"chunks[{i}]")
            key = c.get("key")
            if type(key) is not bytes or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                f.as_bytes(f.get(c, "key", f"chunks[{i}]"), f"chunks[{i}].key", MIN_KEY_BYTES, MAX_KEY_BYTES)
            groups = c.get("blocks")
            if type(groups) is not list or len(groups) != ngroups:
                f.as_list(f.get(c, "blocks", f"chunks[{i}]"), f"chunks[{i}].blocks", ngroups, ngroups)
            for g, ids in enumerate(groups):
                limit = geo.limits[g]
                # fast path: a list of in-range ints (no nulls); anything else is checked one by one
                if not (type(ids) is list and len(ids) == geo.bpcs[g] and all(type(b) is int for b in ids)
                        and min(ids) >= 0 and max(ids) < limit):
                    where = f"chunks[{i}].blocks[{g}]"
                    ids = f.as_list(ids, where, geo.bpcs[g], geo.bpcs[g])
                    for j, b in enumerate(ids):
                        if not isinstance(b, int) or isinstance(b, bool) or (b != null and not 0 <= b < limit):
                            raise f.bad(f"{where}[{j}]", f"block id {b!r} is neither null ({null}) nor in [0, {limit})")
            out.append((key, groups))
        return out

    def _geom(self, inst: Instance) -> "_Geometry":
        if inst.geom is None:
            inst.geom = _Geometry(inst.layout, self.d.settings.separate_object_groups)
        return inst.geom

    def store(self, identity, session, body, ctx):
        inst = self._instance(body)
        chunks = self._chunks(inst, body)
        touch = _keys(body, "touch", required=False)
        event = f.get(body, "event", "", None)
        if event is not None:  # interprocess event on the engine's forward stream (CUDA layouts)
            event = f.as_bytes(event, "event", IPC_EVENT_BYTES, IPC_EVENT_BYTES)
        layout, pool, null = inst.layout, self.d.pool, self.d.settings.null_block_id
        job = Job("STORE", ctx.envelope, ctx.req_id, ctx.t0, inst, deadline=_deadline(body), touch=touch)
        if touch:
            pool.touch(inst.ns, touch)  # keep the head from being evicted by this store's allocations
        if layout.replicated and layout.rank != 0:
            job.results = ["exists"] * len(chunks)  # rank 0's copy serves every rank
            self.d.stats.add("stores")
            return {"results": job.results}
        plan: dict[int, list[CopyItem]] = {}
        geo = self._geom(inst)
        for key, blocks in chunks:
            if geo.has_full and "rejected" in job.results:
                job.results.append("rejected")  # past a hole LOOKUP never reaches: keep the room
                self.d.stats.add("store_rejects")
                continue
            split = [split_nulls(ids, null, geo.positions[g]) for g, ids in enumerate(blocks)]
            if not any(len(ids) for ids, _ in split):
                job.results.append("empty")  # an all-null chunk is not stored
                continue
            new: list[Obj] = []
            items: list[tuple[int, CopyItem]] = []
            status = "exists"
            for obj_set in geo.objects:
                present = [(g, sh, off) for g, sh, off in obj_set.parts if len(split[g][0])]
                if not present:
                    continue
                mask = 0
                for g, sh, _ in present:
                    ids, pos = split[g]
                    if len(ids) == geo.bpcs[g]:
                        mask |= geo.full_masks[g] << sh
                    else:
                        for p in pos.tolist():
                            mask |= 1 << (sh + p)
                obj = pool.begin_write(inst.ns, key, obj_set.span, inst.rank_key, obj_set.nbytes, mask, obj_set.label)
                if obj is EXISTS:
                    continue
                if obj is None:
                    status = "rejected"
                    break
                status = "stored"
                new.append(obj)
                view = obj.view()
                for g, _, off in present:
                    ids, pos = split[g]
                    items.append((g, CopyItem(ids, pos, geo.bpcs[g], view[off : off + geo.gbytes[g]])))
            if status == "rejected":
                pool.abort(new)  # all groups of a chunk or none
                self.d.stats.add("store_rejects")
            else:
                job.objs.extend(new)
                for g, item in items:
                    plan.setdefault(g, []).append(item)
                    job.nbytes += item.view.nbytes * len(item.ids) // item.bpc
            job.results.append(status)
        if not job.objs:
            self.d.stats.add("stores")
            return {"results": job.results}
        memory = inst.memory
        wait_event = getattr(memory, "wait_event", None) if event is not None else None  # cpu: nothing to wait on

        def copy():
            if wait_event is not None:
                wait_event(event)  # the gathers below start only once the engine's writes are done
            return pending([memory.store(g, items) for g, items in plan.items()])  # cuda: done on the device later

        self.d.submit(job, copy)
        return PENDING

    def finish_store(self, job: Job, exc: BaseException | None) -> tuple[dict | None, ProtocolError | None]:
        if exc is not None:
            self.d.pool.abort(job.objs)
            return None, ProtocolError(ErrorCode.DEVICE_ERROR, f"store copy failed: {type(exc).__name__}: {exc}")
        if job.deadline and time.time() > job.deadline:
            # The client gave up and may already reuse the blocks we read: never publish them.
            self.d.pool.abort(job.objs)
            return None, ProtocolError(ErrorCode.EXPIRED, "the store finished after its deadline; nothing was stored")
        self.d.pool.commit(job.objs)
        if job.touch:
            # Again after the commit, or the new tail ends up more recent than the head it extends.
            self.d.pool.touch(job.instance.ns, job.touch)
        stats = self.d.stats
        stats.add("stores")
        stats.add("stored_chunks", job.results.count("stored"))
        stats.add("stored_bytes", job.nbytes)
        return {"results": job.results}, None

    def retrieve(self, identity, session, body, ctx):
        inst = self._instance(body)
        chunks = self._chunks(inst, body)
        lease_id = f.as_int(f.get(body, "lease", "", 0), "lease", 0)
        pool, null = self.d.pool, self.d.settings.null_block_id
        job = Job("RETRIEVE", ctx.envelope, ctx.req_id, ctx.t0, inst, lease=lease_id, deadline=_deadline(body))
        plan: dict[int, list[CopyItem]] = {}
        reads: dict[Obj, None] = {}
        geo = self._geom(inst)
        for key, blocks in chunks:
            ok = True
            for g, ids in enumerate(blocks):
                ids_arr, pos = split_nulls(ids, null, geo.positions[g])
                if not len(ids_arr):
                    continue
                obj = pool.find_ready(inst.ns, key, g, inst.rank_key)
                have = 0 if obj is None else obj.mask >> obj.span[g][0]
                if have & geo.full_masks[g] == geo.full_masks[g]:
                    present = None  # every block of the chunk is held: the common case
                else:
                    present = np.array([bool(have >> p & 1) for p in pos.tolist()], dtype=bool)
                if present is not None and not present.all():
                    # Report exactly the blocks not restored; still restore the ones held.
                    ok = False
                    job.failed.extend([g, int(b)] for b in ids_arr[~present].tolist())
                    ids_arr, pos = ids_arr[present], pos[present]
                    if not len(ids_arr):
                        continue
                shift, off = obj.span[g]
                gbytes, bpc = geo.gbytes[g], geo.bpcs[g]
                reads[obj] = None
                view = obj.view()[off : off + gbytes]
                plan.setdefault(g, []).append(CopyItem(ids_arr, pos, bpc, view))
                job.nbytes += gbytes * len(ids_arr) // bpc
            job.results.append(ok)
        job.objs = list(reads)
        if not job.objs:
            return self.finish_retrieve(job, None)[0]
        pool.pin(job.objs)  # no eviction while the bytes are read
        memory, deadline = inst.memory, job.deadline

        def copy():
            if deadline and time.time() > deadline:
                raise Expired()  # the engine may have given these blocks to another request
            return pending([memory.retrieve(g, items) for g, items in plan.items()])

        self.d.submit(job, copy)
        return PENDING

    def finish_retrieve(self, job: Job, exc: BaseException | None) -> tuple[dict | None, ProtocolError | None]:
        if job.objs:
            self.d.pool.unpin(job.objs)
        if job.lease:
            self.d.leases.consume(job.lease, job.instance.layout.rank, self.d.sessions)
        if isinstance(exc, Expired):
            return None, ProtocolError(ErrorCode.EXPIRED, "the retrieve's deadline passed before its copy started")
        if exc is not None:
            return None, ProtocolError(ErrorCode.DEVICE_ERROR, f"retrieve copy failed: {type(exc).__name__}: {exc}")
        stats = self.d.stats
        stats.add("retrieves")
        stats.add("retrieved_chunks", sum(job.results))
        stats.add("retrieved_bytes", job.nbytes)
        stats.add("retrieve_failed_blocks", len(job.failed))
        return {"ok": job.results, "failed": job.failed}, None
