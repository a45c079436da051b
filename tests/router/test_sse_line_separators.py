"""Answers containing U+0085 / U+2028 / U+2029 stream whole to line-splitting readers (httpx's
``aiter_lines``, which splits as ``str.splitlines`` does) and to the official SDK, on every SSE path."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pipeline.protocol.cluster import FinishCode
from router.sse import json_for_sse, sse_event
from tests.router.fake_worker import tokens_script

TEXT = "a\u2028b\u2029c\u0085d \u2028\u2028 end"


def test_separators_are_escaped_and_the_json_is_unchanged():
    payload = {"text": TEXT, "nested": [{"x": "\u2029"}], "plain": "é ✓ \U0001F600"}
    data = json_for_sse(payload)
    assert b"\xe2\x80\xa8" not in data and b"\xe2\x80\xa9" not in data and b"\xc2\x85" not in data
    assert json.loads(data) == payload
    assert len(data.decode().splitlines()) == 1
    assert sse_event(payload, event="x").decode().splitlines()[:2] == ["event: x", "data: " + data.decode()]


async def _read_events(url: str, path: str, body: dict) -> list[dict]:
    events = []
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", url + path, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():  # splits at U+2028 etc. like str.splitlines
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))  # a split event would not parse
    return events


@pytest.fixture
def text_router(router, served_model):
    ids = served_model.tokenizer.encode(TEXT)
    assert served_model.tokenizer.decode(ids) == TEXT
    router.add_worker(script=tokens_script(ids, finish=FinishCode.STOP))
    return router


def test_completions_and_chat_streams_read_back_whole_line_by_line(text_router):
    completions = asyncio.run(_read_events(text_router.url, "/v1/completions",
                                           {"model": "tiny", "prompt": "Hi", "max_tokens": 40, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in completions if e["choices"]) == TEXT
    chat = asyncio.run(_read_events(text_router.url, "/v1/chat/completions",
                                    {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chat if e["choices"]) == TEXT


def test_responses_stream_reads_back_whole_line_by_line(text_router):
    events = asyncio.run(_read_events(text_router.url, "/v1/responses",
                                      {"model": "tiny", "input": "Hi", "stream": True}))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == TEXT
    assert events[-1]["type"] == "response.completed"


def test_official_sdk_streams_read_back_whole(text_router):
    client = openai.OpenAI(base_url=f"{text_router.url}/v1", api_key="unused", max_retries=0, timeout=10)
    stream = client.completions.create(model="tiny", prompt="Hi", max_tokens=40, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == TEXT
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == TEXT
    with client.responses.stream(model="tiny", input="Hi") as events:
        assert events.get_final_response().output_text == TEXT
