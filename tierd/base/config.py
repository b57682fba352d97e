"""One settings object for the daemon. Each field's ``help`` is the CLI help (tierd serve --help)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from tierd.base.l2url import parse_url
from tierd.protocol.sockets import default_socket

GIB = 1 << 30


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class Settings:
    l1_size_gb: float = _opt(
        8.0, "Ceiling of the host pool in GiB; memory is backed only as objects arrive.", min=0.001
    )
    l1_init_size_gb: float = _opt(
        0.0, "Host memory backed (and pinned on CUDA hosts) at start, in GiB.", min=0.0
    )
    l1_align_bytes: int = _opt(4096, "Alignment of every object in bytes; a power of two.", min=64)
    l1_segment_mb: int = _opt(
        1024,
        "Largest step the pool grows by, in MiB: a segment, one memory mapping and, on CUDA hosts, one "
        "pinned registration. A larger object gets a segment of its own while the ceiling allows.",
        min=1,
    )
    l1_grow_mb: int = _opt(
        64,
        "Smallest step the pool grows by, in MiB: a new segment is as large as the pool already is, "
        "from this up to --l1-segment-mb (a first 1 MiB object backs 64 MiB).",
        min=1,
    )
    l1_grow_ahead: bool = _opt(
        True,
        "Once the pool has grown on demand, back the next steps' memory on threads of their own before "
        "it is needed (one step ahead, one more each time a burst of stores outran it, at most 8, under "
        "the ceiling), so a growth holds no request; off: each step is backed when a store needs it, on "
        "the daemon's main loop.",
    )
    socket: str = _opt(
        None,
        "ZeroMQ endpoint to bind: ipc://PATH (default under $XDG_RUNTIME_DIR or /tmp) or tcp://HOST:PORT.",
    )
    socket_mode: str = _opt("0600", "File mode of the ipc:// socket file, octal.")
    http_host: str = _opt("127.0.0.1", "Address the HTTP endpoints (/status, /metrics, /healthz) listen on.")
    http_port: int = _opt(
        9800, "Port of the HTTP endpoints; 0 picks a free port (logged), -1 disables HTTP.", min=-1, max=65535
    )
    http_timeout_s: float = _opt(
        5.0,
        "Seconds an HTTP connection has to send its request line and "
        "headers (idle and slow ones are closed); also the most one write of a "
        "reply may block.",
        min=0.1,
    )
    http_max_connections: int = _opt(
        64,
        "HTTP connections open at once (each a file descriptor; 4 threads "
        "answer them); when full, the oldest still sending its request is "
        "closed.",
        min=1,
    )
    null_block_id: int = _opt(-1, "Block id meaning 'no data for this group in this chunk'.")
    separate_object_groups: bool = _opt(
        True,
        "Store each engine group of a chunk as its own object (on), or all groups of a rank as one "
        "object (off).",
    )
    workers: int = _opt(
        0, "Copy threads shared by every rank's copy lane; 0: two per CPU core, 16 to 64.", min=0, max=1024
    )
    heartbeat_timeout_s: float = _opt(
        30.0,
        "Seconds without a message after which a client is dead: its leases and registrations go.",
        min=0.1,
    )
    lease_ttl_s: float = _opt(
        60.0, "Seconds a LOOKUP lease keeps its objects from eviction unless released or consumed.", min=0.1
    )
    max_frame_mb: int = _opt(
        16, "Largest request frame accepted, in MiB; larger ones get a TOO_LARGE error.", min=1
    )
    log_level: str = _opt("info", "Log level.", choices=("debug", "info", "warning", "error"))
    eviction_log: int = _opt(
        65536,
        "Chunks evicted from the pool the daemon remembers for EVICTED (the "
        "connectors' router events); 0 keeps none (EVICTED then only says 'missed').",
        min=0,
        max=1 << 24,
    )
    lookup_channel: bool = _opt(
        True,
        "Serve LOOKUP and PING on a Unix seqpacket socket next to the ipc:// socket "
        "(PATH.lookup) as well: a round trip without ZeroMQ's I/O threads.",
    )
    busy_poll_us: int = _opt(
        0,
        "After a request, poll without sleeping for this many microseconds before the main loop "
        "sleeps: a request that comes meanwhile (the next LOOKUP of a scheduler step) skips the "
        "wakeup of a sleeping process (benchmarks/lookup_latency.py --busy-poll-us). Costs at most "
        "this much CPU per burst of requests; 0: sleep at once.",
        min=0,
        max=10000,
    )
    lookup_settle_objects: int = _opt(
        256,
        "A LOOKUP's bookkeeping (the eviction order's touch of what it found, its lease's pins) is "
        "applied after its reply while no request waits, this many objects at a time, so the next "
        "request waits for one part at most (benchmarks/lookup_settle.py); 0: all of it right after "
        "each reply, before the next request is read.",
        min=0,
        max=1 << 20,
    )
    drop_on_disconnect: bool = _opt(
        True,
        "Drop a client's session (its leases and registered ranks) as soon "
        "as its connection closes, not only after --heartbeat-timeout-s of "
        "silence.",
    )
    # ---- tenants and per-client limits (docs/protocol.md section 21) ----
    tcp_token_file: str = _opt(
        None,
        "File of 'TENANT TOKEN' lines: a tcp:// client's HELLO must carry one of the "
        "tokens and acts as that tenant (TENANT 'admin' is an operator).",
    )
    insecure_tcp: bool = _opt(
        False,
        "Accept tcp:// clients without a token, all as the daemon's own tenant with "
        "operator rights (trusted networks only).",
    )
    max_sessions_per_peer: int = _opt(
        256,
        "Sessions one user (uid; on tcp:// one tenant) may hold at once; "
        "twice as many connections (more are closed at once).",
        min=1,
    )
    max_connections: int = _opt(
        0,
        "Client connections at once (each holds a file descriptor); more are closed "
        "at once. 0: a quarter of the daemon's descriptor limit (raised to its hard limit "
        "at start).",
        min=0,
    )
    max_instances_per_tenant: int = _opt(1024, "Ranks one tenant may have registered at once.", min=1)
    max_files_per_tenant: int = _opt(
        4096,
        "Shared-memory files one tenant's registered ranks may hold open "
        "(each file is opened once per rank, whatever the number of its tensors).",
        min=1,
    )
    max_leases_per_session: int = _opt(8192, "LOOKUP leases one session may hold at once.", min=1)
    max_lease_share: float = _opt(
        0.5, "Largest share of the pool's ceiling one tenant's leases may pin, 0..1.", min=0.0, max=1.0
    )
    eviction_policy: str = _opt(
        "reuse",
        "What pool pressure evicts first: reuse (least recently used, but an object LOOKUPs found "
        "before lives longer, by the reuse distance the pool measures; tierd.pool.policy) or lru "
        "(least recently used). Either takes a prefix's tail before its head and never a leased object.",
        choices=("reuse", "lru"),
    )
    namespace_quota_gb: float = _opt(
        0.0,
        "Most pool memory one namespace may fill, in GiB; 0: no quota. A namespace "
        "at its quota evicts its own least recently used objects, never another's.",
        min=0.0,
    )
    cuda: str = _opt(
        "auto",
        "GPU data path: auto (when torch sees a GPU) or off (CPU layouts only).",
        choices=("auto", "off"),
    )
    # ---- second tier (docs/protocol.md section 22) ----
    l2_url: str = _opt(
        None,
        "Second tier on Mooncake Store: mooncake://MASTER[:PORT]?metadata=URL"
        "&protocol=tcp&local=HOST[:PORT]&segment_gb=N&... (docs/protocol.md section 22); "
        "unset: L1 only.",
    )
    l2_policy: str = _opt(
        "write-back",
        "When L1 objects go to L2: write-back (the coldest, before L1 evicts "
        "them) or write-through (each as its STORE commits: other nodes see it at once).",
        choices=("write-back", "write-through"),
    )
    l2_backlog_mb: int = _opt(
        256,
        "MiB of L1 objects waiting for their put to L2, at most; write-back also "
        "keeps this much of L1's cold end written to L2 once L1 is that close to full.",
        min=1,
    )
    l2_lookup_timeout_ms: int = _opt(
        250,
        "How long a LOOKUP waits for L2 to say what it holds; past it the LOOKUP is answered from L1 alone.",
        min=1,
        max=60000,
    )
    pool_dir: str = _opt(
        None,
        "Folder on tmpfs or hugetlbfs whose files hold the pool, so that a restarted "
        "daemon serves what the last one held (warm restart); default: process memory, "
        "lost at exit.",
    )
    pool_index_dir: str = _opt(
        None,
        "Folder on tmpfs for the pool's index and commit journal (default: "
        "--pool-dir); required when --pool-dir is on hugetlbfs.",
    )

    def __post_init__(self):
        if self.socket is None:
            self.socket = default_socket()
        for f in fields(self):
            value = getattr(self, f.name)
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            if lo is not None and value < lo:
                raise ValueError(f"--{_flag(f.name)} must be >= {lo}, got {value}")
            if hi is not None and value > hi:
                raise ValueError(f"--{_flag(f.name)} must be <= {hi}, got {value}")
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ValueError(f"--{_flag(f.name)} must be one of {', '.join(choices)}, got {value!r}")
        if self.l1_align_bytes & (self.l1_align_bytes - 1):
            raise ValueError(f"--l1-align-bytes must be a power of two, got {self.l1_align_bytes}")
        if self.l1_init_size_gb > self.l1_size_gb:
            raise ValueError(
                f"--l1-init-size-gb ({self.l1_init_size_gb}) cannot exceed --l1-size-gb ({self.l1_size_gb})"
            )
        for name in ("pool_dir", "pool_index_dir", "tcp_token_file"):
            if getattr(self, name) == "":
                raise ValueError(f"--{_flag(name)} must name a path, got ''")
        if self.pool_index_dir is not None and self.pool_dir is None:
            raise ValueError("--pool-index-dir needs --pool-dir (it holds the index of a pool kept in files)")
        if not (self.socket.startswith("ipc://") or self.socket.startswith("tcp://")):
            raise ValueError(f"--socket must start with ipc:// or tcp://, got {self.socket!r}")
        if self.socket.startswith("tcp://") and not (self.tcp_token_file or self.insecure_tcp):
            raise ValueError(
                "a tcp:// --socket has no kernel credentials to tell tenants apart: give "
                "--tcp-token-file (tenant tokens) or --insecure-tcp (every client trusted)"
            )
        if self.tcp_token_file is not None and not self.socket.startswith("tcp://"):
            raise ValueError(
                "--tcp-token-file is for a tcp:// --socket (ipc:// clients are told apart by uid)"
            )
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise ValueError(f"--socket-mode must be octal like 0600, got {self.socket_mode!r}") from None
        if not 0 <= mode <= 0o777:
            raise ValueError(f"--socket-mode must be between 0000 and 0777, got {self.socket_mode}")
        if self.l2_url is not None:
            try:
                parse_url(self.l2_url)
            except ValueError as exc:
                raise ValueError(f"--l2-url: {exc}") from None

    @property
    def ceiling_bytes(self) -> int:
        return int(self.l1_size_gb * GIB)

    @property
    def initial_bytes(self) -> int:
        return int(self.l1_init_size_gb * GIB)

    @property
    def socket_file(self) -> str | None:
        return self.socket[len("ipc://") :] if self.socket.startswith("ipc://") else None

    @property
    def max_frame_bytes(self) -> int:
        return self.max_frame_mb << 20

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _flag(name: str) -> str:
    return name.replace("_", "-")
