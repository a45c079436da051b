"""The shipped Grafana dashboard and Prometheus config against a real Prometheus (the ``prometheus``
binary, run as a child process) scraping a real 1P1D cluster under load: every panel's query returns
data through Prometheus's HTTP API, with the dashboard's variables substituted as Grafana would.

Skipped where the binary is absent (``apt-get install prometheus``); ``make dashboard-check`` sets
TANDEM_REQUIRE_PROMETHEUS=1, which makes its absence a failure instead.
"""

from __future__ import annotations

import math
import os
import re

import pytest

from tests.observability.conftest import put_load
from tests.observability.dashboard_queries import load_dashboard, panel_queries, substitute
from tests.observability.prometheus_server import PrometheusServer, prometheus_binary

RATE_WINDOW = "30s"  # what $__rate_interval stands for: the whole test's load stays inside it
NUM_ROUNDS, CONCURRENCY = 3, 4


NO_PROMETHEUS = "the prometheus binary is not installed (apt-get install prometheus): dashboard queries not checked"
# skipped before any cluster starts; under `make dashboard-check` the fixture fails instead
pytestmark = pytest.mark.skipif(prometheus_binary() is None and os.environ.get("TANDEM_REQUIRE_PROMETHEUS") != "1",
                                reason=NO_PROMETHEUS)


@pytest.fixture(scope="module")
def prometheus(cluster):
    binary = prometheus_binary()
    if binary is None:
        pytest.fail(NO_PROMETHEUS)
    server = PrometheusServer(binary, cluster.url)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def loaded(cluster, prometheus):
    """Prometheus has scraped the idle cluster, then the cluster under load, then its reports after it."""
    prometheus.wait_for_scrapes(2)
    assert put_load(cluster.url, num_rounds=NUM_ROUNDS, concurrency=CONCURRENCY) == NUM_ROUNDS * CONCURRENCY
    prometheus.wait_for_scrapes(3)  # workers report their counters with heartbeats (every 0.5 s)
    return prometheus


def dashboard_variables(dashboard: dict, job: str) -> dict[str, str]:
    """Grafana's substitutions: this cluster's job, "All" (the variable's allValue) for the rest."""
    values = {"__rate_interval": RATE_WINDOW}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            values[variable["name"]] = job if variable["name"] == "job" else variable["allValue"]
    return values


def test_every_panel_query_returns_data(loaded):
    dashboard = load_dashboard()
    variables = dashboard_variables(dashboard, loaded.job)
    queries = panel_queries(dashboard)
    assert len(queries) >= 20
    empty = []
    for query in queries:
        result = loaded.query(substitute(query.expr, variables))
        if not any(math.isfinite(float(series["value"][1])) for series in result):
            empty.append(f"{query.panel} [{query.ref_id}]: {query.expr} -> {result}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_the_variables_list_this_cluster(loaded):
    """Each query variable's ``label_values(match, label)``, as Grafana runs it (the job chosen, then workers)."""
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    listed = {}
    for name in ("job", "worker"):
        match, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name]["definition"]).groups()
        listed[name] = sorted(loaded.label_values(label, substitute(match, {"job": loaded.job})))
    assert listed == {"job": [loaded.job], "worker": ["decode-0", "prefill-0"]}


def test_the_numbers_are_the_loads(loaded):
    """A few panels read back what the load did: requests, KV moved from P to D, latencies."""
    job = loaded.job

    def scalar(expr: str) -> float:
        return sum(float(series["value"][1]) for series in loaded.query(expr))

    ok = scalar(f'sum(tandem_requests_total{{job="{job}",outcome="ok"}})')
    assert ok == NUM_ROUNDS * CONCURRENCY
    transferred = {s["metric"]["worker"]: float(s["value"][1]) for s in loaded.query(
        f'sum by (worker) (rate(tandem_kv_transfer_bytes_total{{job="{job}"}}[{RATE_WINDOW}]))')}
    assert transferred["prefill-0"] > 0 and transferred["decode-0"] > 0  # every request went through a transfer
    ttft_p50 = scalar(f'histogram_quantile(0.5, sum by (le) (rate(tandem_time_to_first_token_seconds_bucket'
                      f'{{job="{job}"}}[{RATE_WINDOW}])))')
    tpot_p50 = scalar(f'histogram_quantile(0.5, sum by (le) (rate(tandem_time_per_output_token_seconds_bucket'
                      f'{{job="{job}"}}[{RATE_WINDOW}])))')
    assert 0 < ttft_p50 < 10 and 0 < tpot_p50 < 2.5
