"""The router's HTTP refusals: a bad request is a 4xx in OpenAI's error shape naming the field as the client sent
it, never reaches a worker, and counts once as rejected; the API key."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        (b"{not json", 400, None, "Invalid JSON"),
        ({"prompt": "Hi"}, 400, "model", "Field required"),
        ({"model": "tiny", "prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
        ({"model": "tiny", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "must be >= 1"),
        ({"model": "tiny", "prompt": "Hi", "temperature": -1}, 400, "temperature", "must be >= 0"),
        ({"model": "tiny", "prompt": "Hi", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
        ({"model": "tiny", "prompt": [5] * 60, "max_tokens": 10}, 400, "max_tokens", "maximum context length is 64"),
        ({"model": "tiny", "prompt": "Hi", "n": 0}, 400, "n", "must be in [1, 64]"),
        ({"model": "tiny", "prompt": "Hi", "n": 2, "best_of": 1}, 400, "best_of", "must be in [n, 64]"),
        ({"model": "tiny", "prompt": "Hi", "best_of": 3, "stream": True}, 400, "best_of", "stream"),
        ({"model": "nope", "prompt": "Hi"}, 404, "model", "does not exist"),
        ({"model": "tiny", "prompt": "Hi", "seed": 2**70}, 400, "seed", "less than or equal to 9223372036854775807"),
        ({"model": "tiny", "prompt": "Hi", "seed": -2**63 - 1}, 400, "seed", "greater than or equal"),
        # past 64 bits: it used to be admitted and fail its dispatch with a 500 (the frame cannot carry it)
        ({"model": "tiny", "prompt": "Hi", "top_k": 2**64}, 400, "top_k", "less than or equal to 9223372036854775807"),
        # past float32: it used to reach the sampler as inf (a grammar then refused the NaN draw: a 500)
        ({"model": "tiny", "prompt": "Hi", "temperature": 1e39}, 400, "temperature", "a float32"),
    ],
)
def test_bad_requests_never_reach_a_worker(router, body, status, param, words):
    worker = router.add_worker()
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{router.url}/v1/completions", **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert worker.requests == []
    assert router.metric('tandem_requests_total{outcome="rejected"}') == 1


def test_every_refused_generation_request_counts_once_as_rejected_and_other_endpoints_not_at_all(router_factory):
    router = router_factory(api_key="sekret")
    router.add_worker()
    key = {"Authorization": "Bearer sekret"}
    refused = [httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "Hi"}),  # no key: 401
               httpx.post(f"{router.url}/v1/chat/completions", headers=key, json={"model": "tiny"}),  # 400
               httpx.get(f"{router.url}/v1/completions", headers=key),  # 405
               httpx.post(f"{router.url}/v1/responses", headers=key, json={"model": "nope", "input": "Hi"})]  # 404
    assert [r.status_code for r in refused] == [401, 400, 405, 404]
    assert httpx.post(f"{router.url}/tokenize", headers=key, json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.post(f"{router.url}/tokenize", headers=key, json={"model": "tiny", "prompt": "x"}).status_code == 200
    assert httpx.post(f"{router.url}/v1/nowhere", headers=key, json={}).status_code == 404
    assert router.metric('tandem_requests_total{outcome="rejected"}') == 4
    assert router.metric('tandem_requests_total{outcome="ok"}') == 0


def test_openai_client_sees_bad_request_errors(router, client):
    router.add_worker()
    with pytest.raises(openai.BadRequestError, match="n: must be in"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=65)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi")


def test_api_key(router_factory):
    router = router_factory(api_key="sekret")
    router.add_worker()
    url = f"{router.url}/v1/completions"
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        response = httpx.post(url, json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{router.url}/v1/models").status_code == 401
    # the key before anything of the body is read, as vLLM answers: a body that is not JSON is no 400 without a key
    not_json = httpx.post(url, content=b"{bad", headers={"content-type": "application/json"})
    assert not_json.status_code == 401 and not_json.headers["www-authenticate"] == "Bearer", not_json.text
    assert httpx.post(f"{router.url}/tokenize", json={"model": "tiny", "prompt": "x"}).status_code == 401
    assert httpx.post(url, content=b"{bad", headers={"content-type": "application/json",
                                                    "Authorization": "Bearer sekret"}).status_code == 400
    assert httpx.get(f"{router.url}/health").status_code == 200 and httpx.get(f"{router.url}/metrics").status_code == 200
    good = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sekret", max_retries=0, timeout=10)
    assert good.completions.create(**body).choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{router.url}/v1", api_key="bad", max_retries=0).completions.create(**body)


def test_a_completion_budget_past_the_context_is_named_as_the_client_sent_it(router):
    router.add_worker()
    for field in ("max_tokens", "max_completion_tokens"):
        response = httpx.post(f"{router.url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], field: 1000})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field and f"or {field}." in error["message"], error


def test_a_body_without_a_json_content_type_is_told_so(router):
    body = '{"model": "tiny", "prompt": "Hi", "max_tokens": 3}'
    response = httpx.post(f"{router.url}/v1/completions", content=body,
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 400
    assert "Content-Type: application/json" in response.json()["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": -5},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": -5}, "max_tokens"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": -3}, "max_output_tokens"),
])
def test_a_400_names_the_field_the_client_sent(router, path, body, param):
    router.add_worker()
    response = httpx.post(f"{router.url}{path}", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error


def test_a_response_format_key_the_format_lacks_is_a_400_naming_it(router):
    """They were accepted and dropped (an audit): a client's intent lost without a word, where every other nested
    object's unknown keys are a 400."""
    router.add_worker()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for response_format, param in [
        ({"type": "json_object", "bogus": 1}, "response_format.bogus"),
        ({"type": "text", "bogus": 1}, "response_format.bogus"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "bogus": 1}},
         "response_format.json_schema.bogus"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}, "schema": {"type": "string"}},
         "response_format.schema"),
    ]:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/completions", {"prompt": "Hi"})):
            response = httpx.post(f"{router.url}{path}", json={"model": "tiny", "max_tokens": 2, **body,
                                                               "response_format": response_format})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    accepted = {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": schema,
                                                         "strict": True}}
    response = httpx.post(f"{router.url}/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "response_format": accepted})
    assert response.status_code == 200, response.text
