"""Speculative decoding through real clusters: 1P1D, where the prefill worker prefills the draft too and
its KV ships with the target's, and colocated. Greedy text is transformers' own; the draft's KV arrives
intact (a self-draft accepts everything on the decode worker); acceptance is on /metrics; no block leaks."""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import (CLUSTER_CONFIG, check_concurrent_greedy_streams, running_cluster,
                                    wait_for_idle_blocks, worker_metric)
from tests.conftest import hf_greedy, hf_logprobs

NUM_BLOCKS = CLUSTER_CONFIG["kv_cache"]["num_blocks"]
# name: (prefill workers, decode workers, colocated workers, draft kind of tests/conftest.py's ``drafts``)
SHAPES = {
    "1p1d-self": (1, 1, 0, "self"),
    "1p1d-small": (1, 1, 0, "small"),
    "1p1d-wrong": (1, 1, 0, "wrong"),
    "colocated-small": (0, 0, 1, "small"),
}
PROMPTS = ["Hello there, how are you?", "The quick brown fox", "def main():\n"]


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tiny_checkpoint, drafts, tmp_path_factory):
    num_prefill, num_decode, num_colocated, kind = SHAPES[request.param]
    config = {"draft_model": {"model_path": drafts("llama", kind)}, "speculative": {"num_speculative_tokens": 3}}
    with running_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp(f"logs-spec-{request.param}"),
                         num_prefill=num_prefill, num_decode=num_decode, num_colocated=num_colocated,
                         config=config) as c:
        c.draft_kind = kind
        yield c


def decoding_worker(cluster) -> str:
    return next(name for name in cluster.worker_names if "prefill" not in name)


def test_greedy_text_and_logprobs_match_transformers(cluster, client, tiny_checkpoint, hf_reference):
    model, tokenizer = hf_reference(tiny_checkpoint("llama"))
    name = client.models.list().data[0].id
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        want = hf_greedy(model, ids, 24)
        out = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
        assert out.usage.completion_tokens == 24
        reference = hf_logprobs(model, ids + want)
        for step, value in enumerate(out.choices[0].logprobs.token_logprobs):
            assert abs(value - reference[len(ids) - 1 + step, want[step]].item()) < 1e-4
        stream = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == out.choices[0].text


def test_acceptance_is_on_metrics_and_in_the_serving_benchmark_report(cluster, client):
    from bench.tandem_scrape import run_report, scrape, wait_until_idle

    before = wait_until_idle(cluster.url)
    name = client.models.list().data[0].id
    client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                              extra_body={"ignore_eos": True})
    worker = decoding_worker(cluster)
    for _ in range(50):  # heartbeats carry the counters (every 0.5 s)
        if (worker_metric(cluster.url, "tandem_spec_decode_num_drafts_total", worker) or 0) > before.spec_drafts:
            break
        time.sleep(0.1)
    draft_tokens = worker_metric(cluster.url, "tandem_spec_decode_num_draft_tokens_total", worker)
    accepted = worker_metric(cluster.url, "tandem_spec_decode_num_accepted_tokens_total", worker)
    first_position = worker_metric(cluster.url, "tandem_spec_decode_num_accepted_tokens_per_pos_total", worker)
    assert draft_tokens > 0 and first_position is not None
    if cluster.draft_kind == "self":
        # the decode worker's draft KV of the prompt came from the prefill worker: wrong KV would miss
        assert accepted == draft_tokens
    if cluster.draft_kind == "wrong":
        assert accepted < draft_tokens / 2
    report = run_report(before, wait_until_idle(cluster.url) or scrape(cluster.url), num_completed=1)
    spec = report["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0 and 1.0 <= spec["mean_acceptance_length"] <= 4.0
    assert len(spec["acceptance_rate_per_position"]) == 3
    if cluster.draft_kind == "self":
        assert spec["acceptance_rate"] == 1.0


def test_seeded_sampling_is_reproducible(cluster, client):
    kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPTS[2], max_tokens=16, temperature=0.9,
                  top_p=0.95, seed=7, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_32_concurrent_streams_then_no_block_held(cluster, reference_text):
    check_concurrent_greedy_streams(cluster.url, reference_text, 32, seed=1)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)
