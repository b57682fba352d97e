"""What an operator runs beside tierd, for the tests: a real Prometheus on loopback that scrapes a
daemon and a vLLM server and evaluates deploy/prometheus/tierd-rules.yml, promtool, and the
queries of deploy/grafana/tierd.json as Grafana would send them.

``prometheus`` and ``promtool`` are Debian's package (``apt-get install prometheus``); without
them ``binary`` says so and the tests that need them skip. The server listens on 127.0.0.1 only,
keeps its data in the test's folder and is stopped by ``close`` (SIGKILL if SIGTERM is not
enough); nothing of it outlives a run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tierd.tools.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "tierd-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tierd-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "tierd.json"
# the tierd job: scraped every 1.5 s with a 1.2 s timeout, so that a daemon holding its port without
# answering shows as a scrape that ran over 1 s (TierdHTTPStalled) and a dead one as a refused one
TIERD_SCRAPE = ("1500ms", "1200ms")


def binary(name: str) -> str | None:
    return shutil.which(name)


def missing_reason() -> str | None:
    absent = [b for b in ("prometheus", "promtool") if binary(b) is None]
    if absent:
        return f"{' and '.join(absent)} not installed (Debian: apt-get install prometheus)"
    return None


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary("promtool") or "promtool", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def live_rules(dest: Path) -> Path:
    """tierd-rules.yml with every ``for:`` at 0 (an alert fires at the first evaluation that finds
    its condition), so a short test sees alerts fire; the file's own durations are proven by
    ``promtool test rules``."""
    text = re.sub(r"^(\s+for:\s*)\S+", r"\g<1>0s", RULES.read_text(), flags=re.M)
    dest.write_text(text)
    return dest


class Prometheus:
    """``prometheus`` on a free loopback port: job ``tierd`` scrapes ``tierd_targets`` (host:port),
    job ``vllm`` the targets ``add_vllm`` writes to a file it watches; rules from ``rules``.
    ``preexec_fn`` runs in the child before it starts (a harness's die-with-parent)."""

    def __init__(self, folder: Path, tierd_targets: list[str], rules: Path | None = None, preexec_fn=None):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.port = free_port()
        self.vllm_targets = folder / "vllm-targets.json"
        self.vllm_targets.write_text("[]")
        interval, timeout = TIERD_SCRAPE
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)] if rules is not None else [],
            "scrape_configs": [
                {
                    "job_name": "tierd",
                    "scrape_interval": interval,
                    "scrape_timeout": timeout,
                    "static_configs": [{"targets": list(tierd_targets)}],
                },
                {
                    "job_name": "vllm",
                    "file_sd_configs": [{"files": [str(self.vllm_targets)], "refresh_interval": "1s"}],
                },
            ],
        }
        (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = folder / "prometheus.log"
        self._fh = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [
                binary("prometheus") or "prometheus",
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready in {timeout:.0f}s: {self.log_tail()}")

    def add_vllm(self, target: str) -> None:
        tmp = self.vllm_targets.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [target]}]))
        os.replace(tmp, self.vllm_targets)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return self.api("query", query=expr, **({"time": at} if at is not None else {}))["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def names(self) -> set[str]:
        """Every metric name Prometheus holds (scraped, or recorded by the rules)."""
        return set(self.api("label/__name__/values"))

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def firing(self, name: str) -> list[dict]:
        return [a for a in self.alerts() if a["labels"].get("alertname") == name and a["state"] == "firing"]

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            got = pred()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:.0f} s; prometheus log: {self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        if self._fh.closed:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._fh.close()

    stop = close  # (a harness stops what it started)


# ---- the dashboard's queries --------------------------------------------------------------------
def panels(dashboard: dict | None = None) -> list[dict]:
    """Every panel with queries, those inside collapsed rows included."""
    dash = dashboard if dashboard is not None else json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        out += [p, *p.get("panels", [])]
    return [p for p in out if p.get("targets")]


def queries(dashboard: dict | None = None) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query of the dashboard."""
    return [(p["title"], t["refId"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]


def as_sent(expr: str, rate_interval: str = "10s") -> str:
    """``expr`` with Grafana's variables as a dashboard of every instance and model sends it."""
    expr = expr.replace("$__rate_interval", rate_interval)
    expr = expr.replace("$tierd_job", "tierd")
    return re.sub(r"\$\{?(instance|model_name)\}?", ".*", expr)


def rule_exprs() -> list[tuple[str, str]]:
    """(rule name, expr) of every rule of tierd-rules.yml (read with the YAML parser of the venv)."""
    import yaml

    doc = yaml.safe_load(RULES.read_text())
    return [(r.get("alert") or r["record"], r["expr"]) for g in doc["groups"] for r in g["rules"]]


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
_KEYWORDS |= {"offset", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, keywords or labels)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', as_sent(expr))  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range durations
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"(?<![\w:.])\d[\d.]*(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*", " ", s)  # numbers, durations
    out = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end() :].lstrip().startswith("("):  # a function
            continue
        if m.group(0).lower() not in _KEYWORDS:
            out.add(m.group(0))
    return out


def series(text: str, name: str) -> dict[str, float]:
    """{label text: value} of the samples ``name`` in a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def exposed_names(text: str) -> set[str]:
    """Sample names of a Prometheus text exposition (``_bucket``/``_sum``/``_count`` included)."""
    out = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            out.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return out


def l2_panel(title: str) -> bool:
    """Panels of the second tier: they have data only from a daemon with --l2-url."""
    return title.startswith("L2 ")


def panel_data(prom: Prometheus, start: float, end: float, rate: str, which=lambda title: True):
    """Each dashboard query of the panels ``which`` picks, sent to ``prom`` over [start, end] as
    Grafana sends it (a range query): ({"title refId": (series, largest finite value)}, [queries
    with no finite value: no data])."""
    import math

    shown, empty = {}, []
    for title, ref, expr in queries():
        if not which(title):
            continue
        res = prom.query_range(as_sent(expr, rate), start, end, 2)
        values = [float(v) for s in res for _, v in s["values"] if math.isfinite(float(v))]
        if values:
            shown[f"{title} {ref}"] = (len(res), max(values))
        else:
            empty.append(f"{title} {ref}: {expr}")
    return shown, empty
