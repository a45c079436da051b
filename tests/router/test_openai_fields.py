"""Accepted means honoured: every field a request schema accepts is in docs/openai-api.md's tables (so a
new field cannot slip in undocumented), and every field it does not accept is a 400 naming it, over
real HTTP, before any worker is involved."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.responses_schema import ResponsesRequest
from router.tool_parsers import TOOL_PARSERS

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"
SCHEMAS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
           "/v1/responses": ResponsesRequest}
MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {"/v1/chat/completions": {"model": "tiny", "messages": MESSAGES},
        "/v1/completions": {"model": "tiny", "prompt": "hi"},
        "/v1/responses": {"model": "tiny", "input": "hi"}}

# Fields OpenAI's API defines that this server does not support, per endpoint, and what a client may send.
REFUSED = {
    "/v1/chat/completions": {"functions": [{"name": "f"}], "function_call": "auto", "reasoning_effort": "low",
                             "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content"},
                             "web_search_options": {}, "service_tier": "flex", "metadata": {"a": "b"},
                             "verbosity": "low", "some_future_field": 1},
    "/v1/completions": {"some_future_field": 1, "metadata": {"a": "b"}},
    "/v1/responses": {"reasoning": {"effort": "low"}, "background": True, "conversation": "conv_1",
                      "prompt": {"id": "pmpt_1"}, "service_tier": "flex", "max_tool_calls": 3},
}
REFUSED_VALUES = {
    "/v1/chat/completions": {"store": True, "modalities": ["text", "audio"],
                             "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
    "/v1/completions": {"suffix": "tail"},
    "/v1/responses": {"store": True, "previous_response_id": "resp_1", "include": ["message.output_text.logprobs"],
                      "truncation": "auto"},
}


def documented_fields(endpoint: str) -> set[str]:
    text = DOC.read_text()
    section = text.split(f"### {endpoint}\n", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))


@pytest.mark.parametrize("endpoint", list(SCHEMAS))
def test_every_accepted_field_is_documented(endpoint):
    schema = SCHEMAS[endpoint]
    accepted = {field.alias or name for name, field in schema.model_fields.items()}
    assert accepted == documented_fields(endpoint)
    assert schema.model_config.get("extra") == "forbid"


@pytest.mark.parametrize("endpoint, field", [(e, f) for e, fields in REFUSED.items() for f in fields])
def test_an_unsupported_field_is_a_400_naming_it(router, endpoint, field):
    body = dict(BASE[endpoint], **{field: REFUSED[endpoint][field]})
    response = httpx.post(f"{router.url}{endpoint}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("endpoint, field", [(e, f) for e, fields in REFUSED_VALUES.items() for f in fields])
def test_an_unsupported_value_is_a_400(router, endpoint, field):
    body = dict(BASE[endpoint], **{field: REFUSED_VALUES[endpoint][field]})
    response = httpx.post(f"{router.url}{endpoint}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


def test_a_boolean_field_takes_only_a_boolean(router):
    body = dict(BASE["/v1/chat/completions"], store=0)
    error = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10).json()["error"]
    assert error["param"] == "store" and "boolean" in error["message"]


def test_a_field_names_its_nested_place(router):
    body = dict(BASE["/v1/chat/completions"], messages=[{"role": "user", "content": "hi", "audio": {"id": "a"}}])
    error = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10).json()["error"]
    assert error["param"] == "messages.0.audio" and "not supported" in error["message"]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "21 C"}]}),  # no tool_call_id
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [dict(CALL, function={"name": "f"})]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        dict(CALL, function={"name": "f", "arguments": "{\"a\": \"\ud800\"}"})]}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "code_interpreter"}]}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL, TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "sometimes"}),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL]}),  # this template names no tool format
    ("/v1/chat/completions", {"messages": MESSAGES, "parallel_tool_calls": "yes"}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}),  # no stream
    ("/v1/completions", {"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}}),
    ("/v1/responses", {"input": [{"type": "function_call_output", "output": "x"}]}),
    ("/v1/responses", {"input": [{"type": "computer_call", "id": "c"}]}),
    ("/v1/responses", {"input": []}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
]


@pytest.mark.parametrize("endpoint, body", BAD_BODIES)
def test_bad_tool_and_item_shapes_are_400s_that_reach_no_worker(router, endpoint, body):
    worker = router.add_worker()
    raw = json.dumps({"model": "tiny", **body}).encode()  # ASCII escapes: a lone surrogate travels as JSON sends it
    response = httpx.post(f"{router.url}{endpoint}", content=raw, headers={"content-type": "application/json"},
                          timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] and worker.requests == []


def test_tools_without_a_parser_name_every_parser_there_is(router):
    body = {"model": "tiny", "messages": MESSAGES, "tools": [TOOL]}  # this template names no tool format
    message = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=10).json()["error"]["message"]
    assert f"--router-tool-call-parser {'|'.join(sorted(TOOL_PARSERS))}," in message and "deepseek_v31" in message


def test_a_function_call_output_may_be_a_list_of_text_parts():
    """The SDK types ``output`` as a string or a list of content parts (an Agents SDK tool returning
    ``ToolOutputText`` sends the list): its text is the tool message."""
    from router.responses_schema import chat_body

    items = [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_text", "text": "o"}, {"type": "input_text", "text": "k"}]}]
    messages = chat_body(ResponsesRequest.model_validate({"model": "tiny", "input": items}))["messages"]
    assert messages[-1] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}


def test_a_bad_input_item_is_told_what_is_wrong_with_it_as_that_item(router):
    bad = {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": "x"}]}
    error = httpx.post(f"{router.url}/v1/responses", json=dict(BASE["/v1/responses"], input=[bad]),
                       timeout=10).json()["error"]
    assert error["param"] == "input.0.output.0.type" and "input_text" in error["message"], error
    error = httpx.post(f"{router.url}/v1/responses", json=dict(BASE["/v1/responses"], input=[{"type": "weird"}]),
                       timeout=10).json()["error"]
    assert "must be message, function_call, function_call_output or reasoning" in error["message"], error


NULLABLE = {  # fields OpenAI types "... or null" that have a default here: null is that default
    "/v1/chat/completions": {"n": 1, "logprobs": False, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                             "stream": False, "parallel_tool_calls": True, "priority": 0},
    "/v1/completions": {"n": 1, "echo": False, "stream": False, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                        "priority": 0},
    "/v1/responses": {"stream": False, "parallel_tool_calls": True, "priority": 0},
}


@pytest.mark.parametrize("endpoint", list(NULLABLE))
def test_null_means_the_default(endpoint):
    body = SCHEMAS[endpoint].model_validate(dict(BASE[endpoint], **{f: None for f in NULLABLE[endpoint]}))
    assert {f: getattr(body, f) for f in NULLABLE[endpoint]} == NULLABLE[endpoint]
    assert SCHEMAS[endpoint].model_validate(dict(BASE[endpoint], seed=None)).seed is None  # a None default stays


def test_an_assistant_message_sent_back_as_the_sdk_dumps_it_is_taken():
    """``messages.append(completion.choices[0].message.model_dump())``: its ``refusal``, ``audio``,
    ``function_call`` and ``annotations`` are null, which asks for nothing; a non-null one is still refused."""
    from openai.types.chat import ChatCompletionMessage

    dumped = ChatCompletionMessage(role="assistant", content="a").model_dump()
    assert {k for k, v in dumped.items() if v is None} >= {"refusal", "audio", "function_call", "annotations"}
    body = ChatCompletionRequest.model_validate(dict(BASE["/v1/chat/completions"], messages=MESSAGES + [dumped]))
    assert body.messages[-1].content == "a"
    with pytest.raises(ValueError, match="refusal"):
        ChatCompletionRequest.model_validate(dict(BASE["/v1/chat/completions"],
                                                  messages=MESSAGES + [dict(dumped, refusal="no")]))


@pytest.mark.parametrize("endpoint", list(BASE))
def test_an_unknown_model_name_with_a_lone_surrogate_is_a_404_that_quotes_it(router, endpoint):
    raw = json.dumps(dict(BASE[endpoint], model="no\ud800such")).encode()  # JSON's escape of a lone surrogate
    response = httpx.post(f"{router.url}{endpoint}", content=raw, headers={"content-type": "application/json"},
                          timeout=10)
    assert response.status_code == 404, response.text
    assert "no\\ud800such" in response.json()["error"]["message"]
