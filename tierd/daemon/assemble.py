"""What a daemon is built of, from its settings: the pool, the CUDA data path, the second tier,
the engines' memory, the connection cap. tierd.daemon.server puts them together and runs the loop.
"""

from __future__ import annotations

import os
import resource

from tierd.base.config import Settings
from tierd.daemon import warm
from tierd.edge.peer import Peer
from tierd.pool.pool import Pool
from tierd.protocol.errors import ErrorCode, ProtocolError
from tierd.protocol.layout import PageLayout
from tierd.state.registry import Limits, Registry
from tierd.state.tenants import Tenants, load_tokens
from tierd.transfer.cpu import CpuRankMemory
from tierd.transfer.cuda import detect as detect_cuda
from tierd.transfer.engine import TransferEngine


def open_pool(settings: Settings, cuda) -> Pool:
    return Pool(
        settings.ceiling_bytes,
        settings.initial_bytes,
        settings.l1_align_bytes,
        settings.l1_segment_mb << 20,
        pinner=cuda.pinner() if cuda else None,
        ns_quota_bytes=int(settings.namespace_quota_gb * (1 << 30)),
        eviction_log=settings.eviction_log,
        eviction_policy=settings.eviction_policy,
        grow_bytes=settings.l1_grow_mb << 20,
        grow_ahead=settings.l1_grow_ahead,
        pool_dir=settings.pool_dir,
        meta=warm.pool_meta(settings),
        index_dir=settings.pool_index_dir,
    )


def open_registry(settings: Settings, pool: Pool, xfer: TransferEngine) -> Registry:
    limits = Limits.from_settings(settings)
    return Registry(pool, xfer, settings.lease_ttl_s, settings.heartbeat_timeout_s, limits)


def open_tenants(settings: Settings, ipc: bool) -> Tenants:
    """Who a session acts as: on ipc:// the connection's user; on tcp:// a token's tenant."""
    tokens = load_tokens(settings.tcp_token_file) if settings.tcp_token_file else None
    return Tenants(not ipc, tokens, settings.insecure_tcp)


class MemoryOpener:
    """``(layout, peer) -> rank memory``: an engine's CPU shared memory (by path, or a descriptor
    handed over through ``inbox``) or its CUDA IPC mappings."""

    def __init__(self, settings: Settings, cuda, inbox):
        self.settings, self.cuda, self.inbox = settings, cuda, inbox

    def __call__(self, layout: PageLayout, peer: Peer):
        if layout.device == "cpu":
            claim = None
            if self.inbox is not None and peer.local:

                def claim(ticket, uid=peer.uid):
                    return self.inbox.claim(uid, ticket)

            return CpuRankMemory(layout, peer, self.refuse_own_file, claim)
        if not self.cuda:
            raise ProtocolError(
                ErrorCode.LAYOUT_INVALID, "a cuda layout was registered but this daemon has no CUDA"
            )
        return self.cuda.rank_memory(layout)

    def refuse_own_file(self, st: os.stat_result) -> str | None:
        """A client naming one of the pool's own files (--pool-dir under /dev/shm) is refused."""
        for folder in {self.settings.pool_dir, self.settings.pool_index_dir} - {None}:
            try:
                if os.stat(folder).st_dev != st.st_dev:
                    continue
                with os.scandir(folder) as entries:
                    if any(e.inode() == st.st_ino for e in entries):
                        return f"it is one of the daemon's own pool files (in {folder})"
            except OSError:
                continue
        return None


def connection_cap(settings: Settings) -> int:
    """--max-connections, or (0) a quarter of the descriptors this process may open, raised first
    to the hard limit: the rest is for shared-memory files, pool segments, the lookup channel and
    the fd inbox."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    cap = (1 << 20) if soft == resource.RLIM_INFINITY else max(64, soft // 4)
    return min(settings.max_connections, cap) if settings.max_connections else cap


def l2_families(status: dict):
    """The ``tierd_l2_*`` metric families of a /status (with --l2-url)."""
    from tierd.tier2.metrics import families

    return families(status.get("l2"))


def second_tier(settings: Settings, pool: Pool, registry: Registry):
    """Mooncake Store as L2 with --l2-url (the second tier imported only then), else None."""
    if not settings.l2_url:
        return None
    from tierd.tier2.bridge import SecondTier

    return SecondTier(settings, pool, registry)


def cuda_support(settings: Settings):
    """The CUDA data path when torch sees a GPU (and --cuda is not off), else None."""
    if settings.cuda == "off":
        return None
    return detect_cuda(settings)
