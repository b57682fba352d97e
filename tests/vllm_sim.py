"""vLLM's real Scheduler driving TierdConnector in both roles, with a simulated forward.

The scheduler, its KV cache manager, block pool and request objects are vLLM's own; only the
model is simulated: a "forward" writes, for every scheduled token, bytes derived from the token
id and its position into exactly the slot vLLM's block table gives it (and, for recurrent
groups, a state derived from the whole prefix into the state block). Tests can then check that
what a load restored is byte for byte what a forward would have written.

As in vLLM's hybrid allocator, layer ``i`` of every attention group with the same page shape
shares one tensor (block ``b`` of any group is the same page), so a block id freed by one group
and handed to another aliases the memory a pending store may still read.

Every forward checks the invariant a real model depends on (``stale_reads``): each position the
attention of a scheduled token reads (full: all before it; sliding: its window; recurrent: the
state at the request's first computed token) holds exactly what a forward of that token wrote.
A violation raises at once, naming the request, group, layer, position and block.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

import numpy as np
import torch

TOK_BYTES = 8  # bytes of KV per token per layer in the simulated cache
STATE_BYTES = 32


@dataclass
class GroupDef:
    kind: str  # "full" | "sliding" | "mamba"
    layers: int = 2
    block_size: int = 16
    window: int = 0
    extra: int = 0  # sliding: vLLM's extra_retained_tokens (multi-module speculative decoding)


def token_bytes(token: int, pos: int, layer: int) -> np.ndarray:
    base = (token * 1315423911 + pos * 2654435761 + layer * 97) & 0xFFFFFFFF
    return np.frombuffer(np.array([base, base ^ 0x5BD1E995], dtype=np.uint32).tobytes(), dtype=np.int8)


def tokens_bytes(tokens, positions, layer: int) -> np.ndarray:
    """``token_bytes`` of many (token, position) pairs at once: [n, TOK_BYTES] int8."""
    t = np.asarray(tokens, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    base = (t * np.uint64(1315423911) + p * np.uint64(2654435761) + np.uint64(layer * 97)) & np.uint64(
        0xFFFFFFFF
    )
    pair = np.stack([base, base ^ np.uint64(0x5BD1E995)], axis=1).astype(np.uint32)
    return pair.view(np.int8).reshape(len(t), TOK_BYTES)


def state_bytes(tokens: list[int], layer: int) -> np.ndarray:
    h = hashlib.blake2b(
        np.asarray(tokens, dtype=np.int64).tobytes() + bytes([layer]), digest_size=STATE_BYTES
    )
    return np.frombuffer(h.digest(), dtype=np.int8)


def make_specs(groups: list[GroupDef]):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    specs = []
    for g in groups:
        if g.kind == "full":
            specs.append(
                FullAttentionSpec(
                    block_size=g.block_size, num_kv_heads=1, head_size=TOK_BYTES // 4, dtype=torch.int8
                )
            )
        elif g.kind == "sliding":
            specs.append(
                SlidingWindowSpec(
                    block_size=g.block_size,
                    num_kv_heads=1,
                    head_size=TOK_BYTES // 4,
                    dtype=torch.int8,
                    sliding_window=g.window,
                    extra_retained_tokens=g.extra,
                )
            )
        elif g.kind == "mamba":
            specs.append(
                MambaSpec(
                    block_size=g.block_size,
                    shapes=((STATE_BYTES,),),
                    dtypes=(torch.int8,),
                    mamba_cache_mode="align",
                )
            )
        else:
            raise ValueError(g.kind)
    return specs


def make_vllm_config(
    model_dir: str,
    url: str,
    block_size: int,
    chunk_tokens: int | None,
    *,
    max_batched: int = 256,
    extra: dict | None = None,
    mamba: bool = False,
    spec_tokens: int = 0,
    kv_events: dict | None = None,
):
    """vLLM's own config objects for a CPU engine with TierdConnector (no model is loaded)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    mc = ModelConfig(model=model_dir, dtype="bfloat16", seed=0, max_model_len=4096, skip_tokenizer_init=True)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_batched,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
        **({"mamba_cache_mode": "align"} if mamba else {}),
    )
    cfg_extra = {
        "tierd.url": url,
        **({"tierd.chunk_tokens": chunk_tokens} if chunk_tokens is not None else {}),  # None: unset
        "tierd.timeout_s": 5,
        "tierd.lookup_timeout_s": 2,
        **(extra or {}),
    }
    kvt = KVTransferConfig(
        kv_connector="TierdConnector",
        kv_connector_module_path="tierd_client.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=cfg_extra,
        engine_id=uuid.uuid4().hex,
    )
    spec = {}
    if spec_tokens:
        from vllm.config import ParallelConfig, SpeculativeConfig

        spec["speculative_config"] = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=spec_tokens,
            prompt_lookup_max=4,
            prompt_lookup_min=2,
            target_model_config=mc,
            target_parallel_config=ParallelConfig(),
        )
    if kv_events is not None:  # KVEventsConfig fields, e.g. {"enable_kv_cache_events": True, "endpoint": ...}
        from vllm.config import KVEventsConfig

        spec["kv_events_config"] = KVEventsConfig(**kv_events)
    return VllmConfig(
        scheduler_config=sc,
        model_config=mc,
        cache_config=cc,
        kv_transfer_config=kvt,
        device_config=DeviceConfig("cpu"),
        **spec,
    )


class SimEngine:
    """One scheduler + one worker connector (TP=1) over simulated KV tensors."""

    def __init__(
        self,
        model_dir: str,
        url: str,
        groups: list[GroupDef],
        *,
        num_blocks: int = 256,
        chunk_tokens: int | None = 64,
        max_batched: int = 256,
        extra: dict | None = None,
        spec_tokens: int = 0,
        spec_accept: int = 0,
        share_pages: bool = True,
        kv_events: dict | None = None,
        retention: int | None = None,
    ):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from tierd_client.vllm_connector import TierdConnector

        self.groups = groups
        self.block_size = groups[0].block_size
        # speculative decoding: each decode step proposes spec_tokens drafts, the first
        # spec_accept of them right (accepted), the rest wrong (rejected, their KV garbage)
        self.spec_tokens, self.spec_accept = spec_tokens, spec_accept
        self.vllm_config = vc = make_vllm_config(
            model_dir,
            url,
            self.block_size,
            chunk_tokens,
            max_batched=max_batched,
            extra=extra,
            mamba=any(g.kind == "mamba" for g in groups),
            spec_tokens=spec_tokens,
            kv_events=kv_events,
        )
        specs = make_specs(groups)
        self.layer_names = [[f"g{gi}.layer{l}" for l in range(g.layers)] for gi, g in enumerate(groups)]
        kcc = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in zip(self.layer_names, specs)],
            prefix_cache_retention_interval=retention,  # vLLM's engine: its --prefix-cache-retention-interval
        )
        vc.cache_config.num_gpu_blocks = num_blocks
        self.kv_cache_config = kcc
        self.worker = TierdConnector(vc, KVConnectorRole.WORKER, kcc)
        # simulated KV: per group per layer a [num_blocks, block_size, TOK_BYTES] (or state) int8 tensor;
        # layer i of attention groups of one block size share a tensor, as vLLM's hybrid allocator does
        self.kv: dict[str, torch.Tensor] = {}
        shared: dict[tuple, torch.Tensor] = {}
        for gi, g in enumerate(groups):
            for li, name in enumerate(self.layer_names[gi]):
                shape = (
                    (num_blocks, STATE_BYTES) if g.kind == "mamba" else (num_blocks, g.block_size, TOK_BYTES)
                )
                key = (shape, li) if g.kind != "mamba" and share_pages else (name,)
                if key not in shared:
                    shared[key] = torch.zeros(shape, dtype=torch.int8)
                self.kv[name] = shared[key]
        self.worker.register_kv_caches(self.kv)
        # vLLM's EngineCore builds its scheduler only now, after the workers registered their KV
        # caches, and schedules requests at once (the order a restarted engine meets the tier in)
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=self.block_size,
        )
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, TierdConnector)
        self.finished: dict[str, object] = {}
        self.failed_loads: set[str] = set()
        self.computed: dict[str, list[tuple[int, int]]] = {}  # req -> [(start, n)] the forward ran
        self.block_ids: dict[str, list[list[int]]] = {}  # req -> its block table at its first forward
        self.steps = 0
        self.reads_checked = 0  # positions stale_reads verified (a test can assert it did work)
        self.connector_stats: list[dict] = []  # each step's kv_connector_stats, as vLLM's loggers get it
        self.on_forward = None

    # ---- requests ----------------------------------------------------------------------------------
    def add(
        self,
        req_id: str,
        tokens: list[int],
        max_tokens: int = 4,
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )
        req = Request(
            request_id=req_id,
            prompt_token_ids=list(tokens),
            sampling_params=sp,
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(self.block_size, sha256),
        )
        self.scheduler.add_request(req)
        return req

    # ---- the loop ----------------------------------------------------------------------------------
    def step(self, after_schedule=None):
        """One engine step; ``after_schedule(so)`` runs between scheduling and the worker side
        (where a failure can be injected between a LOOKUP and its RETRIEVE)."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        if after_schedule is not None:
            after_schedule(so)
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        self._forward(so)
        w.start_load_kv(None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        kv_events = w.get_kv_connector_kv_cache_events()  # as vLLM's model runner does, after the forward
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        self.failed_loads |= res.failed_recving
        if wmeta is not None:
            self.failed_loads |= wmeta.failed_loads
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            done_prefill = req.num_computed_tokens - len(drafts) >= req.num_tokens
            n_out = len(req.output_token_ids)
            ok = 0
            while ok < len(drafts) and drafts[ok] == self.true_token(n_out + ok):
                ok += 1
            sampled.append([self.true_token(n_out + i) for i in range(ok + 1)] if done_prefill else [])
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(
                finished_sending=res.finished_sending,
                finished_recving=res.finished_recving,
                failed_recving=res.failed_recving,
                invalid_block_ids=invalid,
                kv_cache_events=kv_events,
                kv_connector_worker_meta=wmeta,
                kv_connector_stats=w.get_kv_connector_stats(),  # as vLLM's model runner does
            ),
        )
        engine_out = self.scheduler.update_from_output(so, out)
        for outs in engine_out.values():
            if outs.scheduler_stats is not None and outs.scheduler_stats.kv_connector_stats:
                self.connector_stats.append(outs.scheduler_stats.kv_connector_stats)
        if self.spec_tokens:
            from vllm.v1.outputs import DraftTokenIds

            live = [r for r in req_ids if r in self.scheduler.requests]
            drafts = []
            for r in live:
                n_out = len(self.scheduler.requests[r].output_token_ids)
                drafts.append(
                    [
                        self.true_token(n_out + i) if i < self.spec_accept else 3
                        for i in range(self.spec_tokens)
                    ]
                )
            self.scheduler.update_draft_token_ids(DraftTokenIds(live, drafts))
        for outs in engine_out.values():
            for o in outs.outputs:
                if o.finished:
                    self.finished[o.request_id] = o
        self.steps += 1
        return so

    @staticmethod
    def true_token(n_out: int) -> int:
        """The token the simulated model samples as output number ``n_out``."""
        return 7 + n_out

    def run(self, max_steps: int = 500, idle_sleep: float = 0.002, after_schedule=None):
        import time

        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                self.flush()
                return
            so = self.step(after_schedule)
            if not so.num_scheduled_tokens:
                time.sleep(idle_sleep)  # waiting for a load: let the daemon answer
        raise AssertionError(
            f"requests still unfinished after {max_steps} steps: {[r for r in self.scheduler.requests]}"
        )

    def _forward(self, so):
        """Write what a model would, then check what its attention read (``stale_reads``)."""
        if self.on_forward is not None:
            self.on_forward(so)  # a test's look at the KV before this forward writes it
        self._write(so)
        bad = self.stale_reads(so)
        if bad:
            raise AssertionError(
                f"step {self.steps}: {len(bad)} positions read stale KV, first "
                f"(request, group, layer, position, block): {bad[:6]}"
            )

    def stale_reads(self, so) -> list[tuple]:
        """Positions this step's attention reads that do not hold their token's bytes. Checked after
        the step's writes: a request may read KV another request writes in the same forward (vLLM
        caches a block as soon as it is scheduled), and those bytes are the same."""
        bad = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)
            tokens = list(req.all_token_ids)
            # a forward that (re)starts the request: its first, or one after a preemption
            first = start < max((s + m for s, m in self.computed[rid][:-1]), default=start + 1)
            for gi, g in enumerate(self.groups):
                for li, name in enumerate(self.layer_names[gi]):
                    kv = self.kv[name].numpy()
                    if g.kind == "mamba":
                        if first and start > 0:  # the state the first computed token continues from
                            b = ids[gi][(start - 1) // g.block_size]
                            self.reads_checked += 1
                            if not np.array_equal(kv[b], state_bytes(tokens[:start], li)):
                                bad.append((rid, gi, li, f"state@{start}", b))
                        continue
                    # sliding: the window, and the tokens vLLM keeps below it for a drafter's re-prefill
                    lo = 0 if g.kind == "full" else max(0, start - g.window + 1 - g.extra)
                    pos = np.arange(lo, min(start, len(tokens)))
                    if not len(pos):
                        continue
                    blocks = np.asarray(ids[gi])[pos // g.block_size]
                    got = kv[blocks, pos % g.block_size]
                    want = tokens_bytes(np.asarray(tokens)[pos], pos, li)
                    self.reads_checked += len(pos)
                    for i in np.flatnonzero((got != want).any(axis=1))[:8]:
                        bad.append((rid, gi, li, int(pos[i]), int(blocks[i])))
        return bad

    def _write(self, so):
        """Per token its bytes, per recurrent group the prefix state."""
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # num_computed_tokens was advanced at schedule time
            self.computed.setdefault(rid, []).append((start, n))
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)
            self.block_ids.setdefault(rid, [list(x) for x in ids])
            tokens = list(req.all_token_ids) + list(so.scheduled_spec_decode_tokens.get(rid, []))
            for gi, g in enumerate(self.groups):
                for li, name in enumerate(self.layer_names[gi]):
                    kv = self.kv[name].numpy()
                    if g.kind == "mamba":
                        end = start + n
                        if end % g.block_size == 0 or end == len(tokens):
                            kv[ids[gi][(end - 1) // g.block_size]] = state_bytes(tokens[:end], li)
                        continue
                    for p in range(start, min(start + n, len(tokens))):
                        kv[ids[gi][p // g.block_size], p % g.block_size] = token_bytes(tokens[p], p, li)

    # ---- checks ------------------------------------------------------------------------------------
    def expected_block(self, gi: int, layer: int, tokens: list[int], block_index: int) -> np.ndarray:
        g = self.groups[gi]
        if g.kind == "mamba":
            return state_bytes(tokens[: (block_index + 1) * g.block_size], layer)
        return np.stack(
            [
                token_bytes(tokens[p], p, layer)
                for p in range(block_index * g.block_size, (block_index + 1) * g.block_size)
            ]
        )

    def first_computed(self, rid: str) -> int:
        """Position of the first token the forward computed for ``rid`` (the hit before it)."""
        return self.computed[rid][0][0]

    def assert_restored(self, rid: str, tokens: list[int], upto: int) -> None:
        """KV of positions [0, upto) in rid's blocks equals what a forward writes, in every group
        (full: every block; sliding: the blocks in the window before ``upto``; mamba: the state at
        ``upto``)."""
        ids = self.block_ids[rid]
        for gi, g in enumerate(self.groups):
            for li, name in enumerate(self.layer_names[gi]):
                kv = self.kv[name].numpy()
                if g.kind == "mamba":
                    idx = upto // g.block_size - 1
                    np.testing.assert_array_equal(kv[ids[gi][idx]], self.expected_block(gi, li, tokens, idx))
                    continue
                first = 0 if g.kind == "full" else max(0, (upto - g.window + 1) // g.block_size)
                for b in range(first, upto // g.block_size):
                    np.testing.assert_array_equal(
                        kv[ids[gi][b]],
                        self.expected_block(gi, li, tokens, b),
                        err_msg=f"group {gi} layer {li} block {b}",
                    )

    def flush(self):
        """Wait for the stores this engine sent (a real engine does not need to)."""
        self.worker.worker.flush()

    def close(self):
        if not getattr(self, "_closed", False):
            self._closed = True
            self.worker.shutdown()
            self.connector.shutdown()
