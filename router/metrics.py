"""Prometheus metrics of one router app (its own CollectorRegistry, so apps and tests never collide).

Request metrics are updated as requests run; ``tandem_requests_total{outcome="overloaded"}`` counts
429s, ``tandem_router_admission_queue_depth`` the requests waiting for a free worker slot now and
``tandem_router_admission_wait_seconds`` how long they waited. Per-worker metrics are read from the
worker registry at scrape time (``WorkerCollector``), so a worker that goes away simply stops being
reported. Per-worker TTFT, TPOT and prefix hits: ``router.worker_request_metrics``; per request priority
(queue depth, admission wait, TTFT, displaced 429s): ``router.priority_metrics``.

* ``tandem_kv_blocks_used`` / ``tandem_kv_blocks_free`` / ``tandem_kv_blocks_capacity`` {worker, role}:
  from the last heartbeat; "used" is held by a live request, prefix-cached blocks nobody holds are free.
* ``tandem_worker_queue_depth``, ``tandem_worker_running_requests``, ``tandem_worker_queued_prefill_tokens``.
* ``tandem_kv_transfer_bytes_total`` / ``tandem_kv_transfer_seconds_total`` / ``tandem_kv_transfers_total``:
  cumulative, as reported.
* ``tandem_router_event_loop_lag_seconds``: how late the router's own housekeeping timer fires (a router that
  is itself the bottleneck, or starved of CPU, shows here before its streams' latencies say why).
* ``tandem_worker_bad_frames_total`` (reported), ``tandem_worker_up`` (1 alive, 0 declared dead) and
  ``tandem_worker_restarts_total`` (new processes under the worker's id, counted by the router).
* ``tandem_cluster_handshakes_refused_total``: connections to the router's cluster socket that never
  completed a CURVE handshake (no key, another cluster's key; ``pipeline.security``). Those at a worker's
  own sockets (prefill requests, KV transfer), as its heartbeat reports them:
  ``tandem_worker_handshakes_refused_total`` {worker, role}.
* ``tandem_worker_busy_in_step_seconds`` (how long the current step has run: busy, not dead),
  ``tandem_worker_max_step_seconds``, ``tandem_worker_steps_total`` and ``tandem_worker_draining``.
* Prefill workers: ``tandem_worker_early_prefills_unclaimed_total``, early prefills no decode worker claimed
  within the hold (a later claim recomputes the prompt's last block: decode workers ask late).
* Speculating workers: ``tandem_spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total`` and ``..._num_accepted_tokens_per_pos_total{position}`` (vLLM's
  names): acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.config import PipelineRole
from router.priority_metrics import PriorityMetrics
from router.worker_request_metrics import WorkerRequestMetrics

if TYPE_CHECKING:
    from router.registry import WorkerRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

ADMISSION_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

EVENT_LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
MIGRATION_PAUSE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0)
# rejected: a bad request (4xx); unavailable: no worker can serve it (503); overloaded: 429, every worker busy
OUTCOMES = ("ok", "error", "cancelled", "timeout", "rejected", "unavailable", "overloaded")


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
        self.admission_queue_depth = Gauge(  # its owner binds it with set_function (read at scrape time)
            "tandem_router_admission_queue_depth", "Requests waiting in the router for a worker with a free slot",
            registry=self.registry,
        )
        self.admission_wait_seconds = Histogram(
            "tandem_router_admission_wait_seconds", "Request arrival to dispatch to a worker (queueing in the router)",
            buckets=ADMISSION_WAIT_BUCKETS, registry=self.registry,
        )
        self.requests_in_flight = Gauge(
            "tandem_requests_in_flight", "Requests dispatched to a worker and not finished", registry=self.registry
        )
        self.retries_total = Counter(
            "tandem_request_retries_total", "Requests re-dispatched after a worker failed them before any token",
            registry=self.registry,
        )
        self.event_loop_lag_seconds = Histogram(
            "tandem_router_event_loop_lag_seconds", "How much later than due the router's housekeeping timer ran "
            "(every 0.25 s by default): its event loop busy, or the process not scheduled (every stream's tokens "
            "wait as long)",
            buckets=EVENT_LOOP_LAG_BUCKETS, registry=self.registry)
        self.bad_frames_total = Counter(
            "tandem_router_bad_frames_total", "Frames on the router socket that failed to decode (dropped)",
            registry=self.registry,
        )
        self.migrations_total = Counter(
            "tandem_migrations_total", "Streams moved to another worker after their first token, by cause "
            "(worker_died: killed or silent; worker_error: a worker failed it, e.g. a drain ran out of time; "
            "drain: a draining worker handed it off with its KV)", ["cause"], registry=self.registry)
        for cause in ("worker_died", "worker_error", "drain"):
            self.migrations_total.labels(cause)
        self.migration_recomputed_tokens = Counter(
            "tandem_migration_recomputed_tokens_total", "Tokens (prompt + output so far) a migrated stream's new "
            "worker computed again", registry=self.registry)
        self.handoffs_declined_total = Counter(
            "tandem_handoffs_declined_total", "Streams a draining worker offered that no other worker took (they "
            "decode on where they are, and are offered again a second later)", registry=self.registry)
        self.migration_kv_bytes = Counter(
            "tandem_migration_kv_bytes_total", "KV bytes moved from a draining decode worker to the one that took "
            "its streams (live migration: those tokens are not computed again)", registry=self.registry)
        self.migration_pause_seconds = Histogram(
            "tandem_migration_pause_seconds", "A migrated stream's pause: its last token before the move to its "
            "first token after (a crash: detection of the failure, then the new worker's recompute; a drain: the KV move)",
            buckets=MIGRATION_PAUSE_BUCKETS, registry=self.registry)
        self.routed_total = Counter(
            "tandem_routed_requests_total", "Requests routed, per worker and side (decode: the decode or colocated "
            "worker; prefill: the prefill worker of a disaggregated request)", ["worker", "side"],
            registry=self.registry)
        self.routed_prompt_tokens = Counter(
            "tandem_routed_prompt_tokens_total", "Prompt tokens of routed requests, per side", ["side"],
            registry=self.registry)
        self.routed_cached_tokens = Counter(
            "tandem_routed_cached_prompt_tokens_total", "Prompt tokens the chosen worker already held when routed "
            "(the router's KV index), per side: divided by tandem_routed_prompt_tokens_total, the prefix hit rate",
            ["side"], registry=self.registry)
        self.prefill_warmups_total = Counter(
            "tandem_prefill_warmups_total", "Finished disaggregated requests whose prompt + answer the router asked "
            "their prefill worker to warm its prefix cache with (router.warm_prefill_cache)", registry=self.registry)
        self.prefix_spreads_total = Counter(
            "tandem_prefix_spreads_total", "Prefill workers asked to warm up a prefix that conversations share "
            "(held by two decode workers or more) and that they lacked, so new conversations spread by load",
            registry=self.registry)
        self.prefill_first_tokens_total = Counter(
            "tandem_prefill_first_tokens_total", "Disaggregated requests whose first token was streamed as its prefill "
            "worker sent it, before the decode worker had verified the KV", registry=self.registry)
        self.prefill_spills_total = Counter(
            "tandem_prefill_spills_total", "Prompts a DecodeOnly worker prefilled itself because the prefill workers' "
            "queue was longer than its own by router.prefill_spill_tokens (queue-aware conditional disaggregation)",
            registry=self.registry)
        for side in ("decode", "prefill"):
            self.routed_prompt_tokens.labels(side)
            self.routed_cached_tokens.labels(side)
        self.per_worker = WorkerRequestMetrics(self.registry, TTFT_BUCKETS)  # TTFT, TPOT and prefix hits per worker
        # queue depth, admission wait, TTFT and displacements per request priority (bucketed label)
        self.per_priority = PriorityMetrics(self.registry, TTFT_BUCKETS, ADMISSION_WAIT_BUCKETS)
        self.registry.register(WorkerCollector(registry))
        self.registry.register(HandshakeCollector())

    def forget_worker(self, worker_id: str) -> None:
        """A worker the router forgot (dead for good): every series labelled with it goes, as a gone target's
        do; otherwise each restart of a worker named by host and pid would add series for ever."""
        self.per_worker.remove_worker(worker_id)
        for side in ("decode", "prefill"):
            try:
                self.routed_total.remove(worker_id, side)
            except KeyError:  # never routed to on that side
                pass

    def note_route(self, route, num_prompt_tokens: int) -> None:
        """Count one routing decision and how much of the prompt its workers held (0 without KV-aware routing)."""
        for side, worker in (("decode", route.decode), ("prefill", route.prefill)):
            if worker is None:
                continue
            self.routed_total.labels(worker.worker_id, side).inc()
            self.routed_prompt_tokens.labels(side).inc(num_prompt_tokens)
            self.routed_cached_tokens.labels(side).inc(worker.num_cached_prompt_tokens)
            self.per_worker.note_route(worker.worker_id, num_prompt_tokens, worker.num_cached_prompt_tokens)
        if route.is_spilled:
            self.prefill_spills_total.inc()

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
            "restarts": CounterMetricFamily(
                "tandem_worker_restarts", "Times a new process registered under the worker's id (a restart after a "
                "crash, a rolling replace)", labels=labels),
            "used": GaugeMetricFamily("tandem_kv_blocks_used", "KV blocks held by live requests", labels=labels),
            "free": GaugeMetricFamily("tandem_kv_blocks_free", "KV blocks free (incl. unheld prefix cache)", labels=labels),
            "total": GaugeMetricFamily("tandem_kv_blocks_capacity", "KV blocks in the pool", labels=labels),
            "queue": GaugeMetricFamily("tandem_worker_queue_depth", "Requests waiting for admission", labels=labels),
            "running": GaugeMetricFamily("tandem_worker_running_requests", "Requests running", labels=labels),
            "prefill": GaugeMetricFamily(
                "tandem_worker_queued_prefill_tokens", "Prompt tokens waiting for prefill", labels=labels
            ),
            "bytes": CounterMetricFamily("tandem_kv_transfer_bytes", "KV bytes transferred (reported)", labels=labels),
            "transfers": CounterMetricFamily("tandem_kv_transfers", "KV transfers finished (reported)", labels=labels),
            "seconds": CounterMetricFamily(
                "tandem_kv_transfer_seconds", "KV transfers' time from the first block to the receiver's "
                "acknowledgement, summed (a decode worker's includes the prefill it waits for; reported)",
                labels=labels),
            "transfer_busy": CounterMetricFamily(
                "tandem_kv_transfer_busy_seconds", "Of those seconds, the time spent moving KV bytes (packing and "
                "sending, copying in place, unpacking and verifying): the transport's own (reported)",
                labels=labels),
            "bad": CounterMetricFamily("tandem_worker_bad_frames", "Frames a worker dropped (reported)", labels=labels),
            "refused": CounterMetricFamily(
                "tandem_worker_handshakes_refused", "Connections to the worker's own cluster sockets (prefill "
                "requests, KV transfer) refused before any message: no CURVE or a key that is not the cluster's "
                "(reported)",
                labels=labels),
            "busy": GaugeMetricFamily(
                "tandem_worker_busy_in_step_seconds", "How long the worker's current engine step has run (0: idle)",
                labels=labels),
            "max_step": GaugeMetricFamily(
                "tandem_worker_max_step_seconds", "The longest engine step the worker has run", labels=labels),
            "steps": CounterMetricFamily("tandem_worker_steps", "Engine steps the worker completed", labels=labels),
            "prompt_computed": CounterMetricFamily(
                "tandem_worker_prompt_tokens_computed", "Prompt tokens the worker ran through the model (its prefix "
                "cache's hits and KV it received are not computed)", labels=labels),
            "warmup_computed": CounterMetricFamily(
                "tandem_worker_warmup_tokens_computed", "Tokens the worker's prefix warm-ups ran through the model in "
                "idle steps (a finished turn's answer, for the conversation's next turn)", labels=labels),
            "early_unclaimed": CounterMetricFamily(
                "tandem_worker_early_prefills_unclaimed", "Early prefills (started as the request was routed) no "
                "decode worker claimed within the hold (router.early_prefill_hold_s): a later claim "
                "recomputed the prompt's last block from the prefix cache. Rising: decode workers ask late (busy)",
                labels=labels),
            "kv_index": GaugeMetricFamily(
                "tandem_kv_index_blocks", "Prefix-cache blocks the router's KV index holds for the worker",
                labels=labels),
            "draining": GaugeMetricFamily(
                "tandem_worker_draining", "1 while the worker shuts down (takes no new requests)", labels=labels),
            "spec_drafts": CounterMetricFamily(
                "tandem_spec_decode_num_drafts", "Verify steps of one request that checked draft tokens", labels=labels),
            "spec_draft_tokens": CounterMetricFamily(
                "tandem_spec_decode_num_draft_tokens", "Draft tokens proposed", labels=labels),
            "spec_accepted": CounterMetricFamily(
                "tandem_spec_decode_num_accepted_tokens", "Draft tokens accepted", labels=labels),
            "spec_per_position": CounterMetricFamily(
                "tandem_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position",
                labels=[*labels, "position"]),
        }
        for w in self._workers.all_workers():
            values = [w.worker_id, w.role.value]
            load = w.load
            families["up"].add_metric(values, 1.0 if w.is_alive else 0.0)
            families["restarts"].add_metric(values, w.num_restarts)
            if not w.is_alive:
                continue
            families["used"].add_metric(values, load.num_used_blocks)
            families["free"].add_metric(values, load.num_free_blocks)
            families["total"].add_metric(values, load.num_total_blocks or w.num_total_blocks)
            families["queue"].add_metric(values, load.num_waiting)
            families["running"].add_metric(values, load.num_running)
            families["prefill"].add_metric(values, load.num_queued_prefill_tokens)
            families["bytes"].add_metric(values, load.transfer_bytes)
            families["transfers"].add_metric(values, load.transfer_count)
            families["seconds"].add_metric(values, load.transfer_seconds)
            families["transfer_busy"].add_metric(values, load.transfer_busy_seconds)
            families["bad"].add_metric(values, load.num_bad_frames)
            families["refused"].add_metric(values, load.num_handshakes_refused)
            families["busy"].add_metric(values, load.busy_in_step_s)
            families["max_step"].add_metric(values, load.max_step_s)
            families["steps"].add_metric(values, load.num_steps)
            families["prompt_computed"].add_metric(values, load.num_prompt_tokens_computed)
            families["warmup_computed"].add_metric(values, load.num_warmup_tokens_computed)
            if w.role is PipelineRole.PrefillOnly:
                families["early_unclaimed"].add_metric(values, load.num_early_prefills_unclaimed)
            families["draining"].add_metric(values, 1.0 if load.is_draining else 0.0)
            families["kv_index"].add_metric(values, self._workers.kv_index.num_blocks(w.worker_id))
            if load.spec_accepted_per_position:  # a speculating worker
                families["spec_drafts"].add_metric(values, load.spec_num_drafts)
                families["spec_draft_tokens"].add_metric(values, load.spec_num_draft_tokens)
                families["spec_accepted"].add_metric(values, load.spec_num_accepted_tokens)
                for position, count in enumerate(load.spec_accepted_per_position):
                    families["spec_per_position"].add_metric([*values, str(position)], count)
        yield from families.values()


class HandshakeCollector(Collector):
    """The process's refused cluster handshakes (``pipeline.security``), read at scrape time."""

    def describe(self) -> Iterator:
        return iter(())

    def collect(self) -> Iterator:
        from pipeline.security import num_handshakes_refused

        family = CounterMetricFamily(
            "tandem_cluster_handshakes_refused", "Connections to the router's cluster socket refused before any "
            "message: no CURVE, a key that is not the cluster's, or a client key ZAP denied")
        family.add_metric([], num_handshakes_refused())
        yield family
