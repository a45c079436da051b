"""Router metrics per request priority, on the router's registry (``RouterMetrics.per_priority``).

A request's ``priority`` is any integer, so the label is bucketed to keep cardinality bounded (at most
12 series per metric): ``"0"`` ... ``"9"`` as themselves, every negative priority as ``"negative"`` and
every priority from 10 up as ``"10+"``.

* ``tandem_router_priority_admission_queue_depth{priority}``: requests waiting in the admission queue now
  (read at scrape time; every priority seen waiting since the start, and the default 0, is reported, as 0
  when nobody of it waits, so that its series does not break off).
* ``tandem_router_priority_admission_wait_seconds{priority}``: arrival to dispatch to a worker.
* ``tandem_router_priority_time_to_first_token_seconds{priority}``: arrival to first token at the router.
* ``tandem_router_priority_displaced_total{priority}``: waiting requests answered 429 because the queue was
  full and a request of better priority took their place (``router/admission.py``).
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

MAX_LABELLED_PRIORITY = 9


def priority_label(priority: int) -> str:
    """The bounded label of a priority: "negative", "0" ... "9", "10+"."""
    if priority < 0:
        return "negative"
    return str(priority) if priority <= MAX_LABELLED_PRIORITY else f"{MAX_LABELLED_PRIORITY + 1}+"


class PriorityMetrics:
    def __init__(self, registry: CollectorRegistry, ttft_buckets: tuple, wait_buckets: tuple) -> None:
        self.admission_wait_seconds = Histogram(
            "tandem_router_priority_admission_wait_seconds", "Request arrival to dispatch to a worker, by priority "
            "(bucketed: negative, 0-9, 10+)", ["priority"], buckets=wait_buckets, registry=registry)
        self.ttft_seconds = Histogram(
            "tandem_router_priority_time_to_first_token_seconds", "Request arrival to first token at the router, "
            "by priority (bucketed: negative, 0-9, 10+)", ["priority"], buckets=ttft_buckets, registry=registry)
        self.displaced_total = Counter(
            "tandem_router_priority_displaced", "Waiting requests answered 429 because the admission queue was full "
            "and a request of better priority took their place, by the displaced one's priority", ["priority"],
            registry=registry)
        self._depth = _DepthCollector()
        registry.register(self._depth)

    def bind_queue_depth(self, depth_by_label: Callable[[Callable[[int], str]], dict[str, int]]) -> None:
        """The admission queue's owner gives its per-priority count (``AdmissionQueue.depth_by_priority``)."""
        self._depth.read = depth_by_label

    def note_admitted(self, priority: int, wait_s: float) -> None:
        self.admission_wait_seconds.labels(priority_label(priority)).observe(wait_s)

    def note_first_token(self, priority: int, ttft_s: float) -> None:
        self.ttft_seconds.labels(priority_label(priority)).observe(ttft_s)

    def note_displaced(self, priority: int) -> None:
        self.displaced_total.labels(priority_label(priority)).inc()


class _DepthCollector(Collector):
    def __init__(self) -> None:
        self.read: Callable[[Callable[[int], str]], dict[str, int]] | None = None
        self._reported = {priority_label(0): 0}  # each label seen so far: reported from then on

    def describe(self) -> Iterator:
        return iter(())

    def collect(self) -> Iterator:
        family = GaugeMetricFamily(
            "tandem_router_priority_admission_queue_depth", "Requests waiting in the router for a worker with a "
            "free slot, by priority (bucketed: negative, 0-9, 10+)", labels=["priority"])
        depth = dict.fromkeys(self._reported, 0) | (self.read(priority_label) if self.read else {})
        self._reported = depth
        for label, count in sorted(depth.items()):
            family.add_metric([label], count)
        yield family
