"""The product as a user meets it: the official openai client against real clusters on loopback.

Each cluster shape (1 prefill + 1 decode over shared memory, 2 + 2 over ZMQ, colocated, and 1P1D and
colocated with the overlap pipeline) must return exactly transformers' greedy text; afterwards every
worker's KV blocks are back to the start value.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from tests.cluster.conftest import (CLUSTER_CONFIG, check_concurrent_greedy_streams, model_name, start_cluster,
                                    wait_for_idle_blocks)
from tests.conftest import hf_logprobs

SHAPES = {
    "1p1d-shm": dict(num_prefill=1, num_decode=1, config={"transfer": {"transport": "shm"}}),
    "2p2d-zmq": dict(num_prefill=2, num_decode=2, config={"transfer": {"transport": "zmq"}}),
    "colocated": dict(num_prefill=0, num_decode=0, num_colocated=1),
    # the overlap pipeline on every role: steps launched before the previous one's tokens are read
    "1p1d-overlap": dict(num_prefill=1, num_decode=1, config={"enable_overlap_scheduler": True}),
    "colocated-overlap": dict(num_prefill=0, num_decode=0, num_colocated=1, config={"enable_overlap_scheduler": True}),
}
PROMPTS = ["Hello there, how are you?", "The quick brown fox", "Paged attention keeps", "def main():\n"]
NUM_BLOCKS = CLUSTER_CONFIG["kv_cache"]["num_blocks"]


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request, tiny_checkpoint, tmp_path_factory):
    shape = SHAPES[request.param]
    c = start_cluster(tiny_checkpoint("llama"), tmp_path_factory.mktemp(f"logs-{request.param}"), **shape)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint, hf_reference):
    return hf_reference(tiny_checkpoint("llama"))[1]


def test_completions_match_transformers(cluster, client, tokenizer, reference_text):
    name = model_name(client)
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        want_ids, want_text = reference_text(ids, 16)
        out = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
        assert out.choices[0].text == want_text
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want_ids)
        assert out.usage.total_tokens == len(ids) + len(want_ids)
        stream = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
        assert chunks[-1].usage.completion_tokens == len(want_ids)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [out.choices[0].finish_reason]
    by_ids = client.completions.create(model=name, prompt=tokenizer(PROMPTS[0])["input_ids"], max_tokens=16,
                                       temperature=0)
    assert by_ids.choices[0].text == reference_text(tokenizer(PROMPTS[0])["input_ids"], 16)[1]


def test_chat_completions_match_transformers(cluster, client, tokenizer, reference_text):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paged attention?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want_ids, want_text = reference_text(ids, 20)
    out = client.chat.completions.create(model=model_name(client), messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == want_text
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want_ids)
    stream = client.chat.completions.create(model=model_name(client), messages=messages, max_tokens=20,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_text


def test_logprobs_match_transformers(cluster, client, tokenizer, hf_reference, tiny_checkpoint):
    from tests.conftest import hf_greedy

    model, _ = hf_reference(tiny_checkpoint("llama"))
    ids = tokenizer(PROMPTS[1])["input_ids"]
    out = client.completions.create(model=model_name(client), prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    generated = hf_greedy(model, ids, 6)  # greedy output is transformers' own, token for token
    assert out.choices[0].text == tokenizer.decode(generated, skip_special_tokens=True)
    assert len(logprobs.token_logprobs) == 6
    reference = hf_logprobs(model, ids + generated)
    for step, value in enumerate(logprobs.token_logprobs):
        row = reference[len(ids) - 1 + step]
        assert abs(value - row[generated[step]].item()) < 1e-4
        top3 = torch.topk(row, 3).values.tolist()
        # Keys are token strings (OpenAI format), so byte pieces that render alike may share one key.
        for top_value in logprobs.top_logprobs[step].values():
            assert min(abs(top_value - v) for v in top3) < 1e-4
    chat = client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_a_pd_stream_starts_with_the_prefill_workers_first_token(cluster, client, tokenizer, reference_text):
    """Under P/D the router streams the first token as the prefill worker sent it, beside the KV, and drops
    the decode worker's copy: still transformers' text, one logprob per token, each token once. Which copy
    reaches the router first is a race between two sockets (it is the prefill worker's unless the machine is
    loaded: a suite run on two busy cores once saw the decode worker's win), so up to three streams are sent
    until one starts early; whichever copy comes first, each stream's text and logprobs are exact."""
    ids = tokenizer(PROMPTS[3])["input_ids"]
    want_ids, want_text = reference_text(ids, 12)
    streamed_early = 0.0
    for _ in range(3 if cluster.num_prefill else 1):
        before = router_metric(cluster.url, "tandem_prefill_first_tokens_total")
        chunks = list(client.completions.create(model=model_name(client), prompt=ids, max_tokens=12, temperature=0,
                                                logprobs=1, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
        assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs) \
            == len(want_ids) > 1
        streamed_early = router_metric(cluster.url, "tandem_prefill_first_tokens_total") - before
        assert streamed_early in (0, 1)
        if streamed_early:
            break
    assert streamed_early == (1 if cluster.num_prefill else 0)


def router_metric(url: str, name: str) -> float:
    line = next(line for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines() if line.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def test_seeded_sampling_is_reproducible_across_requests(cluster, client):
    kwargs = dict(model=model_name(client), prompt=PROMPTS[2], max_tokens=12, temperature=0.9, seed=7,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_64_concurrent_streams_then_no_block_held(cluster, tokenizer, reference_text):
    check_concurrent_greedy_streams(cluster.url, reference_text, 64, seed=0)
    wait_for_idle_blocks(cluster.url, cluster.worker_names, NUM_BLOCKS)


def test_bad_requests_get_openai_errors_and_cluster_keeps_serving(cluster, client):
    name = model_name(client)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt="hi", max_tokens=0)
    assert "max_tokens" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="hi", top_p=1.5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="hi", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    out = client.completions.create(model=name, prompt="hi", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert math.isfinite(out.usage.total_tokens)
