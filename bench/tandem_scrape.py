"""What the benchmark reads from a Tandem router's ``/metrics`` before and after a run.

Request outcomes (to check the client's counts against the server's), KV bytes and transfer time
per request (received by DecodeOnly workers, sent by PrefillOnly workers), the prefix hit rates of
KV-aware routing (prompt tokens the chosen workers already held) and the prompt tokens each role's
workers computed (ran through the model: neither cached nor received) and, apart, what their prefix
warm-ups computed in idle steps (``router.warm_prefill_cache``), speculative decoding's
acceptance over the run (when workers speculate), and the leak check: once
the run is over and the workers have reported in, no KV block may still be held
(``tandem_kv_blocks_used`` summed over live workers back to 0). Any other server has no
``tandem_requests_total`` and is simply not scraped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

IDLE_WAIT_S = 15.0  # workers report blocks in use with their heartbeats (every 0.5 s by default)
SETTLE_S = 1.25  # unchanged counters for this long: every worker's latest report is in


@dataclass
class TandemSnapshot:
    requests_by_outcome: dict[str, float] = field(default_factory=dict)
    transfer_bytes_by_role: dict[str, float] = field(default_factory=dict)
    transfer_seconds_by_role: dict[str, float] = field(default_factory=dict)
    kv_blocks_used: float = 0.0
    requests_in_flight: float = 0.0
    running_requests: float = 0.0
    # speculative decoding, summed over workers: drafts, draft tokens, accepted tokens, accepted per position
    spec_drafts: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted_tokens: float = 0.0
    spec_accepted_per_position: dict[int, float] = field(default_factory=dict)
    # KV-aware routing: prompt tokens routed, and those the chosen worker already held, per side
    routed_prompt_tokens: dict[str, float] = field(default_factory=dict)
    routed_cached_tokens: dict[str, float] = field(default_factory=dict)
    prompt_tokens_computed_by_role: dict[str, float] = field(default_factory=dict)
    warmup_tokens_computed_by_role: dict[str, float] = field(default_factory=dict)
    routed_requests_by_worker: dict[str, float] = field(default_factory=dict)  # "side/worker" -> count

    @property
    def is_idle(self) -> bool:
        return self.kv_blocks_used == 0 and self.requests_in_flight == 0 and self.running_requests == 0


def scrape(base_url: str, headers: dict[str, str] | None = None) -> TandemSnapshot | None:
    """The router's counters now, or None when ``base_url`` is not a Tandem router."""
    try:
        response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or "tandem_requests_total" not in response.text:
        return None
    snapshot = TandemSnapshot()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            if sample.name == "tandem_requests_total":
                snapshot.requests_by_outcome[labels["outcome"]] = value
            elif sample.name == "tandem_kv_transfer_bytes_total":
                _add(snapshot.transfer_bytes_by_role, labels["role"], value)
            elif sample.name == "tandem_kv_transfer_seconds_total":
                _add(snapshot.transfer_seconds_by_role, labels["role"], value)
            elif sample.name == "tandem_kv_blocks_used":
                snapshot.kv_blocks_used += value
            elif sample.name == "tandem_requests_in_flight":
                snapshot.requests_in_flight = value
            elif sample.name == "tandem_worker_running_requests":
                snapshot.running_requests += value
            elif sample.name == "tandem_spec_decode_num_drafts_total":
                snapshot.spec_drafts += value
            elif sample.name == "tandem_spec_decode_num_draft_tokens_total":
                snapshot.spec_draft_tokens += value
            elif sample.name == "tandem_spec_decode_num_accepted_tokens_total":
                snapshot.spec_accepted_tokens += value
            elif sample.name == "tandem_routed_prompt_tokens_total":
                _add(snapshot.routed_prompt_tokens, labels["side"], value)
            elif sample.name == "tandem_routed_cached_prompt_tokens_total":
                _add(snapshot.routed_cached_tokens, labels["side"], value)
            elif sample.name == "tandem_routed_requests_total":
                _add(snapshot.routed_requests_by_worker, f"{labels['side']}/{labels['worker']}", value)
            elif sample.name == "tandem_worker_prompt_tokens_computed_total":
                _add(snapshot.prompt_tokens_computed_by_role, labels["role"], value)
            elif sample.name == "tandem_worker_warmup_tokens_computed_total":
                _add(snapshot.warmup_tokens_computed_by_role, labels["role"], value)
            elif sample.name == "tandem_spec_decode_num_accepted_tokens_per_pos_total":
                _add(snapshot.spec_accepted_per_position, int(labels["position"]), value)
    return snapshot


def _add(totals: dict[str, float], key: str, value: float) -> None:
    totals[key] = totals.get(key, 0.0) + value


def wait_until_idle(base_url: str, headers: dict[str, str] | None = None,
                    timeout_s: float = IDLE_WAIT_S) -> TandemSnapshot | None:
    """Scrape until nothing is in flight, no block is held and every counter has stayed the same for
    ``SETTLE_S`` (each worker reports with its own heartbeat, so one may be idle while another's last
    bytes are still to be reported), or until ``timeout_s``; the last scrape."""
    deadline = time.monotonic() + timeout_s
    snapshot = scrape(base_url, headers)
    settled_since = time.monotonic()
    while snapshot is not None and time.monotonic() < deadline:
        if snapshot.is_idle and time.monotonic() - settled_since >= SETTLE_S:
            break
        time.sleep(0.25)
        previous, snapshot = snapshot, scrape(base_url, headers)
        if snapshot != previous:
            settled_since = time.monotonic()
    return snapshot


def run_report(before: TandemSnapshot, after: TandemSnapshot, num_completed: int) -> dict:
    """The server's side of one run: its request counts and transfer costs, and the leak check."""
    outcomes = {k: after.requests_by_outcome.get(k, 0.0) - before.requests_by_outcome.get(k, 0.0)
                for k in after.requests_by_outcome}

    def per_request(totals_after: dict, totals_before: dict, role: str, scale: float = 1.0) -> float:
        delta = totals_after.get(role, 0.0) - totals_before.get(role, 0.0)
        return delta * scale / num_completed if num_completed else 0.0

    report = {
        "requests_by_outcome": {k: int(v) for k, v in outcomes.items()},
        "kv_bytes_received_per_request": per_request(after.transfer_bytes_by_role, before.transfer_bytes_by_role,
                                                     "DecodeOnly"),
        "kv_bytes_sent_per_request": per_request(after.transfer_bytes_by_role, before.transfer_bytes_by_role,
                                                 "PrefillOnly"),
        "kv_transfer_ms_per_request": per_request(after.transfer_seconds_by_role, before.transfer_seconds_by_role,
                                                  "DecodeOnly", scale=1000.0),
        "prompt_tokens_computed_per_request": {
            role: per_request(after.prompt_tokens_computed_by_role, before.prompt_tokens_computed_by_role, role)
            for role in after.prompt_tokens_computed_by_role},
        # off the critical path: answers (and shared prefixes) prefill workers computed into their caches
        "warmup_tokens_computed_per_request": {
            role: per_request(after.warmup_tokens_computed_by_role, before.warmup_tokens_computed_by_role, role)
            for role in after.warmup_tokens_computed_by_role if after.warmup_tokens_computed_by_role[role]},
        "routed_requests": {key: int(value - before.routed_requests_by_worker.get(key, 0.0))
                            for key, value in sorted(after.routed_requests_by_worker.items())},
        "kv_blocks_used_after": int(after.kv_blocks_used),
        "leak_check": "pass" if after.is_idle else "fail",
    }
    for side, prompt_after in after.routed_prompt_tokens.items():
        prompt = prompt_after - before.routed_prompt_tokens.get(side, 0.0)
        cached = after.routed_cached_tokens.get(side, 0.0) - before.routed_cached_tokens.get(side, 0.0)
        if prompt:
            report[f"prefix_hit_rate_{side}"] = cached / prompt  # at routing time, from the router's KV index
    if after.spec_draft_tokens > before.spec_draft_tokens:
        report["speculative_decoding"] = spec_report(before, after)
    return report


def spec_report(before: TandemSnapshot, after: TandemSnapshot) -> dict:
    """Acceptance over the run: rate (accepted / drafted), mean acceptance length (tokens per verify of
    one request, 1 + accepted / drafts) and the acceptance rate at each draft position."""
    drafts = after.spec_drafts - before.spec_drafts
    draft_tokens = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    per_position = {position: value - before.spec_accepted_per_position.get(position, 0.0)
                    for position, value in sorted(after.spec_accepted_per_position.items())}
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "acceptance_rate_per_position": [value / drafts if drafts else 0.0 for value in per_position.values()],
    }
