"""KV cache events for KV-aware routers: ``BlockStored`` / ``BlockRemoved`` with medium ``CPU``
for the chunks this engine put in the tier, in vLLM's own block hashes (those a router already
tracks from the engine's GPU events), published by vLLM's event publisher (``--kv-events-config``).

Flow (only when ``kv_events_config.enable_kv_cache_events``):

1. The scheduler side plans a STORE and ``record``s, per chunk key, the payload a router needs:
   the chunk's block hashes per full-attention group, its parent hash, tokens, block size.
2. Each worker reports the fate of every chunk it was asked to store (the STORE reply's
   ``results``, or ``failed`` / ``skipped`` when no STORE went out) through
   ``get_kv_connector_kv_cache_events`` (a ``ChunkReports`` container; vLLM merges the ranks').
3. Once every rank has reported a chunk, it is announced iff at least one rank answered
   ``stored`` and none ``rejected`` / ``failed`` / ``skipped`` (a chunk is servable only when
   every rank's bytes are in; ``exists`` means it already was, from this or another engine).
4. Evictions: every ``EVICTION_POLL_S`` the scheduler side asks the daemon (op ``EVICTED``,
   docs/protocol.md section 14; an ``UNKNOWN_OP`` answer, an older daemon, turns polling off)
   which chunk keys of its namespace stopped being servable from the daemon's memory since its
   cursor; those this engine announced are published as ``BlockRemoved`` with the same hashes,
   at the engine's next step (vLLM publishes events only when its scheduler steps: an idle
   engine publishes them when it next has work). The first poll sends ``since`` -1 (from now
   on); each reply's ``seq`` and ``boot_id`` are sent with the next one.
   ``missed`` (the daemon restarted, or more was evicted between two polls than its
   ``--eviction-log`` holds): removals may have been lost. The connector keeps its announced
   chunks and goes on from the new cursor, so a router may over-estimate what this node holds,
   never under-estimate: a request routed here for a chunk that is gone recomputes and stores it
   again, which makes the router right again, whereas a chunk wrongly reported removed but still
   held is never announced again (its stores answer ``exists``). Logged once at INFO, then DEBUG.

While chunks await their reports the connector asks vLLM to keep stepping
(``has_pending_push_work``), so the last stores of a request that has finished still reach the
router although the engine has nothing else to do; a chunk whose reports have not all come
within ``max_wait_s`` (the STORE deadline and a margin) is dropped, never waited for forever.

Hazards: memory is bounded (at most ``MAX_TRACKED`` planned and announced chunks; a key dropped
from ``announced`` is never reported removed, so a router may over-estimate what this node
holds, never under-estimate). Sliding-window and recurrent-state groups are not announced: the
tier holds only part of their blocks. Without the daemon side, only ``BlockStored`` is emitted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVConnectorKVEvents

from tierd.protocol import messages
from tierd.protocol.layout import GroupKind
from tierd_client.vllm_connector.log import get_logger

log = get_logger("tierd_client.vllm_connector")

MAX_TRACKED = 16384
EVICTION_POLL_S = 1.0
GOOD, BAD = frozenset({"stored", "exists"}), frozenset({"rejected", "failed", "skipped"})


class ChunkReports(KVConnectorKVEvents):
    """Worker -> scheduler: ``(chunk key, result)`` of the STOREs that ended since the last step."""

    def __init__(self, reports: list[tuple[bytes, str]] | None = None):
        self.reports = list(reports or ())
        self.workers = 1

    def add_events(self, events) -> None:
        self.reports.extend(events)

    def aggregate(self) -> ChunkReports:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self):
        return list(self.reports)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.reports.clear()

    def __len__(self) -> int:
        return len(self.reports)


@dataclass
class _Planned:
    stored: list  # BlockStored events to publish
    expected: int  # rank reports still to come
    good: bool = False
    bad: bool = False
    at: float = 0.0  # monotonic time it was (last) planned


@dataclass
class RouterEvents:
    geo: object
    client: object
    world_size: int
    hash_block_size: int
    max_wait_s: float = 11.0
    planned: OrderedDict = field(default_factory=OrderedDict)  # key -> _Planned
    announced: OrderedDict = field(default_factory=OrderedDict)  # key -> [BlockRemoved]
    out: list = field(default_factory=list)
    evictions: bool = True  # the daemon may report evictions (off after UNKNOWN_OP)
    _poll: object = None
    _poll_at: float = 0.0
    _cursor: int = -1  # EVICTED's seq to send next (-1: from now on)
    _boot: str | None = None  # the daemon boot that cursor belongs to
    missed: int = 0  # EVICTED replies that said removals may have been lost

    def record(self, request, chunk: int, key: bytes) -> None:
        stored = [
            e
            for g in self.geo.groups
            if g.kind is GroupKind.FULL
            for e in [self._stored_event(request, chunk, g)]
            if e is not None
        ]
        if not stored:
            return
        p = self.planned.pop(key, None)
        expected = self.world_size + (p.expected if p is not None else 0)
        self.planned[key] = _Planned(
            stored, expected, p.good if p else False, p.bad if p else False, time.monotonic()
        )
        while len(self.planned) > MAX_TRACKED:
            self.planned.popitem(last=False)

    def on_reports(self, container) -> None:
        for key, result in container.get_all_events() if container is not None else ():
            p = self.planned.get(key)
            if p is None:
                continue
            p.expected -= 1
            p.good |= result == "stored"
            p.bad |= result in BAD
            if p.expected > 0:
                continue
            del self.planned[key]
            if p.good and not p.bad:
                self.out += p.stored
                self.announced[key] = [
                    BlockRemoved(block_hashes=e.block_hashes, medium=MEDIUM_CPU, group_idx=e.group_idx)
                    for e in p.stored
                ]
                self.announced.move_to_end(key)
                while len(self.announced) > MAX_TRACKED:
                    self.announced.popitem(last=False)

    def pending(self) -> bool:
        """Chunks still await reports (stale ones are dropped first)."""
        cutoff = time.monotonic() - self.max_wait_s
        while self.planned:
            key, p = next(iter(self.planned.items()))
            if p.at >= cutoff:
                return True
            del self.planned[key]
        return False

    def take(self) -> list:
        self._poll_evictions()
        out, self.out = self.out, []
        return out

    # ---- evictions ------------------------------------------------------------------------------
    def _poll_evictions(self) -> None:
        if not self.evictions or getattr(self.client, "server", None) is None:
            return
        fut = self._poll
        if fut is not None and fut.done():
            self._poll = None
            exc = fut.exception()
            if exc is None:
                reply = fut.result()
                if reply.missed:
                    self.missed += 1
                    (log.info if self.missed == 1 else log.debug)(
                        "tierd: some evictions were not reported (the daemon restarted, or evicted more "
                        "than its --eviction-log holds between two polls): the router may think this node "
                        "holds chunks it no longer does"
                    )
                self._cursor = reply.seq
                self._boot = reply.boot_id or None
                for key in reply.keys:
                    self.out += self.announced.pop(bytes(key), ())
            elif getattr(exc, "code", None) == "UNKNOWN_OP":
                log.info("tierd: this daemon does not report evictions: router events carry stores only")
                self.evictions = False
        if self._poll is None and self.evictions and time.monotonic() >= self._poll_at:
            self._poll_at = time.monotonic() + EVICTION_POLL_S
            # boot_id: a cursor of another boot is missed, read from this boot's start
            body = messages.Evicted(self.geo.namespace, since=self._cursor, boot_id=self._boot or "")
            try:
                self._poll = self.client.call_async("EVICTED", body, timeout=EVICTION_POLL_S)
            except Exception:  # noqa: BLE001 - closed client: no more events
                self._poll = None

    # ---- payloads -------------------------------------------------------------------------------
    def _stored_event(self, request, chunk: int, g) -> BlockStored | None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        C = self.geo.chunk_tokens
        hashes = _hashes_at(
            list(getattr(request, "block_hashes", ()) or ()), self.hash_block_size, g.block_tokens
        )
        per = C // g.block_tokens
        first = chunk * per
        if len(hashes) < first + per:
            return None  # vLLM has not hashed these blocks (cannot happen for full chunks; be safe)
        lora = getattr(request, "lora_request", None)
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first : first + per]],
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(request.all_token_ids[chunk * C : (chunk + 1) * C]),
            block_size=g.block_tokens,
            lora_id=getattr(lora, "adapter_id", None) if lora else None,
            medium=MEDIUM_CPU,
            lora_name=getattr(lora, "name", None) if lora else None,
            group_idx=g.index,
            kv_cache_spec_kind="mla_attention" if g.spec_name == "MLAAttentionSpec" else "full_attention",
        )


def _hashes_at(hashes: list, hash_block_size: int, block_size: int) -> list:
    if block_size == hash_block_size or not hashes:
        return hashes
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    return list(resolve_block_hashes(hashes, hash_block_size, block_size))
