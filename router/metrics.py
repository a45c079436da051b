"""Prometheus metrics of one router app (its own CollectorRegistry, so apps and tests never collide).

Request metrics are updated as requests run. Per-worker metrics are read from the worker registry at
scrape time (``WorkerCollector``), so a worker that goes away simply stops being reported:

* ``tandem_kv_blocks_used`` / ``tandem_kv_blocks_free`` / ``tandem_kv_blocks_total`` {worker, role}:
  from the last heartbeat; "used" is held by a live request, prefix-cached blocks nobody holds are free.
* ``tandem_worker_queue_depth``, ``tandem_worker_running_requests``, ``tandem_worker_queued_prefill_tokens``.
* ``tandem_kv_transfer_bytes_total`` / ``tandem_kv_transfer_seconds_total``: cumulative, as reported.
* ``tandem_worker_bad_frames_total`` (reported) and ``tandem_worker_up`` (1 alive, 0 declared dead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from router.registry import WorkerRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

OUTCOMES = ("ok", "error", "cancelled", "timeout", "rejected", "unavailable")


class RouterMetrics:
    def __init__(self, registry: "WorkerRegistry") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests_total = Counter(
            "tandem_requests_total", "Requests by outcome", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests_total.labels(outcome)
        self.ttft_seconds = Histogram(
            "tandem_time_to_first_token_seconds", "Request arrival to first token at the router",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.itl_seconds = Histogram(
            "tandem_inter_token_latency_seconds", "Time between output tokens of one request",
            buckets=ITL_BUCKETS, registry=self.registry,
        )
        self.queue_depth = Gauge(
            "tandem_router_queue_depth", "Requests dispatched and still waiting for their first token",
            registry=self.registry,
        )
        self.requests_in_flight = Gauge(
            "tandem_requests_in_flight", "Requests dispatched to a worker and not finished", registry=self.registry
        )
        self.retries_total = Counter(
            "tandem_request_retries_total", "Requests re-dispatched after a worker failed them before any token",
            registry=self.registry,
        )
        self.bad_frames_total = Counter(
            "tandem_router_bad_frames_total", "Frames on the router socket that failed to decode (dropped)",
            registry=self.registry,
        )
        self.registry.register(WorkerCollector(registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class WorkerCollector(Collector):
    """Per-worker gauges and counters, read from the worker registry at scrape time."""

    def __init__(self, workers: "WorkerRegistry") -> None:
        self._workers = workers

    def describe(self) -> Iterator:
        return iter(())  # dynamic: nothing to describe up front

    def collect(self) -> Iterator:
        labels = ["worker", "role"]
        families = {
            "up": GaugeMetricFamily("tandem_worker_up", "1 while the worker heartbeats, 0 once declared dead", labels=labels),
            "used": GaugeMetricFamily("tandem_kv_blocks_used", "KV blocks held by live requests", labels=labels),
            "free": GaugeMetricFamily("tandem_kv_blocks_free", "KV blocks free (incl. unheld prefix cache)", labels=labels),
            "total": GaugeMetricFamily("tandem_kv_blocks_total", "KV blocks in the pool", labels=labels),
            "queue": GaugeMetricFamily("tandem_worker_queue_depth", "Requests waiting for admission", labels=labels),
            "running": GaugeMetricFamily("tandem_worker_running_requests", "Requests running", labels=labels),
            "prefill": GaugeMetricFamily(
                "tandem_worker_queued_prefill_tokens", "Prompt tokens waiting for prefill", labels=labels
            ),
            "bytes": CounterMetricFamily("tandem_kv_transfer_bytes", "KV bytes transferred (reported)", labels=labels),
            "seconds": CounterMetricFamily(
                "tandem_kv_transfer_seconds", "Seconds spent transferring KV (reported)", labels=labels
            ),
            "bad": CounterMetricFamily("tandem_worker_bad_frames", "Frames a worker dropped (reported)", labels=labels),
        }
        for w in self._workers.all_workers():
            values = [w.worker_id, w.role.value]
            load = w.load
            families["up"].add_metric(values, 1.0 if w.is_alive else 0.0)
            if not w.is_alive:
                continue
            families["used"].add_metric(values, load.num_used_blocks)
            families["free"].add_metric(values, load.num_free_blocks)
            families["total"].add_metric(values, load.num_total_blocks or w.num_total_blocks)
            families["queue"].add_metric(values, load.num_waiting)
            families["running"].add_metric(values, load.num_running)
            families["prefill"].add_metric(values, load.num_queued_prefill_tokens)
            families["bytes"].add_metric(values, load.transfer_bytes)
            families["seconds"].add_metric(values, load.transfer_seconds)
            families["bad"].add_metric(values, load.num_bad_frames)
        yield from families.values()
