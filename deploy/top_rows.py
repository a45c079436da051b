"""``tandem top``'s numbers: two scrapes of a router's /metrics (and its /ready JSON) into one row per worker
and the cluster's totals; no terminal, no I/O.

Gauges (running, queued, KV blocks, in flight) are read from the newer scrape. Rates and "now" latencies
are differences between the two: requests/s from ``tandem_requests_total``, TTFT now = the change of a
histogram's ``_sum`` over the change of its ``_count`` (the mean over the interval; None when no request
got there in it). A counter that went down restarted with its process (a worker's own counters): its
new value is the change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# outcomes of tandem_requests_total that are the server's failures (rejected: a bad request, 4xx; overloaded: 429)
ERROR_OUTCOMES = ("error", "timeout", "unavailable")
BUSY_STEP_S = 1.0  # a step running longer than this is shown: the worker is alive but stuck in a long step


@dataclass
class Scrape:
    """One reading of the router: when (time.monotonic()), every sample of /metrics, and /ready's JSON."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]]
    ready: dict | None = None

    @classmethod
    def parse(cls, at: float, metrics_text: str, ready: dict | None = None) -> "Scrape":
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((sample.labels, sample.value))
        return cls(at, samples, ready)

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when there are none)."""
        return sum(value for sample_labels, value in self.samples.get(name, ())
                   if all(sample_labels.get(k) == v for k, v in labels.items()))

    def per_worker(self, name: str) -> dict[str, float]:
        return {labels["worker"]: value for labels, value in self.samples.get(name, ()) if "worker" in labels}

    def roles(self) -> dict[str, str]:
        """worker -> role, for every worker the router knows (alive or declared dead)."""
        return {labels["worker"]: labels.get("role", "") for labels, _ in self.samples.get("tandem_worker_up", ())}


@dataclass
class WorkerRow:
    worker: str
    role: str
    state: str  # serving, idle, draining, dead, or "busy 2.5s" (a long step)
    pid: int | None
    num_ranks: int  # tensor parallelism: the worker's processes (rank 0, the pid, and ranks 1..N-1)
    num_running: int
    num_queued: int
    kv_used_fraction: float | None  # blocks held by live requests / blocks in the pool
    ttft_s: float | None  # mean over the interval; None: no first token in it
    tpot_s: float | None
    transfer_bytes_per_s: float
    num_restarts: int


@dataclass
class ClusterTotals:
    requests_per_s: float
    errors_per_s: float
    num_errors: int  # since the router started
    num_in_flight: int
    num_queued: int  # waiting in the router for a worker with a free slot
    ttft_s: float | None
    tpot_s: float | None


@dataclass
class TopView:
    totals: ClusterTotals
    rows: list[WorkerRow] = field(default_factory=list)
    is_ready: bool | None = None  # None: /ready not read
    ready_reason: str = ""
    interval_s: float = 0.0


def build_view(previous: Scrape, current: Scrape) -> TopView:
    """The cluster between two scrapes (``previous`` older)."""
    dt = max(current.at - previous.at, 1e-9)
    errors = sum(current.total("tandem_requests_total", outcome=o) for o in ERROR_OUTCOMES)
    previous_errors = sum(previous.total("tandem_requests_total", outcome=o) for o in ERROR_OUTCOMES)
    totals = ClusterTotals(
        requests_per_s=_increase(previous.total("tandem_requests_total"), current.total("tandem_requests_total")) / dt,
        errors_per_s=_increase(previous_errors, errors) / dt,
        num_errors=int(errors),
        num_in_flight=int(current.total("tandem_requests_in_flight")),
        num_queued=int(current.total("tandem_router_admission_queue_depth")),
        ttft_s=_mean_between(previous, current, "tandem_time_to_first_token_seconds"),
        tpot_s=_mean_between(previous, current, "tandem_time_per_output_token_seconds"),
    )
    ready = current.ready or {}
    return TopView(totals=totals, rows=_worker_rows(previous, current, dt),
                   is_ready=ready.get("ready") if current.ready is not None else None,
                   ready_reason=ready.get("reason", ""), interval_s=dt)


def _worker_rows(previous: Scrape, current: Scrape, dt: float) -> list[WorkerRow]:
    entries = {w["worker_id"]: w for w in (current.ready or {}).get("workers", [])}
    up, draining = current.per_worker("tandem_worker_up"), current.per_worker("tandem_worker_draining")
    busy = current.per_worker("tandem_worker_busy_in_step_seconds")
    running = current.per_worker("tandem_worker_running_requests")
    queued = current.per_worker("tandem_worker_queue_depth")
    used, total = current.per_worker("tandem_kv_blocks_used"), current.per_worker("tandem_kv_blocks_capacity")
    restarts = current.per_worker("tandem_worker_restarts_total")
    bytes_now, bytes_before = (s.per_worker("tandem_kv_transfer_bytes_total") for s in (current, previous))
    ttft = _per_worker_means(previous, current, "tandem_worker_time_to_first_token_seconds")
    tpot = _per_worker_means(previous, current, "tandem_time_per_output_token_seconds")
    rows = []
    for worker, role in sorted(current.roles().items(), key=lambda item: (_role_order(item[1]), item[0])):
        if not up.get(worker):
            state = "dead"
        elif draining.get(worker):
            state = "draining"
        elif busy.get(worker, 0.0) > BUSY_STEP_S:
            state = f"busy {busy[worker]:.1f}s"
        else:
            state = "serving" if running.get(worker) or queued.get(worker) else "idle"
        rows.append(WorkerRow(
            worker=worker, role=role, state=state, pid=entries.get(worker, {}).get("pid"),
            num_ranks=1 + len(entries.get(worker, {}).get("rank_pids") or ()),
            num_running=int(running.get(worker, 0)), num_queued=int(queued.get(worker, 0)),
            kv_used_fraction=used[worker] / total[worker] if total.get(worker) and worker in used else None,
            ttft_s=ttft.get(worker), tpot_s=tpot.get(worker),
            transfer_bytes_per_s=_increase(bytes_before.get(worker, 0.0), bytes_now.get(worker, 0.0)) / dt,
            num_restarts=int(restarts.get(worker, 0)),
        ))
    return rows


def _role_order(role: str) -> int:
    """Prefill workers first, then decode, then colocated: the order a request meets them."""
    return {"PrefillOnly": 0, "DecodeOnly": 1, "PrefillAndDecode": 2}.get(role, 3)


def _increase(before: float, now: float) -> float:
    """A counter's increase; one that went down was reset (its process restarted): it rose by ``now``."""
    return now - before if now >= before else now


def _mean_between(previous: Scrape, current: Scrape, histogram: str) -> float | None:
    count = current.total(f"{histogram}_count") - previous.total(f"{histogram}_count")
    if count <= 0:
        return None
    return (current.total(f"{histogram}_sum") - previous.total(f"{histogram}_sum")) / count


def _per_worker_means(previous: Scrape, current: Scrape, histogram: str) -> dict[str, float]:
    sums_now, sums_before = current.per_worker(f"{histogram}_sum"), previous.per_worker(f"{histogram}_sum")
    counts_now, counts_before = current.per_worker(f"{histogram}_count"), previous.per_worker(f"{histogram}_count")
    return {worker: (sums_now[worker] - sums_before.get(worker, 0.0)) / (count - counts_before.get(worker, 0.0))
            for worker, count in counts_now.items() if count > counts_before.get(worker, 0.0)}
