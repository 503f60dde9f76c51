"""deploy/prometheus and deploy/grafana: alert rules through promtool, and every
metric the rules and the dashboard query exported by a running daemon.

promtool is Prometheus' own checker (Debian package prometheus): ``check rules``
parses and type-checks every expression, ``test rules`` evaluates the alerts on
series over time. The same rules travel as a PrometheusRule; its spec goes
through promtool too, and must equal the plain file.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from tests.daemon_harness import metric_value, running_daemon, wait_for
from tests.workers import start_worker
from tests.deploy_tools import (
    DASHBOARD,
    K8S,
    RULES,
    RULES_TEST,
    exported,
    need_tool,
    promql_equality_matchers,
    promql_metric_names,
    yaml_docs,
)

# series the expressions may use that no ascendbind daemon exports, and why
FOREIGN = {
    "up": "written by Prometheus itself for every scrape target",
    "npu_chip_info_process_info_num": "Ascend NPU-Exporter: processes on each NPU",
}
# labels Prometheus adds to every series it scrapes (PodMonitor: job, instance, node)
TARGET_LABELS = {"job", "instance", "node"}


def _rules() -> list[dict]:
    return [r for g in yaml_docs(RULES)[0]["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_promql_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(ab_x_bucket{job="a", node=~"$node"}[$__rate_interval])))'
            ' / on (node) group_left ab_y_total offset 5m or vector(0) > bool 2 unless absent(up{a="b"})')
    assert promql_metric_names(expr) == {"ab_x_bucket", "ab_y_total", "up"}
    assert promql_equality_matchers(expr) == [("ab_x_bucket", "job", "a"), ("up", "a", "b")]
    assert promql_metric_names('label_values(ab_build_info{job="x"}, node)') == {"ab_build_info"}


def test_rules_pass_promtool_check_as_a_file_and_as_the_prometheusrule(tmp_path):
    promtool = need_tool("promtool")
    (rule,) = yaml_docs(K8S / "prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"] == yaml_docs(RULES)[0], "the PrometheusRule's spec differs from the rules file"
    extracted = tmp_path / "prometheusrule-spec.yml"
    extracted.write_text(yaml.safe_dump(rule["spec"]))
    for path in (RULES, extracted):
        r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and f"SUCCESS: {len(_rules())} rules found" in r.stdout, r.stdout + r.stderr


def test_rules_unit_tests_pass_and_cover_every_alert_firing_and_quiet():
    promtool = need_tool("promtool")
    r = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    cases = [c for t in yaml_docs(RULES_TEST)[0]["tests"] for c in t["alert_rule_test"]]
    for rule in _rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']} is never tested firing"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']} is never tested quiet"


def test_promtool_catches_a_broken_rule(tmp_path):
    promtool = need_tool("promtool")
    bad = tmp_path / "bad.yml"
    bad.write_text(RULES.read_text().replace("ascendbind_reasserts_total{", "ascendbind_reasserts_total{{", 1))
    r = subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    """The exposition of a real daemon that discovered its host, answered a bind attempt and
    holds a real worker (whose per-role and pool series exist only while one is bound)."""
    with running_daemon(str(tmp_path_factory.mktemp("metrics"))) as d, start_worker(plain=1, acl=1, release=1) as w:
        d.wait_discovered()
        d.curl("POST", "/v1/bind", {"pid": 999999999, "npu": 0})  # rejected: creates the API series too
        status, body = d.curl("POST", "/v1/bind", {"pid": w.pid, "npu": 0})
        assert status == 200, body
        yield d.metrics_text()


def _check_names(exprs: list[str], scrape_text: str, where: str) -> int:
    names, samples = exported(scrape_text)
    used = set()
    for expr in exprs:
        for name in promql_metric_names(expr):
            used.add(name)
            assert name in names or name in FOREIGN, f"{where}: {name} (in {expr!r}) is not exported by the daemon"
        for metric, label, value in promql_equality_matchers(expr):
            if metric in FOREIGN or label in TARGET_LABELS:
                continue
            assert any(n == metric and lbl.get(label) == value for n, lbl in samples), \
                f"{where}: no exported {metric} series has {label}={value!r}"
    return len(used)


def test_dashboard_queries_only_metrics_a_running_daemon_exports(scrape):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "ascendbind" and dash["panels"]
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
    assert _check_names(_dashboard_exprs(), scrape, "dashboard") >= 15


def test_alert_rules_query_only_metrics_a_running_daemon_exports(scrape):
    assert _check_names([r["expr"] for r in _rules()], scrape, "rules") >= 6


def _promtool_on_scrape(tmp_path, text: str, alert: str, fires: bool) -> subprocess.CompletedProcess:
    """promtool evaluates ``alert`` on a real scrape held constant for 30 minutes."""
    rules = yaml_docs(RULES)[0]
    for g in rules["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)  # the expressions are under test here, not the wording
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    target = {"job": "ascendbind", "instance": "10.0.0.9:9464", "node": "node-9"}
    series = []
    for name, labels in exported(text)[1]:
        value = metric_value(text, name, **labels)
        sel = ",".join(f'{k}="{v}"' for k, v in {**labels, **target}.items())
        series.append({"series": f"{name}{{{sel}}}", "values": f"{value:g}x30"})
    expected = [{"exp_labels": {**target, "severity": "critical"}}] if fires else []
    test = {"rule_files": ["rules.yml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "alert_rule_test": [{"eval_time": "25m", "alertname": alert, "exp_alerts": expected}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    return subprocess.run([need_tool("promtool"), "test", "rules", str(tmp_path / "test.yml")],
                          capture_output=True, text=True, timeout=120)


def _discovery_errors(text: str) -> float:
    return sum(metric_value(text, n, **lbl) for n, lbl in exported(text)[1] if n == "ascendbind_discovery_errors_total")


def test_discovery_alert_fires_on_a_real_failing_daemon_and_not_on_a_healthy_one(tmp_path, scrape):
    need_tool("promtool")
    (tmp_path / "ok").mkdir()
    quiet = _promtool_on_scrape(tmp_path / "ok", scrape, "AscendbindDiscoveryFailing", fires=False)
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    (tmp_path / "d").mkdir()
    with running_daemon(str(tmp_path / "d"), ASCENDBIND_NPU_SMI=str(tmp_path / "no-such-npu-smi")) as d:
        assert wait_for(lambda: _discovery_errors(d.metrics_text()) >= 1, 15), d.log()
        failing = d.metrics_text()
    (tmp_path / "bad").mkdir()
    fired = _promtool_on_scrape(tmp_path / "bad", failing, "AscendbindDiscoveryFailing", fires=True)
    assert fired.returncode == 0, fired.stdout + fired.stderr
