"""What the registry (tierd.state.registry) holds: sessions, registered ranks (instances), leases, and
the limits it counts them against. Plain records; the registry is their one owner.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierd.edge.peer import Peer
from tierd.pool.index import Obj
from tierd.protocol.layout import PageLayout
from tierd.state.planner import Geometry
from tierd.state.tenants import DEFAULT_TENANT, Principal

if TYPE_CHECKING:  # (cuda's imports torch)
    from tierd.transfer.cpu import CpuRankMemory
    from tierd.transfer.cuda import DirectRankMemory, StagedRankMemory


@dataclass(frozen=True)
class Limits:
    """Per-client caps (the --max-* flags); a request past one is answered LIMIT."""

    sessions_per_peer: int = 256
    instances_per_tenant: int = 1024
    files_per_tenant: int = 4096
    leases_per_session: int = 8192
    lease_share: float = 0.5  # of the pool's ceiling, per tenant

    @classmethod
    def from_settings(cls, s) -> Limits:
        return cls(
            s.max_sessions_per_peer,
            s.max_instances_per_tenant,
            s.max_files_per_tenant,
            s.max_leases_per_session,
            s.max_lease_share,
        )


OWNER = Principal(DEFAULT_TENANT, True, "uid:self")  # the daemon's own user: tests and tools
OWN_PEER = Peer(os.getuid(), os.getgid(), os.getpid())


def instance_key(tenant: str, name: str) -> str:
    """The registry's key (and copy lane) of instance ``name`` of ``tenant``: the name, and for any
    tenant but the default one a NUL and the tenant. A name holds no NUL (protocol.layout.Name), so
    no name of one tenant spells another tenant's key, as ``name@tenant`` did (the default tenant's
    instance ``r0@uid:5`` was tenant ``uid:5``'s ``r0``)."""
    return f"{name}\x00{tenant}" if tenant else name


@dataclass(eq=False)
class Instance:
    id: str  # the registry's key: the client's name, qualified by its tenant (instance_key)
    session: bytes
    layout: PageLayout
    ns: bytes  # namespace id
    memory: CpuRankMemory | StagedRankMemory | DirectRankMemory
    registered_at: float = field(default_factory=time.time)
    closed: bool = False
    geometry: Geometry | None = None  # the planner's per-layout constants, made on first use
    name: str = ""  # as the client named it
    tenant: str = DEFAULT_TENANT

    @property
    def label(self) -> str:
        """How logs name it: its name, and its tenant unless that is the default one."""
        return f"{self.name} (tenant {self.tenant})" if self.tenant else self.name

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
    principal: Principal = OWNER
    peer: Peer = OWN_PEER  # the kernel's credentials of the connection (none on tcp://)

    @property
    def tenant(self) -> str:
        return self.principal.tenant

    @property
    def uid(self) -> int:
        return self.peer.uid


@dataclass(eq=False)
class Lease:
    id: int
    session: bytes
    objs: list[Obj]
    pending_ranks: set[int]
    expires: float
    tenant: str = DEFAULT_TENANT
