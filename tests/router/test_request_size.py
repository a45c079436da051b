"""Large request bodies: refused with 413 before they are read past the bound, and what passes is tokenized off
the event loop, so one heavy request never stalls the other clients' streams or the health checks."""

from __future__ import annotations

import dataclasses
import threading

import httpx
import pytest

from tests.router.conftest import RouterServer
from tests.router.fake_worker import tokens_script

LIMIT = {"config": {"router": {"max_local_prefill_length": 0, "max_request_body_mib": 0.05}}}  # 52,428 bytes


def assert_too_large(response: httpx.Response) -> None:
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "0.05 MiB" in error["message"] and "router.max_request_body_mib" in error["message"]


def test_a_body_over_the_bound_gets_413_and_the_router_serves_on(router_factory, served_model):
    router = router_factory(**LIMIT)
    router.add_worker(script=tokens_script(served_model.tokenizer.encode("fine"), step_s=0.0))
    body = {"model": "tiny", "prompt": "a " * 40_000, "max_tokens": 2}  # ~80 KB, with a Content-Length
    assert_too_large(httpx.post(f"{router.url}/v1/completions", json=body, timeout=10))

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(20):
            yield b"a " * 4000
        yield b'"}'
    response = httpx.post(f"{router.url}/v1/chat/completions", content=chunked(),
                          headers={"content-type": "application/json"}, timeout=10)
    assert_too_large(response)
    small = b'{"model": "tiny", "max_tokens": 2, "prompt": "' + b"a " * 20 + b'"}'
    ok = httpx.post(f"{router.url}/v1/completions", content=small, headers={"content-type": "application/json"},
                    timeout=10)
    assert ok.status_code == 200, ok.text
    ok = httpx.post(f"{router.url}/v1/completions", content=iter([small[:10], small[10:]]),  # chunked, under the bound
                    headers={"content-type": "application/json"}, timeout=10)
    assert ok.status_code == 200, ok.text
    assert router.metric('tandem_requests_total{outcome="rejected"}') == 2  # the two 413s


class HeldTokenizer:
    """The served tokenizer, except that encoding a prompt waits until the test lets it go."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(30), "the test never released the tokenizer"
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_tokenizing_a_prompt_does_not_hold_up_the_event_loop(served_model, path):
    held = HeldTokenizer(served_model.tokenizer)
    router = RouterServer(dataclasses.replace(served_model, tokenizer=held)).start()
    try:
        router.add_worker(script=tokens_script(served_model.tokenizer.encode("fine"), step_s=0.0))
        result = {}
        body = {"model": "tiny", "prompt": "a long prompt", **({"max_tokens": 2} if path == "/v1/completions" else {})}
        thread = threading.Thread(target=lambda: result.setdefault(
            "response", httpx.post(f"{router.url}{path}", json=body, timeout=30)))
        thread.start()
        assert held.entered.wait(10)
        # the prompt is being tokenized (held): the loop still answers
        assert httpx.get(f"{router.url}/health", timeout=5).json() == {"status": "ok"}
        assert httpx.get(f"{router.url}/v1/models", timeout=5).status_code == 200
        held.release.set()
        thread.join(30)
        assert result["response"].status_code == 200, result["response"].text
    finally:
        held.release.set()
        router.stop()
