"""Per-worker request metrics at the router (fake workers): TTFT under every worker of a request's route,
TPOT under its decode worker, prompt tokens routed per worker, and restarts counted per worker id."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import RegisterWorker, WorkerRole
from router.metrics import RouterMetrics
from router.registry import WorkerRegistry
from tests.router.fake_worker import tokens_script

PROMPT = list(range(40, 52))
STEP_S = 0.03


def _samples(router) -> dict[tuple[str, str], float]:
    """{(sample name, worker label): value} of the router's /metrics."""
    text = httpx.get(f"{router.url}/metrics").text
    return {(s.name, s.labels.get("worker", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_ttft_tpot_and_routed_prompt_tokens_per_worker(router):
    router.add_worker("p0", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p0-wrm")
    router.add_worker("d0", role=PipelineRole.DecodeOnly, script=tokens_script([10, 11, 12, 13, 14], step_s=STEP_S))
    samples = _samples(router)  # series from registration on, so rate() counts the first requests too
    for worker in ("p0", "d0"):
        assert samples[("tandem_worker_time_to_first_token_seconds_count", worker)] == 0
        assert samples[("tandem_worker_routed_prompt_tokens_total", worker)] == 0
    assert samples[("tandem_time_per_output_token_seconds_count", "d0")] == 0
    for _ in range(2):
        response = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 5})
        assert response.status_code == 200, response.text
    samples = _samples(router)
    for worker in ("p0", "d0"):  # both workers of the route saw each request's first token
        assert samples[("tandem_worker_time_to_first_token_seconds_count", worker)] == 2
        assert samples[("tandem_worker_routed_prompt_tokens_total", worker)] == 2 * len(PROMPT)
    assert samples[("tandem_worker_time_to_first_token_seconds_sum", "d0")] >= 2 * STEP_S  # the first token's step
    # TPOT only where requests were decoded: 4 gaps of one step each, per request
    assert samples[("tandem_time_per_output_token_seconds_count", "d0")] == 2
    assert 2 * STEP_S * 0.8 < samples[("tandem_time_per_output_token_seconds_sum", "d0")] < 2 * STEP_S * 4
    assert ("tandem_time_per_output_token_seconds_count", "p0") not in samples


def test_restarts_count_new_processes_under_a_worker_id():
    registry = WorkerRegistry(heartbeat_interval_s=0.5, dead_after_s=3.0)
    metrics = RouterMetrics(registry)

    def restarts() -> float:
        text = metrics.render().decode()
        return {s.labels["worker"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "tandem_worker_restarts_total"}["w0"]

    for pid, expected in ((1, 0), (1, 0), (2, 1), (3, 2)):  # the same process again is no restart
        registry.register(RegisterWorker(worker_id="w0", role=WorkerRole.DECODE_ONLY, model_name="m", max_length=128,
                                         page_size=16, num_total_blocks=32, prefill_endpoint=None, pid=pid))
        assert restarts() == expected


def test_a_forgotten_worker_leaves_no_series_behind():
    """Workers started without --worker-id are named by host and pid: a series kept after the router forgot its
    worker would add up with every restart."""
    registry = WorkerRegistry(heartbeat_interval_s=0.5, dead_after_s=3.0)
    metrics = RouterMetrics(registry)
    decode = SimpleNamespace(worker_id="decode-host-41", num_cached_prompt_tokens=0)
    prefill = SimpleNamespace(worker_id="prefill-host-40", num_cached_prompt_tokens=16)
    metrics.note_route(SimpleNamespace(decode=decode, prefill=prefill, is_spilled=False), num_prompt_tokens=32)
    metrics.per_worker.note_first_token(("prefill-host-40", "decode-host-41"), 0.05)

    def labelled(worker_id: str) -> set[str]:
        text = metrics.render().decode()
        return {s.name for f in text_string_to_metric_families(text) for s in f.samples
                if s.labels.get("worker") == worker_id}

    assert "tandem_routed_requests_total" in labelled("decode-host-41")
    assert "tandem_routed_requests_total" in labelled("prefill-host-40")
    for worker_id in ("decode-host-41", "prefill-host-40"):
        metrics.forget_worker(worker_id)
        assert labelled(worker_id) == set()
    metrics.forget_worker("never-seen")  # a worker with no series is no error
