"""deploy/monitoring: the Grafana dashboard's queries and the Prometheus alerts, run by a real
Prometheus that scrapes a real deployment, so that a renamed metric or a broken query fails
here rather than on an operator's dashboard or pager."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest

from pdserve.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MONITORING = os.path.join(REPO, "deploy", "monitoring")
DASHBOARD = os.path.join(MONITORING, "grafana-dashboard.json")
ALERTS = os.path.join(MONITORING, "pdserve-alerts.yml")

needs_prometheus = pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("promtool")),
    reason="Prometheus is not installed (apt-get install prometheus; .ci/run does)",
)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query, with Grafana's variables as a scrape of all models would have them."""
    out = []
    for panel in json.load(open(DASHBOARD))["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$model_name", ".*").replace("$__rate_interval", "1m")
            out.append((panel["title"], expr))
    return out


def metric_names(expr: str) -> set[str]:
    """The pdserve families a query reads (histogram series named by their family)."""
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"pdserve:[a-z0-9_]+", expr)}


def test_the_dashboard_is_grafana_json_with_a_query_in_every_panel():
    d = json.load(open(DASHBOARD))
    graphs = [p for p in d["panels"] if p["type"] != "row"]
    assert len(graphs) >= 15 and all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in graphs)
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "model_name"}


@needs_prometheus
def test_promtool_accepts_the_alerting_rules():
    r = subprocess.run(["promtool", "check", "rules", ALERTS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_prometheus
def test_the_alerts_fire_when_they_should_and_not_otherwise(tmp_path):
    """promtool's rule tests on synthetic series: a pool with no live worker pages, one sized to
    zero on purpose does not; unsigned calls counted by the front alone fire; a request the
    front gave up on pages."""
    import yaml

    rules = {r["alert"]: r for g in yaml.safe_load(open(ALERTS))["groups"] for r in g["rules"]}

    def fired(name: str, **labels) -> dict:
        r = rules[name]
        notes = {k: v.replace("{{ $labels.role }}", labels.get("role", "")) for k, v in r["annotations"].items()}
        return {"exp_labels": {**r["labels"], **labels}, "exp_annotations": notes}

    series = {
        'pdserve:workers_alive{role="decode"}': "1 1 0 0 0 0 0",
        'pdserve:pool_wanted_workers{role="decode"}': "1x6",
        'pdserve:workers_alive{role="prefill"}': "0x6",  # sized to zero: decode workers run whole requests
        'pdserve:pool_wanted_workers{role="prefill"}': "0x6",
        "pdserve:front_internal_auth_refused_total": "0 0 3 3 3 3 3",
        "pdserve:internal_auth_refused_total": "0x6",
        "pdserve:front_requests_failed_total": "0 0 0 1 1 1 1",
    }
    checks = [
        ("1m", "PdserveNoLiveWorker", []),
        ("6m", "PdserveNoLiveWorker", [fired("PdserveNoLiveWorker", role="decode")]),
        ("1m", "PdserveInternalCallsRefused", []),
        ("3m", "PdserveInternalCallsRefused", [fired("PdserveInternalCallsRefused")]),
        ("4m", "PdserveFrontGaveUp", [fired("PdserveFrontGaveUp")]),
    ]
    spec = {
        "rule_files": [ALERTS],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in series.items()],
                "alert_rule_test": [{"eval_time": t, "alertname": a, "exp_alerts": e} for t, a, e in checks],
            }
        ],
    }
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(spec))
    r = subprocess.run(["promtool", "test", "rules", str(tmp_path / "alerts_test.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_prometheus
@pytest.mark.integration
def test_prometheus_scrapes_a_deployment_and_every_query_and_rule_evaluates(tiny_model_dir, tmp_path):
    from tests.server.deployment import Deployment

    dep = Deployment(tiny_model_dir, "--served-model-name", "tiny")
    prom = None
    try:
        for _ in range(4):
            assert dep.complete(6).status_code == 200
        exported = {
            re.sub(r"_(bucket|sum|count)$", "", line.split("{")[0].split(" ")[0])
            for line in httpx.get(dep.url + "/metrics", timeout=5).text.splitlines()
            if line.startswith("pdserve:")
        }
        # every family the dashboard and the alerts read is one the router exports
        read = set().union(*(metric_names(e) for _, e in dashboard_queries()), metric_names(open(ALERTS).read()))
        assert read - exported == set(), f"not exported: {read - exported}"

        port = free_port()
        host = dep.url.removeprefix("http://")
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{json.dumps(ALERTS)}]\n"
            "scrape_configs:\n"
            f"  - {{job_name: pdserve, metrics_path: /metrics, static_configs: [{{targets: [{json.dumps(host)}]}}]}}\n"
        )
        prom = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "prometheus.log", "w"),
        )
        api = f"http://127.0.0.1:{port}/api/v1"

        def query(expr: str) -> dict:
            r = httpx.get(api + "/query", params={"query": expr}, timeout=10)
            assert r.status_code == 200, (expr, r.text)
            return r.json()["data"]

        deadline = time.monotonic() + 60
        while True:  # a few scrapes, a request in between, so that rates have two points
            try:
                if (
                    len(query('count_over_time(up{job="pdserve"}[1m])')["result"])
                    and float(query('count_over_time(up{job="pdserve"}[1m])')["result"][0]["value"][1]) >= 4
                ):
                    break
            except (httpx.HTTPError, AssertionError, KeyError, IndexError):
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            dep.complete(4)
            time.sleep(0.5)
        assert float(query('up{job="pdserve"}')["result"][0]["value"][1]) == 1
        empty = []
        for title, expr in dashboard_queries():
            if not query(expr)["result"]:
                empty.append(title)
        # what has happened by now has a value: latencies, load, KV, workers, transfers
        must = {
            "Time to first token",
            "Inter-token latency",
            "Requests finished, by reason / refused",
            "Tokens per second",
            "KV cache usage",
            "KV transfer time per request",
            "Workers alive / wanted",
            "P:D ratio: recommended by the router",
        }
        assert must.isdisjoint(empty), empty
        rules = httpx.get(api + "/rules", timeout=10).json()["data"]["groups"]
        deadline = time.monotonic() + 20
        while any(r.get("health") == "unknown" for g in rules for r in g["rules"]) and time.monotonic() < deadline:
            time.sleep(0.5)
            rules = httpx.get(api + "/rules", timeout=10).json()["data"]["groups"]
        states = {r["name"]: (r["health"], r.get("lastError", ""), r["state"]) for g in rules for r in g["rules"]}
        assert len(states) == 10 and all(h == "ok" for h, _, _ in states.values()), states
        assert all(state == "inactive" for _, _, state in states.values()), states  # a healthy deployment pages no one
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(20)
            except subprocess.TimeoutExpired:
                prom.kill()
        assert dep.stop() == 0
