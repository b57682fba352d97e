"""deploy/prometheus and deploy/grafana stay what Prometheus and Grafana load: the rules pass
``promtool check rules`` and their own tests (``promtool test rules``: each alert fires on the
series it is about and not on its look-alikes); the dashboard is one Grafana can import, every
panel reads Prometheus through the dashboard's datasource variable, and its queries use only the
variables the dashboard defines. What the queries return from a real daemon and engine is
tests/e2e/test_e2e_serving_vllm_cpu.py's."""

from __future__ import annotations

import json
import re

import operate
import pytest


def need_promtool():
    if operate.binary("promtool") is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")


def test_the_rules_pass_promtool_check():
    need_promtool()
    r = operate.promtool("check", "rules", str(operate.RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 13 rules found" in r.stdout, r.stdout


def test_the_rules_pass_their_own_tests_and_each_alert_has_one():
    need_promtool()
    tested = set(re.findall(r"alertname: (\w+)", operate.RULE_TESTS.read_text()))
    alerts = {name for name, _ in operate.rule_exprs() if name[0].isupper()}
    assert alerts == tested, f"alerts without a test: {alerts - tested}"
    records = {name for name, _ in operate.rule_exprs() if not name[0].isupper()}
    assert all(f"expr: {r}\n" in operate.RULE_TESTS.read_text() for r in records), records
    r = operate.promtool("test", "rules", operate.RULE_TESTS.name, cwd=operate.RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboard_is_one_grafana_imports_and_its_queries_use_its_own_variables():
    dash = json.loads(operate.DASHBOARD.read_text())
    assert dash["uid"] == "tierd" and dash["schemaVersion"] >= 36
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "tierd_job", "instance", "model_name"}
    ps = operate.panels(dash)
    ids = [p["id"] for p in dash["panels"]] + [q["id"] for p in dash["panels"] for q in p.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in ps:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["description"] and set(p["gridPos"]) == {"h", "w", "x", "y"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    for title, ref, expr in operate.queries(dash):
        used = set(re.findall(r"\$\{?(\w+)", expr)) - {"__rate_interval"}
        assert used <= variables, f"{title} {ref} uses {used - variables}"
        assert "$" not in operate.as_sent(expr), (title, operate.as_sent(expr))
    titles = {p["title"] for p in ps}
    assert len(titles) == len(ps) >= 30, "panel titles repeat"  # the README describes each by title


def test_metric_names_are_read_from_promql_as_prometheus_would():
    expr = (
        'histogram_quantile(0.99, sum by (op, le) (rate(tierd_op_seconds_bucket{job="$tierd_job", '
        'op=~"LOOKUP|STORE"}[$__rate_interval]))) / on (op) group_left sum by (op) (vllm:x_total offset 5m)'
        " > 1e-3 and up == 0 or absent(tierd_sessions)"
    )
    assert operate.metric_names(expr) == {"tierd_op_seconds_bucket", "vllm:x_total", "up", "tierd_sessions"}


def test_the_readme_describes_every_panel_and_every_rule():
    text = (operate.ROOT / "README.md").read_text()
    section = text.split("### Watch it: Prometheus, Grafana and alerts", 1)[1].split("\n### ", 1)[0]
    section = " ".join(section.split())  # titles wrap across lines
    undescribed = [p["title"] for p in operate.panels() if f"*{p['title']}*" not in section]
    assert not undescribed, f"README's 'Watch it' does not describe the panels {undescribed}"
    unnamed = [name for name, _ in operate.rule_exprs() if f"`{name}`" not in section]
    assert not unnamed, f"README's 'Watch it' does not name the rules {unnamed}"
