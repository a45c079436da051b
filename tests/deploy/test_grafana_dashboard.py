"""The shipped Grafana dashboard, read without Prometheus (the fast lane's check; tests/observability runs
every query on a real one): importable as is, and every metric it queries is one the router exports."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from pipeline.protocol.cluster import Heartbeat, RegisterWorker, WorkerLoad, WorkerRole
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from tests.observability.dashboard_queries import load_dashboard, panel_queries, substitute


def exported_sample_names() -> set[str]:
    """Every sample name a router with a prefill and a decode worker exports."""
    registry = WorkerRegistry(heartbeat_interval_s=0.5, dead_after_s=3.0)
    metrics = RouterMetrics(registry)
    registry.on_worker_registered = metrics.per_worker.add_worker  # as create_app wires it
    for worker_id, role, endpoint in (("prefill-0", WorkerRole.PREFILL_ONLY, "ipc:///tmp/p"),
                                      ("decode-0", WorkerRole.DECODE_ONLY, None)):
        registry.register(RegisterWorker(worker_id=worker_id, role=role, model_name="m", max_length=128, page_size=16,
                                         num_total_blocks=32, prefill_endpoint=endpoint, pid=1))
        registry.heartbeat(Heartbeat(worker_id=worker_id, load=WorkerLoad(num_total_blocks=32, num_free_blocks=32)))
    text = metrics.render().decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_queried_metric_is_exported():
    exported = exported_sample_names()
    queried = {name for query in panel_queries(load_dashboard()) for name in re.findall(r"\btandem_\w+", query.expr)}
    assert queried and not queried - exported, f"not exported: {sorted(queried - exported)}"


def test_importable_as_is():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "tandem-cluster" and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])  # ids unique
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"] and panel["targets"], panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
    known = {name: "x" for name in variables} | {"__rate_interval": "1m"}
    for query in panel_queries(dashboard):
        substitute(query.expr, known)  # raises on a variable the dashboard does not define
