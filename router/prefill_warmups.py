"""The prefix warm-ups the router asks prefill workers for (``WarmPrefix``; ``pipeline/prefix_warmup.py``
runs them in the workers' idle steps; ``router.warm_prefill_cache`` switches both kinds).

1. After a turn: a disaggregated request that ended well leaves its prefill worker with the prompt's KV
   but not the answer, which only the decode worker computed and the conversation's next turn repeats.
   That prefill worker computes prompt + answer into its cache, so the next turn there computes only the
   new message.
2. After a routing decision: a prefix that conversations share (``policy.popular_prefix_gaps``) is warmed
   on the live prefill workers that lack it, so new conversations spread over prefill workers by load
   instead of all following the first one that cached the system prompt. Asked again only after
   ``RESEND_S``, while the index still shows it missing.
"""

from __future__ import annotations

import time
from typing import Callable

import msgspec

from pipeline.protocol.cluster import WarmPrefix
from router.metrics import RouterMetrics
from router.policy import Route, WorkerView, popular_prefix_gaps
from router.registry import WorkerRegistry
from router.request_handle import RequestHandle

RESEND_S = 5.0  # a prefill worker asked to warm a shared prefix is asked again after this, if still lacking
_MAX_REMEMBERED = 4096


class PrefillWarmups:
    def __init__(self, registry: WorkerRegistry, metrics: RouterMetrics,
                 send: Callable[[str, msgspec.Struct], bool]) -> None:
        self.registry = registry
        self.metrics = metrics
        self.send = send
        self._spread_sent: dict[tuple[str, int], float] = {}  # (prefill worker, prefix length) -> when asked

    def after_turn(self, handle: RequestHandle) -> None:
        """``handle`` ended well (rule 1); a request with n > 1 choices has no one answer to warm."""
        if handle.prefill_worker_id is None or handle.num_choices != 1:
            return
        prefill = self.registry.get(handle.prefill_worker_id)
        if prefill is None or not prefill.is_alive or prefill.load.is_draining:
            return
        warmup = WarmPrefix(token_ids=handle.prompt_token_ids + handle.output_token_ids,
                            num_prompt_tokens=len(handle.prompt_token_ids))
        if self.send(prefill.worker_id, warmup):
            self.metrics.prefill_warmups_total.inc()

    def after_route(self, views: list[WorkerView], route: Route, prompt_token_ids: list[int]) -> None:
        """A request went out on ``route``, chosen from ``views`` (rule 2)."""
        num_tokens, lacking = popular_prefix_gaps(views, route)
        now = time.monotonic()
        for worker in lacking:
            key = (worker.worker_id, num_tokens)
            if key in self._spread_sent and now - self._spread_sent[key] < RESEND_S:
                continue
            if self.send(worker.worker_id, WarmPrefix(token_ids=prompt_token_ids[:num_tokens])):
                self._spread_sent[key] = now
                self.metrics.prefix_spreads_total.inc()
        if len(self._spread_sent) > _MAX_REMEMBERED:
            self._spread_sent.clear()
