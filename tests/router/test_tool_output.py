"""Tool calls and reasoning read out of scripted answers, over real HTTP with the official openai client:
a fake worker emits exactly the tokens of a text, so every parser path (content before a call, several
calls, a broken call, thinking, the Responses API's items and events) is checked token by token."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pipeline.protocol.cluster import FinishCode
from router.served_model import load_served_model
from tests.router.conftest import RouterServer
from tests.router.fake_worker import tokens_script
from tests.tool_checkpoint import build_tool_checkpoint

MAX_LENGTH = 4096
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    path = build_tool_checkpoint(tmp_path_factory.mktemp("tool-router"))
    return load_served_model(str(path), max_length=MAX_LENGTH, name="tiny")


@pytest.fixture
def serve(tool_model):
    """``serve(text, **config)`` -> an openai client of a router whose one worker answers ``text``."""
    servers = []

    def make(text: str, finish: FinishCode = FinishCode.STOP, **config) -> openai.OpenAI:
        server = RouterServer(tool_model, config={"router": {"max_local_prefill_length": 0, **config}}).start()
        servers.append(server)
        ids = tool_model.tokenizer(text, add_special_tokens=False)["input_ids"]
        server.add_worker(script=tokens_script(ids, finish=finish), max_length=MAX_LENGTH)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10)
        client.server = server
        return client

    yield make
    for server in servers:
        server.stop()


def streamed(client, **body):
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **body):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("text, content, arguments", [
    (CALL, None, [{"city": "Paris"}]),
    ("Let me check.\n" + CALL + "\n", "Let me check.", [{"city": "Paris"}]),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), None, [{"city": "Paris"}, {"city": "Rome"}]),
])
def test_calls_are_read_out_of_the_answer(serve, text, content, arguments):
    client = serve(text)
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == arguments
    assert all(c.function.name == "get_weather" and c.id.startswith("call_") for c in choice.message.tool_calls)
    got_content, _, calls, finish = streamed(client, messages=ASK, tools=TOOLS, max_tokens=200)
    assert finish == "tool_calls" and got_content == (content or "")
    assert [json.loads(c["arguments"]) for c in calls] == arguments and all(c["id"] for c in calls)


def test_a_broken_call_or_no_tools_leaves_the_text_as_content(serve):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    client = serve(broken)
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == broken and choice.finish_reason == "stop"
    assert streamed(client, messages=ASK, tools=TOOLS, max_tokens=200)[0] == broken
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200).choices[0]  # no tools offered
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=200).choices[0]
    assert plain.message.content == none.message.content == broken


def test_a_call_cut_by_the_token_limit_is_content(serve):
    client = serve(CALL, finish=FinishCode.LENGTH)
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=10).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert CALL.startswith(choice.message.content)
    assert streamed(client, messages=ASK, tools=TOOLS, max_tokens=10)[0] == choice.message.content


def test_reasoning_goes_to_reasoning_content(serve):
    client = serve("<think>\nThe user wants weather.\n</think>\n\nIt is sunny.", reasoning_parser="think")
    message = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200).choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants weather." and message.content == "It is sunny."
    content, reasoning, _, _ = streamed(client, messages=ASK, max_tokens=200)
    assert (reasoning, content) == ("The user wants weather.", "It is sunny.")
    hidden = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200,
                                            extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.model_extra["reasoning_content"] is None and hidden.content == "It is sunny."


def test_reasoning_then_a_call(serve):
    client = serve("<think>\nI need the tool.\n</think>\n\n" + CALL, reasoning_parser="think")
    choice = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "I need the tool."
    assert choice.finish_reason == "tool_calls" and json.loads(choice.message.tool_calls[0].function.arguments)
    content, reasoning, calls, finish = streamed(client, messages=ASK, tools=TOOLS, max_tokens=200)
    assert (content, reasoning, finish) == ("", "I need the tool.", "tool_calls") and len(calls) == 1


def test_thinking_turned_off_in_the_template_is_all_content(serve, tool_model):
    client = serve("<think> is a tag.", reasoning_parser="think")
    out = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=200,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == "<think> is a tag."
    want = tool_model.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False,
                                                    tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert out.usage.prompt_tokens == len(want)
    tokens = httpx.post(f"{client.server.url}/tokenize", json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    assert tokens == want


def test_responses_items_follow_the_answer(serve, tool_model):
    thinking = "hm, the weather in Paris"
    client = serve(f"<think>\n{thinking}\n</think>\n\nChecking.\n" + CALL, reasoning_parser="think")
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    out = client.responses.create(model="tiny", input="Weather?", tools=tools, max_output_tokens=200)
    assert [item.type for item in out.output] == ["reasoning", "message", "function_call"]
    assert out.output[0].content[0].text == thinking and out.output[1].content[0].text == "Checking."
    thinking_tokens = len(tool_model.tokenizer(thinking, add_special_tokens=False)["input_ids"])
    assert out.usage.output_tokens_details.reasoning_tokens == thinking_tokens > 1
    assert json.loads(out.output[2].arguments) == {"city": "Paris"} and out.output[2].name == "get_weather"
    assert out.status == "completed" and out.usage.output_tokens > 0
    with client.responses.stream(model="tiny", input="Weather?", tools=tools, max_output_tokens=200) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[1].content[0].text == "Checking." and final.output[2].arguments == out.output[2].arguments


def test_responses_incomplete_and_errors(serve):
    client = serve("abc def", finish=FinishCode.LENGTH)
    out = client.responses.create(model="tiny", input=[{"role": "user", "content": "x"}], max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[-1].status == "incomplete"  # the item that was cut, as OpenAI marks it
    assert (out.temperature, out.top_p) == (1.0, 1.0)  # what ran, not null: the request left them unset
    for bad in (dict(store=True), dict(previous_response_id="resp_1"), dict(extra_body={"background": True}),
                dict(include=["reasoning.encrypted_content"])):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="tiny", input="x", **bad)


def test_responses_whole_and_streamed_hold_the_same_items_in_the_models_order(serve):
    """A call, then text after it: both forms list the call first (an audit found the whole response put the
    text first, the order of a chat message's fields rather than of the answer)."""
    client = serve(CALL + "\nDone.")
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    out = client.responses.create(model="tiny", input="Weather?", tools=tools, max_output_tokens=200)
    with client.responses.stream(model="tiny", input="Weather?", tools=tools, max_output_tokens=200) as stream:
        final = stream.get_final_response()
    assert [item.type for item in out.output] == [item.type for item in final.output] == ["function_call", "message"]
    assert out.output[1].content[0].text == final.output[1].content[0].text
    assert out.output[0].arguments == final.output[0].arguments


@pytest.mark.parametrize("strict", [True, False])
def test_tools_under_auto_beside_a_response_format_are_one_constraint(serve, strict):
    """The OpenAI Agents SDK's Agent(tools=..., output_type=...) sends strict tools, tool_choice auto and a
    json_schema response format together (an audit saw a 400): the worker gets one grammar, the format or the
    calls, and the call the model writes is read out as usual."""
    client = serve(CALL)
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": strict}}]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    choice = client.chat.completions.create(
        model="tiny", messages=ASK, tools=tools, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema, "strict": True}},
    ).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    constraint = client.server.workers[0].requests[0].sampling_params.structured_output
    assert constraint.kind == "grammar" and "answer_or_calls: answer | tool_calls" in constraint.value


def test_structured_outputs_under_auto_constrain_the_whole_text(serve):
    """vLLM's structured_outputs constrain the whole answer, calls included (as vLLM applies them): beside tools
    under auto the worker gets the request's own constraint, not 'the constraint or the calls' (CI saw a
    sampled call escape a regex that cannot spell one)."""
    client = serve(CALL)
    client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=20,
                                   extra_body={"structured_outputs": {"regex": "[a-z ]{5,20}"}})
    constraint = client.server.workers[0].requests[0].sampling_params.structured_output
    assert constraint.kind == "regex" and constraint.value == "[a-z ]{5,20}"
