"""Request latency and routing per worker, for dashboards and ``tandem top`` (one row per worker).

The router's own TTFT and inter-token histograms say how the cluster does; these say which worker a
slow request went through:

* ``tandem_worker_time_to_first_token_seconds{worker}``: a request's TTFT, observed once for each worker
  of its route (the decode or colocated worker, and the prefill worker of a disaggregated request).
* ``tandem_time_per_output_token_seconds{worker}``: a finished request's TPOT, (last token - first token) /
  (output tokens - 1), under its decode worker (requests of one choice and at least two tokens). Summed
  over workers, ``sum by (le)``, it is the cluster's.
* ``tandem_worker_routed_prompt_tokens_total{worker}`` and ``..._cached_prompt_tokens_total{worker}``:
  prompt tokens routed to each worker and those its prefix cache already held (the router's KV index,
  KV-aware routing): cached / routed is the worker's prefix hit rate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

if TYPE_CHECKING:
    from router.registry import WorkerInfo

TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class WorkerRequestMetrics:
    def __init__(self, registry: CollectorRegistry, ttft_buckets: tuple[float, ...]) -> None:
        self.ttft_seconds = Histogram(
            "tandem_worker_time_to_first_token_seconds", "Request arrival to first token at the router, per worker "
            "of the request's route (decode or colocated worker, and prefill worker)", ["worker"],
            buckets=ttft_buckets, registry=registry)
        self.tpot_seconds = Histogram(
            "tandem_time_per_output_token_seconds", "A finished request's time per output token after the first, "
            "per decode worker", ["worker"], buckets=TPOT_BUCKETS, registry=registry)
        self.routed_prompt_tokens = Counter(
            "tandem_worker_routed_prompt_tokens", "Prompt tokens of requests routed to the worker",
            ["worker"], registry=registry)
        self.routed_cached_tokens = Counter(
            "tandem_worker_routed_cached_prompt_tokens", "Prompt tokens routed to the worker that its prefix cache "
            "held (the router's KV index); divided by tandem_worker_routed_prompt_tokens_total: its prefix hit rate",
            ["worker"], registry=registry)

    def add_worker(self, worker: "WorkerInfo") -> None:
        """A worker registered: its series start at 0 now, so Prometheus's rate() sees its first requests
        (a series born with its first observation has no earlier sample to count from)."""
        self.ttft_seconds.labels(worker.worker_id)
        self.routed_prompt_tokens.labels(worker.worker_id)
        self.routed_cached_tokens.labels(worker.worker_id)
        if worker.can_decode:
            self.tpot_seconds.labels(worker.worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """A worker the router forgot (dead for good): its series go, as a gone target's do."""
        for metric in (self.ttft_seconds, self.tpot_seconds, self.routed_prompt_tokens, self.routed_cached_tokens):
            try:
                metric.remove(worker_id)
            except KeyError:  # never labelled (a prefill worker has no TPOT series)
                pass

    def note_route(self, worker_id: str, num_prompt_tokens: int, num_cached_prompt_tokens: int) -> None:
        self.routed_prompt_tokens.labels(worker_id).inc(num_prompt_tokens)
        self.routed_cached_tokens.labels(worker_id).inc(num_cached_prompt_tokens)

    def note_first_token(self, worker_ids: tuple[str | None, ...], ttft_s: float) -> None:
        """A request's first token reached the router ``ttft_s`` after it arrived; ``worker_ids``: its route."""
        for worker_id in worker_ids:
            if worker_id is not None:
                self.ttft_seconds.labels(worker_id).observe(ttft_s)

    def note_finished(self, worker_id: str, first_token_at: float, last_token_at: float, num_tokens: int) -> None:
        """A request of one choice finished on decode worker ``worker_id`` with ``num_tokens`` output tokens."""
        if num_tokens >= 2:
            self.tpot_seconds.labels(worker_id).observe((last_token_at - first_token_at) / (num_tokens - 1))
