"""The router over real HTTP (httpx and the official openai client) against a scripted fake worker."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from pipeline.config import PipelineRole
from pipeline.protocol.cluster import FinishCode, WorkerLoad
from tests.router.fake_worker import tokens_script


TEXT = "Hello there, how are you? Paris is the capital of France."


@pytest.fixture
def text_ids(served_model):
    return served_model.tokenizer.encode(TEXT)


def test_ready_health_and_models(router):
    response = httpx.get(f"{router.url}/ready")
    assert response.status_code == 503 and response.json()["ready"] is False
    assert "no live workers" in response.json()["reason"]
    assert httpx.get(f"{router.url}/health").json() == {"status": "ok"}
    router.add_worker()
    assert router.wait_ready(True)
    body = httpx.get(f"{router.url}/ready").json()
    assert body["ready"] and len(body["workers"]) == 1
    assert body["workers"][0] == {"worker_id": "w0", "role": "PrefillAndDecode", "alive": True, "pid": os.getpid(),
                                  "rank_pids": [], "busy_in_step_s": 0.0, "draining": False}
    models = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 64


def test_max_model_len_is_what_the_workers_kv_pools_hold_when_that_is_less(router):
    """A worker whose KV pool holds 48 tokens of the model's 64: /v1/models says 48, as the 400 for a longer
    prompt does (an audit saw 2048 advertised by workers of 1024)."""
    worker = router.add_worker(max_length=48)
    assert router.wait_ready(True)
    assert httpx.get(f"{router.url}/v1/models").json()["data"][0]["max_model_len"] == 48
    # and max_tokens is held to it, as the prompt is: accepted, it was cut short at the pool's end without a word
    for path, body in (("/v1/completions", {"prompt": [5] * 40, "max_tokens": 10}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 47}),
                       ("/v1/responses", {"input": "Hi", "max_output_tokens": 47})):
        response = httpx.post(f"{router.url}{path}", json={"model": "tiny", **body})
        assert response.status_code == 400 and "maximum context length is 48" in response.text, (path, response.text)
    # unset, max_tokens is the rest of that context
    assert httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": [5] * 40}).status_code == 200
    assert worker.requests[-1].sampling_params.max_tokens == 8


def test_no_worker_is_503_with_an_openai_body(router):
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 503
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "no live workers" in error["message"]


def test_completion_non_streaming(router, text_ids, served_model):
    worker = router.add_worker(script=tokens_script(text_ids))
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 40})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == TEXT and body["choices"][0]["finish_reason"] == "length"
    num_prompt = len(served_model.tokenizer.encode("Hi"))
    assert body["usage"]["prompt_tokens"] == num_prompt and body["usage"]["completion_tokens"] == len(text_ids)
    assert body["usage"]["total_tokens"] == num_prompt + len(text_ids)
    request = worker.requests[0]
    assert request.request_id == body["id"] and request.prompt_token_ids == served_model.tokenizer.encode("Hi")
    assert request.prefill_endpoint is None and request.sampling_params.max_tokens == 40


def test_openai_client_completions(router, client, text_ids):
    router.add_worker(script=tokens_script(text_ids))
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=40, temperature=0)
    assert completion.choices[0].text == TEXT and completion.usage.completion_tokens == len(text_ids)
    stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=40, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(text_ids)


def test_openai_client_chat(router, client, text_ids, served_model):
    worker = router.add_worker(script=tokens_script(text_ids, finish=FinishCode.STOP))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=40)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == TEXT
    assert reply.choices[0].finish_reason == "stop" and reply.object == "chat.completion"
    expected = served_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "input_ids") else expected
    assert worker.requests[0].prompt_token_ids == list(expected)
    assert reply.usage.prompt_tokens == len(expected) and reply.usage.prompt_tokens_details.cached_tokens == 3
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None


def test_logprobs_formatting(router, client, served_model):
    ids = served_model.tokenizer.encode("Hello there")
    router.add_worker(script=tokens_script(ids, logprobs=True))
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == "Hello there" and lp.token_logprobs == [-0.5 - i for i in range(len(ids))]
    assert lp.text_offset[0] == 0 and len(lp.top_logprobs) == len(ids)
    assert lp.top_logprobs[0][lp.tokens[0]] == -0.5 and len(lp.top_logprobs[0]) == 3  # sampled + top-2
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           logprobs=True, top_logprobs=2, max_tokens=10)
    content = reply.choices[0].logprobs.content
    assert "".join(c.token for c in content) == "Hello there"
    assert content[0].logprob == -0.5 and content[0].bytes == list(content[0].token.encode())
    assert [t.logprob for t in content[0].top_logprobs] == [-1.0, -2.0]
    assert content[0].top_logprobs[0].token == served_model.token_text(ids[0] + 1)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            logprobs=True, top_logprobs=1, max_tokens=10, stream=True)
    streamed = [e.token for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(streamed) == "Hello there"


def test_stop_string_truncates_and_cancels_the_worker(router, client, text_ids):
    worker = router.add_worker(script=tokens_script(text_ids, step_s=0.02))
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=40, stop=["how are"])
    assert completion.choices[0].text == "Hello there, " and completion.choices[0].finish_reason == "stop"
    assert worker.wait_for(lambda: completion.id in worker.cancels)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 stop="Paris", stream=True, max_tokens=40))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there, how are you? "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert worker.wait_for(lambda: chunks[0].id in worker.cancels)


def test_disaggregated_route_and_readiness(router):
    decode = router.add_worker("d0", role=PipelineRole.DecodeOnly)
    assert router.wait_ready(True)  # alone, a DecodeOnly worker prefills locally
    assert "prefilling locally" in httpx.get(f"{router.url}/ready").json()["reason"]
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200, response.text
    local = decode.requests[0]
    assert local.prefill_worker_id is None and local.prefill_endpoint is None
    router.add_worker("p0", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p0-prefill")
    assert router.wait_ready(True)
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 200
    request = decode.requests[1]
    assert request.prefill_worker_id == "p0" and request.prefill_endpoint == "ipc:///tmp/p0-prefill"
    assert 0 < request.deadline_s <= 10.0


def test_short_prompts_prefill_on_the_decode_worker(router_factory, served_model):
    router = router_factory(config={"router": {"max_local_prefill_length": 4}})
    decode = router.add_worker("d0", role=PipelineRole.DecodeOnly)
    router.add_worker("p0", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p0-prefill")
    long_prompt = "Hello there, how are you? Paris is the capital of France."
    assert len(served_model.tokenizer.encode("Hi")) <= 4 < len(served_model.tokenizer.encode(long_prompt))
    for prompt in ("Hi", long_prompt):
        response = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3})
        assert response.status_code == 200, response.text
    short, long = decode.requests
    assert short.prefill_endpoint is None and long.prefill_worker_id == "p0"


def test_only_prefill_workers_is_not_ready_and_503(router):
    router.add_worker("p0", role=PipelineRole.PrefillOnly, prefill_endpoint="ipc:///tmp/p0-prefill")
    assert router.wait_ready(False)
    response = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 503 and "decode-capable" in response.json()["error"]["message"]


def test_metrics_expose_worker_kv_gauges_and_request_counts(router):
    load = WorkerLoad(num_free_blocks=52, num_used_blocks=12, num_total_blocks=64, num_running=2, num_waiting=1,
                      transfer_bytes=4096, transfer_seconds=0.5, transfer_busy_seconds=0.125)
    router.add_worker(load=load)
    assert httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}).status_code == 200
    text = httpx.get(f"{router.url}/metrics").text
    labels = '{role="PrefillAndDecode",worker="w0"}'
    for line in (f"tandem_kv_blocks_used{labels} 12.0", f"tandem_kv_blocks_free{labels} 52.0",
                 f"tandem_kv_blocks_capacity{labels} 64.0", f"tandem_worker_queue_depth{labels} 1.0",
                 f"tandem_kv_transfer_bytes_total{labels} 4096.0", f"tandem_worker_up{labels} 1.0",
                 f"tandem_kv_transfer_seconds_total{labels} 0.5", f"tandem_kv_transfer_busy_seconds_total{labels} 0.125",
                 'tandem_requests_total{outcome="ok"} 1.0', "tandem_time_to_first_token_seconds_count 1.0",
                 "tandem_router_queue_depth 0.0", "tandem_requests_in_flight 0.0"):
        assert line in text, line


def test_content_parts_reach_a_template_as_it_reads_them(router, served_model):
    """vLLM's two content formats: a template that loops over a message's content gets the parts; any other gets
    their texts joined by newlines (they were joined with nothing)."""
    from router.chat_messages import walks_content_parts

    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    as_string = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    as_parts = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}|{% endfor %}"
    assert not walks_content_parts(as_string) and walks_content_parts(as_parts)
    assert walks_content_parts("{%- for item in message.content %}") and not walks_content_parts(None)
    for template, text in ((as_string, "Hello\nworld|"), (as_parts, "<Hello><world>|")):
        body = httpx.post(f"{router.url}/tokenize", json={"messages": messages, "chat_template": template,
                                                          "add_generation_prompt": False}).json()
        assert body["tokens"] == served_model.tokenizer.encode(text, add_special_tokens=False), (template, body)


def test_tokenize_and_detokenize_in_vllms_shapes(router, served_model):
    tokenizer = served_model.tokenizer
    text = "Hello there, how are you?"
    body = httpx.post(f"{router.url}/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert body["tokens"] == tokenizer(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == served_model.max_length and body["token_strs"] is None
    plain = httpx.post(f"{router.url}/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                        "return_token_strs": True}).json()
    assert plain["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{router.url}/tokenize", json={"messages": messages}).json()
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    back = httpx.post(f"{router.url}/detokenize", json={"tokens": body["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(body["tokens"])}
    info = httpx.get(f"{router.url}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    for path, bad, status in (("/tokenize", {"prompt": "x", "truncate": 3}, 400),
                              ("/tokenize", {"prompt": 5}, 400),
                              ("/tokenize", {"model": "other", "prompt": "x"}, 404),
                              ("/detokenize", {"tokens": [10**9]}, 400)):
        response = httpx.post(f"{router.url}{path}", json=bad)
        assert response.status_code == status and "error" in response.json(), (path, bad, response.text)


def test_cors_preflight_and_headers(router_factory):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    open_router = router_factory()  # vLLM's default: any origin
    response = httpx.options(f"{open_router.url}/v1/chat/completions", headers=preflight)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] in ("*", "https://app.example")
    listed = router_factory(config={"router": {"max_local_prefill_length": 0,
                                               "cors_allowed_origins": "https://app.example"}})
    assert httpx.options(f"{listed.url}/v1/completions", headers=preflight).status_code == 200
    other = httpx.options(f"{listed.url}/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    models = httpx.get(f"{listed.url}/v1/models", headers={"Origin": "https://app.example"})
    assert models.headers["access-control-allow-origin"] == "https://app.example"
    closed = router_factory(config={"router": {"max_local_prefill_length": 0, "cors_allowed_origins": ""}})
    assert httpx.options(f"{closed.url}/v1/completions", headers=preflight).status_code == 405


def test_served_model_names_and_aliases(served_model, tiny_checkpoint):
    import dataclasses

    from router.served_model import load_served_model
    from tests.router.conftest import RouterServer

    loaded = load_served_model(tiny_checkpoint("llama"), served_names="team-model, alias-b")
    assert loaded.names == ["team-model", "alias-b"] and loaded.checkpoint_name == os.path.basename(
        tiny_checkpoint("llama"))
    named = dataclasses.replace(served_model, name="team-model", aliases=("alias-b",), checkpoint_name="tiny")
    router = RouterServer(named).start()
    try:
        router.add_worker(script=tokens_script(served_model.tokenizer.encode(" there")))  # registers as "tiny"
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["team-model", "alias-b"]
        for name in ("team-model", "alias-b"):
            out = client.completions.create(model=name, prompt="Hi", max_tokens=3)
            assert out.model == "team-model" and out.choices[0].text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    finally:
        router.stop()


def test_vllm_stream_and_logprob_extras(router, client, served_model):
    ids = served_model.tokenizer.encode("Hello there")
    router.add_worker(script=tokens_script(ids, logprobs=True))
    stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [c for c in stream if c.choices]
    assert chunks and all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks] == sorted(c.usage.completion_tokens for c in chunks)
    assert chunks[-1].usage.completion_tokens == len(ids)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
                                          stream=True, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": True})
    chat_chunks = [c for c in chat if c.choices]
    assert chat_chunks[0].choices[0].delta.role == "assistant"  # the role chunk carries it too, as vLLM's does
    assert all(c.usage is not None for c in chat_chunks)
    plain = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, stream=True,
                                      stream_options={"include_usage": True})
    assert all(c.usage is None for c in plain if c.choices)
    as_ids = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert as_ids.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert as_ids.choices[0].text == "Hello there"


def test_a_prompt_no_workers_kv_pool_holds_is_a_400_not_a_503(router, client):
    """A worker whose KV pool is shorter than the model's context registers what it holds: a prompt longer than
    that on every worker is the client's to shorten (openai's BadRequestError, code context_length_exceeded;
    LangChain and LiteLLM act on it), not a 503 that SDKs retry. Nothing is sent to the worker."""
    worker = router.add_worker(max_length=16)
    rejected = router.metric('tandem_requests_total{outcome="rejected"}')
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=list(range(5, 25)), max_tokens=2)
    assert info.value.code == "context_length_exceeded" and "maximum context length is 16" in info.value.message
    assert router.metric('tandem_requests_total{outcome="rejected"}') == rejected + 1 and worker.requests == []
    assert client.completions.create(model="tiny", prompt=list(range(5, 10)), max_tokens=2).choices  # it fits


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(router, monkeypatch):
    """A bug's exception: an OpenAI-shaped 500, counted, and the client's keep-alive connection still works."""
    import router.app as app_module

    def broken(*_args, **_kwargs):
        raise OverflowError("a bug")
    monkeypatch.setattr(app_module, "prepare_completion", broken)
    router.add_worker()
    errors_before = router.metric('tandem_requests_total{outcome="error"}')
    with httpx.Client(base_url=router.url, timeout=10) as http:
        for _ in range(2):  # the second on the same connection
            response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi"})
            assert response.status_code == 500
            assert response.json()["error"] == {"message": "internal error: OverflowError", "type": "internal_error",
                                                "param": None, "code": None}
        assert http.get("/health").status_code == 200
    assert router.metric('tandem_requests_total{outcome="error"}') == errors_before + 2


def test_the_sdk_retrieves_the_served_model_by_name(router, client):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_responses_take_vllms_sampling_extras(router):
    """vllm bench serve --backend openai-responses sends ignore_eos on every request; the other extras vLLM's
    Responses endpoint takes reach the worker too."""
    worker = router.add_worker()
    response = httpx.post(f"{router.url}/v1/responses", json={
        "model": "tiny", "input": "Hi", "max_output_tokens": 4, "ignore_eos": True, "repetition_penalty": 1.1,
        "stop": ["zz"], "stop_token_ids": [3], "min_tokens": 2, "min_p": 0.05, "top_k": 5}, timeout=10)
    assert response.status_code == 200, response.text
    params = worker.requests[0].sampling_params
    assert params.ignore_eos and params.repetition_penalty == 1.1 and params.stop == ["zz"]
    assert params.stop_token_ids == [3] and params.min_tokens == 2 and params.min_p == 0.05 and params.top_k == 5
